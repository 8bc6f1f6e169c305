"""Mixed precision: the loss scale and the count of skipped steps.

With `--dtype float16` the loss is multiplied by a dynamic scale before differentiation, so small
gradients survive fp16; gradients are divided by it (in fp32) before the update. A step whose
gradients are not finite is skipped — parameters and optimizer state unchanged — the scale halves,
and `skipped_steps` counts it. After `GROWTH_INTERVAL` finite steps in a row the scale doubles.
bf16 needs no scaling (fp32's exponent range) but gets the same skip guard; fp32 runs carry no
precision state at all, so their programs are unchanged.
"""
from __future__ import annotations

import jax.numpy as jnp

INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 200
MIN_SCALE = 1.0


def uses_guard(dtype: str) -> bool:
    """Whether runs in compute `dtype` skip steps with non-finite gradients (mixed precision)."""
    return dtype in ("float16", "bfloat16")


def init(dtype: str) -> dict | None:
    """Precision state for compute `dtype`: scalars `scale` f32, `good_steps` and `skipped_steps`
    int32 (replicated), or None for fp32."""
    if not uses_guard(dtype):
        return None
    scale = INITIAL_SCALE if dtype == "float16" else 1.0
    return {"scale": jnp.asarray(scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
            "skipped_steps": jnp.zeros((), jnp.int32)}


def scale_of(state: dict):
    """The loss scale of a train state (1.0 when it has no precision state)."""
    mp = state.get("precision")
    return jnp.float32(1.0) if mp is None else mp["scale"]


def advance(mp: dict, finite, dynamic: bool) -> dict:
    """Next precision state after a step whose gradients were `finite` (bool scalar).

    dynamic: grow/shrink the scale (fp16); otherwise only count skipped steps (bf16).
    """
    skipped = mp["skipped_steps"] + jnp.where(finite, 0, 1).astype(jnp.int32)
    if not dynamic:
        return {**mp, "skipped_steps": skipped}
    good = jnp.where(finite, mp["good_steps"] + 1, 0)
    grow = good >= GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, mp["scale"] * 2, mp["scale"]),
                      jnp.maximum(mp["scale"] / 2, MIN_SCALE))
    return {"scale": scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
            "skipped_steps": skipped}
