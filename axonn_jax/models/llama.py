"""A Llama-family decoder (RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention, no biases) written with Flax's own layers, and its Hugging Face checkpoints.

`stacked(config)` is the trainer's form, a `StackedModel` of `Embedding`, `Block` and `Head` on
language-model batches `{'inputs', 'targets'}` of `(b, t)` int32. `Llama(config)` is the same
network as one linen module, `tokens (b, t) -> logits (b, t, vocab)` float32, with the same
parameter tree

    {'embed': {'tokens': {'embedding'}},
     'blocks': {'attn_norm', 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'mlp_norm', 'gate_proj',
                'up_proj', 'down_proj'},        every leaf stacked on a leading layer axis
     'head': {'norm', 'lm_head'}}               no 'lm_head' when the embeddings are tied

so parameters trained by one run the other. `axonn_jax.parallelize` makes the dense layers
tensor-parallel: query heads split over `row`; the key/value projections split over `row` too
when `num_kv_heads` is divisible by it, and otherwise (fewer key/value heads than `row`) stay
whole on every `row` device (`Block.replicate_kv`, a plain matmul that the transform leaves
alone: its kernel is split over `col`·`depth` only, and GSPMD sums its gradient over `row`).

`from_pretrained(path, mesh)` reads a Hugging Face Llama directory straight into that layout;
`to_pretrained(module, params, path)` writes one back.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ..collectives import Collective, ModelCommunication, ParameterShard, StepShape
from ..config import Axis, ParallelConfig, check_divisible
from ..parallel import context
from ..step.model import StackedModel
from ..tp.tensor import DenseLayer
from . import attention, decoder, hf
from .gpt import check_length, cross_entropy, output_logits


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Hugging Face's `rope_scaling` of the kinds supported (`'llama3'`, `'linear'`).

    `'llama3'`: Llama 3.1's frequency scaling (low frequencies divided by `factor`, high ones
    kept, a smooth blend between); `'linear'`: every frequency divided by `factor`, i.e.
    positions interpolated. Another `kind` raises ValueError.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling kind {self.kind!r} is not supported (supported: "
                             "llama3, linear)")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama.

    Attributes:
      num_kv_heads: key/value heads; 0 (the default) means `num_heads` (multi-head attention;
        1 is multi-query).
      head_dim: features of one head; 0 (the default) means `d_model // num_heads`.
      hf_config: the Hugging Face `config.json` this came from (JSON text), whose other fields
        `to_pretrained` keeps.
    """

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 256  # the byte-level tokens of the built-in corpus (axonn_jax.run.data)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"  # the attention core's implementation (models.attention)
    context_attention: str = "ring"  # its scheme across a context axis (parallel.context)
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        attention.check_implementation(self.attention)
        context.check_scheme(self.context_attention)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.d_model % self.num_heads:
                raise ValueError(f"d_model = {self.d_model} is not divisible by num_heads = "
                                 f"{self.num_heads}")
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads = {self.num_heads} is not divisible by num_kv_heads = "
                             f"{self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim} must be even for rotary embeddings")

    @property
    def q_features(self) -> int:
        """Query features of a token (`num_heads · head_dim`)."""
        return self.num_heads * self.head_dim

    @property
    def kv_features(self) -> int:
        """Key (= value) features of a token (`num_kv_heads · head_dim`)."""
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding, blocks, final norm and the output head unless tied).

        Returns:
          The number of parameters of the whole model.
        """
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 2 * d * self.q_features + 2 * d * self.kv_features + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else d * v
        return v * d + self.num_layers * block + d + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included.

        Args:
          seq_len: tokens per sequence (what the attention scores grow with).

        Returns:
          The dense layers' and the head's matmul FLOPs, times 3, plus `score_flops_per_token`.
        """
        d, L = self.d_model, self.num_layers
        per_layer = 2 * d * self.q_features + 2 * d * self.kv_features + 3 * d * self.d_ff
        return 3 * (2 * per_layer * L + 2 * d * self.vocab_size) + self.score_flops_per_token(seq_len)

    def score_flops_per_token(self, seq_len: int) -> int:
        """Of `flops_per_token`, the attention core's, every score of the sequence computed.

        The scores and the weighted values: 2 matmuls of `2·seq·q_features` a layer, times 3.

        Args:
          seq_len: tokens per sequence.

        Returns:
          The attention core's training FLOPs per token.
        """
        return 3 * 2 * 2 * seq_len * self.q_features * self.num_layers

    def replicate_kv(self, grid: ParallelConfig | None) -> bool:
        """Whether the key/value projections stay whole over `row` on `grid`.

        Args:
          grid: the parallel grid, or None (no grid: never).

        Returns:
          True when `num_kv_heads` does not divide over `grid.row`.
        """
        return grid is not None and self.num_kv_heads % grid.row != 0

    def shape(self, grid: ParallelConfig) -> decoder.DecoderShape:
        """The communicating parts on `grid` (`models.decoder`).

        The query projection, the key/value projections (sharing its input gather, or
        `KeyValueReplicated` when `replicate_kv`), the attention output, the gate and up
        projections (one input gather), the down projection, the head; RMSNorms, no biases.

        Args:
          grid: the parallel grid (its `pipe` sets the blocks of one stage).

        Returns:
          The `decoder.DecoderShape` of this model on `grid`.
        """
        d, q, kv, f = self.d_model, self.q_features, self.kv_features, self.d_ff
        n = self.num_layers // grid.pipe
        rep = self.replicate_kv(grid)
        kv_layers = (DenseLayer("kv", d, kv, False, 2, n, bias=False, gathers=0,
                                reused=True),)
        layers = (DenseLayer("q", d, q, False, 1, n, bias=False, gathers=1, reused=True),
                  *(() if rep else kv_layers),
                  DenseLayer("attn_out", q, d, True, 1, n, bias=False, reused=True),
                  DenseLayer("mlp_in", d, f, False, 2, n, bias=False, gathers=1, reused=True),
                  DenseLayer("mlp_down", f, d, True, 1, n, bias=False),
                  DenseLayer("head", d, self.vocab_size, False, bias=False,
                             table=self.tie_embeddings))
        replicated = (KeyValueReplicated(d, kv, self.num_kv_heads, 2, n),) if rep else ()
        return decoder.DecoderShape(self.num_layers, d, self.num_heads, self.vocab_size, 0, layers,
                                    replicated, norm_stats=1, norm_params=1,
                                    tied=self.tie_embeddings, kv_features=kv,
                                    head_dim=self.head_dim)

    def communication(self, step: StepShape) -> ModelCommunication:
        """What one train step communicates (`collectives.ModelCommunication`).

        Args:
          step: the train step's shape (grid, batch, sequence length).

        Returns:
          `decoder.communication` of `shape(step.grid)` with this model's FLOPs.
        """
        tokens = step.batch * step.seq_len
        return decoder.communication(self.shape(step.grid), step,
                                     self.flops_per_token(step.seq_len) * tokens,
                                     self.score_flops_per_token(step.seq_len) * tokens)

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError naming the numbers unless the model's dimensions split evenly on `grid`.

        The tensor-parallel layers must split evenly (see `GPTConfig.check_grid`); key/value
        heads that do not divide over `row` are replicated instead.

        Args:
          grid: the parallel grid.

        Raises:
          ValueError: a dimension does not divide over its axes (the message names the numbers).
        """
        check_divisible("d_model", self.d_model, (Axis.COL, Axis.DEPTH), grid)
        check_divisible("d_model", self.d_model, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("num_heads", self.num_heads, (Axis.ROW,), grid)
        check_divisible("num_heads·head_dim", self.q_features, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("d_ff", self.d_ff, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("vocab_size", self.vocab_size, (Axis.ROW, Axis.DEPTH), grid)


@dataclasses.dataclass(frozen=True)
class KeyValueReplicated:
    """The collectives and parameter shards of `ReplicatedDense` key/value projections.

    A `collectives.Part`: `count` of `fan_in` → `fan_out` in each of the `layers` blocks one
    device holds, as GSPMD lays them out (measured in tests/test_comm_model.py): the query heads'
    split over `row` factors into a split of the `kv_heads` key/value heads over `r = gcd(kv_heads,
    row)` devices and of each group's query heads over `row / r`, and the projections follow it:
    each device computes its `1/r` of the key/value features. Forward, the partial sums over
    `col`; backward, the attention's key/value gradients summed over the `row / r` devices sharing
    a head, the input gradient over the `r` devices holding different heads; the kernel's
    gradient, computed in `r` pieces, is all-gathered to the kernel's layout before the update
    (`step.train_step` lays gradients out like their parameters).
    """

    fan_in: int
    fan_out: int
    kv_heads: int
    count: int
    layers: int

    def collectives(self, step: StepShape) -> list[Collective]:
        """The projections' collectives in one step (see the class docstring)."""
        g, cb, pb = step.grid, step.compute_bytes, step.param_bytes
        per_stage = self.count * self.layers
        r = math.gcd(self.kv_heads, g.row)
        features = step.tokens * self.fan_out / r * cb
        kernel = self.layers * self.fan_in * self.fan_out / (g.col * g.depth) * pb
        out = [Collective("all-reduce", (Axis.COL,), features, per_stage, stage_forward=True),
               Collective("all-reduce", (Axis.ROW,), features, per_stage, group_size=g.row // r),
               Collective("all-reduce", (Axis.ROW,), step.tokens * self.fan_in / g.col * cb,
                          per_stage, group_size=r),
               Collective("all-gather", (Axis.ROW,), kernel, self.count, group_size=r)]
        if g.depth > 1:
            # The kernel's slice `b` is moved into place and gathered over depth for the forward
            # and again for the backward; its gradient summed over depth and moved back.
            b = self.fan_in * self.fan_out / (g.col * g.depth * r) * step.gathered_bytes
            # (Measured: with whole key/value heads, r = 1, GSPMD also moves the gathered
            # kernel, once for the forward and once for the backward.)
            moves = [Collective("collective-permute", (Axis.DEPTH,), b * g.depth, 2 * per_stage,
                                per_microbatch=True)] if r == 1 else []
            out += [*moves, Collective("collective-permute", (Axis.DEPTH,), b, 3 * per_stage,
                                       per_microbatch=True),
                    Collective("all-gather", (Axis.DEPTH,), b * g.depth, 2 * per_stage,
                               per_microbatch=True),
                    Collective("all-reduce", (Axis.DEPTH,), b, per_stage, per_microbatch=True)]
        return out

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The kernels, split over col·depth only (see the class docstring).

        The data-parallel exchange reduces each device's `1/r` piece of its gradient.
        """
        g = step.grid
        r = math.gcd(self.kv_heads, g.row)
        elements = self.layers * self.fan_in * self.fan_out / (g.col * g.depth)
        shard = ParameterShard(elements, 3, ((Axis.COL, Axis.DEPTH),), exchanged=elements / r)
        return [shard] * self.count


_LLAMA31_SCALING = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
PRESETS: dict[str, LlamaConfig] = {
    # Grouped-query attention (4 query heads, 2 key/value heads) at test size.
    "llama-tiny": LlamaConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                              max_seq_len=128),
    # Multi-query attention and tied embeddings at test size.
    "llama-tiny-mqa": LlamaConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=1, d_ff=128,
                                  max_seq_len=128, tie_embeddings=True),
    "llama2-7b": LlamaConfig(32, 4096, 32, 11008, vocab_size=32000, max_seq_len=4096),
    # Llama-2-7B's blocks, 8 of them (1.9B parameters): big enough that its compiled H100 schedule
    # is the real one, small enough to compile on a laptop (benchmarks/overlap.py).
    "llama-1.9b": LlamaConfig(8, 4096, 32, 11008, vocab_size=32000, max_seq_len=4096),
    "llama2-13b": LlamaConfig(40, 5120, 40, 13824, vocab_size=32000, max_seq_len=4096),
    "llama2-70b": LlamaConfig(80, 8192, 64, 28672, num_kv_heads=8, vocab_size=32000,
                              max_seq_len=4096),
    "llama3-8b": LlamaConfig(32, 4096, 32, 14336, num_kv_heads=8, vocab_size=128256,
                             max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": LlamaConfig(80, 8192, 64, 28672, num_kv_heads=8, vocab_size=128256,
                              max_seq_len=8192, rope_theta=500000.0),
    # Llama 3.1 405B (the only 405B): 128k context through the Llama-3 frequency scaling.
    "llama3-405b": LlamaConfig(126, 16384, 128, 53248, num_kv_heads=8, vocab_size=128256,
                               max_seq_len=131072, rope_theta=500000.0,
                               rope_scaling=_LLAMA31_SCALING),
    # Llama 3.1 8B and 70B: 128k context through the Llama-3 frequency scaling.
    "llama3.1-8b": LlamaConfig(32, 4096, 32, 14336, num_kv_heads=8, vocab_size=128256,
                               max_seq_len=131072, rope_theta=500000.0,
                               rope_scaling=_LLAMA31_SCALING),
    "llama3.1-70b": LlamaConfig(80, 8192, 64, 28672, num_kv_heads=8, vocab_size=128256,
                                max_seq_len=131072, rope_theta=500000.0,
                                rope_scaling=_LLAMA31_SCALING),
    # Llama 3.2 1B: tied embeddings.
    "llama3.2-1b": LlamaConfig(16, 2048, 32, 8192, num_kv_heads=8, vocab_size=128256,
                               max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True,
                               rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
}


# ----------------------------------------------------------------------------- rotary embeddings

def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The `head_dim / 2` rotary rotation frequencies (radians per position), float64.

    Args:
      head_dim: features of one head (even).
      theta: the rotary base.
      scaling: Hugging Face's `rope_scaling`, or None.

    Returns:
      `theta^(-2i/head_dim)` for `i < head_dim / 2`, rescaled as `scaling` says (Hugging Face's
      `rope_scaling` rules); shape `(head_dim / 2,)`.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_seq_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def rope_tables(seq_len: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rotary `(cos, sin)` tables for positions `0..seq_len-1`.

    Both halves of the head dimension repeat the frequencies (the "rotate half" layout of
    Hugging Face checkpoints). Angles are rounded to float32 before the cosine, as Hugging
    Face's are.

    Args:
      seq_len: the number of positions.
      head_dim: features of one head (even).
      theta: the rotary base.
      scaling: Hugging Face's `rope_scaling`, or None.

    Returns:
      `(cos, sin)`, each a `(seq_len, head_dim)` float32 numpy array.
    """
    freqs = np.outer(np.arange(seq_len, dtype=np.float64), rope_frequencies(head_dim, theta, scaling))
    angles = np.concatenate([freqs, freqs], axis=-1).astype(np.float32).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_at(positions, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """The rotary `(cos, sin)` at integer true positions (packed documents, the context layout).

    Angles are computed in float32 as Hugging Face's are (`rope_tables` rounds float64 ones:
    the two agree to float32 rounding).

    Args:
      positions: integer positions, shape `(rows, seq)`.
      head_dim: features of one head (even).
      theta: the rotary base.
      scaling: Hugging Face's `rope_scaling`, or None.

    Returns:
      `(cos, sin)`, each `(rows, seq, head_dim)` float32.
    """
    freqs = jnp.asarray(rope_frequencies(head_dim, theta, scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate `x` by position: `x·cos + rotate_half(x)·sin`.

    Args:
      x: queries or keys, shape `(batch, seq, heads, head_dim)`.
      cos: shape `(seq, head_dim)` or `(batch, seq, head_dim)` (cast to x's dtype).
      sin: shaped like `cos`.

    Returns:
      The rotated `x`, same shape and dtype.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = (jnp.asarray(a, x.dtype) for a in (cos, sin))
    cos, sin = ((a[None] if a.ndim == 2 else a)[:, :, None, :] for a in (cos, sin))
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- modules

ACTIVATION_NAMES = ("q", "k", "v", "attn", "attn_proj", "mlp_gate", "mlp_up")
"""`checkpoint_name`s of a block's intermediates that remat policies may save or offload; what they
leave out (norm outputs, rotary embeddings, softmax, SiLU, residual sums) is cheap to recompute."""


class ReplicatedDense(nn.Module):
    """A bias-free dense layer `x (..., in) -> (..., features)` that `parallelize` leaves alone.

    It is not an `nn.Dense`: its kernel `(in, features)` is split over `col`·`depth` on
    `in` only, so its output is whole on every `row` device, and GSPMD lays out the matmul and
    sums the kernel's gradient over the devices that used it. For key/value projections whose
    heads do not divide over `row`. Same parameter (`kernel`) and initializer as `nn.Dense`.
    """

    features: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), ((Axis.COL, Axis.DEPTH), None))
        kernel = self.param("kernel", init, (x.shape[-1], self.features), jnp.float32)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jnp.einsum("...i,io->...o", x, kernel)


class Embedding(nn.Module):
    """Token embeddings: `batch['inputs'] (b, t) int32 -> (b, t, d_model)`."""

    config: LlamaConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.tokens = nn.Embed(self.config.vocab_size, self.config.d_model, dtype=self.dtype)

    def __call__(self, batch):
        check_length(batch["inputs"].shape[1], self.config.max_seq_len)
        return self.tokens(batch["inputs"])

    def table(self):
        """The token table `(vocab, d_model)` (what a tied head multiplies by).

        Returns:
          The `tokens` embedding matrix, shape `(vocab_size, d_model)`.
        """
        return self.tokens.embedding


class Block(nn.Module):
    """One Llama block: `x + attn(norm(x))`, then `+ mlp(norm(·))`; `x (batch, seq, d_model)`.

    `replicate_kv`: key/value projections as `ReplicatedDense` (see the module docstring).
    `segment_ids`, `positions` `(batch, seq)`: see `attention.causal_attention` (None: one
    document, positions in order); rotary embeddings turn by the true positions.
    """

    config: LlamaConfig
    dtype: Any = jnp.float32
    replicate_kv: bool = False

    @property
    def tp_replicated_rows(self) -> bool:
        """Whether the block's tensor-parallel layers keep activations whole over `row`.

        They do next to the GSPMD-laid-out key/value projections
        (`tp.options.KernelOptions.replicated_rows`; `parallelize` reads it).
        """
        return self.replicate_kv

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        kv_dense = (lambda n, name: ReplicatedDense(n, self.dtype, name=name)) \
            if self.replicate_kv else dense
        norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, dtype=self.dtype, name=name)  # noqa: E731
        b, t, _ = x.shape
        true_positions = attention.positions_or_none(positions, t)
        cos, sin = (rope_tables(t, c.head_dim, c.rope_theta, c.rope_scaling)
                    if true_positions is None else
                    rope_at(true_positions, c.head_dim, c.rope_theta, c.rope_scaling))
        heads = lambda y, n, name: checkpoint_name(y, name).reshape(b, t, n, c.head_dim)  # noqa: E731

        h = norm("attn_norm")(x)  # no checkpoint_name here: see gpt.Block
        q = apply_rope(heads(dense(c.q_features, "q_proj")(h), c.num_heads, "q"), cos, sin)
        k = apply_rope(heads(kv_dense(c.kv_features, "k_proj")(h), c.num_kv_heads, "k"), cos, sin)
        v = heads(kv_dense(c.kv_features, "v_proj")(h), c.num_kv_heads, "v")
        y = attention.causal_attention(q, k, v, c.attention, segment_ids=segment_ids,
                                       positions=positions, context_scheme=c.context_attention,
                                       replicated_rows=self.replicate_kv)
        y = checkpoint_name(y.reshape(b, t, c.q_features), "attn")
        x = x + checkpoint_name(dense(c.d_model, "o_proj")(y), "attn_proj")
        return self.mlp(x, norm("mlp_norm")(x))

    def mlp(self, x, h):
        """The block's second half, `x + SwiGLU(h)` with `h = mlp_norm(x)`.

        A subclass may put another feed-forward layer here (`models.mixtral`).

        Args:
          x: the residual stream, shape `(batch, seq, d_model)`.
          h: `mlp_norm(x)`, same shape.

        Returns:
          The block's output, shape `(batch, seq, d_model)`.
        """
        c = self.config
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        gate = checkpoint_name(dense(c.d_ff, "gate_proj")(h), "mlp_gate")
        up = checkpoint_name(dense(c.d_ff, "up_proj")(h), "mlp_up")
        return x + dense(c.d_model, "down_proj")(nn.silu(gate) * up)


class Head(nn.Module):
    """Final RMSNorm and output layer.

    `__call__(x, batch)` is the mean token cross-entropy
    against `batch['targets']`, `logits(x)` the `(b, t, vocab)` float32 logits. With
    `tie_embeddings` the output layer is the token table: `logits(x, table)`, and
    `__call__(x, batch, embed_params)`. `replicate_kv`: the blocks' (the output layer keeps their
    layout).
    """

    config: LlamaConfig
    dtype: Any = jnp.float32
    replicate_kv: bool = False

    @property
    def tp_replicated_rows(self) -> bool:
        """The output layer keeps the blocks' layout (`Block.tp_replicated_rows`)."""
        return self.replicate_kv

    def setup(self):
        self.norm = nn.RMSNorm(epsilon=self.config.norm_eps, dtype=self.dtype)
        if not self.config.tie_embeddings:
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype)

    def logits(self, x, table=None):
        """The float32 logits of the final-normed activations (see `gpt.output_logits`).

        Args:
          x: the last block's output, shape `(b, t, d_model)`.
          table: the token table `(vocab, d_model)` with tied embeddings, else None.

        Returns:
          float32 logits, shape `(b, t, vocab)`.
        """
        return output_logits(self, self.norm(x), table)

    def __call__(self, x, batch, embed_params=None):
        table = None if embed_params is None else embed_params["tokens"]["embedding"]
        return cross_entropy(self.logits(x, table), batch["targets"])


class ScannedBlock(Block):
    """`Block` with `nn.scan`'s `(x, carry) -> (x, carry)` signature (same parameters)."""

    def __call__(self, x, carry=None):
        return super().__call__(x), carry


class Llama(nn.Module):
    """Llama language model. `tokens: (batch, seq) int32` -> logits `(batch, seq, vocab) float32`."""

    config: LlamaConfig
    dtype: Any = jnp.float32
    replicate_kv: bool = False

    def setup(self):
        c = self.config
        self.embed = Embedding(c, self.dtype)
        self.blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=c.num_layers, metadata_params={nn.PARTITION_NAME: None})(
            c, self.dtype, self.replicate_kv)
        self.head = Head(c, self.dtype, self.replicate_kv)

    def __call__(self, tokens):
        x, _ = self.blocks(self.embed({"inputs": tokens}), None)
        return self.head.logits(x, self.embed.table() if self.config.tie_embeddings else None)


