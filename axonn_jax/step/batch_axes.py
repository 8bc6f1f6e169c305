"""The batch axes the step loops over, and what the step itself sends over them.

`PLUGINS` lists every axis that splits the batch (`batch_axis.BatchAxis`), in mesh order: `data`,
`expert`, `context`. Each states its own split, layout, checks and collectives beside its code;
the step (`step.train_step`) and the engines (`step.engines`) ask this module which are manual
and how they split a batch, and never name an axis. Adding a batch axis is its record and one line
here.

What the step sends over them, as the communication model counts it (`collectives.Part`'s
convention, per device and step):

- each axis's own (`BatchAxis.collectives`: `context`'s gather of the batch for its layout);
- the gradient sums over the axes besides `data` (`_sum_over_unsplit`): one all-reduce per group
  of axes, over every parameter shard not split over all of them (an expert's weights, split
  over `expert`, are summed over `context` only); a block's with `data` in the same all-reduce
  where the step sums the layers in the backward (`summed_with_data`);
- the loss and the blocks' metrics averaged over those axes, and the metrics over `data` too (the
  reducer's mean; the loss's is `step.reducers.scalar_collectives`').
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

from ..batch_axis import DATA, BatchAxis
from ..collectives import FP32, Collective, ModelCommunication, StepShape
from ..parallel import context, experts

PLUGINS: tuple[BatchAxis, ...] = (DATA, experts.AXIS, context.AXIS)
"""Every axis that splits the batch, in mesh order (`config.AXES`)."""


def manual_axes(grid) -> tuple[str, ...]:
    """The batch axes the step's shard_map holds manual on `grid`, in mesh order.

    Args:
      grid: the run's `ParallelConfig`.

    Returns:
      `data` always (the gradient reduction is explicit over it), and each other batch axis where
      it splits something (its size above 1: its layers exchange tokens or keys over it).
    """
    return tuple(a.name for a in PLUGINS if a.manual(grid))


def extra_axes(grid) -> tuple[str, ...]:
    """The batch axes besides the reducer's that split something on `grid`, in mesh order.

    Args:
      grid: the run's `ParallelConfig`.

    Returns:
      The names of the manual axes whose gradients the step sums itself (`expert`, `context`).
    """
    return tuple(a.name for a in PLUGINS if not a.reducer_sums and a.manual(grid))


def layers_summed_in_backward(grid, *, microbatches: int, sixteen_bit_offload: bool,
                              compressed: bool, compressed_layers: bool) -> bool:
    """Whether the step sums the blocks' gradients over the batch axes inside the backward.

    Layer by layer, each layer's sum beside the backward of the layer below
    (`step.layer_exchange`).

    The one rule the engine (`SpmdEngine.layer_reduce`) and the communication model
    (`StepShape.layer_sums`) both follow.

    Args:
      grid: the run's `ParallelConfig`.
      microbatches: the step's microbatches: accumulated ones are summed after their loop.
      sixteen_bit_offload: 16-bit device parameters under an offloaded state: each layer's
        sum over `data` is then divided before its cast back (`ComputeFunctions.layer_mean`,
        no overflow), which is built for the exact exchange over `data` alone; with CGX or
        another batch axis they are summed after the backward, in float32.
      compressed: CGX's exchange runs in the step.
      compressed_layers: CGX's exchange offers per-layer stages (`compress_in_backward`), which
        run over `data` alone: with another batch axis the compressed sum is after the
        backward.

    Returns:
      True where the layers are summed in the backward (one microbatch; the rule of
      `SpmdEngine`, the engine of grids without a pipeline).
    """
    extra = extra_axes(grid)
    if microbatches > 1 or sixteen_bit_offload and (compressed or extra):
        return False
    return not compressed or (compressed_layers and not extra)


def _spec(rows: tuple[str, ...], seq: tuple[str, ...]) -> P:
    """Rows (dim 0) over `rows`, the sequence (dim 1) over `seq` where any axis splits it."""
    if not seq:
        return P(rows)
    return P(rows, seq[0] if len(seq) == 1 else seq)


def local_spec(manual) -> P:
    """How the manual batch axes split every batch leaf inside the step's shard_map.

    Args:
      manual: the manual axes' names.

    Returns:
      The rows (dim 0) over the manual axes that split rows, the sequence (dim 1) over those that
      split it.
    """
    rows = tuple(a.name for a in PLUGINS if a.dim == 0 and a.name in manual)
    return _spec(rows, tuple(a.name for a in PLUGINS if a.dim == 1 and a.name in manual))


def sequence_axes(grid) -> tuple[str, ...]:
    """The batch axes that split the sequence (dim 1) of every batch leaf on `grid`.

    Args:
      grid: the run's `ParallelConfig`.

    Returns:
      Their names, in mesh order (`context` when above 1).
    """
    return tuple(a.name for a in PLUGINS if a.dim == 1 and a.size(grid) > 1)


def global_spec(rows: tuple[str, ...], grid) -> P:
    """The PartitionSpec of every batch leaf over the whole mesh.

    Args:
      rows: the axes that split the rows (`config.BATCH_AXES`: the batch axes and `depth`).
      grid: the run's `ParallelConfig`.

    Returns:
      The rows over `rows`; the sequence (dim 1) over `sequence_axes`.
    """
    return _spec(rows, sequence_axes(grid))


def lay_out(batch, manual, grid):
    """Inside the step's shard_map: this device's share of `batch` in each manual axis's layout.

    Args:
      batch: the batch pytree as the shard_map hands it in (`local_spec`).
      manual: the manual axes' names.
      grid: the run's `ParallelConfig`.

    Returns:
      The batch after each manual axis's `layout`, in mesh order (unchanged where none has one).
    """
    for a in PLUGINS:
        if a.layout is not None and a.name in manual:
            batch = a.layout(batch, a.size(grid))
    return batch


def check_batch(batch, grid) -> None:
    """Check `batch` against every batch axis that splits something on `grid`.

    Args:
      batch: a batch pytree of arrays or ShapeDtypeStructs.
      grid: the run's `ParallelConfig`.

    Raises:
      ValueError: (one line) an axis's `check` refuses the batch.
    """
    for a in PLUGINS:
        if a.check is not None and a.size(grid) > 1:
            a.check(batch, a.size(grid))


def _unsplit_extras(shard, grid) -> tuple[str, ...]:
    """The extra batch axes `shard`'s parameter is not split over: its gradient's sum runs there."""
    split = {a for axes in shard.splits for a in axes}
    return tuple(a for a in extra_axes(grid) if a not in split)


def summed_with_data(shard, step: StepShape) -> bool:
    """Whether `shard`'s gradient is summed over `data` and its unsplit extra batch axes at once.

    A block's, layer by layer in the backward, where `step.layer_sums` says the step sums them
    there and an extra batch axis leaves the parameter whole (`ComputeFunctions.vary_layers`);
    the data exchange (`step.reducers.exchange_collectives`) then leaves it out.

    Args:
      shard: a `ParameterShard` one device holds.
      step: the train step's shape.

    Returns:
      True where one all-reduce over `data` and those axes sums it.
    """
    return step.layer_sums and not shard.outside_blocks and bool(_unsplit_extras(shard, step.grid))


def gradient_sums(shards, step: StepShape) -> list[Collective]:
    """The all-reduces of the gradient sums over the extra batch axes, one per group of axes.

    Each shard's gradient (the elements the exact exchange reduces) is summed over the extra
    batch axes its parameter is not split over (`_sum_over_unsplit`), together with `data` where
    the step sums it layer by layer (`summed_with_data`; with a bfloat16 wire in its packed
    all-to-all and all-gather).

    Args:
      shards: the `ParameterShard`s one device holds (`ModelCommunication.parameters`).
      step: the train step's shape (grid, parameter bytes, `layer_sums`).

    Returns:
      One `all-reduce` `Collective` per group of axes, sized with the elements of every shard
      summed over that group.
    """
    groups: dict[tuple[str, ...], float] = {}
    layered: dict[tuple[str, ...], float] = {}
    for s in shards:
        over, n = _unsplit_extras(s, step.grid), s.elements if s.exchanged is None else s.exchanged
        if over and summed_with_data(s, step):
            layered[(DATA.name, *over)] = layered.get((DATA.name, *over), 0.0) + n
        elif over:
            groups[over] = groups.get(over, 0.0) + n
    out = [Collective("all-reduce", axes, n * step.param_bytes) for axes, n in groups.items()]
    if step.reduce_dtype == "bfloat16":  # the packed exchange (`parallel.exchange`)
        return out + [Collective(kind, axes, n * step.packed_bytes) for axes, n in layered.items()
                      for kind in ("all-to-all", "all-gather")]
    return out + [Collective("all-reduce", axes, n * step.param_bytes)
                  for axes, n in layered.items()]


def batch_axes_collectives(declared: ModelCommunication, step: StepShape) -> list[Collective]:
    """Everything the step sends over the batch axes itself, and the metrics' mean.

    What the module docstring lists, and the metrics' mean over `data`.

    Args:
      declared: what the model declares about `step`.
      step: the train step's shape (grid, batch, sequence length, parameter bytes).

    Returns:
      The collectives per device and step: the metrics' all-reduce over `data` (if there are
      metrics), and with a batch axis besides `data` above 1 (`extra_axes`) the gradient sums,
      the loss's and the metrics' all-reduce over those axes, and each one's own collectives
      (`BatchAxis.collectives`: `context`'s gather of the batch).
    """
    g = step.grid
    extra = extra_axes(g)
    metrics = declared.metrics * FP32
    out = [Collective("all-reduce", (DATA.name,), metrics)] if metrics else []
    if not extra:
        return out
    out += gradient_sums(declared.parameters, step)
    out.append(Collective("all-reduce", extra, FP32 + metrics))
    for a in PLUGINS:
        if a.collectives is not None and a.name in extra:
            out += a.collectives(step, declared)
    return out
