"""Models unlike the GPT (tests/user_models.py: a linen ViT on images and labels, an NNX regressor on
sequences) train through every mode of the trainer with their single-device trajectories: data,
2D/3D tensor, pipeline (GPipe, 1F1B), optimizer offload, remat none/full/offload/auto, CGX
compression, bf16/fp16, checkpoints, several processes (`launch`, `mpirun --transport mpi`, the MPI
pipeline); and the documentation's examples (docs/train-your-own-model.md, docs/quickstart.md,
the README's) run as printed."""
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
from conftest import (COMPRESSED, assert_learns, assert_states_match, assert_steps_match,
                      comparable_state, field, metrics_file, relative_difference,
                      state_tolerances)
from test_distributed import REPO, _mpirun, child_env, cli, run  # noqa: F401

# Models that compute another's loss, and that model.
SAME_AS = {"vit-take": "vit"}


def trajectory(devices, name, grid=None, **options):
    """`steps` steps of model `name` on `grid` (um.setup's data and options, overridden by
    `options`): the summary's `history`, `state` (`comparable_state`) and `summary`."""
    grid = ParallelConfig(**(grid or {}))
    model, data, common = um.setup(name)
    summary = train(TrainOptions(**{**common, **options}, parallel=grid), model=model, data=data,
                    devices=devices[:grid.num_devices])
    return {"name": name, "history": summary["history"], "summary": summary,
            "state": comparable_state(summary["trainer"], summary["state"])}


# Losses and gradient norms of fp32 runs, relative: the ViT at lr 1e-2 turns rounding differences
# into Adam steps that show in its loss after two updates (measured up to 2.3e-5; the bound leaves
# room for XLA:CPU's run-to-run variation, see conftest.FP32).
RTOL = {"vit": 1e-4, "regressor": 1e-5}


def assert_trains_like(got, ref, rtol=None, state=None):
    """The same loss and gradient norm at every step (within `rtol`, default RTOL), the same final
    state leaf by leaf (tolerances `state`, default: those of `got`'s dtype, `state_tolerances`)."""
    rtol = rtol or RTOL[SAME_AS.get(got["name"], got["name"])]
    diff = assert_steps_match(got["history"], ref["history"], rtol)
    state = state or state_tolerances(got["summary"]["trainer"].options.precision.dtype)
    assert_states_match(got["state"], ref["state"], **state)
    return diff


# The loss of the repeated batch after two updates, at most this fraction of the first (measured
# 0.24 for the ViT, 0.32 for the regressor).
LEARNS = {"vit": 0.5, "regressor": 0.6}


@pytest.fixture(scope="module")
def reference(devices):
    """Each model's single-device trajectories (computed when first asked for), by dtype
    (`vit-take` computes `vit`'s loss: its reference is `vit`'s)."""
    cache = {}

    def get(name, dtype="float32"):
        name = SAME_AS.get(name, name)
        if (name, dtype) not in cache:
            cache[name, dtype] = ref = trajectory(devices, name, dtype=dtype)
            assert_learns(ref["history"], LEARNS[name])  # the same batch, 2 updates later
            if name == "vit":
                assert min(r["grad_norm"] for r in ref["history"]) > 1.0  # clipping fires
        return cache[name, dtype]

    return get


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
    assert_trains_like(trajectory(devices, name, grid, **options), reference(name))


# Losses and gradient norms within `bound` (measured: 1.7e-3 and 2.4e-3 at 8 bits; 7.0e-2 and
# 3.2e-2 at 4 bits with stochastic rounding and no error feedback).
@pytest.mark.parametrize("name, grid, options, bound", [
    ("vit", dict(pipe=2, data=2, row=2), dict(microbatches=2, schedule="1f1b", compress_bits=8), 5e-3),
    ("regressor", dict(data=8), dict(compress_bits=4, error_feedback=False), 0.15),
])
def test_compressed_trajectory_tracks_exact(reference, devices, name, grid, options, bound):
    got = trajectory(devices, name, grid, **options)
    assert 0 < assert_trains_like(got, reference(name), bound, COMPRESSED)
    if options.get("error_feedback", True):  # each device's residual, split like its parameter
        residual = jax.tree.leaves(field(got["summary"]["state"], "reducer"))
        assert residual and all(r.shape[0] == grid["data"] for r in residual)


# (model, dtype, options, bound of the losses and gradient norms): bf16 within the mode matrix's
# 16-bit gradient-norm bound (the norm drifts with the grid's sum order over the three steps),
# fp16 within a few fp16 ulps (2^-11).
MIXED = [("vit", "bfloat16", dict(offload_optimizer=True), 2e-2),
         ("regressor", "float16", {}, 2e-3)]


