"""The checks every option shares: a value from a fixed set, and problems gathered one line each.

Each component keeps its own set of allowed values beside its code (`compression.SCOPES`,
`pipeline.SCHEDULES`, ...); this module only words the refusal, so that every option says it the
same way: ``--schedule must be one of gpipe, 1f1b, got 'zigzag'``.
"""
from __future__ import annotations

from typing import Callable, Collection, TypeVar

T = TypeVar("T")

NOT_YET = "is not implemented yet"
"""How a refusal of a combination not built yet ends (callers raise NotImplementedError on it)."""


def check_choice(name: str, value: T, choices: Collection) -> T:
    """Return `value` when it is one of `choices`; raise a one-line ValueError otherwise.

    Args:
      name: what the value sets, as the user writes it (a flag such as ``--schedule``, a config
        key, or a field).
      value: the value given.
      choices: the allowed values, in the order the message lists them (a mapping's keys).

    Returns:
      `value`, unchanged.

    Raises:
      ValueError: ``{name} must be one of a, b, c, got {value!r}``.
    """
    if value not in choices:
        listed = ", ".join(map(str, choices))
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def collect(found: list[str], check: Callable, *args, **kwargs) -> None:
    """Run `check`; append its ValueError's or NotImplementedError's message to `found`.

    Args:
      found: the problems gathered so far, one line each; extended in place.
      check: a function that raises on a problem and returns otherwise.
      *args: its positional arguments.
      **kwargs: its keyword arguments.
    """
    try:
        check(*args, **kwargs)
    except (ValueError, NotImplementedError) as e:
        found.append(str(e))
