"""AxoNN's communication model: bytes, time and memory of one training step on a given grid.

For a model and a grid `data × pipe × expert × context × depth × row × col` it counts, per
device and per step, the bytes of every collective the axonn_jax train step issues, as the parts
of the step declare them (`axonn_jax.collectives`): the model's layers (its config's
`communication(step)`: tensor-parallel dense, convolution and embedding layers, norms, the loss,
context-parallel attention's key/value traffic `parallel.context.ContextAttention`, a mixture of
experts' token all-to-alls `models.moe.MoELayers`), the gradient exchange over data
(`step.reducers`, exact or compressed), the sums over expert and context of the parameters they do
not split and the context layout's batch gather (`step.batch_axes`), the loss and gradient-norm
scalars, the pipeline's messages and gradient sums (`parallel.pipeline`). The sum agrees with the
compiled step's HLO per collective kind and mesh axes within 5% — mostly to the byte — on the
grids of tests/test_comm_model.py and tests/test_axes_model.py
(`axonn_jax.analysis.hlo.wire_bytes`'s convention). It turns them into
time with a latency–bandwidth model of intra-node and inter-node links (ring and tree algorithms,
the faster one chosen as NCCL does), and adds compute, exposed communication and the pipeline
bubble. The planner ranks every grid that fits in memory by that predicted step time.

Byte convention ("wire bytes"): see `axonn_jax.collectives`.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterable

from ..batch_axis import DATA
from ..collectives import (FP32, KINDS, Collective, ModelCommunication, ParameterShard,  # noqa: F401
                           StepShape, ring_bytes)
from ..config import AXES, Axis, ParallelConfig, check_grid, devices_inside
from ..models.unet import conv_layouts  # noqa: F401  (a public name of this module)
from ..offload.activations import UNIFORM_REMAT
from ..offload.optimizer import gradient_offload_problems
from ..parallel.context import check_sequence
from ..parallel.experts import AXIS as EXPERT_AXIS
from ..parallel.pipeline import (make_schedule, option_problems as pipeline_problems,
                                 pipeline_collectives, stage_repeats)
from ..step.batch_axes import (PLUGINS as BATCH_AXIS_PLUGINS, batch_axes_collectives,
                               layers_summed_in_backward, summed_with_data)
from ..step.reducers import exchange_collectives, scalar_collectives
from ..tp.tensor import collective_matmuls_on
from . import hidden_shares


def counts(model) -> bool:
    """Whether the planner counts `model`: its config declares its parts' communication.

    Args:
      model: a model config (`GPTConfig`, `LlamaConfig`, `UNetConfig`, ...).

    Returns:
      True where the config has a callable `communication(step)`.
    """
    return callable(getattr(model, "communication", None))


# Published H100 SXM figures the H100 machines below are made of. [A] NVIDIA H100 Tensor Core GPU
# Architecture whitepaper (2022) and H100 SXM datasheet: dense BF16 989.4 TFLOPS, TF32 494.7,
# FP8 1978.9, FP32 (vector) 66.9; HBM3 3.35 TB/s; NVLink 4 900 GB/s per GPU (450 GB/s each
# direction). [B] NVIDIA DGX H100 user guide: eight 400 Gb/s ConnectX-7 ports for the compute
# fabric, one per GPU (50 GB/s each direction). [C] S. Bekman, "Machine Learning Engineering Open
# Book", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"
# (mamf-finder.py, torch 2.7.0+cu126): H100 SXM BF16 794.5 TFLOPS (80.3% of peak), FP8 e4m3
# 1402.6 TFLOPS (70.9%) — the best a large matmul reaches, which is what an H100 runs a
# transformer's GEMMs at, at best. [D] NVIDIA H200 Tensor Core GPU datasheet (2024): the H100's
# compute (dense BF16 989 TFLOPS, same SMs and clocks) with 141 GB of HBM3e at 4.8 TB/s; NVLink
# 900 GB/s per GPU. [E] Intel Xeon Platinum 8480C: 56 cores, 8 channels of DDR5-4800 (8 × 38.4 GB/s
# per socket).
H100_BF16_PEAK = 989.4e12  # [A]
H100_BF16_MATMUL = 794.5e12  # [C]
H100_FP8_MATMUL = 1402.6e12  # [C]
H100_VECTOR_FLOPS = 66.9e12  # [A]
H100_HBM_BW = 3.35e12  # [A]
# [A] lists PCIe Gen5 at 128 GB/s (64 GB/s each direction); a pinned host copy gets about 55 of
# them each way (PCIe packet overhead; the rate issue "Host memory that pays" quotes from public
# reports, not yet measured on a lent GPU).
H100_HOST_LINK = 55e9
# A host computation (the optimizer update run by the CPU, `compute_on('device_host')`) streams
# host memory: [B]'s two Xeon Platinum 8480C sockets ([E]: 307 GB/s each), shared by the node's
# 8 GPUs.
H100_DGX_HOST_MEMORY_PER_GPU = 2 * 307.2e9 / 8


@dataclasses.dataclass(frozen=True)
class Machine:
    """A cluster's links and devices.

    Bandwidths are bytes/s one device can send in one direction.
    """

    name: str
    devices_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    peak_flops: float = H100_BF16_PEAK
    """Dense 16-bit tensor-core peak (what MFU divides by)."""
    device_memory: float = 80e9
    host_bw: float = H100_HOST_LINK
    """Bytes/s between host and device memory in each direction (both run at once)."""
    host_compute_bw: float = H100_DGX_HOST_MEMORY_PER_GPU
    """Bytes/s of host memory one device's host computations (XLA's HostExecute) stream: the
    host's memory bandwidth over its devices (a host update is memory-bound)."""
    efficiency: float = H100_BF16_MATMUL / H100_BF16_PEAK
    """Fraction of `peak_flops` a large 16-bit matmul reaches (measured: [C] for H100)."""
    hbm_bw: float = H100_HBM_BW
    vector_flops: float = H100_VECTOR_FLOPS
    """FLOPs/s of elementwise work (FP32 vector units)."""
    fp8_speedup: float = H100_FP8_MATMUL / H100_BF16_MATMUL
    """FP8 matmuls' rate over 16-bit ones (measured, [C]); 1 where the device has no FP8."""
    f32_speedup: float = 0.5
    """FP32 matmuls' rate over 16-bit ones: TF32 tensor cores, half the BF16 peak on H100 ([A];
    XLA's default precision on NVIDIA GPUs), at the same fraction of peak."""
    platform: str = "gpu"
    """The XLA backend that compiles its programs (`gpu`, `cpu`): `Workload.platform`."""
    kernel_s: float = 1e-6
    """Seconds each kernel launch adds to a step beyond its own work (`kernel_count`): an
    assumption, not a measurement. XLA:GPU launches a step's kernels asynchronously from command
    buffers, so launches mostly overlap the kernels before them; the one-device steps measured
    on an H200 ran below the replay of their own modules, which charges no launch at all
    (`benchmarks/results/gpu_calibration.md`), so what a launch adds there is below the
    replay's error."""

    def matmul_rate(self, dtype: str = "bf16") -> float:
        """FLOPs/s of a large matmul whose result is `dtype`.

        Args:
          dtype: an HLO dtype: `bf16`, `f16`, `f32`, `f8e4m3fn`, ...

        Returns:
          `peak_flops × efficiency`, times `fp8_speedup` for an 8-bit float result and
          `f32_speedup` for `f32`/`f64`.
        """
        rate = self.peak_flops * self.efficiency
        if dtype.startswith("f8"):
            return rate * self.fp8_speedup
        return rate * (self.f32_speedup if dtype in ("f32", "f64") else 1.0)


