"""The collectives a train step issues, as its parts declare them.

Each part states what it sends for a shape and a grid, next to its code: the tensor-parallel
layers (`tp.tensor`: dense, convolution, vocabulary-parallel tables; `tp.layers`: norms), the
pipeline (`parallel.pipeline`: messages, the sum of replicated gradients, repeated stage work),
the gradient reducers and the step's scalars (`step.reducers`), and each model adapter its
layers' shapes, its norms and its loss (`config.communication(step)`, e.g. `models.gpt`). The
communication model (`analysis.comm_model`) adds up what they declare.

Byte convention ("wire bytes"): what one device sends for an operation on a buffer of S bytes in a
group of g devices under the ring algorithm: all-reduce 2(g−1)/g·S; all-gather (g−1)/g·S (S the
gathered result); reduce-scatter (g−1)/g·S (S the input); all-to-all (g−1)/g·S; collective-permute
S. Groups of one device move nothing. (`analysis.hlo.wire_bytes` counts the compiled program so.)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Protocol

from .config import ParallelConfig

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
FP32 = 4
"""Bytes of the values reduced in float32 whatever the compute dtype: norm statistics (Flax's
norms reduce in float32), the logits' softmax sums (the head's logits are float32), scalars."""

_RING = {"all-reduce": lambda g: 2 * (g - 1) / g, "all-gather": lambda g: (g - 1) / g,
         "reduce-scatter": lambda g: (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
         "collective-permute": lambda g: 1.0}


def ring_bytes(kind: str, size: float, group: int) -> float:
    """Wire bytes one device sends for a collective of buffer `size` over `group` devices.

    Args:
      kind: the collective kind (`KINDS`).
      size: the full buffer's bytes.
      group: devices in the collective's group.

    Returns:
      The ring algorithm's bytes per device; 0 for a group of one or an empty buffer.
    """
    if group <= 1 or size == 0:
        return 0.0
    return _RING[kind](group) * size


@dataclasses.dataclass
class Collective:
    """`count` collectives of one kind over one mesh axis (or several), each on `size` bytes."""

    kind: str
    axes: tuple[str, ...]
    size: float
    count: int = 1
    overlappable: float = 0.0
    """FLOPs of independent compute this collective can hide behind (per occurrence)."""
    stage_forward: bool = False
    """Part of a pipeline stage's forward, which the engine runs again (recomputes) in the
    stage's backward tick: with `pipe > 1` it happens twice per microbatch."""
    per_microbatch: bool = False
    """Parameter-sized (a weight gather, a weight-gradient reduction): the pipeline runs it in
    every microbatch's operation, so with `pipe > 1` it happens M times per step instead of once.
    Activation-sized collectives split with the tokens and add up to the same bytes either way."""
    loop_invariant: bool = False
    """Reads only parameters outside the blocks (a table's or the head's kernel gathered over
    depth, a position table's lookup sum): XLA hoists it out of the microbatch loop, pipelined or
    accumulated, so it runs once per step whatever `per_microbatch` and `stage_forward` say
    (measured in tests/test_comm_model.py)."""
    rematerialized: bool = False
    """Run again in the backward when `--remat` recomputes the block (the batch-split layout's
    input gathers: the gathered input is not among the outputs a remat policy keeps)."""
    recomputed_in_full: bool = False
    """Run again in the backward under `--remat full` only (the output reduce-scatter of a layer
    whose output the block's backward reads, which `selective` keeps: `DenseLayer.reused`)."""
    group_size: int = 0
    """Devices per group when the group is part of an axis (GSPMD's sub-groups of `row`);
    0: all the devices of `axes`."""
    span: int = 0
    """Consecutive devices of `axes` each group lies within (one node's share of `data` under
    CGX's inter-node scope: the group is `span` neighbours); 0: a group may spread over all of
    them (what decides whether it crosses nodes)."""
    waited: bool = False
    """The step waits for it as soon as it is issued: its result is read at once and nothing
    independent runs beside it (a mixture of experts' partial sums over the tensor axes, inside
    its dispatch; the gather of the new parameters after an offloaded update), so no compute
    hides any of it."""
    copied: float = 0.0
    """HBM bytes read and written per occurrence to put what it brought in place (a collective
    matmul's ring: each block's product and rows copied into the gathered result); `predict`
    adds their time to the compute."""

    def group(self, grid: ParallelConfig) -> int:
        """Devices per group on `grid`.

        Args:
          grid: the mesh.

        Returns:
          `group_size`, or the product of the sizes of `axes` where it is 0.
        """
        return self.group_size or math.prod(getattr(grid, a) for a in self.axes)

    def wire_bytes(self, grid: ParallelConfig) -> float:
        """Wire bytes one device sends for all `count` of them on `grid` (`ring_bytes`).

        Args:
          grid: the mesh.

        Returns:
          `count` × the ring bytes of one.
        """
        return self.count * ring_bytes(self.kind, self.size, self.group(grid))


