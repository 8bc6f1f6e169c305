"""The documentation site's sources (docs/, mkdocs.yml) hold together without building it (`make
docs` builds it strictly; `make test-all` runs that too): every nav entry is a page, every page is
in the nav, the API page documents every public name, the reference generator covers the config
tree, and the README stays a landing page."""
import importlib.util
import pathlib
import re
import textwrap

import yaml

import axonn_jax

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
GENERATED = {"reference/config.md", "reference/cli.md", "changelog.md"}  # made by docs/hooks.py


def docs_script(name: str):
    """The module of the script docs/<name>.py."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(entries) -> list[str]:
    found = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_nav_and_pages_agree():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(set(nav) - pages - GENERATED) == []
    assert sorted(pages - set(nav)) == []


def test_api_page_documents_every_public_name():
    api = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: axonn_jax\.(\w+)$", api, re.M))
    assert sorted(set(axonn_jax.__all__) - documented) == []


def test_reference_pages_list_every_field_and_command():
    from axonn_jax.run import options

    gen = docs_script("gen_reference")
    config_page, cli_page = gen.config_page(), gen.cli_page()
    for leaf in options.leaves():
        assert f"| `{leaf.path}` |" in config_page, leaf.path
    for command in ("train", "plan", "bench", "compile", "launch", "report"):
        assert f"## axonn-jax {command}" in cli_page


def test_pages_repeat_the_status_rows_as_status_md_has_them():
    """A page that repeats a row of docs/status.md holds it as status.md does (`python
    docs/status_rows.py` rewrites them), its links relative to the page."""
    rows = docs_script("status_rows")
    table = rows.status_rows()
    assert rows.synced("| x |\n" + table["data parallelism"], "axes/data.md").endswith(
        rows._relinked(table["data parallelism"], "axes/data.md"))
    stale = [page for page in rows.pages()
             if rows.synced((DOCS / page).read_text(), page, table) != (DOCS / page).read_text()]
    assert stale == []


def test_readme_is_a_landing_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]*|CHANGELOG\.md)\)", readme):
        assert (REPO / link).exists(), link


# The public modules whose docstrings follow docs/docstring_rule.py's rule: the whole package.
DOCUMENTED = ("axonn_jax",)


def test_docstring_rule_finds_what_it_names():
    rule = docs_script("docstring_rule")
    source = textwrap.dedent("""
        def good(x):
            \"\"\"Twice x.

            Args:
              x: a number.

            Returns:
              2x.
            \"\"\"
            return 2 * x

        def no_args(x):
            \"\"\"Twice x.

            Returns:
              2x.
            \"\"\"
            return 2 * x

        def long_summary():
            \"\"\"A summary
            over two lines.\"\"\"

        class Shape:
            \"\"\"A shape.\"\"\"

            def area(self):
                \"\"\"Its area.\"\"\"
                return 1

            @property
            def sides(self):
                \"\"\"How many sides.\"\"\"
                return 4

            def collectives(self, step):
                \"\"\"What it sends.\"\"\"
                return []
    """)
    found = rule.problems([("m.py", source)], protocols={"collectives"})
    assert found == ["m.py:13 no_args: no Args:", "m.py:21 long_summary: no one-line summary",
                     "m.py:28 Shape.area: no Returns:"]


def test_public_docstrings_have_a_summary_args_and_returns():
    rule = docs_script("docstring_rule")
    protocols = rule.protocol_methods(rule.sources([REPO / "axonn_jax"]))
    assert rule.problems(rule.sources([REPO / p for p in DOCUMENTED]), protocols) == []
