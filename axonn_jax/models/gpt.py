"""A GPT decoder (pre-LayerNorm, causal self-attention, GELU MLP) written with Flax's own layers.

`stacked(config)` is the trainer's form, a `StackedModel` of `Embedding`, `Block` and `Head`, on
language-model batches `{'inputs': (b, t) int32, 'targets': (b, t) int32}`. `GPT(config)` is the
same network as one linen module, `tokens (b, t) -> logits (b, t, vocab)`, with the same parameter
tree `{'embed': {'wte', 'wpe'}, 'blocks': {...}, 'head': {'ln_f', 'lm_head'}}` (every block parameter
stacked on a leading layer axis of length `num_layers`), so parameters trained by one run the other.
`axonn_jax.parallelize` swaps the dense layers for tensor-parallel ones without touching this file.

`from_pretrained(path, mesh)` / `to_pretrained(module, params, path)` read and write Hugging Face
GPT-2 directories (its fused query/key/value `c_attn` split into `query`, `key`, `value`; its
Conv1D kernels, stored `(in, out)` by PyTorch and `(out, in)` by Flax, mapped to ours).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..collectives import ModelCommunication, StepShape
from ..config import Axis, ParallelConfig, check_divisible
from ..parallel import context
from ..step.model import StackedModel
from ..tp.tensor import DenseLayer
from . import attention, decoder, hf

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. `d_ff` defaults to 4·d_model."""

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int = 0
    vocab_size: int = 256  # the byte-level tokens of the built-in corpus (axonn_jax.run.data)
    max_seq_len: int = 1024
    norm_eps: float = 1e-6
    tie_embeddings: bool = False  # the output head multiplies by the token table (GPT-2)
    attention: str = "auto"  # the attention core's implementation (models.attention)
    context_attention: str = "ring"  # its scheme across a context axis (parallel.context)
    hf_config: str = dataclasses.field(default="", compare=False, repr=False)
    """The Hugging Face `config.json` this came from (JSON text), whose other fields
    `to_pretrained` keeps."""

    def __post_init__(self):
        attention.check_implementation(self.attention)
        context.check_scheme(self.context_attention)
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model = {self.d_model} is not divisible by num_heads = {self.num_heads}")

    @property
    def head_dim(self) -> int:
        """Features of one attention head (`d_model // num_heads`)."""
        return self.d_model // self.num_heads

    @property
    def kv_features(self) -> int:
        """Key (= value) features of a token: what context-parallel attention moves."""
        return self.d_model

    def num_params(self) -> int:
        """Parameter count (embeddings, blocks, final norm and the output head unless tied).

        Returns:
          The number of parameters of the whole model.
        """
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d  # q,k,v,o (+bias), mlp, 2 norms
        head = 0 if self.tie_embeddings else d * v
        return v * d + self.max_seq_len * d + self.num_layers * block + 2 * d + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included.

        Args:
          seq_len: tokens per sequence (what the attention scores grow with).

        Returns:
          The dense layers' and the head's matmul FLOPs, times 3, plus `score_flops_per_token`.
        """
        d, f, L = self.d_model, self.d_ff, self.num_layers
        matmul = 2 * (4 * d * d + 2 * d * f) * L + 2 * d * self.vocab_size
        return 3 * matmul + self.score_flops_per_token(seq_len)

    def score_flops_per_token(self, seq_len: int) -> int:
        """Of `flops_per_token`, the attention core's, every score of the sequence computed.

        The scores and the weighted values: 2 matmuls of `2·seq·d_model` a layer, times 3.

        Args:
          seq_len: tokens per sequence.

        Returns:
          The attention core's training FLOPs per token.
        """
        return 3 * 2 * 2 * seq_len * self.d_model * self.num_layers

    def shape(self, grid: ParallelConfig) -> decoder.DecoderShape:
        """The communicating parts on `grid` (`models.decoder`).

        Query, key and value projections sharing one input gather, the attention output, the
        MLP, the head.

        Args:
          grid: the parallel grid (its `pipe` sets the blocks of one stage).

        Returns:
          The `decoder.DecoderShape` of this model on `grid`.
        """
        d, f, n = self.d_model, self.d_ff, self.num_layers // grid.pipe
        layers = (DenseLayer("qkv", d, d, False, 3, n, gathers=1, reused=True),
                  DenseLayer("attn_out", d, d, True, 1, n, reused=True),
                  DenseLayer("mlp_up", d, f, False, 1, n, reused=True),
                  DenseLayer("mlp_down", f, d, True, 1, n),
                  DenseLayer("head", d, self.vocab_size, False, bias=False,
                             table=self.tie_embeddings))
        return decoder.DecoderShape(self.num_layers, d, self.num_heads, self.vocab_size,
                                    self.max_seq_len, layers, tied=self.tie_embeddings,
                                    kv_features=self.kv_features)

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

        The tensor-parallel layers must split evenly (normal layers: in over col·depth, out over
        row; transposed ones the other way; vocabulary-parallel tables over row·depth) and the
        heads over `row`. The trainer and the planner both check with this.

        Args:
          grid: the parallel grid.

        Raises:
          ValueError: a dimension does not divide over its axes (the message names the numbers).
        """
        check_divisible("d_model", self.d_model, (Axis.COL, Axis.DEPTH), grid)
        check_divisible("d_model", self.d_model, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("d_ff", self.d_ff, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("num_heads", self.num_heads, (Axis.ROW,), grid)
        check_divisible("vocab_size", self.vocab_size, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("max_seq_len", self.max_seq_len, (Axis.ROW, Axis.DEPTH), grid)


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
    """A preset by name, with fields optionally overridden.

    Args:
      name: a key of `PRESETS`.
      **overrides: `GPTConfig` fields and their new values.

    Returns:
      The preset's `GPTConfig` with the overrides applied.

    Raises:
      ValueError: `name` is not a preset.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


ACTIVATION_NAMES = ("q", "k", "v", "attn", "attn_proj", "mlp_up")
"""`checkpoint_name`s of a block's intermediates that remat policies may save or offload; what they
leave out (norm outputs, softmax, GELU, residual sums) is cheap to recompute from them."""


class Embedding(nn.Module):
    """Token plus learned position embeddings: `batch['inputs'] (b, t) int32 -> (b, t, d_model)`.

    The positions are `batch['positions'] (b, t)` when the batch has them (packed documents),
    else the tokens' true positions (`arange(t)`, or the context layout's inside a context axis).
    """

    config: GPTConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype)
        self.wpe = nn.Embed(c.max_seq_len, c.d_model, dtype=self.dtype)

    def __call__(self, batch):
        c, tokens = self.config, batch["inputs"]
        t = tokens.shape[1]
        check_length(t, c.max_seq_len)
        positions = attention.positions_or_none(batch.get("positions"), t)
        table = self.wpe(jnp.arange(t))[None] if positions is None else self.wpe(positions)
        return self.wte(tokens) + table

    def table(self):
        """The token table `(vocab, d_model)` (what a tied head multiplies by).

        Returns:
          The `wte` embedding matrix, shape `(vocab_size, d_model)`.
        """
        return self.wte.embedding


def check_length(local_len: int, max_seq_len: int) -> None:
    """Raise ValueError unless the whole sequence fits in `max_seq_len`.

    Args:
      local_len: this device's tokens per sequence; the whole sequence is `local_len` times the
        devices of a `context` axis that an enclosing shard_map is manual over.
      max_seq_len: the model's longest sequence.

    Raises:
      ValueError: the whole sequence is longer than `max_seq_len`.
    """
    total = local_len * context.axis_size()
    if total > max_seq_len:
        raise ValueError(f"sequence length {total} exceeds the model's max_seq_len {max_seq_len}")


class Block(nn.Module):
    """One pre-LayerNorm transformer block: `x (batch, seq, d_model)` -> the same shape.

    `segment_ids`, `positions` `(batch, seq)`: see `attention.causal_attention` (None: one
    document, positions in order).
    """

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        c = self.config
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
        # The norms' outputs carry no name (they are recomputed): a name between a norm and a
        # tensor-parallel layer hides the feature split from GSPMD, which then moves data around.
        h = nn.LayerNorm(epsilon=c.norm_eps, dtype=self.dtype, name="ln1")(x)
        b, t, _d = h.shape
        heads = lambda y, n: checkpoint_name(y.reshape(b, t, c.num_heads, c.head_dim), n)
        q, k, v = (heads(dense(c.d_model, n)(h), s)
                   for n, s in (("query", "q"), ("key", "k"), ("value", "v")))
        y = attention.causal_attention(q, k, v, c.attention, segment_ids=segment_ids,
                                       positions=positions, context_scheme=c.context_attention)
        y = checkpoint_name(y.reshape(b, t, c.d_model), "attn")
        x = x + checkpoint_name(dense(c.d_model, "attn_out")(y), "attn_proj")
        h = nn.LayerNorm(epsilon=c.norm_eps, dtype=self.dtype, name="ln2")(x)
        h = nn.gelu(checkpoint_name(dense(c.d_ff, "mlp_up")(h), "mlp_up"))
        return x + dense(c.d_model, "mlp_down")(h)


class Head(nn.Module):
    """Final norm and output head.

    `__call__(x, batch)` is the mean token cross-entropy against `batch['targets']`, `logits(x)`
    the `(b, t, vocab)` float32 logits. With `tie_embeddings` the head has no matrix of its own:
    `logits(x, table)` multiplies by the token table and `__call__(x, batch, embed_params)` takes
    it from the embedding's parameters.
    """

    config: GPTConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.ln_f = nn.LayerNorm(epsilon=self.config.norm_eps, dtype=self.dtype)
        if not self.config.tie_embeddings:
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False, dtype=self.dtype)

    def logits(self, x, table=None):
        """The float32 logits of the final-normed activations (see `output_logits`).

        Args:
          x: the last block's output, shape `(b, t, d_model)`.
          table: the token table `(vocab, d_model)` with tied embeddings, else None.

        Returns:
          float32 logits, shape `(b, t, vocab)`.
        """
        return output_logits(self, self.ln_f(x), table)

    def __call__(self, x, batch, embed_params=None):
        table = None if embed_params is None else embed_params["wte"]["embedding"]
        return cross_entropy(self.logits(x, table), batch["targets"])


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
        return self.head.logits(x, self.embed.table() if self.config.tie_embeddings else None)


def stacked(config: GPTConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> StackedModel:
    """The GPT as the trainer's `StackedModel` (batches `{'inputs', 'targets'}`).

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: not used (no layer's layout depends on it).

    Returns:
      A `StackedModel` of `Embedding`, `Block` and `Head`, `config.num_layers` blocks.
    """
    return StackedModel(Embedding(config, dtype), Block(config, dtype), Head(config, dtype),
                        config.num_layers, offload_names=ACTIVATION_NAMES,
                        head_reads_embed=config.tie_embeddings,
                        side_inputs=attention.DOCUMENT_INPUTS)


def output_logits(head: nn.Module, h, table=None):
    """float32 logits `(b, t, vocab)` of the normalized `h (b, t, d)`.

    Args:
      head: the head module (its `lm_head` and `dtype`).
      h: the normalized activations, shape `(b, t, d)`.
      table: the token table `(vocab, d)` with tied embeddings, else None.

    Returns:
      `head.lm_head(h)`, or, when `table` is given, `h @ table.T` (a plain matmul: with tensor
      parallelism GSPMD lays it out from the table's vocabulary-parallel split); float32,
      shape `(b, t, vocab)`.
    """
    if table is None:
        return head.lm_head(h).astype(jnp.float32)
    h, table = nn.dtypes.promote_dtype(h, table, dtype=head.dtype)
    return jnp.einsum("btd,vd->btv", h, table).astype(jnp.float32)


def cross_entropy(logits, targets):
    """Mean token cross-entropy.

    Args:
      logits: float32, shape `(b, t, v)`.
      targets: int32 token ids, shape `(b, t)`.

    Returns:
      The mean over all `b·t` tokens of `-log softmax(logits)[target]`, a float32 scalar.
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    # A one-hot contraction (exact: the other terms are zeros), not a gather: XLA's SPMD partitioner
    # aborts on a gather from a vocabulary split over `row` inside the data-manual train step.
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1)
    return -jnp.mean(picked)


def network(config: GPTConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> GPT:
    """The whole model as one module, `tokens -> logits`, with `stacked`'s parameter tree.

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: not used (no layer's layout depends on it).

    Returns:
      A `GPT` module.
    """
    return GPT(config, dtype)


# ----------------------------------------------------------------------------- Hugging Face

def _tensors(config: GPTConfig) -> dict[tuple[str, ...], hf.Tensor]:
    """Where every parameter leaf lives in a Hugging Face GPT-2 checkpoint."""
    d, n = config.d_model, config.num_layers
    layer = lambda name, kind, offset=0: hf.Tensor(  # noqa: E731
        "transformer.h.{}." + name, kind, n, offset)
    out = {("embed", "wte", "embedding"): hf.Tensor("transformer.wte", "embedding"),
           ("embed", "wpe", "embedding"): hf.Tensor("transformer.wpe", "embedding"),
           ("head", "ln_f", "scale"): hf.Tensor("transformer.ln_f", "layernorm"),
           ("head", "ln_f", "bias"): hf.Tensor("transformer.ln_f", "bias")}
    for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
        out[("blocks", ours, "scale")] = layer(theirs, "layernorm")
        out[("blocks", ours, "bias")] = layer(theirs, "bias")
    dense = {"query": ("attn.c_attn", 0), "key": ("attn.c_attn", d), "value": ("attn.c_attn", 2 * d),
             "attn_out": ("attn.c_proj", 0), "mlp_up": ("mlp.c_fc", 0),
             "mlp_down": ("mlp.c_proj", 0)}
    for ours, (theirs, offset) in dense.items():
        out[("blocks", ours, "kernel")] = layer(theirs, "conv1d", offset)
        out[("blocks", ours, "bias")] = layer(theirs, "bias", offset)
    if not config.tie_embeddings:
        out[("head", "lm_head", "kernel")] = hf.Tensor("lm_head", "linear")
    return out


# The causal-mask buffers of PyTorch GPT-2 exports.
_IGNORED = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)


def config_from_hf(cfg: dict) -> GPTConfig:
    """A `GPTConfig` from a Hugging Face GPT-2 `config.json` dict.

    Args:
      cfg: the parsed `config.json`.

    Returns:
      The `GPTConfig`, whose `hf_config` keeps `cfg` as JSON text.

    Raises:
      ValueError: naming what does not match (architecture, activation, attention variants).
    """
    hf.expect(cfg, "model_type", ("gpt2",))
    hf.expect(cfg, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    hf.expect(cfg, "scale_attn_weights", (True,), True)
    hf.expect(cfg, "scale_attn_by_inverse_layer_idx", (False,), False)
    hf.expect(cfg, "add_cross_attention", (False,), False)
    return GPTConfig(num_layers=cfg["n_layer"], d_model=cfg["n_embd"], num_heads=cfg["n_head"],
                     d_ff=cfg.get("n_inner") or 0, vocab_size=cfg["vocab_size"],
                     max_seq_len=cfg["n_positions"], norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                     hf_config=json.dumps(cfg))


def config_to_hf(config: GPTConfig, dtype: str) -> dict:
    """The Hugging Face GPT-2 `config.json` dict of `config` (the source's other fields kept).

    Args:
      config: the model's shape (its `hf_config` gives the fields kept).
      dtype: the `torch_dtype` to record, e.g. `"bfloat16"`.

    Returns:
      The `config.json` contents as a dict.
    """
    c = config
    base = json.loads(c.hf_config) if c.hf_config else {}
    return {**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_layer": c.num_layers, "n_embd": c.d_model, "n_head": c.num_heads, "n_inner": c.d_ff,
            "vocab_size": c.vocab_size, "n_positions": c.max_seq_len,
            "layer_norm_epsilon": c.norm_eps, "activation_function": "gelu_new",
            "tie_word_embeddings": c.tie_embeddings, "torch_dtype": dtype}


HF = hf.Family("gpt2", config_from_hf, config_to_hf, _tensors, network, _IGNORED)


def from_pretrained(path, mesh=None, dtype=jnp.float32):
    """Read a Hugging Face GPT-2 directory as a module and its parameters.

    Args:
      path: the directory (`config.json`, `model.safetensors` or a sharded index; PyTorch or
        Flax layout).
      mesh: the mesh to place the parameters on and make the module tensor-parallel over
        (`depth`, `row`, `col`; replicated over the other axes); None: the default device.
      dtype: the parameters' dtype.

    Returns:
      `(module, params)` as `axonn_jax.models.llama.from_pretrained` does (the module a `GPT`,
      tensor-parallel on `mesh`).
    """
    return HF.from_pretrained(path, mesh, dtype)


def to_pretrained(module: GPT, params, path, dtype=None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `params` as a Hugging Face GPT-2 directory (see `models.llama.to_pretrained`).

    Args:
      module: a `GPT` (its `config` names the shape).
      params: its parameters, or those of `stacked(module.config)`.
      path: the directory to write.
      dtype: the dtype to store; None: the first parameter leaf's.
      max_shard_bytes: the most bytes of one safetensors shard (see `hf.save`).
    """
    HF.to_pretrained(module, params, path, dtype, max_shard_bytes)
