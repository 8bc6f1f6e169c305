"""Gathers with batching dimensions, rewritten into the equivalent gathers XLA can partition.

`jnp.take_along_axis` (a classifier's `take_along_axis(log_probs, labels[:, None], axis=1)`)
lowers to a gather with batching dimensions. XLA's SPMD partitioner (JAX 0.10) aborts the process
(`spmd_partitioner_util.cc:497 Check failed: partition_group_list`) on such a gather inside a
partially manual computation when its operand is split over two automatic axes — the train step's
shard_map is manual over `data` (and `pipe`), and a tensor-parallel layer's output is split over
`depth` or `col` on its rows and over `row` on its features. The same gather with the batch
positions written into its indices (an iota per batching dimension) partitions fine, and its
transpose (a scatter-add) too.

`unbatched_gathers(f)` traces `f` and evaluates its jaxpr with every such gather rewritten, inside
`jit`-wrapped functions and the bodies of `scan`, `while` and `cond` too; `f` is called as it is
when it has none.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

_CALLS = ("jit", "pjit", "closed_call")  # inlined (`jit`: the name of `pjit` from JAX 0.8)
_LOOPS = ("scan", "while", "cond")


def _batched(eqn) -> bool:
    return eqn.primitive is lax.gather_p and bool(
        eqn.params["dimension_numbers"].operand_batching_dims)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jax.extend.core.Jaxpr):
                yield sub


def has_batched_gather(jaxpr) -> bool:
    """Whether `jaxpr` (or any jaxpr inside it) has a gather with batching dimensions.

    Args:
      jaxpr: a `jax.extend.core.Jaxpr` (not closed); the jaxprs in its equations' parameters
        (calls, loop bodies, branches) are searched too.

    Returns:
      True when one of its gathers has operand batching dimensions.
    """
    return any(_batched(e) or any(has_batched_gather(j) for j in _subjaxprs(e))
               for e in jaxpr.eqns)


def _unbatched_gather(operand, indices, *, dimension_numbers, **params):
    """`lax.gather` with `dimension_numbers`' batching dimensions moved into the indices: each
    batching dimension becomes a collapsed slice dimension indexed by an iota over its indices'
    dimension."""
    d = dimension_numbers
    if params.get("index_vector_dim", indices.ndim - 1) not in (indices.ndim - 1, None):
        raise NotImplementedError("a batched gather whose index vector is not the last dimension")
    batch_shape = (*indices.shape[:-1], 1)
    iotas = [lax.broadcasted_iota(indices.dtype, batch_shape, dim)
             for dim in d.start_indices_batching_dims]
    numbers = lax.GatherDimensionNumbers(
        offset_dims=d.offset_dims,
        collapsed_slice_dims=tuple(sorted((*d.collapsed_slice_dims, *d.operand_batching_dims))),
        start_index_map=(*d.start_index_map, *d.operand_batching_dims))
    params.pop("index_vector_dim", None)
    return lax.gather_p.bind(operand, jnp.concatenate([indices, *iotas], axis=-1),
                             dimension_numbers=numbers, **params)


def _rewrite_open(jaxpr):
    """A Jaxpr without constants (JAX 0.12's scan body) computing the same as `jaxpr`, its
    batched gathers rewritten."""
    closed = _rewrite_closed(jax.extend.core.ClosedJaxpr(jaxpr, []))
    if closed.consts:
        raise NotImplementedError("a loop body whose rewritten gathers need constants")
    return closed.jaxpr


def _rewrite_closed(closed):
    """A ClosedJaxpr computing the same as `closed`, its batched gathers rewritten."""
    if not has_batched_gather(closed.jaxpr):
        return closed
    avals = [v.aval for v in closed.jaxpr.invars]
    fn = lambda *args: _eval(closed.jaxpr, closed.consts, args)  # noqa: E731
    return jax.make_jaxpr(fn)(*avals)


def _eval(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        params = eqn.primitive.get_bind_params(eqn.params)
        if _batched(eqn):
            out = _unbatched_gather(*invals, **params)
        elif eqn.primitive.name in _CALLS and has_batched_gather(eqn.params["jaxpr"].jaxpr):
            sub = eqn.params["jaxpr"]
            out = _eval(sub.jaxpr, sub.consts, invals)  # inlined
        elif eqn.primitive.name in _LOOPS and any(map(has_batched_gather, _subjaxprs(eqn))):
            params = {k: (_rewrite_closed(v) if isinstance(v, jax.extend.core.ClosedJaxpr) else
                          _rewrite_open(v) if isinstance(v, jax.extend.core.Jaxpr) else
                          tuple(map(_rewrite_closed, v)) if k == "branches" else v)
                      for k, v in params.items()}
            out = eqn.primitive.bind(*invals, **params)
        else:
            out = eqn.primitive.bind(*invals, **params)
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def unbatched_gathers(f: Callable) -> Callable:
    """`f`, computing the same with its gathers' batching dimensions written into their indices.

    See the module docstring. `f` is traced on each call; when its jaxpr has no batched gather,
    `f` itself is called.

    Args:
      f: a function that takes and returns pytrees of arrays.

    Returns:
      The wrapped function, with `f`'s signature (positional arguments only).

    Raises:
      NotImplementedError: (when called) on a batched gather whose index vector is not the last
        dimension, or a loop body whose rewritten gathers need constants.
    """
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
        if not has_batched_gather(closed.jaxpr):
            return f(*args)
        out = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), out)
    return wrapped
