"""Flash-attention blocks: one query block against one key block, forward and backward, in
float32 with a log-sum-exp, the pieces that the context-parallel schemes (`parallel.context`'s
ring and all-gather, `parallel.ulysses`) schedule across devices.

Layouts: queries `(rows, tq, kv_heads, groups, d)` (grouped-query attention: `groups` query
heads per key/value head), keys and values `(rows, tk, kv_heads, d)`, masks `(rows or 1, tq,
tk)` bool, log-sum-exps `(rows, tq, kv_heads, groups)` float32.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

NEG = -0.7 * float(np.finfo(np.float32).max)
"""A finite -inf: the score of a masked key (exp of it minus any finite max is 0)."""
_TINY = 1e-30  # a row's sum of probabilities is >= 1 unless the block hides the whole row


def block_mask(q_index, k_index, q_side, k_side):
    """Where each query of a block may attend to each key of a block.

    Args:
      q_index: `(tq,)` the queries' places in the sequence.
      k_index: `(tk,)` the keys' places.
      q_side: `side_inputs` of the queries: optional `pos` and `seg`, `(rows, tq)` each.
      k_side: the same of the keys, `(rows, tk)` each.

    Returns:
      `(rows or 1, tq, tk)` bool: the key not later in the sequence, not later by position,
      in the same segment.
    """
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if "pos" in q_side:
        mask = mask & (k_side["pos"][:, None, :] <= q_side["pos"][:, :, None])
    if "seg" in q_side:
        mask = mask & (k_side["seg"][:, None, :] == q_side["seg"][:, :, None])
    return mask


def side_inputs(segment_ids, positions) -> dict:
    """The optional per-token inputs of the mask, by the names `block_mask` reads.

    Args:
      segment_ids: `(rows, t)` integers, or None.
      positions: `(rows, t)` integers, or None.

    Returns:
      `{"seg": segment_ids, "pos": positions}` without the None ones.
    """
    return {n: x for n, x in (("seg", segment_ids), ("pos", positions)) if x is not None}


def causal_mask(seq_len: int, segment_ids=None, positions=None):
    """The causal mask of one device: True where query `t` may attend to key `s`.

    That is where `s <= t`, `s` is not later by `positions` and in the same segment.

    Args:
      seq_len: the sequence length.
      segment_ids: `(rows, seq)` integers, or None.
      positions: `(rows, seq)` integers, or None.

    Returns:
      `(rows or 1, seq, seq)` bool.
    """
    side = side_inputs(segment_ids, positions)
    index = jnp.arange(seq_len)
    return block_mask(index, index, side, side)


def block_forward(q, k, v, mask, scale):
    """Attention of a query block over a key block, normalized over this block.

    Args:
      q: `(rows, tq, kv_heads, groups, d)`.
      k: `(rows, tk, kv_heads, d)`.
      v: `(rows, tk, kv_heads, d)`.
      mask: `(rows or 1, tq, tk)` bool.
      scale: the scores' scale.

    Returns:
      `(output, lse)`: output fp32 shaped like `q`, log-sum-exp `(rows, tq, kv_heads, groups)`
      fp32, below `NEG / 2` for rows the block hides (whose output is 0).
    """
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, NEG)
    # A hidden row's max stays at NEG / 2, so its masked scores still give exp(...) = 0.
    m = jnp.maximum(jnp.max(s, axis=-1), NEG / 2)
    p = jnp.exp(s - m[..., None])
    total = jnp.maximum(jnp.sum(p, axis=-1), _TINY)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    to_rows = lambda x: jnp.moveaxis(x, -1, 1)  # noqa: E731  (b,k,g,q) -> (b,q,k,g)
    return o / to_rows(total)[..., None], to_rows(m + jnp.log(total))


def query_tiles(x, tile: int, axis: int):
    """`x` with its queries cut into tiles, the tiles in front.

    Args:
      x: any array whose dim `axis` holds queries.
      tile: queries per tile (divides that dim).
      axis: the queries' dim.

    Returns:
      `(n, ...)`: `axis` cut into `(n, tile)`, the `n` tiles moved to the front.
    """
    shape = x.shape[:axis] + (x.shape[axis] // tile, tile) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def untile(x, axis: int):
    """The inverse of `query_tiles`.

    Args:
      x: `(n, ...)` tiles.
      axis: the queries' dim of the result.

    Returns:
      The tiles joined along `axis`.
    """
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def tiled_forward(q, k, v, mask, scale, tile):
    """`block_forward` one tile of queries at a time (a loop).

    The scores in memory are `tile × tk` per head, not `tq × tk`.

    Args:
      q, k, v, mask, scale: as `block_forward`'s.
      tile: queries per tile.

    Returns:
      `block_forward`'s `(output, lse)`.
    """
    if q.shape[1] <= tile:
        return block_forward(q, k, v, mask, scale)
    o, lse = lax.map(lambda qm: block_forward(qm[0], k, v, qm[1], scale),
                     (query_tiles(q, tile, 1), query_tiles(mask, tile, 1)))
    return untile(o, 1), untile(lse, 1)


def tiled_backward(q, k, v, mask, lse, do, delta, scale, tile):
    """`block_backward` one tile of queries at a time, summing the key/value gradients.

    Args:
      q, k, v, mask, lse, do, delta, scale: as `block_backward`'s.
      tile: queries per tile.

    Returns:
      `block_backward`'s `(dq, dk, dv)`.
    """
    if q.shape[1] <= tile:
        return block_backward(q, k, v, mask, lse, do, delta, scale)

    def one(acc, x):
        dq, dk, dv = block_backward(x[0], k, v, x[1], *x[2:], scale)
        return (acc[0] + dk, acc[1] + dv), dq
    zero = jnp.zeros_like(k, jnp.float32)
    (dk, dv), dq = lax.scan(one, (zero, jnp.zeros_like(v, jnp.float32)),
                            tuple(query_tiles(x, tile, 1) for x in (q, mask, lse, do, delta)))
    return untile(dq, 1), dk, dv


def merge(o, lse, o_block, lse_block):
    """Online softmax: the output and log-sum-exp over the union of two disjoint key sets.

    Args:
      o: the output over the first set, like `block_forward`'s.
      lse: its log-sum-exp (finite).
      o_block: the output over the second set.
      lse_block: its log-sum-exp (finite).

    Returns:
      `(output, lse)` over both sets.
    """
    top = jnp.maximum(lse, lse_block)
    new = top + jnp.log(jnp.exp(lse - top) + jnp.exp(lse_block - top))
    return (o * jnp.exp(lse - new)[..., None] + o_block * jnp.exp(lse_block - new)[..., None],
            new)


def block_backward(q, k, v, mask, lse, do, delta, scale):
    """The gradients of one block, recomputing its probabilities (flash attention's backward).

    Args:
      q, k, v, mask, scale: as `block_forward`'s.
      lse: the whole attention's log-sum-exp, `(rows, tq, kv_heads, groups)`, finite.
      do: the output's cotangent, like `q`.
      delta: `sum(do · o)` over the head dim, like `lse`.

    Returns:
      `(dq, dk, dv)`, fp32, shaped like `q`, `k`, `v`.
    """
    to_heads = lambda x: jnp.moveaxis(x, 1, -1)[..., None]  # noqa: E731  (b,q,k,g) -> (b,k,g,q,1)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    p = jnp.exp(jnp.where(mask[:, None, None], s, NEG) - to_heads(lse))  # lse is finite
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - to_heads(delta))
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k,
                    preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), q,
                    preferred_element_type=jnp.float32) * scale
    return dq, dk, dv
