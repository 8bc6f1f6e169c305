"""Ulysses context attention (`--context-attention ulysses`): the sequence split traded for a
heads split by all-to-alls, as in DeepSpeed-Ulysses.

Inside a shard_map manual over the context axis (`C` devices) each device holds q `(rows, 2c,
heads, head_dim)` and k, v `(rows, 2c, kv_heads, head_dim)`: its chunks `i` and `2C-1-i` of the
zig-zag layout (`parallel.context`). One all-to-all each of q, k and v (heads cut in `C`,
sequence concatenated) gives every device the whole sequence, its chunks in device order
(`context.zigzag_order`), for `heads / C` query heads and `kv_heads / C` key/value heads
(device `j`: block `j` of each, a query head's group with its key/value head). It
attends them under the causal mask of the tokens' true sequence indices, `positions` and
`segment_ids` (those two all-gathered: they have no heads dimension), `tile` queries at a time
with an fp32 softmax, so memory holds `tile × seq` scores per head; one all-to-all brings the
output back to the sequence split. The backward pass sends the transposes: an all-to-all of the
output's gradient, then of the q, k and v gradients; between them a flash-attention backward
(residuals: the output and its log-sum-exp) computes each tile's scores again.

Grouped-query attention: `heads` and `kv_heads` must be multiples of `C`, or `kv_heads` a divisor
of `C`: then each key/value head is repeated `C / kv_heads` times before the all-to-all (multi-query
attention over context 8 sends 8 copies of its one head), so every device receives whole heads.

With heads split over the tensor axes (`row` > 1) GSPMD gathers them over those axes before
the all-to-alls, as it does the keys before `allgather`'s all-gather: more bytes than `collectives`
states (2× with multi-head attention at `row` = 2, docs/axes/context.md).

Against the ring (`parallel.context`): per call and device the ring sends the keys and values
`C - 1` times forward (and again with their fp32 gradients backward); Ulysses sends q, k, v and
the output once each way, about `(2·heads + 2·kv_heads) / heads` of q's bytes a pass whatever
`C`. It computes every score of its heads, the masked ones too: 7/6 of the models' every-score
matmul count (the ring's block schedule: `7(2C + 1) / 24C`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import context
from .attention_blocks import (block_backward, block_forward, block_mask, query_tiles,
                               side_inputs, untile)


def check_heads(heads: int, kv_heads: int, size: int) -> None:
    """Check that the query and key/value heads split over `size` devices.

    Args:
      heads: query heads; must be a multiple of `size`.
      kv_heads: key/value heads; a multiple of `size`, or a divisor of it.
      size: the devices on the context axis.

    Raises:
      ValueError: one line, naming the numbers, when they do not split so.
    """
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(f"ulysses attention splits heads over context {size}: {heads} query "
                         f"heads and {kv_heads} key/value heads must be multiples of {size} "
                         "(key/value heads may also divide it)")


def _sent_kv_heads(kv_heads, size):
    """Key/value heads after the repeat that gives every device whole heads."""
    return max(kv_heads, size)


def _sequence_index(size: int, t: int) -> np.ndarray:
    """`(size·t,)`: the sequence index of each token of the gathered sequence (device `d`'s `t`
    tokens, chunks `d` and `2·size-1-d`, in device order)."""
    c = t // 2
    if size == 1:
        return np.arange(t)
    return (context.zigzag_order(size)[:, None] * c + np.arange(c)).reshape(-1)


def _grouped(x, kv_heads: int):
    """`(rows, T, heads, d)` -> `(rows, T, kv_heads, heads / kv_heads, d)`."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _query_tiles(tile: int, index, side: dict, *xs):
    """The per-query inputs cut into tiles of `tile` queries, the tiles first: `index (T,)`,
    side entries `(rows, T)`, `xs` `(rows, T, ...)`."""
    return (index.reshape(-1, tile), {n: query_tiles(x, tile, 1) for n, x in side.items()},
            *(query_tiles(x, tile, 1) for x in xs))


