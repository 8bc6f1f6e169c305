"""`parallelize`: run an ordinary Flax model's layers with AxoNN's 2D/3D tensor parallelism. This
file holds the one public entry point and the linen transform; NNX modules go to
`axonn_jax.tp.parallelize_nnx`.

For linen, the returned module is an instance of a subclass of the model's class with the same
fields. Its `init` and `apply` run the model under `nn.intercept_methods`, which replaces the
arithmetic of Flax's own `nn.Dense`, `nn.DenseGeneral` (several feature dims too: attention's
heads × head_dim), `nn.Embed` (lookup and `attend`), `nn.Conv`, `nn.ConvTranspose` (a dense layer over the channels
of every window) by the tensor-parallel kernels of `axonn_jax.tp.tensor`, and places the
parameters of those and of `nn.LayerNorm` / `nn.RMSNorm` / `nn.GroupNorm`.
Only the Flax layers' own methods are replaced: a subclass's `__call__` runs as written around
them (`super().__call__(x) * 2` stays doubled), and modules named in `rules` run as the rule says.

Parameters are created by the layers' own code (names, shapes, initializers are Flax's), so the
parameter tree is the original's and model code reading `self.variables` sees plain arrays. `init`
returns the parameters boxed in `nn.Partitioned` (`nn.get_partition_spec` gives the placement,
`nn.unbox` the plain tree, which the original module accepts), the layer axes added by `nn.scan` /
`nn.vmap` left unsplit; `apply` accepts either tree and lays the arrays out as it goes.

Choosing `transpose` follows the layout of activations through the trace (`axonn_jax.tp._layout`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from jax.sharding import PartitionSpec as P

from ..config import TENSOR_AXES, Axis
from . import report as _report
from ._layout import Layout, check_divisible, check_groups, dense_placement, stacked_spec
from .conv import check_conv_options, conv_apply
from .options import DEFAULT, KernelOptions
from .parallelize_nnx import parallelize_nnx, trace_layout
from .rules import AsDense, Replicated, check_rules, find_rule
from .tensor import (bias_spec, conv_kernel_spec, embed_spec, table_divides, tp_attend,
                     tp_dense_general, tp_embed)

_UNSUPPORTED = (nn.ConvLocal, nn.Einsum, nn.BatchNorm, nn.InstanceNorm, nn.SpectralNorm,
                nn.WeightNorm)
_SUPPORTED_NAMES = ("nn.Dense, nn.DenseGeneral, nn.Embed (lookup and attend), nn.Conv, "
                    "nn.ConvTranspose, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, and modules given an "
                    "AsDense or Replicated rule")


def _path(m: nn.Module) -> str:
    scope = getattr(m, "scope", None)
    return "/".join(scope.path) if scope is not None and scope.path else (m.name or type(m).__name__)


def _own(cls, name):
    """The function Flax defines as `cls.name`, unwrapped as interceptors see it."""
    fn = getattr(cls, name)
    return getattr(fn, "__wrapped__", fn)


def _running(context) -> Callable:
    """The plain function an interceptor's call runs (Flax binds it with functools.partial)."""
    fn = context.orig_method
    return getattr(fn, "func", None) or getattr(fn, "__func__", None) or fn


def _input(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()))


def _options(kernels: KernelOptions, m) -> KernelOptions:
    """`kernels` for a layer `m`, in the replicated layout when a module around it (or `m`) says
    so by its attribute `tp_replicated_rows` (a block whose other layers expect activations whole
    over `row`: `models.llama.Block`)."""
    while isinstance(m, nn.Module):
        if getattr(m, "tp_replicated_rows", False):
            return kernels.replace(replicated_rows=True)
        m = m.parent
    return kernels


