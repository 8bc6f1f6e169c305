"""`train` with tensor parallelism follows the data-parallel loss trajectory."""
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run.cli import main as cli_main
from axonn_jax.train import TrainOptions, train

from conftest import relative_difference

OPTS = dict(steps=10, batch_size=16, seq_len=32, eval_batches=1, eval_every=10)
losses = lambda s: [r["loss"] for r in s["history"]]  # noqa: E731


def test_tensor_parallel_trajectory_equals_data_parallel(devices):
    ref = train(TrainOptions(**OPTS, parallel=ParallelConfig(data=8)), devices=devices)
    tp = train(TrainOptions(**OPTS, parallel=ParallelConfig(data=2, depth=2, row=2)), devices=devices)
    assert len(losses(tp)) == 10 and losses(ref)[-1] < losses(ref)[0]
    assert relative_difference(losses(tp), losses(ref)) <= 1e-5
    # Parameters and optimizer state are split over depth·row = 4 (up to small replicated vectors).
    assert tp["state_bytes_device"] < 0.3 * ref["state_bytes_device"]


@pytest.mark.parametrize("mode", [dict(offload_optimizer=True), dict(remat="offload")],
                         ids=["offload-optimizer", "remat-offload"])
def test_tensor_parallel_composes_with_memory_modes(mode, devices):
    short = dict(OPTS, steps=3, batch_size=8)
    ref = train(TrainOptions(**short, parallel=ParallelConfig(data=2)), devices=devices[:2])
    got = train(TrainOptions(**short, **mode, parallel=ParallelConfig(data=2, row=2, col=2)),
                devices=devices)
    assert relative_difference(losses(got), losses(ref)) <= 1e-5


def test_tensor_parallel_bf16_tracks_data_parallel(devices):
    """bf16 compute with TP (its 16-bit all-reduces once aborted XLA:CPU): the loss trajectory
    follows the data-parallel bf16 one (measured 1e-4 apart)."""
    short = dict(OPTS, steps=3, batch_size=8, dtype="bfloat16")
    ref = train(TrainOptions(**short, parallel=ParallelConfig(data=2)), devices=devices[:2])
    got = train(TrainOptions(**short, parallel=ParallelConfig(data=2, row=2, col=2)), devices=devices)
    assert relative_difference(losses(got), losses(ref)) <= 2e-3


def test_tensor_parallel_pipeline_stages(devices):
    short = dict(OPTS, model="gpt-tiny-deep", steps=4, batch_size=8)
    ref = train(TrainOptions(**short, parallel=ParallelConfig(data=2)), devices=devices[:2])
    got = train(TrainOptions(**short, microbatches=2, schedule="1f1b",
                             parallel=ParallelConfig(pipe=2, row=2, data=2)), devices=devices)
    assert relative_difference(losses(got), losses(ref)) <= 1e-5
    # Each stage's blocks are split over pipe (layers) and row (output features).
    kernel = got["state"].params["blocks"]["query"]["kernel"]  # (8 layers, 32, 32)
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 32, 16)}


@pytest.mark.parametrize("argv, message", [
    (["--row", "8"], "num_heads = 4 is not divisible by row=8"),
    (["--depth", "8", "--batch-size", "4"], "--batch-size = 4 is not divisible by data=1 × depth=8"),
])
def test_cli_tensor_parallel_bad_grid(argv, message, capsys):
    assert cli_main(["train", "--steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err
