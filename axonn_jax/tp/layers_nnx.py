"""Tensor-parallel Flax NNX layers: `Dense`, vocabulary-parallel `Embed`, `LayerNorm` for
feature-sharded activations (the NNX counterparts of `axonn_jax.layers`).

Each is a subclass of the NNX layer it replaces, with the same parameters (names, shapes,
initializers) carrying `out_sharding` metadata, so `nnx.get_partition_spec(nnx.state(model))` gives
their placement on the `('depth','row','col')` axes. Flax places each parameter as it is created;
create the model under `nnx.jit` so that no device ever holds a full copy.
"""
from __future__ import annotations

from flax import nnx

from .tensor import bias_spec, embed_spec, kernel_spec, tp_dense, tp_embed


class Dense(nnx.Linear):
    """Tensor-parallel `nnx.Linear`: `x (batch, ..., in)` -> `(batch, ..., out)`; input features
    over `col` and output over `row` (`transpose=True` swaps them); kernel also split over `depth`,
    batch over `depth`. See `axonn_jax.tp.tensor.tp_dense`."""

    def __init__(self, in_features: int, out_features: int, *, mesh, transpose: bool = False,
                 rngs: nnx.Rngs, **kwargs):
        super().__init__(in_features, out_features, rngs=rngs,
                         kernel_metadata={"out_sharding": tuple(kernel_spec(transpose)), "mesh": mesh},
                         bias_metadata={"out_sharding": tuple(bias_spec(transpose)), "mesh": mesh},
                         **kwargs)
        self.mesh, self.transpose = mesh, transpose

    def __call__(self, x):
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
        return tp_dense(x, kernel, bias, self.mesh, self.transpose)


class Embed(nnx.Embed):
    """Vocabulary-parallel `nnx.Embed`: table vocab over (`row`, `depth`), features over `col`;
    `tokens (batch, ...)` -> `(batch, ..., features)` over `col` (zeros for out-of-range tokens)."""

    def __init__(self, num_embeddings: int, features: int, *, mesh, rngs: nnx.Rngs, **kwargs):
        super().__init__(num_embeddings, features, rngs=rngs,
                         embedding_metadata={"out_sharding": tuple(embed_spec()), "mesh": mesh}, **kwargs)
        self.mesh = mesh

    def __call__(self, tokens):
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return tp_embed(tokens, embedding, self.mesh)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` over the last dim of activations whose features are split over `axis`
    (`col` for the residual stream): scale and bias are split the same way, and GSPMD turns the
    feature statistics into all-reduces over `axis`."""

    def __init__(self, num_features: int, *, mesh, axis: str = "col", rngs: nnx.Rngs, **kwargs):
        meta = {"out_sharding": (axis,), "mesh": mesh}
        super().__init__(num_features, rngs=rngs, scale_metadata=meta, bias_metadata=meta, **kwargs)
