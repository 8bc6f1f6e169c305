"""The one place that knows which JAX version is running.

CPU machines run JAX 0.10.x and GPU machines 0.11.x; APIs that moved between versions (shard_map,
compute_on, memory kinds) are wrapped here so the rest of the package has one spelling for each.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

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


def compute_on_host() -> contextlib.AbstractContextManager:
    """Context in which traced ops run on the host (`compute_on('device_host')`)."""
    try:
        from jax.experimental.compute_on import compute_on
    except ImportError:  # pragma: no cover - moved in newer JAX
        from jax import compute_on  # type: ignore[no-redef]
    return compute_on("device_host")


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


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside a shard_map (its `vma` type; empty outside)."""
    import jax

    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)  # JAX 0.10.2 spells it `aval.mat.varying`
    return frozenset(mat.varying) if mat is not None else frozenset()
