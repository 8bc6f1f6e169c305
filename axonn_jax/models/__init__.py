"""The built-in models, as presets the command line names (`--model`): each builds a `StackedModel`
and says what data it trains on and how its dimensions must divide over a grid."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..config import ParallelConfig
from ..step.model import StackedModel


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named model: `build(dtype) -> StackedModel`; `data`: the batches it trains on (`tokens`:
    language-model batches `{'inputs', 'targets'}` of `(batch, seq_len)` int32); `config`: its
    shape (with `check_grid(grid)` and, for language models, `max_seq_len`, `vocab_size`)."""

    name: str
    config: Any
    build: Callable[[Any], StackedModel]
    data: str = "tokens"

    def check_grid(self, grid: ParallelConfig) -> None:
        self.config.check_grid(grid)


def presets() -> dict[str, Preset]:
    """Every built-in model by name."""
    from . import gpt

    return {name: Preset(name, config, lambda dtype, c=config: gpt.stacked(c, dtype))
            for name, config in gpt.PRESETS.items()}


def get(name: str) -> Preset:
    """The built-in model `name`; a clear error naming the presets otherwise."""
    found = presets()
    if name not in found:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(found)}")
    return found[name]
