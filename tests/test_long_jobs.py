"""Long jobs, tested by breaking them with real processes and real signals: Ctrl-C, SIGTERM and
SIGUSR1 save and stop (one process, and a 2-process job whose processes agree on the step);
`--resume auto`; a worker killed with SIGKILL under `launch --max-restarts 1` and the job
finishes with the uninterrupted run's losses; a stopped (hung) worker is named; a diverged run
stops without saving; flags that would be ignored are refused in one line."""
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest

from axonn_jax.run.cli import main as cli_main, parse
from axonn_jax.run.loop import train
from axonn_jax.run.stopping import EXIT_DIVERGED, EXIT_PREEMPTED
from axonn_jax.train import TrainOptions

from conftest import relative_difference
from test_distributed import DATA, REPO, child_env, cli  # noqa: F401

TINY = ["--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--eval-every", "100000",
        "--data", DATA, "--steps", "100000", "--warmup-steps", "0"]
"""A long run of a tiny model: every job of one process, and every one of two, runs one compiled
program (read from the compilation cache after the first); `--stop-at` ends the short ones."""


def _lines(path) -> list[dict]:
    try:
        return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


class Job:
    """A command run in the background with its output in files."""

    def __init__(self, cmd, tmp: pathlib.Path, name: str):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=out, stderr=err)

    def wait_for(self, condition, what: str, timeout: float = 240):
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"exited before {what}: {self.text()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s: {self.text()}"
            time.sleep(0.02)

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def text(self) -> str:
        return self.out.read_text(errors="replace")[-3000:] + self.err.read_text(errors="replace")[-3000:]


def _checkpoints(directory) -> list[int]:
    return sorted(int(p.name) for p in pathlib.Path(directory).iterdir() if p.name.isdigit())


def test_ctrl_c_then_sigterm_save_and_resume_auto(tmp_path):
    """Ctrl-C saves and exits 130 without a traceback (no --checkpoint-every: the run directory's
    checkpoints); `--resume auto` continues from it; SIGTERM saves and exits 75."""
    run = tmp_path / "run"
    cmd = cli("train", *TINY, "--devices", "1", "--run-dir", str(run))
    first = Job(cmd + ["--resume", "auto"], tmp_path, "first")
    first.wait_for(lambda: len(_lines(run / "metrics.jsonl")) >= 2, "two steps")
    first.proc.send_signal(signal.SIGINT)
    assert first.wait() == 130, first.text()
    done = _lines(run / "metrics.jsonl")[-1]["step"]
    assert _checkpoints(run / "checkpoints") == [done]
    assert f"SIGINT: stopped after step {done}; checkpoint saved in" in first.out.read_text()
    assert "--resume auto: no checkpoint" in first.out.read_text()
    assert "Traceback" not in first.text()

    second = Job(cmd + ["--resume", "auto"], tmp_path, "second")
    second.wait_for(lambda: _lines(run / "metrics.jsonl")[-1]["step"] >= done + 2, "two more steps")
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait() == EXIT_PREEMPTED, second.text()
    assert f"resumed from step {done}" in second.out.read_text()
    last = _lines(run / "metrics.jsonl")[-1]["step"]
    assert _checkpoints(run / "checkpoints")[-1] == last
    assert f"SIGTERM: stopped after step {last}" in second.out.read_text()


def _launch(tmp_path, *flags):
    logs = tmp_path / "logs"
    return logs, cli("launch", "--nprocs", "2", "--log-dir", str(logs), *flags, "--", "train", *TINY)


def _pids(logs) -> list[int]:
    return json.loads((logs / "launch.json").read_text())["pids"]


def test_sigusr1_to_one_process_stops_the_job_at_one_step(tmp_path):
    """SLURM's warning signal reaching one process of two: both stop after the same step, the
    checkpoint is saved cooperatively, every process and the launcher exit 75."""
    run = tmp_path / "run"
    logs, cmd = _launch(tmp_path, "--devices-per-proc", "1")
    job = Job(cmd + ["--run-dir", str(run)], tmp_path, "job")
    job.wait_for(lambda: len(_lines(run / "metrics.jsonl")) >= 2, "two steps")
    os.kill(_pids(logs)[1], signal.SIGUSR1)
    assert job.wait() == EXIT_PREEMPTED, job.text()
    last = _lines(run / "metrics.jsonl")[-1]["step"]
    assert _checkpoints(run / "checkpoints") == [last]
    assert f"SIGUSR1: stopped after step {last}" in (logs / "proc0.log").read_text()


