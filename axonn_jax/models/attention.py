"""The attention core of the built-in models, and the one place that picks its implementation.

`causal_attention(q, k, v, implementation)` is `jax.nn.dot_product_attention` with a causal mask
(grouped-query attention when `k, v` have fewer heads than `q`). Its implementation is one of
`IMPLEMENTATIONS`:

- `xla`: JAX's reference implementation (two einsums around an fp32 softmax); runs everywhere.
- `cudnn`: cuDNN's fused flash attention; a CUDA GPU, bfloat16 or float16, head_dim a multiple
  of 8 and at most 128.
- `auto` (the default): `cudnn` where it can run (see `resolve`), `xla` elsewhere.

A choice that cannot run where it is asked for (`cudnn` on a CPU, in float32) raises a one-line
ValueError (`check`), which `axonn-jax train --attention` shows before anything is compiled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .._compat import mesh_platform, platform_or_default

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def check_choice(choice: str) -> None:
    """ValueError unless `choice` names an implementation."""
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                         f"got {choice!r}")


def _cudnn_problem(dtype, head_dim: int | None, platform: str) -> str | None:
    """Why cuDNN's flash attention cannot run here (None: it can)."""
    if platform != "gpu":
        return f"needs a CUDA GPU (this backend is {platform})"
    if jnp.dtype(dtype) not in tuple(map(jnp.dtype, _CUDNN_DTYPES)):
        return f"needs bfloat16 or float16 (the compute dtype is {jnp.dtype(dtype).name})"
    if head_dim is not None and (head_dim % 8 or head_dim > 128):
        return f"needs head_dim a multiple of 8 and at most 128 (it is {head_dim})"
    return None


def check(choice: str, dtype, head_dim: int | None = None, platform: str | None = None) -> None:
    """ValueError (one line) unless `choice` can run in `dtype` on `platform` (default: the
    platform of the mesh in context, else JAX's default backend; the trainer passes its mesh's)."""
    check_choice(choice)
    if choice == "cudnn":
        problem = _cudnn_problem(dtype, head_dim, platform_or_default(platform))
        if problem:
            raise ValueError(f"--attention cudnn {problem}; use --attention xla or auto")


def resolve(choice: str, dtype, head_dim: int | None = None, platform: str | None = None) -> str:
    """The implementation (`xla` or `cudnn`) that `choice` means for `dtype` and `head_dim` on
    `platform` (default: as `check`): `auto` is `cudnn` wherever cuDNN's flash
    attention can run, else `xla`. ValueError (`check`) for a choice that cannot run."""
    check(choice, dtype, head_dim, platform)
    if choice != "auto":
        return choice
    return "xla" if _cudnn_problem(dtype, head_dim, platform_or_default(platform)) else "cudnn"


def causal_attention(q, k, v, implementation: str = "auto"):
    """Softmax attention with a causal mask, scaled by `head_dim ** -0.5`. q: `(batch, seq, heads,
    head_dim)`; k, v: `(batch, seq, kv_heads, head_dim)` with kv_heads dividing heads: query head
    `h` attends with key/value head `h // (heads / kv_heads)` (grouped-query attention; kv_heads =
    1 is multi-query, = heads multi-head). Returns `(batch, seq, heads, head_dim)` in q's dtype.
    `implementation`: see `resolve`."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not divisible by {k.shape[2]} key/value heads")
    # The platform of the mesh in context (the step's shard_map); outside one, an explicit `cudnn`
    # is trusted (the trainer checked it against its mesh) and `auto` asks the default backend.
    platform = mesh_platform() or ("gpu" if implementation == "cudnn" else None)
    impl = resolve(implementation, q.dtype, q.shape[-1], platform)
    if impl == "xla" and q.dtype == jnp.float16 and platform_or_default() == "cpu":
        # XLA:CPU has no float16 × float16 -> float32 dot, which the xla implementation asks for;
        # its scores and softmax are float32 either way, so computing in float32 changes nothing
        # but the rounding of q, k, v products.
        out = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), is_causal=True,
                                           implementation="xla")
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
