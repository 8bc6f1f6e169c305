"""Tensor-parallel Flax linen layers: `Dense`, vocabulary-parallel `Embed`, and `LayerNorm` for
feature-sharded activations.

Parameters are created with `nn.with_partitioning`, so `init` returns `nn.Partitioned` boxes whose
`nn.get_partition_spec` gives each array's placement on the `('depth','row','col')` axes; initialize
under `jax.jit(..., out_shardings=...)` and no device ever holds a full copy. The names, shapes and
initializers are those of `nn.Dense` / `nn.Embed` / `nn.LayerNorm`. (`axonn_jax.parallelize` runs
Flax's own layers with the same kernels, `axonn_jax.tp.tensor`, and places their parameters itself.)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..config import Axis
from ..collectives import FP32, Collective, ParameterShard, StepShape
from .options import DEFAULT, KernelOptions
from .tensor import bias_spec, embed_spec, kernel_spec, tp_dense, tp_embed

_default_kernel_init = nn.initializers.lecun_normal()
_default_embed_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def dense_call(m: nn.Module, x, features: int, mesh, transpose: bool,
               options: KernelOptions = DEFAULT):
    """Create (or read) `m`'s `kernel (in, features)` and `bias (features,)` and apply `tp_dense`.

    Args:
      m: a linen module inside its own method, with the attributes of `nn.Dense` (`use_bias,
        dtype, param_dtype, kernel_init, bias_init, precision`).
      x: `(batch, ..., in)`, features split over `col` (`row` when `transpose`).
      features: the output features.
      mesh: the device mesh (axes `depth, row, col`; None: the mesh in context).
      transpose: swap `row` and `col`.
      options: the kernel's modes (`tp.options.KernelOptions`).

    Returns:
      `(batch, ..., features)`, features split over `row` (`col` when `transpose`).
    """
    kernel = m.param("kernel", nn.with_partitioning(m.kernel_init, tuple(kernel_spec(transpose))),
                     (x.shape[-1], features), m.param_dtype)
    bias = None
    if m.use_bias:
        bias = m.param("bias", nn.with_partitioning(m.bias_init, tuple(bias_spec(transpose))),
                       (features,), m.param_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=m.dtype)
    return tp_dense(x, kernel, bias, mesh, transpose, options=options)


def embed_param(m: nn.Module):
    """Create (or read) `m.embedding (num_embeddings, features)`, in `setup` like `nn.Embed`.

    Args:
      m: a linen module with the attributes of `nn.Embed` (`num_embeddings, features,
        embedding_init, param_dtype`).

    Returns:
      The table `(num_embeddings, features)`, vocab over (`row`, `depth`), features over `col`.
    """
    return m.param("embedding", nn.with_partitioning(m.embedding_init, tuple(embed_spec())),
                   (m.num_embeddings, m.features), m.param_dtype)


def embed_call(m: nn.Module, embedding, tokens, mesh):
    """`embedding[tokens]` with `tp_embed`; tokens outside `[0, num_embeddings)` give zeros.

    Args:
      m: a linen module with `nn.Embed`'s `dtype`.
      embedding: the table `(num_embeddings, features)`, placed as `embed_spec`.
      tokens: int `(batch, ...)`, batch over `depth` (1-D tokens are unbatched).
      mesh: the device mesh (None: the mesh in context).

    Returns:
      `(*tokens.shape, features)`, features over `col`.

    Raises:
      ValueError: `tokens` are not integers.
    """
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"Embed: input type must be an integer, got {tokens.dtype}")
    (embedding,) = nn.dtypes.promote_dtype(embedding, dtype=m.dtype, inexact=False)
    return tp_embed(tokens, embedding, mesh)


def norm_call(m: nn.Module, x, axis: str, rms: bool = False):
    """LayerNorm (or RMSNorm when `rms`) over the last dim of `x`, whose features are split.

    `scale`/`bias` `(features,)` are split the same way as the features, and GSPMD turns the
    feature mean into an all-reduce over `axis`. Numerics follow Flax's norms (float32
    statistics, `use_fast_variance`).

    Args:
      m: a linen module with the attributes of `nn.LayerNorm` (`epsilon, use_scale, use_bias,
        scale_init, bias_init, use_fast_variance, dtype, param_dtype`).
      x: `(batch, ..., features)`, features over `axis`.
      axis: the mesh axis splitting the features.
      rms: RMSNorm (no mean subtracted, no bias) rather than LayerNorm.

    Returns:
      `(batch, ..., features)`, laid out as `x`.
    """
    features = x.shape[-1]
    spec = (axis,)
    stats_dtype = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(stats_dtype)
    mean2 = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    if rms:
        mean, var = 0.0, mean2
    else:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = (jnp.maximum(0.0, mean2 - jnp.square(mean)) if m.use_fast_variance
               else jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True))
    mul = jax.lax.rsqrt(var + m.epsilon)
    args = [x]  # as Flax does, the result dtype follows the input and the parameters' values
    if m.use_scale:
        args.append(m.param("scale", nn.with_partitioning(m.scale_init, spec), (features,),
                            m.param_dtype))
        mul = mul * args[-1]
    y = (xf - mean) * mul
    if not rms and m.use_bias:
        args.append(m.param("bias", nn.with_partitioning(m.bias_init, spec), (features,),
                            m.param_dtype))
        y = y + args[-1]
    return y.astype(nn.dtypes.canonicalize_dtype(*args, dtype=m.dtype))


@dataclasses.dataclass(frozen=True)
class Norms:
    """The collectives and parameter shards of norms over features split over `col` (`norm_call`).

    As a model declares them (`collectives.Part`): `count` such norms in each of the `layers`
    blocks one device holds.

    Attributes:
      stats: 2 for LayerNorm (the mean and the mean of squares), 1 for RMSNorm.
      vectors: parameter vectors of each norm (scale and bias, or scale).
      layers: blocks one device holds; 0: outside the stack, run once per step with the head.
    """

    features: int
    stats: int = 2
    vectors: int = 2
    count: int = 1
    layers: int = 0

    def collectives(self, step: StepShape) -> list[Collective]:
        """The per-token statistics' sums over col and the vectors' gradient sums.

        The statistics are summed in float32 whatever the compute dtype, forward and backward;
        the vectors' gradients over the devices that saw other rows (depth, and row when the
        batch is split).
        """
        g, stacked = step.grid, self.layers > 0
        n = self.count * self.layers if stacked else self.count
        tokens = step.tokens / (g.row if step.split else 1)  # split: rows over row too
        stats = self.stats * tokens * FP32
        return [
            Collective("all-reduce", (Axis.COL,), stats, n, stage_forward=stacked),  # forward
            Collective("all-reduce", (Axis.COL,), stats, n),  # backward: the matching sums
            Collective("all-reduce", (Axis.DEPTH, Axis.ROW) if step.split else (Axis.DEPTH,),
                       self.vectors * self.features / g.col * step.param_bytes, n,
                       per_microbatch=True),
        ]

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The scale and bias vectors, split over `col`."""
        g = step.grid
        if not self.layers:
            return [ParameterShard(self.features / g.col, 1, ((Axis.COL,),), True)] * \
                (self.count * self.vectors)
        return [ParameterShard(self.layers * self.features / g.col, 2, ((Axis.COL,),))] * \
            (self.count * self.vectors)


