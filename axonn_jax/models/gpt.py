"""A GPT decoder (pre-LayerNorm, causal self-attention, GELU MLP) written with Flax's own layers.

`stacked(config)` is the trainer's form, a `StackedModel` of `Embedding`, `Block` and `Head`, on
language-model batches `{'inputs': (b, t) int32, 'targets': (b, t) int32}`. `GPT(config)` is the
same network as one linen module, `tokens (b, t) -> logits (b, t, vocab)`, with the same parameter
tree `{'embed': {'wte', 'wpe'}, 'blocks': {...}, 'head': {'ln_f', 'lm_head'}}` (every block parameter
stacked on a leading layer axis of length `num_layers`), so parameters trained by one run the other.
`axonn_jax.parallelize` swaps the dense layers for tensor-parallel ones without touching this file.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..config import ParallelConfig, check_divisible
from ..step.model import StackedModel

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. `d_ff` defaults to 4·d_model."""

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int = 0
    vocab_size: int = 256  # the byte-level tokens of the built-in corpus (axonn_jax.run.data)
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

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError naming the numbers unless the tensor-parallel layers split evenly on
        `grid` (normal layers: in over col·depth, out over row; transposed ones the other way;
        vocabulary-parallel tables over row·depth) and the heads split over `row`. The trainer and
        the planner both check with this."""
        check_divisible("d_model", self.d_model, ("col", "depth"), grid)
        check_divisible("d_model", self.d_model, ("row", "depth"), grid)
        check_divisible("d_ff", self.d_ff, ("row", "depth"), grid)
        check_divisible("num_heads", self.num_heads, ("row",), grid)
        check_divisible("vocab_size", self.vocab_size, ("row", "depth"), grid)
        check_divisible("max_seq_len", self.max_seq_len, ("row", "depth"), grid)


PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(num_layers=2, d_model=64, num_heads=4, max_seq_len=128),
    # Eight thin layers: splits over pipe = 2, 4 or 8 stages in tests and benchmarks.
    "gpt-tiny-deep": GPTConfig(num_layers=8, d_model=32, num_heads=2, max_seq_len=128),
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


ACTIVATION_NAMES = ("q", "k", "v", "attn", "attn_proj", "mlp_up")
"""`checkpoint_name`s of a block's intermediates that remat policies may save or offload; what they
leave out (norm outputs, softmax, GELU, residual sums) is cheap to recompute from them."""


class Embedding(nn.Module):
    """Token plus learned position embeddings: `batch['inputs'] (b, t) int32 -> (b, t, d_model)`."""

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, batch):
        c, tokens = self.config, batch["inputs"]
        t = tokens.shape[1]
        if t > c.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len {c.max_seq_len}")
        wte = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, name="wte")
        wpe = nn.Embed(c.max_seq_len, c.d_model, dtype=self.dtype, name="wpe")
        return wte(tokens) + wpe(jnp.arange(t))[None]


class Block(nn.Module):
    """One pre-LayerNorm transformer block. `x: (batch, seq, d_model)` -> same shape."""

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
        # The norms' outputs carry no name (they are recomputed): a name between a norm and a
        # tensor-parallel layer hides the feature split from GSPMD, which then moves data around.
        h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
        b, t, _d = h.shape
        heads = lambda y, n: checkpoint_name(y.reshape(b, t, c.num_heads, c.head_dim), n)
        q, k, v = (heads(dense(c.d_model, n)(h), s)
                   for n, s in (("query", "q"), ("key", "k"), ("value", "v")))
        y = checkpoint_name(causal_attention(q, k, v).reshape(b, t, c.d_model), "attn")
        x = x + checkpoint_name(dense(c.d_model, "attn_out")(y), "attn_proj")
        h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(checkpoint_name(dense(c.d_ff, "mlp_up")(h), "mlp_up"))
        return x + dense(c.d_model, "mlp_down")(h)


class Head(nn.Module):
    """Final norm and untied output head; `__call__(x, batch)` is the mean token cross-entropy
    against `batch['targets']`, `logits(x)` the `(b, t, vocab)` float32 logits."""

    config: GPTConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.ln_f = nn.LayerNorm(dtype=self.dtype)
        self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype)

    def logits(self, x):
        return self.lm_head(self.ln_f(x)).astype(jnp.float32)

    def __call__(self, x, batch):
        return cross_entropy(self.logits(x), batch["targets"])


class ScannedBlock(Block):
    """`Block` with `nn.scan`'s `(x, carry) -> (x, carry)` signature (same parameters)."""

    def __call__(self, x, carry=None):
        return super().__call__(x), carry


class GPT(nn.Module):
    """GPT language model. `tokens: (batch, seq) int32` -> logits `(batch, seq, vocab) float32`."""

    config: GPTConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.embed = Embedding(c, self.dtype)
        self.blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=c.num_layers, metadata_params={nn.PARTITION_NAME: None})(
            c, self.dtype)
        self.head = Head(c, self.dtype)

    def __call__(self, tokens):
        x, _ = self.blocks(self.embed({"inputs": tokens}), None)
        return self.head.logits(x)


def stacked(config: GPTConfig, dtype=jnp.float32) -> StackedModel:
    """The GPT as the trainer's `StackedModel` (batches `{'inputs', 'targets'}`)."""
    return StackedModel(Embedding(config, dtype), Block(config, dtype), Head(config, dtype),
                        config.num_layers, offload_names=ACTIVATION_NAMES)


def cross_entropy(logits, targets):
    """Mean token cross-entropy. logits `(b, t, v)` float32, targets `(b, t)` int32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    # A one-hot contraction (exact: the other terms are zeros), not a gather: XLA's SPMD partitioner
    # aborts on a gather from a vocabulary split over `row` inside the data-manual train step.
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)
    return -jnp.mean(picked)


def generate(config: GPTConfig, params, prompt, num_tokens: int, *, window: int, key,
             temperature: float = 0.8, dtype=jnp.float32) -> list[int]:
    """Continue the token list `prompt` by `num_tokens` sampled tokens, in a sliding window of
    `window` tokens. `params`: the GPT's (sharded or not: the model runs under jit on them)."""
    model = GPT(config, dtype)
    tokens = jnp.zeros((1, window), jnp.int32)
    prompt = list(prompt)[-window:]
    tokens = tokens.at[0, :len(prompt)].set(jnp.asarray(prompt, jnp.int32))

    @jax.jit
    def next_token(params, tokens, pos, key):
        logits = jax.lax.dynamic_index_in_dim(model.apply({"params": params}, tokens), pos - 1,
                                              axis=1, keepdims=False)
        return jax.random.categorical(key, logits / temperature, axis=-1)[0]

    out, pos = list(prompt), len(prompt)
    for _ in range(num_tokens):
        key, sub = jax.random.split(key)
        if pos == window:  # slide the window
            tokens, pos = jnp.roll(tokens, -1, axis=1), pos - 1
        nxt = next_token(params, tokens, pos, sub)
        tokens = tokens.at[0, pos].set(nxt)
        out.append(int(nxt))
        pos += 1
    return out
