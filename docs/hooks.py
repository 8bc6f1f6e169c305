"""mkdocs hooks (`hooks:` in mkdocs.yml): pages made from the repository at build time.

- `reference/config.md` and `reference/cli.md`: generated from the config tree and the CLI's
  parser by `docs/gen_reference.py`;
- `results/*.md` (and the figures beside them): the measurement write-ups of `benchmarks/results/`,
  so the pages link to them where they live in the repository;
- `changelog.md`: the repository's `CHANGELOG.md`;
- in hand-written pages, where they hold the marker: the index of the results pages
  (`RESULTS_INDEX`, docs/results.md) and every command's synopsis (`SYNOPSIS`, docs/cli.md);
- in every page that repeats a row of the status table, that row as docs/status.md has it
  (`docs/status_rows.py`).
"""
from __future__ import annotations

import importlib.util
import pathlib

from mkdocs.structure.files import File, InclusionLevel

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RESULT_SUFFIXES = (".md", ".png", ".json")
RESULTS_INDEX = "<!-- results index: generated from benchmarks/results/*.md by docs/hooks.py -->"
SYNOPSIS = "<!-- synopsis: generated from the parser by docs/gen_reference.py (docs/hooks.py) -->"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generator():
    return _load("gen_reference")


def results_index() -> str:
    """A table of every `benchmarks/results/*.md`: its link and its title (first line)."""
    rows = ["| page | what it measures |", "|---|---|"]
    for path in sorted(RESULTS.glob("*.md")):
        title = path.read_text().splitlines()[0].lstrip("#").strip().replace("|", "/")
        rows.append(f"| [`{path.name}`](results/{path.name}) | {title} |")
    return "\n".join(rows)


def on_files(files, config):
    for uri, make in _generator().PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in RESULT_SUFFIXES:
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path),
                                        inclusion=InclusionLevel.NOT_IN_NAV))
    files.append(File.generated(config, "changelog.md", abs_src_path=str(ROOT / "CHANGELOG.md")))
    return files


def on_page_markdown(markdown, page, config, files):
    """Generated text where a page asks for it (`RESULTS_INDEX`, `SYNOPSIS`); CHANGELOG.md's links
    as the site lays the files out. The results pages print pytree paths (`['blocks']['bias']`)
    outside code spans, which mkdocs-autorefs would read as cross-references: escape them there."""
    if page.file.src_uri == "changelog.md":  # its links are written from the repository's root
        markdown = (markdown.replace("](benchmarks/results/)", "](results.md)")
                    .replace("](benchmarks/results/", "](results/").replace("](docs/", "]("))
    markdown = _load("status_rows").synced(markdown, page.file.src_uri)
    if RESULTS_INDEX in markdown:
        markdown = markdown.replace(RESULTS_INDEX, results_index())
    if SYNOPSIS in markdown:
        markdown = markdown.replace(SYNOPSIS, "```text\n" + _generator().synopsis() + "\n```")
    if not page.file.src_uri.startswith("results/"):
        return markdown
    parts = markdown.split("`")
    parts[::2] = [p.replace("][", "]\\[") for p in parts[::2]]
    return "`".join(parts)