def _local_forward(tile, q, k, v, index, side):
    """(output in q's dtype, log-sum-exp `(rows, T, kv_heads, groups)` fp32) of causal attention
    over one device's heads of the whole sequence, `tile` queries at a time."""
    scale = q.shape[-1] ** -0.5

    def one(x):
        q_index, q_side, q_tile = x
        mask = block_mask(q_index, index, q_side, side)
        return block_forward(q_tile, k, v, mask, scale)
    o, lse = lax.map(one, _query_tiles(tile, index, side, _grouped(q, k.shape[2])))
    return untile(o, 1).astype(q.dtype).reshape(q.shape), untile(lse, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend_local(tile, q, k, v, index, side):
    return _local_forward(tile, q, k, v, index, side)[0]


def _attend_local_fwd(tile, q, k, v, index, side):
    out, lse = _local_forward(tile, q, k, v, index, side)
    return out, (q, k, v, index, side, out, lse)


def _attend_local_bwd(tile, residuals, d_out):
    q, k, v, index, side, out, lse = residuals
    kv_heads, scale = k.shape[2], q.shape[-1] ** -0.5
    do = _grouped(d_out, kv_heads)
    delta = jnp.sum(do.astype(jnp.float32) * _grouped(out, kv_heads).astype(jnp.float32), -1)

    def one(acc, x):
        q_index, q_side, q_tile, lse_tile, do_tile, delta_tile = x
        mask = block_mask(q_index, index, q_side, side)
        dq, dk, dv = block_backward(q_tile, k, v, mask, lse_tile, do_tile, delta_tile,
                                             scale)
        return (acc[0] + dk, acc[1] + dv), dq
    zeros = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    (dk, dv), dq = lax.scan(one, zeros, _query_tiles(tile, index, side, _grouped(q, kv_heads),
                                                     lse, do, delta))
    return (untile(dq, 1).astype(q.dtype).reshape(q.shape), dk.astype(k.dtype),
            dv.astype(v.dtype), None, jax.tree.map(lambda _: None, side))


_attend_local.defvjp(_attend_local_fwd, _attend_local_bwd)


def attend(q, k, v, segment_ids, positions, *, axis: str, size: int, tile: int):
    """Causal attention over the whole sequence by the Ulysses all-to-alls (`Scheme.attend`).

    The all-to-alls, mask and tiles of the module docstring; inside a shard_map manual over
    `axis` when `size > 1` (elsewhere one device's attention through the same tiles).

    Args:
      q: `(rows, 2c, heads, head_dim)`, this device's chunks `i` and `2C-1-i` (dim 1 split over
        `axis` in the zig-zag layout).
      k: `(rows, 2c, kv_heads, head_dim)`, in the same layout.
      v: like `k`.
      segment_ids: `(rows, 2c)` integers in the same layout, or None.
      positions: `(rows, 2c)` integers in the same layout, or None (the layout's).
      axis: the mesh axis the sequence is split over.
      size: its devices.
      tile: queries at a time (it divides `c`).

    Returns:
      `(rows, 2c, heads, head_dim)` in q's dtype, in the zig-zag layout. ValueError unless the
      heads split over `size` (`check_heads`).
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    check_heads(heads, kv_heads, size)
    side = side_inputs(segment_ids, positions)
    index = jnp.asarray(_sequence_index(size, q.shape[1]), jnp.int32)
    if size == 1:
        return _attend_local(tile, q, k, v, index, side)
    if kv_heads < size:  # every device receives whole key/value heads
        k, v = (jnp.repeat(x, size // kv_heads, axis=2) for x in (k, v))
    to_heads = lambda x: lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
    side = {n: lax.all_gather(x, axis, axis=1, tiled=True) for n, x in side.items()}
    out = _attend_local(tile, to_heads(q), to_heads(k), to_heads(v), index, side)
    return lax.all_to_all(out, axis, 1, 2, tiled=True)  # back to the sequence split


def collectives(q_shape, kv_shape, dtype, size, *, axis, segment_ids, positions, backward,
                home_dtype):
    """What one `attend` call sends per device (`Scheme.collectives`).

    Forward one all-to-all each of q, k, v (`kv_heads` repeated up to `size` when fewer) and the
    output; backward the same bytes again (the output's gradient, then the q, k, v gradients, in
    `dtype`); the segment ids and positions (int32) all-gathered once, forward.

    Args:
      q_shape: the per-device queries `(rows, 2c, heads, head_dim)`.
      kv_shape: the per-device keys (= values) `(rows, 2c, kv_heads, head_dim)`.
      dtype: theirs.
      size: devices on `axis` (> 1).
      axis: the mesh axis.
      segment_ids: whether segment ids are gathered.
      positions: whether positions are gathered.
      backward: whether to count the backward pass.
      home_dtype: unused (the ring's).

    Returns:
      `[(kind, axis, bytes)]` in `analysis.hlo`'s full-buffer convention.
    """
    rows, t, kv_heads, head_dim = kv_shape
    item = jnp.dtype(dtype).itemsize
    per_pass = (2 * math.prod(q_shape) + 2 * rows * t * _sent_kv_heads(kv_heads, size) * head_dim) \
        * item
    out = [("all-to-all", axis, (2 if backward else 1) * per_pass)]
    side = int(segment_ids) + int(positions)
    return out + ([("all-gather", axis, side * rows * t * size * 4)] if side else [])


def flops_share(size: int) -> float:
    """`Scheme.flops_share`: every score of its heads at 7 matmuls against the models' 6.

    2 matmuls forward and 5 backward (the scores again) against the models' 6.

    Args:
      size: the devices on the context axis (the share does not depend on it).

    Returns:
      7/6.
    """
    return 7 / 6


def working_bytes(q_shape, kv_shape, size, query_tile, compute_bytes) -> float:
    """`Scheme.working_bytes`: the temporary bytes of one call per device.

    The fp32 scores and probabilities of one tile of queries over the whole sequence for
    `heads / size` heads, and the received q, k, v and output with, backward, their fp32
    gradients.

    Args:
      q_shape: the per-device query shape `(rows, 2c, heads, head_dim)`.
      kv_shape: the per-device key (= value) shape `(rows, 2c, kv_heads, head_dim)`.
      size: the devices on the context axis.
      query_tile: queries at a time.
      compute_bytes: bytes of an element of the compute dtype.

    Returns:
      The bytes.
    """
    rows, t, heads, head_dim = q_shape
    tile = min(query_tile, t / 2)
    scores = 2 * rows * heads * tile * t * 4  # (heads / size) × tile × (size · t)
    elements = 2 * math.prod(q_shape) + 2 * rows * t * _sent_kv_heads(kv_shape[2], size) * head_dim
    return scores + elements * (compute_bytes + 4)


SCHEME = context.register(context.Scheme("ulysses", attend, collectives, flops_share,
                                         working_bytes))
