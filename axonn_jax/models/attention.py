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

Masks: with segment ids or positions the mask is an explicit `(rows, 1, seq, seq)` boolean, which
XLA's implementation takes; `auto` picks it then, and `cudnn` named explicitly is refused (cuDNN's
packed-sequence offsets are not in JAX's public API; handing it the mask as an additive bias would
cost a `rows·seq²` buffer). Without them cuDNN uses its own causal mask. The context-parallel
kernels compute their blocks with XLA einsums (an fp32 online softmax) whatever the
implementation: `cudnn` named explicitly there is refused.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..config import TENSOR_AXES, Axis
from .._compat import mesh_platform, nested_shard_map, platform_or_default
from ..checks import check_choice
from ..parallel import context
from ..parallel.attention_blocks import causal_mask

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
DOCUMENT_INPUTS = ("segment_ids", "positions")
"""The batch entries (packed documents) the built-in models' blocks take as side inputs."""
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def check_implementation(choice: str) -> None:
    """Raise ValueError unless `choice` names an implementation.

    Args:
      choice: an attention implementation's name.

    Raises:
      ValueError: `choice` is not one of `IMPLEMENTATIONS`.
    """
    check_choice("attention implementation", choice, IMPLEMENTATIONS)


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
    """Raise a one-line ValueError unless `choice` can run in `dtype` on `platform`.

    Args:
      choice: one of `IMPLEMENTATIONS`.
      dtype: the compute dtype of q, k and v.
      head_dim: features of one head; None: not checked.
      platform: the backend it runs on; None: the platform of the mesh in context, else JAX's
        default backend (the trainer passes its mesh's).

    Raises:
      ValueError: `choice` is not an implementation, or is `cudnn` where cuDNN's flash attention
        cannot run (not a CUDA GPU, not bfloat16 or float16, head_dim not a multiple of 8 or
        above 128).
    """
    check_implementation(choice)
    if choice == "cudnn":
        problem = _cudnn_problem(dtype, head_dim, platform_or_default(platform))
        if problem:
            raise ValueError(f"--attention cudnn {problem}; use --attention xla or auto")


def resolve(choice: str, dtype, head_dim: int | None = None, platform: str | None = None) -> str:
    """The implementation (`xla` or `cudnn`) that `choice` means for `dtype` and `head_dim`.

    Args:
      choice: one of `IMPLEMENTATIONS`.
      dtype: the compute dtype of q, k and v.
      head_dim: features of one head; None: not checked.
      platform: the backend it runs on; None: as `check`.

    Returns:
      `choice` itself unless it is `auto`; `auto` is `cudnn` wherever cuDNN's flash attention
      can run, else `xla`.

    Raises:
      ValueError: from `check`, for a choice that cannot run.
    """
    check(choice, dtype, head_dim, platform)
    if choice != "auto":
        return choice
    return "xla" if _cudnn_problem(dtype, head_dim, platform_or_default(platform)) else "cudnn"


def causal_attention(q, k, v, implementation: str = "auto", *, segment_ids=None, positions=None,
                     context_axis: str = Axis.CONTEXT, context_scheme: str = "ring",
                     replicated_rows: bool = False):
    """Softmax attention with a causal mask, scaled by `head_dim ** -0.5`.

    Query head `h` attends with key/value head `h // (heads / kv_heads)` (grouped-query
    attention; kv_heads = 1 is multi-query, = heads multi-head).

    A query attends to the keys not later in the sequence, not later by `positions` and in its
    segment (`segment_ids`); both `(rows, seq)` integers, optional (packed documents: ids per
    document, positions restarting at each). Inside a shard_map manual over `context_axis`
    (more than one device) the sequence is split over it in the zig-zag layout and
    `context_scheme` (a name in `parallel.context.SCHEMES`) attends across it (`parallel.context.attention`).

    Args:
      q: queries, shape `(rows, seq, heads, head_dim)`.
      k: keys, shape `(rows, seq, kv_heads, head_dim)`, kv_heads dividing heads.
      v: values, shaped like `k`.
      implementation: one of `IMPLEMENTATIONS`; see `resolve`.
      segment_ids: `(rows, seq)` integer document ids, or None (one document).
      positions: `(rows, seq)` integer true positions, or None (positions in order).
      context_axis: the mesh axis that splits the sequence inside a manual shard_map.
      context_scheme: the context-parallel scheme, a name in `parallel.context.SCHEMES`.
      replicated_rows: q, k, v come from tensor-parallel layers in the replicated layout
        (`tp.options.KernelOptions.replicated_rows`; `fully_manual`).

    Returns:
      The attended values, shape `(rows, seq, heads, head_dim)`, in q's dtype.

    Raises:
      ValueError: an unknown implementation or scheme; `cudnn` inside context parallelism, with
        document masks, or where it cannot run (`check`).
    """
    context.check_scheme(context_scheme)
    if context.axis_size(context_axis) > 1:
        if implementation == "cudnn":
            raise ValueError("--attention cudnn does not run inside context parallelism (its "
                             "blocks are XLA einsums); use --attention xla or auto")
        check_implementation(implementation)
        return context.attention(q, k, v, axis=context_axis, scheme=context_scheme,
                                 segment_ids=segment_ids, positions=positions)
    context.check_inputs(q, k, v, segment_ids, positions)
    # The platform of the mesh in context (the step's shard_map); outside one, an explicit `cudnn`
    # is trusted (the trainer checked it against its mesh) and `auto` asks the default backend.
    platform = mesh_platform() or ("gpu" if implementation == "cudnn" else None)
    impl = resolve(implementation, q.dtype, q.shape[-1], platform)
    mask = None
    if segment_ids is not None or positions is not None:
        if implementation == "cudnn":
            raise ValueError("--attention cudnn with document masks (segment ids, positions) is "
                             "not implemented yet; use --attention xla or auto")
        impl = "xla"
        mask = causal_mask(q.shape[1], segment_ids, positions)[:, None]
    if impl == "xla" and q.dtype == jnp.float16 and platform_or_default() == "cpu":
        # XLA:CPU has no float16 × float16 -> float32 dot, which the xla implementation asks for;
        # its scores and softmax are float32 either way, so computing in float32 changes nothing
        # but the rounding of q, k, v products.
        out = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), mask=mask, is_causal=True,
                                           implementation="xla")
        return out.astype(q.dtype)
    if impl == "cudnn":
        return fully_manual(_cudnn, q, k, v, replicated_rows)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)


