"""Mixtral-style decoders: Llama attention (`models.llama`) with a mixture-of-experts feed-forward
layer (`models.moe.MoE`) in every block, and their Hugging Face Mixtral checkpoints.

`stacked(config)` is the trainer's `StackedModel`; its block returns `(x, aux)` (the MoE layer's
aux: `aux['loss']` to add to the training loss, the rest metrics). `Mixtral(config)` is the same
network as one linen module, `tokens (b, t) -> logits (b, t, vocab)` float32 (with
`return_aux=True` also the aux of every layer, stacked on a leading layer axis), with the
parameter tree

    {'embed': {'tokens': {'embedding'}},
     'blocks': {'attn_norm', 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'mlp_norm',
                'moe': {'router', 'w_gate', 'w_up', 'w_down',
                        ['shared_gate', 'shared_up', 'shared_down']}},   stacked on layers
     'head': {'norm', 'lm_head'}}

The experts split over the `expert` mesh axis when the block runs inside a shard_map manual over
it (see `models.moe`); attention is tensor-parallel through `axonn_jax.parallelize` as in
`models.llama`; the experts' own matmuls are not tensor-parallel (GSPMD lays them out over the
tensor axes).

`from_pretrained(path, mesh)` / `to_pretrained(module, params, path)` read and write Hugging Face
Mixtral directories (`MixtralForCausalLM`: `block_sparse_moe.gate`, `experts.{j}.w1/w3/w2` are
our `router`, `w_gate`, `w_up`, `w_down`).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..collectives import ModelCommunication, StepShape
from ..config import Axis, ParallelConfig, check_divisible
from ..step.model import StackedModel
from ..tp.tensor import DenseLayer
from . import attention, decoder, hf, llama
from .moe import MoE, MoEConfig, MoELayers


@dataclasses.dataclass(frozen=True)
class MixtralConfig(llama.LlamaConfig):
    """A `LlamaConfig` whose MLP is a mixture of experts.

    `d_ff` is one expert's hidden width; the other fields are `MoEConfig`'s (`moe` gives it).
    """

    num_experts: int = 8
    top_k: int = 2
    score: str = "softmax"
    renormalize: bool = True
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0
    num_shared_experts: int = 0
    capacity_factor: float | None = None
    dispatch_factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        self.moe  # noqa: B018  (checks the MoE fields)

    @property
    def moe(self) -> MoEConfig:
        """The `MoEConfig` of every block's mixture of experts (checks its fields)."""
        return MoEConfig(self.num_experts, self.top_k, self.d_ff, self.score, self.renormalize,
                         self.aux_loss_weight, self.z_loss_weight, self.num_shared_experts,
                         self.capacity_factor, self.dispatch_factor)

    def num_params(self) -> int:
        """Parameter count: Llama's, with each block's MLP replaced by the MoE layer's.

        Returns:
          The number of parameters of the whole model (every expert counted).
        """
        dense_mlp = 3 * self.d_model * self.d_ff
        return super().num_params() + self.num_layers * (self.moe.num_params(self.d_model)
                                                         - dense_mlp)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included.

        The MLP's FLOPs are those of the experts a token uses (top_k routed, the shared ones,
        the router).

        Args:
          seq_len: tokens per sequence (what the attention scores grow with).

        Returns:
          The training FLOPs of one token.
        """
        extra = self.moe.active_params(self.d_model) - 3 * self.d_model * self.d_ff
        return super().flops_per_token(seq_len) + 3 * 2 * self.num_layers * extra

    def shape(self, grid: ParallelConfig) -> decoder.DecoderShape:
        """The communicating parts on `grid` (`models.decoder`).

        Llama's attention, norms and head; instead of its MLP the MoE layers
        (`models.moe.MoELayers`) and the shared experts' tensor-parallel gate/up and down
        projections.

        Args:
          grid: the parallel grid (its `pipe` sets the blocks of one stage).

        Returns:
          The `decoder.DecoderShape` of this model on `grid`, the MoE layers in its `parts`.
        """
        base = super().shape(grid)
        n, d, f = self.num_layers // grid.pipe, self.d_model, self.num_shared_experts * self.d_ff
        shared = (DenseLayer("shared_in", d, f, False, 2, n, bias=False, gathers=1,
                             reused=True),
                  DenseLayer("shared_down", f, d, True, 1, n, bias=False)) if f else ()
        dense = tuple(x for x in base.layers if x.name not in ("mlp_in", "mlp_down"))
        moe = MoELayers(self.moe, d, n)
        return dataclasses.replace(base, layers=dense + shared, parts=(moe,),
                                   metrics=moe.metrics())

    def communication(self, step: StepShape) -> ModelCommunication:
        """What one train step communicates (`collectives.ModelCommunication`).

        Args:
          step: the train step's shape (grid, batch, sequence length).

        Returns:
          `decoder.communication` of `shape(step.grid)`, with the FLOPs the compiled experts
          run (`MoELayers.routed_flops`) beside the ideal ones (`executed_flops`,
          `expert_flops`).
        """
        shape = self.shape(step.grid)
        flops = self.flops_per_token(step.seq_len) * (step.batch * step.seq_len)
        ideal = MoELayers(self.moe, self.d_model, self.num_layers).ideal_flops(
            step.batch * step.seq_len)
        # As if every device ran what one device of the (most loaded) stage runs.
        executed = shape.parts[0].executed_flops(step) * step.grid.num_devices
        tokens = step.batch * step.seq_len
        found = decoder.communication(shape, step, flops,
                                      scores=self.score_flops_per_token(step.seq_len) * tokens)
        # over context the decoder counts the ring kernel's own FLOPs (`executed_flops`)
        base = found.executed_flops if found.executed_flops is not None else flops
        return dataclasses.replace(found, executed_flops=base - ideal + executed,
                                   expert_flops=executed)

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError naming the numbers unless the model splits evenly on `grid`.

        Attention must split over the tensor axes (as in `LlamaConfig.check_grid`; the experts
        are not tensor-parallel) and the experts over the `expert` axis.

        Args:
          grid: the parallel grid.

        Raises:
          ValueError: a dimension does not divide over its axes (the message names the numbers).
        """
        check_divisible("d_model", self.d_model, (Axis.COL, Axis.DEPTH), grid)
        check_divisible("d_model", self.d_model, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("num_heads", self.num_heads, (Axis.ROW,), grid)
        check_divisible("num_heads·head_dim", self.q_features, (Axis.ROW, Axis.DEPTH), grid)
        check_divisible("vocab_size", self.vocab_size, (Axis.ROW, Axis.DEPTH), grid)
        self.moe.check_expert_axis(getattr(grid, Axis.EXPERT, 1))


PRESETS: dict[str, MixtralConfig] = {
    # Grouped-query attention and 8 experts, top-2, at test size.
    "mixtral-tiny": MixtralConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=32,
                                  max_seq_len=128, num_experts=8, top_k=2, aux_loss_weight=0.02,
                                  z_loss_weight=0.001),
    # Fine-grained experts at test size: 16 experts, top-4, sigmoid scores, one shared expert.
    "deepseek-moe-tiny": MixtralConfig(num_layers=2, d_model=64, num_heads=4, d_ff=16,
                                       max_seq_len=128, num_experts=16, top_k=4, score="sigmoid",
                                       num_shared_experts=1, aux_loss_weight=0.01),
    # Mixtral 8x7B (v0.1): 46.7B parameters, 12.9B active per token.
    "mixtral-8x7b": MixtralConfig(32, 4096, 32, 14336, num_kv_heads=8, vocab_size=32000,
                                  max_seq_len=32768, rope_theta=1e6, num_experts=8, top_k=2,
                                  aux_loss_weight=0.02),
    # DeepSeekMoE 16B's shapes: 64 routed experts of width 1408, top-6, 2 shared experts, every
    # layer a mixture (the original's first layer is dense), softmax routing without
    # renormalization, Llama attention.
    "deepseek-moe-16b": MixtralConfig(28, 2048, 16, 1408, vocab_size=102400, max_seq_len=4096,
                                      num_experts=64, top_k=6, renormalize=False,
                                      num_shared_experts=2, aux_loss_weight=0.001),
}


