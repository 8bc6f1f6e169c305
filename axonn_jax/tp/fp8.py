"""FP8 matmuls for the tensor-parallel dense layers (`tp.tensor.tp_dense`): e4m3 operands forward,
e5m2 gradients backward, per-tensor *current* scaling, the casts and scale arithmetic from Flax's
`flax.linen.fp8_ops`.

Each operand of a GEMM is scaled by `amax / fp8_max`, the amax taken over the whole (global)
tensor at the moment it is used: the local block's max, then `pmax` over every mesh axis that
holds another piece of it (the tensor axes and the enclosing manual batch axes: `data`, `context`,
`expert`). So every grid quantizes exactly as one device would, and there is no scaling state to
carry, checkpoint, reshard or reduce across data-parallel copies and microbatches (delayed scaling's
amax history would need max, not sum, through every gradient path). This is the recipe of
torchao's float8 training (tensorwise dynamic scaling, its default) and Transformer Engine's
`Float8CurrentScaling`.

The quantized operands are what crosses the wire (all-gathers of rows and of `depth` kernel shards
move float8, half bf16's bytes), and each GEMM reads them as float8 with float32 accumulation, the
two scales applied to its result (`dot`). Written so rather than as a dot of dequantized operands:
compiled for H100, XLA fuses such a dequantization into a bf16 GEMM (measured), while a dot of
float8 operands stays an FP8 GEMM.

A layer runs in FP8 when its `KernelOptions` say so (`tp.options`, `fp8=True`): the train step
passes them to its model with `--fp8`; user code passes them to `parallelize(..., kernels=...)`
or to the layers of `tp.layers` / `tp.layers_nnx`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from ..config import Axis
from .._compat import varying_axes

FORWARD = jnp.float8_e4m3fn
"""Activations and weights in the forward (more mantissa)."""
BACKWARD = jnp.float8_e5m2
"""Output gradients in the backward (more range)."""

TOKEN_AXES = (Axis.DATA, Axis.EXPERT, Axis.CONTEXT)
"""The manual mesh axes of an enclosing step that may split a tensor's tokens: its amax is taken
over those it varies over. Never `pipe`: each stage's tensors are other layers' tensors."""


def scale(x, q_dtype, axes: tuple[str, ...]):
    """The per-tensor scale that maps the global `x` onto `q_dtype`'s range.

    Call inside a shard_map.

    Args:
      x: this device's block of the tensor.
      q_dtype: the float8 dtype to quantize to.
      axes: the manual mesh axes splitting or replicating `x`: the amax is the local block's
        max |x| taken over them too.

    Returns:
      A float32 scalar: `amax / fp8_max` (1 when x is all zeros).
    """
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    if axes:
        amax = jax.lax.pmax(amax, axes)
    return fp8_ops.compute_scale(amax, jnp.float32(1.0), fp8_ops.get_fp8_max(q_dtype, jnp.float32))


def amax_axes(*operands) -> tuple[str, ...]:
    """The enclosing manual `TOKEN_AXES` that any of `operands` varies over.

    Args:
      *operands: arrays, typed with the manual axes they vary over.

    Returns:
      The axes, sorted.
    """
    return tuple(sorted(frozenset().union(*map(varying_axes, operands)) & set(TOKEN_AXES)))


def quantize(x, q_dtype, s):
    """`x / s` saturated to `q_dtype`'s range, as `q_dtype` (Flax's `fp8_ops.quantize`).

    Args:
      x: the array to quantize.
      q_dtype: the float8 dtype.
      s: the scale (`scale`).

    Returns:
      `x / s` as `q_dtype`, the shape of `x`.
    """
    return fp8_ops.quantize(x, q_dtype, s, x.dtype)


def dot(a, b, dimension_numbers, dtype):
    """The GEMM of two quantized operands, float32 accumulation, the scales applied to the result.

    The operands stay float8 with float32 accumulation (`preferred_element_type`), the product of
    the scales applied to the float32 result. XLA compiles it to an FP8 GEMM on Hopper (a Triton
    or cuBLASLt kernel reading float8); XLA:CPU computes the same products exactly in float32.

    Args:
      a: `(q_a, s_a)`: a float8 operand and its scale.
      b: `(q_b, s_b)`: the other.
      dimension_numbers: `jax.lax.dot_general`'s.
      dtype: the result's dtype.

    Returns:
      The product, as `dtype`.
    """
    (qa, sa), (qb, sb) = a, b
    y = jax.lax.dot_general(qa, qb, dimension_numbers, preferred_element_type=jnp.float32)
    return (y * (sa * sb)).astype(dtype)