def test_killed_worker_restarts_and_finishes_like_the_uninterrupted_run(tmp_path, devices):
    """kill -9 of a worker mid-run under `--max-restarts 1`: the job restarts from its newest
    checkpoint and ends with the losses of the same job run without interruption, on two devices
    in this process (a 2-process job equals one process: `tests/test_distributed.py`)."""
    steps = 16
    config = parse(["train", *TINY, "--devices", "2", "--stop-at", str(steps),
                    "--run-dir", str(tmp_path / "whole")]).run_config
    reference = [r["loss"] for r in train(config, devices=devices[:2])["history"]]
    assert len(reference) == steps

    run = tmp_path / "run"
    logs, cmd = _launch(tmp_path, "--devices-per-proc", "1", "--max-restarts", "1")
    job = Job(cmd + ["--stop-at", str(steps), "--checkpoint-every", "4", "--run-dir", str(run)],
              tmp_path, "job")
    job.wait_for(lambda: (run / "checkpoints" / "4").is_dir(), "the checkpoint of step 4")
    os.kill(_pids(logs)[1], signal.SIGKILL)
    assert job.wait(240) == 0, job.text()
    err = job.err.read_text()
    assert "axonn-jax launch: process 1 was killed by signal SIGKILL; restarting the job from its " \
           "newest checkpoint (restart 1 of 1)\n" in err
    assert "resumed from step" in (logs / "proc0.log").read_text()
    by_step = {}
    for r in _lines(run / "metrics.jsonl"):  # steps after the newest checkpoint may run twice
        by_step[r["step"]] = r["loss"]
    assert sorted(by_step) == list(range(1, steps + 1))
    assert relative_difference([by_step[s] for s in range(1, steps + 1)], reference) <= 1e-6


def test_stopped_worker_is_named(tmp_path):
    """A SIGSTOPped process stops sending heartbeats: the launcher names it in one line (not the
    process whose runtime noticed, nor its C++ stack dump)."""
    logs, cmd = _launch(tmp_path, "--devices-per-proc", "1", "--heartbeat-timeout", "3")
    job = Job(cmd + ["--run-dir", str(tmp_path / "run")], tmp_path, "job")
    job.wait_for(lambda: len(_lines(tmp_path / "run" / "metrics.jsonl")) >= 1, "a step")
    os.kill(_pids(logs)[1], signal.SIGSTOP)
    assert job.wait() == 1, job.text()
    assert job.err.read_text() == "axonn-jax launch: process 1 stopped answering (no heartbeat); " \
                                  f"stopped the other processes (logs: {logs})\n"
    assert "Check failure stack trace" not in job.out.read_text()


def test_divergence_stops_without_saving(tmp_path):
    """A learning rate of 1e5: the first non-finite loss or gradient norm stops the run (exit code
    3, one line), the checkpoints hold only the steps before it, all finite."""
    run = tmp_path / "run"
    job = Job(cli("train", *TINY, "--devices", "1", "--lr", "1e5",
                  "--warmup-steps", "0", "--clip-norm", "1e9", "--checkpoint-every", "1",
                  "--run-dir", str(run)), tmp_path, "job")
    assert job.wait() == EXIT_DIVERGED, job.text()
    err = job.err.read_text()
    assert err.count("\n") == 1, err
    bad = int(re.match(r"axonn-jax train: error: the (loss|grad_norm) of step (\d+) is (nan|inf)",
                       err).group(2))
    kept = _lines(run / "metrics.jsonl")
    assert kept[-1]["step"] == bad - 1 and max(_checkpoints(run / "checkpoints")) == bad - 1
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in kept)


@pytest.mark.parametrize("flags, message", [
    (["--compress-bucket", "512"], "--compress-bucket needs gradient compression"),
    (["--no-error-feedback"], "--no-error-feedback needs gradient compression"),
    (["--schedule", "zb-h1"], "--schedule zb-h1 needs a pipeline (--pipe > 1)"),
    (["--stop-at", "-1"], "--stop-at must be a step >= 1"),
    (["--eval-batches", "0"], "--eval-batches must be positive, got 0"),
    (["--devices", "-2"], "--devices must be positive, got -2"),
    (["--metrics-out", "{tmp}"], "is a directory; name a file"),
    (["--row", "-2"], "--row must be positive, got -2"),
    (["--data-parallel", "-1"], "--data-parallel must be positive, got -1"),
])
def test_ignored_flags_and_bad_values_are_refused_in_one_line(flags, message, tmp_path, capsys):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert cli_main(["train", "--steps", "2", *TINY, "--run-dir", str(tmp_path / "run"),
                     *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_checkpoint_every_without_a_directory_is_refused():
    with pytest.raises(ValueError, match="--checkpoint-every needs a place for the checkpoints"):
        TrainOptions(checkpoint_every=5)


def test_stop_at_saves_into_the_run_directory(tmp_path):
    """--stop-at without --checkpoint-every still saves, where --resume looks (the program of the
    Ctrl-C test's jobs: compiled already)."""
    run = tmp_path / "run"
    job = Job(cli("train", *TINY, "--devices", "1", "--run-dir", str(run),
                  "--stop-at", "2"), tmp_path, "job")
    assert job.wait() == 0, job.text()
    assert _checkpoints(run / "checkpoints") == [2]
