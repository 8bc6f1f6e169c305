"""AxoNN's communication model: bytes, time and memory of one training step on a given grid.

For a model (a GPT or a Llama: `shape_of` reduces either to the layers that communicate; a U-Net:
its convolutions and dense layers, `_conv_collectives`) and a grid `data × pipe × depth × row ×
col` it counts, per device and per step, the bytes of every collective the axonn_jax train step
issues, component by component (dense layers, vocabulary-parallel embedding and loss, norms,
gradient sums over data and pipe, pipeline sends, the loss and gradient-norm scalars; the same
convention as `axonn_jax.analysis.hlo.wire_bytes`, and within 5% — mostly to the byte — of the
compiled step's HLO per collective kind and mesh axes on the grids of tests/test_comm_model.py),
turns them into time
with a latency–bandwidth model of intra-node and inter-node links (ring and tree algorithms, the
faster one chosen as NCCL does), and adds compute, exposed communication and the pipeline bubble.
The planner ranks every grid that fits in memory by that predicted step time.

Byte convention ("wire bytes"): what one device sends for an operation on a buffer of S bytes in a
group of g devices under the ring algorithm: all-reduce 2(g−1)/g·S; all-gather (g−1)/g·S (S the
gathered result); reduce-scatter (g−1)/g·S (S the input); all-to-all (g−1)/g·S; collective-permute S.
Groups of one device move nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable

from ..config import AXES, ParallelConfig, check_grid
from ..models.gpt import GPTConfig
from ..models.llama import LlamaConfig
from ..models.unet import UNetConfig
from ..parallel.pipeline import check_layers, check_schedule, make_schedule

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
FP32 = 4
"""Bytes of the values reduced in float32 whatever the compute dtype: norm statistics (Flax's
norms reduce in float32), the logits' softmax sums (the head's logits are float32), scalars."""


PLANNED_MODELS = (GPTConfig, LlamaConfig, UNetConfig)
"""The model configs the planner counts."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """A cluster's links and devices. Bandwidths are bytes/s one device can send in one direction."""

    name: str
    devices_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    peak_flops: float = 989e12
    device_memory: float = 80e9
    host_bw: float = 50e9
    efficiency: float = 0.6
    """Fraction of peak the matmuls reach; compute time = FLOPs / (peak · efficiency)."""


