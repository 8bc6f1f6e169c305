"""Starting JAX's distributed runtime: explicit arguments, environment variables, SLURM and mpirun.

Every process of a multi-process job calls `init_distributed()` before it touches a device. The
process grid comes from, in order: the arguments; `AXONN_COORDINATOR` / `AXONN_NUM_PROCESSES` /
`AXONN_PROCESS_ID` (set by `axonn-jax launch`); JAX's own `JAX_COORDINATOR_ADDRESS` /
`JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`; a SLURM job step (`srun`); `mpirun` (Open MPI's
`OMPI_COMM_WORLD_*`, MPICH's `PMI_RANK` / `PMI_SIZE`). Under mpirun the coordinator address is
agreed over MPI (rank 0 picks its host name and a free port and broadcasts them with mpi4py).
On CPU, collectives between processes use gloo (JAX 0.10's default `jax_cpu_collectives_implementation`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Mapping

ENV_COORDINATOR = "AXONN_COORDINATOR"
ENV_NUM_PROCESSES = "AXONN_NUM_PROCESSES"
ENV_PROCESS_ID = "AXONN_PROCESS_ID"
ENV_LOCAL_DEVICES = "AXONN_LOCAL_DEVICES"
"""Simulated CPU devices per process (`axonn-jax launch --devices-per-proc`)."""
ENV_HEARTBEAT_TIMEOUT = "AXONN_HEARTBEAT_TIMEOUT"
"""Seconds without a heartbeat after which the job declares a process dead (`axonn-jax launch
--heartbeat-timeout`; JAX's default when unset)."""

SLURM_BASE_PORT = 41000


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a job: `process_id` of `num_processes`, and the coordinator's
    `host:port` (None under mpirun until it is agreed over MPI). `source` names where it came from;
    `local_rank` is the process's index on its host when a scheduler (srun, mpirun) started it."""

    coordinator: str | None
    num_processes: int
    process_id: int
    source: str
    local_rank: int | None = None


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `"gpu[007-010,12],cpu1"` -> `"gpu007"`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def detect(environ: Mapping[str, str] | None = None) -> ProcessSpec | None:
    """The process grid described by the environment, or None when nothing describes one."""
    env = os.environ if environ is None else environ
    for source, (addr, count, rank) in (
        ("AXONN_*", (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)),
        ("JAX_*", ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")),
    ):
        present = [name for name in (addr, count, rank) if name in env]
        if len(present) == 3:
            return ProcessSpec(env[addr], _int(env, count), _int(env, rank), source)
        if present and source == "AXONN_*":
            missing = sorted({addr, count, rank} - set(present))
            raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} missing")
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        count = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        # Every task derives the same port from the job and step ids.
        port = SLURM_BASE_PORT + (int(env.get("SLURM_JOB_ID", "0")) * 7
                                  + int(env.get("SLURM_STEP_ID", "0") or 0)) % 20000
        return ProcessSpec(f"{first_slurm_host(nodes)}:{port}", _int(env, count),
                           _int(env, "SLURM_PROCID"), "slurm", _local_rank(env, "SLURM_LOCALID"))
    for source, count, rank, local in (
        ("openmpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("mpich", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
    ):
        if count in env and rank in env:
            return ProcessSpec(None, _int(env, count), _int(env, rank), source,
                               _local_rank(env, local))
    return None


def _local_rank(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if name in env else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _coordinator_over_mpi() -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"launched by mpirun but mpi4py is not installed: install the `mpi` extra, or set "
            f"{ENV_COORDINATOR}=host:port") from None
    comm = MPI.COMM_WORLD
    address = f"{socket.gethostname()}:{free_port('0.0.0.0')}" if comm.Get_rank() == 0 else None
    return comm.bcast(address, root=0)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_count: int | None = None,
                     environ: Mapping[str, str] | None = None) -> ProcessSpec:
    """Start JAX's distributed runtime for this process; returns the grid it joined.

    Arguments left None come from the environment (see the module docstring). A job of one process
    starts nothing. `local_device_count` (default: `AXONN_LOCAL_DEVICES`) makes the CPU backend of
    this process expose that many simulated devices. Must run before any JAX computation; calling
    it again with the same grid is a no-op.
    """
    import jax

    from ..mesh import simulate_cpu_devices

    env = os.environ if environ is None else environ
    if local_device_count is None and ENV_LOCAL_DEVICES in env:
        local_device_count = _int(env, ENV_LOCAL_DEVICES)
    if local_device_count is not None:
        simulate_cpu_devices(local_device_count)

    detected = None if None not in (coordinator, num_processes, process_id) else detect(env)
    spec = ProcessSpec(
        coordinator if coordinator is not None else (detected and detected.coordinator),
        num_processes if num_processes is not None else (detected and detected.num_processes),
        process_id if process_id is not None else (detected and detected.process_id),
        "arguments" if detected is None else detected.source,
        None if detected is None else detected.local_rank,
    )
    if spec.num_processes is None and spec.process_id is None:
        if coordinator is not None:
            raise ValueError(f"init_distributed: coordinator {coordinator!r} given without "
                             "num_processes and process_id")
        return ProcessSpec(None, 1, 0, "single process")
    if spec.num_processes is None or spec.process_id is None:
        raise ValueError(f"init_distributed: num_processes={spec.num_processes} and "
                         f"process_id={spec.process_id} must both be known")
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"process_id {spec.process_id} is not in [0, num_processes="
                         f"{spec.num_processes}) (from {spec.source})")
    if spec.num_processes == 1:
        return spec
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (spec.num_processes, spec.process_id):
            raise RuntimeError(f"jax.distributed already initialized as process "
                               f"{jax.process_index()} of {jax.process_count()}, not {spec}")
        return spec
    if spec.coordinator is None:
        if spec.source not in ("openmpi", "mpich"):
            raise ValueError("init_distributed: the coordinator address (host:port) is not known")
        spec = dataclasses.replace(spec, coordinator=_coordinator_over_mpi())
    local_ids = None
    if spec.local_rank is not None and "JAX_LOCAL_DEVICE_IDS" not in env:
        # As JAX does under SLURM and Open MPI: a process started by the scheduler drives one
        # accelerator, its local rank (this sets CUDA/ROCm visible devices; CPUs are unaffected).
        local_ids = [spec.local_rank]
    timeouts = {}
    if ENV_HEARTBEAT_TIMEOUT in env:
        timeouts["heartbeat_timeout_seconds"] = _int(env, ENV_HEARTBEAT_TIMEOUT)
    # Everything is decided here; JAX's own cluster detection would second-guess it.
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                               local_device_ids=local_ids, cluster_detection_method="deactivate",
                               **timeouts)
    return spec


def axes_crossing_processes(mesh) -> list[str]:
    """Mesh axes along which neighbouring devices belong to different processes (outer axes first).

    With `make_mesh`'s layout these are the outer axes (`data`, `pipe`) unless a process holds fewer
    devices than one tensor-parallel group.
    """
    import numpy as np

    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    crossing = []
    for i, name in enumerate(mesh.axis_names):
        if procs.shape[i] > 1 and np.any(np.diff(procs, axis=i) != 0):
            crossing.append(name)
    return crossing
