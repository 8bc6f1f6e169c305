"""What a mesh axis that splits the batch tells the train step: one record per axis.

`data`, `expert` and `context` each split the batch: which dimension of every leaf, how a device
lays out its share, which batches it refuses, and what it sends besides its layers' own
collectives. Each axis states that once, beside its code (`DATA` here, `parallel.experts.AXIS`,
`parallel.context.AXIS`); the step's registry (`step.batch_axes.PLUGINS`) lists them in mesh
order, and the step, the engines and the communication model loop over it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .config import Axis
from .collectives import Collective, ModelCommunication, StepShape


@dataclasses.dataclass(frozen=True)
class BatchAxis:
    """A mesh axis that splits the batch.

    Attributes:
      name: the mesh axis (`config.AXES`).
      dim: the dimension of every batch leaf it splits: 0 the rows, 1 the sequence.
      reducer_sums: the gradient reducer sums the gradients over it (`data`), so the step holds
        it manual at any size; the step itself sums the gradients over the other axes where their
        parameter is not split (`step.batch_axes.gradient_sums`), only where the axis is above 1.
      layout: inside the step's shard_map, `(batch, size) -> batch`: this device's share in the
        axis's own layout (None: the contiguous share the sharding gives).
      check: `(batch, size) -> None`, raising a one-line ValueError on a batch the axis cannot
        split beyond what `config.check_grid` checks (None: nothing more).
      collectives: `(step, declared) -> [Collective]`, what `layout` sends per device and step
        (None: nothing).
      splits: `(model config, seq_len) -> bool`, whether the axis can split anything of that
        model (the planner searches it only then; None: any model).
    """

    name: str
    dim: int = 0
    reducer_sums: bool = False
    layout: Callable[[Any, int], Any] | None = None
    check: Callable[[Any, int], None] | None = None
    collectives: Callable[[StepShape, ModelCommunication], list[Collective]] | None = None
    splits: Callable[[Any, int], bool] | None = None

    def size(self, grid) -> int:
        """Devices on this axis in `grid`.

        Args:
          grid: a `ParallelConfig`.

        Returns:
          The axis's size.
        """
        return getattr(grid, self.name)

    def manual(self, grid) -> bool:
        """Whether the step's shard_map holds this axis manual on `grid`.

        Args:
          grid: a `ParallelConfig`.

        Returns:
          True for the reducer's axis, and for another where it splits something (size > 1).
        """
        return self.reducer_sums or self.size(grid) > 1

    def splits_model(self, model, seq_len: int) -> bool:
        """Whether this axis can split anything of `model` at `seq_len`.

        Args:
          model: a model config (`GPTConfig`, `MixtralConfig`, ...).
          seq_len: the positions of a sequence.

        Returns:
          `splits(model, seq_len)`, or True where the axis states no condition.
        """
        return self.splits is None or self.splits(model, seq_len)


DATA = BatchAxis(Axis.DATA, dim=0, reducer_sums=True)
"""Data parallelism: the rows over replicas of the model; the reducer sums the gradients."""
