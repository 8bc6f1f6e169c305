"""`parallelize` for Flax NNX modules: the same model object graph, its Flax layers made
tensor-parallel and its parameters placed on the mesh.

The result is a copy (`nnx.clone`) of the model in which every `nnx.Linear`, `nnx.LinearGeneral`,
`nnx.Embed`, `nnx.Conv` and `nnx.ConvTranspose` runs as the `axonn_jax.layers_nnx` layer of its
kind (a subclass of the Flax layer keeping its attributes and parameters; a user's subclass of a
Flax layer gets the parallel layer slotted in under its own methods, so its `__call__` runs as
written around the parallel kernel), modules named in `rules` run as the rule says, and the
`scale` / `bias` of every `nnx.LayerNorm` / `nnx.RMSNorm` / `nnx.GroupNorm` are split like the
features of that norm's input (a GroupNorm's groups must divide over the axis); Flax's own norm
arithmetic then runs on the feature-sharded activations, with GSPMD adding the all-reduces of the
statistics.
Every variable keeps its path and global shape and is placed by an `out_sharding` annotation
(`nnx.get_partition_spec` / `nnx.get_named_sharding` give the placement); layer axes of stacks
made with `nnx.vmap` stay unsplit; variables outside these layers are replicated over the mesh.

`transpose` of each dense layer comes from one abstract trace of the model's `__call__` on example
inputs (`axonn_jax.tp._layout.Layout`, shared with the linen transform; nothing is computed). Without
example inputs, a layer is normal unless the `transpose` overrides say otherwise.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import NamedSharding, PartitionSpec as P

from ..config import Axis
from . import layers_nnx
from . import report as _report
from ._layout import Layout, check_divisible, check_groups, dense_placement, stacked_spec
from .conv import check_conv_options
from .options import DEFAULT, KernelOptions
from .rules import AsDense, Replicated, find_rule
from .tensor import bias_spec, conv_kernel_spec, embed_spec, table_divides, tp_dense_general

_NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm)
_DENSE = (nnx.Linear, nnx.LinearGeneral)
_CONV = (nnx.Conv, nnx.ConvTranspose)
_FLAX = (*_DENSE, *_CONV, nnx.Embed, *_NORMS)
_PARALLEL = {nnx.Linear: layers_nnx.Dense, nnx.LinearGeneral: layers_nnx.DenseGeneral,
             nnx.Embed: layers_nnx.Embed, nnx.Conv: layers_nnx.Conv,
             nnx.ConvTranspose: layers_nnx.ConvTranspose}
_ALREADY_PARALLEL = (layers_nnx.Dense, layers_nnx.DenseGeneral, layers_nnx.Embed, layers_nnx.LayerNorm,
                     layers_nnx.Conv, layers_nnx.ConvTranspose)
_UNSUPPORTED = (nnx.Einsum, nnx.BatchNorm, nnx.InstanceNorm, nnx.WeightNorm, nnx.SpectralNorm,
                nnx.LoRA)
_SUPPORTED_NAMES = ("nnx.Linear, nnx.LinearGeneral, nnx.Embed, nnx.Conv, nnx.ConvTranspose, "
                    "nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, and modules given an AsDense or "
                    "Replicated rule")
CLASS_CACHE = 256
"""Classes made per process (`_under`, `_rule_class`, `_tracing_rule`): one per user layer class
(and rule) parallelized. The bound is far above what a program defines; were one evicted, a
later call would make an equal class under a new identity (modules made before keep theirs)."""


def _flax_base(m) -> type | None:
    """The Flax layer class `m` is (or subclasses) among those parallelize runs."""
    return next((c for c in type(m).__mro__ if c in _FLAX), None)


def _layers(module: nnx.Module, rules: Mapping):
    """(`{path: (layer, Flax base class or AsDense rule)}` of the layers in `module`'s graph that
    parallelize runs, paths of the modules kept as written by a Replicated rule); raises for a
    layer it cannot run tensor-parallel."""
    modules = [("/".join(map(str, parts)), m) for parts, m in nnx.iter_modules(module)]
    kept = [p for p, m in modules if isinstance(find_rule(rules, p, m), Replicated)]
    found = {}
    for path, m in modules:
        if any(path == k or path.startswith(k + "/") or not k for k in kept):
            continue
        rule, base = find_rule(rules, path, m), _flax_base(m)
        path = path or type(m).__name__  # the root, named in errors
        if isinstance(rule, AsDense):
            found[path] = (m, rule)
        elif isinstance(m, _ALREADY_PARALLEL):
            continue
        elif base is not None:
            _check_options(path, m)
            found[path] = (m, base)
        elif isinstance(m, _UNSUPPORTED):
            raise NotImplementedError(f"parallelize: cannot run layer '{path}' ({type(m).__name__}) "
                                      f"tensor-parallel; supported: {_SUPPORTED_NAMES}")
    return found, kept


def _check_options(path: str, m: nnx.Module):
    kind = type(m).__name__
    if isinstance(m, _DENSE):
        if m.dot_general is not jax.lax.dot_general and m.dot_general is not None \
                or getattr(m, "dot_general_cls", None) is not None \
                or m.preferred_element_type is not None or m.precision is not None:
            raise NotImplementedError(
                f"parallelize: layer '{path}' ({kind}) sets dot_general, precision or "
                "preferred_element_type, which the tensor-parallel matmul does not take")
        if isinstance(m, nnx.LinearGeneral) and m.batch_axis:
            raise NotImplementedError(f"parallelize: layer '{path}' ({kind} batch_axis="
                                      f"{dict(m.batch_axis)}) has a kernel per batch entry; only "
                                      "LinearGeneral without batch_axis runs tensor-parallel")
    elif isinstance(m, _CONV):
        check_conv_options(path, m, isinstance(m, nnx.ConvTranspose))
    elif isinstance(m, nnx.GroupNorm):
        if m.axis_name or m.reduction_axes is not None:
            raise NotImplementedError(f"parallelize: layer '{path}' ({kind}) sets axis_name="
                                      f"{m.axis_name} or reduction_axes={m.reduction_axes}; only "
                                      "the defaults are supported")
    elif isinstance(m, _NORMS):
        if m.reduction_axes not in (-1, (-1,)) or m.feature_axes not in (-1, (-1,)) or m.axis_name:
            raise NotImplementedError(
                f"parallelize: layer '{path}' ({kind}) normalizes over reduction_axes="
                f"{m.reduction_axes}, feature_axes={m.feature_axes}, axis_name={m.axis_name}; only "
                "the last axis, without axis_name, is supported")


# -- classes: a layer's class is swapped on the copy, keeping a user subclass's own methods on top


@functools.lru_cache(maxsize=CLASS_CACHE)
def _under(cls: type, parallel: type, prefix: str) -> type:
    """`parallel` (a subclass of the Flax layer that `cls` is or subclasses) slotted under `cls`'s
    own methods: `super()` in `cls` reaches `parallel`'s methods."""
    if parallel.__mro__[1] is cls:
        return parallel
    return type(f"{prefix}{cls.__name__}", (cls, parallel), {"__module__": cls.__module__})


