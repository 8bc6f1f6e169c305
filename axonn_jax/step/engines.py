"""Gradient engines: how a train step computes the loss and the gradients of this device's rows.

One class per kind of grid, behind one interface:

    engine.loss_and_grads(params, batch, scale) -> (loss, grads, metrics)

Called inside the step's shard_map, which is manual over `engine.manual_axes` (the batch axes
`data`, `expert`, `context` that split something; with a pipeline `pipe` too) and automatic over
the tensor axes, whose layers bring their own collectives. `params` are this device's (split over
the manual axes as their specs say), `batch` is this device's rows (and, over `context`, its chunk
of every sequence); `scale` the loss scale. `grads` are this device's, multiplied by `scale` and not
yet reduced over the batch axes (the step does that); `loss` is this device's mean loss (unscaled);
`metrics` the blocks' per-layer auxiliary outputs. An engine with no manual axes runs on global
arrays without a shard_map (nothing to reduce).

- `SpmdEngine`: autodiff of `head(blocks(embed(batch)))`, accumulated over `microbatches` slices of
  the rows when asked (a global batch that does not fit in memory at once).
- `PipelineEngine`: the lockstep pipeline (`parallel.pipeline`) over `pipe` with a schedule.

`make_engine` picks the one of a grid; nothing outside this module branches on `pipe` to choose.

The message-driven MPI pipeline (`transport.mpi_pipeline`) is a host-driven engine of its own.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import ensure_varying, psum, to_varying, varying_axes
from ..config import Axis, ParallelConfig
from ..parallel import pipeline as pipeline_lib
from . import batch_axes
from .compute import ComputeFunctions, cast_floating


def make_engine(compute: ComputeFunctions, grid: ParallelConfig, options, *,
                compressed: bool = False, layer_stages: Callable | None = None):
    """The engine of a step on `grid`: the lockstep pipeline with `pipe` > 1, else `SpmdEngine`.

    Args:
      compute: the model's functions as the step computes them.
      grid: the mesh's `ParallelConfig`.
      options: the step's modes (`step.train_step.StepOptions`; read: `microbatches`, `schedule`,
        `virtual_stages`, `dtype`, `offload_optimizer`, `offload_gradients`, `reduce_dtype`).
      compressed: CGX's exchange runs in the step (its rounding runs even on one data copy, so
        the step keeps its shard_map there).
      layer_stages: CGX's per-layer exchange (`LayerExchange.stages`) when it offers one, else
        None (the exact sum).

    Returns:
      A `PipelineEngine` or an `SpmdEngine`.
    """
    axes = batch_axes.manual_axes(grid)
    if grid.pipe > 1:
        return PipelineEngine(compute, pipeline_lib.make_schedule(
            options.schedule, grid.pipe, options.microbatches, options.virtual_stages), axes)
    # Nothing to reduce when no batch axis splits the rows and the reduction is exact (a mean
    # over one device; CGX's rounds even there): no shard_map, plain autodiff.
    alone = not batch_axes.extra_axes(grid) and grid.data == 1 and not compressed
    sixteen_bit_offload = options.offload_optimizer and options.dtype != "float32"
    summed = batch_axes.layers_summed_in_backward(
        grid, microbatches=options.microbatches, sixteen_bit_offload=sixteen_bit_offload,
        compressed=compressed, compressed_layers=layer_stages is not None)
    return SpmdEngine(compute, frozenset() if alone else frozenset(axes), options.microbatches,
                      layer_reduce=summed,
                      layer_mean=sixteen_bit_offload or options.offload_gradients,
                      reduce_dtype=options.reduce_dtype, layer_stages=layer_stages)


@dataclasses.dataclass(frozen=True)
class SpmdEngine:
    """The engine of data, expert, context and tensor grids (`pipe` = 1).

    Attributes:
      compute: the model's functions as the step computes them (dtype, remat, kernels).
      manual_axes: the axes manual in the step's shard_map; empty when no batch axis splits the
        rows and the reduction is exact (one device, or one data-parallel copy spanning
        tensor-parallel devices): nothing to reduce, so plain autodiff without a shard_map (XLA
        rejects an all-reduce over the size-1 `data` axis of gradients that come out of the
        tensor-parallel layers' own shard_maps, and on one device the step is then the plain
        `jax.jit` step: `benchmarks/results/one_device_vs_jit.md`).
      microbatches: slices of the local rows whose gradients are accumulated (in float32).
    """

    compute: ComputeFunctions
    manual_axes: frozenset[str]
    microbatches: int = 1
    layer_reduce: bool = False
    """The blocks' gradients summed over the manual axes layer by layer inside the backward
    (`ComputeFunctions.vary_layers`, `step.layer_exchange`; they come out invariant, already
    summed): for an exact reducer over one microbatch, where the reduction is the same sum issued
    earlier."""
    layer_mean: bool = False
    """The per-layer sums divided by the axis' size before the cast back (means, which the
    step's reducer then leaves alone): for 16-bit gradients, whose sum could overflow, and for
    gradients that leave for host memory (`ComputeFunctions.layer_mean`)."""
    reduce_dtype: str = "float32"
    """The dtype the per-layer sums send (`parallel.exchange`)."""
    layer_stages: Callable | None = None
    """Another per-layer exchange than the exact sum (`ComputeFunctions.layer_stages`: the
    reducer's `LayerExchange.stages`, CGX's), whose state `loss_and_grads` takes."""

    metric_spec = P()
    """Metrics (per layer, `(layers, ...)`) leave whole: every device ran every layer."""
    gpu_overlap_options = True
    """Whether the step compiles with `step.xla_options.GPU_OPTIONS` on GPUs."""

    @property
    def exchanges_layers(self) -> bool:
        """Whether the blocks' gradients come out reduced over the manual axes, layer by layer.

        The sums run inside the backward: with `layer_reduce`, one microbatch and manual axes.
        """
        return self.layer_reduce and self.microbatches == 1 and bool(self.manual_axes)

    def loss_and_grads(self, params, batch, scale, layer_state=None, sink=None):
        """This device's `(loss, grads, metrics)`, as the module docstring says.

        With `microbatches > 1` the rows are split into that many slices, each slice's loss
        weighted `1/microbatches`, the gradients summed in float32 and the loss and metrics
        averaged over the slices.

        Args:
          params: this device's parameters, split over the manual axes as their specs say.
          batch: this device's rows (and, over `context`, its chunk of every sequence); every
            leaf `(rows, ...)`.
          scale: the loss scale the gradients are multiplied by.
          layer_state: `(state stack or None, key or None)` of `layer_stages`, when
            `exchanges_layers`; one microbatch only.
          sink: `{"grads": host stacks like params['blocks'], "squares": float32 (layers,)}`
            to write the blocks' gradients to in the backward (`--offload-gradients`; over the
            manual axes, after each layer's mean: `exchanges_layers` with `layer_mean`); one
            microbatch only.

        Returns:
          `(loss, grads, metrics)`: this device's mean loss (unscaled), its gradients like
          `params` (times `scale`; the blocks' already summed over the manual axes when
          `exchanges_layers`), and the blocks' per-layer metrics. With `layer_state`, also the
          new state stack, as a fourth; with `sink`, the blocks' gradients are the sink's host
          stacks and the fourth is their per-layer sums of squares.

        Raises:
          ValueError: when the local rows are not divisible by `microbatches`.
        """
        axes = tuple(sorted(self.manual_axes))
        m = self.microbatches
        compute = self.compute
        if self.exchanges_layers:
            compute = dataclasses.replace(compute, vary_layers=axes, layer_mean=self.layer_mean,
                                          reduce_dtype=self.reduce_dtype,
                                          layer_stages=self.layer_stages)
            params = {**ensure_varying({k: v for k, v in params.items() if k != "blocks"}, axes),
                      "blocks": params["blocks"]}
        else:
            # Varying over the manual axes: each shard keeps its own gradients until the reduction.
            params = ensure_varying(params, axes)
        if layer_state is not None:
            return self._with_layer_state(compute, params, batch, scale, layer_state)
        if sink is not None:
            return self._into_sink(compute, params, batch, scale, sink)

        def scaled(p, b, weight):
            loss, metrics = compute.loss_and_metrics(p, b)
            return loss * weight, (loss, metrics)

        grad_fn = jax.value_and_grad(scaled, has_aux=True)
        if m == 1:
            (_, (loss, metrics)), grads = grad_fn(params, batch, scale)
            return loss, grads, metrics
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % m:
            raise ValueError(f"the local batch of {rows} rows is not divisible by microbatches = {m}")
        split = jax.tree.map(lambda a: a.reshape(m, rows // m, *a.shape[1:]), batch)
        low = cast_floating(params, compute.dtype)  # once, not in every microbatch's passes

        def one(acc, b):
            # Each microbatch's loss weighted 1/m: the sum of the gradients is the mean's.
            (_, (loss, metrics)), g = grad_fn(low, b, scale / m)
            acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
            return acc, (loss, metrics)

        zeros = to_varying(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), axes)
        grads, (losses, metrics) = jax.lax.scan(one, zeros, split)
        return jnp.mean(losses), grads, jax.tree.map(lambda v: jnp.mean(v, axis=0), metrics)

    @staticmethod
    def _with_layer_state(compute, params, batch, scale, layer_state):
        """`loss_and_grads` of one microbatch whose per-layer exchange has state: the state
        stack differentiated beside the parameters, its "gradient" the new stack."""
        state, key = layer_state

        def scaled(p, st, b, weight):
            loss, metrics = compute.loss_and_metrics(p, b, layer_state=(st, key))
            return loss * weight, (loss, metrics)

        (_, (loss, metrics)), (grads, new) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True)(params, state, batch, scale)
        return loss, grads, metrics, new

    @staticmethod
    def _into_sink(compute, params, batch, scale, sink):
        """`loss_and_grads` of one microbatch whose blocks' gradients go to host memory layer by
        layer: the sink differentiated instead of the blocks, its "gradient" the filled one."""
        blocks = params["blocks"]

        def scaled(rest, sk, b, weight):
            loss, metrics = compute.loss_and_metrics({**rest, "blocks": blocks}, b, sink=sk)
            return loss * weight, (loss, metrics)

        rest = {k: v for k, v in params.items() if k != "blocks"}
        # Copies that write their shares of the mean (host stacks varying over the manual axes)
        # sum their shares' squares after the backward.
        shared = tuple(sorted(set().union(*map(varying_axes, jax.tree.leaves(sink["grads"])))))
        sink = {**sink, "squares": to_varying(sink["squares"], shared)}
        (_, (loss, metrics)), (grads, filled) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True)(rest, sink, batch, scale)
        squares = psum(filled["squares"], shared) if shared else filled["squares"]
        return loss, {**grads, "blocks": filled["grads"]}, metrics, squares


@dataclasses.dataclass(frozen=True)
class PipelineEngine:
    """The engine of grids with `pipe` > 1: the lockstep pipeline.

    The stack's layers are split over `pipe` (each device its stage's `V` chunks), the
    microbatches streamed through the stages in the timetable `schedule`.

    Attributes:
      compute: the model's functions as the step computes them.
      schedule: the pipeline's timetable (`parallel.pipeline.Schedule`).
      batch_axes: the batch axes manual besides `pipe` (`step.batch_axes.manual_axes`).
    """

    compute: ComputeFunctions
    schedule: pipeline_lib.Schedule
    batch_axes: tuple[str, ...] = (Axis.DATA,)

    metric_spec = P(Axis.PIPE)
    """Metrics (per layer) leave split over `pipe` like the blocks, in their stored order."""
    gpu_overlap_options = False
    """The collective pipeliner of `step.xla_options.GPU_OPTIONS` adds reduce-scatter bytes to
    the pipeline's ticks: the step compiles with XLA's defaults."""

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes manual in the step's shard_map: `batch_axes` and `pipe`."""
        return frozenset((*self.batch_axes, Axis.PIPE))

    def loss_and_grads(self, params, batch, scale):
        """This device's `(loss, grads, metrics)` from the pipeline, as the module docstring says.

        Args:
          params: this device's parameters; `blocks` holds its stage's chunks on the layer axis
            (split over `pipe`).
          batch: this device's rows, every leaf `(rows, ...)`; the schedule splits them into
            microbatches.
          scale: the loss scale the gradients are multiplied by.

        Returns:
          `(loss, grads, metrics)`: the mean loss (unscaled), the gradients
          `{"embed", "blocks", "head"}` (times `scale`, summed in the stored dtype), and the
          per-layer metrics of this stage's blocks (they leave the shard_map split over `pipe`,
          `metric_spec`).
        """
        fns, s = self.compute.fns, self.schedule
        params = ensure_varying(params, tuple(sorted(self.manual_axes)))
        layers = jax.tree.leaves(params["blocks"])[0].shape[0] // s.virtual_stages
        stored = (params["embed"], params["blocks"], fns.head_params(params))
        # Cast to the compute dtype once, not in every tick's forward and recomputed forward (the
        # replayed gain is in CHANGELOG.md's entry for this hoist); the gradients still sum in
        # the stored dtype.
        loss, (g_e, g_b, g_h), metrics = pipeline_lib.pipeline_loss_and_grads(
            self.compute.embed, self.compute.stage(layers), self.compute.head,
            cast_floating(stored, self.compute.dtype), batch, s, scale=scale,
            accumulate_in=jax.tree.map(lambda a: a.dtype, stored))
        g_e, g_h = fns.embed_and_head_grads(g_e, g_h)
        return loss, {"embed": g_e, "blocks": g_b, "head": g_h}, metrics
