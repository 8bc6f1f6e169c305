"""Where a train step can be compiled without running it: abstract H100s, simulated CPU devices.

- **H100** (`h100_devices(n)`): JAX's compile-only devices of the CUDA plugin
  (`jax.experimental.topologies`), one process on this host standing in for `n` H100 SXM GPUs in
  nodes of 8. XLA compiles real sm_90 code for them from the target description below; nothing
  runs, nothing is allocated, no GPU is needed. Needs the `compile` extra (`jax-cuda12-plugin` and
  `jax-cuda12-pjrt` at jaxlib's exact version, `nvidia-cuda-nvcc-cu12` for libdevice and ptxas,
  `nvidia-cudnn-cu12` for fused attention) and the CPU platform for JAX itself
  (`JAX_PLATFORMS=cpu`, `mesh.use_cpu_platform()`: on a machine without a GPU the plugin's own
  backend fails to start). `cuda_compile_problem()` says what is missing.
- **CPU** (`cpu_devices(n)`): this process's simulated CPU devices (`mesh.simulate_cpu_devices`);
  XLA:CPU has no compile-only topology, so `n` above the process's device count needs a process
  started with that many (`axonn-jax compile --target cpu --devices N` is one).

Device ids of both are the positions in `make_mesh`'s order, as the compiled HLO's replica groups
name them (`analysis.hlo.group_axes`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import pathlib
import sys

from .._compat import register_cuda_plugin
from ..checks import check_choice

GPUS_PER_NODE = 8

# The H100 SXM5 80GB, in the fields of XLA's `stream_executor.GpuDeviceInfoProto` that the
# installed jaxlib (0.10) accepts. Sources: [A] NVIDIA H100 Tensor Core GPU Architecture
# whitepaper (2022) and H100 SXM datasheet; [B] CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability", compute capability 9.0.
H100_SXM = {
    "cuda_compute_capability": (9, 0),  # [B] Hopper
    "core_count": 132,  # [A] SMs of the SXM5 part
    "fpus_per_core": 128,  # [A] FP32 cores per SM
    "clock_rate_ghz": 1.98,  # [A] max boost clock (1980 MHz)
    "memory_bandwidth": 3_350_000_000_000,  # [A] HBM3, 3.35 TB/s
    "device_memory_size": 80 * 2**30,  # [A] 80 GB of HBM3 (5 stacks × 16 GiB)
    "l2_cache_size": 50 * 2**20,  # [A] 50 MB
    "shared_memory_per_core": 228 * 2**10,  # [A] [B] 228 KB per SM
    "shared_memory_per_block": 48 * 2**10,  # [B] without opt-in
    "shared_memory_per_block_optin": 227 * 2**10,  # [B] 227 KB
    "threads_per_block_limit": 1024,  # [B]
    "threads_per_warp": 32,  # [B]
    "threads_per_core_limit": 2048,  # [B] 64 warps per SM
    "registers_per_core_limit": 65536,  # [B] 64K 32-bit registers per SM
    "registers_per_block_limit": 65536,  # [B]
    "block_dim_limit_x": 2**31 - 1,  # [B] grid dimensions (XLA's name for them)
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "thread_dim_limit_x": 1024,  # [B] block dimensions
    "thread_dim_limit_y": 1024,
    "thread_dim_limit_z": 64,
    "pcie_bandwidth": 64_000_000_000,  # [A] PCIe Gen5 ×16, per direction
}
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_CAPACITY_BYTES = 80e9
"""What `fits` compares a compiled step's peak with: the 80 GB `plan` budgets an H100 with
(`comm_model.MACHINES`), below the part's 80 GiB, which the CUDA context and XLA's own buffers
share with the program."""

CUDA_WHEELS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12",
               "nvidia-cudnn-cu12")

PLUGIN_DIR_VARIABLE = "AXONN_CUDA_PLUGIN_DIR"
"""Where `scripts/install_compile_extra.sh` puts the CUDA plugin wheels on a machine without a GPU
(default: `cuda-plugin` inside the virtual environment): outside site-packages, since a plugin
there is imported by every `import jax` and, without a GPU, prints CUDA driver warnings on every
process's stderr. `load_cuda_plugin` adds it to sys.path when compiling for H100."""


def plugin_dir() -> pathlib.Path:
    """The side directory of the CUDA plugin (`PLUGIN_DIR_VARIABLE`, else `cuda-plugin`).

    Returns:
      Its path; the default lies inside the virtual environment (`sys.prefix`).
    """
    return pathlib.Path(os.environ.get(PLUGIN_DIR_VARIABLE) or pathlib.Path(sys.prefix) / "cuda-plugin")


def load_cuda_plugin() -> bool:
    """Make the CUDA plugin importable and registered with JAX.

    From `plugin_dir()` unless it is installed in site-packages.

    Returns:
      True when JAX can then make CUDA topologies.
    """
    import importlib.util

    import jax

    # JAX looks for plugins once, when its backends start: start them before the side directory
    # is on sys.path, or that search finds the plugin registered below and registers it again
    # (a logged "PJRT_Api already exists" traceback on stderr).
    jax.devices()
    side = str(plugin_dir())
    if importlib.util.find_spec("jax_cuda12_plugin") is None and os.path.isdir(side) \
            and side not in sys.path:
        sys.path.append(side)
        importlib.invalidate_caches()
    return register_cuda_plugin()