def _rule_call(rule: AsDense) -> Callable:
    def __call__(self, x):
        kernel = getattr(self, rule.kernel)[...]
        bias = getattr(self, rule.bias, None) if rule.bias else None
        bias = None if bias is None else bias[...]
        x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=getattr(self, "dtype", None))
        return tp_dense_general(x, kernel, bias, self._axonn_mesh, self._axonn_transpose,
                                rule.in_ndim, rule.out_in, options=self._axonn_options)
    return __call__


@functools.lru_cache(maxsize=CLASS_CACHE)
def _rule_class(cls: type, rule: AsDense) -> type:
    return type(f"Parallel{cls.__name__}", (cls,), {"__call__": _rule_call(rule),
                                                      "__module__": cls.__module__})


def _record(layout: Layout, path: str, kind, x, y, attend: bool = False):
    """Report the layer `path`'s call `x -> y` to the trace's `layout`; returns `y`."""
    if isinstance(kind, AsDense) or kind in _DENSE or kind in _CONV:
        layout.dense_output(y, layout.dense(path, x))
    elif kind is nnx.Embed:
        layout.dense_output(y, False) if attend else layout.mark(y, Axis.COL)
    else:
        layout.mark(y, layout.norm(path, x))
    return y


def _tracing_base(base):
    """A subclass of the Flax layer `base` whose calls report to the `Layout` of the trace that
    set the layer's `_axonn_layout`."""
    def __call__(self, x, *args, **kwargs):
        return _record(self._axonn_layout, self._axonn_path, base, x,
                       base.__call__(self, x, *args, **kwargs))

    def attend(self, query, *args, **kwargs):
        return _record(self._axonn_layout, self._axonn_path, base, query,
                       base.attend(self, query, *args, **kwargs), True)

    methods = {"__call__": __call__, **({"attend": attend} if base is nnx.Embed else {})}
    return type(f"_Tracing{base.__name__}", (base,), methods)


_TRACING = {base: _tracing_base(base) for base in _FLAX}


