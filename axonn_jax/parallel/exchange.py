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
import numpy as np
from jax.sharding import PartitionSpec as P

from .._compat import (all_gather_invariant, current_mesh, manual_axes,
                       manual_axis_size, psum, psum_scatter, shard_map, varying_axes)
from ..checks import check_choice

ReduceDtype = Literal["float32", "bfloat16"]
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)


def check_reduce_dtype(dtype: str) -> None:
    """Raise a one-line ValueError unless `dtype` is a wire dtype of the exchange.

    Args:
      dtype: the requested wire dtype.

    Raises:
      ValueError: `dtype` is not one of `REDUCE_DTYPES`.
    """
    check_choice("reduce_dtype", dtype, REDUCE_DTYPES)


def _size(axis) -> int:
    """The devices of a manual mesh axis or of a tuple of them (1 where none is manual)."""
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([manual_axis_size(a) for a in names]))


def _is_16bit(g) -> bool:
    return jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits == 16


def sum_divided(g, axes, divide_by: float = 1):
    """`g`'s sum over the manual mesh `axes`, divided by `divide_by`.

    A 16-bit `g` is summed in float32 and cast back only after the division: a sum of copies may
    exceed float16's range where each copy does not.

    Args:
      g: an array varying over `axes`.
      axes: a manual mesh axis name or a tuple of them; empty: no sum.
      divide_by: the sum is divided by it.

    Returns:
      The divided sum, in `g`'s dtype and shape, invariant over `axes`.
    """
    low = g.dtype if _is_16bit(g) else None
    x = g.astype(jnp.float32) if low else g
    x = psum(x, axes) if axes else x
    x = x if divide_by == 1 else x / divide_by
    return x.astype(low) if low else x


def spec_axes(spec) -> frozenset[str]:
    """The mesh axes a PartitionSpec splits its array over.

    Args:
      spec: a PartitionSpec (entries None, an axis name or a tuple of them).

    Returns:
      The names of every axis it names.
    """
    return frozenset(n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n)