class _Interceptor:
    """The method interceptor of one trace: runs Flax's layers tensor-parallel with the kernels'
    modes `kernels`, chooses their layout with a `Layout`, and records where each parameter it
    handles goes.

    placed: `{parameter path: (shape in the layer's call, PartitionSpec)}`; notes: `{parameter
    path: why it stays whole}`; kept: paths of modules kept as written by a Replicated rule.
    """

    def __init__(self, mesh, transpose: Mapping[str, bool], rules: Mapping,
                 kernels: KernelOptions = DEFAULT):
        self.mesh, self.sizes = mesh, dict(mesh.shape)
        self.layout = Layout(transpose)
        self.rules, self.kernels = rules, kernels
        self.placed: dict[tuple, tuple] = {}
        self.notes: dict[tuple, str] = {}
        self.kept: set[tuple] = set()

    def __call__(self, next_fun, args, kwargs, context):
        m, method = context.module, context.method_name
        if not method.isidentifier():  # Flax's own helpers (nn.scan's setup-only `<lambda>`)
            return next_fun(*args, **kwargs)
        scope_path = tuple(m.scope.path) if m.scope is not None else ()
        rule = find_rule(self.rules, "/".join(scope_path), m)
        if self.kept or isinstance(rule, Replicated):
            if isinstance(rule, Replicated):
                self.kept.add(scope_path)
            if any(scope_path[:len(k)] == k for k in self.kept):  # it, or a module inside it
                return next_fun(*args, **kwargs)
        if isinstance(rule, AsDense) and method == "__call__":
            return self._dense(m, next_fun, args, kwargs, rule.kernel, rule.bias,
                               tuple(range(-rule.in_ndim, 0)), rule.out_in)
        handler = _HANDLERS.get(_running(context))
        if handler is not None:
            return handler(self, m, next_fun, args, kwargs)
        if isinstance(m, _UNSUPPORTED) and method == "__call__":
            raise NotImplementedError(
                f"parallelize: cannot run layer '{_path(m)}' ({type(m).__name__}) tensor-parallel; "
                f"supported: {_SUPPORTED_NAMES}")
        return next_fun(*args, **kwargs)

    # -- parameters

    def _place(self, m, name: str, shape, spec: P):
        self.placed[(*m.scope.path, name)] = (tuple(shape), spec)

    @staticmethod
    def _read(m, name: str):
        value = m.get_variable("params", name)
        if value is None:
            names = sorted(m.variables.get("params", {}))
            raise ValueError(f"parallelize: layer '{_path(m)}' ({type(m).__name__}) has no parameter "
                             f"'{name}' (its parameters: {names})")
        return meta.unbox(value)

    # -- dense layers

    def _dense(self, m, next_fun, args, kwargs, kernel_name, bias_name, axes, out_in):
        """Any dense layer: `x` contracted over `axes` with `kernel_name` (+ `bias_name`)."""
        path, kind = _path(m), type(m).__name__
        if not m.has_variable("params", kernel_name):
            next_fun(*args, **kwargs)  # init: the layer creates its parameters itself
        kernel = self._read(m, kernel_name)
        bias = self._read(m, bias_name) if bias_name else None
        x = _input(args, kwargs)
        transpose = self.layout.dense(path, x)
        axes, trailing = tuple(a % x.ndim for a in axes), tuple(range(x.ndim - len(axes), x.ndim))
        if axes != trailing:  # DenseGeneral(axis=...) contracting inner dims: move them last
            x = jnp.moveaxis(x, axes, trailing)
        promote = getattr(m, "promote_dtype", nn.dtypes.promote_dtype)
        x, kernel, bias = promote(x, kernel, bias, dtype=getattr(m, "dtype", None))
        hint = f" (keep it whole with rules={{'{path}': Replicated()}})"
        try:
            y = tp_dense_general(x, kernel, bias, self.mesh, transpose, len(axes), out_in,
                                 options=_options(self.kernels, m))
        except ValueError as e:
            raise ValueError(f"parallelize: layer '{path}' ({kind}): {e}{hint}") from None
        n_in, n_out = len(axes), kernel.ndim - len(axes)
        out_dims = kernel.shape[:n_out] if out_in else kernel.shape[n_in:]
        try:
            specs = dense_placement(path, kind, x.shape[x.ndim - n_in:], out_dims, transpose, out_in,
                                    self.mesh)
        except ValueError as e:
            raise ValueError(f"{e}{hint}") from None
        self._place(m, kernel_name, kernel.shape, specs["kernel"][1])
        if bias is not None:
            self._place(m, bias_name, bias.shape, specs["bias"][1])
        return self.layout.dense_output(y, transpose)

    def _flax_dense(self, m, next_fun, args, kwargs):
        _check_plain_dot(m)
        return self._dense(m, next_fun, args, kwargs, "kernel", "bias" if m.use_bias else None,
                           (-1,), False)

    def _flax_dense_general(self, m, next_fun, args, kwargs):
        _check_plain_dot(m)
        if m.batch_dims not in ((), None):
            raise NotImplementedError(
                f"parallelize: layer '{_path(m)}' (DenseGeneral batch_dims={m.batch_dims}) has a "
                "kernel per batch entry; only batch_dims=() runs tensor-parallel")
        axis = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
        return self._dense(m, next_fun, args, kwargs, "kernel", "bias" if m.use_bias else None,
                           axis, False)

    # -- convolutions: a dense layer over the channels of every window

    def _conv(self, m, next_fun, args, kwargs, transposed: bool):
        path, kind = _path(m), type(m).__name__
        if not getattr(m, "shared_weights", True):  # nn.ConvLocal runs _Conv.__call__ too
            raise NotImplementedError(f"parallelize: cannot run layer '{path}' ({kind}) "
                                      f"tensor-parallel; supported: {_SUPPORTED_NAMES}")
        check_conv_options(path, m, transposed)
        whole = None
        if not m.has_variable("params", "kernel"):
            whole = next_fun(*args, **kwargs)  # init: the layer creates its parameters itself
        kernel = self._read(m, "kernel")
        bias = self._read(m, "bias") if m.use_bias else None
        x = _input(args, kwargs)
        transpose = self.layout.dense(path, x)
        spec = conv_kernel_spec(kernel.ndim, transpose, bool(getattr(m, "transpose_kernel", False)))
        try:  # channels the grid does not divide (an RGB input or output): the layer stays whole
            check_divisible(path, kind, "kernel", kernel.shape, spec, self.mesh)
        except ValueError as e:
            self.notes[(*m.scope.path, "kernel")] = str(e).split(": ", 2)[-1]
            return next_fun(*args, **kwargs) if whole is None else whole
        x, kernel, bias = m.promote_dtype(x, kernel, bias, dtype=m.dtype)
        try:
            y = conv_apply(m, x, kernel, bias, self.mesh, transpose, transposed,
                           replicated_rows=_options(self.kernels, m).replicated_rows)
        except ValueError as e:
            raise ValueError(f"parallelize: layer '{path}' ({kind}): {e}") from None
        self._place(m, "kernel", kernel.shape, spec)
        if bias is not None:
            self._place(m, "bias", bias.shape, bias_spec(transpose))
        return self.layout.dense_output(y, transpose)

    def _flax_conv(self, m, next_fun, args, kwargs):
        return self._conv(m, next_fun, args, kwargs, False)

    def _flax_conv_transpose(self, m, next_fun, args, kwargs):
        return self._conv(m, next_fun, args, kwargs, True)

    # -- embeddings

    def _table(self, m, table) -> bool:
        """Whether `m`'s table splits on the grid (placing it); if not it stays whole, noted."""
        if table_divides(table.shape, self.mesh):
            self._place(m, "embedding", table.shape, embed_spec())
            return True
        self.notes[(*m.scope.path, "embedding")] = (
            f"(vocabulary, features) = {tuple(table.shape)} not divisible by (row×depth, col) = "
            f"({self.sizes[Axis.ROW] * self.sizes[Axis.DEPTH]}, {self.sizes[Axis.COL]})")
        return False

    def _embed(self, m, next_fun, args, kwargs):
        if not self._table(m, m.embedding):
            return next_fun(*args, **kwargs)
        tokens = _input(args, kwargs)
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Embed: input type must be an integer, got {tokens.dtype}")
        (table,) = m.promote_dtype(m.embedding, dtype=m.dtype, inexact=False)
        try:
            return self.layout.mark(tp_embed(tokens, table, self.mesh), Axis.COL)
        except ValueError as e:
            raise ValueError(f"parallelize: layer '{_path(m)}' (Embed): {e}") from None

    def _attend(self, m, next_fun, args, kwargs):
        if not self._table(m, m.embedding):
            return next_fun(*args, **kwargs)
        query, table = m.promote_dtype(_input(args, kwargs), m.embedding, dtype=m.dtype)
        try:
            return self.layout.dense_output(
                tp_attend(query, table, self.mesh, options=_options(self.kernels, m)), False)
        except ValueError as e:
            raise ValueError(f"parallelize: layer '{_path(m)}' (Embed.attend): {e}") from None

    # -- norms: Flax's own arithmetic on feature-split activations (GSPMD all-reduces the stats)

    def _norm(self, m, next_fun, args, kwargs):
        x = _input(args, kwargs)
        if m.reduction_axes not in (-1, (-1,)) or m.feature_axes not in (-1, (-1,)) or m.axis_name:
            raise NotImplementedError(
                f"parallelize: layer '{_path(m)}' ({type(m).__name__}) normalizes over "
                f"reduction_axes={m.reduction_axes}, feature_axes={m.feature_axes}, "
                f"axis_name={m.axis_name}; only the last axis, without axis_name, is supported")
        axis = self.layout.norm(_path(m), x)
        if x.shape[-1] % self.sizes[axis]:
            raise ValueError(f"parallelize: layer '{_path(m)}' ({type(m).__name__}): features "
                             f"{x.shape[-1]} are not divisible by {axis} = {self.sizes[axis]}")
        y = next_fun(*args, **kwargs)
        for name in ("scale", "bias"):
            if m.has_variable("params", name):
                self._place(m, name, (x.shape[-1],), P(axis))
        return self.layout.mark(y, axis)

    def _group_norm(self, m, next_fun, args, kwargs):
        """GroupNorm on channels split over an axis: each device holds whole groups, so Flax's
        arithmetic runs locally (the groups must divide over the axis)."""
        x = _input(args, kwargs)
        if m.axis_name or m.reduction_axes is not None:
            raise NotImplementedError(
                f"parallelize: layer '{_path(m)}' (GroupNorm) sets axis_name={m.axis_name} or "
                f"reduction_axes={m.reduction_axes}; only the defaults are supported")
        axis = self.layout.norm(_path(m), x)
        channels = x.shape[-1]
        groups = m.num_groups if m.num_groups is not None else channels // m.group_size
        check_groups(_path(m), type(m).__name__, channels, groups, axis, self.sizes[axis])
        y = next_fun(*args, **kwargs)
        for name in ("scale", "bias"):
            if m.has_variable("params", name):
                self._place(m, name, (channels,), P(axis))
        return self.layout.mark(y, axis)


