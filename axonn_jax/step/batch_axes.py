"""What the train step itself sends over the batch axes that split something besides `data`
(`expert`, `context`; `step.train_step`), as the communication model counts it
(`collectives.Part`'s convention, per device and step):

- the load-balanced layout of the batch over `context` (`TrainStep._balanced`): every batch leaf
  gathered over `context` before each device takes its two chunks;
- the gradient sums over the batch axes that do not split a parameter (`_sum_over_unsplit`): one
  all-reduce per group of axes, over every parameter shard not split over all of them (an
  expert's weights, split over `expert`, are summed over `context` only);
- the loss and the blocks' metrics averaged over those axes, and the metrics over `data` too (the
  reducer's mean; the loss's is `step.reducers.scalar_collectives`').
"""
from __future__ import annotations

from ..collectives import FP32, Collective, ModelCommunication, StepShape

EXTRA_AXES = ("expert", "context")


def extra_axes(grid) -> tuple[str, ...]:
    """The batch axes besides `data` that split something on `grid`, in mesh order.

    Args:
      grid: the run's `ParallelConfig`.

    Returns:
      The names of `EXTRA_AXES` (`expert`, `context`) whose size on `grid` is above 1.
    """
    return tuple(a for a in EXTRA_AXES if getattr(grid, a) > 1)


def gradient_sums(shards, grid, param_bytes: int) -> list[Collective]:
    """The all-reduces of `_sum_over_unsplit`, one per group of extra batch axes.

    Each shard's gradient (the elements the exact exchange reduces) is summed over the extra
    batch axes its parameter is not split over.

    Args:
      shards: the `ParameterShard`s one device holds (`ModelCommunication.parameters`).
      grid: the run's `ParallelConfig`.
      param_bytes: the bytes of one parameter element.

    Returns:
      One `all-reduce` `Collective` per group of axes, sized with the elements of every shard
      summed over that group.
    """
    extra = extra_axes(grid)
    groups: dict[tuple[str, ...], float] = {}
    for s in shards:
        split = {a for axes in s.splits for a in axes}
        over = tuple(a for a in extra if a not in split)
        if over:
            groups[over] = groups.get(over, 0.0) + (s.elements if s.exchanged is None
                                                    else s.exchanged)
    return [Collective("all-reduce", axes, n * param_bytes) for axes, n in groups.items()]


def batch_axes_collectives(declared: ModelCommunication, step: StepShape) -> list[Collective]:
    """Everything the step sends over `expert` and `context` itself, and the metrics' mean.

    What the module docstring lists, and the metrics' mean over `data`.

    Args:
      declared: what the model declares about `step`.
      step: the train step's shape (grid, batch, sequence length, parameter bytes).

    Returns:
      The collectives per device and step: the metrics' all-reduce over `data` (if there are
      metrics), and with `expert` or `context` above 1 the gradient sums, the loss's and the
      metrics' all-reduce over those axes, and with `context > 1` the batch's all-gather over
      `context`.
    """
    g = step.grid
    extra = extra_axes(g)
    metrics = declared.metrics * FP32
    out = [Collective("all-reduce", ("data",), metrics)] if metrics else []
    if not extra:
        return out
    out += gradient_sums(declared.parameters, g, step.param_bytes)
    out.append(Collective("all-reduce", extra, FP32 + metrics))
    if g.context > 1:
        # The gathered result: this device's rows (over data, expert, depth), whole sequences.
        out.append(Collective("all-gather", ("context",),
                              step.rows * step.seq_len * declared.batch_token_bytes))
    return out