def positions_or_none(positions, seq_len: int, context_axis: str = Axis.CONTEXT):
    """The true positions a block needs for its position encoding, or None for `arange`.

    Args:
      positions: the batch's `(rows, seq)` positions, or None.
      seq_len: this device's tokens per sequence.
      context_axis: the mesh axis that splits the sequence inside a manual shard_map.

    Returns:
      `positions` when given, the context layout's `(1, seq_len)` inside a shard_map manual over
      `context_axis` (of more than one device), else None (positions are `arange(seq_len)`).
    """
    if positions is not None:
        return positions
    if context.axis_size(context_axis) > 1:
        return context.positions(seq_len, context_axis)[None]
    return None


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def fully_manual(core, q, k, v, replicated_rows: bool = False):
    """`core(q, k, v)` run in a shard_map manual over every mesh axis that is not manual yet.

    The shard_map is nested inside the train step's shard_map (manual over `data` or `pipe`), or
    at the top of a step that has none (`data` = 1 beside tensor axes; the step traces its model
    under its mesh, `_compat.tracing_in`). JAX partitions the cuDNN
    call with a custom partitioner that refuses manual shardings and that exists only where a
    CUDA backend does (not for abstract H100s compiled from a CPU host), and lowers it as it is
    where every axis is manual: one mechanism for every grid. The nested specs are those
    `tp.tensor` gives the output of a normal (non-transposed) layer, which q, k and v are in
    the built-in models (`_manual_specs`; `replicated_rows`: of a layer in the replicated
    layout); inputs laid out otherwise are still correct (moved into these specs). With no mesh
    in context (a model called outside a step), every axis manual, or one device (nothing to
    partition; the nested shard_map's VJP would run the forward again), `core(q, k, v)` as it
    is.

    Args:
      core: an attention core `(q, k, v) -> out` (cuDNN's).
      q: queries, shape `(rows, seq, heads, head_dim)`.
      k: keys, shape `(rows, seq, kv_heads, head_dim)`.
      v: values, shaped like `k`.
      replicated_rows: the inputs come from a layer in the replicated layout.

    Returns:
      `core`'s output, shape `(rows, seq, heads, head_dim)`, in q's nested spec: rows over
      `depth` (and `col` where a normal layer keeps the batch split), heads over `row`, each
      where it divides.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual or mesh.size == 1:
        return core(q, k, v)
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    q_spec, kv_spec, heads_axis = _manual_specs(q, k, auto, dict(mesh.shape), replicated_rows)
    groups = q.shape[2] // k.shape[2]

    def local(q, k, v):
        if heads_axis is not None and kv_spec[2] is None:
            # This device's query heads all share one key/value head of the whole set.
            start = jax.lax.axis_index(heads_axis) * q.shape[2] // groups
            k, v = (jax.lax.dynamic_slice_in_dim(a, start, 1, axis=2) for a in (k, v))
        return core(q, k, v)

    return nested_shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                            out_specs=q_spec, axis_names=auto)(q, k, v)


def _manual_specs(q, k, auto, sizes, replicated_rows: bool = False):
    """(q's spec, k's and v's spec, the axis splitting the heads or None) over the `auto` axes:
    the layout of a normal layer's output in `tp.tensor` (batch over `depth`, and `col` where the
    layer keeps the batch split; heads over `row`), without the splits that do not divide. Key and
    value heads that do not divide over `row` stay whole where each device's query heads share one
    of them (a Llama's replicated key/value projections)."""
    from ..tp.tensor import split_batch

    if not set(TENSOR_AXES) <= set(sizes):  # not the tensor-parallel layout's mesh
        batch_axes = ()
    else:
        split = split_batch(q.shape, None, False, replicated_rows)
        batch_axes = (Axis.DEPTH, Axis.COL) if split else (Axis.DEPTH,)
    batch_axes = tuple(a for a in batch_axes if a in auto and sizes[a] > 1)
    if q.shape[0] % math.prod(sizes[a] for a in batch_axes):
        batch_axes = ()
    row = sizes.get(Axis.ROW, 1) if Axis.ROW in auto else 1
    heads, kv_heads = q.shape[2], k.shape[2]
    heads_axis = Axis.ROW if row > 1 and heads % row == 0 and (
        kv_heads % row == 0 or (heads // kv_heads) % (heads // row) == 0) else None
    batch = batch_axes or None
    q_spec = P(batch, None, heads_axis, None)
    kv_split = heads_axis if heads_axis and kv_heads % row == 0 else None
    return q_spec, P(batch, None, kv_split, None), heads_axis
