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

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import mesh_platform, nested_shard_map, platform_or_default

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
    if impl == "cudnn":
        return fully_manual(_cudnn, q, k, v)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def fully_manual(core, q, k, v):
    """`core(q, k, v)` (an attention core: cuDNN's), inside a partially manual shard_map run in a
    nested shard_map manual over the mesh's other axes too. JAX partitions the cuDNN call with a
    custom partitioner that refuses manual shardings (the train step's shard_map is manual over
    `data` or `pipe`), and lowers it as it is where every axis is manual. The nested specs are
    those `tp.tensor` gives the output of a normal (non-transposed) layer, which q, k and v are in
    the built-in models (`_manual_specs`); inputs laid out otherwise are still correct (moved into
    these specs). Elsewhere (no shard_map, or every axis manual) `core(q, k, v)` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes or mesh.are_all_axes_manual:
        return core(q, k, v)
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    q_spec, kv_spec, heads_axis = _manual_specs(q, k, auto, dict(mesh.shape))
    groups = q.shape[2] // k.shape[2]

    def local(q, k, v):
        if heads_axis is not None and kv_spec[2] is None:
            # This device's query heads all share one key/value head of the whole set.
            start = jax.lax.axis_index(heads_axis) * q.shape[2] // groups
            k, v = (jax.lax.dynamic_slice_in_dim(a, start, 1, axis=2) for a in (k, v))
        return core(q, k, v)

    return nested_shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                            out_specs=q_spec, axis_names=auto)(q, k, v)


def _manual_specs(q, k, auto, sizes):
    """(q's spec, k's and v's spec, the axis splitting the heads or None) over the `auto` axes:
    the layout of a normal layer's output in `tp.tensor` (batch over `depth`, and `col` where the
    layer keeps the batch split; heads over `row`), without the splits that do not divide. Key and
    value heads that do not divide over `row` stay whole where each device's query heads share one
    of them (a Llama's replicated key/value projections)."""
    from ..tp.tensor import split_batch

    if not {"depth", "row", "col"} <= set(sizes):  # not the tensor-parallel layout's mesh
        batch_axes = ()
    else:
        batch_axes = ("depth", "col") if split_batch(q.shape, None, False) else ("depth",)
    batch_axes = tuple(a for a in batch_axes if a in auto and sizes[a] > 1)
    if q.shape[0] % math.prod(sizes[a] for a in batch_axes):
        batch_axes = ()
    row = sizes.get("row", 1) if "row" in auto else 1
    heads, kv_heads = q.shape[2], k.shape[2]
    heads_axis = "row" if row > 1 and heads % row == 0 and (
        kv_heads % row == 0 or (heads // kv_heads) % (heads // row) == 0) else None
    batch = batch_axes or None
    q_spec = P(batch, None, heads_axis, None)
    kv_split = heads_axis if heads_axis and kv_heads % row == 0 else None
    return q_spec, P(batch, None, kv_split, None), heads_axis
