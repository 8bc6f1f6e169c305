"""AxoNN's communication model: bytes, time and memory of one training step on a given grid.

For a model and a grid `data × pipe × depth × row × col` it counts, per device and per step, the
bytes of every collective the axonn_jax train step issues, as the parts of the step declare them
(`axonn_jax.collectives`): the model's layers (its config's `communication(step)`: tensor-parallel
dense, convolution and embedding layers, norms, the loss), the gradient exchange over data
(`step.reducers`, exact or compressed), the loss and gradient-norm scalars, the pipeline's
messages and gradient sums (`parallel.pipeline`). The sum agrees with the compiled step's HLO per
collective kind and mesh axes within 5% — mostly to the byte — on the grids of
tests/test_comm_model.py (`axonn_jax.analysis.hlo.wire_bytes`'s convention). It turns them into
time with a latency–bandwidth model of intra-node and inter-node links (ring and tree algorithms,
the faster one chosen as NCCL does), and adds compute, exposed communication and the pipeline
bubble. The planner ranks every grid that fits in memory by that predicted step time.

Byte convention ("wire bytes"): see `axonn_jax.collectives`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from ..collectives import (FP32, KINDS, Collective, ModelCommunication, ParameterShard,  # noqa: F401
                           StepShape, ring_bytes)
from ..config import AXES, ParallelConfig, check_grid
from ..models.unet import conv_layouts  # noqa: F401  (a public name of this module)
from ..parallel.pipeline import (check_layers, check_schedule, make_schedule,
                                 pipeline_collectives, stage_repeats)
from ..step.reducers import exchange_collectives, scalar_collectives


def counts(model) -> bool:
    """Whether the planner counts `model` (a model config): its config declares its parts'
    communication (`communication(step)`)."""
    return callable(getattr(model, "communication", None))


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
    """What one step computes: a model (a config with `communication(step)`, e.g. `GPTConfig`,
    `LlamaConfig`, `UNetConfig`), the global batch (sequences or images), sequence length,
    dtypes."""

    model: object
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
        return declared(self, ParallelConfig()).flops

    def step(self, grid: ParallelConfig) -> StepShape:
        """The step as its parts count it on `grid`."""
        return StepShape(grid, self.batch, self.seq_len, self.microbatches, self.compute_bytes,
                         self.param_bytes)


def declared(work: Workload, grid: ParallelConfig) -> ModelCommunication:
    """What the model of `work` declares about one step on `grid` (`config.communication`)."""
    return work.model.communication(work.step(grid))


def shape_of(model, grid: ParallelConfig):
    """The communicating parts of a decoder (a GPT or a Llama) on `grid`
    (`models.decoder.DecoderShape`)."""
    return model.shape(grid)


def _schedule(work: Workload, grid: ParallelConfig):
    """The pipeline's tick table (`axonn_jax.parallel.pipeline`)."""
    return make_schedule(work.schedule, grid.pipe, work.microbatches, work.virtual_stages)


def collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Every collective of one train step on one device (the most loaded stage for `pipe`), as the
    compiled axonn_jax train step issues them (checked against its HLO in tests/test_comm_model.py),
    down to the scalars of the loss and the gradient norm: what the model's layers declare, the
    gradient exchange of the parameters they hold over data, and with a pipeline its messages and
    the sum of the gradients every stage holds, each stage's work repeated as the engine runs it."""
    d = declared(work, grid)
    found = [*d.collectives, *scalar_collectives(d.parameters, grid),
             *exchange_collectives(d.parameters, grid.data, bits=work.compress_bits,
                                   param_bytes=work.param_bytes)]
    if grid.pipe > 1:
        outside = sum(p.elements for p in d.parameters if p.outside_blocks) + d.head_reads
        found += pipeline_collectives(_schedule(work, grid), d.boundary, outside * work.param_bytes)
        found = stage_repeats(found, work.microbatches)
    return found