@pytest.mark.parametrize("name, dtype, options, bound", MIXED, ids=[m[1] for m in MIXED])
def test_mixed_precision_tensor_parallel_tracks_one_device(reference, devices, name, dtype,
                                                           options, bound):
    got = trajectory(devices, name, dict(data=2, row=2, col=2), dtype=dtype, **options)
    assert_trains_like(got, reference(name, dtype), bound)
    assert got["summary"]["history"][-1]["skipped_steps"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_planner_keeps_the_trajectory(reference, devices, dtype):
    """`remat='auto'` plans a user's blocks within a budget below what keeping every activation
    needs (measured: 1.09 MB fp32, 1.16 MB bf16; the plan offloads the first block), and trains as
    one device does without remat (fp32, and bf16: the planner measures the block in the compute
    dtype; the ViT's blocks return fp32, which the step casts back). The swapped block sends the
    stack through the hand-written layer backward (`ComputeFunctions.fetch_ahead`), another
    program than the reference's autodiff scan: bf16 within the mode matrix's 16-bit bound
    (measured 1.2e-3 on the loss)."""
    budget = 1e-3
    got = trajectory(devices, "vit", remat="auto", memory_budget_gb=budget, dtype=dtype)
    plan = got["summary"]["trainer"].bound.plan
    assert plan.predicted_peak <= budget * 1e9 and set(plan.decisions) != {"keep"}, plan
    assert got["summary"]["trainer"].bound.compute.fetch_ahead == ("offload" in plan.decisions)
    assert_trains_like(got, reference("vit", dtype), None if dtype == "float32" else 1e-2)


def test_stopped_run_resumes_with_the_same_trajectory(reference, devices, tmp_path):
    common = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1)
    first = trajectory(devices, "regressor", dict(data=4), stop_at=2, **common)
    rest = trajectory(devices, "regressor", dict(data=4), resume=True, **common)
    assert_trains_like({**rest, "history": first["history"] + rest["history"]},
                       reference("regressor"))


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
    assert_steps_match(metrics_file(metrics), reference(name)["history"], RTOL[name])


def python_block(page: str, section: str) -> str:
    """The first Python block after heading `section` of `page` (a path from the repository root),
    as printed."""
    text = (REPO / page).read_text()
    return re.search(r"```python\n(.*?)```", text.split(section, 1)[1], re.S).group(1)


def run_doc_code(page: str, section: str, tmp_path, check: str = "") -> str:
    """The first Python block after heading `section` of the documentation page `page`, as
    printed (then `check`), in a fresh interpreter; returns its output."""
    code = python_block(page, section)
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


def assert_vit_script_trains_like_one_device(reference, tmp_path, env, devices, grid):
    """tests/user_train.py's ViT on `grid` (1F1B, 2 microbatches) in a child process with `env`
    simulating `devices` devices: the single device's trajectory."""
    env["AXONN_LOCAL_DEVICES"] = str(devices)  # init_distributed simulates them
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, str(REPO / "tests" / "user_train.py"), "vit", grid,
                          "--microbatches", "2", "--metrics-out", str(metrics)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_steps_match(metrics_file(metrics), reference("vit")["history"], RTOL["vit"])


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
    assert_vit_script_trains_like_one_device(reference, tmp_path, env, 8, "data=2,pipe=2,row=2")


def test_sixteen_devices_four_axes_equal_one_device(reference, tmp_path):
    """A user's ViT on 16 simulated devices, data × pipe × depth × row all 2."""
    assert_vit_script_trains_like_one_device(reference, tmp_path, child_env(), 16,
                                             "data=2,pipe=2,depth=2,row=2")


def test_readme_example_runs(tmp_path):
    """The "Train your own model" example of the documentation, as printed, in a fresh
    interpreter."""
    out = run_doc_code("docs/train-your-own-model.md", "# Train your own model", tmp_path)
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\d+\.\d+)$", out, re.M)]
    assert len(losses) >= 2 and np.isfinite(losses).all() and losses[-1] < losses[0]


SHARDED = """
leaves = jax.tree.leaves(variables)
split = [x for x in leaves if x.addressable_shards[0].data.size < x.size]
assert all(len(x.sharding.device_set) == 8 for x in leaves)
print(f"split {len(split)} of {len(leaves)}")
"""


def test_readme_example_is_the_quickstart_snippet():
    """The README's example is the quickstart page's "Python" snippet, which the next test runs."""
    assert python_block("README.md", "## Example") == python_block("docs/quickstart.md", "## Python")


def test_readme_python_snippet_runs_and_creates_sharded_parameters(tmp_path):
    """The quickstart's "Python" snippet (the README's example) on CPU as pasted: the parameters
    are created on all 8 devices, the matrices split (not built on one device), and the trainer
    learns."""
    out = run_doc_code("docs/quickstart.md", "## Python", tmp_path, SHARDED)
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