@functools.lru_cache(maxsize=CLASS_CACHE)
def _tracing_rule(cls: type, rule: AsDense) -> type:
    def __call__(self, x, *args, **kwargs):
        return _record(self._axonn_layout, self._axonn_path, rule, x,
                       cls.__call__(self, x, *args, **kwargs))
    return type(f"_Tracing{cls.__name__}", (cls,), {"__call__": __call__})


def trace_layout(module: nnx.Module, overrides: Mapping[str, bool] | None, args: tuple,
                 kwargs: Mapping | None = None, rules: Mapping | None = None) -> Layout:
    """The `Layout` of one abstract call `module(*args, **kwargs)`.

    Traced with `jax.eval_shape`: nothing is computed and `module` is not changed.

    Args:
      module: the NNX module.
      overrides: `{layer path: transpose}` overriding the automatic choice, or None.
      args: positional inputs; array arguments may be `jax.ShapeDtypeStruct`s.
      kwargs: keyword inputs, or None.
      rules: `parallelize`'s rules, or None.

    Returns:
      The traced `Layout` (its `decisions`: `{dense layer path: transpose}`).
    """
    layout = Layout(overrides)
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs or {})))
    is_array = [hasattr(v, "shape") and hasattr(v, "dtype") for v in leaves]

    def call(state, arrays):
        arrays = iter(arrays)
        a, k = jax.tree.unflatten(treedef, [next(arrays) if f else v for v, f in zip(leaves, is_array)])
        model = nnx.merge(graphdef, state)
        for path, (m, kind) in _layers(model, rules or {})[0].items():  # this copy only
            cls = _tracing_rule(type(m), kind) if isinstance(kind, AsDense) \
                else _under(type(m), _TRACING[kind], "_Tracing")
            object.__setattr__(m, "__class__", cls)
            # static: survive the splits of nnx.scan / nnx.vmap (the layout compares by identity)
            m._axonn_path, m._axonn_layout = path, layout
        model(*a, **k)

    jax.eval_shape(call, state, [v for v, f in zip(leaves, is_array) if f])
    return layout


# -- placement


def _layer_specs(path, m, kind, flip, mesh, layout, notes,
                 kernels: KernelOptions = DEFAULT) -> dict:
    """`{variable name: (one layer's shape, spec)}` for the layer `m`, switching its class to the
    parallel one (dense layers and tables run with the kernels' modes `kernels`); `{}` (and a
    note) for a table or a convolution kernel the grid does not divide."""
    name = type(m).__name__
    if isinstance(kind, AsDense):
        kernel = getattr(m, kind.kernel, None)
        if not isinstance(kernel, nnx.Variable):
            raise ValueError(f"parallelize: layer '{path}' ({name}) has no parameter "
                             f"'{kind.kernel}' for its AsDense rule")
        layer = kernel.shape[kernel.ndim - kind.in_ndim - kind.out_ndim:]
        in_dims, out_dims = (layer[kind.out_ndim:], layer[:kind.out_ndim]) if kind.out_in \
            else (layer[:kind.in_ndim], layer[kind.in_ndim:])
        specs = dense_placement(path, name, in_dims, out_dims, flip, kind.out_in, mesh)
        object.__setattr__(m, "__class__", _rule_class(type(m), kind))
        m._axonn_mesh, m._axonn_transpose, m._axonn_options = mesh, flip, kernels
        return {kind.kernel: specs["kernel"], **({kind.bias: specs["bias"]} if kind.bias else {})}
    if kind in _DENSE:
        in_dims, out_dims = (tuple(np.atleast_1d(m.in_features)), tuple(np.atleast_1d(m.out_features)))
        specs = dense_placement(path, name, tuple(map(int, in_dims)), tuple(map(int, out_dims)),
                                flip, False, mesh)
    elif kind is nnx.Embed:
        table = m.embedding.shape[-2:]
        if not table_divides(table, mesh):
            sizes = dict(mesh.shape)
            notes[f"{path}/embedding"] = (
                f"(vocabulary, features) = {tuple(table)} not divisible by (row×depth, col) = "
                f"({sizes[Axis.ROW] * sizes[Axis.DEPTH]}, {sizes[Axis.COL]})")
            return {}
        specs = {"embedding": (tuple(table), embed_spec())}
    elif kind in _CONV:
        kernel = m.kernel.shape
        spec = conv_kernel_spec(len(kernel), flip, bool(getattr(m, "transpose_kernel", False)))
        try:  # channels the grid does not divide (an RGB input or output): the layer stays whole
            check_divisible(path, name, "kernel", kernel, spec, mesh)
        except ValueError as e:
            notes[f"{path}/kernel"] = str(e).split(": ", 2)[-1]
            return {}
        specs = {"kernel": (tuple(kernel), spec), "bias": ((m.out_features,), bias_spec(flip))}
    else:
        axis = layout.norm_axes.get(path, Axis.COL)
        features = m.num_groups * m.group_size if kind is nnx.GroupNorm else m.num_features
        if kind is nnx.GroupNorm:
            check_groups(path, name, features, m.num_groups, axis, dict(mesh.shape)[axis])
        return {"scale": ((features,), P(axis)), "bias": ((features,), P(axis))}
    object.__setattr__(m, "__class__", _under(type(m), _PARALLEL[kind], "Parallel"))
    m.mesh = mesh
    if kind in _DENSE or kind is nnx.Embed:
        m.options = kernels
    if kind in _DENSE or kind in _CONV:
        m.transpose = flip
    return specs