def _check_plain_dot(m):
    if m.dot_general is not None or m.dot_general_cls is not None:
        raise NotImplementedError(f"parallelize: layer '{_path(m)}' ({type(m).__name__}) sets a "
                                  "custom dot_general, which the tensor-parallel matmul replaces")


# Keyed by the function being run: a subclass's own methods run as written around these.
_HANDLERS: dict[Callable, Callable] = {
    _own(nn.Dense, "__call__"): _Interceptor._flax_dense,
    _own(nn.DenseGeneral, "__call__"): _Interceptor._flax_dense_general,
    _own(nn.Embed, "__call__"): _Interceptor._embed,
    _own(nn.Embed, "attend"): _Interceptor._attend,
    _own(nn.LayerNorm, "__call__"): _Interceptor._norm,
    _own(nn.RMSNorm, "__call__"): _Interceptor._norm,
    _own(nn.GroupNorm, "__call__"): _Interceptor._group_norm,
    _own(nn.Conv, "__call__"): _Interceptor._flax_conv,
    _own(nn.ConvTranspose, "__call__"): _Interceptor._flax_conv_transpose,
}


def _path_key(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)


def _spec_of(interceptor: _Interceptor, key: tuple, shape) -> P:
    if key not in interceptor.placed:
        return P()
    layer_shape, spec = interceptor.placed[key]
    try:
        return stacked_spec(spec, layer_shape, shape)
    except ValueError as e:
        raise ValueError(f"parallelize: parameter '{'/'.join(key)}': {e}") from None