# ----------------------------------------------------------------------------- modules

class Block(llama.Block):
    """One Mixtral block: `x + attn(norm(x))`, then `+ moe(norm(·))`; returns `(x, aux)`.

    `x (batch, seq, d_model)`; `aux` is `models.moe.MoE`'s.
    """

    config: MixtralConfig

    def mlp(self, x, h):
        """The block's second half, `x + MoE(h)` with `h = mlp_norm(x)`.

        Args:
          x: the residual stream, shape `(batch, seq, d_model)`.
          h: `mlp_norm(x)`, same shape.

        Returns:
          `(x + y, aux)`: the block's output `(batch, seq, d_model)` and `MoE`'s aux dict.
        """
        y, aux = MoE(self.config.moe, self.dtype, name="moe")(h)
        return x + y, aux


class ScannedBlock(Block):
    """`Block` as `nn.scan`'s body: `(x, _) -> (x, aux)`."""

    def __call__(self, x, carry=None):
        return super().__call__(x)


class Mixtral(nn.Module):
    """Mixtral language model: `tokens (batch, seq) int32` -> logits `(batch, seq, vocab)` float32.

    With `return_aux` it also returns each layer's aux (leaves with a leading layer axis).
    """

    config: MixtralConfig
    dtype: Any = jnp.float32
    replicate_kv: bool = False

    def setup(self):
        c = self.config
        self.embed = llama.Embedding(c, self.dtype)
        self.blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=c.num_layers, metadata_params={nn.PARTITION_NAME: None})(
            c, self.dtype, self.replicate_kv)
        self.head = llama.Head(c, self.dtype, self.replicate_kv)

    def __call__(self, tokens, return_aux: bool = False):
        x, aux = self.blocks(self.embed({"inputs": tokens}), None)
        logits = self.head.logits(x, self.embed.table() if self.config.tie_embeddings else None)
        return (logits, aux) if return_aux else logits


