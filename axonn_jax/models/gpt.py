"""A GPT decoder (pre-LayerNorm, causal self-attention, GELU MLP) written with Flax's own layers.

The blocks are one `nn.scan`, so every block parameter is stacked on a leading layer axis of length
`num_layers`: the pipeline splits that axis over `pipe`, and `axonn_jax.parallelize` swaps the dense
layers for tensor-parallel ones without touching this file.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..data import VOCAB_SIZE


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. `d_ff` defaults to 4·d_model."""

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int = 0
    vocab_size: int = VOCAB_SIZE
    max_seq_len: int = 1024

    def __post_init__(self):
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} is not divisible by num_heads = {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def num_params(self) -> int:
        """Parameter count (embeddings, blocks, final norm and untied output head)."""
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # q,k,v,o (+bias), mlp, 2 norms
        return v * d + self.max_seq_len * d + self.num_layers * block + 2 * d + d * v

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included."""
        d, f, L = self.d_model, self.d_ff, self.num_layers
        matmul = 2 * (4 * d * d + 2 * d * f) * L + 2 * d * self.vocab_size
        attention = 2 * 2 * seq_len * d * L
        return 3 * (matmul + attention)


PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(num_layers=2, d_model=64, num_heads=4, max_seq_len=128),
    "gpt-mini": GPTConfig(num_layers=4, d_model=128, num_heads=4, max_seq_len=256),
    "gpt-small": GPTConfig(num_layers=12, d_model=768, num_heads=12, max_seq_len=1024),
    "gpt-1.3b": GPTConfig(num_layers=24, d_model=2048, num_heads=16, max_seq_len=2048, vocab_size=50304),
    "gpt-6.7b": GPTConfig(num_layers=32, d_model=4096, num_heads=32, max_seq_len=2048, vocab_size=50304),
    "gpt-13b": GPTConfig(num_layers=40, d_model=5120, num_heads=40, max_seq_len=2048, vocab_size=50304),
    "gpt-20b": GPTConfig(num_layers=44, d_model=6144, num_heads=48, max_seq_len=2048, vocab_size=50304),
    "gpt-100b": GPTConfig(num_layers=80, d_model=10240, num_heads=80, max_seq_len=2048, vocab_size=50304),
}


def get_config(name: str, **overrides) -> GPTConfig:
    """A preset by name, with fields optionally overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def causal_attention(q, k, v):
    """Softmax attention with a causal mask. q, k, v: `(batch, seq, heads, head_dim)`."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Block(nn.Module):
    """One pre-LayerNorm transformer block. `x: (batch, seq, d_model)` -> same shape."""

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, _=None):
        c = self.config
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        b, t, _d = h.shape
        heads = lambda y: y.reshape(b, t, c.num_heads, c.head_dim)
        q, k, v = (heads(dense(c.d_model, n)(h)) for n in ("query", "key", "value"))
        y = causal_attention(q, k, v).reshape(b, t, c.d_model)
        x = x + dense(c.d_model, "attn_out")(y)
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(dense(c.d_ff, "mlp_up")(h))
        x = x + dense(c.d_model, "mlp_down")(h)
        return x, None


class GPT(nn.Module):
    """GPT language model. `tokens: (batch, seq) int32` -> logits `(batch, seq, vocab) float32`.

    block_wrapper: applied to the Block class before scanning (e.g. `nn.remat` with a policy).
    """

    config: GPTConfig
    dtype: Any = jnp.float32
    block_wrapper: Callable[[type], type] | None = None

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        t = tokens.shape[1]
        if t > c.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len {c.max_seq_len}")
        x = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, name="wte")(tokens)
        x = x + nn.Embed(c.max_seq_len, c.d_model, dtype=self.dtype, name="wpe")(jnp.arange(t))[None]
        block = self.block_wrapper(Block) if self.block_wrapper else Block
        blocks = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=c.num_layers,
            # The stacked layer axis is not split by the tensor-parallel layers' partitioning.
            metadata_params={nn.PARTITION_NAME: None},
        )(c, self.dtype, name="blocks")
        x, _ = blocks(x, None)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        logits = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, name="head")(x)
        return logits.astype(jnp.float32)


def cross_entropy(logits, targets):
    """Mean token cross-entropy. logits `(b, t, v)` float32, targets `(b, t)` int32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    # A one-hot contraction (exact: the other terms are zeros), not a gather: XLA's SPMD partitioner
    # aborts on a gather from a vocabulary split over `row` inside the data-manual train step.
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)
    return -jnp.mean(picked)