def _version(package: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def cuda_compile_problem() -> str | None:
    """Why H100 programs cannot be compiled in this process (None: they can).

    Returns:
      A missing wheel of the `compile` extra, a plugin of another version than jaxlib's, or JAX
      running on a platform other than the CPU; None where nothing is in the way.
    """
    import jax
    import jaxlib

    load_cuda_plugin()  # so that a plugin in the side directory has its metadata found too
    missing = [w for w in CUDA_WHEELS if _version(w) is None]
    if missing:
        return (f"compiling for H100 needs {', '.join(missing)} (`bash "
                f"scripts/install_compile_extra.sh .venv`, or `make test`)")
    plugin = importlib.metadata.version("jax-cuda12-plugin")
    if plugin != jaxlib.__version__:
        return f"jax-cuda12-plugin {plugin} does not match jaxlib {jaxlib.__version__}"
    if jax.default_backend() != "cpu":
        return f"JAX runs on {jax.default_backend()}; H100 targets are compiled on the CPU platform"
    return None


def h100_target_config() -> str:
    """`GpuTargetConfigProto` text for the H100 SXM (`H100_SXM`).

    Returns:
      The proto's text, with the cuDNN and CUDA versions of the installed wheels (what XLA may
      assume the toolkit offers).
    """
    info = []
    for field, value in H100_SXM.items():
        if field == "cuda_compute_capability":
            info.append(f"  {field} {{ major: {value[0]} minor: {value[1]} }}")
        else:
            info.append(f"  {field}: {value}")
    dnn = (_version("nvidia-cudnn-cu12") or (9, 8, 0)) + (0, 0)
    cuda = (_version("nvidia-cuda-nvcc-cu12") or (12, 6, 0)) + (0, 0)
    return "\n".join([
        "gpu_device_info {", *info, "}",
        'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
        f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} patch: 0 }}",
        f'device_description_str: "{H100_NAME}"',
    ]) + "\n"


def h100_topology(n: int) -> str:
    """The CUDA plugin's topology string for `n` GPUs.

    Args:
      n: the GPUs.

    Returns:
      `1x1xn` within a node (n ≤ 8), else `1x<n/8>x8` (partitions × hosts × GPUs per host).

    Raises:
      ValueError: a count that fills no whole nodes.
    """
    if n < 1 or (n > GPUS_PER_NODE and n % GPUS_PER_NODE):
        raise ValueError(f"--devices {n}: H100 targets come in nodes of {GPUS_PER_NODE} GPUs "
                         f"(1 to {GPUS_PER_NODE}, or a multiple of {GPUS_PER_NODE})")
    if n <= GPUS_PER_NODE:
        return f"1x1x{n}"
    return f"1x{n // GPUS_PER_NODE}x{GPUS_PER_NODE}"


@functools.lru_cache(maxsize=8)  # a topology's devices, reused by every compile of that size
def h100_devices(n: int) -> tuple:
    """`n` compile-only H100 devices, in nodes of 8. Tried up to 8192.

    Args:
      n: the GPUs (`h100_topology`).

    Returns:
      `jax.Device`s of platform `gpu` that own no memory.

    Raises:
      ValueError: they cannot be made (`cuda_compile_problem`), or `n` fills no whole nodes.
    """
    from jax.experimental import topologies

    if problem := cuda_compile_problem():
        raise ValueError(problem)
    topo = topologies.get_topology_desc(platform="cuda", topology_name="h100",
                                        target_config=h100_target_config(),
                                        topology=h100_topology(n))
    return tuple(topo.devices)


def cpu_devices(n: int) -> tuple:
    """`n` of this process's simulated CPU devices.

    Args:
      n: the devices.

    Returns:
      The first `n` CPU devices.

    Raises:
      ValueError: naming the numbers when the process has fewer (start it with `--devices N`:
        XLA:CPU has no compile-only topology).
    """
    import jax

    devices = jax.devices("cpu")
    if n > len(devices):
        raise ValueError(f"--devices {n}: this process simulates {len(devices)} CPU devices; "
                         f"start it with --devices {n} (`axonn-jax compile --target cpu` does)")
    return tuple(devices[:n])


COMPILE_ONLY_OPTIONS: dict[str, int] = {"xla_gpu_autotune_level": 0}
"""XLA:GPU options for a program compiled for devices that are not there (`h100_devices`). The
autotuner has no GPU to time kernels on: without it the compiled program is the same, and the
compile takes about half the time (`benchmarks/results/compile_speed.md`)."""


def compile_options(device) -> dict[str, int] | None:
    """The options to compile for `device` with, beside the step's own (None: none).

    Args:
      device: a `jax.Device` of the step's mesh.

    Returns:
      `COMPILE_ONLY_OPTIONS` for a compile-only GPU (one that owns no memory), else None.
    """
    if device.platform == "gpu" and not device.addressable_memories():
        return dict(COMPILE_ONLY_OPTIONS)
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: `devices(n)`, and the memory each device has.

    `capacity_bytes` is what `fits` compares with: for CPU devices, the accelerator's they stand
    in for, an H100's by default.
    """

    name: str
    devices: callable
    capacity_bytes: float = H100_CAPACITY_BYTES


TARGETS = {"h100": Target("h100", h100_devices), "cpu": Target("cpu", cpu_devices)}


def target(name: str) -> Target:
    """The compile target named `name`.

    Args:
      name: a key of `TARGETS` (`h100`, `cpu`).

    Returns:
      The `Target`.

    Raises:
      ValueError: an unknown name.
    """
    return TARGETS[check_choice("--target", name, TARGETS)]