def stacked(config: LlamaConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> StackedModel:
    """The Llama as the trainer's `StackedModel` (batches `{'inputs', 'targets'}`).

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: the grid it will run on, which decides whether key/value projections are replicated
        over `row` (`LlamaConfig.replicate_kv`); None: not.

    Returns:
      A `StackedModel` of `Embedding`, `Block` and `Head`, `config.num_layers` blocks.
    """
    rep = config.replicate_kv(grid)
    return StackedModel(Embedding(config, dtype), Block(config, dtype, rep), Head(config, dtype, rep),
                        config.num_layers, offload_names=ACTIVATION_NAMES,
                        head_reads_embed=config.tie_embeddings,
                        side_inputs=attention.DOCUMENT_INPUTS)


def network(config: LlamaConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> Llama:
    """The whole model as one module, `tokens -> logits`, with `stacked`'s parameter tree.

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: the grid it will run on (as in `stacked`); None: key/value projections not
        replicated.

    Returns:
      A `Llama` module.
    """
    return Llama(config, dtype, config.replicate_kv(grid))


# ----------------------------------------------------------------------------- Hugging Face

_LAYER = "model.layers.{}."


def _tensors(config: LlamaConfig) -> dict[tuple[str, ...], hf.Tensor]:
    """Where every parameter leaf lives in a Hugging Face Llama checkpoint."""
    layer = lambda name, kind: hf.Tensor(_LAYER + name, kind, config.num_layers)  # noqa: E731
    out = {
        ("embed", "tokens", "embedding"): hf.Tensor("model.embed_tokens", "embedding"),
        ("blocks", "attn_norm", "scale"): layer("input_layernorm", "rmsnorm"),
        ("blocks", "mlp_norm", "scale"): layer("post_attention_layernorm", "rmsnorm"),
        ("head", "norm", "scale"): hf.Tensor("model.norm", "rmsnorm"),
    }
    for ours, theirs in (("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"),
                         ("v_proj", "self_attn.v_proj"), ("o_proj", "self_attn.o_proj"),
                         ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
                         ("down_proj", "mlp.down_proj")):
        out[("blocks", ours, "kernel")] = layer(theirs, "linear")
    if not config.tie_embeddings:
        out[("head", "lm_head", "kernel")] = hf.Tensor("lm_head", "linear")
    return out


_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)  # a buffer old exports keep


def config_from_hf(cfg: dict) -> LlamaConfig:
    """A `LlamaConfig` from a Hugging Face Llama `config.json` dict.

    Args:
      cfg: the parsed `config.json`.

    Returns:
      The `LlamaConfig`, whose `hf_config` keeps `cfg` as JSON text.

    Raises:
      ValueError: naming what does not match (architecture, biases, activation,
        `pretraining_tp`, unsupported `rope_scaling`).
    """
    hf.expect(cfg, "model_type", ("llama",))
    hf.expect(cfg, "hidden_act", ("silu",))
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"config.json: {flag} = true is not supported (the Llama here has no "
                             "biases)")
    if cfg.get("pretraining_tp", 1) != 1:
        raise ValueError(f"config.json: pretraining_tp = {cfg['pretraining_tp']} is not supported")
    return LlamaConfig(
        num_layers=cfg["num_hidden_layers"], d_model=cfg["hidden_size"],
        num_heads=cfg["num_attention_heads"], d_ff=cfg["intermediate_size"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or 0, vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"], rope_theta=float(cfg.get("rope_theta", 1e4)),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling")), norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), hf_config=json.dumps(cfg))


