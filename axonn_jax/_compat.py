"""The one place that knows which JAX version is running.

CPU machines run JAX 0.10.x and GPU machines 0.11.x; APIs that moved between versions (shard_map,
compute_on, memory kinds) are wrapped here so the rest of the package has one spelling for each.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

if hasattr(jax, "shard_map"):
    _shard_map = jax.shard_map
else:  # pragma: no cover - JAX < 0.7
    from jax.experimental.shard_map import shard_map as _old_shard_map

    def _shard_map(f, *, mesh, in_specs, out_specs, axis_names=frozenset(), check_vma=True):
        auto = frozenset(mesh.axis_names) - frozenset(axis_names) if axis_names else frozenset()
        return _old_shard_map(f, mesh, in_specs, out_specs, check_rep=check_vma, auto=auto)


def shard_map(
    f: Callable,
    *,
    mesh,
    in_specs: Any,
    out_specs: Any,
    axis_names: set[str] | frozenset[str] | None = None,
    check_vma: bool = True,
) -> Callable:
    """`jax.shard_map`, manual over `axis_names` (all mesh axes when None), automatic over the rest."""
    kwargs = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    if axis_names is not None:
        kwargs["axis_names"] = frozenset(axis_names)
    return _shard_map(f, **kwargs)


HOST_MEMORY_KIND = "pinned_host"
DEVICE_MEMORY_KIND = "device"


def memory_kind_of(x: jax.Array) -> str | None:
    """The memory kind an array lives in (`device`, `pinned_host`, ...), or None for non-arrays."""
    sharding = getattr(x, "sharding", None)
    return getattr(sharding, "memory_kind", None)


def to_varying(tree, axes: tuple[str, ...]):
    """Mark every array of `tree` as varying over the manual `axes` of the enclosing shard_map.

    Gradients of a varying input are per-shard (not summed by autodiff), so the train step can
    reduce them itself — exactly, compressed, or on the host.
    """
    import jax

    if not axes:
        return tree
    if hasattr(jax.lax, "pcast"):
        return jax.tree.map(lambda x: jax.lax.pcast(x, tuple(axes), to="varying"), tree)
    return jax.tree.map(lambda x: jax.lax.pvary(x, tuple(axes)), tree)  # pragma: no cover


def current_mesh(default):
    """The mesh to hand a nested shard_map: the abstract context mesh inside an enclosing shard_map
    (JAX requires the inner one to match it), else `default`."""
    import jax

    abstract = jax.sharding.get_abstract_mesh()
    return default if abstract.empty else abstract


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which `x` varies inside a shard_map (empty outside one)."""
    import jax

    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset[str]:
    """`varying_axes` of an abstract value (a ShapedArray, or a ShapeDtypeStruct from
    `jax.eval_shape` inside a shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # pragma: no cover - other JAX versions


def ensure_varying(tree, axes: tuple[str, ...]):
    """Like `to_varying`, but leaves already varying over some of `axes` (e.g. arrays split over
    `pipe`) are cast over the missing axes only; `pcast` refuses an axis the input already varies in."""
    import jax

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return to_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def _reduce_16bit_in_fp32(reduce, tree):
    """Apply `reduce` leafwise; on CPU, 16-bit float arrays are reduced in fp32 and cast back.

    XLA:CPU's all-reduce promotion pass aborts the process ("Invalid binary instruction opcode
    copy") on a bf16/fp16 all-reduce or reduce-scatter inside a partially manual shard_map, whose
    reducer ends in a sharding annotation (JAX 0.10.2).
    """
    import jax
    import jax.numpy as jnp

    if jax.devices()[0].platform != "cpu":
        return jax.tree.map(reduce, tree)

    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 16:
            return reduce(x.astype(jnp.float32)).astype(x.dtype)
        return reduce(x)

    return jax.tree.map(one, tree)


def psum(tree, axis):
    """`jax.lax.psum` over `axis` (a name or tuple), CPU-safe for 16-bit floats (see above)."""
    import jax

    return _reduce_16bit_in_fp32(lambda x: jax.lax.psum(x, axis), tree)


def pmean(tree, axis):
    """`jax.lax.pmean` over `axis`, CPU-safe for 16-bit floats."""
    import jax

    return _reduce_16bit_in_fp32(lambda x: jax.lax.pmean(x, axis), tree)


def psum_scatter(x, axis, **kwargs):
    """`jax.lax.psum_scatter` over `axis`, CPU-safe for 16-bit floats."""
    import jax

    return _reduce_16bit_in_fp32(lambda v: jax.lax.psum_scatter(v, axis, **kwargs), x)


def all_gather_invariant(x, axis_name):
    """`all_gather` whose result is typed invariant (replicated) over `axis_name`.

    Plain `all_gather` returns a value typed varying, which a shard_map cannot return under an
    unsplit out_spec; the invariant variant is still private in JAX 0.10.
    """
    from jax._src.lax import parallel

    return parallel.all_gather_invariant(x, axis_name)


def jaxpr_internals():
    """What `parallel.backward_split` needs to read and re-run jaxprs: `Literal`, `DropVar` and
    JAX's dead-code-elimination rules per primitive (`dce_rules`, private in JAX 0.10)."""
    import types

    import jax.extend.core as core
    from jax._src.interpreters import partial_eval as pe

    return types.SimpleNamespace(Literal=core.Literal, DropVar=core.DropVar, Var=core.Var,
                                 dce_rules=pe.dce_rules)


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual in the enclosing shard_map (none outside one)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(getattr(mesh, "manual_axes", ()))


def manual_axis_size(name: str) -> int:
    """The size of mesh axis `name` when it is manual in the enclosing shard_map, else 1 (the
    axis is absent, automatic, or there is no shard_map: the code sees the whole of it)."""
    import jax

    return jax.sharding.get_abstract_mesh().shape[name] if name in manual_axes() else 1
