"""What a decoder language model (`models.gpt`, `models.llama`) declares to the communication model:
its shape on a grid (`DecoderShape`, from `config.shape(grid)`) and, from it, the parts whose
collectives and parameters add up to one train step (`communication`): the vocabulary-parallel
tables, the blocks' dense layers and norms, the final norm, the output head and the loss."""
from __future__ import annotations

import dataclasses

from ..config import Axis
from ..collectives import FP32, Collective, ModelCommunication, StepShape, from_parts
from ..parallel.context import ContextAttention
from ..tp.layers import Norms
from ..tp.tensor import DenseLayer, Table, split_batch


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """A decoder's communicating parts on a grid, as the communication model reads them.

    Attributes:
      layers: the blocks' tensor-parallel dense layers in the order the transform assigns
        `transpose`, with the stage's `layers` blocks (`DenseLayer`s), then the output head
        (layers 0; with `tied`, its matrix is the token table).
      replicated: per-block parts GSPMD lays out, next to which the dense layers keep activations
        whole over `row` (`KernelOptions.replicated_rows`; a Llama's key/value projections when
        their heads do not divide over `row`).
    """

    num_layers: int
    d_model: int
    num_heads: int
    vocab_size: int
    position_rows: int
    """Rows of a learned position table (0: none, e.g. rotary positions)."""
    layers: tuple[DenseLayer, ...]
    replicated: tuple = ()
    norm_stats: int = 2
    """Per-token sums a norm takes over `col`: LayerNorm 2 (mean, mean of squares), RMSNorm 1."""
    norm_params: int = 2
    """Vectors per norm: LayerNorm's scale and bias, RMSNorm's scale."""
    tied: bool = False
    """The output head multiplies by the token table (GSPMD lays out that matmul)."""
    kv_features: int = 0
    """Key (= value) features of one token (kv_heads · head_dim): what context-parallel
    attention moves over `context` (`parallel.context.ContextAttention`)."""
    head_dim: int = 0
    """Features of one attention head (0: `d_model / num_heads`)."""
    parts: tuple = ()
    """Other per-block parts (`collectives.Part`), e.g. a mixture of experts (`models.moe`)."""
    metrics: float = 0.0
    """Float32 elements of the metrics the blocks return per step (per-layer aux outputs)."""


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """`gpt.cross_entropy` on logits whose vocabulary is split over `row` (a normal-layer head).

    Forward: the max, the sum of exponentials and the picked log-probability; backward: the
    softmax's sum; all float32 (the logits are).
    """

    def collectives(self, step: StepShape) -> list[Collective]:
        """Four all-reduces over `row`, each one float32 per token (over `col` too if split)."""
        tokens = step.tokens / (step.grid.col if step.split else 1)
        return [Collective("all-reduce", (Axis.ROW,), tokens * FP32, 4)]

    def parameters(self, step: StepShape) -> list:
        """No parameters (an empty list)."""
        return []


def communication(shape: DecoderShape, step: StepShape, flops: float,
                  scores: float = 0.0) -> ModelCommunication:
    """What one train step of the decoder `shape` communicates (`collectives.ModelCommunication`).

    The dense layers keep the batch split when `tp.tensor.split_batch` says so for the rows one
    layer sees, unless parts laid out by GSPMD (`shape.replicated`) keep it whole.

    Args:
      shape: the decoder's parts on the step's grid (`config.shape(step.grid)`).
      step: the train step's shape (grid, batch, sequence length, microbatches, dtypes).
      flops: the step's training FLOPs.
      scores: of `flops`, the attention scores' (every score computed; over `context` the
        kernels run fewer: `executed_flops`).

    Returns:
      The step's collectives, parameters and activation bytes (`collectives.from_parts`), with
      `executed_flops` set when the grid has a `context` axis of more than one device.
    """
    g, d = step.grid, shape.d_model
    split = not shape.replicated and split_batch((step.layer_rows,), g.as_dict())
    step = dataclasses.replace(step, split=split)
    stage = step.stage_layers(shape.num_layers)
    tables = [Table(shape.vocab_size, d)]
    if shape.position_rows:
        tables.append(Table(shape.position_rows, d, batched=False))
    norms = [Norms(d, shape.norm_stats, shape.norm_params),  # the final norm, run with the head
             Norms(d, shape.norm_stats, shape.norm_params, count=2, layers=stage)]
    rows = g.row if split else 1  # the residual stream's rows split over row
    boundary = step.tokens / step.microbatches / rows * d / g.col * step.compute_bytes
    head_reads = shape.vocab_size * d / (g.depth * g.row * g.col) if shape.tied else 0.0
    # Keys and values: heads over row (whole where replicated, GSPMD's layout)
    kv = shape.kv_features if shape.replicated else shape.kv_features / g.row
    context = ContextAttention(kv, stage, None if shape.replicated else Axis.COL,
                               heads=shape.num_heads / g.row,
                               head_dim=shape.head_dim or shape.d_model / shape.num_heads)
    kept = sum(p.activations(step) for p in shape.parts if hasattr(p, "activations"))
    traffic = [p.traffic(step) for p in shape.parts if hasattr(p, "traffic")]
    working = context.working_bytes(step) + sum(p.working_bytes(step) for p in shape.parts
                                                if hasattr(p, "working_bytes"))
    return from_parts([*tables, *shape.layers, *shape.replicated, *shape.parts, context, *norms,
                       CrossEntropy()], step, boundary=boundary, flops=flops,
                      head_reads=head_reads, saved_features=saved_features(shape),
                      metrics=shape.metrics, working=working,
                      part_activations=kept,
                      part_traffic=(sum(f for f, _ in traffic), sum(b for _, b in traffic)),
                      executed_flops=flops - scores + context.executed_flops(step, scores)
                      if g.context > 1 else None)


def saved_features(shape: DecoderShape) -> float:
    """Features per position of one block that `--remat selective` keeps.

    Those are the outputs of the block's dense layers but the last (whose output only joins the
    residual sum) and the attention core's output (the input of `attn_out`), as the models name
    them (`ACTIVATION_NAMES`; checked against `offload.activations.block_cost` in
    tests/test_comm_model.py).

    Args:
      shape: the decoder's parts on a grid.

    Returns:
      The kept features per position, summed over the block's layers (`fan_out · count`, plus
      `attn_out`'s `fan_in`).
    """
    dense = [layer for layer in shape.layers if layer.layers]  # the block's, the last is MLP down
    others = [part for part in shape.replicated if getattr(part, "layers", 0)]
    kept = sum(layer.fan_out * layer.count for layer in (*dense[:-1], *others))
    return kept + sum(layer.fan_in for layer in dense if layer.name == "attn_out")
