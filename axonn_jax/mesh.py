"""Building the device mesh, and simulated CPU devices for machines without accelerators."""
from __future__ import annotations

import os
import re
from typing import Sequence

from .config import AXES, ParallelConfig


CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""XLA:CPU runs all simulated devices on one pool of as many threads, and a collective holds its
thread until its whole group arrives: the concurrency-optimized scheduler lets one device start two
independent collectives at once, the pool runs dry and XLA aborts after 40 s ("Termination timeout
... rendezvous"). Without it each device runs its collectives in program order."""


def simulate_cpu_devices(n: int) -> None:
    """Make the CPU backend expose `n` devices.

    It also schedules their collectives so that they never starve each other of threads
    (`CPU_SCHEDULER_FLAG`). Must run before JAX initializes its backends.

    Args:
      n: the number of simulated devices.

    Raises:
      ValueError: `n` is not positive.
      RuntimeError: JAX has already started with a different device count.
    """
    if n < 1:
        raise ValueError(f"--devices must be positive, got {n}")
    flags = os.environ.get("XLA_FLAGS", "")
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    if CPU_SCHEDULER_FLAG.split("=")[0] not in flags:
        flags = f"{flags} {CPU_SCHEDULER_FLAG}"
    os.environ["XLA_FLAGS"] = " ".join(f"{flags} {flag}".split())
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        # The backend has started: fine if it already has the count we want.
        if jax.default_backend() == "cpu" and jax.device_count() != n:
            raise RuntimeError(
                f"JAX already started with {jax.device_count()} devices; cannot switch to {n}. "
                "Simulate devices before any JAX computation."
            ) from None


def use_cpu_platform() -> None:
    """Run JAX on its CPU platform only, unless `JAX_PLATFORMS` names platforms.

    For simulated CPU devices and for compile-only ones (`analysis.targets`), where an installed
    CUDA plugin would otherwise try to start its own backend (and, without a GPU, fail or print a
    traceback). Must run before JAX starts its backends."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")


def make_mesh(config: ParallelConfig, devices: Sequence | None = None):
    """A `jax.sharding.Mesh` of shape `config.shape` with axes `config.AXES`.

    The axes are data, pipe, expert, context, depth, row, col. Devices are laid out in id order
    with the innermost axis (`col`) fastest, so tensor-parallel axes stay inside a process/host
    and `data`/`pipe` span processes. Axes are `Auto` (GSPMD partitions code outside explicit
    shard_maps).

    Args:
      config: the grid.
      devices: the devices to lay out (None: `jax.devices()`); sorted by (process, id).

    Returns:
      mesh (jax.sharding.Mesh): the mesh.

    Raises:
      ValueError: the grid does not use exactly as many devices.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    config.validate(len(devices))
    # Sort by (process, id) so each process owns a contiguous block of the outer axes.
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices, dtype=object).reshape(config.shape), AXES)


def config_of(mesh) -> ParallelConfig:
    """The ParallelConfig a mesh was built from.

    Args:
      mesh: a mesh with axes named as `AXES` (absent axes are 1).

    Returns:
      The `ParallelConfig` of its axis sizes.
    """
    return ParallelConfig(**{name: int(mesh.shape.get(name, 1)) for name in AXES})
