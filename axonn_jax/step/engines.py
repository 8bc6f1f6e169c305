"""Gradient engines: how a train step computes the loss and the gradients of this device's rows, one
class per kind of grid behind one interface.

    engine.loss_and_grads(params, batch, scale) -> (loss, grads, metrics)

Called inside the step's shard_map, which is manual over `engine.manual_axes` (the batch axes; with
a pipeline `pipe` too) and automatic over the tensor axes, whose layers bring their own collectives.
`params` are this device's (`engine.param_specs` says how the manual axes split them), `batch` is
this device's rows, `scale` the loss scale; `grads` are this device's, multiplied by `scale` and not
yet reduced over the batch axes (the step's `GradientReducer` does that); `loss` is this device's
mean loss (unscaled); `metrics` extra scalars. An engine with no manual axes runs on global arrays
without a shard_map (nothing to reduce).

- `SpmdEngine`: autodiff of `head(blocks(embed(batch)))`, accumulated over `microbatches` slices of
  the rows when asked (a global batch that does not fit in memory at once).
- `PipelineEngine`: the lockstep pipeline (`parallel.pipeline`) over `pipe` with a schedule.

The message-driven MPI pipeline (`transport.mpi_pipeline`) is a host-driven engine of its own.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import ensure_varying, to_varying
from ..parallel import pipeline as pipeline_lib
from .compute import ComputeFunctions

BATCH_MANUAL = ("data",)
"""The batch axes manual in the step's shard_map."""


@dataclasses.dataclass(frozen=True)
class SpmdEngine:
    """Data and tensor grids (`pipe` = 1). manual: whether the step needs its shard_map (it does
    unless one data-parallel copy spans tensor-parallel devices: nothing to reduce there, and XLA
    rejects an all-reduce over the size-1 `data` axis of gradients that come out of the
    tensor-parallel layers' own shard_maps)."""

    compute: ComputeFunctions
    microbatches: int = 1
    manual: bool = True

    @property
    def manual_axes(self) -> frozenset[str]:
        return frozenset(BATCH_MANUAL) if self.manual else frozenset()

    def param_specs(self, params):
        """Parameters enter whole over the manual axes."""
        return P()

    metric_spec = P()
    """Metrics (per layer, `(layers, ...)`) leave whole: every device ran every layer."""

    def loss_and_grads(self, params, batch, scale):
        if self.manual:  # each shard keeps its own gradients until the explicit reduction
            params = to_varying(params, BATCH_MANUAL)
        m = self.microbatches

        def scaled(p, b, weight):
            loss, metrics = self.compute.loss_and_metrics(p, b)
            return loss * weight, (loss, metrics)

        grad_fn = jax.value_and_grad(scaled, has_aux=True)
        if m == 1:
            (_, (loss, metrics)), grads = grad_fn(params, batch, scale)
            return loss, grads, metrics
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % m:
            raise ValueError(f"the local batch of {rows} rows is not divisible by microbatches = {m}")
        split = jax.tree.map(lambda a: a.reshape(m, rows // m, *a.shape[1:]), batch)

        def one(acc, b):
            # Each microbatch's loss weighted 1/m: the sum of the gradients is the mean's.
            (_, (loss, metrics)), g = grad_fn(params, b, scale / m)
            acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
            return acc, (loss, metrics)

        axes = tuple(sorted(self.manual_axes))
        zeros = to_varying(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), axes)
        grads, (losses, metrics) = jax.lax.scan(one, zeros, split)
        return jnp.mean(losses), grads, jax.tree.map(lambda v: jnp.mean(v, axis=0), metrics)


@dataclasses.dataclass(frozen=True)
class PipelineEngine:
    """`pipe` > 1: the stack's layers split over `pipe` (each device its stage's `V` chunks), the
    microbatches streamed through the stages in the timetable `schedule`."""

    compute: ComputeFunctions
    schedule: pipeline_lib.Schedule

    @property
    def manual_axes(self) -> frozenset[str]:
        return frozenset((*BATCH_MANUAL, "pipe"))

    def param_specs(self, params):
        """The blocks split over `pipe` on their layer axis, the rest whole."""
        return {"embed": P(), "blocks": P("pipe"), "head": P()}

    metric_spec = P("pipe")
    """Metrics (per layer) leave split over `pipe` like the blocks, in their stored order."""

    def loss_and_grads(self, params, batch, scale):
        fns, s = self.compute.fns, self.schedule
        params = ensure_varying(params, tuple(sorted(self.manual_axes)))
        layers = jax.tree.leaves(params["blocks"])[0].shape[0] // s.virtual_stages
        loss, (g_e, g_b, g_h), metrics = pipeline_lib.pipeline_loss_and_grads(
            self.compute.embed, self.compute.stage(layers), self.compute.head,
            (params["embed"], params["blocks"], fns.head_params(params)), batch, s, scale=scale)
        g_e, g_h = fns.embed_and_head_grads(g_e, g_h)
        return loss, {"embed": g_e, "blocks": g_b, "head": g_h}, metrics
