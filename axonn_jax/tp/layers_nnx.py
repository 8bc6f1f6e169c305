"""Tensor-parallel Flax NNX layers: `Dense`, `DenseGeneral` (several feature dims: attention's
heads × head_dim), vocabulary-parallel `Embed` (lookup and `attend`), `Conv` / `ConvTranspose`
(channels-last convolutions), `LayerNorm` for feature-sharded activations (the NNX counterparts
of `axonn_jax.layers`).

Each is a subclass of the NNX layer it replaces, with the same parameters (names, shapes,
initializers) carrying `out_sharding` metadata, so `nnx.get_partition_spec(nnx.state(model))` gives
their placement on the `('depth','row','col')` axes. Flax places each parameter as it is created;
create the model under `nnx.jit` so that no device ever holds a full copy.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..config import Axis
from .conv import check_conv_options, conv_apply
from .options import DEFAULT, KernelOptions
from .tensor import (bias_spec, conv_kernel_spec, dense_specs, embed_spec, kernel_spec, tp_attend,
                     tp_dense, tp_dense_general, tp_embed)


def _no_out_sharding(layer, out_sharding):
    if out_sharding is not None:
        raise NotImplementedError(f"{type(layer).__name__}: out_sharding={out_sharding} is not "
                                  "supported; the tensor-parallel layer places its own output")


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class Dense(nnx.Linear):
    """Tensor-parallel `nnx.Linear`: `x (batch, ..., in)` -> `(batch, ..., out)`.

    Input features over `col` and output over `row` (`transpose=True` swaps them); kernel also
    split over `depth`, batch over `depth`. `options`: the kernel's modes
    (`tp.options.KernelOptions`). See `axonn_jax.tp.tensor.tp_dense`.
    """

    def __init__(self, in_features: int, out_features: int, *, mesh, transpose: bool = False,
                 options: KernelOptions = DEFAULT, rngs: nnx.Rngs, **kwargs):
        super().__init__(in_features, out_features, rngs=rngs,
                         kernel_metadata={"out_sharding": tuple(kernel_spec(transpose)), "mesh": mesh},
                         bias_metadata={"out_sharding": tuple(bias_spec(transpose)), "mesh": mesh},
                         **kwargs)
        self.mesh, self.transpose, self.options = mesh, transpose, options

    def __call__(self, x, out_sharding=None):
        _no_out_sharding(self, out_sharding)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        return tp_dense(x, kernel, bias, self.mesh, self.transpose, options=self.options)


class DenseGeneral(nnx.LinearGeneral):
    """Tensor-parallel `nnx.LinearGeneral` without `batch_axis`.

    `x` is contracted over `axis` with a kernel `(*in_features, *out_features)` ->
    `(..., *out_features)`. Split like `Dense` over the flattened features, the mesh axes on the
    leading feature dims (attention's query projection, kernel `(d_model, heads, head_dim)`:
    heads over `row`). `options`: as `Dense`'s. See `tensor.tp_dense_general`.
    """

    def __init__(self, in_features, out_features, *, mesh, transpose: bool = False,
                 options: KernelOptions = DEFAULT, rngs: nnx.Rngs, **kwargs):
        specs = dense_specs(_tuple(in_features), _tuple(out_features), dict(mesh.shape), transpose)
        if specs is None:
            raise ValueError(f"DenseGeneral: features {in_features} -> {out_features} cannot be "
                             f"split in contiguous blocks over {dict(mesh.shape)}")
        super().__init__(in_features, out_features, rngs=rngs,
                         kernel_metadata={"out_sharding": tuple(specs[0]), "mesh": mesh},
                         bias_metadata={"out_sharding": tuple(specs[1]), "mesh": mesh}, **kwargs)
        self.mesh, self.transpose, self.options = mesh, transpose, options

    def __call__(self, x, out_sharding=None):
        _no_out_sharding(self, out_sharding)
        if self.batch_axis:
            raise NotImplementedError(f"DenseGeneral: batch_axis={dict(self.batch_axis)} is not "
                                      "supported tensor-parallel")
        axis, trailing = tuple(a % x.ndim for a in self.axis), tuple(range(x.ndim - len(self.axis), x.ndim))
        if axis != trailing:
            x = jnp.moveaxis(x, axis, trailing)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        return tp_dense_general(x, kernel, bias, self.mesh, self.transpose, len(axis),
                                options=self.options)


class Embed(nnx.Embed):
    """Vocabulary-parallel `nnx.Embed`: table vocab over (`row`, `depth`), features over `col`.

    `tokens (batch, ...)` -> `(batch, ..., features)` over `col` (zeros for out-of-range tokens);
    `attend(query)` -> `(batch, ..., vocab)` over `row` (a tied output head, `tp_attend`, run
    with `options`: `tp.options.KernelOptions`).
    """

    def __init__(self, num_embeddings: int, features: int, *, mesh,
                 options: KernelOptions = DEFAULT, rngs: nnx.Rngs, **kwargs):
        super().__init__(num_embeddings, features, rngs=rngs,
                         embedding_metadata={"out_sharding": tuple(embed_spec()), "mesh": mesh}, **kwargs)
        self.mesh, self.options = mesh, options

    def __call__(self, tokens, out_sharding=None):
        _no_out_sharding(self, out_sharding)
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return tp_embed(tokens, embedding, self.mesh)

    def attend(self, query, out_sharding=None):
        """The logits `query @ embedding.T` of a tied output head (`tp_attend`).

        Args:
          query: `(batch, ..., features)`, features over `col`, batch over `depth`.
          out_sharding: must be None (the layer places its own output).

        Returns:
          `(batch, ..., vocab)`, vocab over `row`.

        Raises:
          NotImplementedError: `out_sharding` is given.
        """
        _no_out_sharding(self, out_sharding)
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return tp_attend(query, embedding, self.mesh, options=self.options)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last dim of activations whose features are split over `axis`.

    `axis` is `col` for the residual stream: scale and bias are split the same way, and GSPMD
    turns the feature statistics into all-reduces over `axis`.
    """

    def __init__(self, num_features: int, *, mesh, axis: str = Axis.COL, rngs: nnx.Rngs, **kwargs):
        meta = {"out_sharding": (axis,), "mesh": mesh}
        super().__init__(num_features, rngs=rngs, scale_metadata=meta, bias_metadata=meta, **kwargs)


