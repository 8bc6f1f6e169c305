"""Models unlike the GPT (tests/user_models.py: a linen ViT on images and labels, an NNX regressor on
sequences) train through every mode of the trainer with their single-device trajectories: data,
2D/3D tensor, pipeline (GPipe, 1F1B), optimizer offload, remat none/full/offload/auto, CGX
compression, bf16/fp16, checkpoints, several processes (`launch`, `mpirun --transport mpi`, the MPI
pipeline); and the README's "Train your own model" example runs as printed."""
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.train import TrainOptions, train

import user_models as um
from conftest import relative_difference
from test_distributed import REPO, _mpirun, child_env, cli, run  # noqa: F401

STEPS = 3
MODELS = {"vit": (um.vit, um.image_batches), "regressor": (um.regressor, um.sequence_batches),
          "vit-take": (lambda: um.vit(take=True), um.image_batches)}


def trajectory(devices, name, grid=None, steps=STEPS, **options):
    """Losses of `steps` steps of model `name` on `grid` (and the run's summary)."""
    grid = ParallelConfig(**(grid or {}))
    make_model, make_data = MODELS[name]
    summary = train(TrainOptions(steps=steps, batch_size=8, lr=1e-2, parallel=grid, **options),
                    model=make_model(), data=make_data(8), devices=devices[:grid.num_devices])
    return [r["loss"] for r in summary["history"]], summary


@pytest.fixture(scope="module")
def reference(devices):
    """Each model's single-device fp32 trajectory (`vit-take` computes `vit`'s loss)."""
    found = {name: trajectory(devices, name)[0] for name in ("vit", "regressor")}
    return {**found, "vit-take": found["vit"]}


# (model, grid, options): every mode, alone and combined as the trainer combines them.
EXACT = [
    ("vit", dict(data=8), {}),
    ("vit", dict(data=2, row=2, col=2), dict(offload_optimizer=True)),
    ("vit", dict(data=2, depth=2, row=2), dict(remat="offload")),
    ("vit", dict(pipe=4, data=2), dict(microbatches=2, schedule="gpipe", remat="full")),
    ("regressor", dict(data=2, row=2, col=2), {}),
    ("regressor", dict(pipe=2, data=2, row=2), dict(microbatches=2, schedule="1f1b",
                                                    offload_optimizer=True)),
    ("regressor", dict(depth=2, data=4), dict(remat="full")),
    # a head picking labels with take_along_axis: XLA's partitioner aborted on its gather with
    # batching dimensions split over two automatic axes (`step.gathers`)
    ("vit-take", dict(data=2, depth=2, row=2), {}),
    ("vit-take", dict(pipe=2, depth=2, row=2), dict(microbatches=2, schedule="gpipe")),
]


@pytest.mark.parametrize("name, grid, options", EXACT,
                         ids=[f"{n}-{'x'.join(f'{k}{v}' for k, v in g.items())}-{'-'.join(o) or 'plain'}"
                              for n, g, o in EXACT])
def test_trajectory_equals_single_device(reference, devices, name, grid, options):
    losses, _ = trajectory(devices, name, grid, **options)
    assert losses[-1] != losses[0]
    assert relative_difference(losses, reference[name]) <= 1e-5


@pytest.mark.parametrize("name, grid, options, bound", [
    ("vit", dict(pipe=2, data=2, row=2), dict(microbatches=2, schedule="1f1b", compress_bits=8), 1e-3),
    ("regressor", dict(data=8), dict(compress_bits=4, error_feedback=False), 3e-2),
])
def test_compressed_trajectory_tracks_exact(reference, devices, name, grid, options, bound):
    losses, summary = trajectory(devices, name, grid, **options)
    assert 0 < relative_difference(losses, reference[name]) <= bound
    if options.get("error_feedback", True):  # each device's residual, split like its parameter
        residual = jax.tree.leaves(summary["state"].reducer)
        assert residual and all(r.shape[0] == grid["data"] for r in residual)


@pytest.mark.parametrize("name, dtype, options", [
    ("vit", "bfloat16", dict(offload_optimizer=True)), ("regressor", "float16", {})])
def test_mixed_precision_tensor_parallel_tracks_one_device(devices, name, dtype, options):
    one, _ = trajectory(devices, name, dtype=dtype)
    tp, summary = trajectory(devices, name, dict(data=2, row=2, col=2), dtype=dtype, **options)
    assert relative_difference(tp, one) <= 5e-3  # below one bf16 ulp (2^-7)
    assert summary["history"][-1]["skipped_steps"] == 0


def test_activation_planner_and_resume(reference, devices, tmp_path):
    """`remat='auto'` plans a user's blocks within the budget (the trajectory is unchanged), and a
    stopped run resumes from its checkpoint with the same losses."""
    _, summary = trajectory(devices, "vit", remat="auto", memory_budget_gb=0.1, steps=1)
    plan = summary["trainer"].bound.plan
    assert plan is not None and plan.predicted_peak <= 0.1e9
    common = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    first, _ = trajectory(devices, "regressor", dict(data=4), stop_at=2, **common)
    rest, _ = trajectory(devices, "regressor", dict(data=4), resume=True, **common)
    assert relative_difference(first + rest, reference["regressor"]) <= 1e-5


def _losses(path):
    return [json.loads(line)["loss"] for line in pathlib.Path(path).read_text().splitlines()]


SCRIPT = str(pathlib.Path(__file__).parent / "user_train.py")


