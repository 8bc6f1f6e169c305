"""Every test runs on 8 simulated CPU devices; set before JAX starts."""
import atexit
import os
import shutil
import tempfile

# LLVM optimization level 0 halves XLA:CPU's compile time, most of a tiny test's time; losses
# agree with the default level's to ~1e-7. The scheduler flag keeps the simulated devices'
# collectives from starving each other of threads (`axonn_jax.mesh.CPU_SCHEDULER_FLAG`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Default run directories of CLI runs (and of their child processes) go to a temporary folder, not
# into the checkout.
if "AXONN_RUNS" not in os.environ:
    os.environ["AXONN_RUNS"] = tempfile.mkdtemp(prefix="axonn-runs-")
    atexit.register(shutil.rmtree, os.environ["AXONN_RUNS"], True)
# One persistent compilation cache for the whole run: both pytest-xdist workers and every child
# process (a resumed job, a second launch of the same grid, a reference computed in several
# files) load what another compiled instead of compiling it again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="axonn-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests need 8 simulated devices, JAX sees {len(devs)}"
    return devs


def relative_difference(a, b):
    """max |a - b| / max |b| over arrays or sequences of numbers."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def lm_batch(trainer, tokens, step, seed_offset=0):
    """Language-model batch `step` of `tokens` for `trainer`'s options, placed on its devices."""
    from axonn_jax.run.data import lm_batch as make

    o = trainer.options
    return trainer.place(make(tokens, o.run.seed + seed_offset, step, o.data.batch_size,
                              o.data.seq_len))


def preset_trajectory(devices, family, name, grid=None, steps=3, **options):
    """Losses of `steps` steps of preset `name` of the model module `family` (`models.unet`,
    `models.resnet`: `PRESETS`, `stacked(config)`, `config.batches`) on its own drawn data, no
    validation, on `grid` (a dict of ParallelConfig sizes; default one device)."""
    from axonn_jax import ParallelConfig
    from axonn_jax.train import TrainOptions, train

    grid, config = ParallelConfig(**(grid or {})), family.PRESETS[name]
    summary = train(TrainOptions(steps=steps, batch_size=8, lr=1e-2, parallel=grid, **options),
                    model=family.stacked(config), data=config.batches(0, 8),
                    devices=devices[:grid.num_devices])
    return [r["loss"] for r in summary["history"]]