def _box(params, interceptor: _Interceptor):
    """`params` with every parameter the trace placed in an `nn.Partitioned` box."""
    def box(path, leaf):
        key, value = _path_key(path), meta.unbox(leaf)
        if key not in interceptor.placed:
            return leaf
        return nn.Partitioned(value, tuple(_spec_of(interceptor, key, value.shape)))
    return jax.tree_util.tree_map_with_path(box, params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def _linen_report(params, interceptor: _Interceptor) -> _report.SplitReport:
    entries = []
    boxed = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=boxed)[0]:
        key, value = _path_key(path), meta.unbox(leaf)
        kept = any(key[:len(k)] == k for k in interceptor.kept)
        note = _report.RULE_NOTE if kept else interceptor.notes.get(key, "")
        spec = _spec_of(interceptor, key, jnp.shape(value))
        if key not in interceptor.placed and isinstance(leaf, nn.Partitioned):
            spec = leaf.get_partition_spec()  # placed by the model's own code
        entries.append(("/".join(map(str, key)), jnp.shape(value), value.dtype, spec, note))
    return _report.build(entries, interceptor.sizes)


def _parallelize_linen(module: nn.Module, mesh, overrides: dict, rules: dict, report,
                       max_replicated, kernels: KernelOptions = DEFAULT):
    """The linen form of `parallelize`: a subclass of `type(module)` with the same fields whose
    `init` / `init_with_output` / `apply` run under an `_Interceptor`."""
    base = type(module)
    reported = []  # the report and notes come once per parallelized module

    def traced(call):
        """`call()` under a fresh interceptor: (result, interceptor)."""
        interceptor = _Interceptor(mesh, overrides, rules, kernels)
        with nn.intercept_methods(interceptor):
            return call(), interceptor

    def finish(interceptor, params):
        if not reported:
            _report.act(_linen_report(params, interceptor), report, max_replicated)
            reported.append(True)

    def placed(variables, interceptor):
        if "params" not in variables:
            return variables
        variables = {**variables, "params": _box(variables["params"], interceptor)}
        finish(interceptor, variables["params"])
        return variables

    def init_with_output(self, *args, **kwargs):
        (y, variables), interceptor = traced(lambda: base.init_with_output(self, *args, **kwargs))
        return y, placed(variables, interceptor)

    def init(self, *args, **kwargs):
        # Flax's `init` is `init_with_output`'s variables; calling the base's own keeps the
        # trace under one interceptor (this class's `init_with_output` would add another)
        (_, variables), interceptor = traced(lambda: base.init_with_output(self, *args, **kwargs))
        return placed(variables, interceptor)

    def apply(self, variables, *args, **kwargs):
        variables = meta.unbox(variables)  # model code reading self.variables sees plain arrays
        out, interceptor = traced(lambda: base.apply(self, variables, *args, **kwargs))
        finish(interceptor, variables.get("params", {}))
        return out

    methods = {"init": init, "init_with_output": init_with_output, "apply": apply}
    for name, fn in methods.items():
        fn.__doc__ = getattr(base, name).__doc__
        methods[name] = nn.nowrap(fn)
    cls = type(f"Parallel{base.__name__}", (base,),
               {**methods, "__module__": base.__module__, "axonn_mesh": mesh,
                "axonn_kernels": kernels})
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.init and f.name not in ("parent", "name")}
    return cls(**fields)


