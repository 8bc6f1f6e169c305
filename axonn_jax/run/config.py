"""YAML config files for the command line: `axonn-jax train --config FILE.yaml [--set key=value ...]`.

Every flag of a command is a config key of the same name (`--batch-size` is `batch_size`; dashes
and underscores are interchangeable). Values come, lowest priority first, from the flag defaults,
the file, `--set key=value` (the value read as YAML: `--set steps=10 dtype=bfloat16`), and flags
given on the command line. Unknown keys and values of the wrong type are refused with one line naming
the key. `effective_config` writes the values a run used back in the same form, so a run directory's
`config.yaml` can be given to `--config` again.
"""
from __future__ import annotations

import argparse
import difflib
import pathlib
from typing import Any

CONFIG_FLAGS = ("--config", "--set")
"""The flags that read configs; they are not config keys themselves."""


def add_config_args(p: argparse.ArgumentParser) -> None:
    """Add `--config FILE.yaml` and `--set key=value ...` to a command's parser."""
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read the options from this YAML file (keys named like the flags)")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE", help="override config keys, e.g. --set steps=10 lr=1e-3")


def _key(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _flags(parser: argparse.ArgumentParser):
    """`(keys, action)` of every flag of `parser` that a config may set: the keys of its long
    names, the first one (the flag's own name) first."""
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and not isinstance(action, argparse._HelpAction) and longs[0] not in CONFIG_FLAGS:
            yield [_key(option) for option in longs], action


def config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """`{key: action}` for every flag of `parser` that a config may set (each long name and alias)."""
    return {key: action for keys, action in _flags(parser) for key in keys}


def _is_switch(action: argparse.Action) -> bool:
    """A flag without a value (`store_true` / `store_false`)."""
    return action.nargs == 0 and isinstance(action.const, bool)


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


def check_value(key: str, action: argparse.Action, value) -> Any:
    """`value` for the flag of `action` as the parsed namespace holds it (a switch's bool is
    inverted for `store_false`); raises ValueError naming `key` when it does not fit."""
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ValueError(f"config key {key!r} must be true or false, got {value!r}")
        return value if action.const else not value
    if value is None and action.default is None:
        return None
    if action.nargs == "?" and isinstance(action.const, bool) and isinstance(value, bool):
        return value  # a flag with an optional value (`--resume [RUN_DIR]`)
    if action.type in (int, float):
        value = _number(key, value, action.type)
    elif not isinstance(value, str):
        raise ValueError(f"config key {key!r} must be a string, got {value!r} "
                         f"({type(value).__name__}; in YAML, quote it)")
    elif action.type is not None:
        try:
            value = action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"config key {key!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"config key {key!r} must be one of {sorted(action.choices)}, "
                         f"got {value!r}")
    return value


def read_file(path: str | pathlib.Path) -> dict:
    """The mapping in a YAML config file (one-line errors for a missing file or bad YAML)."""
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


class Text(str):
    """A `--set` value as typed: read as YAML for switches and numbers, kept as text for string
    flags (YAML 1.1 would turn `--set profile_steps=2:3` into the integer 123)."""


def parse_overrides(items: list[str]) -> dict:
    """`["key=value", ...]` as `{key: Text(value)}`."""
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes key=value, got {item!r}")
        values[key] = Text(text)
    return values


def _typed(action: argparse.Action, value):
    """A `--set` value as the flag of `action` reads it (see `Text`)."""
    import yaml

    if not isinstance(value, Text):
        return value
    if value in ("", "null", "~", "None") and action.default is None:
        return None
    if _is_switch(action) or action.type in (int, float) or action.nargs == "?":
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return str(value)
        return parsed if isinstance(parsed, (bool, int, float)) else str(value)
    return str(value)


def defaults_from(parser: argparse.ArgumentParser, values: dict) -> dict:
    """Checked `{dest: value}` for the config `values` of `parser`'s command."""
    actions = config_actions(parser)
    out = {}
    for key, value in values.items():
        name = _key(str(key))
        if name not in actions:
            close = difflib.get_close_matches(name, actions, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        action = actions[name]
        out[action.dest] = check_value(name, action, _typed(action, value))
    return out


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)` with the `--config` file and `--set` overrides of the chosen
    command as its defaults (flags on the command line still win). Raises ValueError or
    FileNotFoundError (one line) for a bad config."""
    subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
                      None)
    command = subparsers.choices.get(argv[0]) if subparsers and argv else None
    if command is None or "--config" not in command._option_string_actions:
        return parser.parse_args(argv)
    pre = argparse.ArgumentParser(add_help=False)
    add_config_args(pre)
    known, _ = pre.parse_known_args(argv[1:])
    values = read_file(known.config) if known.config else {}
    values.update(parse_overrides(known.overrides))
    defaults = defaults_from(command, values)
    for action in command._actions:
        if action.dest in defaults:
            action.required = False  # given by the config
    command.set_defaults(**defaults)
    return parser.parse_args(argv)


def effective_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     exclude: tuple[str, ...] = ()) -> dict:
    """`{key: value}` of every flag of the command `parser` as `args` holds it (first long name of
    each flag, in the parser's order), minus the keys in `exclude`: a config that `--config` reads
    back to the same arguments."""
    values = {}
    for keys, action in _flags(parser):
        if keys[0] not in exclude:
            value = getattr(args, action.dest)
            values[keys[0]] = (value if action.const else not value) if _is_switch(action) else value
    return values


def write(path: str | pathlib.Path, values: dict) -> pathlib.Path:
    """Write `values` as YAML (keys in their order) to `path`."""
    import yaml

    path = pathlib.Path(path)
    path.write_text(yaml.safe_dump(values, sort_keys=False, default_flow_style=False))
    return path
