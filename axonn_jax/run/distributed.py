"""Joining a multi-process job: JAX's distributed runtime, started from explicit arguments,
`axonn-jax launch`'s variables, or the cluster JAX itself detects.

Every process of a multi-process job calls `init_distributed()` before it touches a device. Each of
the coordinator's `host:port`, the process count and the process id comes from, in order: the
arguments; `AXONN_COORDINATOR` / `AXONN_NUM_PROCESSES` / `AXONN_PROCESS_ID` (set by `axonn-jax
launch`); then `jax.distributed.initialize`'s own cluster detection (`JAX_COORDINATOR_ADDRESS`, a
SLURM step, Open MPI, Cloud TPU, Kubernetes). Under an MPI launcher that JAX does not recognise by
itself (MPICH's Hydra `mpirun`, which sets `PMI_RANK`) JAX's `mpi4py` method is chosen: rank 0
picks the coordinator and broadcasts it over MPI. On CPU, collectives between processes use gloo.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from importlib.util import find_spec
from typing import Mapping, Sequence

from .. import _compat

ENV_COORDINATOR = "AXONN_COORDINATOR"
ENV_NUM_PROCESSES = "AXONN_NUM_PROCESSES"
ENV_PROCESS_ID = "AXONN_PROCESS_ID"
ENV_LOCAL_DEVICES = "AXONN_LOCAL_DEVICES"
"""Simulated CPU devices per process (`axonn-jax launch --devices-per-proc`)."""
ENV_HEARTBEAT_TIMEOUT = "AXONN_HEARTBEAT_TIMEOUT"
"""Seconds without a heartbeat after which the job declares a process dead (`axonn-jax launch
--heartbeat-timeout`; JAX's default when unset)."""

MPI_LAUNCHER_VARIABLES = ("PMI_RANK", "PMIX_RANK")
"""Set by MPI launchers (Hydra: MPICH, Intel MPI, MVAPICH; PMIx ones) whose jobs JAX's default
detection does not look for; their grid is read through mpi4py instead."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a job, and where that came from.

    Attributes:
      coordinator: the coordinator's `host:port` (None until known).
      num_processes: the processes in the job.
      process_id: this process's index in [0, num_processes).
      source: where the grid came from ("arguments", "AXONN_*", the name of the cluster JAX
        detected, or "single process").
    """

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str


def _int(environ: Mapping[str, str], name: str) -> int:
    """The integer value of environment variable `name`; a one-line ValueError naming it otherwise."""
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def launcher_grid(environ: Mapping[str, str]) -> ProcessSpec | None:
    """The grid `axonn-jax launch` hands its processes.

    Args:
      environ: the environment to read (`os.environ` in a launched process).

    Returns:
      The grid from `AXONN_COORDINATOR` / `AXONN_NUM_PROCESSES` / `AXONN_PROCESS_ID`, or None when
      none of them is set. Raises ValueError when only some are set or a count is not an integer.
    """
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [name for name in names if name in environ]
    if not present:
        return None
    if len(present) < len(names):
        missing = [name for name in names if name not in environ]
        raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} missing")
    return ProcessSpec(environ[ENV_COORDINATOR], _int(environ, ENV_NUM_PROCESSES),
                       _int(environ, ENV_PROCESS_ID), "AXONN_*")


def cluster_method(environ: Mapping[str, str]) -> str | None:
    """The `cluster_detection_method` of `jax.distributed.initialize` that describes this job.

    Args:
      environ: the environment to read for an MPI launcher's variables (JAX's own detectors read
        `os.environ`).

    Returns:
      The name of the cluster JAX's default detection finds ("slurm", "ompi", ...); "mpi4py" under
      an MPI launcher JAX does not look for; None outside any job. Raises RuntimeError under such a
      launcher when mpi4py is not installed.
    """
    found = _compat.detected_cluster()
    if found is not None or not any(name in environ for name in MPI_LAUNCHER_VARIABLES):
        return found
    if find_spec("mpi4py") is None:
        raise RuntimeError(
            f"launched by mpirun but mpi4py is not installed: install the `mpi` extra, or set "
            f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}")
    return "mpi4py"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (bind to port 0 and let the OS choose).

    Args:
      host: the address to bind.

    Returns:
      The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _given_grid(coordinator: str | None, num_processes: int | None, process_id: int | None,
                environ: Mapping[str, str]) -> ProcessSpec:
    """The grid known before any cluster detection: each argument, else `axonn-jax launch`'s value."""
    launched = launcher_grid(environ)
    if launched is None or None not in (coordinator, num_processes, process_id):
        return ProcessSpec(coordinator, num_processes, process_id, "arguments")
    return ProcessSpec(
        coordinator if coordinator is not None else launched.coordinator,
        num_processes if num_processes is not None else launched.num_processes,
        process_id if process_id is not None else launched.process_id,
        "AXONN_*")