MACHINES: dict[str, Machine] = {
    # Nodes of 4 H100s on NVLink 4 (450 GB/s per direction), one 200 Gb/s NIC per GPU.
    "h100-4": Machine("4× H100 SXM per node, NVLink, 200 Gb/s NIC per GPU", 4, 450e9, 25e9),
    # A DGX H100 ([A], [B]): 8 GPUs on NVSwitch, one 400 Gb/s NIC per GPU.
    "h100-dgx": Machine("8× H100 SXM per node (DGX), NVSwitch, 400 Gb/s NIC per GPU", 8, 450e9, 50e9),
    # A DGX H200 ([D], [B]'s network): the H100 node with the H200's memory.
    # Its memory-bound kernels at the device copy's rate measured on a lent H200, below the
    # datasheet's 4.8 TB/s (the rate: `benchmarks/results/gpu_nvidia_h200.md` (d)); the H100's
    # HBM is taken at its datasheet rate until one is measured.
    "h200-dgx": Machine("8× H200 per node (DGX), NVSwitch, 400 Gb/s NIC per GPU", 8, 450e9, 50e9,
                        device_memory=141e9, hbm_bw=2.998e12),
    # Perlmutter-like: 4 A100-40GB per node, NVLink 3, 4 × 200 Gb/s Slingshot per node.
    "a100-4": Machine("4× A100 40GB per node, NVLink 3, 200 Gb/s per GPU", 4, 300e9, 25e9,
                      peak_flops=312e12, device_memory=40e9, host_bw=25e9, efficiency=0.6,
                      hbm_bw=1.555e12, vector_flops=19.5e12, fp8_speedup=1.0),
    # A consumer node: 8 RTX 3090s talking over PCIe 4 through the host, 10 GbE between nodes.
    "consumer-pcie": Machine("8× RTX 3090 per node, PCIe 4 only, 10 GbE between nodes", 8, 12e9,
                             1.25e9 / 8, intra_latency=10e-6, inter_latency=30e-6,
                             peak_flops=71e12, device_memory=24e9, host_bw=12e9, efficiency=0.6,
                             hbm_bw=0.936e12, vector_flops=35.6e12, fp8_speedup=1.0),
    # Simulated devices of one host (`--xla_force_host_platform_device_count`): every "link" is a
    # memory copy on the same CPU, and the devices share its cores.
    "cpu": Machine("simulated CPU devices of one host", 1024, 5e9, 5e9, intra_latency=20e-6,
                   inter_latency=20e-6, peak_flops=20e9, device_memory=8e9, efficiency=0.5,
                   hbm_bw=20e9, vector_flops=20e9, fp8_speedup=1.0, f32_speedup=1.0,
                   platform="cpu"),
}