@dataclasses.dataclass(frozen=True)
class GroupNorms:
    """The scales and biases of GroupNorms, counted whole on every device (`collectives.Part`).

    GroupNorms over `channels` channels in each of `layers` copies of a part (`stacked`: a block
    of the stack); their collectives are not counted (GSPMD lays the GroupNorm out).
    """

    channels: int
    layers: int = 1
    stacked: bool = False

    def collectives(self, step: StepShape) -> list[Collective]:
        """None: GSPMD lays the GroupNorm out."""
        return []

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The scales and biases, whole on every device."""
        return [ParameterShard(2 * self.channels * self.layers, 1 + self.stacked, (),
                               not self.stacked)]


class Dense(nn.Module):
    """Tensor-parallel `nn.Dense`. `x (batch, ..., in)` -> `(batch, ..., features)`.

    Normal: input features over `col`, output over `row`; `transpose=True` swaps them, so a normal
    layer followed by a transposed one needs no re-layout. The kernel is further split over `depth`
    (all-gathered just before use) and the batch over `depth`. `mesh`: the device mesh (axes
    `depth, row, col` at least). `options`: the kernel's modes (`tp.options.KernelOptions`: FP8
    GEMMs, gathers in rings, the replicated layout).
    """

    features: int
    mesh: Any = None
    transpose: bool = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = _default_kernel_init
    bias_init: Callable = nn.initializers.zeros_init()
    options: KernelOptions = DEFAULT

    @nn.compact
    def __call__(self, x):
        return dense_call(self, x, self.features, self.mesh, self.transpose, self.options)


class Embed(nn.Module):
    """Vocabulary-parallel `nn.Embed`: `tokens (batch, ...)` -> `(batch, ..., features)`.

    Output features over `col`. The table `(num_embeddings, features)`: vocab over (`row`,
    `depth`), features over `col`.
    """

    num_embeddings: int
    features: int
    mesh: Any = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: Callable = _default_embed_init

    def setup(self):
        self.embedding = embed_param(self)

    def __call__(self, tokens):
        return embed_call(self, self.embedding, tokens, self.mesh)


class LayerNorm(nn.Module):
    """`nn.LayerNorm` over the last dim of activations whose features are split over `axis`.

    `axis` is `col` for the residual stream of a parallelized transformer.
    """

    axis: str = Axis.COL
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    use_fast_variance: bool = True
    bias_init: Callable = nn.initializers.zeros_init()
    scale_init: Callable = nn.initializers.ones_init()

    @nn.compact
    def __call__(self, x):
        return norm_call(self, x, self.axis)
