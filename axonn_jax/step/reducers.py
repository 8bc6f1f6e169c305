"""Gradient reducers: the data-parallel mean of the gradients as an `init/reduce` pair, like an optax
transform, so that every train step differs from another only in the reducer it is given.

    state = reducer.init(params)                          # None when the reducer keeps nothing
    grads, state = reducer.reduce(grads, state, step)     # the mean over the data-parallel copies
    loss = reducer.mean(loss)                             # an exact mean of a few small values

`exact_mean` and `compressed_mean` (CGX, error-feedback residual in its state) run inside the train
step's shard_map, manual over `data`. Reducers between processes (`between_processes=True`, e.g.
`axonn_jax.transport.mpi`) run in a program of their own on one device of each process, after the
step has averaged the gradients over its local devices exactly.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from .._compat import pmean
from ..parallel import compression


class GradientReducer(NamedTuple):
    """init(params) -> state | None; reduce(grads, state, step) -> (grads, state); mean(tree) ->
    tree (exact); state_spec(param_spec) -> spec of the state leaf of that parameter.

    between_processes: runs between processes on one device each (see the module docstring);
    process_index / process_count: this process's place among them (which rows of each global batch
    it trains on)."""

    init: Callable[[Any], Any]
    reduce: Callable[[Any, Any, Any], tuple[Any, Any]]
    mean: Callable[[Any], Any]
    state_spec: Callable[[P], P] = lambda spec: spec
    between_processes: bool = False
    process_index: int = 0
    process_count: int = 1


def exact_mean(axis: str = "data") -> GradientReducer:
    """The mean over the mesh axis `axis` (an all-reduce); no state."""
    return GradientReducer(init=lambda params: None,
                           reduce=lambda grads, state, step: (pmean(grads, axis), state),
                           mean=lambda tree: pmean(tree, axis))


def compressed_mean(mesh, grad_specs, *, bits: int, bucket_size: int = compression.DEFAULT_BUCKET_SIZE,
                    error_feedback: bool = True, seed: int = 0,
                    axis: str = "data") -> GradientReducer:
    """CGX: the mean over `axis` with every device's gradient shard quantized to `bits` bits in
    buckets of `bucket_size` (see `parallel.compression.sharded_compressed_pmean`).

    grad_specs: PartitionSpecs like the gradients, how the other mesh axes split them (each device
    compresses only its own shard). With `error_feedback`, rounding is to nearest and the state is
    each device's residual: leaves `[size of axis, *param.shape]`, split over `axis` and like the
    parameter (nearest rounding with feedback was measured better than stochastic with feedback at
    2 bits). Without it the state is None and rounding is stochastic, its noise a pure function of
    (seed, step), which keeps the mean unbiased.
    """
    compression.check_args(bits, bucket_size)
    shards = int(mesh.shape[axis])

    def init(params):
        return compression.init_residual(params, shards) if error_feedback else None

    def reduce(grads, residual, step):
        key = None if error_feedback else jax.random.fold_in(jax.random.key(seed), step)
        local = None if residual is None else jax.tree.map(lambda r: r[0], residual)
        grads, local = compression.sharded_compressed_pmean(
            grads, grad_specs, mesh, axis, bits=bits, bucket_size=bucket_size, key=key,
            residual=local)
        return grads, None if local is None else jax.tree.map(lambda r: r[None], local)

    return GradientReducer(init, reduce, mean=lambda tree: pmean(tree, axis),
                           state_spec=lambda spec: P(axis, *spec))