@dataclasses.dataclass(frozen=True)
class ParameterShard:
    """One parameter tensor as one device of a pipeline stage holds it.

    Block tensors are stacked over the stage's layers.
    """

    elements: float
    ndim: int
    splits: tuple[tuple[str, ...], ...]
    """For each split dimension, the mesh axes it is split over (sizes of 1 included), e.g. a
    normal dense kernel `(('col', 'depth'), ('row',))`."""
    outside_blocks: bool = False
    """Embedding tables, final norm and head: every pipeline stage holds them."""
    exchanged: float | None = None
    """Elements of its gradient the exact data-parallel exchange reduces, when fewer than
    `elements` (a kernel whose gradient is computed in pieces and gathered after the exchange);
    None: all of them."""

    @property
    def size(self) -> float:
        """`elements`, under the name the compression size rule reads (`bits_for_leaf`)."""
        return self.elements


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One train step as the parts count it.

    The grid, the global batch of `batch` rows (sequences, or images with `seq_len` 1) of
    `seq_len` positions, `microbatches`, the bytes of a compute value and of a parameter, whether
    the tensor-parallel layers keep the batch split (`split`, `tp.tensor.split_batch`: the model
    decides, it knows its layers), and the context axis's attention scheme
    (`context_attention`, `parallel.context.SCHEMES`).
    """

    grid: ParallelConfig
    batch: int
    seq_len: int = 1
    microbatches: int = 1
    compute_bytes: int = 2
    param_bytes: int = 4
    split: bool = False
    context_attention: str = "ring"
    platform: str = "gpu"
    """The XLA backend that compiles the step (`gpu`, `cpu`): the parts count what its passes
    make of their collectives (`gathered_bytes`, `tp.tensor.DenseLayer`)."""
    rings: bool = False
    """The tensor-parallel layers gather their rows in rings of permutes
    (`tp.options.KernelOptions.collective_matmuls`)."""
    expert_imbalance: float = 1.0
    """Tokens the busiest expert shard takes over the mean (`--expert-imbalance`): scales what
    the busiest device's ragged expert exchanges move (`parallel.experts.collectives`)."""
    layer_sums: bool = False
    """The blocks' gradients are summed layer by layer inside the backward
    (`step.engines.SpmdEngine.layer_reduce`: one microbatch, no pipeline, float32 parameters; with
    a batch axis besides `data`, an exact exchange over it and `data` at once)."""
    reduce_dtype: str = "float32"
    """What the exact gradient exchange sends (`parallel.exchange`)."""
    pipelined: bool = False
    """The step runs through the pipeline engine (`step.engines.PipelineEngine`): each stage
    runs its layers once per microbatch, and the embedding and the head sit on different stages."""

    @property
    def gathered_bytes(self) -> int:
        """Bytes of one kernel element in the depth gathers and gradient reduce-scatters.

        The compute dtype's (the step casts the parameters before the forward, and XLA:GPU keeps
        16-bit collectives 16-bit); 4 on XLA:CPU, which runs 16-bit collectives in f32 (measured:
        twice the H100 module's depth bytes on llama-tiny data 2 × depth 2 × row 2, bf16)."""
        return 4 if self.platform == "cpu" else self.compute_bytes

    @property
    def rows(self) -> float:
        """Rows one device's tensor-parallel group works on per step.

        The batch over data·expert·depth; `context` splits each row's positions instead.
        """
        return self.batch / (self.grid.data * self.grid.expert * self.grid.depth)

    @property
    def tokens(self) -> float:
        """Positions one device's tensor-parallel group works on per step.

        The batch over data·expert·depth, the sequence over context.
        """
        return self.rows * self.seq_len / self.grid.context

    @property
    def packed_bytes(self) -> int:
        """Bytes of one element of the bfloat16 exchange's pieces (`parallel.exchange`).

        2, or 4 on XLA:CPU, which runs 16-bit collectives in f32."""
        return 4 if self.platform == "cpu" else 2

    @property
    def layer_calls(self) -> int:
        """The calls of each layer one step's per-call counts stand for.

        A pipeline stage runs each layer once per microbatch (`microbatches`); without a pipeline
        a call's counts take every microbatch's rows together (`accumulated`), once."""
        return self.microbatches if self.pipelined else 1

    @property
    def accumulated(self) -> int:
        """The microbatches one layer call's counts hold together.

        Every one without a pipeline (the engine's accumulation loop), one under a pipeline."""
        return self.microbatches // self.layer_calls

    @property
    def layer_rows(self) -> float:
        """Rows one layer call sees on a data (and expert) shard.

        Its microbatch, under a pipeline as under gradient accumulation (`step.engines.SpmdEngine`
        slices the local batch into `microbatches` before the layers run)."""
        return self.batch / (self.grid.data * self.grid.expert * self.microbatches)

    def stage_layers(self, num_layers: int) -> int:
        """Blocks of a stack of `num_layers` one pipeline stage holds.

        Args:
          num_layers: the blocks of the whole stack.

        Returns:
          `num_layers // pipe`.
        """
        return num_layers // self.grid.pipe


