"""`parallelize` for Flax NNX modules: the same model object graph, its Flax layers made
tensor-parallel and its parameters placed on the mesh.

The result is a copy (`nnx.clone`) of the model in which every `nnx.Linear` becomes an
`axonn_jax.layers_nnx.Dense` and every `nnx.Embed` an `axonn_jax.layers_nnx.Embed` (subclasses of
the Flax layers that keep their attributes and parameters), and the `scale` / `bias` of every
`nnx.LayerNorm` / `nnx.RMSNorm` are split like the features of that norm's input; Flax's own norm
arithmetic then runs on the feature-sharded activations, with GSPMD adding the all-reduces of the
statistics. Every variable keeps its path and global shape and is placed by an `out_sharding`
annotation (`nnx.get_partition_spec` / `nnx.get_named_sharding` give the placement); variables
outside these layers are replicated over the mesh.

`transpose` of each dense layer comes from one abstract trace of the model's `__call__` on example
inputs (`axonn_jax.tp._layout.Layout`, shared with the linen transform; nothing is computed). Without
example inputs, a layer is normal unless the `transpose` overrides say otherwise.
"""
from __future__ import annotations

import contextvars
import math
from typing import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from . import layers_nnx
from ._layout import Layout
from .tensor import bias_spec, embed_spec, kernel_spec

_NORMS = (nnx.LayerNorm, nnx.RMSNorm)
_SUPPORTED = (nnx.Linear, nnx.Embed, *_NORMS)
_ALREADY_PARALLEL = (layers_nnx.Dense, layers_nnx.Embed, layers_nnx.LayerNorm)
_UNSUPPORTED = (nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.ConvTranspose, nnx.BatchNorm,
                nnx.GroupNorm, nnx.InstanceNorm, nnx.WeightNorm, nnx.SpectralNorm, nnx.LoRA)
_SUPPORTED_NAMES = "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm"
_TRACE = contextvars.ContextVar("axonn_nnx_trace", default=None)


def _layers(module: nnx.Module) -> dict[str, nnx.Module]:
    """`{path: layer}` of the Flax layers in `module`'s graph that parallelize replaces; raises for
    a layer it cannot run tensor-parallel."""
    found = {}
    for parts, m in nnx.iter_modules(module):
        path = "/".join(map(str, parts)) or type(m).__name__
        if isinstance(m, _ALREADY_PARALLEL):
            continue
        kind = type(m).__name__
        if type(m) in _SUPPORTED:
            _check_options(path, m)
            found[path] = m
        elif isinstance(m, _SUPPORTED):
            raise NotImplementedError(
                f"parallelize: layer '{path}' ({kind}) subclasses a Flax layer and may change its "
                f"arithmetic; only the Flax layers themselves are replaced: {_SUPPORTED_NAMES}")
        elif isinstance(m, _UNSUPPORTED):
            raise NotImplementedError(f"parallelize: cannot run layer '{path}' ({kind}) "
                                      f"tensor-parallel; supported: {_SUPPORTED_NAMES}")
    return found


def _check_options(path: str, m: nnx.Module):
    kind = type(m).__name__
    if isinstance(m, nnx.Linear):
        if m.dot_general is not jax.lax.dot_general or m.preferred_element_type is not None \
                or m.precision is not None:
            raise NotImplementedError(
                f"parallelize: layer '{path}' (Linear) sets dot_general, precision or "
                "preferred_element_type, which the tensor-parallel matmul does not take")
    elif isinstance(m, _NORMS):
        if m.reduction_axes not in (-1, (-1,)) or m.feature_axes not in (-1, (-1,)) or m.axis_name:
            raise NotImplementedError(
                f"parallelize: layer '{path}' ({kind}) normalizes over reduction_axes="
                f"{m.reduction_axes}, feature_axes={m.feature_axes}, axis_name={m.axis_name}; only "
                "the last axis, without axis_name, is supported")


def _record(layout: Layout, path: str, m: nnx.Module, x, y):
    if isinstance(m, nnx.Linear):
        layout.dense_output(y, layout.dense(path, x))
    elif isinstance(m, nnx.Embed):
        layout.mark(y, "col")
    else:
        layout.mark(y, layout.norm(path, x))
    return y


def _tracing(base):
    """A subclass of the Flax layer `base` whose calls report to the active trace's `Layout`."""
    def __call__(self, x, *args, **kwargs):
        layout, paths = _TRACE.get()
        return _record(layout, paths[id(self)], self, x, base.__call__(self, x, *args, **kwargs))
    return type(f"_Tracing{base.__name__}", (base,), {"__call__": __call__})