def bytes_by_kind(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Wire bytes per device per step, by collective kind."""
    totals = {k: 0.0 for k in KINDS}
    for c in collectives(work, grid):
        totals[c.kind] += c.wire_bytes(grid)
    return totals


def parameter_shards(work: Workload, grid: ParallelConfig) -> list[ParameterShard]:
    """Every parameter tensor one device holds, as the model's parts declare them."""
    return list(declared(work, grid).parameters)


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
    """Parameters one device holds (`parameter_shards`)."""
    return sum(p.elements for p in declared(work, grid).parameters)


def fused_attention(work: Workload) -> bool:
    """Whether the step's attention keeps no probabilities (cuDNN's fused kernel): `--attention
    cudnn`, or `auto` in 16 bits, which picks cuDNN on a GPU (`models.attention.resolve`)."""
    choice = getattr(work.model, "attention", "auto")
    return choice == "cudnn" or (choice == "auto" and work.compute_bytes < FP32)


def block_residual_bytes(work: Workload, grid: ParallelConfig, tokens: float,
                         split: bool = False) -> float:
    """Bytes one transformer block's backward keeps from its forward on one device (no
    recompute), for `tokens` of a (micro)batch, `split`: the dense layers' batch-split layout
    (`tp.tensor.split_batch`, rows over col). Read off the memory-usage reports of compiled H100
    steps (`--dump-hlo` with XLA's dump flags; bf16, cuDNN attention) of Llama-3-8B on
    data 8 × pipe 8 and Llama-3-405B on pipe 2 × depth 16 × row 8 and on pipe 2 × depth 2 ×
    row 8 × col 8, per layer:

    - 6 activations of the residual stream's width in fp32 (the norms compute in fp32),
      features over col, rows over row when split; and 3 in the compute dtype whose rows stay
      whole (405B, col 8: three bf16[63, 8·4096, 16384/8]);
    - 6 of the MLP's hidden width (`d_ff`) in the compute dtype, features over row, rows over
      col when split but for one (405B: bf16[63, 8·4096, 53248/8], 25.6 GiB);
    - 4 of the attention heads' width (queries, keys, values, output), heads over row;
    - unfused attention (fp32, or `--attention xla`): the probabilities, 2 per head and key;
      cuDNN's fused kernel keeps only per-row statistics.
    """
    m, g, cb = work.model, grid, work.compute_bytes
    d_ff = getattr(m, "d_ff", 4 * m.d_model)
    stream = tokens * m.d_model / g.col * (6 * FP32 / (g.row if split else 1) + 3 * cb)
    inner = tokens / (g.col if split else 1) / g.row
    out = stream + inner * (5 * d_ff + 4 * m.d_model) * cb + tokens / g.row * d_ff * cb
    if not fused_attention(work):
        out += 2 * inner * work.seq_len * m.num_heads * cb
    return out


def memory_per_device(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Bytes one device holds at peak: parameters, gradients, optimizer state and activations."""
    m, g, d = work.model, grid, declared(work, grid)
    n = sum(p.elements for p in d.parameters)
    params = n * work.compute_bytes if work.offload_optimizer else n * work.param_bytes
    grads = n * (work.compute_bytes if work.offload_optimizer else work.param_bytes)
    if g.pipe > 1:  # every stage's gradient of the embedding and head, summed over pipe in fp32
        # beside the accumulator (compiled H100 step of Llama-3-8B on data 8 × pipe 8)
        grads += sum(p.elements for p in d.parameters if p.outside_blocks) * FP32
    optimizer = 0.0 if work.offload_optimizer else n * 2 * work.param_bytes  # Adam's two moments
    # fp32 parameters computed with in 16 bits: the forward's cast of every parameter and its
    # gradient in the compute dtype before it is added in fp32 (the compiled H100 step of
    # Llama-3-70B on 256 devices holds both at its peak: memory-usage report of --dump-hlo)
    copies = 2 * n * work.compute_bytes if not work.offload_optimizer and \
        work.compute_bytes < work.param_bytes else 0.0
    if d.activations is not None:  # a model that counts its own (a U-Net)
        activations = d.activations + copies
        return {"params": params, "grads": grads, "optimizer": optimizer,
                "activations": activations, "total": params + grads + optimizer + activations}
    # Else a stack of transformer blocks (`d_model`, `num_heads`):
    tokens = work.tokens / (g.data * g.depth) / work.microbatches
    rows = (g.row, g.col) if d.split else (1, 1)
    per_block = block_residual_bytes(work, grid, tokens, d.split)
    act = d.boundary
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
    # The head's float32 logits of one (micro)batch and their gradient, the vocabulary over `row`.
    logits = 2 * tokens / rows[1] * m.vocab_size / g.row * FP32
    activations = per_block * layers + stash + logits + copies
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
    wire = ring_bytes(c.kind, c.size, g)
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


MICROBATCH_FACTORS = (1, 2, 4, 8, 16, 32)
"""`plan` tries pipe × these microbatches: up to 32 per stage, so that a large model's stage of
many layers (Llama-3-405B on pipe 2: 63) finds a microbatch whose activations fit."""


def plan(work: Workload, num_devices: int, machine: Machine, grid: ParallelConfig | None = None,
         microbatch_choices: Iterable[int] | None = None) -> list[Prediction]:
    """Every feasible grid of `num_devices` (or just `grid`) ranked by predicted step time.

    For each grid with pipe > 1 the number of microbatches is chosen among `microbatch_choices`
    (default: pipe × `MICROBATCH_FACTORS`) as the fastest that divides the batch and fits in memory.
    Grids whose memory exceeds the device are dropped.
    """
    if not counts(work.model):
        raise ValueError(f"the communication model counts models whose config declares their "
                         f"communication (`communication(step)`), not {type(work.model).__name__}")
    candidates = [grid] if grid else [ParallelConfig(*s) for s in _factorizations(num_devices, 5)]
    results = []
    for g in candidates:
        choices = [1] if g.pipe == 1 else list(microbatch_choices or (g.pipe * k for k in MICROBATCH_FACTORS))
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
