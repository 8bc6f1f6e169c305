"""The update phase of a train step: global-norm clipping, the loss-scale division, the non-finite
guard and the optimizer (on the device, or streamed from host memory), in one place for every path.

Clipping and unscaling are one scalar `factor` by which every gradient is multiplied as it is
consumed, computed from the global norm of the (scaled) gradients:

    norm = sqrt(sum_squares(grads)) / loss_scale
    factor = (max_norm / norm if norm > max_norm else 1) / loss_scale

so the host-offloaded optimizer can apply it piece by piece without an fp32 copy of all gradients.
`sum_squares` takes a hook for gradients spread over processes (the MPI pipeline sums the squares of
its stages' gradients); in every other path the gradients are global arrays and the sum is local.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from ..offload.optimizer import HostOffloadedOptimizer
from ..offload.precision import LossScaler, keep_if_finite


def sum_of_squares(grads) -> jax.Array:
    """Sum of the squares of every gradient element, in fp32."""
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)),
               jnp.zeros((), jnp.float32))


def gradient_factor(norm, loss_scale, clip_norm: float | None):
    """The multiplier that unscales and clips every gradient (see the module docstring).
    norm: global norm of the unscaled gradients; clip_norm None: no clipping."""
    clip = 1.0 if clip_norm is None else jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
    return (clip / loss_scale).astype(jnp.float32)


def make_update(optimizer: optax.GradientTransformation, *, scaler: LossScaler,
                clip_norm: float | None = None, offloaded: HostOffloadedOptimizer | None = None,
                all_reduce_squares: Callable = lambda s: s) -> Callable:
    """`update(state, grads) -> (state, metrics)`.

    state: `{'step', 'params', 'opt_state'}` and, for mixed precision, `'precision'` (the
    `scaler`'s state: its `scale` multiplied the loss, so `grads` are scaled by it). `offloaded`:
    the optimizer state lives in host memory and `optimizer` is its per-piece transform (see
    `offload.optimizer`). metrics: `grad_norm` (before clipping) and, for mixed precision,
    `loss_scale` and `skipped_steps`.
    """
    def update(state, grads):
        mp = state.get("precision")
        scale = jnp.float32(1.0) if mp is None else mp["scale"]
        norm = jnp.sqrt(all_reduce_squares(sum_of_squares(grads))) / scale
        finite = jnp.isfinite(norm)
        factor = gradient_factor(norm, scale, clip_norm)
        keep = finite if scaler.guards else None
        params, opt_state = state["params"], state["opt_state"]
        if offloaded is not None:
            new_params, new_opt = offloaded.update(grads, params, opt_state, factor, keep)
        else:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32) * factor, grads)
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if keep is not None:
                new_params, new_opt = keep_if_finite(keep, (new_params, new_opt),
                                                     (params, opt_state))
        new = {**state, "step": state["step"] + 1, "params": new_params, "opt_state": new_opt}
        metrics = {"grad_norm": norm}
        if mp is not None:
            new["precision"] = scaler.update(mp, finite)
            metrics.update(loss_scale=mp["scale"], skipped_steps=new["precision"]["skipped_steps"])
        return new, metrics

    return update


def initial_state(params, *, optimizer: optax.GradientTransformation, scaler: LossScaler,
                  offloaded: HostOffloadedOptimizer | None = None) -> dict[str, Any]:
    """The train state for fp32 `params`: `{'step', 'params', 'opt_state'}` and, for mixed
    precision, `'precision'` (with `offloaded`, `params` become the device copy in the compute
    dtype and `opt_state` the fp32 masters and the optimizer's state)."""
    if offloaded is not None:
        params, opt_state = offloaded.init(params)
    else:
        opt_state = optimizer.init(params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}
    mp = scaler.init()
    if mp is not None:
        state["precision"] = mp
    return state
