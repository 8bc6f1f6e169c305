"""`parallelize`: run an ordinary Flax model's layers with AxoNN's 2D/3D tensor parallelism. This
file holds the one public entry point and the linen transform; NNX modules go to
`axonn_jax.tp.parallelize_nnx`.

For linen, the returned module is an instance of a subclass of the model's class with the same
fields. Its `init` and `apply` run the model under `nn.intercept_methods`, which replaces the
arithmetic of Flax's own `nn.Dense`, `nn.DenseGeneral` (2-D kernels), `nn.Embed`, `nn.LayerNorm`
and `nn.RMSNorm` by the tensor-parallel versions of `axonn_jax.layers`. Parameter names, global
shapes and initializers are Flax's, so the parameter tree is the original's: `init` returns it boxed in
`nn.Partitioned` (`nn.get_partition_spec` gives the placement, `nn.unbox` the plain tree, which the
original module accepts), and `apply` accepts the original's parameters and lays them out as it goes.

Choosing `transpose` follows the layout of activations through the trace (`axonn_jax.tp._layout`).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Mapping

import flax.linen as nn
from flax import nnx

from . import layers
from ._layout import Layout
from .parallelize_nnx import parallelize_nnx, trace_layout

_ACTIVE = contextvars.ContextVar("axonn_parallelize_active", default=False)
_UNSUPPORTED = (nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum, nn.BatchNorm, nn.GroupNorm,
                nn.InstanceNorm, nn.SpectralNorm, nn.WeightNorm)


def _path(m: nn.Module) -> str:
    scope = getattr(m, "scope", None)
    return "/".join(scope.path) if scope is not None and scope.path else (m.name or type(m).__name__)


class _Interceptor:
    """The method interceptor of one trace, choosing layouts with a `Layout`."""

    def __init__(self, mesh, transpose: Mapping[str, bool]):
        self.mesh = mesh
        self.layout = Layout(transpose)

    def _dense(self, m, x, features: int):
        path = _path(m)
        transpose = self.layout.dense(path, x)
        try:
            y = layers.dense_call(m, x, features, self.mesh, transpose)
        except ValueError as e:
            raise ValueError(f"parallelize: layer '{path}' ({type(m).__name__}): {e}") from None
        return self.layout.dense_output(y, transpose)

    def __call__(self, next_fun, args, kwargs, context):
        m, method = context.module, context.method_name
        if isinstance(m, _UNSUPPORTED):
            raise NotImplementedError(
                f"parallelize: cannot run layer '{_path(m)}' ({type(m).__name__}) tensor-parallel; "
                "supported: nn.Dense, nn.DenseGeneral with a 2-D kernel, nn.Embed, nn.LayerNorm, "
                "nn.RMSNorm")
        if isinstance(m, nn.Embed):
            if method == "setup":
                m.embedding = layers.embed_param(m)
                return None
            if method == "__call__":
                try:
                    return self.layout.mark(layers.embed_call(m, m.embedding, args[0], self.mesh), "col")
                except ValueError as e:
                    raise ValueError(f"parallelize: layer '{_path(m)}' (Embed): {e}") from None
            raise NotImplementedError(f"parallelize: Embed.{method} of layer '{_path(m)}' (e.g. "
                                      "tied output heads via `attend`) is not supported")
        if method != "__call__":
            return next_fun(*args, **kwargs)
        if isinstance(m, nn.Dense):
            self._check_plain_dot(m)
            return self._dense(m, args[0], m.features)
        if isinstance(m, nn.DenseGeneral):
            self._check_plain_dot(m)
            features = (m.features,) if isinstance(m.features, int) else tuple(m.features)
            axis = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
            if len(features) != 1 or axis not in ((-1,), (args[0].ndim - 1,)) or tuple(m.batch_dims):
                raise NotImplementedError(
                    f"parallelize: layer '{_path(m)}' (DenseGeneral features={m.features}, "
                    f"axis={m.axis}, batch_dims={m.batch_dims}) has a kernel that is not 2-D "
                    "(in, out); only features=int, axis=-1, batch_dims=() is supported")
            return self._dense(m, args[0], features[0])
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            x = args[0]
            if m.reduction_axes not in (-1, (-1,)) or m.feature_axes not in (-1, (-1,)) or m.axis_name:
                raise NotImplementedError(
                    f"parallelize: layer '{_path(m)}' ({type(m).__name__}) normalizes over "
                    f"reduction_axes={m.reduction_axes}, feature_axes={m.feature_axes}, "
                    f"axis_name={m.axis_name}; only the last axis, without axis_name, is supported")
            axis = self.layout.norm(_path(m), x)
            return self.layout.mark(layers.norm_call(m, x, axis, rms=isinstance(m, nn.RMSNorm)), axis)
        return next_fun(*args, **kwargs)

    @staticmethod
    def _check_plain_dot(m):
        if m.dot_general is not None or m.dot_general_cls is not None:
            raise NotImplementedError(f"parallelize: layer '{_path(m)}' ({type(m).__name__}) sets a "
                                      "custom dot_general, which the tensor-parallel matmul replaces")


def parallelize(module, mesh, *, transpose: Mapping[str, bool] | None = None,
                example_args: tuple | None = None, example_kwargs: Mapping | None = None):
    """The tensor-parallel version of a Flax `module` (linen or NNX) on `mesh` (axes `depth, row, col`).

    Linen: returns an instance of a subclass of `type(module)` with the same fields, whose `init` /
    `apply` run the model's dense layers, embeddings and norms with `axonn_jax.layers` (see the
    module docstring); the layout is traced at `init` / `apply`.
    NNX: returns a copy of `module` whose `nnx.Linear` / `nnx.Embed` run tensor-parallel
    (`axonn_jax.layers_nnx`) and whose variables are placed on `mesh` (see
    `axonn_jax.tp.parallelize_nnx`); `example_args` / `example_kwargs` (inputs of `module.__call__`)
    let it trace the layout and alternate `transpose`; without them dense layers are normal.

    transpose: optional `{layer path: bool}` (paths like `'blocks/attn_out'`, NNX `'blocks/0/up'`)
    overriding the automatic choice of normal / transposed layers. Raises NotImplementedError
    naming a layer it cannot run tensor-parallel (convolutions, batch norm, multi-dim
    DenseGeneral / LinearGeneral, Embed.attend in linen), ValueError naming a layer whose
    dimensions the grid does not divide.
    """
    missing = {"depth", "row", "col"} - set(getattr(mesh, "axis_names", ()))
    if missing:
        raise ValueError(f"parallelize: the mesh lacks axes {sorted(missing)}; build it with make_mesh")
    if isinstance(module, nnx.Module):
        return parallelize_nnx(module, mesh, transpose=transpose, example_args=example_args,
                               example_kwargs=example_kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize takes a flax.linen or flax.nnx Module, got {type(module).__name__}")
    if example_args is not None or example_kwargs is not None:
        raise TypeError("parallelize: example_args / example_kwargs are for NNX modules; a linen "
                        "module's layout is traced from the inputs of its init / apply")
    base = type(module)
    overrides = dict(transpose or {})

    def run(method_name):
        def wrapped(self, *args, **kwargs):
            if _ACTIVE.get():  # `init` calls `init_with_output`: intercept once per trace
                return getattr(base, method_name)(self, *args, **kwargs)
            token = _ACTIVE.set(True)
            try:
                with nn.intercept_methods(_Interceptor(mesh, overrides)):
                    return getattr(base, method_name)(self, *args, **kwargs)
            finally:
                _ACTIVE.reset(token)
        wrapped.__doc__ = getattr(base, method_name).__doc__
        return nn.nowrap(wrapped)

    cls = type(f"Parallel{base.__name__}", (base,),
               {"init": run("init"), "apply": run("apply"), "init_with_output": run("init_with_output"),
                "__module__": base.__module__, "axonn_mesh": mesh})
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
              if f.init and f.name not in ("parent", "name")}
    return cls(**fields)


def transpose_plan(module, mesh, *args, **kwargs) -> dict[str, bool]:
    """`{dense layer path: transpose}` that `parallelize` chooses for a linen `module` with inputs
    `args` / `kwargs` (or an NNX `module` with `example_args=args, example_kwargs=kwargs`), traced
    abstractly; nothing is computed."""
    import jax

    if isinstance(module, nnx.Module):
        return dict(trace_layout(module, {}, args, kwargs).decisions)
    interceptor = _Interceptor(mesh, {})

    def init(key):
        with nn.intercept_methods(interceptor):
            return module.init(key, *args, **kwargs)

    jax.eval_shape(init, jax.random.key(0))
    return dict(interceptor.layout.decisions)