def _place(value, sharding: NamedSharding):
    if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model stays abstract
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if isinstance(value, (jax.Array, np.ndarray)):
        return jax.device_put(value, sharding)
    return value  # a Python scalar in a Variable stays one


def _nnx_report(model, notes: dict, kept: list, mesh) -> _report.SplitReport:
    entries = []
    for parts, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = "/".join(map(str, parts))
        spec = var.get_metadata().get("out_sharding")
        kept_here = any(path.startswith(k + "/") or not k for k in kept)
        entries.append((path, var.shape, var.dtype, P(*spec) if spec else P(),
                        _report.RULE_NOTE if kept_here else notes.get(path, "")))
    return _report.build(entries, dict(mesh.shape))


def parallelize_nnx(module: nnx.Module, mesh, *, transpose: Mapping[str, bool] | None = None,
                    rules: Mapping | None = None, report: bool | Callable = False,
                    max_replicated: int | None = None, example_args: tuple | None = None,
                    example_kwargs: Mapping | None = None, kernels: KernelOptions = DEFAULT):
    """The tensor-parallel copy of the NNX `module` on `mesh` (see the module docstring).

    `module` is not changed; the copy's arrays are new shardings of its arrays (`jax.device_put`
    sends each device its shard).

    Args:
      module: the NNX module; an abstract one (`nnx.eval_shape`) gives an abstract copy whose
        ShapeDtypeStructs carry the shardings.
      mesh: a mesh with axes `depth, row, col`.
      transpose: `{layer path: bool}` (paths like `'blocks/0/up'`) overriding the automatic
        choice.
      rules: as for `axonn_jax.parallelize`.
      report: as for `axonn_jax.parallelize`.
      max_replicated: as for `axonn_jax.parallelize`.
      example_args: positional inputs of `module.__call__` (arrays or ShapeDtypeStructs) from
        which the layout is traced; without them (and `example_kwargs`) every dense layer not in
        `transpose` is normal.
      example_kwargs: keyword inputs of `module.__call__`, as `example_args`.
      kernels: as for `axonn_jax.parallelize`: an attribute of each dense layer and table,
        static in the graph definition.

    Returns:
      The tensor-parallel copy, its variables placed on `mesh`.

    Raises:
      ValueError: `transpose` names no dense layer of the model, or a layer's dimensions do not
        divide over the grid.
    """
    rules = dict(rules or {})
    if example_args is not None or example_kwargs is not None:
        layout = trace_layout(module, transpose, tuple(example_args or ()), example_kwargs, rules)
    else:
        layout = Layout(transpose)
    model = nnx.clone(module)
    found, kept = _layers(model, rules)
    dense = {p for p, (m, kind) in found.items()
             if isinstance(kind, AsDense) or kind in _DENSE or kind in _CONV}
    unknown = sorted(set(layout.overrides) - dense)
    if unknown:
        raise ValueError(f"parallelize: transpose names no nnx.Linear of the model: {unknown}")
    notes: dict[str, str] = {}
    for path, (m, kind) in found.items():
        flip = layout.decisions.get(path, layout.overrides.get(path, False))
        for name, (layer_shape, spec) in _layer_specs(path, m, kind, flip, mesh, layout, notes,
                                                         kernels).items():
            var = getattr(m, name, None)
            if var is None:  # use_bias / use_scale off
                continue
            try:
                spec = stacked_spec(spec, layer_shape, var.shape)
            except ValueError as e:
                raise ValueError(f"parallelize: layer '{path}' ({type(m).__name__}): {name}: {e}") from None
            check_divisible(path, type(m).__name__, name, var.shape, spec, mesh)
            var.set_metadata("out_sharding", tuple(spec))
            var.set_metadata("mesh", mesh)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(_place, state, nnx.get_named_sharding(state, mesh)))
    _report.act(_nnx_report(model, notes, kept, mesh), report, max_replicated)
    return model
