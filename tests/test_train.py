"""End-to-end training: data parallelism equals one device, checkpoints resume exactly, the CLI."""
import json

import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.models.gpt import get_config
from axonn_jax.run.cli import main as cli_main
from axonn_jax.train import TrainOptions, train

from conftest import relative_difference

STEPS = 10


def losses(summary):
    return [r["loss"] for r in summary["history"]]


@pytest.fixture(scope="module")
def single_device_run(devices):
    return train(TrainOptions(steps=STEPS, batch_size=16, seq_len=32, eval_batches=1),
                 devices=devices[:1])


def test_data_parallel_trajectory_equals_single_device(single_device_run, devices):
    parallel = train(TrainOptions(steps=STEPS, batch_size=16, seq_len=32, eval_batches=1,
                                  parallel=ParallelConfig(data=8)), devices=devices)
    ref = losses(single_device_run)
    assert len(ref) == STEPS and ref[-1] < ref[0]
    assert relative_difference(losses(parallel), ref) <= 1e-5
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
    opts = dict(steps=STEPS, batch_size=16, seq_len=32, eval_batches=1,
                parallel=ParallelConfig(data=4), checkpoint_dir=str(tmp_path / "ckpt"),
                checkpoint_every=4)
    first = train(TrainOptions(**opts, stop_at=6), devices=devices[:4])
    assert (tmp_path / "ckpt" / "4").is_dir()
    resumed = train(TrainOptions(**opts, resume=True), devices=devices[:4])
    # Resumes from step 6 (saved at the end of the first run), then sees the same data.
    assert [r["step"] for r in resumed["history"]] == list(range(7, STEPS + 1))
    full = losses(first) + losses(resumed)
    assert relative_difference(full, losses(single_device_run)) <= 1e-5


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
