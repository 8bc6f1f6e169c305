"""The CLI and config reference pages, generated from the code (run by `docs/hooks.py` on every
`mkdocs build`; `python docs/gen_reference.py OUT_DIR` writes them to OUT_DIR to read them).

The config tree (`axonn_jax.run.options`: sections of fields, each with its default, help, flag and
aliases) gives `reference/config.md`; the CLI's parser (`axonn_jax.run.cli.build_parser`, which
makes every tree field a flag) gives `reference/cli.md`. Nothing on these pages is written by hand.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _import():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from axonn_jax.run import cli, options

    return cli, options


def _cell(text) -> str:
    """Text for a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").replace("%%", "%")


def _code(text) -> str:
    return f"`{text}`" if text not in ("", None) else ""


def _default(leaf) -> str:
    d = leaf.default
    if isinstance(d, dataclasses._MISSING_TYPE):  # noqa: SLF001 - a field without a default
        return ""
    if d in (None, ()):
        return "none"
    return _code(str(d).lower() if isinstance(d, bool) else d)


def _values(leaf) -> str:
    choices = leaf.choices()
    if choices is not None:
        return ", ".join(_code(c) for c in choices)
    kind = leaf.kind
    name = {bool: "true / false", int: "integer", float: "number", str: "text",
            tuple: "list"}.get(kind, getattr(kind, "__name__", str(kind)))
    return f"true / false / {name}" if leaf.switch_with_value else name