REMAT_POLICIES = UNIFORM_REMAT
"""The `--remat` modes the planner models (`offload.activations`): `offload` keeps on the device
what `full` keeps and recomputes what `selective` recomputes."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step computes: a model, the global batch, sequence length, dtypes.

    `model` is a config with `communication(step)`, e.g. `GPTConfig`, `LlamaConfig`,
    `UNetConfig`; `batch` counts sequences (or images).
    """

    model: object
    batch: int
    seq_len: int
    compute_bytes: int = 2  # bf16 activations and matmul operands
    param_bytes: int = 4  # fp32 parameters (and master weights)
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved-1f1b's chunks per stage
    compress_bits: int = 0
    compress_scope: str = "all"
    """CGX's `--compress-scope`: `inter-node` sums exactly inside nodes of
    `compress_node_size` devices (None: the step's default, `node_shards`; `plan` sets the
    machine's `devices_per_node`)."""
    compress_node_size: int | None = None
    error_feedback: bool = True
    """CGX's error feedback (`--no-error-feedback` turns it off): each device keeps its rounding
    error, a residual the size of its parameters, in the dtype of its gradients."""
    compress_in_backward: bool = True
    """CGX's exchange inside the backward (`--compress-after-backward` turns it off): layer by
    layer where the step allows it (`step.batch_axes.layers_summed_in_backward`)."""
    reduce_dtype: str = "float32"
    """What the exact data-parallel exchange sends (`parallel.exchange`): XLA:CPU runs a bfloat16
    exchange's collectives in float32, so on `platform` cpu it counts 4 bytes an element."""
    offload_optimizer: bool = False
    offload_gradients: bool = False
    """`--offload-gradients`: the blocks' gradients leave for host memory as the backward
    finishes each layer (with `offload_optimizer`, on grids where nothing sums them after)."""
    context_attention: str = "ring"  # the context axis's scheme (`parallel.context.SCHEMES`)
    expert_imbalance: float = 1.0
    """Tokens the busiest expert shard takes over the mean (the metrics' `load_imbalance`):
    multiplies the routed experts' compute time and activation memory. 1.0: balanced routing
    (the auxiliary loss's aim); measured values belong in `--expert-imbalance`."""
    remat: str = "none"
    """What each block keeps for its backward (`--remat`, uniform over the stack): one of
    `REMAT_POLICIES`."""
    platform: str = "gpu"
    """The XLA backend that compiles the step (`StepShape.platform`): `gpu` for the clusters
    `plan` ranks grids for, `cpu` for simulated devices (`Machine.platform`)."""
    collective_matmul: str = "auto"
    """`--collective-matmul` (`tp.tensor.collective_matmuls_on`): whether the tensor-parallel
    layers gather their rows in rings on `platform`."""
    fp8: bool = False
    """`--fp8`: no rings under `auto` (`tp.tensor.collective_matmuls_on`)."""

    @property
    def tokens(self) -> int:
        """Tokens of the global batch: `batch × seq_len`."""
        return self.batch * self.seq_len

    def flops(self) -> float:
        """Training FLOPs of the whole step (forward + backward, no recompute).

        Returns:
          The FLOPs the model declares on a one-device grid.
        """
        return declared(self, ParallelConfig()).flops

    def executed_flops(self, grid: ParallelConfig) -> float:
        """Training FLOPs the compiled step runs, as if every device ran the busiest one's.

        A dropless mixture of experts under jaxlib's dense `ragged_dot` runs more than `flops`;
        the routed experts' share is multiplied by `expert_imbalance` (the busiest device's).

        Args:
          grid: the mesh.

        Returns:
          FLOPs of the whole step (all devices).
        """
        d = declared(self, grid)
        executed = d.flops if d.executed_flops is None else d.executed_flops
        return executed + (self.imbalance(grid) - 1) * d.expert_flops

    def imbalance(self, grid: ParallelConfig) -> float:
        """`expert_imbalance` where experts split over devices (`expert > 1`), else 1.

        A device holding every expert takes every token's choices whatever their spread.

        Args:
          grid: the mesh.

        Returns:
          The busiest expert shard's tokens over the mean.
        """
        return self.expert_imbalance if grid.expert > 1 else 1.0

    def node_shards(self, grid: ParallelConfig) -> int:
        """Data shards per node that CGX's exchange sums exactly (`step.reducers.node_shards`).

        Args:
          grid: the mesh.

        Returns:
          1 under scope `all` (or without compression); under `inter-node`,
          `compress_node_size` devices (default 8 on a GPU, an H100 node; on CPU every device,
          one process) over those of the axes inside `data`, at most `grid.data` (one node:
          nothing compressed).
        """
        if not self.compress_bits or self.compress_scope != "inter-node":
            return 1
        devices = self.compress_node_size or (8 if self.platform == "gpu" else grid.num_devices)
        return min(grid.data, max(1, devices // devices_inside(grid.as_dict(), Axis.DATA)))

    def step(self, grid: ParallelConfig) -> StepShape:
        """The step as its parts count it on `grid`.

        Args:
          grid: the mesh.

        Returns:
          The `StepShape` the model's `communication` reads.
        """
        rings = collective_matmuls_on(self.collective_matmul, self.platform, self.fp8)
        return StepShape(grid, self.batch, self.seq_len, self.microbatches, self.compute_bytes,
                         self.param_bytes, context_attention=self.context_attention,
                         platform=self.platform, rings=rings,
                         expert_imbalance=self.imbalance(grid),
                         layer_sums=self.exchanges_layers(grid),
                         reduce_dtype=self.reduce_dtype, pipelined=grid.pipe > 1)

    def exchanges_layers(self, grid: ParallelConfig) -> bool:
        """Whether the step sums the blocks' gradients layer by layer inside the backward.

        The engine's rule (`step.batch_axes.layers_summed_in_backward`).

        Args:
          grid: the mesh.

        Returns:
          True where `SpmdEngine.layer_reduce` runs (`StepShape.layer_sums`); never in a
          pipeline (`PipelineEngine`).
        """
        return grid.pipe == 1 and layers_summed_in_backward(
            grid, microbatches=self.microbatches,
            sixteen_bit_offload=self.offload_optimizer and self.compute_bytes < 4,
            compressed=bool(self.compress_bits), compressed_layers=self.compress_in_backward)


def declared(work: Workload, grid: ParallelConfig) -> ModelCommunication:
    """What the model of `work` declares about one step on `grid` (`config.communication`).

    Computed once per (work, grid): `predict` reads it from a dozen helpers, and `plan` predicts
    thousands of grids (`_once`).

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The model's `ModelCommunication` for `work.step(grid)` (immutable).
    """
    return _once(_declared, work, grid)


def _declared(work: Workload, grid: ParallelConfig) -> ModelCommunication:
    return work.model.communication(work.step(grid))


def _once(f, work: Workload, grid: ParallelConfig):
    """`f(work, grid)`, computed once per hashable (work, grid) (`_remembered`); every time
    for a model config that cannot be hashed. `f` returns something immutable."""
    try:
        hash((work, grid))
    except TypeError:
        return f(work, grid)
    return _remembered(f, work, grid)


@functools.lru_cache(maxsize=8192)
def _remembered(f, work: Workload, grid: ParallelConfig):
    return f(work, grid)


def shape_of(model, grid: ParallelConfig):
    """The communicating parts of a decoder (a GPT or a Llama) on `grid`.

    Args:
      model: a decoder config.
      grid: the mesh.

    Returns:
      Its `models.decoder.DecoderShape`.
    """
    return model.shape(grid)


def _schedule(work: Workload, grid: ParallelConfig):
    """The pipeline's tick table (`axonn_jax.parallel.pipeline`)."""
    return make_schedule(work.schedule, grid.pipe, work.microbatches, work.virtual_stages)


def collectives(work: Workload, grid: ParallelConfig) -> list[Collective]:
    """Every collective of one train step on one device (the most loaded stage for `pipe`).

    As the compiled axonn_jax train step issues them (checked against its HLO in
    tests/test_comm_model.py), down to the scalars of the loss and the gradient norm: what the
    model's layers declare, the gradient exchange of the parameters they hold over data, and with
    a pipeline its messages and the sum of the gradients every stage holds, each stage's work
    repeated as the engine runs it.

    Args:
      work: the step.
      grid: the mesh, `data × pipe × expert × context × depth × row × col`.

    Returns:
      The `Collective`s, each with its count per step.
    """
    return list(_once(_collectives, work, grid))


def _collectives(work: Workload, grid: ParallelConfig) -> tuple[Collective, ...]:
    d, shape = declared(work, grid), work.step(grid)
    stage_layers = max(1, getattr(work.model, "num_layers", 1) // grid.pipe)
    exchanged = [p for p in d.parameters if not summed_with_data(p, shape)]
    shared = [p for p in exchanged if _gradient_shared(work, grid, p)]
    found = [*d.collectives, *scalar_collectives(d.parameters, grid),
             *exchange_collectives([p for p in exchanged if p not in shared],
                                   grid.data, bits=work.compress_bits,
                                   param_bytes=work.param_bytes, reduce_dtype=work.reduce_dtype,
                                   piece_bytes=shape.packed_bytes,
                                   layers=stage_layers, node_shards=work.node_shards(grid)),
             *batch_axes_collectives(d, shape)]
    if shared:  # each copy's share of their mean, for host memory, in float32
        found.append(Collective("reduce-scatter", (DATA.name,),
                                sum(p.elements for p in shared) * FP32))
    if work.offload_optimizer and grid.data > 1:
        # The new 16-bit parameters, each copy's share made from its share of the host state,
        # gathered over `data` (`offload.optimizer`: the state split over it). It runs after the
        # update, with no compute left in the step to hide behind.
        found.append(Collective("all-gather", (DATA.name,),
                                parameters_per_device(work, grid) * work.compute_bytes,
                                waited=True))
    if grid.pipe > 1:
        outside = sum(p.elements for p in d.parameters if p.outside_blocks) + d.head_reads
        found += pipeline_collectives(_schedule(work, grid), d.boundary, outside * work.param_bytes)
    # The pipeline runs a stage's forward again in its backward tick; parameter-sized collectives
    # repeat per microbatch, pipelined or accumulated. Of what `--remat` recomputes, the compiled
    # step (tests/test_comm_model.py) repeats the batch-split input gathers, not the weight
    # gathers over depth; `full` also the output reduce-scatters (all-reduces in the replicated
    # layout: tests/test_axes_model.py) of the layers whose output the block's backward reads
    # (`DenseLayer.reused`). Collectives XLA hoists out of the microbatch loop count once
    # (`loop_invariant`), except from a pipeline's ticks compiled for a GPU, whose embedding and
    # head sit in `lax.cond` branches (`pipeline._cond`): there the tables' and head's depth
    # gathers run per microbatch (compiled H100 step of Llama-3-8B on data 4 × pipe 2 × depth 8:
    # four table-sized gathers a tick).
    if work.remat != "none":
        found = [dataclasses.replace(c, count=c.count * 2) if c.rematerialized or (
            c.recomputed_in_full and work.remat == "full") else c for c in found]
    return tuple(stage_repeats(found, work.microbatches, 2 if grid.pipe > 1 else 1,
                               hoisted=grid.pipe == 1 or work.platform == "cpu"))


def bytes_by_kind(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Wire bytes per device per step, by collective kind.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      `{kind: wire bytes}` for every kind of `KINDS`.
    """
    totals = {k: 0.0 for k in KINDS}
    for c in collectives(work, grid):
        totals[c.kind] += c.wire_bytes(grid)
    return totals


def parameter_shards(work: Workload, grid: ParallelConfig) -> list[ParameterShard]:
    """Every parameter tensor one device holds, as the model's parts declare them.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The `ParameterShard`s of one device.
    """
    return list(declared(work, grid).parameters)


def bytes_by_axes(work: Workload, grid: ParallelConfig,
                  buffers: bool = False) -> dict[tuple[str, tuple[str, ...]], float]:
    """Bytes per device per step by collective kind and mesh axes.

    As `axonn_jax.analysis.hlo.bytes_by_axes` measures them in the compiled step.

    Args:
      work: the step.
      grid: the mesh.
      buffers: count full-buffer bytes (`size × count`) instead of wire bytes.

    Returns:
      `{(kind, axes): bytes}`, axes in mesh order (those of size 1 left out).
    """
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in collectives(work, grid):
        if c.group(grid) > 1 and c.count and c.size:
            key = (c.kind, tuple(a for a in AXES if a in c.axes and getattr(grid, a) > 1))
            out[key] = out.get(key, 0.0) + (c.size * c.count if buffers else c.wire_bytes(grid))
    return out


def parameters_per_device(work: Workload, grid: ParallelConfig) -> float:
    """Parameters one device holds (`parameter_shards`).

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The number of parameter elements.
    """
    return sum(p.elements for p in declared(work, grid).parameters)


def fused_attention(work: Workload) -> bool:
    """Whether the step's attention keeps no probabilities (cuDNN's fused kernel).

    Args:
      work: the step.

    Returns:
      True for `--attention cudnn`, or `auto` in 16 bits, which picks cuDNN on a GPU
      (`models.attention.resolve`).
    """
    choice = getattr(work.model, "attention", "auto")
    return choice == "cudnn" or (choice == "auto" and work.compute_bytes < FP32)


def block_residual_bytes(work: Workload, grid: ParallelConfig, tokens: float,
                         split: bool = False) -> float:
    """Bytes one transformer block's backward keeps from its forward on one device (no recompute).

    Read off the memory-usage reports of compiled H100 steps (`--dump-hlo` with XLA's dump
    flags; bf16, cuDNN attention) of Llama-3-8B on data 8 × pipe 8 and Llama-3-405B on pipe 2 ×
    depth 16 × row 8 and on pipe 2 × depth 2 × row 8 × col 8, per layer:

    - 6 activations of the residual stream's width in fp32 (the norms compute in fp32),
      features over col, rows over row when split; and 3 in the compute dtype whose rows stay
      whole (405B, col 8: three bf16[63, 8·4096, 16384/8]);
    - 6 of the MLP's hidden width (`d_ff`) in the compute dtype, features over row, rows over
      col when split but for one (405B: bf16[63, 8·4096, 53248/8]);
    - 4 of the attention heads' width (queries, keys, values, output), heads over row;
    - unfused attention (fp32, or `--attention xla`): the softmax's scores and probabilities,
      2 per head and key in fp32 (checked against the peak of Llama-3.2-1B with XLA's attention
      on an H200, which counting them in bf16 falls well below:
      `benchmarks/results/gpu_findings.md`); cuDNN's fused kernel keeps only per-row
      statistics, and so does the context-parallel attention (`parallel.context`, whose
      temporaries the model declares as `working`).

    Args:
      work: the step.
      grid: the mesh.
      tokens: positions of a (micro)batch on the device.
      split: the dense layers' batch-split layout (`tp.tensor.split_batch`, rows over col).

    Returns:
      Bytes one block keeps on one device.
    """
    m, g, cb = work.model, grid, work.compute_bytes
    d_ff = getattr(m, "d_ff", 4 * m.d_model)
    stream = tokens * m.d_model / g.col * (6 * FP32 / (g.row if split else 1) + 3 * cb)
    inner = tokens / (g.col if split else 1) / g.row
    out = stream + inner * (5 * d_ff + 4 * m.d_model) * cb + tokens / g.row * d_ff * cb
    if not fused_attention(work) and g.context == 1:  # context attention keeps none either
        out += 2 * inner * work.seq_len * m.num_heads * FP32
    return out


def memory_per_device(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """Bytes one device holds at peak: parameters, gradients, optimizer state and activations.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      `{"params", "grads", "optimizer", "compression", "activations", "total": bytes}`
      (`compression`: CGX's error-feedback residuals).
    """
    d = declared(work, grid)
    n = sum(p.elements for p in d.parameters)
    if d.activations is not None:  # a model that counts its own (a U-Net)
        activations = d.activations
    else:
        activations = _stack_activations(work, grid, d)
    return _breakdown(*_state_bytes(work, grid, d, n),
                      activations + _parameter_copies(work, grid, n))


def _state_bytes(work: Workload, grid: ParallelConfig, d: ModelCommunication, n: float) -> tuple:
    """`(params, grads, optimizer, CGX residuals)` bytes of `n` parameters on one device."""
    params = n * work.compute_bytes if work.offload_optimizer else n * work.param_bytes
    grads = n * (work.compute_bytes if work.offload_optimizer else work.param_bytes)
    if work.offload_gradients:  # only the parameters outside the blocks keep theirs
        grads -= _block_elements(d) * work.compute_bytes
    if grid.pipe > 1:  # every stage's gradient of the embedding and head, summed over pipe in fp32
        # beside the accumulator (compiled H100 step of Llama-3-8B on data 8 × pipe 8)
        grads += sum(p.elements for p in d.parameters if p.outside_blocks) * FP32
    optimizer = 0.0 if work.offload_optimizer else n * 2 * work.param_bytes  # Adam's two moments
    # CGX's error-feedback residuals: one per device, in the dtype of the gradients they correct
    # (`init_residual` of the device's parameters).
    residuals = n * (work.compute_bytes if work.offload_optimizer else work.param_bytes) \
        if work.compress_bits and work.error_feedback and grid.data > 1 else 0.0
    return params, grads, optimizer, residuals


def _parameter_copies(work: Workload, grid: ParallelConfig, n: float) -> float:
    """Bytes of the compute-dtype copies of `n` fp32 parameters that the step materializes."""
    # fp32 parameters computed with in 16 bits: the forward's cast of every parameter and its
    # gradient in the compute dtype before it is added in fp32, where the step materializes
    # them: gathered over depth, or cast once before a microbatch loop (the compiled H100 step
    # of Llama-3-70B on 256 devices holds both at its peak: memory-usage report of --dump-hlo).
    # Else XLA fuses the casts into the matmuls that read them (Llama-3.2-1B on one H200: the
    # plan is over the measured peak with them counted, `benchmarks/results/plan_vs_replay.md`).
    materialized = grid.depth > 1 or grid.pipe > 1 or work.microbatches > 1
    if materialized and not work.offload_optimizer and work.compute_bytes < work.param_bytes:
        return 2 * n * work.compute_bytes
    return 0.0


def _stack_activations(work: Workload, grid: ParallelConfig, d: ModelCommunication) -> float:
    """Activation bytes at peak of a stack of transformer blocks (`d_model`, `num_heads`)."""
    m, g = work.model, grid
    tokens = work.tokens / (g.data * g.expert * g.context * g.depth) / work.microbatches
    rows = (g.row, g.col) if d.split else (1, 1)
    per_block = block_residual_bytes(work, grid, tokens, d.split)
    layers, stash = _stashed(work, grid, d.boundary, tokens)
    # The head's logits of one (micro)batch and their gradient, the vocabulary over `row`: float32
    # in the model, but XLA:GPU keeps the matmul's compute-dtype output and fuses the cast into
    # the softmax's reductions, except inside a pipeline's tick (compiled H100 steps: Llama-3-70B
    # on data 4 × depth 16 × row 4 holds one bf16[16, 4096, 32064], GPT-20B on data 4 × depth 16
    # bf16[24, 2048, 50304]; Llama-3-8B on data 4 × pipe 2 × depth 8 two f32[2, 4096, 128256]).
    in_compute_dtype = g.pipe == 1 and work.platform == "gpu"
    logits = 2 * tokens / rows[1] * m.vocab_size / g.row * (
        work.compute_bytes if in_compute_dtype else FP32)
    parts = d.part_activations * work.imbalance(grid) / work.microbatches
    if work.remat != "none":  # the parts' layers recomputed one block at a time (as `per_block`)
        parts /= m.num_layers // g.pipe
    # The head's backward ends before the last block's recomputed forward begins: the logits and
    # one recomputed block are never live together (counting both put `plan` well over the
    # compiled peak of Llama-3-70B on data 4 × depth 16 × row 4 and of GPT-20B on depth 64).
    transient = max(logits, per_block if work.remat != "none" else 0.0)
    return kept_per_block(work, d, per_block, tokens / (g.row * g.col)) * layers \
        + transient + stash + d.working + parts


def _stashed(work: Workload, grid: ParallelConfig, boundary: float, tokens: float) -> tuple:
    """`(layers whose activations live at once, stashed bytes)`: the whole stack and its input
    without a pipeline; else one chunk's layers and the schedule's stashed chunk inputs."""
    m, g = work.model, grid
    if g.pipe == 1:
        return m.num_layers, boundary
    # One chunk's layers live in a backward; zb-h1's deferred weight gradients keep every
    # layer's matmul inputs and output cotangents (~16 activations of the block, those of
    # `block_residual_bytes` without the attention probabilities).
    sched = _schedule(work, grid)
    layers = m.num_layers // (g.pipe * work.virtual_stages)
    deferred = (sched.weight_slots * layers * 16 * tokens * m.d_model / (g.row * g.col)
                * work.compute_bytes) if sched.split_backward else 0.0
    return layers, sched.stash_slots * boundary + deferred


def _breakdown(params, grads, optimizer, residuals, activations) -> dict[str, float]:
    """`memory_per_device`'s dict: the parts and their total."""
    parts = {"params": params, "grads": grads, "optimizer": optimizer,
             "compression": residuals, "activations": activations}
    return {**parts, "total": sum(parts.values())}


def kept_per_block(work: Workload, declared: ModelCommunication, working_set: float,
                   tokens: float) -> float:
    """Bytes one block keeps for the backward under `work.remat`.

    Args:
      work: the step (its `remat`, `compute_bytes`).
      declared: what the model declares (`saved_features`, `boundary`).
      working_set: the block's whole working set (`block_residual_bytes`).
      tokens: positions per device and microbatch over the tensor split.

    Returns:
      Its whole working set (`none`), its input (`full`, `offload`: the rest is recomputed,
      resp. on the host), or its input and its named matmul outputs (`selective`:
      `declared.saved_features` per position; the working set when the model declares none).
    """
    if work.remat == "none" or (work.remat == "selective" and not declared.saved_features):
        return working_set
    kept = declared.saved_features * tokens * work.compute_bytes if work.remat == "selective" else 0
    return declared.boundary + kept


def link_time(kind: str, size: float, group: int, inter: bool, machine: Machine) -> float:
    """Seconds one collective takes, by the ring algorithm (all-reduce: or the double binary tree).

    An all-reduce takes the faster of the two, as NCCL picks.

    Args:
      kind: the collective kind (`KINDS`).
      size: the full buffer's bytes (`axonn_jax.collectives`' convention).
      group: devices in its group.
      inter: whether it runs across nodes (else within one).
      machine: the cluster's links.

    Returns:
      Seconds; 0 for a group of one.
    """
    if group <= 1:
        return 0.0
    bw = machine.inter_bw if inter else machine.intra_bw
    lat = machine.inter_latency if inter else machine.intra_latency
    ring = ring_bytes(kind, size, group) / bw + (2 * (group - 1) if kind == "all-reduce"
                                                 else group - 1) * lat
    if kind == "all-reduce":  # double binary tree: 2·S per device, 2·log2(g) latency steps
        ring = min(ring, 2 * size / bw + 2 * math.ceil(math.log2(group)) * lat)
    return ring


def spans_nodes(c: Collective, grid: ParallelConfig, machine: Machine) -> bool:
    """Whether collective `c`'s groups span nodes of `machine` (run on the NICs, not NVLink).

    Its devices lie further apart than one node: the stride of an axis is the product of the
    sizes of the axes inside it (mesh order, col fastest).

    Args:
      c: the collective (its `axes` and `span`).
      grid: the mesh.
      machine: the cluster (`devices_per_node`).

    Returns:
      True where a group crosses nodes.
    """
    outer_span = devices_inside(grid.as_dict(), c.axes[-1]) * (
        c.span or math.prod(getattr(grid, a) for a in c.axes))
    return outer_span > machine.devices_per_node


def _collective_time(c: Collective, grid: ParallelConfig, machine: Machine) -> float:
    g = c.group(grid)
    if g <= 1 or c.count == 0:
        return 0.0
    return c.count * link_time(c.kind, c.size, g, spans_nodes(c, grid, machine), machine)


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
    expert_imbalance_s: float = 0.0
    """Of `compute_s`, what the busiest expert shard adds over balanced routing
    (`Workload.expert_imbalance`): its experts' FLOPs and their memory-bound kernels."""
    remat: str = "none"
    """The `--remat` mode predicted (`Workload.remat`)."""
    memory_bound_s: float = 0.0
    """Of `compute_s`, the memory-bound kernels' time (`memory_bound_bytes` at HBM bandwidth)."""
    launch_s: float = 0.0
    """Of `compute_s`, what kernel launches add (`kernel_count` × `Machine.kernel_s`)."""
    kernels: float = 0.0
    """Kernel launches per step (`kernel_count`)."""
    offload_optimizer: bool = False
    """Whether the optimizer state is in host memory (`Workload.offload_optimizer`)."""
    offload_gradients: bool = False
    """Whether the blocks' gradients go to host memory too (`Workload.offload_gradients`)."""
    compress_bits: int = 0
    """CGX's bits per gradient value over `data` (`Workload.compress_bits`; 0: exact)."""

    def as_dict(self) -> dict:
        """Fields named as `axonn-jax compile --json` names the compiled figures.

        Returns:
          A JSON-ready dict, the grid as `ParallelConfig.as_dict`.
        """
        return {"grid": self.grid.as_dict(), "microbatches": self.microbatches,
                "remat": self.remat, "offload_optimizer": self.offload_optimizer,
                "offload_gradients": self.offload_gradients,
                "compress_bits": self.compress_bits,
                "step_time_s": self.step_time_s,
                "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "bubble_s": self.bubble_s, "comm_bytes_per_device": self.comm_bytes_per_device,
                "memory_per_device_bytes": self.memory_per_device_bytes,
                "memory_breakdown": self.memory_breakdown, "mfu": self.mfu,
                "exposed_comm_by_axis": self.exposed_comm_by_axis,
                "flops_per_device": self.flops_per_device,
                "host_memory_per_device_bytes": self.host_memory_per_device_bytes,
                "fits": self.fits, "expert_imbalance_s": self.expert_imbalance_s,
                "memory_bound_s": self.memory_bound_s, "launch_s": self.launch_s,
                "kernels": self.kernels}


def _overlaps_backward(c: Collective) -> bool:
    """The gradient exchange over the batch axes (data's, and the sums over expert and context
    of the parameters they do not split, `step.batch_axes`), hidden behind the backward pass up
    to its compute time."""
    return c.axes == (Axis.DATA,) or (c.kind == "all-reduce" and set(c.axes) <= _BATCH_AXIS_NAMES)


_BATCH_AXIS_NAMES = frozenset(a.name for a in BATCH_AXIS_PLUGINS)


def recompute_factor(work: Workload, grid: ParallelConfig) -> float:
    """FLOPs the step runs over the model's training FLOPs (forward 1, backward 2).

    The pipeline runs each stage's forward again in its backward tick (+1/3); `--remat full` each
    block's once more (+1/3); `selective` and `offload` recompute the attention scores (`QKᵀ`,
    one of the attention core's two matmuls) from the kept projections.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The factor, at least 1.
    """
    factor = (4 / 3 if grid.pipe > 1 else 1.0) + (1 / 3 if work.remat == "full" else 0.0)
    m = work.model
    if work.remat in ("selective", "offload") and hasattr(m, "d_model"):
        # 2·seq·d FLOPs per position per block (XLA's attention computes every score).
        scores = 2 * work.tokens * work.seq_len * m.d_model * m.num_layers
        factor += scores / work.flops()
    return factor


def parameter_traffic(work: Workload, grid: ParallelConfig) -> float:
    """HBM bytes one device moves per step over its parameters besides the matmuls.

    When the step runs several microbatches (a pipeline's ticks, gradient accumulation): each
    fp32 parameter is cast to the compute dtype once per step (read 4, write 2: `step.engines`
    casts before the microbatch loop), and per microbatch its gradient is converted to fp32 (read
    2, write 4) and added to the accumulator (read 8, write 4): 18 bytes per microbatch in bf16,
    12 in fp32. (Read off the compiled H100 step of Llama-3-70B on data 4 × pipe 16 × row 4: with
    the casts in every tick, 30 bytes per microbatch, its tick loop's converts and adds were a
    large share of the replayed schedule; casting once shortened the replayed step.) One
    microbatch: once, negligible.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      Bytes per device per step; 0 with one microbatch or `offload_optimizer`.
    """
    if work.microbatches == 1 or work.offload_optimizer:
        return 0.0
    cb, pb = work.compute_bytes, work.param_bytes
    cast = pb + cb if cb < pb else 0
    n = sum(p.elements for p in declared(work, grid).parameters)
    return n * (cast + work.microbatches * (cast + 3 * pb))


KERNELS_PER_LAYER = 200
"""Kernels (fusions, library calls, collective starts) one block launches per step, forward and
backward together: read off compiled H100 steps (`analysis.overlap.kernel_count` on their
modules, each row's count in `benchmarks/results/plan_vs_replay.md`): fewer on one device, more
on grids whose rows go round rings (their permutes and block copies). A context axis's ring runs
each hop's kernels apart, which this leaves out."""
KERNELS_OUTSIDE_LAYERS = 250
"""Kernels of a step outside its blocks (embedding, loss, gradient exchange, the optimizer
update's fusions), read off the same modules."""
QUANTIZER_PASSES = 4.0
"""HBM passes over one device's fp32 gradients that CGX's compressed exchange adds to the exact
exchange's: read off the compiled H100 module of the one-pass quantizer, 8 bits with error
feedback over data 8 (`benchmarks/results/compression_quantizer.md`: 5.6–6.1 passes in all,
of which the exact all-reduce's input and output are 2)."""
SOFTMAX_PASSES = (6, 6)
"""(forward, backward) passes over the attention scores of XLA's attention core, in fp32 scores
(one pass: every score read or written once), besides the probabilities kept for the backward
(`memory_bound_bytes`' `stacked`): forward the masked, scaled scores read and written, their
max and sum of exponentials read, the probabilities written and transposed; backward the
probabilities and their gradient read, the row sums, the scores' gradient written and
transposed. Read off the score-sized kernels of the compiled one-device H100 step of
Llama-3.2-1B with `--attention xla` (`benchmarks/plan_vs_replay.py`)."""


def _decoder_widths(m) -> dict[str, float] | None:
    """The widths a decoder's memory-bound kernels run over (None for another model): `d` the
    residual stream, `mlp` the hidden width its activation function reads per token (a gated MLP
    reads two, `gated`; a mixture of experts' `top_k` experts and shared experts), `rotary` the
    query and key features rotated (0 with learned positions), `heads`."""
    if not hasattr(m, "d_model") or not hasattr(m, "num_heads"):
        return None
    gated = hasattr(m, "num_kv_heads")  # Llama's SwiGLU (and a Mixtral's experts); GPT's GELU
    experts = getattr(m, "top_k", 0) + getattr(m, "num_shared_experts", 0)
    d_ff = getattr(m, "d_ff", 4 * m.d_model)
    rotary = (getattr(m, "q_features", m.d_model) + getattr(m, "kv_features", m.d_model)) \
        if gated else 0
    return {"d": m.d_model, "mlp": d_ff * (experts or 1), "gated": gated, "rotary": rotary,
            "heads": m.num_heads}


def memory_bound_bytes(work: Workload, grid: ParallelConfig) -> dict[str, float]:
    """HBM bytes one device's memory-bound kernels read and write per step, by kind.

    Each kernel is counted by what it must read and write once (the roofline the replay of a
    compiled step, `analysis.overlap`, charges it at `Machine.hbm_bw`); per block, for its
    tokens on the device (the residual stream's `S` elements: the batch over data, expert,
    context and depth, features over col, rows over row in the batch-split layout; the inner
    tensors' rows over row, and over col when split, as `block_residual_bytes` lays them out), in
    the compute dtype:

    - `norms`: two per block; forward a reduction (read `S`) and the normalization (read `S`,
      write `S`); backward six passes (the recomputed statistics, the input's and the scale's
      gradients: read the input and the output gradient, write the input gradient, the residual
      gradient added in);
    - `activation`: the MLP's activation over its hidden width `F` (per token: `d_ff`, times
      `top_k` plus shared experts in a mixture of experts): SwiGLU forward reads gate and up and
      writes their product (3`F`), backward reads both and the product's gradient and writes two
      gradients, the SiLU's derivative recomputed (7`F`); GELU forward 2`F`, backward 3`F`;
    - `rotary`: Llama's rotary embedding of queries and keys, read and written forward and
      backward;
    - `softmax`: XLA's attention core (not cuDNN's fused kernel, whose score traffic stays on
      chip and which the matmul term times): `SOFTMAX_PASSES` over the fp32 scores, every score
      of the sequence (over context: the scheme's share, `parallel.context.flops_share`);
    - `carry`: the layer loop's residual stream copied in and out of its carry, forward and
      backward (2`S` each);
    - `stacked`: what each block keeps for its backward (`kept_per_block`: under `none` its
      working set, under `selective` its input and named matmul outputs, under `full` its input)
      is zeroed once, written into the stacked buffer and read back: 5 passes;
    - `weights`: per parameter of the blocks one device holds, the cast of the fp32 parameter to
      the compute dtype per forward pass (read 4, write 2) and in the backward its gradient
      converted to fp32 and stacked (6 fp32 passes);
    - `loss`: the logits' softmax cross-entropy, 4 passes over the logits (the max, the sum of
      exponentials, the gradient read and written), in the compute dtype on a GPU without a
      pipeline (as `memory_per_device` keeps them) else fp32;
    - `parts`: what per-block parts declare beyond (`ModelCommunication.part_traffic`: a
      mixture of experts' dispatch), the forward's repeated as recomputed;
    - `quantizer`: CGX's compressed exchange over `data` (`compress_bits`), `QUANTIZER_PASSES`
      over the device's fp32 gradients beyond what the exact exchange moves.

    Recompute repeats the forward's kernels: the pipeline's and `full`'s whole forward,
    `selective`'s all but the MLP activation (whose inputs it keeps). A model that is not a
    decoder (a U-Net, which counts its own activations) gets five passes over the activations it
    keeps (written, read, and their gradients). The optimizer update is `update_seconds`, the
    microbatch loop's gradient accumulation `parameter_traffic`.

    Args:
      work: the step.
      grid: the mesh, `data × pipe × expert × context × depth × row × col`.

    Returns:
      `{kind: bytes per device per step}` for the kinds above.
    """
    g, d, m, cb = grid, declared(work, grid), work.model, work.compute_bytes
    widths = _decoder_widths(m)
    if widths is None:
        return {"stacked": 5 * (d.activations or 0.0)}
    tokens = work.tokens / (g.data * g.expert * g.context * g.depth)  # per step, all microbatches
    layers = m.num_layers // g.pipe
    rows = (g.row, g.col) if d.split else (1, 1)
    stream = tokens * widths["d"] / g.col / rows[0]
    inner = tokens / rows[1] / g.row
    mlp = inner * widths["mlp"] * work.imbalance(grid)
    fwd = {"norms": 2 * 3 * stream * cb, "activation": (3 if widths["gated"] else 2) * mlp * cb,
           "rotary": 2 * inner * widths["rotary"] * cb, "softmax": 0.0, "carry": 2 * stream * cb}
    bwd = {"norms": 2 * 6 * stream * cb, "activation": (7 if widths["gated"] else 3) * mlp * cb,
           "rotary": 2 * inner * widths["rotary"] * cb, "softmax": 0.0, "carry": 2 * stream * cb}
    if not fused_attention(work) or g.context > 1:
        from ..parallel.context import flops_share
        scores = inner * widths["heads"] * work.seq_len * FP32 * (
            flops_share(g.context, work.context_attention) if g.context > 1 else 1.0)
        fwd["softmax"], bwd["softmax"] = (p * scores for p in SOFTMAX_PASSES)
    recomputed = (1 if g.pipe > 1 else 0) + (1 if work.remat == "full" else 0)
    out = {k: layers * (fwd[k] * (1 + recomputed) + bwd[k]) for k in fwd}
    if work.remat in ("selective", "offload"):
        out = {k: v + layers * fwd[k] * (k not in ("activation", "carry")) for k, v in out.items()}
    per_block = block_residual_bytes(work, grid, tokens / work.microbatches, d.split)
    kept = kept_per_block(work, d, per_block, tokens / work.microbatches / (g.row * g.col))
    out["stacked"] = 5 * kept * work.microbatches * layers
    n_blocks = _block_elements(d)
    cast = work.param_bytes + cb if cb < work.param_bytes else 0
    out["weights"] = n_blocks * (cast * (1 + recomputed) + 6 * work.param_bytes)
    logits = tokens / rows[1] * m.vocab_size / g.row
    out["loss"] = 4 * logits * (cb if g.pipe == 1 and work.platform == "gpu" else FP32)
    forward, backward = d.part_traffic
    out["parts"] = forward * (1 + recomputed) * work.imbalance(grid) + backward
    out["quantizer"] = QUANTIZER_PASSES * parameters_per_device(work, grid) * FP32 \
        if work.compress_bits and g.data > 1 else 0.0
    return out


def kernel_count(work: Workload, grid: ParallelConfig) -> float:
    """Kernels one device launches per step.

    `KERNELS_PER_LAYER` a block, each pass of a recomputed forward a third more,
    `KERNELS_OUTSIDE_LAYERS` besides, per microbatch.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The estimated number of kernel launches per step.
    """
    layers = getattr(work.model, "num_layers", 1) // grid.pipe
    return work.microbatches * (layers * KERNELS_PER_LAYER * recompute_factor(work, grid)
                                + KERNELS_OUTSIDE_LAYERS)


def stream_utilisation(comm_s: float, compute_s: float) -> float:
    """The share of a step's compute time its communication stream is busy, at most 1.

    Why it is each collective's exposed share: XLA:GPU runs a step's collectives one after
    another on one stream, started as early as the latency-hiding scheduler can (weights
    prefetched a layer ahead, gradients reduced a layer late, ring permutes beside their block's
    matmul), and the compute that needs a collective's result arrives with no relation to what
    the stream is doing: it finds the stream still busy as often as the stream is busy, and
    waits for about the collective's own time. So a step exposes comm_s · utilisation =
    comm_s² / compute_s (all of comm_s once the stream is busy for the whole step). No measured
    constant: it was checked against the compiled H100 schedules replayed by `analysis.overlap`
    on ten grids (Llama-3-70B on 256: five grids; the 1.9B Llama on 8: data, depth, row,
    data × row × col, depth × row × col), as closely as the per-axis shares: the ratios are in
    `benchmarks/results/overlap_notes.md`, "... one law for the exposed time". It does not hold
    for the steps it leaves to the shares: a pipeline's collectives wait at tick boundaries (it
    overstates the replay's exposed time), and rows gathered whole (`--collective-matmul off`)
    put each gather before its matmul.

    Args:
      comm_s: every collective's time on its links, in seconds.
      compute_s: the step's compute time, in seconds.

    Returns:
      `comm_s / compute_s`, at most 1 (1 without compute).
    """
    return min(1.0, comm_s / compute_s) if compute_s > 0 else 1.0


def exposed_communication(timed: list[tuple[Collective, float]], compute_s: float, rate: float,
                          mode: str, links: list[bool] | None = None, layers: int = 0
                          ) -> list[tuple[Collective, float]]:
    """The seconds of each collective in `timed` that the step waits for.

    `spmd`: each collective's time × `stream_utilisation` of its link's stream: `links` (one
    flag per entry of `timed`: whether it spans nodes) puts the collectives inside nodes and those
    across on two streams, as XLA runs them and the replay of a compiled step
    (`analysis.overlap`) counts them, each busy with its own collectives; None: one stream.
    A collective the step `waited` for is exposed whole. Other modes: its time less what the
    compiled schedule hides of its axes' communication (`hidden_shares`), and never more than
    the compute it can hide behind: a tensor-parallel collective that declares the matmul it
    overlaps (`Collective.overlappable`) hides up to that matmul, the data-parallel gradient
    exchange (`_overlaps_backward`) up to the backward pass (2/3 of the compute).

    Under `spmd` a gradient exchange the backward issues layer by layer (`layers` > 0) is the
    exception to the stream law: nothing waits for it before the update, so it is exposed only
    where its link has no room left in the backward (`_backward_exchange_share`).

    Args:
      timed: `(collective, its time in seconds)` pairs.
      compute_s: the step's compute, in seconds.
      rate: the matmuls' rate, FLOP/s.
      mode: `spmd` (no pipeline, rows gathered in rings), `spmd-gathers`, or a pipeline
        schedule.
      links: for `spmd`, one flag per entry of `timed`: whether it spans nodes.
      layers: the layers whose gradients the backward exchanges one by one (`StepShape
        .layer_sums`); 0: the exchange runs after the backward.

    Returns:
      `(collective, exposed seconds)` pairs.
    """
    if mode == "spmd":
        links = links or [False] * len(timed)
        grads = [bool(layers) and not c.waited and _overlaps_backward(c) for c, _ in timed]
        busy, share = {}, {}
        for link in set(links):
            mine = [(t, g) for (_, t), on, g in zip(timed, links, grads) if on == link]
            busy[link] = stream_utilisation(sum(t for t, _ in mine), compute_s)
            share[link] = _backward_exchange_share(sum(t for t, g in mine if g),
                                                   sum(t for t, g in mine if not g),
                                                   compute_s, layers)
        return [(c, t if c.waited else t * (share[link] if g else busy[link]))
                for (c, t), link, g in zip(timed, links, grads)]
    out = []
    for c, t in timed:
        if not _overlaps_backward(c):
            hidden = 0.0 if c.waited else t * hidden_shares.hidden_share(c.axes, mode)
            if c.overlappable:
                hidden = min(hidden, c.count * c.overlappable / rate)
            out.append((c, t - hidden))
    data_time = sum(t for c, t in timed if _overlaps_backward(c))
    if data_time:
        hidden = min(data_time * hidden_shares.hidden_share((Axis.DATA,), mode), compute_s * 2 / 3)
        out += [(c, t * (1 - hidden / data_time)) for c, t in timed if _overlaps_backward(c)]
    return out


def _exchanges_tokens(found: list[Collective]) -> bool:
    """Whether the layers send their tokens to experts (all-to-alls over `expert`).

    In the compiled schedule of such a step (DeepSeek-MoE-16B on 64 H100s,
    `benchmarks/results/moe_grouped.md`) each layer's gradient exchange starts only after the
    layer's last token exchange, with little compute left beside it: the backward does not hide
    it (`_backward_exchange_share` does not apply; the stream law does)."""
    return any(c.kind == "all-to-all" and EXPERT_AXIS.name in c.axes for c in found)


def _backward_exchange_share(exchange_s: float, other_s: float, compute_s: float,
                             layers: int) -> float:
    """The exposed share of a link's gradient exchange issued layer by layer in the backward.

    Each layer's exchange runs while the layers below compute their backward
    (`step.layer_exchange`) and only the update reads the sums, so the exchange waits for
    nothing but its link: it hides in the backward (2/3 of `compute_s`) less the link's other
    collectives in that window (2/3 of `other_s`), and the last layer's share (1/`layers`)
    always follows the backward.

    Args:
      exchange_s: the link's gradient-exchange seconds.
      other_s: the link's other collectives' seconds.
      compute_s: the step's compute.
      layers: the layers exchanged one by one.

    Returns:
      The exposed fraction of `exchange_s`, in [1/`layers`, 1].
    """
    if not exchange_s:
        return 0.0
    room = max(0.0, (compute_s - other_s) * 2 / 3)
    return 1 - min(exchange_s * (1 - 1 / layers), room) / exchange_s


def predict(work: Workload, grid: ParallelConfig, machine: Machine) -> Prediction:
    """Predicted step time on `machine`: compute + exposed communication + pipeline bubble.

    Exposed communication (`exposed_communication`): without a pipeline, on a step whose layers
    gather their rows in rings, each collective waits for the communication stream as often as
    the stream is busy (`stream_utilisation`); otherwise each collective's time less what the
    compiled H100 schedule hides of its axes' communication (`hidden_shares`: measured, with its
    source). The bubble adds the schedule's published idle time per unit of
    work ((P−1)/M for 1F1B; V times less interleaved; zb-h1's at the engine's costs: forward 1,
    input gradient 2 (with the recomputed forward), weight gradient 1).

    Args:
      work: the step.
      grid: the mesh.
      machine: the cluster.

    Returns:
      The grid's `Prediction`.
    """
    rate = machine.peak_flops * machine.efficiency
    devices = grid.num_devices
    # FLOPs run per model FLOP: recomputation, and a pipeline's pace set by its busiest stage
    factor = recompute_factor(work, grid) * declared(work, grid).busiest_stage
    executed = work.executed_flops(grid)
    found = collectives(work, grid)
    memory_bound = sum(memory_bound_bytes(work, grid).values()) / machine.hbm_bw
    balanced = dataclasses.replace(work, expert_imbalance=1.0)  # what imbalance adds to it
    skew = memory_bound - sum(memory_bound_bytes(balanced, grid).values()) / machine.hbm_bw \
        if work.imbalance(grid) != 1.0 else 0.0
    kernels = kernel_count(work, grid)
    launch = kernels * machine.kernel_s
    compute = executed / devices / rate * factor + (parameter_traffic(work, grid) + sum(
        c.count * c.copied for c in found)) / machine.hbm_bw + memory_bound + launch
    # Rows go round rings only in the batch-split layout; tensor-parallel layers that keep their
    # rows whole (a microbatch too small to split over row) sum each output before the next
    # matmul, as rows gathered whole do.
    whole = grid.row * grid.col > 1 and not declared(work, grid).split
    mode = work.schedule if grid.pipe > 1 else \
        "spmd" if work.step(grid).rings and not whole else "spmd-gathers"
    timed = [(c, _collective_time(c, grid, machine)) for c in found]
    exposed = {k: 0.0 for k in KINDS}
    by_axis: dict[str, float] = {}
    links = [spans_nodes(c, grid, machine) for c, _ in timed]
    layers = max(1, getattr(work.model, "num_layers", 1) // grid.pipe) \
        if work.step(grid).layer_sums and not _exchanges_tokens(found) else 0
    for c, t in exposed_communication(timed, compute, rate, mode, links, layers):
        exposed[c.kind] += t
        by_axis["+".join(c.axes)] = by_axis.get("+".join(c.axes), 0.0) + t
    bubble = 0.0
    if grid.pipe > 1:
        idle = _schedule(work, grid).predicted_bubble(1.0, 2.0, 1.0)
        bubble = compute * idle / (1 - idle)
    mem = memory_per_device(work, grid)
    compute += update_seconds(work, grid, machine, mem)  # after the backward: nothing hides it
    # The compiled backward waits for each layer's gradient write to host memory at once (the
    # replayed H100 schedule: `benchmarks/results/offload_claim.md`).
    compute += host_gradient_bytes(work, grid) / machine.host_bw
    step = compute + sum(exposed.values()) + bubble
    mfu = work.flops() / (step * devices * machine.peak_flops)
    return Prediction(grid, work.microbatches, step, compute, exposed, bubble, bytes_by_kind(work, grid), mem["total"],
                      mem, mfu, {a: t for a, t in by_axis.items() if t > 0},
                      flops_per_device=executed / devices * factor,
                      host_memory_per_device_bytes=host_memory_per_device(work, grid),
                      fits=mem["total"] <= machine.device_memory, remat=work.remat,
                      expert_imbalance_s=(work.imbalance(grid) - 1) * declared(work, grid)
                      .expert_flops / devices / rate * factor + skew,
                      memory_bound_s=memory_bound,
                      launch_s=launch, kernels=kernels,
                      offload_optimizer=work.offload_optimizer,
                      offload_gradients=work.offload_gradients, compress_bits=work.compress_bits)


def update_seconds(work: Workload, grid: ParallelConfig, machine: Machine,
                   memory: dict[str, float]) -> float:
    """The optimizer update's time per step on one device.

    An elementwise update (AdamW, `step.update`) reads every parameter, gradient and state leaf
    the device holds and writes the parameters and the state back: 2·params + grads + 2·optimizer
    bytes at HBM bandwidth. With `offload_optimizer` the state streams from host memory and back
    (`offload.optimizer`): twice the host state over the host link, at best. The layers'
    memory-bound kernels are `memory_bound_bytes` (against measured steps:
    `benchmarks/results/plan_vs_replay.md`).

    Args:
      work: the step.
      grid: the mesh.
      machine: the cluster (`hbm_bw`, `host_bw`).
      memory: the device's `memory_per_device`.

    Returns:
      Seconds.
    """
    hbm = 2 * memory["params"] + memory["grads"] + 2 * memory["optimizer"]
    host = 2 * _host_state_bytes(work, grid)
    if work.offload_gradients:  # the share of the blocks' gradients this copy's state reads
        host += _block_elements(declared(work, grid)) * work.compute_bytes / grid.data
    return hbm / machine.hbm_bw + host / machine.host_bw


def host_gradient_bytes(work: Workload, grid: ParallelConfig) -> float:
    """Bytes of the blocks' gradients one device writes to host memory (`offload_gradients`).

    Each data-parallel copy writes its share of their mean (`_gradient_shared`; the whole mean
    of a block beside a tensor axis), during the backward, on the link's other direction
    (`predict` times it); in the update each reads back the share its part of the state needs
    (1/data), which `update_seconds` times.

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      Bytes (0 without `offload_gradients`).
    """
    if not work.offload_gradients:
        return 0.0
    d = declared(work, grid)
    elements = sum(p.elements / (grid.data if _gradient_shared(work, grid, p) else 1)
                   for p in d.parameters if not p.outside_blocks)
    return elements * work.compute_bytes


def _gradient_shared(work: Workload, grid: ParallelConfig, shard: ParameterShard) -> bool:
    """Whether each data-parallel copy writes only its share of `shard`'s gradient to host memory
    (`offload_gradients`, `offload.optimizer.share_dimension`): a block's that no tensor axis of
    more than one device splits."""
    if not work.offload_gradients or grid.data == 1 or shard.outside_blocks:
        return False
    return all(getattr(grid, a) == 1 for axes in shard.splits for a in axes)


def _block_elements(d: ModelCommunication) -> float:
    """Parameter elements of the stacked blocks one device holds."""
    return sum(p.elements for p in d.parameters if not p.outside_blocks)


def host_memory_per_device(work: Workload, grid: ParallelConfig) -> float:
    """Host bytes of one device's optimizer state (and gradients).

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      With `offload_optimizer`, its share of its parameters' fp32 masters and Adam's two fp32
      moments (`offload.optimizer`: split over `data`), plus the blocks' gradients with
      `offload_gradients`; else 0.
    """
    return _host_state_bytes(work, grid) + host_gradient_bytes(work, grid)


def _host_state_bytes(work: Workload, grid: ParallelConfig) -> float:
    """One device's share of the offloaded fp32 masters and Adam's two moments (0 without
    `offload_optimizer`)."""
    if not work.offload_optimizer:
        return 0.0
    return parameters_per_device(work, grid) * 3 * work.param_bytes / grid.data


def _factorizations(n: int, parts: int) -> Iterable[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


def searched_axes(work: Workload) -> tuple[str, ...]:
    """The mesh axes a grid for `work` may split, in `AXES` order.

    Args:
      work: the step.

    Returns:
      Every axis but the batch axes that split nothing of the model (`BatchAxis.splits_model`):
      `expert` only for a mixture of experts, `context` only for a decoder whose attention runs
      over it.
    """
    refused = {a.name for a in BATCH_AXIS_PLUGINS if not a.splits_model(work.model, work.seq_len)}
    return tuple(a for a in AXES if a not in refused)


def candidate_grids(work: Workload, num_devices: int) -> list[ParallelConfig]:
    """Every grid of `num_devices` devices over `searched_axes(work)`.

    Context is tried wherever it is allowed and kept when it ranks best (long sequences need it
    for memory).

    Args:
      work: the step.
      num_devices: the devices to split.

    Returns:
      Every `ParallelConfig` whose searched axes multiply to `num_devices`.
    """
    axes = searched_axes(work)
    return [ParallelConfig(**dict(zip(axes, sizes)))
            for sizes in _factorizations(num_devices, len(axes))]


def infeasible_reason(work: Workload, grid: ParallelConfig) -> str | None:
    """Why `grid` cannot run `work` (a dimension that does not divide), or None.

    The trainer's own checks (`config.check_grid`, `GPTConfig.check_grid`).

    Args:
      work: the step.
      grid: the mesh.

    Returns:
      The first check's error message, or None where the grid runs.
    """
    try:
        check_grid(grid, batch_size=work.batch, microbatches=work.microbatches)
        work.model.check_grid(grid)
        searched = searched_axes(work)
        for axis in AXES:
            if getattr(grid, axis) > 1 and axis not in searched:
                raise ValueError(f"{type(work.model).__name__} has no {axis} axis")
        if grid.context > 1:
            check_sequence(work.seq_len, grid.context)
    except ValueError as e:
        return str(e)
    found = pipeline_problems(grid.pipe, schedule=work.schedule, microbatches=work.microbatches,
                              virtual_stages=work.virtual_stages,
                              num_layers=work.model.num_layers)
    if work.offload_gradients:
        found += gradient_offload_problems(grid, work.offload_optimizer, work.microbatches,
                                           bool(work.compress_bits))
    return found[0] if found else None


MICROBATCH_FACTORS = (1, 2, 4, 8, 16, 32)
"""Microbatches `plan` tries with a pipeline: pipe × these, up to 32 per stage, so that a large
model's stage of many layers (Llama-3-405B on pipe 2: 63) finds a microbatch whose activations
fit (without one: 1, see `plan`)."""
PLANNED_REMAT = ("none", "selective", "full")
"""The `--remat` modes the planner chooses among (`offload`'s host transfers are not timed)."""


def plan(work: Workload, num_devices: int, machine: Machine, grid: ParallelConfig | None = None,
         microbatch_choices: Iterable[int] | None = None,
         remat_choices: Iterable[str] | None = None,
         state_choices: Iterable[tuple[bool, int]] | None = None,
         lossy_margin: float = 0.0) -> list[Prediction]:
    """Every feasible grid of `num_devices` (or just `grid`) ranked by predicted step time.

    A context grid only where the same grid with data in its place does not run or fit
    (`_data_instead`). For each grid the number of microbatches (default: pipe ×
    `MICROBATCH_FACTORS` with a pipeline, 1 without), the remat mode (default
    `PLANNED_REMAT`) and where the optimizer state lives and how the gradients cross `data`
    (`state_choices`; default: the workload's) are chosen as the fastest that divides the
    batch and fits in memory (the least memory among equally fast ones). Grids whose memory
    exceeds the device are dropped.

    Args:
      work: the step.
      num_devices: the devices to split.
      machine: the cluster.
      grid: rank this grid alone (None: every `candidate_grids`).
      microbatch_choices: microbatch counts to try (None: the default above).
      remat_choices: `--remat` modes to try (None: `PLANNED_REMAT`).
      state_choices: `(offload_optimizer, compress_bits)` pairs to try (None: the workload's
        own); compressed pairs only on grids whose gradients cross `data`.
      lossy_margin: a compressed pair (which changes the numerics) is chosen over an exact one
        only when it is predicted this much faster (a fraction of the step).

    Returns:
      The fitting grids' `Prediction`s, fastest first.

    Raises:
      ValueError: the model's config declares no communication (`counts`).
    """
    if not counts(work.model):
        raise ValueError(f"the communication model counts models whose config declares their "
                         f"communication (`communication(step)`), not {type(work.model).__name__}")
    candidates = [grid] if grid else candidate_grids(work, num_devices)
    remats = list(remat_choices or PLANNED_REMAT)
    if not remat_choices and not declared(work, ParallelConfig()).saved_features:
        remats.remove("selective")  # a model that declares no selective bytes (a U-Net)
    states = list(state_choices or [(work.offload_optimizer, work.compress_bits)])
    results, fitting = [], set()
    for g in sorted(candidates, key=lambda g: g.context):
        if _data_instead(g) in fitting:
            continue
        # Without a pipeline one microbatch: the compiled H100 step of Llama-3-70B on data 2 ×
        # depth 16 × row 4 × col 2 with 4 accumulated microbatches held far more than counted
        # (its kept activations as counted, and about as much again that accumulation leaves
        # live: not modelled), so accumulation is only what a config asks.
        default = [g.pipe * k for k in MICROBATCH_FACTORS] if g.pipe > 1 else [1]
        # Within pipeline stages only `none` (the compiled Llama-3-405B step on pipe 2 × depth
        # 16 × row 4 × col 2 with `selective` held well over what is counted: the tick's
        # recompute under a policy is not modelled); a config's own `--remat` is counted as given.
        modes = remats if g.pipe == 1 or remat_choices else ["none"]
        best = None
        for mb in list(microbatch_choices or default):
            w = dataclasses.replace(work, microbatches=mb)
            if infeasible_reason(w, g):
                continue
            for remat, (offload, bits) in itertools.product(modes, states):
                if bits and g.data == 1:
                    continue
                chosen = dataclasses.replace(w, remat=remat, offload_optimizer=offload,
                                             compress_bits=bits)
                p = _gradients_offloaded_if_needed(predict(chosen, g, machine), chosen, g,
                                                   machine)
                key = (p.step_time_s * (1 + lossy_margin if bits else 1),
                       p.memory_per_device_bytes)
                if p.fits and (best is None or key < best[0]):
                    best = (key, p)
        if best:
            results.append(best[1])
            fitting.add(g)
    return sorted(results, key=lambda p: p.step_time_s)


def _gradients_offloaded_if_needed(p: Prediction, work: Workload, grid: ParallelConfig,
                                   machine: Machine) -> Prediction:
    """`p` (`work`'s prediction), or where its offloaded state does not fit, the prediction with
    the blocks' gradients in host memory too (`offload_gradients`, where the grid allows it)."""
    if p.fits or not work.offload_optimizer or work.offload_gradients:
        return p
    moved = dataclasses.replace(work, offload_gradients=True)
    return p if infeasible_reason(moved, grid) else predict(moved, grid, machine)


def _data_instead(grid: ParallelConfig) -> ParallelConfig | None:
    """For a grid that splits the sequence, the same grid splitting the batch over those devices
    instead (None otherwise). The same tokens per device, the same gradient sum (over data·context
    either way), no key/value traffic and no more memory but the attention's probabilities: where
    it runs and fits, the context grid cannot be faster, and the planner skips it (context is
    kept where memory or the batch needs it)."""
    if grid.context == 1:
        return None
    return dataclasses.replace(grid, data=grid.data * grid.context, context=1)