def _check_grid(spec: ProcessSpec) -> None:
    """Raise a one-line ValueError naming the numbers when `spec`'s id lies outside its count."""
    if None in (spec.num_processes, spec.process_id):
        return
    if spec.num_processes < 1 or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(f"process_id {spec.process_id} is not in [0, num_processes="
                         f"{spec.num_processes}) (from {spec.source})")


def _already_joined(spec: ProcessSpec) -> ProcessSpec:
    """The grid this process joined earlier; RuntimeError when `spec`'s known numbers differ."""
    coordinator, count, index = _compat.distributed_grid()
    if spec.num_processes not in (None, count) or spec.process_id not in (None, index):
        raise RuntimeError(f"jax.distributed already initialized as process {index} of {count}, "
                           f"not process {spec.process_id} of {spec.num_processes}")
    return ProcessSpec(coordinator, count, index, spec.source)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None,
                     local_device_ids: Sequence[int] | None = None,
                     local_device_count: int | None = None) -> ProcessSpec:
    """Start JAX's distributed runtime for this process and return the grid it joined.

    Must run before any JAX computation; calling it again with the same grid is a no-op. A job of
    one process starts nothing.

    Args:
      coordinator: `host:port` of process 0's coordinator service; None: from `axonn-jax launch`
        or JAX's cluster detection (see the module docstring).
      num_processes: processes in the job; None: as `coordinator`.
      process_id: this process's index in [0, num_processes); None: as `coordinator`.
      local_device_ids: the accelerators this process drives (passed to JAX); None: all, or under
        SLURM / mpirun the one at the process's local rank (JAX's rule).
      local_device_count: simulated CPU devices of this process (default: `AXONN_LOCAL_DEVICES`).

    Returns:
      The grid: coordinator, process count and id, and where they came from.
    """
    import jax

    from ..mesh import simulate_cpu_devices

    env = os.environ
    if local_device_count is None and ENV_LOCAL_DEVICES in env:
        local_device_count = _int(env, ENV_LOCAL_DEVICES)
    if local_device_count is not None:
        simulate_cpu_devices(local_device_count)

    spec = _given_grid(coordinator, num_processes, process_id, env)
    _check_grid(spec)
    if spec.num_processes == 1:
        return ProcessSpec(spec.coordinator, 1, 0, spec.source)
    # A grid given in full is passed through as it is: JAX's detection would still pick the local
    # devices of a process that `axonn-jax launch` started inside a SLURM step.
    known = None not in (spec.coordinator, spec.num_processes, spec.process_id)
    method = "deactivate" if known else cluster_method(env)
    if method is None and spec.num_processes is None and spec.process_id is None:
        # No job around this process: arguments and JAX_COORDINATOR_ADDRESS alone make no grid.
        if spec.coordinator is not None:
            raise ValueError(f"init_distributed: coordinator {spec.coordinator!r} given without "
                             "num_processes and process_id")
        return ProcessSpec(None, 1, 0, "single process")
    if jax.distributed.is_initialized():
        return _already_joined(spec)
    timeouts = {}
    if ENV_HEARTBEAT_TIMEOUT in env:
        timeouts["heartbeat_timeout_seconds"] = _int(env, ENV_HEARTBEAT_TIMEOUT)
    # JAX's own detection fills in what is still None and checks the numbers it finds; its default
    # order is asked for by None ("deactivate" and "mpi4py" are opt-in).
    jax.distributed.initialize(
        spec.coordinator, spec.num_processes, spec.process_id, local_device_ids=local_device_ids,
        cluster_detection_method=method if method in ("deactivate", "mpi4py") else None, **timeouts)
    return ProcessSpec(*_compat.distributed_grid(), spec.source if known else method or spec.source)


def axes_crossing_processes(mesh) -> list[str]:
    """Mesh axes along which neighbouring devices belong to different processes.

    With `make_mesh`'s layout these are the outer axes (`data`, `pipe`) unless a process holds
    fewer devices than one tensor-parallel group.

    Args:
      mesh: a `jax.sharding.Mesh`.

    Returns:
      The axes' names, in the mesh's order (outer axes first).
    """
    import numpy as np

    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    crossing = []
    for i, name in enumerate(mesh.axis_names):
        if procs.shape[i] > 1 and np.any(np.diff(procs, axis=i) != 0):
            crossing.append(name)
    return crossing
