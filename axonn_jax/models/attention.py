"""The attention core of the built-in models, and the one place that picks its implementation.

`causal_attention(q, k, v, implementation, segment_ids=, positions=)` is
`jax.nn.dot_product_attention` with a causal mask (grouped-query attention when `k, v` have fewer
heads than `q`), optionally restricted to segments (packed documents) and to true positions.
Inside a shard_map manual over a context axis of more than one device it is the context-parallel
attention of `axonn_jax.parallel.context` (ring or all-gather) instead. A user's model calls it
the same way. Its implementation is one of `IMPLEMENTATIONS`:

- `xla`: JAX's reference implementation (two einsums around an fp32 softmax); runs everywhere.
- `cudnn`: cuDNN's fused flash attention; a CUDA GPU, bfloat16 or float16, head_dim a multiple
  of 8 and at most 128.
- `auto` (the default): `cudnn` where it can run (see `resolve`), `xla` elsewhere.

A choice that cannot run where it is asked for (`cudnn` on a CPU, in float32) raises a one-line
ValueError (`check`), which `axonn-jax train --attention` shows before anything is compiled.

Masks on cuDNN: `jax.nn.dot_product_attention` hands cuDNN a boolean mask as an additive bias
`(rows, 1, seq, seq)` (cuDNN's packed-sequence offsets are not in its public API), so segment ids
or positions cost a `rows·seq²` bias in memory there; without them the mask is cuDNN's own causal
mask. The context-parallel kernels compute their blocks with XLA einsums (an fp32 online softmax)
whatever the implementation: `cudnn` named explicitly there is refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..parallel import context

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
    """ValueError (one line) unless `choice` can run in `dtype` on `platform` (default: JAX's
    default backend)."""
    check_choice(choice)
    if choice == "cudnn":
        problem = _cudnn_problem(dtype, head_dim, platform or jax.default_backend())
        if problem:
            raise ValueError(f"--attention cudnn {problem}; use --attention xla or auto")


def resolve(choice: str, dtype, head_dim: int | None = None, platform: str | None = None) -> str:
    """The implementation (`xla` or `cudnn`) that `choice` means for `dtype` and `head_dim` on
    `platform` (default: JAX's default backend): `auto` is `cudnn` wherever cuDNN's flash
    attention can run, else `xla`. ValueError (`check`) for a choice that cannot run."""
    check(choice, dtype, head_dim, platform)
    if choice != "auto":
        return choice
    return "xla" if _cudnn_problem(dtype, head_dim, platform or jax.default_backend()) else "cudnn"


def causal_attention(q, k, v, implementation: str = "auto", *, segment_ids=None, positions=None,
                     context_axis: str = "context", context_scheme: str = "ring"):
    """Softmax attention with a causal mask, scaled by `head_dim ** -0.5`. q: `(rows, seq, heads,
    head_dim)`; k, v: `(rows, seq, kv_heads, head_dim)` with kv_heads dividing heads: query head
    `h` attends with key/value head `h // (heads / kv_heads)` (grouped-query attention; kv_heads =
    1 is multi-query, = heads multi-head). Returns `(rows, seq, heads, head_dim)` in q's dtype.

    A query attends to the keys not later in the sequence, not later by `positions` and in its
    segment (`segment_ids`); both `(rows, seq)` integers, optional (packed documents: ids per
    document, positions restarting at each). Inside a shard_map manual over `context_axis`
    (more than one device) the sequence is split over it in the zig-zag layout and
    `context_scheme` (`ring`, `allgather`) attends across it (`parallel.context.attention`).
    `implementation`: see `resolve`."""
    context.check_scheme(context_scheme)
    if context.axis_size(context_axis) > 1:
        if implementation == "cudnn":
            raise ValueError("--attention cudnn does not run inside context parallelism (its "
                             "blocks are XLA einsums); use --attention xla or auto")
        check_choice(implementation)
        return context.attention(q, k, v, axis=context_axis, scheme=context_scheme,
                                 segment_ids=segment_ids, positions=positions)
    context.check_inputs(q, k, v, segment_ids, positions)
    impl = resolve(implementation, q.dtype, q.shape[-1])
    mask = None
    if segment_ids is not None or positions is not None:
        mask = context.causal_mask(q.shape[1], segment_ids, positions)[:, None]
    if impl == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no float16 × float16 -> float32 dot, which the xla implementation asks for;
        # its scores and softmax are float32 either way, so computing in float32 changes nothing
        # but the rounding of q, k, v products.
        out = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), mask=mask, is_causal=True,
                                           implementation="xla")
        return out.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)


def positions_or_none(positions, seq_len: int, context_axis: str = "context"):
    """The true positions a block needs for its position encoding: `positions` when given, the
    context layout's `(1, seq_len)` inside a shard_map manual over `context_axis`, else None
    (positions are `arange(seq_len)`)."""
    if positions is not None:
        return positions
    if context.axis_size(context_axis) > 1:
        return context.positions(seq_len, context_axis)[None]
    return None