@pytest.mark.parametrize("name, grid, transport", [
    ("vit", "data=2,row=2,col=2", "launch"),
    ("regressor", "data=1", "mpirun"),
    ("regressor", "pipe=2", "mpirun"),
])
def test_user_script_in_several_processes(reference, tmp_path, name, grid, transport):
    """A user's training script as 2 processes: `axonn-jax launch` (one grid over both processes'
    devices), `mpirun` with `--transport mpi` (gradients over MPI), and the MPI pipeline."""
    metrics = tmp_path / "m.jsonl"
    args = [SCRIPT, name, grid, "--metrics-out", str(metrics)]
    if transport == "launch":
        run(cli("launch", "--nprocs", "2", "--devices-per-proc", "4", "--log-dir",
                str(tmp_path / "logs"), "--", *args))
    else:
        mpirun = _mpirun()
        assert mpirun, "mpirun not found next to this Python: install the `mpi` extra"
        extra = ["--microbatches", "2"] if "pipe" in grid else []
        run([mpirun, "-n", "2", sys.executable, *args, "--transport", "mpi", *extra])
    assert relative_difference(_losses(metrics), reference[name]) <= 1e-5


def run_readme_code(section: str, tmp_path, check: str = "") -> str:
    """The first Python block after README heading `section`, as printed (then `check`), in a
    fresh interpreter; returns its output."""
    readme = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme.split(section, 1)[1], re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code + check)
    env = child_env()
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_simulating_devices_turns_off_the_starving_scheduler(monkeypatch):
    from axonn_jax.mesh import CPU_SCHEDULER_FLAG, simulate_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    simulate_cpu_devices(8)  # JAX runs with 8 already: only the environment changes
    assert CPU_SCHEDULER_FLAG in os.environ["XLA_FLAGS"].split()


def test_pipeline_and_tensor_grid_on_exactly_its_simulated_devices(reference, tmp_path):
    """A data × pipe × row grid on exactly 8 simulated devices, in a child process whose
    environment does not turn off XLA:CPU's concurrency-optimized scheduler: under it such runs
    aborted now and then ("Termination timeout ... rendezvous": a pool of 8 threads for 8 devices,
    and a device holding two collectives at once), so `simulate_cpu_devices` turns it off
    (`mesh.CPU_SCHEDULER_FLAG`); the run trains like one device."""
    from axonn_jax.mesh import CPU_SCHEDULER_FLAG

    env = child_env()
    name = CPU_SCHEDULER_FLAG.split("=")[0]
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if not f.startswith(name))
    env["AXONN_LOCAL_DEVICES"] = "8"  # init_distributed simulates them
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, str(REPO / "tests" / "user_train.py"), "vit",
                          "data=2,pipe=2,row=2", "--microbatches", "2", "--metrics-out",
                          str(metrics)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert relative_difference(_losses(metrics), reference["vit"]) <= 1e-5


def test_sixteen_devices_four_axes_equal_one_device(reference, tmp_path):
    """A user's ViT on 16 simulated devices in a child process, data × pipe × depth × row all 2
    (1F1B): the single device's trajectory."""
    env = child_env()
    env["AXONN_LOCAL_DEVICES"] = "16"
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, str(REPO / "tests" / "user_train.py"), "vit",
                          "data=2,pipe=2,depth=2,row=2", "--microbatches", "2", "--metrics-out",
                          str(metrics)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert relative_difference(_losses(metrics), reference["vit"]) <= 1e-5


def test_readme_example_runs(tmp_path):
    """The README's "Train your own model" example, as printed, in a fresh interpreter."""
    out = run_readme_code("## Train your own model", tmp_path)
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) >= 2 and np.isfinite(losses).all() and losses[-1] < losses[0]


SHARDED = """
leaves = jax.tree.leaves(variables)
split = [x for x in leaves if x.addressable_shards[0].data.size < x.size]
assert all(len(x.sharding.device_set) == 8 for x in leaves)
print(f"split {len(split)} of {len(leaves)}")
"""


def test_readme_python_snippet_runs_and_creates_sharded_parameters(tmp_path):
    """The README's "Python" snippet on CPU as pasted: the parameters are created on all 8
    devices, the matrices split (not built on one device), and the trainer learns."""
    out = run_readme_code("## Python", tmp_path, SHARDED)
    first, last = map(float, re.search(r"^loss (\S+) -> (\S+)$", out, re.M).groups())
    assert last < first
    split, total = map(int, re.search(r"^split (\d+) of (\d+)$", out, re.M).groups())
    assert split >= 8  # every block's four dense kernels at least


def test_unbatched_gathers_compute_the_same():
    """`step.gathers.unbatched_gathers`: `take_along_axis` (also inside a scan) without batching
    dimensions in its gathers, with the same values and gradients."""
    import jax.numpy as jnp

    from axonn_jax.step.gathers import has_batched_gather, unbatched_gathers

    def f(x, i):
        def layer(h, _):
            return h * jnp.take_along_axis(h, i, axis=1).mean(), None
        y = jax.lax.scan(layer, x, None, length=2)[0]
        return jnp.sum(jnp.take_along_axis(y, i, axis=1) ** 2)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    i = jnp.asarray(rng.integers(0, 6, (4, 3)), jnp.int32)
    assert has_batched_gather(jax.make_jaxpr(f)(x, i).jaxpr)
    assert not has_batched_gather(jax.make_jaxpr(unbatched_gathers(f))(x, i).jaxpr)
    want = jax.value_and_grad(f)(x, i)
    got = jax.value_and_grad(unbatched_gathers(f))(x, i)
    assert relative_difference(got[0], want[0]) <= 1e-6
    assert relative_difference(got[1], want[1]) <= 1e-6
