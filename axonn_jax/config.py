"""The parallel grid: how many devices split each of its axes (`AXES`)."""
from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
"""The pipeline timetables (`axonn_jax.parallel.pipeline`), named as `--schedule` takes them."""


class Axis:
    """The mesh axes' names: code names an axis as `Axis.ROW`, never by its string."""

    DATA = "data"
    PIPE = "pipe"
    EXPERT = "expert"
    CONTEXT = "context"
    DEPTH = "depth"
    ROW = "row"
    COL = "col"


AXES: tuple[str, ...] = (Axis.DATA, Axis.PIPE, Axis.EXPERT, Axis.CONTEXT, Axis.DEPTH, Axis.ROW,
                         Axis.COL)
"""Mesh axis names, outermost (slowest-changing device id, across hosts) first."""

TENSOR_AXES: tuple[str, ...] = (Axis.DEPTH, Axis.ROW, Axis.COL)
"""The tensor-parallel axes: `depth` (3D's weight and batch split), `row` and `col` (2D)."""

BATCH_AXES: tuple[str, ...] = (Axis.DATA, Axis.EXPERT, Axis.DEPTH)
"""Axes the batch's rows are split over: `data` replicates the model, `expert` splits the experts
of mixture-of-experts layers (the rest of the model is data-parallel over it), `depth` splits
weights and batch. `context` splits each row's sequence instead (`SEQUENCE_AXIS`)."""

SEQUENCE_AXIS = Axis.CONTEXT
"""The axis that splits the sequence (dim 1 of every batch leaf) in load-balanced chunks."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the `data × pipe × expert × context × depth × row × col` grid.

    data:  batch split, gradients all-reduced (optionally compressed).
    pipe:  the stack of layers split into stages.
    expert: the experts of mixture-of-experts layers split; tokens exchanged with all-to-all; the
           batch split too (the other layers are data-parallel over it).
    context: each sequence split in load-balanced chunks (ring or all-gather attention).
    depth: weights of every tensor-parallel layer split further (ZeRO-3 inside the TP group) and the
           batch too.
    row, col: each dense layer's output / input features (AxoNN's 2D tensor parallelism).

    (Positional arguments keep their order of earlier releases: data, pipe, depth, row, col; the
    mesh's order is `AXES`.)
    """

    data: int = 1
    pipe: int = 1
    depth: int = 1
    row: int = 1
    col: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self):
        for name in AXES:
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {size!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in mesh order (`AXES`: data, pipe, expert, context, depth, row, col)."""
        return tuple(getattr(self, name) for name in AXES)

    @property
    def num_devices(self) -> int:
        """Devices of the whole grid: the product of its axis sizes."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def tensor_parallel_size(self) -> int:
        """Devices in one tensor-parallel group (`depth · row · col`)."""
        return self.depth * self.row * self.col

    @property
    def batch_shards(self) -> int:
        """Devices that hold different examples or tokens (`data · expert · context`)."""
        return self.data * self.expert * self.context

    def as_dict(self) -> dict[str, int]:
        """The grid as `{axis: size}` for every axis of `AXES`, in mesh order.

        Returns:
          A new dict of the seven sizes.
        """
        return {name: getattr(self, name) for name in AXES}

    def validate(self, num_devices: int) -> None:
        """Raise ValueError unless the grid uses exactly `num_devices` devices.

        Args:
          num_devices: the devices available.

        Raises:
          ValueError: the axis sizes do not multiply to `num_devices`.
        """
        if self.num_devices != num_devices:
            grid = " × ".join(f"{n}={getattr(self, n)}" for n in AXES)
            raise ValueError(
                f"the grid {grid} has {self.num_devices} devices but {num_devices} are available; "
                f"the five sizes must multiply to the device count"
            )

    @classmethod
    def parse(cls, text: str) -> "ParallelConfig":
        """Parse a grid of `NAME=INT` entries: `'data=2,row=4'` -> `ParallelConfig(data=2, row=4)`.

        Args:
          text: comma-separated `NAME=INT` entries, NAME in `AXES`; absent axes are 1.

        Returns:
          The `ParallelConfig`.

        Raises:
          ValueError: an entry is not `NAME=INT` with NAME in `AXES`, or a size is not positive.
        """
        sizes = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, _, value = item.partition("=")
            if name not in AXES or not value.strip().isdigit():
                raise ValueError(f"bad grid entry {item!r}: expected NAME=INT with NAME in {AXES}")
            sizes[name] = int(value)
        return cls(**sizes)


def devices_inside(sizes, axis: str) -> int:
    """How many consecutive devices one step along mesh axis `axis` spans.

    The product of the sizes of the axes after it in `AXES` order (they change fastest across
    device ids).

    Args:
      sizes: `{axis: size}` (a mesh's shape or `ParallelConfig.as_dict()`); absent axes are 1.
      axis: one of `AXES`.

    Returns:
      The stride of `axis` in devices.
    """
    return math.prod(sizes.get(a, 1) for a in AXES[AXES.index(axis) + 1:])


def check_divisible(what: str, size: int, axes: str | tuple[str, ...], config: ParallelConfig) -> None:
    """Raise ValueError naming the numbers unless `size` divides evenly over the product of `axes`.

    Args:
      what: the quantity's name in the message (`batch size`, `--batch-size`, ...).
      size: the quantity.
      axes: a mesh axis or several.
      config: the grid.

    Raises:
      ValueError: `size` is not divisible by the product of `axes`' sizes.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    parts = 1
    for axis in axes:
        parts *= getattr(config, axis)
    if size % parts:
        split = " × ".join(f"{a}={getattr(config, a)}" for a in axes)
        raise ValueError(f"{what} = {size} is not divisible by {split} (= {parts})")


def check_grid(config: ParallelConfig, *, batch_size: int, microbatches: int = 1,
               flags: bool = False) -> None:
    """Raise ValueError naming the numbers unless the grid can split a step.

    The batch over `data`, `expert` and `depth`, each data shard into `microbatches` (a
    pipeline's, or gradient accumulation's). The trainer and the planner (`analysis.comm_model`)
    both check grids with this; the layers over pipeline stages are the pipeline's check
    (`parallel.pipeline.check_layers`).

    Args:
      config: the grid.
      batch_size: the global batch's rows.
      microbatches: microbatches per data shard.
      flags: name the quantities as `axonn-jax train` flags (`--batch-size`) in the messages.

    Raises:
      ValueError: `microbatches` is not positive, or a dimension does not divide.
    """
    batch, mb = ("--batch-size", "--microbatches") if flags else ("batch size", "microbatches")
    if microbatches < 1:
        raise ValueError(f"{mb} must be positive, got {microbatches}")
    check_divisible(batch, batch_size, BATCH_AXES, config)
    # Each microbatch of a data shard is split over `expert` and `depth` again.
    rows = config.data * config.expert * config.depth
    if microbatches > 1 and batch_size % (rows * microbatches):
        more = "".join(f" × {a} = {getattr(config, a)}" for a in ("expert", "depth")
                       if getattr(config, a) > 1)
        raise ValueError(f"{batch} = {batch_size} is not divisible by data × microbatches = "
                         f"{config.data} × {microbatches}{more}")