ACTIVATION_NAMES = ("q", "k", "v", "attn", "attn_proj")
"""`checkpoint_name`s of a block's intermediates (the attention's, see `llama.ACTIVATION_NAMES`)."""


def stacked(config: MixtralConfig, dtype=jnp.float32,
            grid: ParallelConfig | None = None) -> StackedModel:
    """The model as the trainer's `StackedModel` (batches `{'inputs', 'targets'}`).

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: the grid it will run on, which decides whether key/value projections are replicated
        over `row` (`LlamaConfig.replicate_kv`); None: not.

    Returns:
      A `StackedModel` of Llama's embedding and head around `Block`s that return `(x, aux)`.
    """
    rep = config.replicate_kv(grid)
    return StackedModel(llama.Embedding(config, dtype), Block(config, dtype, rep),
                        llama.Head(config, dtype, rep), config.num_layers,
                        offload_names=ACTIVATION_NAMES, head_reads_embed=config.tie_embeddings,
                        side_inputs=attention.DOCUMENT_INPUTS)


def network(config: MixtralConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> Mixtral:
    """The whole model as one module, `tokens -> logits`, with `stacked`'s parameter tree.

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: the grid it will run on (as in `stacked`); None: key/value projections not
        replicated.

    Returns:
      A `Mixtral` module.
    """
    return Mixtral(config, dtype, config.replicate_kv(grid))


# ----------------------------------------------------------------------------- Hugging Face

_MOE = llama._LAYER + "block_sparse_moe."


def _tensors(config: MixtralConfig) -> dict[tuple[str, ...], hf.Tensor]:
    """Where every parameter leaf lives in a Hugging Face Mixtral checkpoint; ValueError for a
    config that format cannot hold."""
    if config.num_shared_experts or config.score != "softmax" or not config.renormalize:
        raise ValueError(f"a Hugging Face Mixtral checkpoint holds softmax routing with "
                         f"renormalized weights and no shared experts; this model has score = "
                         f"{config.score!r}, renormalize = {config.renormalize}, "
                         f"num_shared_experts = {config.num_shared_experts}")
    out = {p: t for p, t in llama._tensors(config).items()
           if p[1] not in ("gate_proj", "up_proj", "down_proj")}
    L, E = config.num_layers, config.num_experts
    out[("blocks", "moe", "router")] = hf.Tensor(_MOE + "gate", "linear", L)
    for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
        out[("blocks", "moe", ours)] = hf.Tensor(_MOE + "experts.{}." + theirs, "linear", L,
                                                 experts=E)
    return out


def config_from_hf(cfg: dict) -> MixtralConfig:
    """A `MixtralConfig` from a Hugging Face Mixtral `config.json` dict.

    Args:
      cfg: the parsed `config.json`.

    Returns:
      The `MixtralConfig`, whose `hf_config` keeps `cfg` as JSON text.

    Raises:
      ValueError: naming what is not supported (a sliding window shorter than the context,
        router jitter, and what `llama.config_from_hf` refuses).
    """
    hf.expect(cfg, "model_type", ("mixtral",))
    hf.expect(cfg, "hidden_act", ("silu",))
    window = cfg.get("sliding_window")
    if window is not None and window < cfg["max_position_embeddings"]:
        raise ValueError(f"config.json: sliding_window = {window} (< max_position_embeddings = "
                         f"{cfg['max_position_embeddings']}) is not supported")
    if cfg.get("router_jitter_noise", 0.0):
        raise ValueError(f"config.json: router_jitter_noise = {cfg['router_jitter_noise']} is not "
                         "supported")
    base = llama.config_from_hf({**cfg, "model_type": "llama"})
    return MixtralConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                            if f.name != "hf_config"},
                         num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                         aux_loss_weight=float(cfg.get("router_aux_loss_coef", 0.0)),
                         hf_config=json.dumps(cfg))


