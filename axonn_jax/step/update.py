"""The update phase of a train step, as optax transformations.

    tx = update_chain(optimizer, clip_norm=1.0, skip_non_finite=...)
       = skip_if_not_finite(chain(unscale_by_loss_scale(), clip_by_global_norm(1.0), optimizer))

Every element is elementwise given three scalars that `make_update` computes once from the whole
gradient tree and passes to the chain as optax extra arguments:

    loss_scale    the mixed-precision loss scale the gradients are multiplied by
    grad_norm     the global norm of the unscaled gradients (also the step's `grad_norm` metric)
    finite        whether that norm is finite

so the same chain runs on the whole tree (`offload.optimizer.on_device`) or streamed piece by piece
from host memory (`offload.optimizer.host_offload`) with identical results, and no fp32 copy of all
gradients is made for either. The squared norm takes a hook for gradients spread over processes
(the MPI pipeline sums the squares of its stages' gradients); elsewhere gradients are global
arrays and the sum is local.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from .._compat import in_host_memory
from ..offload.optimizer import ParamUpdate
from ..offload.precision import LossScaler, keep_if_finite
from .state import TrainState


def sum_of_squares(grads, host_squares=None) -> jax.Array:
    """Sum of the squares of every gradient element, in fp32.

    Args:
      grads: a pytree of arrays (any float dtype; each is cast to float32 first).
      host_squares: the sums of squares of the leaves in host memory (`--offload-gradients`:
        the backward summed them before they left), an array of any shape; required when
        `grads` has such leaves, which are not read.

    Returns:
      A float32 scalar: the sum over this process's arrays (global arrays sum whole).

    Raises:
      ValueError: when `grads` has leaves in host memory and `host_squares` is None.
    """
    leaves = jax.tree.leaves(grads)
    on_device = [g for g in leaves if not in_host_memory(g)]
    if len(on_device) < len(leaves) and host_squares is None:
        raise ValueError("gradients in host memory need their sums of squares (host_squares)")
    total = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in on_device),
                jnp.zeros((), jnp.float32))
    return total if host_squares is None else total + jnp.sum(host_squares)


def _stateless(update) -> optax.GradientTransformationExtraArgs:
    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def unscale_by_loss_scale() -> optax.GradientTransformationExtraArgs:
    """Gradients in float32, divided by the extra argument `loss_scale`.

    The loss scale is a power of two, so the division is exact; without a `loss_scale` the
    gradients are only cast.

    Returns:
      A stateless optax transformation that takes `loss_scale` as an extra argument.
    """
    def update(updates, state, params=None, *, loss_scale=None, **extra):
        inverse = 1.0 / jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32)
        return jax.tree.map(lambda g: g.astype(jnp.float32) * inverse, updates), state

    return _stateless(update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm with the norm given as the extra argument `grad_norm`.

    `grad_norm` is the norm of the whole tree, also when the chain sees only a piece of it.

    Args:
      max_norm: the largest global norm; the updates are multiplied by `max_norm / grad_norm`
        when `grad_norm` is at least `max_norm`.

    Returns:
      A stateless optax transformation that takes `grad_norm` as an extra argument.
    """
    def update(updates, state, params=None, *, grad_norm, **extra):
        factor = jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm).astype(jnp.float32)
        return jax.tree.map(lambda g: g * factor, updates), state

    return _stateless(update)


def skip_if_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner`, skipped (zero updates, state kept) where the extra argument `finite` is False.

    A step whose gradients are not finite is skipped (mixed precision).

    Args:
      inner: the transformation to guard; it gets the extra arguments too.

    Returns:
      An optax transformation with `inner`'s `init` that takes `finite` as an extra argument.
    """
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, *, finite, **extra):
        new_updates, new_state = inner.update(updates, state, params, finite=finite, **extra)
        zeros = jax.tree.map(jnp.zeros_like, new_updates)
        return keep_if_finite(finite, new_updates, zeros), keep_if_finite(finite, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def update_chain(optimizer: optax.GradientTransformation, *, clip_norm: float | None,
                 skip_non_finite: bool) -> optax.GradientTransformation:
    """The update of a step as one optax transformation (see the module docstring).

    Unscale (always: it also casts the gradients to float32), clip when `clip_norm`, then
    `optimizer`; skipped on non-finite gradients when `skip_non_finite` (mixed precision).

    Args:
      optimizer: the optax optimizer applied last.
      clip_norm: the global norm to clip the gradients to, or None for no clipping.
      skip_non_finite: whether to wrap the chain in `skip_if_not_finite`.

    Returns:
      The chain, taking the extra arguments `loss_scale`, `grad_norm` (with `clip_norm`) and
      `finite` (with `skip_non_finite`).
    """
    parts = [unscale_by_loss_scale()]
    if clip_norm is not None:
        parts.append(clip_by_global_norm(clip_norm))
    tx = optax.chain(*parts, optimizer)
    return skip_if_not_finite(tx) if skip_non_finite else tx


def make_update(params_update: ParamUpdate, *, scaler: LossScaler,
                sum_squares: Callable = lambda s: s, param_shardings=None) -> Callable:
    """`update(state, grads, host_squares=None) -> (state, metrics)` of a `TrainState`.

    grads: like `state.params`, multiplied by `state.loss_scale`; host_squares: the sums of
    squares of those in host memory (`sum_of_squares`). metrics: `grad_norm` (before
    clipping) and, for mixed precision, `loss_scale` and `skipped_steps`. The update adds 1 to
    `state.step`.

    Args:
      params_update: applies the optax chain to the parameters and optimizer state, on device
        or streamed from host memory (`offload.optimizer`).
      scaler: the loss scaler, which updates `state.precision` when that is not None.
      sum_squares: the hook that completes the squared norm of gradients spread over processes
        (identity by default: global arrays sum whole).
      param_shardings: the parameters' NamedShardings, for `params_update.apply` (None: left
        to GSPMD).

    Returns:
      The `update` function.
    """
    def update(state: TrainState, grads, host_squares=None) -> tuple[TrainState, dict[str, Any]]:
        scale = state.loss_scale
        norm = jnp.sqrt(sum_squares(sum_of_squares(grads, host_squares))) / scale
        finite = jnp.isfinite(norm)
        params, opt_state = params_update.apply(grads, state.opt_state, state.params,
                                                param_shardings, loss_scale=scale,
                                                grad_norm=norm, finite=finite)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        metrics = {"grad_norm": norm}
        if state.precision is not None:
            new = new.replace(precision=scaler.update(state.precision, finite))
            metrics.update(loss_scale=state.precision["scale"],
                           skipped_steps=new.precision["skipped_steps"])
        return new, metrics

    return update


def initial_state(params, *, params_update: ParamUpdate, scaler: LossScaler, rng,
                  reducer=None) -> TrainState:
    """The `TrainState` of fp32 `params`, at step 0.

    With offload, `params` become the device copy in the compute dtype and the optimizer state
    holds the fp32 masters.

    Args:
      params: the fp32 parameters (global arrays).
      params_update: makes the optimizer state (and the offloaded device copy) of `params`.
      scaler: makes the mixed-precision state (`TrainState.precision`).
      rng: uint32[2] key data of the run's random stream.
      reducer: the gradient reducer whose state the train state holds (`step.reducers`), or
        None. Its state is made from the parameters the gradients are shaped like: the device
        copy, in the compute dtype, under offload.

    Returns:
      The `TrainState`.
    """
    params, opt_state = params_update.init(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      rng=rng, reducer=None if reducer is None else reducer.init(params),
                      precision=scaler.init())
