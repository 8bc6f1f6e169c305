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
from jax.ad_checkpoint import checkpoint_name

from ..data import VOCAB_SIZE
from ..parallel.pipeline_module import pipeline


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


class Block(nn.Module):
    """One pre-LayerNorm transformer block. `x: (batch, seq, d_model)` -> same shape."""

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, _=None):
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
        x = x + dense(c.d_model, "mlp_down")(h)
        return x, None


class GPT(nn.Module):
    """GPT language model. `tokens: (batch, seq) int32` -> logits `(batch, seq, vocab) float32`.

    block_wrapper: applied to the Block class before scanning (e.g. `nn.remat` with a policy).
    mesh, microbatches: see `axonn_jax.pipeline` (the trainer's step uses the 1F1B-capable engine
    instead and leaves `mesh` None).
    `embed`, `run_blocks` and `logits` are the three pieces `__call__` chains; the pipeline runs
    them on the first stage, on every stage (its slice of the layers), and on the last stage.
    layer_groups: per-layer activation handling, `((count, wrap), ...)` over consecutive layers
        (counts sum to `num_layers`); `wrap` maps a block function `f(layer_params, x) -> x` to
        another (e.g. `jax.checkpoint` with a policy), None keeps it as is. The parameters stay one
        stack under `blocks`, whatever the groups.
    """

    config: GPTConfig
    dtype: Any = jnp.float32
    block_wrapper: Callable[[type], type] | None = None
    mesh: Any = None  # with pipe > 1: the blocks run as a GPipe pipeline of `microbatches`
    microbatches: int = 1
    layer_groups: tuple[tuple[int, Callable | None], ...] | None = None

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype)
        self.wpe = nn.Embed(c.max_seq_len, c.d_model, dtype=self.dtype)
        block = self.block_wrapper(Block) if self.block_wrapper else Block
        # nn.scan over the blocks (params stacked on a leading layer axis), through the pipeline
        # transform so that a `mesh` with pipe > 1 runs the stack as a pipeline.
        self.blocks = pipeline(block, c.num_layers, mesh=self.mesh,
                               microbatches=self.microbatches)(c, self.dtype)
        self.ln_f = nn.LayerNorm(dtype=self.dtype)
        self.head = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype)

    def embed(self, tokens):
        """`(batch, seq) int32` -> `(batch, seq, d_model)` token plus position embeddings."""
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's max_seq_len "
                             f"{self.config.max_seq_len}")
        return self.wte(tokens) + self.wpe(jnp.arange(t))[None]

    def run_blocks(self, x):
        """The `num_layers` blocks: `(batch, seq, d_model)` -> same shape."""
        if self.layer_groups is None or self.is_initializing():
            x, _ = self.blocks(x, None)
            return x
        block = self.block_wrapper(Block) if self.block_wrapper else Block
        return scan_layer_groups(block(self.config, self.dtype, parent=None),
                                 self.variables["params"]["blocks"], x, self.layer_groups)

    def logits(self, x):
        """Final norm and output head: `(batch, seq, d_model)` -> `(batch, seq, vocab) float32`."""
        return self.head(self.ln_f(x)).astype(jnp.float32)

    def __call__(self, tokens):
        return self.logits(self.run_blocks(self.embed(tokens)))


def scan_layer_groups(block: nn.Module, stacked, x, groups):
    """Run the stacked layers as one `lax.scan` per group of consecutive layers.

    A remat policy is fixed when a scan body is traced, so layers with different decisions (keep /
    offload / recompute) need different scans; slicing one parameter stack keeps the parameter
    tree independent of the plan. block: unbound Block; stacked: its parameters with a leading
    layer axis; x: `(batch, seq, d_model)`; groups: see `GPT.layer_groups`.
    """
    def layer(p, h):
        return block.apply({"params": p}, h)[0]

    start = 0
    for count, wrap in groups:
        f = layer if wrap is None else wrap(layer)
        part = jax.tree.map(lambda a: a[start:start + count], stacked)
        x, _ = jax.lax.scan(lambda h, p: (f(p, h), None), x, part)
        start += count
    if start != block.config.num_layers:
        raise ValueError(f"layer groups cover {start} layers, the model has {block.config.num_layers}")
    return x


def cross_entropy(logits, targets):
    """Mean token cross-entropy. logits `(b, t, v)` float32, targets `(b, t)` int32."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    # A one-hot contraction (exact: the other terms are zeros), not a gather: XLA's SPMD partitioner
    # aborts on a gather from a vocabulary split over `row` inside the data-manual train step.
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)
    return -jnp.mean(picked)
