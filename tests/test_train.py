"""End-to-end training: data parallelism equals one device, checkpoints resume exactly, the CLI."""
import json

import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.models.gpt import get_config
from axonn_jax.run.cli import main as cli_main
from axonn_jax.train import TrainOptions, train

from conftest import (PARITY, assert_learns, assert_states_match, assert_steps_match,
                      comparable_state)

STEPS = 10
# Warm-up off; clipping active (the gradient norm falls from 4.4 to 1.03, above clip_norm = 1).
OPTS = dict(steps=STEPS, batch_size=16, seq_len=32, eval_batches=1, eval_every=STEPS, **PARITY)


def losses(summary):
    return [r["loss"] for r in summary["history"]]


def final_state(summary):
    return comparable_state(summary["trainer"], summary["state"])


@pytest.fixture(scope="module")
def single_device_run(devices):
    summary = train(TrainOptions(**OPTS), devices=devices[:1])
    assert len(summary["history"]) == STEPS
    assert_learns(summary["history"], 0.8)  # measured 5.94 falling to 3.73: 0.63
    assert all(r["grad_norm"] > 1.0 for r in summary["history"])  # clipping fires at every step
    return summary


def test_data_parallel_trajectory_equals_single_device(single_device_run, devices):
    parallel = train(TrainOptions(**OPTS, parallel=ParallelConfig(data=8)), devices=devices)
    assert_steps_match(parallel["history"], single_device_run["history"])
    assert_states_match(final_state(parallel), final_state(single_device_run))
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "num_params",
            "state_bytes_device", "state_bytes_host", "peak_bytes_compiled",
            "flops_per_device_compiled", "model_flops_per_device"}
    first = parallel["history"][0]
    assert keys <= set(first)
    # FLOPs per device: the model's (gpt-tiny, 16 × 32 tokens over 8 devices) and the compiled
    # step's, which adds the norms, softmax, loss and AdamW (1.11× here); no peak is known for a
    # CPU, so no MFU.
    assert first["model_flops_per_device"] == get_config("gpt-tiny").flops_per_token(32) * 16 * 32 / 8
    assert 1.0 < first["flops_per_device_compiled"] / first["model_flops_per_device"] < 1.2
    assert "mfu" not in first


def test_save_resume_gives_identical_losses(single_device_run, devices, tmp_path):
    opts = dict(OPTS, parallel=ParallelConfig(data=4), checkpoint_dir=str(tmp_path / "ckpt"),
                checkpoint_every=4)
    first = train(TrainOptions(**opts, stop_at=6), devices=devices[:4])
    assert (tmp_path / "ckpt" / "4").is_dir()
    resumed = train(TrainOptions(**opts, resume=True), devices=devices[:4])
    # Resumes from step 6 (saved at the end of the first run), then sees the same data.
    assert [r["step"] for r in resumed["history"]] == list(range(7, STEPS + 1))
    assert_steps_match(first["history"] + resumed["history"], single_device_run["history"])
    assert_states_match(final_state(resumed), final_state(single_device_run))


def test_resume_without_checkpoint_is_clear_error(devices, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        train(TrainOptions(steps=2, checkpoint_dir=str(tmp_path / "none"), resume=True),
              devices=devices[:1])


def test_cli_writes_metrics_and_hlo(tmp_path, capsys):
    out = tmp_path / "m.jsonl"
    rc = cli_main(["train", "--steps", "3", "--batch-size", "8", "--seq-len", "16",
                   "--metrics-out", str(out), "--dump-hlo", str(tmp_path / "hlo"),
                   "--eval-batches", "1"])
    assert rc == 0
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    assert all(np.isfinite(l["loss"]) and l["tokens_per_s"] > 0 for l in lines)
    hlo = (tmp_path / "hlo" / "train_step.hlo.txt").read_text()
    assert "all-reduce" in hlo  # the data-parallel gradient reduction over 8 devices


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel", "3"], "has 3 devices but 8 are available"),
    (["--batch-size", "12"], "--batch-size = 12 is not divisible by data=8"),
    (["--seq-len", "4096"], "exceeds gpt-tiny's max_seq_len"),
    (["--data", "/no/such/file"], "does not exist"),
])
def test_cli_bad_input(argv, message, capsys):
    assert cli_main(["train", "--steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err