MACHINES: dict[str, Machine] = {
    # Nodes of 4 H100s on NVLink 4 (450 GB/s per direction), one 200 Gb/s NIC per GPU.
    "h100-4": Machine("4× H100 SXM per node, NVLink, 200 Gb/s NIC per GPU", 4, 450e9, 25e9),
    # A DGX H100: 8 GPUs on NVSwitch, one 400 Gb/s NIC per GPU.
    "h100-dgx": Machine("8× H100 SXM per node (DGX), NVSwitch, 400 Gb/s NIC per GPU", 8, 450e9, 50e9),
    # Perlmutter-like: 4 A100-40GB per node, NVLink 3, 4 × 200 Gb/s Slingshot per node.
    "a100-4": Machine("4× A100 40GB per node, NVLink 3, 200 Gb/s per GPU", 4, 300e9, 25e9,
                      peak_flops=312e12, device_memory=40e9, host_bw=25e9),
    # A consumer node: 8 RTX 3090s talking over PCIe 4 through the host, 10 GbE between nodes.
    "consumer-pcie": Machine("8× RTX 3090 per node, PCIe 4 only, 10 GbE between nodes", 8, 12e9,
                             1.25e9 / 8, intra_latency=10e-6, inter_latency=30e-6,
                             peak_flops=71e12, device_memory=24e9, host_bw=12e9),
    # Simulated devices of one host (`--xla_force_host_platform_device_count`): every "link" is a
    # memory copy on the same CPU, and the devices share its cores.
    "cpu": Machine("simulated CPU devices of one host", 1024, 5e9, 5e9, intra_latency=20e-6,
                   inter_latency=20e-6, peak_flops=20e9, device_memory=8e9, efficiency=0.5),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step computes: a model (`GPTConfig` or `LlamaConfig`), the global batch
    (sequences), sequence length, dtypes."""

    model: GPTConfig | LlamaConfig
    batch: int
    seq_len: int
    compute_bytes: int = 2  # bf16 activations and matmul operands
    param_bytes: int = 4  # fp32 parameters (and master weights)
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved-1f1b's chunks per stage
    compress_bits: int = 0
    offload_optimizer: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def flops(self) -> float:
        """Training FLOPs of the whole step (forward + backward, no recompute)."""
        if isinstance(self.model, UNetConfig):  # a batch of images; seq_len is not used
            return self.model.flops_per_image() * self.batch
        return self.model.flops_per_token(self.seq_len) * self.tokens


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """One tensor-parallel dense layer of the model, `count` times (e.g. once per block)."""

    name: str
    fan_in: int
    fan_out: int
    transpose: bool
    count: int
    bias: bool = True
    gathers: int | None = None
    """Per block, the input gathers of the batch-split layout (`split_batch`): layers reading the
    same input (a GPT's query, key and value projections) share one; None: one per layer."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the communication model needs to know of a model (see `shape_of`)."""

    num_layers: int
    d_model: int
    num_heads: int
    vocab_size: int
    position_rows: int
    """Rows of a learned position table (0: none, e.g. rotary positions)."""
    layers: tuple[DenseLayer, ...]
    """The tensor-parallel dense layers in the order the transform assigns `transpose`; the
    output head, named 'head', last (with `tied`, its matrix is the token table)."""
    replicated: tuple[DenseLayer, ...] = ()
    """Per-block dense layers kept whole over `row` (a Llama's key/value projections when their
    heads do not divide over it): kernel split over col·depth only, laid out by GSPMD."""
    norm_stats: int = 2
    """Per-token sums a norm takes over `col`: LayerNorm 2 (mean, mean of squares), RMSNorm 1."""
    norm_params: int = 2
    """Vectors per norm: LayerNorm's scale and bias, RMSNorm's scale."""
    tied: bool = False
    """The output head multiplies by the token table (GSPMD lays out that matmul)."""


def shape_of(model: GPTConfig | LlamaConfig, grid: ParallelConfig) -> ModelShape:
    """The communicating parts of `model` on `grid`."""
    d, n = model.d_model, model.num_layers
    # A tied head multiplies by the token table: its activations communicate like a dense
    # layer's, its parameters are the table's.
    head = (DenseLayer("head", d, model.vocab_size, False, 1, bias=False),)
    if isinstance(model, GPTConfig):
        f = model.d_ff
        layers = (DenseLayer("qkv", d, d, False, 3 * n, gathers=1),
                  DenseLayer("attn_out", d, d, True, n),
                  DenseLayer("mlp_up", d, f, False, n), DenseLayer("mlp_down", f, d, True, n))
        return ModelShape(n, d, model.num_heads, model.vocab_size, model.max_seq_len,
                          layers + head, tied=model.tie_embeddings)
    if isinstance(model, LlamaConfig):
        q, kv, f = model.q_features, model.kv_features, model.d_ff
        kv_layers = (DenseLayer("kv", d, kv, False, 2 * n, bias=False, gathers=0),)
        split, replicated = ((), kv_layers) if model.replicate_kv(grid) else (kv_layers, ())
        layers = (DenseLayer("q", d, q, False, n, bias=False, gathers=1), *split,
                  DenseLayer("attn_out", q, d, True, n, bias=False),
                  DenseLayer("mlp_in", d, f, False, 2 * n, bias=False, gathers=1),
                  DenseLayer("mlp_down", f, d, True, n, bias=False))
        return ModelShape(n, d, model.num_heads, model.vocab_size, 0, layers + head, replicated,
                          norm_stats=1, norm_params=1, tied=model.tie_embeddings)
    raise TypeError(f"the communication model knows GPTConfig and LlamaConfig, not "
                    f"{type(model).__name__}")


def _ring(kind: str, size: float, g: int) -> float:
    """Wire bytes one device sends for a collective of buffer `size` over `g` devices."""
    if g <= 1 or size == 0:
        return 0.0
    return {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g, "reduce-scatter": (g - 1) / g,
            "all-to-all": (g - 1) / g, "collective-permute": 1.0}[kind] * size


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
    group_size: int = 0
    """Devices per group when the group is part of an axis (GSPMD's sub-groups of `row`);
    0: all the devices of `axes`."""

    def group(self, grid: ParallelConfig) -> int:
        return self.group_size or math.prod(getattr(grid, a) for a in self.axes)

    def wire_bytes(self, grid: ParallelConfig) -> float:
        return self.count * _ring(self.kind, self.size, self.group(grid))


def collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Every collective of one train step on one device (the most loaded stage for `pipe`), as the
    compiled axonn_jax train step issues them (checked against its HLO in tests/test_comm_model.py),
    down to the scalars of the loss and the gradient norm (not for a U-Net: its convolutions, dense
    layers and gradient sums only)."""
    if isinstance(work.model, UNetConfig):
        found = _conv_collectives(work, grid)
    else:
        found = [*_dense_collectives(work, grid), *_replicated_collectives(work, grid),
                 *_embedding_collectives(work, grid),
                 *_norm_collectives(work, grid), *_loss_collectives(work, grid),
                 *_scalar_collectives(work, grid),
                 *_gradient_collectives(work, grid), *_pipeline_collectives(work, grid)]
    if grid.pipe > 1:
        found = [dataclasses.replace(c, count=c.count * (2 if c.stage_forward else 1)
                                     * (work.microbatches if c.per_microbatch else 1))
                 for c in found]
    return found


def _local_tokens(work: Workload, grid: ParallelConfig) -> float:
    """Tokens one device's tensor-parallel group works on per step (batch split over data·depth)."""
    return work.tokens / (grid.data * grid.depth)


def split_batch(work: Workload, grid: ParallelConfig) -> bool:
    """Whether the dense layers keep the batch split over the axis that does not split their
    features (`tp.tensor.split_batch`: the rows one layer sees, a data shard's microbatch, divide
    over depth × row and depth × col, and no layer is laid out by GSPMD); else activations are
    replicated over it."""
    if shape_of(work.model, grid).replicated:  # `tp.tensor.replicated_rows` (models.llama)
        return False
    rows = work.batch / (grid.data * (work.microbatches if grid.pipe > 1 else 1))
    return rows % (grid.depth * grid.row) == 0 and rows % (grid.depth * grid.col) == 0


def _dense_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """AxoNN's 3D dense layers (`axonn_jax.tp.tensor`): kernels split over (in, out) axes and
    over depth, activations' features over one axis and (`split_batch`) their rows over the other."""
    m, g, cb, pb = shape_of(work.model, grid), grid, work.compute_bytes, work.param_bytes
    tokens = _local_tokens(work, grid)
    split = split_batch(work, grid)
    out: list[Collective] = []
    for layer in m.layers:
        head = layer.name == "head"
        per_stage = m.num_layers // g.pipe
        count = layer.count if head else layer.count // m.num_layers * per_stage
        fin, fout = ("row", "col") if layer.transpose else ("col", "row")
        nin, nout = getattr(g, fin), getattr(g, fout)
        block = layer.fan_in * layer.fan_out / (nin * nout)  # kernel block after the depth gather
        mm_flops = 2 * tokens * block  # one of the three matmuls of this layer on one device
        x_bytes, y_bytes = tokens * layer.fan_in / nin * cb, tokens * layer.fan_out / nout * cb
        if split:
            gathers = count if layer.gathers is None or head else layer.gathers * per_stage
            out += [
                # forward: x's rows gathered over the output axis (once per input), partial sums
                # reduce-scattered onto the rows over the input axis
                Collective("all-gather", (fout,), x_bytes, gathers, stage_forward=not head),
                Collective("reduce-scatter", (fin,), y_bytes, count, stage_forward=not head),
                # backward: dy's rows gathered over the input axis, the input gradient
                # reduce-scattered over the output axis (the weight gradient reads x's rows kept
                # from the forward)
                Collective("all-gather", (fin,), y_bytes, count),
                Collective("reduce-scatter", (fout,), x_bytes, count, overlappable=mm_flops),
            ]
        else:
            out += [
                # forward: partial sums over the input axis (the head runs only in the last
                # stage's backward tick, so it is not recomputed); backward: input gradient over
                # the output axis (hidden behind the weight-gradient matmul)
                Collective("all-reduce", (fin,), y_bytes, count, stage_forward=not head),
                Collective("all-reduce", (fout,), x_bytes, count, overlappable=mm_flops),
            ]
        out += [
            # the kernel gathered over depth; its gradient reduce-scattered over depth (a tied
            # head's, laid out by GSPMD, all-reduced)
            Collective("all-gather", ("depth",), block * pb, count, stage_forward=not head,
                       per_microbatch=True),
            Collective("all-reduce" if head and m.tied else "reduce-scatter", ("depth",),
                       block * pb, count, per_microbatch=True),
        ]
        if not head:
            # The blocks' backward runs in its own scan loop, which gathers the kernel again; the
            # head's forward and backward share one computation, where XLA reuses the gather.
            out.append(Collective("all-gather", ("depth",), block * pb, count, per_microbatch=True))
        if layer.bias:
            # the bias is replicated over depth (and, split, the input axis), whose devices saw
            # different tokens
            out.append(Collective("all-reduce", ("depth", fin) if split else ("depth",),
                                  layer.fan_out / nout * pb, count, per_microbatch=True))
    return out


@functools.lru_cache(maxsize=None)
def conv_layouts(model: UNetConfig) -> dict[str, bool]:
    """`{layer name: transpose}` of a U-Net's layers (`UNetConfig.layers` names), as
    `parallelize` traces them: the parts of a narrow copy of the same architecture (the layout
    does not depend on widths) traced abstractly on one device."""
    import jax
    import jax.numpy as jnp

    from ..mesh import make_mesh
    from ..models import unet
    from ..tp.parallelize import transpose_plan

    small = dataclasses.replace(model, channels=4, num_groups=1, num_heads=1, num_layers=1,
                                image_size=2 ** len(model.channel_mult), in_channels=1)
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
    batch = zeros(small.example_batch(1))
    stacked = unet.stacked(small)
    embed_params = jax.eval_shape(stacked.embed.init, jax.random.key(0), batch)["params"]
    act = jax.eval_shape(stacked.embed.apply, {"params": embed_params}, batch)
    found = {name.removeprefix("down/"): t
             for name, t in transpose_plan(stacked.embed, mesh, batch).items()}
    found |= transpose_plan(stacked.block, mesh, zeros(act))
    found |= {name: t for name, t in transpose_plan(stacked.head, mesh, zeros(act), batch,
                                                      zeros(embed_params)).items()
              if name not in found}  # its recomputed down path: the embedding's own layout
    return found


def _conv_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """A U-Net's collectives: each convolution is AxoNN's dense layer over the channels of every
    window (`tp.tensor.tp_conv`), with `window · in` input features and one row per output pixel;
    the same collectives as `_dense_collectives` per layer, with the input gradient sized by the
    input pixels. Per device: the most loaded pipeline stage (the last: its blocks, the head and
    the head's recomputed down path), the data-parallel gradient all-reduce, the pipeline's
    activations. Not counted: GSPMD's re-layouts of skip concatenations and of layers whose
    input arrives on the other axis (the down and up paths'), GroupNorm parameter gradients."""
    model, g, cb, pb = work.model, grid, work.compute_bytes, work.param_bytes
    if work.compress_bits:
        raise ValueError("the communication model does not count compressed gradients of a "
                         "U-Net yet; plan it without --compress-bits")
    layouts = conv_layouts(model)
    images = work.batch / (g.data * g.depth)
    count = {"block": model.num_layers // g.pipe, "head": 1, "embed": 2 if g.pipe == 1 else 1}
    out: list[Collective] = []
    for layer in model.layers():
        n = count[layer.part]
        fin, fout = ("row", "col") if layouts.get(layer.name, False) else ("col", "row")
        nin, nout = getattr(g, fin), getattr(g, fout)
        block = layer.window * layer.cin * layer.cout / (nin * nout)
        rows_out, rows_in = images * layer.pixels, images * layer.in_pixels
        gathers = 2 if layer.part == "block" else 1  # the scan's backward gathers again
        out += [
            Collective("all-gather", ("depth",), block * pb, n * gathers, per_microbatch=True),
            Collective("all-reduce", (fin,), rows_out * layer.cout / nout * cb, n,
                       stage_forward=layer.part == "block"),
            Collective("all-reduce", (fout,), rows_in * layer.cin / nin * cb, n,
                       overlappable=2 * rows_out * block),
            Collective("reduce-scatter", ("depth",), block * pb, n, per_microbatch=True),
            Collective("all-reduce", ("depth",), layer.cout / nout * pb, n, per_microbatch=True),
        ]
    out.append(Collective("all-reduce", ("data",), parameters_per_device(work, grid) * pb))
    if g.pipe > 1:
        r, c = model.bottleneck_size, model.bottleneck_channels
        act = images / work.microbatches * (r + 1) * r * c / g.col * cb
        out.append(Collective("collective-permute", ("pipe",), act,
                              2 * _schedule(work, grid).message_ticks))
    return out


def _conv_parameters(model: UNetConfig, grid: ParallelConfig) -> float:
    """Parameters one device holds: kernels split over depth·row·col (the blocks' also over
    pipe); biases split like their outputs; GroupNorm vectors counted whole."""
    layouts, g = conv_layouts(model), grid
    total = 0.0
    for layer in model.layers():
        fout = "col" if layouts.get(layer.name, False) else "row"
        n = model.num_layers / g.pipe if layer.part == "block" else 1
        total += n * (layer.window * layer.cin * layer.cout / (g.depth * g.row * g.col)
                      + layer.cout / getattr(g, fout))
    return total + 2 * model._norm_channels()


def _conv_memory(work: Workload, grid: ParallelConfig) -> float:
    """Activation bytes one device keeps for the backward: each layer's output and the
    GroupNorm/SiLU around it (about three arrays of its size), the blocks' over a stage."""
    model, g = work.model, grid
    images = work.batch / (g.data * g.depth) / work.microbatches
    layouts = conv_layouts(model)
    total = 0.0
    for layer in model.layers():
        n = model.num_layers / g.pipe if layer.part == "block" else 2 if layer.part == "embed" else 1
        fout = "col" if layouts.get(layer.name, False) else "row"
        total += 3 * n * images * layer.pixels * layer.cout / getattr(g, fout)
    return total * work.compute_bytes


def _replicated_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Key/value projections kept whole over `row` (`models.llama.ReplicatedDense`), as GSPMD
    lays them out (measured in tests/test_comm_model.py): the query heads' split over `row`
    factors into a split of the key/value heads over `r = gcd(kv_heads, row)` devices and of each
    group's query heads over `row / r`, and the projections follow it: each device computes its
    `1/r` of the key/value features. Forward, the partial sums over `col`; backward, the
    attention's key/value gradients summed over the `row / r` devices sharing a head, the input
    gradient over the `r` devices holding different heads; the kernel's gradient, computed in `r`
    pieces, is all-gathered to the kernel's layout before the update (`step.train_step` lays
    gradients out like their parameters)."""
    model, g, cb, pb = work.model, grid, work.compute_bytes, work.param_bytes
    m = shape_of(model, grid)
    tokens = _local_tokens(work, grid)
    out: list[Collective] = []
    for layer in m.replicated:
        per_stage = layer.count // m.num_layers * (m.num_layers // g.pipe)
        r = math.gcd(model.num_kv_heads, g.row)
        features = tokens * layer.fan_out / r * cb
        kernel = m.num_layers // g.pipe * layer.fan_in * layer.fan_out / (g.col * g.depth) * pb
        out += [Collective("all-reduce", ("col",), features, per_stage, stage_forward=True),
                Collective("all-reduce", ("row",), features, per_stage, group_size=g.row // r),
                Collective("all-reduce", ("row",), tokens * layer.fan_in / g.col * cb, per_stage,
                           group_size=r),
                Collective("all-gather", ("row",), kernel, layer.count // m.num_layers,
                           group_size=r)]
        if g.depth > 1:
            # The kernel's slice `b` is moved into place and gathered over depth for the forward
            # and again for the backward; its gradient summed over depth and moved back.
            b = layer.fan_in * layer.fan_out / (g.col * g.depth * r) * pb
            # (Measured: with whole key/value heads, r = 1, GSPMD also moves the gathered
            # kernel, once for the forward and once for the backward.)
            moves = [Collective("collective-permute", ("depth",), b * g.depth, 2 * per_stage,
                                per_microbatch=True)] if r == 1 else []
            out += [*moves, Collective("collective-permute", ("depth",), b, 3 * per_stage,
                                       per_microbatch=True),
                    Collective("all-gather", ("depth",), b * g.depth, 2 * per_stage,
                               per_microbatch=True),
                    Collective("all-reduce", ("depth",), b, per_stage, per_microbatch=True)]
    return out


def _embedding_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Vocabulary-parallel token (and learned position) tables: rows split over row, features
    over col, both over depth (gathered for the lookup like a dense kernel)."""
    m, g, cb, pb = shape_of(work.model, grid), grid, work.compute_bytes, work.param_bytes
    tokens = _local_tokens(work, grid)
    wte = m.vocab_size * m.d_model / (g.row * g.col)
    out = [
        Collective("all-gather", ("depth",), wte * pb, stage_forward=True, per_microbatch=True),
        # each row shard looks up the ids it owns (zeros elsewhere); the sum over row completes
        # the token embeddings
        Collective("all-reduce", ("row",), tokens * m.d_model / g.col * cb, stage_forward=True),
        # token-table gradient scattered back over depth
        Collective("reduce-scatter", ("depth",), wte * pb, per_microbatch=True),
    ]
    split = split_batch(work, grid)
    if split:  # the lookup's output is replicated over row: GSPMD gathers its gradient's rows
        out.append(Collective("all-gather", ("row",), tokens * m.d_model / g.col * cb))
    if m.position_rows:
        wpe = m.position_rows * m.d_model / (g.row * g.col)
        out += [
            Collective("all-gather", ("depth",), wpe * pb, stage_forward=True, per_microbatch=True),
            # the positions' lookup sum, once per sequence position; their gradient is first
            # summed over the batch, which depth splits
            Collective("all-reduce", ("row",), work.seq_len * m.d_model / g.col * cb,
                       stage_forward=True, per_microbatch=True),
            Collective("all-reduce", ("depth", "row") if split else ("depth",),
                       work.seq_len * m.d_model / g.col * pb, per_microbatch=True),
        ]
    return out


def _norm_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Norms (two per block and the final one) on activations whose features are split over
    col: per-token statistics are sums over col (LayerNorm: mean and mean of squares; RMSNorm:
    mean of squares), in float32 whatever the compute dtype; the scale (and bias) are replicated
    over depth."""
    m, g, pb = shape_of(work.model, grid), grid, work.param_bytes
    split = split_batch(work, grid)
    tokens = _local_tokens(work, grid) / (g.row if split else 1)  # split: rows over row too
    in_blocks = 2 * (m.num_layers // g.pipe)
    norms = in_blocks + 1  # and the final norm, which runs with the head
    stats = m.norm_stats * tokens * FP32
    return [
        Collective("all-reduce", ("col",), stats, in_blocks, stage_forward=True),  # forward
        Collective("all-reduce", ("col",), stats),
        Collective("all-reduce", ("col",), stats, norms),  # backward: the matching sums
        Collective("all-reduce", ("depth", "row") if split else ("depth",),
                   m.norm_params * m.d_model / g.col * pb, norms,
                   per_microbatch=True),  # scale (and bias) gradients
    ]


def _loss_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Cross-entropy on logits whose vocabulary is split over row (the head is a normal layer):
    forward max, sum of exponentials and picked log-probability, backward the softmax's sum, all
    float32 (the logits are)."""
    tokens = _local_tokens(work, grid) / (grid.col if split_batch(work, grid) else 1)
    return [Collective("all-reduce", ("row",), tokens * FP32, 4)]


def _scalar_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """The step's scalars: the loss averaged over the batch (over depth, then data), and the
    gradient's squared norm: one float32 partial sum per parameter tensor and per split
    dimension, over that dimension's axes. (XLA may add the partial sums of one group of
    devices before reducing them, fusing a few of these: the count is an upper bound, exact
    within a few scalars.)"""
    per_group: dict[tuple[str, ...], int] = {}
    for p in parameter_shards(work, grid):
        for axes in p.splits:
            axes = tuple(a for a in axes if getattr(grid, a) > 1)
            if axes:
                per_group[axes] = per_group.get(axes, 0) + 1
    loss = [Collective("all-reduce", ("depth",), FP32), Collective("all-reduce", ("data",), FP32)]
    return loss + \
        [Collective("all-reduce", axes, FP32, n) for axes, n in per_group.items()]


def _gradient_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Data-parallel gradient exchange of this device's parameter shard, exact or compressed (CGX,
    `axonn_jax.parallel.compression`), and the pipeline's sum of the embedding, final norm and head
    gradients, which every stage holds but only the first and last use."""
    m, g, pb = shape_of(work.model, grid), grid, work.param_bytes
    out: list[Collective] = []
    if work.compress_bits:
        exact, packed = _compression_split(work, grid)
        # scatter-reduce as all_to_all of packed chunks, all_gather of the re-quantized result;
        # small tensors take an exact psum
        out += [Collective("all-to-all", ("data",), packed), Collective("all-gather", ("data",), packed),
                Collective("all-reduce", ("data",), exact * pb)]
    else:
        out.append(Collective("all-reduce", ("data",), _reduced_parameters(work, grid) * pb))
    if g.pipe > 1:
        outside = sum(p.elements for p in parameter_shards(work, grid) if p.outside_blocks)
        if m.tied:  # the head's gradient of the table is summed apart from the embedding's
            outside += m.vocab_size * m.d_model / (g.depth * g.row * g.col)
        out.append(Collective("all-reduce", ("pipe",), outside * pb))
    return out


COMPRESS_BUCKET = 1024
COMPRESS_MIN_SIZE = 1024
"""`axonn_jax.parallel.compression` defaults: values per bucket, smallest tensor compressed."""


def _compression_split(work: Workload, grid: ParallelConfig) -> tuple[float, float]:
    """(elements reduced exactly, packed bytes exchanged) for compressed data-parallel gradients:
    tensors of one dimension or fewer than COMPRESS_MIN_SIZE elements stay exact; the rest are
    padded to whole buckets, each bucket packed at `compress_bits` with a scale and an offset, and
    the buffer padded to `data` shards. Each device compresses its own shard
    (`compression.sharded_compressed_psum`): every tensor counts its shard (`parameter_shards`)."""
    tensors = [(p.elements, p.ndim) for p in parameter_shards(work, grid)]
    exact = sum(size for size, ndim in tensors if ndim <= 1 or size < COMPRESS_MIN_SIZE)
    buckets = sum(math.ceil(size / COMPRESS_BUCKET) for size, ndim in tensors
                  if not (ndim <= 1 or size < COMPRESS_MIN_SIZE))
    buckets = math.ceil(buckets / grid.data) * grid.data
    return exact, buckets * (COMPRESS_BUCKET * work.compress_bits / 8 + 2 * work.param_bytes)


def _schedule(work: Workload, grid: ParallelConfig):
    """The pipeline's tick table (`axonn_jax.parallel.pipeline`)."""
    return make_schedule(work.schedule, grid.pipe, work.microbatches, work.virtual_stages)


def _pipeline_collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Every tick each stage sends one microbatch activation forward and one cotangent backward
    (a chunk's, as large, with interleaved stages: V times as many ticks), but zb-h1's last ticks,
    which only run weight gradients. Split layout: the batch-split residual stream."""
    m, g = work.model, grid
    if g.pipe == 1:
        return []
    rows = g.row if split_batch(work, grid) else 1  # the residual stream's rows split over row
    mb_act = _local_tokens(work, grid) / work.microbatches / rows * m.d_model / g.col \
        * work.compute_bytes
    return [Collective("collective-permute", ("pipe",), mb_act,
                       2 * _schedule(work, grid).message_ticks)]


def bytes_by_kind(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Wire bytes per device per step, by collective kind."""
    totals = {k: 0.0 for k in KINDS}
    for c in collectives(work, grid):
        totals[c.kind] += c.wire_bytes(grid)
    return totals


@dataclasses.dataclass(frozen=True)
class ParameterShard:
    """One parameter tensor as one device of a pipeline stage holds it (block tensors stacked over
    the stage's layers)."""

    elements: float
    ndim: int
    splits: tuple[tuple[str, ...], ...]
    """For each split dimension, the mesh axes it is split over (sizes of 1 included), e.g. a
    normal dense kernel `(('col', 'depth'), ('row',))`."""
    outside_blocks: bool = False
    """Embedding tables, final norm and head: every pipeline stage holds them."""


def parameter_shards(work: Workload, grid: ParallelConfig) -> list[ParameterShard]:
    """Every parameter tensor one device holds: dense kernels `(in, out)` split in over
    col·depth and out over row (a transposed layer: in over row·depth, out over col), stacked
    over the stage's `num_layers / pipe` blocks; tables vocabulary-parallel (rows over
    row·depth, features over col); biases split like their layer's output features, norm scales
    (and biases) like the activations' features (over `col`); biases and norms whole over
    depth."""
    m, g = shape_of(work.model, grid), grid
    n = m.num_layers // g.pipe
    tp = g.depth * g.row * g.col
    d, v = m.d_model, m.vocab_size
    table = (("row", "depth"), ("col",))
    out = [ParameterShard(v * d / tp, 2, table, True)]
    if m.position_rows:
        out.append(ParameterShard(m.position_rows * d / tp, 2, table, True))
    out += [ParameterShard(d / g.col, 1, (("col",),), True)] * m.norm_params  # final norm
    for layer in m.layers:
        in_axis, out_axis = ("row", "col") if layer.transpose else ("col", "row")
        kernel = ((in_axis, "depth"), (out_axis,))
        if layer.name == "head":
            if not m.tied:
                out.append(ParameterShard(layer.fan_in * layer.fan_out / tp, 2, kernel, True))
            continue
        per_block = layer.count // m.num_layers
        out += [ParameterShard(n * layer.fan_in * layer.fan_out / tp, 3, kernel)] * per_block
        if layer.bias:
            out += [ParameterShard(n * layer.fan_out / getattr(g, out_axis), 2,
                                   ((out_axis,),))] * per_block
    for layer in m.replicated:
        out += [ParameterShard(n * layer.fan_in * layer.fan_out / (g.col * g.depth), 3,
                               (("col", "depth"),))] * (layer.count // m.num_layers)
    out += [ParameterShard(n * d / g.col, 2, (("col",),))] * (2 * m.norm_params)  # two per block
    return out


def bytes_by_axes(work: Workload, grid: ParallelConfig,
                  buffers: bool = False) -> dict[tuple[str, tuple[str, ...]], float]:
    """`{(kind, axes): bytes per device per step}`, axes in mesh order (those of size 1 left
    out): wire bytes (`buffers`:
    full-buffer bytes, `size × count`), as `axonn_jax.analysis.hlo.bytes_by_axes` measures them
    in the compiled step."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in collectives(work, grid):
        if c.group(grid) > 1 and c.count and c.size:
            key = (c.kind, tuple(a for a in AXES if a in c.axes and getattr(grid, a) > 1))
            out[key] = out.get(key, 0.0) + (c.size * c.count if buffers else c.wire_bytes(grid))
    return out


def parameters_per_device(work: Workload, grid: ParallelConfig) -> float:
    """Parameters one device holds (`parameter_shards`; a U-Net's: `_conv_parameters`)."""
    if isinstance(work.model, UNetConfig):
        return _conv_parameters(work.model, grid)
    return sum(p.elements for p in parameter_shards(work, grid))


def _reduced_parameters(work: Workload, grid: ParallelConfig) -> float:
    """Parameters whose gradients one device reduces over `data`: its parameters, of which the
    replicated key/value kernels only in their `1/r` pieces (see `_replicated_collectives`)."""
    m, g = shape_of(work.model, grid), grid
    if not m.replicated:
        return parameters_per_device(work, grid)
    r = math.gcd(work.model.num_kv_heads, g.row)
    whole = sum(l.fan_in * l.fan_out * l.count for l in m.replicated) / (g.col * g.depth * g.pipe)
    return parameters_per_device(work, grid) - whole * (1 - 1 / r)


def memory_per_device(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Bytes one device holds at peak: parameters, gradients, optimizer state and activations."""
    m, g = work.model, grid
    n = parameters_per_device(work, grid)
    params = n * work.compute_bytes if work.offload_optimizer else n * work.param_bytes
    grads = n * (work.compute_bytes if work.offload_optimizer else work.param_bytes)
    optimizer = 0.0 if work.offload_optimizer else n * 2 * work.param_bytes  # Adam's two moments
    if isinstance(m, UNetConfig):
        activations = _conv_memory(work, grid)
        return {"params": params, "grads": grads, "optimizer": optimizer,
                "activations": activations, "total": params + grads + optimizer + activations}
    tokens = work.tokens / (g.data * g.depth) / work.microbatches
    # Working set of one block's forward+backward (stage-level recompute keeps only stage inputs):
    # ~16 activations of (tokens × d/tp) plus the attention probabilities per head slice (and,
    # in the batch-split layout, per row slice over col); the residual stream split over col
    # (and its rows over row).
    rows = (g.row, g.col) if split_batch(work, grid) else (1, 1)
    per_block = (16 * tokens * m.d_model / (g.row * g.col)
                 + 2 * tokens * work.seq_len * m.num_heads / (g.row * rows[1])) * work.compute_bytes
    act = tokens / rows[0] * m.d_model / g.col * work.compute_bytes
    if g.pipe == 1:
        stash, layers = act, m.num_layers
    else:
        # The stashed (chunk) inputs; one chunk's layers live in a backward; zb-h1's deferred
        # weight gradients keep every layer's matmul inputs and output cotangents (~16
        # activations of the block, those of `per_block` without the attention probabilities).
        sched = _schedule(work, grid)
        layers = m.num_layers // (g.pipe * work.virtual_stages)
        residuals = (sched.weight_slots * layers * 16 * tokens * m.d_model / (g.row * g.col)
                     * work.compute_bytes) if sched.split_backward else 0.0
        stash = sched.stash_slots * act + residuals
    activations = per_block * layers + stash
    return {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
            "total": params + grads + optimizer + activations}


def _collective_time(c: Collective, grid: ParallelConfig, machine: Machine) -> float:
    g = c.group(grid)
    if g <= 1 or c.count == 0:
        return 0.0
    # An axis group spans nodes when its devices are further apart than one node: the stride of
    # an axis is the product of the sizes of the axes inside it (mesh order, col fastest).
    inner = math.prod(getattr(grid, a) for a in AXES[AXES.index(c.axes[-1]) + 1:])
    outer_span = inner * math.prod(getattr(grid, a) for a in c.axes)
    inter = outer_span > machine.devices_per_node
    bw = machine.inter_bw if inter else machine.intra_bw
    lat = machine.inter_latency if inter else machine.intra_latency
    wire = _ring(c.kind, c.size, g)
    ring = wire / bw + (2 * (g - 1) if c.kind == "all-reduce" else g - 1) * lat
    if c.kind == "all-reduce":  # double binary tree: 2·S per device, 2·log2(g) latency steps
        tree = 2 * c.size / bw + 2 * math.ceil(math.log2(g)) * lat
        ring = min(ring, tree)
    return c.count * ring


@dataclasses.dataclass
class Prediction:
    """One grid's predicted step: times in seconds, bytes per device."""

    grid: ParallelConfig
    microbatches: int
    step_time_s: float
    compute_s: float
    exposed_comm_s: dict[str, float]
    bubble_s: float
    comm_bytes_per_device: dict[str, float]
    memory_per_device_bytes: float
    memory_breakdown: dict[str, float]
    mfu: float
    exposed_comm_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    """The exposed communication split by the mesh axes it crosses ("row", "data+depth", ...)."""
    flops_per_device: float = 0.0
    """FLOPs one device runs per step (the pipeline's recomputed stage forwards included)."""
    host_memory_per_device_bytes: float = 0.0
    """Host memory one device's state takes (`offload_optimizer`: fp32 masters and moments)."""
    fits: bool = True
    """Whether `memory_per_device_bytes` fits the machine's device memory."""

    def as_dict(self) -> dict:
        """Fields named as `axonn-jax compile --json` names the compiled figures."""
        return {"grid": self.grid.as_dict(), "microbatches": self.microbatches,
                "step_time_s": self.step_time_s,
                "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "bubble_s": self.bubble_s, "comm_bytes_per_device": self.comm_bytes_per_device,
                "memory_per_device_bytes": self.memory_per_device_bytes,
                "memory_breakdown": self.memory_breakdown, "mfu": self.mfu,
                "exposed_comm_by_axis": self.exposed_comm_by_axis,
                "flops_per_device": self.flops_per_device,
                "host_memory_per_device_bytes": self.host_memory_per_device_bytes,
                "fits": self.fits}


def predict(work: Workload, grid: ParallelConfig, machine: Machine) -> Prediction:
    """Predicted step time on `machine`: compute + exposed communication + pipeline bubble.

    Exposed communication: tensor-parallel collectives sit on the critical path, except the
    backward input-gradient all-reduce, hidden up to the weight-gradient matmul it overlaps; the
    data-parallel gradient exchange overlaps the backward pass (hidden up to its compute time);
    pipeline messages are exposed. The bubble adds the schedule's published idle time per unit of
    work ((P−1)/M for 1F1B; V times less interleaved; zb-h1's at the engine's costs: forward 1,
    input gradient 2 (with the recomputed forward), weight gradient 1).
    """
    rate = machine.peak_flops * machine.efficiency
    devices = grid.num_devices
    # The pipeline recomputes each stage's forward in its backward tick: 4 forwards' worth, not 3.
    recompute = 4 / 3 if grid.pipe > 1 else 1.0
    compute = work.flops() / devices / rate * recompute
    backward = compute * 2 / 3
    exposed = {k: 0.0 for k in KINDS}
    by_axis: dict[str, float] = {}
    data_time = 0.0
    for c in collectives(work, grid):
        t = _collective_time(c, grid, machine)
        if c.axes == ("data",):
            data_time += t
            continue
        if c.overlappable:
            t = max(0.0, t - c.count * c.overlappable / rate)
        exposed[c.kind] += t
        by_axis["+".join(c.axes)] = by_axis.get("+".join(c.axes), 0.0) + t
    exposed_data = max(0.0, data_time - backward)
    for c in collectives(work, grid):
        if c.axes == ("data",) and data_time:
            exposed[c.kind] += exposed_data * _collective_time(c, grid, machine) / data_time
    if data_time:
        by_axis["data"] = exposed_data
    bubble = 0.0
    if grid.pipe > 1:
        idle = _schedule(work, grid).predicted_bubble(1.0, 2.0, 1.0)
        bubble = compute * idle / (1 - idle)
    step = compute + sum(exposed.values()) + bubble
    mem = memory_per_device(work, grid)
    mfu = work.flops() / (step * devices * machine.peak_flops)
    return Prediction(grid, work.microbatches, step, compute, exposed, bubble, bytes_by_kind(work, grid), mem["total"],
                      mem, mfu, {a: t for a, t in by_axis.items() if t > 0},
                      flops_per_device=work.flops() / devices * recompute,
                      host_memory_per_device_bytes=host_memory_per_device(work, grid),
                      fits=mem["total"] <= machine.device_memory)


def host_memory_per_device(work: Workload, grid: ParallelConfig) -> float:
    """Host bytes of one device's optimizer state: with `offload_optimizer`, its parameters' fp32
    masters and Adam's two fp32 moments (`offload.optimizer`); else none."""
    if not work.offload_optimizer:
        return 0.0
    return parameters_per_device(work, grid) * 3 * work.param_bytes


def _factorizations(n: int, parts: int) -> Iterable[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


def infeasible_reason(work: Workload, grid: ParallelConfig) -> str | None:
    """Why `grid` cannot run `work` (a dimension that does not divide), or None: the trainer's own
    checks (`config.check_grid`, `GPTConfig.check_grid`)."""
    try:
        check_grid(grid, batch_size=work.batch, microbatches=work.microbatches,
                   num_layers=work.model.num_layers)
        work.model.check_grid(grid)
        if grid.pipe > 1:
            check_schedule(work.schedule, grid.pipe, work.microbatches, work.virtual_stages)
            check_layers(work.model.num_layers, grid.pipe, work.virtual_stages)
        elif work.virtual_stages > 1:
            raise ValueError(f"--virtual-stages {work.virtual_stages} needs --pipe > 1")
    except ValueError as e:
        return str(e)
    return None


def plan(work: Workload, num_devices: int, machine: Machine, grid: ParallelConfig | None = None,
         microbatch_choices: Iterable[int] | None = None) -> list[Prediction]:
    """Every feasible grid of `num_devices` (or just `grid`) ranked by predicted step time.

    For each grid with pipe > 1 the number of microbatches is chosen among `microbatch_choices`
    (default: pipe·{1, 2, 4, 8}) as the fastest that divides the batch and fits in memory.
    Grids whose memory exceeds the device are dropped.
    """
    if not isinstance(work.model, PLANNED_MODELS):
        raise ValueError(f"the communication model counts GPTs, Llamas and U-Nets, not "
                         f"{type(work.model).__name__}")
    candidates = [grid] if grid else [ParallelConfig(*s) for s in _factorizations(num_devices, 5)]
    results = []
    for g in candidates:
        choices = [1] if g.pipe == 1 else list(microbatch_choices or (g.pipe * k for k in (1, 2, 4, 8)))
        best = None
        for mb in choices:
            w = dataclasses.replace(work, microbatches=mb)
            if infeasible_reason(w, g):
                continue
            p = predict(w, g, machine)
            if p.memory_per_device_bytes > machine.device_memory:
                continue
            if best is None or p.step_time_s < best.step_time_s:
                best = p
        if best:
            results.append(best)
    return sorted(results, key=lambda p: p.step_time_s)