def parallelize(module, mesh, *, transpose: Mapping[str, bool] | None = None,
                rules: Mapping | None = None, report: bool | Callable = False,
                max_replicated: int | None = None, example_args: tuple | None = None,
                example_kwargs: Mapping | None = None, kernels: KernelOptions = DEFAULT):
    """The tensor-parallel version of a Flax `module` (linen or NNX) on `mesh`.

    Embedding tables and convolution kernels whose channels the grid does not divide (an RGB
    input or output layer) stay whole (noted). A linen module whose attribute
    `tp_replicated_rows` is True runs the layers inside it in the replicated layout.

    Args:
      module: a `flax.linen` or `flax.nnx` Module.
      mesh: a mesh with axes `depth, row, col` (`make_mesh`).
      transpose: optional `{layer path: bool}` (paths like `'blocks/attn_out'`, NNX
        `'blocks/0/up'`) overriding the automatic choice of normal / transposed layers.
      rules: `{module class or path glob: AsDense(...) | Replicated()}` (`axonn_jax.tp.rules`):
        run a custom dense module tensor-parallel, or keep a module as written with whole
        parameters.
      report: True prints a `SplitReport` (every parameter, its split and the bytes left whole on
        each device) once the layout is known (linen: at the first `init` / `apply`; NNX: here);
        a callable receives it instead. Weights left whole are named in one-line log notes
        either way.
      max_replicated: raise ValueError if a parameter above this many elements would stay whole
        on every device (except those kept so by a Replicated rule).
      example_args: NNX only: positional inputs of `module.__call__` that let it trace the layout
        and alternate `transpose`; without them (and `example_kwargs`) dense layers are normal.
      example_kwargs: NNX only: keyword inputs of `module.__call__`, as `example_args`.
      kernels: the modes of the tensor-parallel dense layers
        (`axonn_jax.tp.options.KernelOptions`: FP8 GEMMs, gathers in rings, the replicated
        layout), fixed in the returned module, so part of what `jax.jit` of a function calling
        it caches on.

    Returns:
      Linen: an instance of a subclass of `type(module)` with the same fields, whose `init` /
      `apply` run the model's dense layers, embeddings and norms tensor-parallel (see the module
      docstring); the layout is traced at `init` / `apply`. NNX: a copy of `module` whose
      `nnx.Linear` / `nnx.LinearGeneral` / `nnx.Embed` run tensor-parallel
      (`axonn_jax.layers_nnx`) and whose variables are placed on `mesh` (see
      `axonn_jax.tp.parallelize_nnx`).

    Raises:
      NotImplementedError: naming a layer it cannot run tensor-parallel (grouped or local
        convolutions, batch norm, DenseGeneral with batch_dims).
      ValueError: naming a layer whose dimensions the grid does not divide; or the mesh lacks
        `depth`, `row` or `col`.
      TypeError: `module` is not a Flax module, or `example_args` / `example_kwargs` are given
        for a linen module.
    """
    missing = set(TENSOR_AXES) - set(getattr(mesh, "axis_names", ()))
    if missing:
        raise ValueError(f"parallelize: the mesh lacks axes {sorted(missing)}; build it with make_mesh")
    rules = check_rules(rules)
    if isinstance(module, nnx.Module):
        return parallelize_nnx(module, mesh, transpose=transpose, rules=rules, report=report,
                               max_replicated=max_replicated, example_args=example_args,
                               example_kwargs=example_kwargs, kernels=kernels)
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize takes a flax.linen or flax.nnx Module, got {type(module).__name__}")
    if example_args is not None or example_kwargs is not None:
        raise TypeError("parallelize: example_args / example_kwargs are for NNX modules; a linen "
                        "module's layout is traced from the inputs of its init / apply")
    return _parallelize_linen(module, mesh, dict(transpose or {}), rules, report, max_replicated,
                              kernels)


def transpose_plan(module, mesh, *args, **kwargs) -> dict[str, bool]:
    """The `{dense layer path: transpose}` that `parallelize` chooses for `module` on its inputs.

    Traced abstractly; nothing is computed.

    Args:
      module: a linen module, or an NNX module (then `args` / `kwargs` act as `parallelize`'s
        `example_args` / `example_kwargs`).
      mesh: a mesh with axes `depth, row, col`.
      *args: positional inputs of the module (arrays or `jax.ShapeDtypeStruct`s).
      **kwargs: keyword inputs of the module.

    Returns:
      `{dense layer path: transpose}`.
    """
    if isinstance(module, nnx.Module):
        return dict(trace_layout(module, {}, args, kwargs).decisions)
    interceptor = _Interceptor(mesh, {}, {})

    def init(key):
        with nn.intercept_methods(interceptor):
            return module.init(key, *args, **kwargs)

    jax.eval_shape(init, jax.random.key(0))
    return dict(interceptor.layout.decisions)