def config_page() -> str:
    """`reference/config.md`: every field of the config tree, section by section."""
    _, options = _import()
    doc = options.__doc__.split("\n\n")
    out = ["# Config reference", "",
           "Generated from `axonn_jax/run/options.py` by `docs/gen_reference.py`: do not edit by "
           "hand. Every field is a YAML key (by its path, `pipeline.schedule`, or by its flat key, "
           "`schedule`), a flag of `train`, `plan` and `compile` (and of `bench` for the model, "
           "grid, pipeline, precision and data sections), `--set KEY=VALUE`, and a keyword of "
           "`TrainOptions` (the flat name). See [the command line](../cli.md) for how the "
           "sources combine.", "",
           "```text", doc[0].strip(), "", textwrap.dedent(doc[1]).strip("\n"), "```", ""]
    leaves = options.leaves()
    for section, cls in options.SECTIONS.items():
        out += [f"## {section}", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out += [" ".join(cls.__doc__.split()), ""]
        out += ["| YAML path | flag | flat key | default | values | what it does |",
                "|---|---|---|---|---|---|"]
        for leaf in leaves:
            if leaf.path.split(".")[0] != section:
                continue
            flags = ", ".join(_code(f) for f in leaf.flags) if leaf.meta["cli"] else "(YAML only)"
            out.append("| " + " | ".join(_cell(c) for c in (
                _code(leaf.path), flags, _code(leaf.legacy), _default(leaf), _values(leaf),
                leaf.meta["help"])) + " |")
        out.append("")
    source = options.DataSource
    out += ["## data.sources entries", "", " ".join(source.__doc__.split()), "",
            "| field | default |", "|---|---|"]
    for f in dataclasses.fields(source):
        out.append(f"| `{f.name}` | {_default_field(f)} |")
    out.append("")
    return "\n".join(out)


def _default_field(f) -> str:
    if isinstance(f.default, dataclasses._MISSING_TYPE):  # noqa: SLF001
        return "(required)"
    return "none" if f.default is None else _code(f.default)


def _subparsers(parser):
    for action in parser._actions:  # noqa: SLF001 - argparse keeps no public list
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action
    raise RuntimeError("axonn-jax's parser has no subcommands")


def cli_page() -> str:
    """`reference/cli.md`: every subcommand with the options of its own (the tree's flags are on
    the config page) and its full `--help`."""
    cli, options = _import()
    tree = {leaf.path for leaf in options.leaves()}
    sub = _subparsers(cli.build_parser())
    helps = {a.dest: a.help for a in sub._choices_actions}  # noqa: SLF001
    out = ["# CLI reference", "",
           "Generated from `axonn_jax/run/cli.py`'s parser by `docs/gen_reference.py`: do not edit "
           "by hand. `train`, `plan` and `compile` take every flag of the "
           "[config tree](config.md) (`bench` those of its model, grid, pipeline, precision and "
           "data sections); the tables below list each command's own options.", "",
           "```text", synopsis(), "```", ""]
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        for name, parser in sub.choices.items():
            out += [f"## axonn-jax {name}", "", _cell(helps.get(name, "")), ""]
            own = [a for a in parser._actions  # noqa: SLF001
                   if a.dest not in tree and a.dest != "help" and not isinstance(a, argparse._HelpAction)]  # noqa: SLF001
            if own:
                out += ["| option | default | what it does |", "|---|---|---|"]
                for a in own:
                    names = ", ".join(a.option_strings) or a.dest
                    if a.metavar and a.option_strings:
                        names += f" {a.metavar}"
                    elif a.choices and a.option_strings:
                        names += " {" + ",".join(map(str, a.choices)) + "}"
                    default = a.default
                    shown = "" if default in (None, argparse.SUPPRESS, False, [], ()) else _code(default)
                    out.append(f"| {_code(names)} | {shown} | {_cell(a.help or '')} |")
                out.append("")
            out += ["??? note \"`axonn-jax " + name + " --help`\"", "", "    ```text"]
            out += ["    " + line if line else "" for line in parser.format_help().rstrip().splitlines()]
            out += ["    ```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)


def _own_actions(parser, tree):
    return [a for a in parser._actions  # noqa: SLF001
            if a.dest not in tree and not isinstance(a, argparse._HelpAction)]  # noqa: SLF001


def _usage(a) -> str:
    if not a.option_strings:
        return f"{a.metavar or a.dest} [...]" if a.nargs in ("+", "*") else (a.metavar or a.dest)
    flag = a.option_strings[0]
    if a.nargs == 0:
        text = flag
    elif a.choices:
        text = f"{flag} {'|'.join(map(str, a.choices))}"
    else:
        text = f"{flag} {a.metavar or a.dest.upper()}"
    return text if a.required else f"[{text}]"


def _leaf_usage(leaf) -> str:
    flag = "/".join(leaf.flags)
    if leaf.kind is bool:
        return flag
    if leaf.switch_with_value:
        return f"{flag} [{leaf.meta['metavar'] or 'TEXT'}]"
    choices = leaf.choices()
    if choices is not None and leaf.path != "model.name":
        return f"{flag} {'|'.join(map(str, choices))}"
    names = {int: "N", float: "X", str: "TEXT", tuple: "PATH"}
    return f"{flag} {leaf.meta['metavar'] or names.get(leaf.kind, 'VALUE')}"


def synopsis() -> str:
    """Every command's synopsis, and the tree's flags section by section (a text block)."""
    cli, options = _import()
    tree = {leaf.path for leaf in options.leaves()}
    sub = _subparsers(cli.build_parser())
    lines = []
    for name, parser in sub.choices.items():
        own = [_usage(a) for a in _own_actions(parser, tree) if a.nargs != argparse.REMAINDER]
        takes_tree = any(a.dest in tree for a in parser._actions)  # noqa: SLF001
        words = ["[TREE FLAGS]"] * takes_tree + own + (["-- train ... | SCRIPT.py ..."] if name == "launch" else [])
        line, out = f"axonn-jax {name:<8}", []
        for w in words:
            if len(line) + len(w) + 1 > 100:
                out.append(line)
                line = " " * 18
            line += " " + w
        lines += out + [line]
    lines += ["", "TREE FLAGS (the config tree's fields; `bench` takes those of model, grid, "
              "pipeline, precision, data):"]
    for section in options.SECTIONS:
        words = [_leaf_usage(leaf) for leaf in options.leaves()
                 if leaf.path.split(".")[0] == section and leaf.meta["cli"]]
        line, out, first = f"  {section:<12}", [], True
        for w in words:
            if len(line) + len(w) + 2 > 100:
                out.append(line)
                line, first = " " * 14, True
            line += ("" if first else "  ") + w
            first = False
        lines += out + [line]
    return "\n".join(lines)


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page}


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "build/reference")
    for uri, make in PAGES.items():
        path = target / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
        print(f"wrote {path}")
