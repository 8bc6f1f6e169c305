"""Mixed precision: the loss scaler, an `init/update` pair like an optax transform.

With `float16` compute the loss is multiplied by a dynamic scale before differentiation, so small
gradients survive fp16; gradients are divided by it (in fp32) before the update. A step whose
gradients are not finite is skipped (parameters and optimizer state unchanged: `keep_if_finite`),
the scale halves, and `skipped_steps` counts it. After `GROWTH_INTERVAL` finite steps in a row the
scale doubles. `bfloat16` needs no scaling (fp32's exponent range) but gets the same skip guard;
`float32` runs carry no precision state at all, so their programs are unchanged.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ..checks import check_choice

INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 200
MIN_SCALE = 1.0
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check_dtype(dtype: str) -> None:
    """Raise ValueError unless `dtype` names a compute dtype of `DTYPES`.

    Args:
      dtype: `float32`, `bfloat16` or `float16`.

    Raises:
      ValueError: another name.
    """
    check_choice("dtype", dtype, DTYPES)


class LossScaler(NamedTuple):
    """A loss scaler's `init` and `update` functions, and whether it guards steps.

    `init() -> state | None` (replicated scalars: `scale` f32, `good_steps`, `skipped_steps`
    int32; None: no precision state) and `update(state, finite) -> state` after a step whose
    gradients were `finite` (bool scalar). `guards`: steps with non-finite gradients are skipped.
    """

    init: Callable[[], dict | None]
    update: Callable[[dict, jax.Array], dict]
    guards: bool


def loss_scaler(dtype: str) -> LossScaler:
    """The loss scaler of compute `dtype`.

    Args:
      dtype: `float32`, `bfloat16` or `float16`.

    Returns:
      Dynamic scaling for float16, a skip counter for bfloat16, nothing for float32.

    Raises:
      ValueError: another dtype name.
    """
    check_dtype(dtype)
    if dtype == "float32":
        return LossScaler(lambda: None, lambda state, finite: state, guards=False)
    dynamic = dtype == "float16"

    def init():
        scale = INITIAL_SCALE if dynamic else 1.0
        return {"scale": jnp.asarray(scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
                "skipped_steps": jnp.zeros((), jnp.int32)}

    def update(state, finite):
        skipped = state["skipped_steps"] + jnp.where(finite, 0, 1).astype(jnp.int32)
        if not dynamic:
            return {**state, "skipped_steps": skipped}
        good = jnp.where(finite, state["good_steps"] + 1, 0)
        grow = good >= GROWTH_INTERVAL
        scale = jnp.where(finite, jnp.where(grow, state["scale"] * 2, state["scale"]),
                          jnp.maximum(state["scale"] / 2, MIN_SCALE))
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
                "skipped_steps": skipped}

    return LossScaler(init, update, guards=True)


def scale_of(state: dict):
    """The loss scale of a train state.

    Args:
      state: a train state (a mapping with an optional `precision` entry).

    Returns:
      Its f32 scale (1.0 when it has no precision state).
    """
    mp = state.get("precision")
    return jnp.float32(1.0) if mp is None else mp["scale"]


def keep_if_finite(finite, new, old):
    """`new` where `finite`, else `old`, leaf by leaf: the one non-finite guard.

    Args:
      finite: a bool scalar.
      new: the pytree to take where finite.
      old: a pytree of the same structure, kept otherwise.

    Returns:
      The chosen pytree.
    """
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