_TRACING = {base: _tracing(base) for base in _SUPPORTED}


def trace_layout(module: nnx.Module, overrides: Mapping[str, bool] | None, args: tuple,
                 kwargs: Mapping | None = None) -> Layout:
    """The `Layout` of one abstract call `module(*args, **kwargs)` (`jax.eval_shape`: nothing is
    computed and `module` is not changed). Array arguments may be `jax.ShapeDtypeStruct`s."""
    layout = Layout(overrides)
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs or {})))
    is_array = [hasattr(v, "shape") and hasattr(v, "dtype") for v in leaves]

    def call(state, arrays):
        arrays = iter(arrays)
        a, k = jax.tree.unflatten(treedef, [next(arrays) if f else v for v, f in zip(leaves, is_array)])
        model = nnx.merge(graphdef, state)
        paths = {}
        for path, m in _layers(model).items():
            object.__setattr__(m, "__class__", _TRACING[type(m)])  # this copy only
            paths[id(m)] = path
        token = _TRACE.set((layout, paths))
        try:
            model(*a, **k)
        finally:
            _TRACE.reset(token)

    jax.eval_shape(call, state, [v for v, f in zip(leaves, is_array) if f])
    return layout


def _check_divisible(path: str, kind: str, name: str, shape, spec: P, mesh):
    sizes = dict(mesh.shape)
    for dim, (n, axes) in enumerate(zip(shape, spec)):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        parts = math.prod(sizes[a] for a in axes)
        if n % parts:
            raise ValueError(f"parallelize: layer '{path}' ({kind}): {name} {tuple(shape)} dim {dim} "
                             f"= {n} is not divisible by {'×'.join(axes)} = {parts}")


def _place(value, sharding: NamedSharding):
    if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model stays abstract
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if isinstance(value, (jax.Array, np.ndarray)):
        return jax.device_put(value, sharding)
    return value  # a Python scalar in a Variable stays one


def parallelize_nnx(module: nnx.Module, mesh, *, transpose: Mapping[str, bool] | None = None,
                    example_args: tuple | None = None, example_kwargs: Mapping | None = None):
    """The tensor-parallel copy of the NNX `module` on `mesh` (see the module docstring).

    transpose: `{layer path: bool}` (paths like `'blocks/0/up'`) overriding the automatic choice.
    example_args / example_kwargs: inputs of `module.__call__` (arrays or ShapeDtypeStructs) from
    which the layout is traced; without them every dense layer not in `transpose` is normal.
    `module` is not changed; the copy's arrays are new shardings of its arrays (`jax.device_put`
    sends each device its shard); an abstract `module` (`nnx.eval_shape`) gives an abstract copy
    whose ShapeDtypeStructs carry the shardings.
    """
    if example_args is not None or example_kwargs is not None:
        layout = trace_layout(module, transpose, tuple(example_args or ()), example_kwargs)
    else:
        layout = Layout(transpose)
    model = nnx.clone(module)
    found = _layers(model)
    unknown = sorted(set(layout.overrides) - {p for p, m in found.items() if isinstance(m, nnx.Linear)})
    if unknown:
        raise ValueError(f"parallelize: transpose names no nnx.Linear of the model: {unknown}")
    for path, m in found.items():
        kind = type(m).__name__
        if isinstance(m, nnx.Linear):
            flip = layout.decisions.get(path, layout.overrides.get(path, False))
            specs = {"kernel": kernel_spec(flip), "bias": bias_spec(flip)}
            object.__setattr__(m, "__class__", layers_nnx.Dense)
            m.mesh, m.transpose = mesh, flip
        elif isinstance(m, nnx.Embed):
            specs = {"embedding": embed_spec()}
            object.__setattr__(m, "__class__", layers_nnx.Embed)
            m.mesh = mesh
        else:
            axis = layout.norm_axes.get(path, "col")
            specs = {"scale": P(axis), "bias": P(axis)}
        for name, spec in specs.items():
            var = getattr(m, name, None)
            if var is None:  # use_bias / use_scale off
                continue
            _check_divisible(path, kind, name, var.shape, spec, mesh)
            var.set_metadata("out_sharding", tuple(spec))
            var.set_metadata("mesh", mesh)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(_place, state, nnx.get_named_sharding(state, mesh)))
    return model
