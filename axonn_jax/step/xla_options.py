"""The XLA options the library compiles a train step with on GPUs: those that govern overlap.

XLA:GPU hides a collective behind computation when its latency-hiding scheduler moves work between
the collective's `start` and its `done`. Inside a loop (the scan over layers, the pipeline's ticks)
there is often nothing independent of the collective in the same iteration; the collective
pipeliner then moves it across the iteration boundary (an all-gather one iteration early: the next
layer's weights prefetched during this layer; a reduce-scatter or all-reduce one iteration late:
this layer's gradients reduced during the previous layer's backward). `GPU_OPTIONS` are the options
`benchmarks/overlap.py` measured to raise the share of collective bytes with compute between start
and done in the compiled H100 module (`analysis.overlap`; figures in
`benchmarks/results/overlap.md`); every option there is kept because its measurement showed a gain.

`compiler_options(mesh, choice, tuned)` is what `jax.jit(..., compiler_options=...)` gets:
`GPU_OPTIONS` for a mesh of GPUs under `choice="library"` where the step's engine takes them
(`tuned`: not the pipeline's), nothing for other platforms or under `choice="xla"` (XLA's own
defaults, the "before" of the measurement). Options in the `XLA_FLAGS` environment variable still
apply; the ones here override them for the step's program only.
"""
from __future__ import annotations

import re

from .._compat import mesh_platform
from ..checks import check_choice

CHOICES = ("library", "xla")

OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"

GPU_OPTIONS: dict[str, bool | int] = {
    # The collective pipeliner for all-gathers and all-reduces in loops: the next layer's weights
    # are gathered during this layer. It adds reduce-scatter bytes to a pipeline's ticks, so the
    # pipeline's engine compiles without these options (`engines.PipelineEngine`).
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    # Each weight's gradient reduce-scattered over depth on its own, as soon as its matmul is
    # done, instead of the layer's weights combined into one that waits for the last of them.
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
    # The latency-hiding scheduler's memory limit, in percent of the device's memory less the
    # step's arguments and results (XLA's default: 95). Near the limit the scheduler stops
    # overlapping, on its own estimate of the peak, which is not the buffer assignment's; what
    # the device must hold is still the compiled buffers (`fits`).
    "xla_gpu_memory_limit_slop_factor": 125,
    # Up to eight collectives in flight at once (XLA's default: one) on meshes split over more
    # than one axis (`overlap_limit`): a layer's data-parallel exchange (`step.layer_exchange`:
    # the all-to-all of one layer and the all-gather of the layer above) then runs beside the
    # depth gathers, reduce-scatters and row/col all-reduces of the layer below instead of
    # queueing behind them.
    OVERLAP_LIMIT: 8,
}
"""XLA:GPU `DebugOptions` (names as in `XLA_FLAGS`, without the dashes) -> value. Each one's
measurements, and those of the options left out (the pipelined reduce-scatter, while-loop double
buffering, the analytical latency estimator), are in `benchmarks/results/overlap_notes.md` and
`benchmarks/results/layer_exchange.md`."""


def check_setting(choice: str) -> None:
    """Check that `choice` is one of `CHOICES`.

    Args:
      choice: the `xla_options` setting, `"library"` or `"xla"`.

    Raises:
      ValueError: when `choice` is not in `CHOICES`.
    """
    check_choice("xla_options", choice, CHOICES)


def compiler_options(mesh, choice: str = "library",
                     tuned: bool = True) -> dict[str, bool | int] | None:
    """The options to compile a step on `mesh` with (None: XLA's defaults).

    Of `GPU_OPTIONS` (with `OVERLAP_LIMIT` set by `overlap_limit`), those the installed XLA knows
    (`accepted`); only for a mesh of GPUs, under `choice="library"`, for an engine that takes them.

    Args:
      mesh: the step's `jax.sharding.Mesh`.
      choice: `"library"` (the options here) or `"xla"` (XLA's own defaults).
      tuned: the step's engine compiles with `GPU_OPTIONS` (`engine.gpu_overlap_options`).

    Returns:
      The options for `jax.jit(..., compiler_options=...)`, or None for XLA's defaults.

    Raises:
      ValueError: when `choice` is not in `CHOICES`.
    """
    check_setting(choice)
    if choice == "xla" or mesh_platform(mesh) != "gpu" or not tuned:
        return None
    return accepted(mesh, {**GPU_OPTIONS, OVERLAP_LIMIT: overlap_limit(dict(mesh.shape))}) or None


def overlap_limit(shape: dict[str, int]) -> int:
    """How many collectives XLA may run at once on a mesh of `shape` (`{axis: size}`).

    One on a mesh split over one axis: its collectives share its links, and XLA, free to run
    several, starts them all late. Else `GPU_OPTIONS`' eight: the collectives of different axes
    run on different links (NVLink inside a node, the NICs across nodes) or beside each other's
    compute (`benchmarks/results/layer_exchange.md`).

    Args:
      shape: the mesh's `{axis: size}`.

    Returns:
      1 when at most one axis has size above 1, else `GPU_OPTIONS[OVERLAP_LIMIT]`.
    """
    if sum(size > 1 for size in shape.values()) <= 1:
        return 1
    return GPU_OPTIONS[OVERLAP_LIMIT]


SUCCESSORS: dict[str, tuple[str, object]] = {
    # XLA made the collective pipeliner's switches three-valued (openxla/xla#45836): jaxlib 0.11.2
    # (on an H200) refuses the boolean names and takes these (measured: `True`, "ON", "AUTO" are
    # not valid values there).
    "xla_gpu_enable_pipelined_all_gather": ("xla_gpu_pipeline_all_gather",
                                            "COLLECTIVE_PIPELINING_MODE_ON"),
    "xla_gpu_enable_pipelined_all_reduce": ("xla_gpu_pipeline_all_reduce",
                                            "COLLECTIVE_PIPELINING_MODE_ON"),
}
"""An option of `GPU_OPTIONS` that a newer XLA renamed -> (its name there, the value that means
ours `True`)."""

_ACCEPTED: dict[tuple, dict] = {}


def accepted(mesh, options: dict) -> dict:
    """`options` as the installed XLA takes them.

    An option it refuses ("No such compile option": XLA renames and retires its flags) is
    replaced by its successor (`SUCCESSORS`) or, without one, dropped with a warning that names
    it. Found by compiling a one-number program on `mesh` once per process and set of options.

    Args:
      mesh: the mesh whose platform compiles the probe program.
      options: XLA `DebugOptions` names -> values.

    Returns:
      A new dict of the options kept, successors included.

    Raises:
      Exception: the compiler's error when compiling fails for another reason than a refused
        option.
    """
    import warnings

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    key = (mesh_platform(mesh), tuple(sorted(options.items())))
    if key not in _ACCEPTED:
        kept = dict(options)
        one = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
        while kept:
            try:
                jax.jit(lambda x: x + 1, compiler_options=kept).lower(one).compile()
                break
            except Exception as e:  # jax.errors.JaxRuntimeError, whose home moved between versions
                refused = re.search(r"No such compile option: '(\w+)'", str(e))
                if not refused or refused.group(1) not in kept:
                    raise
                name = refused.group(1)
                value = kept.pop(name)
                if name in SUCCESSORS and value is True:
                    kept.setdefault(*SUCCESSORS[name])
                else:
                    warnings.warn(f"this XLA (jaxlib {jax.__version__}) has no option {name}: "
                                  "the step compiles without it", stacklevel=2)
        _ACCEPTED[key] = kept
    return dict(_ACCEPTED[key])
