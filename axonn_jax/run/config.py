"""The config tree (`run.options`) on the command line and in YAML files.

    axonn-jax train --config FILE.yaml [--set key=value ...] [--flag value ...]

Every field of the tree is a flag (`--batch-size`, `--pipe`; see `run.options.option`) and a key.
A key names a field by its path (`pipeline.schedule`) or its flag (`schedule`, `data_parallel`,
`dp`); a YAML file may nest sections (`pipeline: {schedule: zb-h1}`) or list flat keys (`model:
gpt-mini` is `model.name`, `data: PATH` is `data.path`). Values come, lowest priority first, from
the tree's defaults, the file, `--set key=value` (read as YAML: `--set steps=10 dtype=bfloat16`),
and flags on the command line. Unknown keys and values of the wrong type are refused with one line
naming the key. `effective_config` writes a config back as nested YAML, which `--config` reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
from typing import Any

from ..checks import check_choice
from .options import SECTIONS, Leaf, RunConfig, build, leaves


def add_config_args(p: argparse.ArgumentParser) -> None:
    """Add `--config FILE.yaml` and `--set key=value ...` to a command's parser.

    Args:
      p: the command's parser (`--config` parses into `config_file`, `--set` into `overrides`).
    """
    p.add_argument("--config", dest="config_file", default=None, metavar="FILE.yaml",
                   help="read the options from this YAML file (see configs/README.md)")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE", help="override config keys, e.g. --set steps=10 "
                                             "pipeline.schedule=zb-h1")


def add_tree_args(p: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """Add one flag per field of the tree's `sections` to a parser, in a group per section.

    Flags not given stay out of the parsed namespace (their values come from the config file or
    the defaults); each parses into the field's path (`pipeline.schedule`).

    Args:
      p: the command's parser.
      sections: the sections whose fields get flags (default: all, `run.options.SECTIONS`).
    """
    for section in sections:
        group = p.add_argument_group(section)
        for leaf in leaves():
            if leaf.path.split(".")[0] == section:
                _add(group, leaf)


def _add(group, leaf: Leaf) -> None:
    meta = leaf.meta
    kw: dict[str, Any] = dict(dest=leaf.path, default=argparse.SUPPRESS,
                              help=meta["help"] + _default_text(leaf))
    if leaf.kind is bool:
        kw["action"] = "store_false" if meta["switch_off"] else "store_true"
    elif leaf.kind is tuple:  # a list: the flag repeated
        kw.update(action="append", metavar=meta["metavar"])
    elif leaf.switch_with_value:  # `--resume`, or `--resume RUN_DIR`
        kw.update(nargs="?", const=True, metavar=meta["metavar"])
    else:
        names = {int: "N", float: "X", str: "TEXT"}
        kw.update(type=_typed_flag(leaf), metavar=meta["metavar"] or names.get(leaf.kind))
        choices = leaf.choices()
        if choices is not None:
            kw["choices"] = list(choices)
    group.add_argument(*leaf.flags, **kw)


def _default_text(leaf: Leaf) -> str:
    if isinstance(leaf.default, bool) or leaf.default in (None, ()):
        return ""
    return f" (default: {leaf.default})"


def _typed_flag(leaf: Leaf):
    """The argparse `type` of a flag: its kind, `none` for an optional value."""
    kind = leaf.kind

    def convert(text: str):
        if leaf.optional and text.lower() in ("none", "null"):
            return None
        return kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in its error messages
    return convert


def _number(key: str, value, kind: type):
    name = "an integer" if kind is int else "a number"
    if isinstance(value, str):  # `--set` values, and YAML 1.1 reads `3e-3` as a string
        try:
            value = kind(value)
        except ValueError:
            raise ValueError(f"config key {key!r} must be {name}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)):
        raise ValueError(f"config key {key!r} must be {name}, got {value!r} "
                         f"({type(value).__name__})")
    return kind(value)


class Text(str):
    """A `--set` value as typed: read as YAML for switches and numbers, kept as text for strings.

    String fields keep the text: YAML 1.1 would turn `--set profile_steps=2:3` into the integer
    123.
    """


def value_of(key: str, leaf: Leaf, value) -> Any:
    """`value` for the field `leaf`, checked and typed.

    A switch-off flag's key (`no_error_feedback`) takes the flag's sense.

    Args:
      key: the key it was given under (a path, a flag's key or an alias), for errors.
      leaf: the field.
      value: the value as written (YAML's, or a `Text` of `--set`).

    Returns:
      The typed value (a tuple for a list field; None where the field allows it).

    Raises:
      ValueError: (naming the key) a value of the wrong type or not among the field's choices.
    """
    import yaml

    if leaf.kind is tuple:
        return _list_value(key, value)
    if isinstance(value, Text):
        if value in ("", "null", "~", "None", "none") and leaf.optional:
            return None
        if leaf.kind in (bool, int, float) or leaf.switch_with_value:
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = str(value)
            value = parsed if isinstance(parsed, (bool, int, float)) else str(value)
        else:
            value = str(value)
    if value is None and leaf.optional:
        return None
    inverted = leaf.meta["switch_off"] and key == leaf.key
    if leaf.switch_with_value and isinstance(value, bool):
        return value
    if leaf.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {key!r} must be true or false, got {value!r}")
        return not value if inverted else value
    if leaf.kind in (int, float):
        value = _number(key, value, leaf.kind)
    elif not isinstance(value, str):
        raise ValueError(f"config key {key!r} must be a string, got {value!r} "
                         f"({type(value).__name__}; in YAML, quote it)")
    choices = leaf.choices()
    return value if choices is None else check_choice(f"config key {key!r}", value, choices)


def _list_value(key: str, value) -> tuple:
    """A list field's value: a YAML list, one item, or `--set` text (YAML: `[a.jsonl, b.parquet]`);
    the field's dataclass types the items."""
    import yaml

    if isinstance(value, Text):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"config key {key!r}: cannot parse {str(value)!r} as YAML") from None
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _index() -> dict[str, Leaf]:
    """Every key that names a field: paths, flag keys, aliases."""
    index: dict[str, Leaf] = {}
    for leaf in leaves():
        index[leaf.path] = leaf
        for flag in leaf.flags:
            index[flag.lstrip("-").replace("-", "_")] = leaf
    return index


# Flat keys of old config files that name a section's main field when their value is not a mapping.
_SECTION_VALUES = {"model": "model.name", "data": "data.path"}


def flatten(values: dict, where: str = "") -> dict[str, tuple[str, Any]]:
    """The fields a config mapping sets, by path.

    Args:
      values: a config mapping (nested sections or flat keys).
      where: the section `values` is of (empty: the top level).

    Returns:
      `{path: (key as written, value)}`.

    Raises:
      ValueError: (one line) an unknown key, with the closest known one.
    """
    index, out = _index(), {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        full = f"{where}.{key}" if where else key
        if not where and key in SECTIONS and isinstance(value, dict):
            out.update(flatten(value, key))
            continue
        if not where and key in _SECTION_VALUES and not isinstance(value, dict):
            out[_SECTION_VALUES[key]] = (key, value)
            continue
        leaf = index.get(full)
        if leaf is None:
            close = difflib.get_close_matches(full, index, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {raw_key if not where else full!r}{hint}")
        out[leaf.path] = (full, value)
    return out


def read_file(path: str | pathlib.Path) -> dict:
    """The mapping in a YAML config file.

    Args:
      path: the YAML file.

    Returns:
      Its mapping (empty for an empty file).

    Raises:
      FileNotFoundError: (one line) the file does not exist.
      ValueError: (one line) bad YAML, or not a mapping.
    """
    import yaml

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ValueError(f"cannot parse {where}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got "
                         f"{type(values).__name__}")
    return values


def parse_overrides(items: list[str]) -> dict:
    """`["key=value", ...]` as `{key: Text(value)}`.

    Args:
      items: `--set`'s values.

    Returns:
      `{key: Text(value)}`.

    Raises:
      ValueError: an item without `=` or without a key.
    """
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes key=value, got {item!r}")
        values[key] = Text(text)
    return values


def typed(values: dict) -> dict[str, Any]:
    """`{path: typed value}` of a config mapping (see `flatten`, `value_of`).

    Args:
      values: a config mapping.

    Returns:
      `{path: typed value}`.
    """
    index = {leaf.path: leaf for leaf in leaves()}
    return {path: value_of(key, index[path], value) for path, (key, value) in
            flatten(values).items()}


def load(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The config of a parsed command line.

    Values come, lowest priority first, from `base`, the file of `--config`, `--set`, then the
    flags given (argparse leaves flags not given out of `args`).

    Args:
      args: the parsed arguments.
      base: the config to start from (default: the tree's defaults).

    Returns:
      The `RunConfig`; the paths set by the file, `--set` and the flags are added to its
      `given`.
    """
    values: dict[str, Any] = {}
    if getattr(args, "config_file", None):
        values.update(typed(read_file(args.config_file)))
    values.update(typed(parse_overrides(getattr(args, "overrides", []))))
    values.update({leaf.path: getattr(args, leaf.path) for leaf in leaves()
                   if hasattr(args, leaf.path)})
    return build(values, base=base, given=frozenset(values))


def load_file(path: str | pathlib.Path) -> RunConfig:
    """The config of a YAML file (e.g. a run directory's `config.yaml`) over the defaults.

    Args:
      path: the YAML file.

    Returns:
      The `RunConfig`.
    """
    return build(typed(read_file(path)))


def effective_config(config: RunConfig, exclude: tuple[str, ...] = ()) -> dict:
    """Every field of `config` as nested YAML values: what `--config` reads back to it.

    Args:
      config: the config.
      exclude: paths to leave out.

    Returns:
      `{section: {field: value}}`, sections in the tree's order (lists for tuples; a section
      left out when all its fields are excluded).
    """
    out: dict[str, dict] = {}
    for name in SECTIONS:
        section = dataclasses.asdict(getattr(config, name))
        kept = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()
                if f"{name}.{k}" not in exclude}
        if kept:
            out[name] = kept
    return out


def write(path: str | pathlib.Path, values: dict) -> pathlib.Path:
    """Write `values` as YAML (keys in their order) to `path`.

    Args:
      path: the file.
      values: a mapping of YAML values (e.g. `effective_config`'s).

    Returns:
      The path written.
    """
    import yaml

    path = pathlib.Path(path)
    path.write_text(yaml.safe_dump(values, sort_keys=False, default_flow_style=False))
    return path