def _conv_call(layer, x, transposed: bool):
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    return conv_apply(layer, x, kernel, bias, layer.mesh, layer.transpose, transposed)


class Conv(nnx.Conv):
    """Tensor-parallel `nnx.Conv` (channels last): a dense layer over the channels of every window.

    Input channels over `col` and output over `row` (`transpose=True` swaps them), the kernel
    `(*window, in, out)` also split over `depth`, the spatial dims untouched. See
    `axonn_jax.tp.tensor.tp_conv`.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size, *, mesh,
                 transpose: bool = False, rngs: nnx.Rngs, **kwargs):
        ndim = len(kernel_size) + 2 if isinstance(kernel_size, (tuple, list)) else 3
        super().__init__(in_features, out_features, kernel_size, rngs=rngs,
                         kernel_metadata={"out_sharding": tuple(conv_kernel_spec(ndim, transpose)),
                                          "mesh": mesh},
                         bias_metadata={"out_sharding": tuple(bias_spec(transpose)), "mesh": mesh},
                         **kwargs)
        self.mesh, self.transpose = mesh, transpose

    def __call__(self, x, out_sharding=None):
        _no_out_sharding(self, out_sharding)
        check_conv_options(type(self).__name__, self, False)
        return _conv_call(self, x, False)


class ConvTranspose(nnx.ConvTranspose):
    """Tensor-parallel `nnx.ConvTranspose`, split as `Conv`.

    A `transpose_kernel` kernel `(*window, out, in)` keeps `depth` on its second-to-last dim.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size, *, mesh,
                 transpose: bool = False, rngs: nnx.Rngs, **kwargs):
        ndim = len(kernel_size) + 2 if isinstance(kernel_size, (tuple, list)) else 3
        spec = conv_kernel_spec(ndim, transpose, kwargs.get("transpose_kernel", False))
        super().__init__(in_features, out_features, kernel_size, rngs=rngs,
                         kernel_metadata={"out_sharding": tuple(spec), "mesh": mesh},
                         bias_metadata={"out_sharding": tuple(bias_spec(transpose)), "mesh": mesh},
                         **kwargs)
        self.mesh, self.transpose = mesh, transpose

    def __call__(self, x):
        check_conv_options(type(self).__name__, self, True)
        return _conv_call(self, x, True)