def config_to_hf(config: MixtralConfig, dtype: str) -> dict:
    """The Hugging Face `config.json` dict of `config` (the source's other fields kept).

    Args:
      config: the model's shape (its `hf_config` gives the fields kept).
      dtype: the `torch_dtype` to record, e.g. `"bfloat16"`.

    Returns:
      The `config.json` contents as a dict (`MixtralForCausalLM`).
    """
    out = llama.config_to_hf(config, dtype)
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key)
    return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": config.num_experts, "num_experts_per_tok": config.top_k,
            "router_aux_loss_coef": config.aux_loss_weight, "sliding_window": None,
            "router_jitter_noise": 0.0}


HF = hf.Family("mixtral", config_from_hf, config_to_hf, _tensors, network)


def from_pretrained(path, mesh=None, dtype=jnp.float32):
    """Read a Hugging Face Mixtral directory as a module and its parameters.

    Args:
      path: the directory.
      mesh: the mesh to place the parameters on, or None (see `models.llama.from_pretrained`).
      dtype: the dtype the module computes in and the parameters are stored in.

    Returns:
      `(module, params)` as `models.llama.from_pretrained` returns them (`module` a `Mixtral`).
    """
    return HF.from_pretrained(path, mesh, dtype)


def to_pretrained(module: Mixtral, params, path, dtype=None,
                  max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `params` of `module` as a Hugging Face Mixtral directory.

    See `models.llama.to_pretrained`.

    Args:
      module: a `Mixtral` (its `config` names the shape).
      params: its parameters, or those of `stacked(module.config)`.
      path: the directory to write.
      dtype: the tensors' dtype; None: the parameters'.
      max_shard_bytes: above this, the tensors are sharded over several files with an index.

    Raises:
      ValueError: the config is one a Hugging Face Mixtral checkpoint cannot hold (shared
        experts, sigmoid scores, weights not renormalized).
    """
    HF.to_pretrained(module, params, path, dtype, max_shard_bytes)
