"""The exact data-parallel sum of gradients, with the dtype it sends chosen (the wire dtype).

- `float32`: an all-reduce in float32; 16-bit gradients (the device parameters of a step with
  host-offloaded state) are cast up first, so every copy's contribution is summed in float32.
- `bfloat16`: half the bytes. Each device packs its blocks of the gradients (as the tensor axes
  split them; one buffer per set of axes that split them) into a bfloat16 buffer and cuts it into
  one piece per device of the axis; an
  all-to-all hands every device all copies of its own piece, which it sums in float32 and rounds
  to bfloat16 once; an all-gather returns the sum to every device. It sends what a bfloat16 ring
  all-reduce sends, with one rounding of the sum instead of one per ring hop.

`sum_over` is what the layer stack's backward calls on each layer's gradients
(`step.layer_exchange`) and what the reducer calls on the rest (`step.reducers.exact_mean`).
"""
from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import (all_gather_invariant, current_mesh, manual_axes,
                       manual_axis_size, psum, shard_map, varying_axes)

ReduceDtype = Literal["float32", "bfloat16"]
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)


def check_reduce_dtype(dtype: str) -> None:
    """ValueError (one line) unless `dtype` is a wire dtype of the exchange."""
    if dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {dtype!r}")


def _is_16bit(g) -> bool:
    return jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits == 16


def sum_divided(g, axes, divide_by: float = 1):
    """`g`'s sum over the manual mesh `axes` (a name or a tuple; empty: `g` itself) divided by
    `divide_by`, in float32 for a 16-bit `g`, cast back only after the division: a sum of copies
    may exceed float16's range where each copy does not."""
    low = g.dtype if _is_16bit(g) else None
    x = g.astype(jnp.float32) if low else g
    x = psum(x, axes) if axes else x
    x = x if divide_by == 1 else x / divide_by
    return x.astype(low) if low else x


def _sum_packed(leaves: list, axis: str, parts: int, divide_by: int) -> list:
    """The bfloat16 exchange of this device's `leaves` (local blocks) in one buffer."""
    flat = jnp.concatenate([g.astype(jnp.bfloat16).reshape(-1) for g in leaves])
    size = flat.shape[0]
    pieces = jnp.pad(flat, (0, -size % parts)).reshape(parts, -1)
    received = jax.lax.all_to_all(pieces, axis, 0, 0, tiled=False)
    mine = (jnp.sum(received.astype(jnp.float32), axis=0) / divide_by).astype(jnp.bfloat16)
    whole = all_gather_invariant(mine, axis).reshape(-1)[:size]
    out, start = [], 0
    for g in leaves:
        out.append(whole[start:start + g.size].reshape(g.shape).astype(g.dtype))
        start += g.size
    return out


def _automatic(spec: P, manual: set[str]) -> P:
    """`spec` with the axes that are already manual dropped."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def sum_over(tree, axis: str, dtype: str = "float32", specs=None, divide_by: int = 1):
    """The sum over the manual mesh axis `axis` of every leaf of `tree` (gradients varying over
    it), sending `dtype` (module docstring), divided by `divide_by` in float32; each leaf keeps its
    dtype and comes out invariant over `axis`. specs: a tree of PartitionSpecs like `tree`, how
    the mesh's automatic axes split each leaf (None: they split none): a bfloat16 exchange packs
    each device's blocks."""
    parts = manual_axis_size(axis)
    leaves, treedef = jax.tree.flatten(tree)
    if dtype == "float32" or parts == 1 or not leaves:
        return jax.tree.unflatten(treedef, [sum_divided(g, axis, divide_by) for g in leaves])
    manual = set(manual_axes())
    spec_leaves = [P()] * len(leaves) if specs is None else jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P))
    local = [_automatic(s, manual) for s in spec_leaves]
    # One buffer per set of tensor axes that split its leaves and of other manual axes they vary
    # over (a pipeline's embedding gradients over `pipe`): a buffer is typed by all its leaves'.
    groups: dict[tuple[frozenset, frozenset], list[int]] = {}
    for i, s in enumerate(local):
        split = frozenset(n for e in s for n in (e if isinstance(e, tuple) else (e,)) if n)
        groups.setdefault((split, varying_axes(leaves[i])), []).append(i)
    out = list(leaves)
    for (split, _), members in groups.items():
        mine = [leaves[i] for i in members]
        if split:
            specs_in = tuple(local[i] for i in members)
            summed = shard_map(lambda *ls: tuple(_sum_packed(list(ls), axis, parts, divide_by)),
                               mesh=current_mesh(None), in_specs=specs_in, out_specs=specs_in,
                               axis_names=split)(*mine)
        else:
            summed = _sum_packed(mine, axis, parts, divide_by)
        for i, g in zip(members, summed):
            out[i] = g
    return jax.tree.unflatten(treedef, out)