def _unsplit_axes(g, spec, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `axes` gradient `g` is still a partial sum over: not splitting its parameter
    (`spec`), and `g` varying over them."""
    return tuple(a for a in axes if a not in spec_axes(spec) and a in varying_axes(g))


def sum_over_unsplit(tree, specs, axes: tuple[str, ...], divide_by: float = 1):
    """Every leaf of `tree` summed over those of the manual `axes` it is a partial sum over.

    A leaf is a partial sum over an axis that splits the batch but not its parameter (its spec
    does not name the axis) while it still varies over it; one already summed there (invariant)
    or split there (an expert's weights over `expert`: the all-to-all's transpose already brought
    it every shard's tokens) is only divided.

    Args:
      tree: gradients, any pytree of arrays.
      specs: PartitionSpecs like `tree`, each naming the mesh axes its parameter is split over.
      axes: manual mesh axes that split the batch (`data`, `expert`, `context`).
      divide_by: every leaf is divided by it (16-bit leaves in float32, `sum_divided`).

    Returns:
      `tree`, each leaf summed and divided, in its own dtype.
    """
    return jax.tree.map(lambda g, spec: sum_divided(g, _unsplit_axes(g, spec, axes), divide_by),
                        tree, specs)


def sum_over_unsplit_stages(axes: tuple[str, ...], dtype: str = "float32", specs=None) -> tuple:
    """`sum_over_unsplit` (undivided) as stages, sending `dtype`.

    The leaves that sum over the same axes are exchanged together by `sum_over_stages` over
    those axes: in bfloat16 an expert's weights are packed apart from the layer's shared
    parameters, which sum over `expert` as well.

    Args:
      axes: manual mesh axes that split the batch.
      dtype: the wire dtype (module docstring).
      specs: PartitionSpecs like the gradients, each naming the mesh axes its parameter is split
        over.

    Returns:
      The stages, applied in order to a tree of gradients (two in bfloat16: each group's
      all-to-all, then its all-gather).
    """
    if dtype == "float32":
        return (lambda tree: sum_over_unsplit(tree, specs, axes),)
    layout = {}  # the first stage's groups, which the second reads (static per tree structure)

    def scatter(tree):
        leaves, treedef = jax.tree.flatten(tree)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, (g, spec) in enumerate(zip(leaves, spec_leaves)):
            groups.setdefault(_unsplit_axes(g, spec, axes), []).append(i)
        plans = [(members, sum_over_stages(over, dtype, [spec_leaves[i] for i in members]))
                 for over, members in groups.items()]
        layout["plan"] = treedef, len(leaves), plans
        return [stages[0]([leaves[i] for i in members]) for members, stages in plans]

    def gather(shares):
        treedef, count, plans = layout["plan"]
        out = [None] * count
        for (members, stages), share in zip(plans, shares):
            for i, g in zip(members, stages[-1](share)):
                out[i] = g
        return jax.tree.unflatten(treedef, out)

    return scatter, gather


def _scatter_packed(leaves: list, axis: str, parts: int, divide_by: int):
    """This device's piece of the bfloat16 exchange of its `leaves` (local blocks) packed in one
    buffer: the all-to-all of the pieces, summed in float32 and rounded once. Returns
    `(ceil(size / parts),)` bfloat16, varying over `axis`."""
    flat = jnp.concatenate([g.astype(jnp.bfloat16).reshape(-1) for g in leaves])
    pieces = jnp.pad(flat, (0, -flat.shape[0] % parts)).reshape(parts, -1)
    received = jax.lax.all_to_all(pieces, axis, 0, 0, tiled=False)
    return (jnp.sum(received.astype(jnp.float32), axis=0) / divide_by).astype(jnp.bfloat16)


def _gather_packed(mine, axis: str, like: list) -> list:
    """Every device's piece (`_scatter_packed`) gathered over `axis` and unpacked into arrays of
    the shapes and dtypes of `like`, invariant over `axis`."""
    whole = all_gather_invariant(mine, axis).reshape(-1)
    out, start = [], 0
    for g in like:
        out.append(whole[start:start + g.size].reshape(g.shape).astype(g.dtype))
        start += g.size
    return out


def mean_shares(leaves: list, dims: list[int], axis: str) -> list:
    """This device's share of each leaf's mean over `axis`, from one packed reduce-scatter.

    The leaves travel in one float32 buffer: one collective for a layer's small leaves instead
    of one each, since a reduce-scatter costs its latency whatever its size.

    Args:
      leaves: arrays varying over the manual `axis`, each split on its entry of `dims` into
        `axis`'s size blocks.
      dims: for each leaf, the dimension its share is a block of.
      axis: a manual mesh axis.

    Returns:
      The shares: leaf `i`'s shape with `dims[i]` divided by `axis`'s size, in its dtype.
    """
    parts = manual_axis_size(axis)
    rows = [jnp.moveaxis(g, d, 0).astype(jnp.float32).reshape(parts, -1)
            for g, d in zip(leaves, dims)]
    mine = psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0,
                        tiled=True).reshape(-1) / parts
    out, start = [], 0
    for g, d, row in zip(leaves, dims, rows):
        moved = jnp.moveaxis(g, d, 0).shape
        piece = mine[start:start + row.shape[1]].reshape(moved[0] // parts, *moved[1:])
        out.append(jnp.moveaxis(piece, 0, d).astype(g.dtype))
        start += row.shape[1]
    return out


def _automatic(spec: P, manual: set[str]) -> P:
    """`spec` with the axes that are already manual dropped."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def sum_over(tree, axis: str, dtype: str = "float32", specs=None, divide_by: int = 1):
    """The sum over the manual mesh axis `axis` of every leaf of `tree`, sending `dtype`.

    Args:
      tree: gradients varying over `axis`; any pytree of arrays.
      axis: a manual mesh axis (e.g. `data`).
      dtype: the wire dtype (module docstring).
      specs: a tree of PartitionSpecs like `tree`, how the mesh's automatic axes split each leaf
        (None: they split none); a bfloat16 exchange packs each device's blocks.
      divide_by: the sum is divided by it in float32.

    Returns:
      `tree`'s sum, each leaf in its own dtype and invariant over `axis`.
    """
    stages = sum_over_stages(axis, dtype, specs, divide_by)
    for stage in stages:
        tree = stage(tree)
    return tree


def sum_over_stages(axis: str | tuple[str, ...], dtype: str = "float32", specs=None,
                    divide_by: int = 1) -> tuple:
    """`sum_over` as a sequence of functions whose composition it is.

    A caller can run each stage in its own window of compute (`step.layer_exchange`).

    Args:
      axis: a manual mesh axis (e.g. `data`), or a tuple of them (one exchange over all).
      dtype: the wire dtype (module docstring).
      specs: a tree of PartitionSpecs like the gradients, how the mesh's automatic axes split
        each leaf (None: they split none).
      divide_by: the sum is divided by it in float32.

    Returns:
      The stages, applied in order to a tree of gradients. float32: one, the all-reduce.
      bfloat16: two, each device's pieces summed into its share (the all-to-all), then the
      shares gathered (the all-gather); the value between them is a list of shares. The second
      takes what the first made for a tree of the same structure and shapes.
    """
    if dtype == "float32":
        return (lambda tree: jax.tree.map(lambda g: sum_divided(g, axis, divide_by), tree),)
    layout = {}  # the first stage's packing, which the second reads (static per tree structure)

    def scatter(tree):
        layout["plan"] = plan = _packing(tree, axis, specs)
        if plan is None:
            return tree
        parts = _size(axis)
        leaves = jax.tree.leaves(tree)
        shares = []
        for split, members, local in plan[1]:
            mine = [leaves[i] for i in members]
            if split:
                shares.append(shard_map(lambda *ls: _scatter_packed(list(ls), axis, parts, divide_by),
                                        mesh=current_mesh(None), in_specs=local, out_specs=P(split),
                                        axis_names=set(split))(*mine))
            else:
                shares.append(_scatter_packed(mine, axis, parts, divide_by))
        return shares

    def gather(shares):
        plan = layout["plan"]
        if plan is None:
            return shares
        treedef, groups, like = plan
        out = [None] * treedef.num_leaves
        for (split, members, local), mine in zip(groups, shares):
            shapes = [like[i] for i in members]
            if split:
                summed = shard_map(lambda m, shapes=shapes: tuple(_gather_packed(m, axis, shapes)),
                                   mesh=current_mesh(None), in_specs=(P(split),), out_specs=local,
                                   axis_names=set(split))(mine)
            else:
                summed = _gather_packed(mine, axis, shapes)
            for i, g in zip(members, summed):
                out[i] = g
        return jax.tree.unflatten(treedef, out)

    return scatter, gather


def _packing(tree, axis: str, specs):
    """How the bfloat16 exchange packs `tree` (None: nothing to exchange): its treedef; one
    buffer per set of tensor axes that split its leaves and of other manual axes they vary over
    (a pipeline's embedding gradients over `pipe`: a buffer is typed by all its leaves'), as
    `(split axes in mesh order, leaf indices, their local specs)`; and each leaf's local shape
    and dtype (its block on one device)."""
    leaves, treedef = jax.tree.flatten(tree)
    if _size(axis) == 1 or not leaves:
        return None
    manual = set(manual_axes())
    spec_leaves = [P()] * len(leaves) if specs is None else jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P))
    local = [_automatic(s, manual) for s in spec_leaves]
    mesh = current_mesh(None)
    groups: dict[tuple[frozenset, frozenset], list[int]] = {}
    for i, s in enumerate(local):
        groups.setdefault((spec_axes(s), varying_axes(leaves[i])), []).append(i)
    like = [jax.ShapeDtypeStruct(_block_shape(g.shape, s, mesh), g.dtype)
            for g, s in zip(leaves, local)]
    packed = [(tuple(n for n in mesh.axis_names if n in split), members,
               tuple(local[i] for i in members)) for (split, _), members in groups.items()]
    return treedef, packed, like


def _block_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    """The shape of one device's block of an array of `shape` split by `spec` over `mesh`."""
    sizes = dict(mesh.shape)
    out = list(shape)
    for d, entry in enumerate(spec):
        for n in (entry if isinstance(entry, tuple) else (entry,)):
            if n:
                out[d] //= sizes[n]
    return tuple(out)
