"""Multi-process training: `axonn-jax launch` (jax.distributed + gloo) and `mpirun` + mpi4jax give the
single-process trajectory; a killed process stops the job; process grids from the environment."""
import atexit
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from axonn_jax import ParallelConfig, make_mesh
from axonn_jax.run.distributed import (ENV_HEARTBEAT_TIMEOUT, ProcessSpec, axes_crossing_processes,
                                       cluster_method, init_distributed, launcher_grid)
from axonn_jax.train import TrainOptions, train

from conftest import (PARITY, assert_states_match, assert_steps_match, comparable_state,
                      metrics_file)

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4


def _fixed_corpus() -> str:
    """A corpus that no commit changes, written once per test process: 300,000 words drawn with
    Zipf-like frequencies from 2,000 made-up words by a seeded legacy `RandomState` (stable across
    numpy versions). The package's own sources served before; every edit of the package then
    moved the trajectories that the quantized exchanges are held to within tight bounds."""
    rng = np.random.RandomState(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, size=rng.randint(1, 9))) for _ in range(2000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    picks = rng.choice(len(words), size=300_000, p=weights / weights.sum())
    lines = [" ".join(words[i] for i in picks[k:k + 12]) for k in range(0, len(picks), 12)]
    root = pathlib.Path(tempfile.mkdtemp(prefix="axonn-corpus-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    return str(root / "corpus.txt")


DATA = _fixed_corpus()
# Warm-up off (every step a real update); the default clip_norm = 1 clips.
RUN = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "16", "--eval-batches", "1",
       "--eval-every", "1000", "--data", DATA, "--warmup-steps", str(PARITY["warmup_steps"])]


def child_env():
    """The test's environment minus its 8-device XLA flag, with this checkout and the venv's
    executables (mpirun) first."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    # (conftest's flags keep LLVM optimization level 0 and the run's compilation cache)
    env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                 if not f.startswith("--xla_force_host_platform_device_count")])
    # JAX's 100 s heartbeat deadline is not a property under test here (test_long_jobs sets its
    # own): on CI's two cores, four compiling processes beside the other pytest worker have gone
    # 100 s without a heartbeat. A process that hangs still fails the test at `run`'s timeout.
    env.setdefault(ENV_HEARTBEAT_TIMEOUT, "280")
    return env


def cli(*args):
    return [sys.executable, "-m", "axonn_jax", *args]


def run(cmd, timeout=300):
    result = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _grid_size(grid_flags):
    return math.prod(int(v) for v in grid_flags[1::2])


def _mpirun():
    return shutil.which("mpirun", path=child_env()["PATH"])


def steps_of(path):
    """The per-step records of a metrics file, checked to hold steps 1..STEPS once each."""
    records = metrics_file(path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


@pytest.fixture(scope="module")
def reference(devices):
    """The single-process run on 8 devices: its summary (`history`, `state`, `trainer`)."""
    summary = train(TrainOptions(steps=STEPS, batch_size=8, seq_len=16, eval_batches=1,
                                 eval_every=1000, data_path=DATA, parallel=ParallelConfig(data=8),
                                 **PARITY), devices=devices)
    assert min(r["grad_norm"] for r in summary["history"]) > 1.0  # clipped at every step
    return summary


def assert_checkpoint_matches(reference, directory):
    """The newest checkpoint in `directory` holds the reference run's final state, leaf by leaf."""
    trainer = reference["trainer"]
    restored = trainer.make_checkpointer(str(directory), 0).restore(trainer.init_state())
    assert_states_match(comparable_state(trainer, restored),
                        comparable_state(trainer, reference["state"]))


# Data, tensor (inside each process, data across) and pipeline grids (stages across processes):
# every grid must reproduce the single-process trajectory.
@pytest.mark.parametrize("nprocs, per_proc, grid", [
    (2, 4, []), (2, 4, ["--row", "2", "--col", "2"]), (4, 2, ["--pipe", "2"])])
def test_launch_equals_single_process(nprocs, per_proc, grid, reference, tmp_path):
    metrics = tmp_path / "m.jsonl"
    launch = cli("launch", "--nprocs", str(nprocs), "--devices-per-proc", str(per_proc),
                 "--log-dir", str(tmp_path / "logs"), "--")
    train_args = ["train", *RUN, *grid, "--metrics-out", str(metrics)]
    if not grid:
        # Cooperative orbax checkpoint: stop after 2 steps, resume in a fresh job for the rest.
        ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
        run(launch + train_args + ckpt + ["--stop-at", "2"])
        assert (tmp_path / "ckpt" / "2").is_dir()
        # The second job starts under mpirun where there is one: init_distributed then finds the
        # grid in MPICH's / Open MPI's variables and agrees on a coordinator over mpi4py.
        mpirun = _mpirun()
        relaunch = [mpirun, "-n", "2", *cli()] if mpirun else launch
        out = run(relaunch + train_args + ckpt + ["--resume", "--devices", str(per_proc)]).stdout
        assert "resumed from step 2" in out
    else:
        out = run(launch + train_args).stdout
    assert f"data={nprocs * per_proc // _grid_size(grid)} " in out  # one grid over all processes
    assert_steps_match(steps_of(metrics), reference["history"])
    if not grid:
        assert_checkpoint_matches(reference, tmp_path / "ckpt")
    # Process 0 alone writes the metrics and the progress; the others' logs hold no progress bar.
    assert "train ━" in (tmp_path / "logs" / "proc0.log").read_text()
    assert "train ━" not in (tmp_path / "logs" / "proc1.log").read_text()


def test_sixteen_devices_four_axes_equal_one_process(reference, tmp_path):
    """GPT on 16 simulated devices in a child process, data × pipe × depth × row all 2 (1F1B, 2
    microbatches): the 8-device single-process run's trajectory (which equals one device's,
    `tests/test_train.py`). The child simulates the devices the way the CLI does
    (`mesh.simulate_cpu_devices`, with XLA:CPU's concurrency-optimized scheduler off)."""
    metrics = tmp_path / "m.jsonl"
    out = run(cli("train", *RUN, "--devices", "16", "--dp", "2", "--pipe", "2", "--depth", "2",
                  "--row", "2", "--microbatches", "2", "--schedule", "1f1b", "--metrics-out",
                  str(metrics), "--run-dir", str(tmp_path / "run")), timeout=600).stdout
    assert "data=2 pipe=2" in out and "depth=2 row=2" in out, out[-2000:]
    assert_steps_match(steps_of(metrics), reference["history"])


@pytest.mark.parametrize("nprocs, per_proc", [(2, 4), (4, 2)])
def test_mpirun_transport_equals_single_process(nprocs, per_proc, reference, tmp_path):
    import mpi4jax  # noqa: F401  (`make test` installs the `mpi` extra: its absence is a failure)

    mpirun = _mpirun()
    assert mpirun, "mpirun not found next to this Python: install the `mpi` extra (make test does)"
    metrics = tmp_path / "m.jsonl"
    job = [mpirun, "-n", str(nprocs), *cli("train", *RUN, "--transport", "mpi", "--devices",
                                           str(per_proc), "--metrics-out", str(metrics),
                                           "--dump-hlo", str(tmp_path / "hlo"))]
    if nprocs == 2:
        # Rank 0 writes the checkpoint, every rank reads it.
        ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
        run(job + ckpt + ["--stop-at", "2"])
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2"]
        out = run(job + ckpt + ["--resume"]).stdout
        assert "resumed from step 2" in out
    else:
        out = run(job).stdout
    assert f"data={per_proc} " in out  # the local grid; processes meet only through MPI
    assert_steps_match(steps_of(metrics), reference["history"])
    if nprocs == 2:
        assert_checkpoint_matches(reference, tmp_path / "ckpt")
    hlo = (tmp_path / "hlo" / "train_step.hlo.txt").read_text()
    # The whole gradient pytree in one message, and the loss in another.
    assert hlo.count("mpi_allreduce") == 2


def _mpi_wire_bytes(hlo_text: str, nprocs: int) -> dict[str, float]:
    """Bytes one process sends through each mpi4jax collective of a program (ring algorithms:
    allreduce 2(n-1)/n of the buffer, alltoall and allgather (n-1)/n of the full result)."""
    import re

    from axonn_jax.analysis.hlo_module import array_bytes

    out, seen = {}, set()
    for name, shape, kind in re.findall(r"%(\S+) = \((\w+\[[0-9,]*\])[^)]*\) custom-call\(.*?"
                                        r"custom_call_target=\"mpi_(\w+?)_ffi\"", hlo_text):
        if name in seen:
            continue
        seen.add(name)
        factor = 2 * (nprocs - 1) / nprocs if kind == "allreduce" else (nprocs - 1) / nprocs
        out[kind] = out.get(kind, 0.0) + factor * array_bytes(shape)[0]
    return out


def test_mpirun_compressed_exchange(reference, tmp_path):
    """`--transport mpi --compress-bits`: CGX's all-reduce between processes over mpi4jax. 8 bits
    with error feedback track the exact single-process trajectory; 4 bits (stochastic rounding)
    send at most a sixth of the exact exchange's bytes."""
    import mpi4jax  # noqa: F401

    mpirun = _mpirun()
    assert mpirun, "mpirun not found next to this Python: install the `mpi` extra (make test does)"
    found = {}
    for bits, extra in ((8, []), (4, ["--no-error-feedback"])):
        metrics, hlo = tmp_path / f"m{bits}.jsonl", tmp_path / f"hlo{bits}"
        run([mpirun, "-n", "2", *cli("train", *RUN, "--transport", "mpi", "--devices", "4",
                                     "--compress-bits", str(bits), *extra, "--metrics-out",
                                     str(metrics), "--dump-hlo", str(hlo))])
        found[bits] = (steps_of(metrics),
                       _mpi_wire_bytes((hlo / "train_step.hlo.txt").read_text(), 2))
    # Losses and gradient norms, measured (AXONN_TEST_MEASURE): 6.5e-4 and 1.6e-3 at 8 bits
    # (buckets quantized in steps of range/255, error feedback); 1.9e-2 and 0.14 at 4 bits with
    # stochastic rounding and no feedback, whose noise adds to the gradients' norm (the exact
    # exchange: 1e-7).
    assert 0 < assert_steps_match(found[8][0], reference["history"], 5e-3, 5e-3)
    assert_steps_match(found[4][0], reference["history"], 6e-2, 0.6)
    sent = found[4][1]
    assert sent["alltoall"] > 0 and sent["allgather"] > 0
    num_params = 141_056  # gpt-tiny; the exact exchange allreduces them and the loss as fp32
    exact = 2 * (2 - 1) / 2 * 4 * (num_params + 1)
    assert sum(sent.values()) <= exact / 6, (sent, exact)
    for bits in (8, 4):
        assert len(found[bits][0]) == STEPS and found[bits][1]["allreduce"] < 0.1 * exact


def test_mpirun_error_feedback_residuals_are_checkpointed(tmp_path):
    """`--transport mpi --compress-bits` with error feedback: each process's residual is saved (rank
    0 gathers them), and a run resumed from step 2 repeats the uninterrupted run's steps 3 and 4."""
    import mpi4jax  # noqa: F401

    mpirun = _mpirun()
    ckpt, whole, rest = tmp_path / "ckpt", tmp_path / "whole.jsonl", tmp_path / "rest.jsonl"
    job = [mpirun, "-n", "2", *cli("train", *RUN, "--transport", "mpi", "--devices", "1",
                                   "--compress-bits", "4", "--checkpoint-dir", str(ckpt))]
    run(job + ["--checkpoint-every", "2", "--metrics-out", str(whole)])
    shutil.rmtree(ckpt / "4")
    out = run(job + ["--resume", "--metrics-out", str(rest)]).stdout
    assert "resumed from step 2" in out
    assert_steps_match(metrics_file(rest), steps_of(whole)[2:], 1e-6)


def test_killed_process_stops_the_job_quickly(tmp_path):
    logs = tmp_path / "logs"
    cmd = cli("launch", "--nprocs", "2", "--devices-per-proc", "1", "--log-dir", str(logs), "--",
              "train", "--steps", "100000", "--batch-size", "2", "--seq-len", "16",
              "--eval-batches", "1", "--eval-every", "100000", "--data", DATA)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 240
            # Kill once the processes are connected (their first collective has run).
            while "[Gloo]" not in _read(logs / "proc1.log"):
                assert launcher.poll() is None, _read(tmp_path / "err")
                assert time.monotonic() < deadline, "the processes never connected"
                time.sleep(0.5)
            pids = json.loads((logs / "launch.json").read_text())["pids"]
            os.kill(pids[1], signal.SIGKILL)
            killed = time.monotonic()
            rc = launcher.wait(timeout=60)
            elapsed = time.monotonic() - killed
        finally:
            if launcher.poll() is None:
                launcher.kill()
    assert rc == 128 + signal.SIGKILL
    assert elapsed < 60
    assert "process 1 was killed by signal SIGKILL; stopped the other processes" in _read(tmp_path / "err")
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_long_job(logs):
    """A launcher of a 2-process job that trains for a long time, started with SIGINT ignored, as
    a shell's background job is (its Ctrl-C must work all the same). Returns (launcher, pids)."""
    command = cli("launch", "--nprocs", "2", "--log-dir", str(logs), "--",
                  "train", "--steps", "100000", "--data", DATA)
    # `trap '' INT` ignores SIGINT, and exec keeps it ignored in the launcher.
    launcher = subprocess.Popen(["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command],
                                cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (logs / "launch.json").exists():
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return launcher, json.loads((logs / "launch.json").read_text())["pids"]


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for pid in alive:  # never leave a stray job eating the machine's cores
        os.kill(pid, signal.SIGKILL)
    return alive


def test_ctrl_c_stops_all(tmp_path):
    launcher, pids = _start_long_job(tmp_path / "logs")
    try:
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 130
    finally:
        if launcher.poll() is None:
            launcher.kill()
        alive = _wait_gone(pids, 5)
    assert "interrupted; stopped all processes" in launcher.stderr.read()
    assert not alive


def test_killed_launcher_takes_its_processes_with_it(tmp_path):
    """SIGKILL cannot be caught, so the launcher cannot stop its job: its processes follow it."""
    launcher, pids = _start_long_job(tmp_path / "logs")
    launcher.kill()
    launcher.wait()
    assert not _wait_gone(pids, 10)


def _read(path):
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def test_failing_process_reports_its_error(tmp_path):
    result = subprocess.run(cli("launch", "--nprocs", "2", "--log-dir", str(tmp_path), "--",
                                "train", "--model", "no-such-model"),
                            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "exited with code 2" in result.stderr
    assert "invalid choice: 'no-such-model'" in result.stderr  # the tail of the failing log


@pytest.mark.parametrize("argv, message", [
    (["--nprocs", "0", "--", "train"], "--nprocs must be positive, got 0"),
    (["--nprocs", "2", "--devices-per-proc", "0", "--", "train"], "--devices-per-proc must be positive"),
    (["--nprocs", "2"], "nothing to launch"),
])
def test_launch_bad_input(argv, message, tmp_path, capsys):
    from axonn_jax.run.cli import main

    assert main(["launch", "--log-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"AXONN_COORDINATOR": "h:1", "AXONN_NUM_PROCESSES": "4", "AXONN_PROCESS_ID": "3"},
     ProcessSpec("h:1", 4, 3, "AXONN_*")),
    # The launcher's variables are read whatever scheduler started the launcher.
    ({"AXONN_COORDINATOR": "h:1", "AXONN_NUM_PROCESSES": "2", "AXONN_PROCESS_ID": "1",
      "PMI_SIZE": "4", "PMI_RANK": "3"}, ProcessSpec("h:1", 2, 1, "AXONN_*")),
])
def test_launcher_grid(env, expected):
    assert launcher_grid(env) == expected


@pytest.mark.parametrize("env, message", [
    ({"AXONN_COORDINATOR": "h:1", "AXONN_PROCESS_ID": "0"}, "AXONN_NUM_PROCESSES missing"),
    ({"AXONN_COORDINATOR": "h:1", "AXONN_NUM_PROCESSES": "two", "AXONN_PROCESS_ID": "0"},
     "AXONN_NUM_PROCESSES='two' is not an integer"),
])
def test_launcher_grid_bad_environment(env, message):
    with pytest.raises(ValueError, match=message):
        launcher_grid(env)


# The variables JAX's cluster detectors and MPI launchers look at, cleared before each case.
CLUSTER_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                     "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE",
                     "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_VERSION",
                     "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "KUBERNETES_SERVICE_HOST",
                     "JAX_COORDINATOR_ADDRESS")


@pytest.fixture
def no_cluster(monkeypatch):
    """os.environ without any cluster's or launcher's variables."""
    for name in CLUSTER_VARIABLES + ("AXONN_COORDINATOR", "AXONN_NUM_PROCESSES", "AXONN_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, method", [
    ({}, None),
    ({"SLURM_JOB_ID": "100", "SLURM_STEP_NODELIST": "gpu[007-010]", "SLURM_NTASKS": "8",
      "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}, "slurm"),
    ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:58000", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "ompi"),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "mpi4py"),  # MPICH's mpirun: JAX's opt-in method
])
def test_jax_detects_the_cluster(env, method, no_cluster):
    from importlib.util import find_spec

    for name, value in env.items():
        no_cluster.setenv(name, value)
    if method == "mpi4py" and find_spec("mpi4py") is None:
        with pytest.raises(RuntimeError, match="mpi4py is not installed"):
            cluster_method(os.environ)
    else:
        assert cluster_method(os.environ) == method


def test_slurm_grid_is_jax_s(no_cluster):
    """Under a SLURM step the grid is JAX's reading of it (the node list parsed by JAX)."""
    from jax._src.clusters import SlurmCluster

    for name, value in {"SLURM_JOB_ID": "100", "SLURM_STEP_NODELIST": "gpu[007-010,12],cpu1",
                        "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}.items():
        no_cluster.setenv(name, value)
    assert SlurmCluster.get_coordinator_address(None, None).startswith("gpu007:")
    assert (SlurmCluster.get_process_count(), SlurmCluster.get_process_id()) == (8, 5)


def test_init_distributed_checks_the_grid(no_cluster):
    assert init_distributed() == ProcessSpec(None, 1, 0, "single process")
    with pytest.raises(ValueError, match=r"process_id 4 is not in \[0, num_processes=4\)"):
        init_distributed("h:1", 4, 4)
    with pytest.raises(ValueError, match="coordinator 'h:1' given without num_processes"):
        init_distributed("h:1")
    no_cluster.setenv("AXONN_COORDINATOR", "h:1")
    no_cluster.setenv("AXONN_NUM_PROCESSES", "2")
    no_cluster.setenv("AXONN_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"process_id 2 is not in \[0, num_processes=2\) "
                                         r"\(from AXONN_\*\)"):
        init_distributed()


class FakeProcess:
    """`poll()` answers None until `finish_after` polls, then `code`."""

    def __init__(self, code, finish_after):
        self.code, self.polls, self.finish_after = code, 0, finish_after

    def poll(self):
        self.polls += 1
        return self.code if self.polls > self.finish_after else None


def test_watch_names_the_root_cause(monkeypatch):
    from axonn_jax.run import launch

    monkeypatch.setattr(launch, "POLL_S", 0.001)
    assert launch._watch([FakeProcess(0, 2), FakeProcess(0, 5)]) is None
    # The peer that lost its connection fails in the same poll as the killed process.
    failure = launch._watch([FakeProcess(1, 3), FakeProcess(-9, 3)])
    assert (failure.process_id, failure.exit_code) == (1, 137)
    assert failure.message == "process 1 was killed by signal SIGKILL"
    # A process stuck after its peers finished does not hang the launcher.
    monkeypatch.setattr(launch, "FINISH_GRACE_S", 0.05)
    failure = launch._watch([FakeProcess(0, 1), FakeProcess(0, 10**9)])
    assert failure.message == "process 1 was still running 0 s after process 0 finished"
    assert failure.exit_code == 1


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"


@pytest.mark.parametrize("config, crossing", [
    (ParallelConfig(data=2, row=2, col=2), ["data"]),
    (ParallelConfig(data=1, pipe=2, row=4), ["pipe"]),
    (ParallelConfig(data=4, col=2), ["data"]),
    (ParallelConfig(data=1, row=8), ["row"]),  # a tensor group larger than a process must cross
])
def test_process_boundaries_on_outer_axes(config, crossing):
    # Two processes of four devices, listed out of order: make_mesh sorts by (process, id).
    devices = [FakeDevice(i + 2048 * p, p) for p in (1, 0) for i in (3, 1, 2, 0)]
    mesh = make_mesh(config, devices)
    assert axes_crossing_processes(mesh) == crossing
    assert [d.process_index for d in mesh.devices.flat] == [0] * 4 + [1] * 4