def _rope_scaling(spec: dict | None) -> RopeScaling | None:
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(spec["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(spec["factor"]), float(spec["low_freq_factor"]),
                           float(spec["high_freq_factor"]),
                           int(spec["original_max_position_embeddings"]))
    raise ValueError(f"config.json: rope_scaling of type {kind!r} is not supported (supported: "
                     "default, linear, llama3)")


def config_to_hf(config: LlamaConfig, dtype: str) -> dict:
    """The Hugging Face `config.json` dict of `config` (the source's other fields kept).

    Args:
      config: the model's shape (its `hf_config` gives the fields kept).
      dtype: the `torch_dtype` to record, e.g. `"bfloat16"`.

    Returns:
      The `config.json` contents as a dict.
    """
    c = config
    scaling = None
    if c.rope_scaling is not None:
        r = c.rope_scaling
        scaling = {"rope_type": r.kind, "factor": r.factor}
        if r.kind == "llama3":
            scaling.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                           original_max_position_embeddings=r.original_max_seq_len)
    base = json.loads(c.hf_config) if c.hf_config else {}
    base.pop("rope_scaling", None)
    return {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": c.num_layers, "hidden_size": c.d_model,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.d_ff, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_seq_len, "rope_theta": c.rope_theta,
            "rope_scaling": scaling, "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}


HF = hf.Family("llama", config_from_hf, config_to_hf, _tensors, network, _IGNORED)


def from_pretrained(path, mesh=None, dtype=jnp.float32):
    """Read a Hugging Face Llama directory as a module and its parameters.

    With `mesh` (axes `data, pipe, depth, row, col`, see `make_mesh`) the module is
    tensor-parallel on its `depth, row, col` axes and each process reads from the files only the
    slices its devices hold; without it, one device holds the model.

    Args:
      path: the directory (`config.json`, `model.safetensors` or a sharded
        `model.safetensors.index.json`; PyTorch or Flax tensor layout).
      mesh: the mesh to place the parameters on, or None.
      dtype: the dtype the module computes in and the parameters are stored in.

    Returns:
      `(module, params)`: `module.apply({'params': params}, tokens)` gives the logits
      `(batch, seq, vocab)` float32, computed in `dtype`; `params` (in `dtype`) have the tree of
      `stacked(module.config)`, the trainer's model.

    Raises:
      ValueError: naming what does not match (architecture, shapes, missing tensors).
    """
    return HF.from_pretrained(path, mesh, dtype)


def to_pretrained(module: Llama, params, path, dtype=None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `params` as a Hugging Face directory that `transformers` loads.

    The directory gets `config.json` and `model.safetensors` in the PyTorch layout. Every
    process must call it; process 0 writes.

    Args:
      module: a `Llama` (its `config` names the shape).
      params: the tree of `module`, or of `stacked(module.config)`.
      path: the directory to write.
      dtype: the tensors' dtype; None: the parameters'.
      max_shard_bytes: above this, the tensors are sharded over several files with an index.
    """
    HF.to_pretrained(module, params, path, dtype, max_shard_bytes)