class Part(Protocol):
    """Anything that declares its collectives and parameters for a step."""

    def collectives(self, step: StepShape) -> list[Collective]:
        """The collectives the part issues on one device in one step.

        Args:
          step: the step being counted.

        Returns:
          Its `Collective`s.
        """
        ...

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The parameter tensors the part holds on one device.

        Args:
          step: the step being counted.

        Returns:
          Its `ParameterShard`s.
        """
        ...


@dataclasses.dataclass(frozen=True)
class ModelCommunication:
    """What a model declares about one train step (`config.communication(step)`).

    On one device of the most loaded pipeline stage: the collectives of its own layers
    (tensor-parallel kernels, norms, loss), the parameter shards that device holds (from which the
    step's gradient exchange, gradient-norm sums and pipeline gradient sums follow), the bytes of
    one microbatch's activation between two blocks on one device (`boundary`: what a stage sends
    and stashes), the layout its dense layers run in (`split`), the elements of the embedding's
    parameters its head reads (`head_reads`, `StackedModel.head_reads_embed`: the pipeline sums
    their gradient apart), the training FLOPs of the step, and the activation bytes the device
    keeps (`activations`; None: the planner's estimate for a stack of transformer blocks), and the
    features per position of one block that `--remat selective` keeps (`saved_features`, the
    outputs of its named matmuls; 0: not modelled)."""

    collectives: tuple[Collective, ...]
    parameters: tuple[ParameterShard, ...]
    boundary: float
    flops: float
    split: bool = False
    head_reads: float = 0.0
    activations: float | None = None
    saved_features: float = 0.0
    executed_flops: float | None = None
    """Training FLOPs the compiled step runs when they differ from `flops` (a dropless mixture
    of experts under jaxlib's dense `ragged_dot`, `models.moe.DENSE_RAGGED_DOT`); None: `flops`."""
    expert_flops: float = 0.0
    """Of `executed_flops` (or `flops`), the routed experts' share: what expert imbalance
    multiplies on the busiest device."""
    busiest_stage: float = 1.0
    """The busiest pipeline stage's FLOPs over the mean stage's (a model whose embedding or
    head outweighs a stage's blocks: a U-Net's up path), at whose pace the pipeline runs; 1
    without a pipeline or where the stages are even."""
    working: float = 0.0
    """Temporary bytes one block's parts hold while it runs, beyond the planner's estimate of a
    transformer block (context attention's score tiles and gathered keys/values)."""
    part_activations: float = 0.0
    """Activation bytes per device that per-block parts keep for the backward beyond that
    estimate, all the stage's layers together (a mixture of experts' dispatch buffers)."""
    part_traffic: tuple[float, float] = (0.0, 0.0)
    """HBM bytes per device and step that per-block parts' memory-bound kernels read and write
    beyond a transformer block's own (`comm_model.memory_bound_bytes`), (one forward, the
    backward), all the stage's layers together: a mixture of experts' dispatch
    (`models.moe.MoELayers.traffic`)."""
    metrics: float = 0.0
    """Float32 elements of the per-step metrics the blocks return (averaged over the batch axes)."""
    batch_token_bytes: float = 8.0
    """Bytes of one position of the batch pytree (token ids and targets, int32): what the
    context axis's load-balancing gather moves (`step.batch_axes`)."""


def from_parts(parts: Iterable[Part], step: StepShape, **fields) -> ModelCommunication:
    """The `ModelCommunication` of a model made of `parts`, with its other `fields`.

    Args:
      parts: the model's parts (`Part`), in any order.
      step: the step being counted (its `split` is the layout's).
      **fields: the other `ModelCommunication` fields (`boundary`, `flops`, ...).

    Returns:
      The parts' collectives and parameters together.
    """
    parts = tuple(parts)
    return ModelCommunication(tuple(c for p in parts for c in p.collectives(step)),
                              tuple(s for p in parts for s in p.parameters(step)),
                              split=step.split, **fields)
