"""`train` with tensor parallelism follows the data-parallel loss trajectory."""
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run.cli import main as cli_main
from axonn_jax.train import TrainOptions, train

from conftest import (BF16, FP32, PARITY, assert_states_match, assert_steps_match,
                      comparable_state, field)

# Warm-up off. The 10-step runs clip (gradient norms above 1); the short ones do not.
OPTS = dict(steps=10, batch_size=16, seq_len=32, eval_batches=1, eval_every=10, **PARITY)
SHORT = dict(OPTS, steps=3, batch_size=8, clip_norm=None)


def assert_trains_like(got, ref, rtol=1e-5, state=FP32, norm_rtol=None):
    """Summaries `got` and `ref`: the same losses and gradient norms at every step (within
    `rtol`, `norm_rtol` for the norms), the same final parameters and optimizer state leaf by
    leaf (tolerances `state`)."""
    assert_steps_match(got["history"], ref["history"], rtol, norm_rtol)
    assert_states_match(comparable_state(got["trainer"], got["state"]),
                        comparable_state(ref["trainer"], ref["state"]), **state)


@pytest.fixture(scope="module")
def data_parallel(devices):
    """SHORT's data=2 run in fp32 and bf16 (computed when first asked for)."""
    cache = {}

    def run(dtype="float32", model="gpt-tiny", steps=SHORT["steps"]):
        key = dtype, model, steps
        if key not in cache:
            cache[key] = train(TrainOptions(**dict(SHORT, dtype=dtype, model=model, steps=steps),
                                            parallel=ParallelConfig(data=2)), devices=devices[:2])
        return cache[key]

    return run


def test_tensor_parallel_trajectory_equals_data_parallel(devices):
    ref = train(TrainOptions(**OPTS, parallel=ParallelConfig(data=8)), devices=devices)
    tp = train(TrainOptions(**OPTS, parallel=ParallelConfig(data=2, depth=2, row=2)), devices=devices)
    assert min(r["grad_norm"] for r in ref["history"]) > ref["trainer"].options.optimizer.clip_norm
    assert_trains_like(tp, ref)
    # Parameters and optimizer state are split over depth·row = 4 (up to small replicated vectors).
    assert tp["state_bytes_device"] < 0.3 * ref["state_bytes_device"]


@pytest.mark.parametrize("mode", [dict(offload_optimizer=True), dict(remat="offload"),
                                  dict(remat="selective")],
                         ids=["offload-optimizer", "remat-offload", "remat-selective"])
def test_tensor_parallel_composes_with_memory_modes(mode, devices, data_parallel):
    got = train(TrainOptions(**SHORT, **mode, parallel=ParallelConfig(data=2, row=2, col=2)),
                devices=devices)
    assert_trains_like(got, data_parallel())


def test_collective_matmuls_train_like_data_parallel(devices, data_parallel):
    """`--collective-matmul on`: every dense layer gathers its rows over row and col in rings of
    permutes (`KernelOptions.collective_matmuls`), and the run follows the data-parallel one."""
    got = train(TrainOptions(**SHORT, collective_matmul="on",
                             parallel=ParallelConfig(data=2, row=2, col=2)), devices=devices)
    assert got["trainer"].bound.kernels.collective_matmuls
    assert_trains_like(got, data_parallel())


def test_tensor_parallel_bf16_tracks_data_parallel(devices, data_parallel):
    """bf16 compute with TP (its 16-bit all-reduces once aborted XLA:CPU): the losses and gradient
    follow the data-parallel bf16 run's, the gradient norms within two bf16 ulps (the two grids
    sum in other orders; jaxlib 0.12 fuses them differently from 0.10), the fp32 masters and
    moments within bf16's resolution."""
    got = train(TrainOptions(**SHORT, dtype="bfloat16",
                             parallel=ParallelConfig(data=2, row=2, col=2)), devices=devices)
    assert_trains_like(got, data_parallel("bfloat16"), 2e-3, BF16, norm_rtol=1e-2)


def test_tensor_parallel_pipeline_stages(devices, data_parallel):
    got = train(TrainOptions(**dict(SHORT, model="gpt-tiny-deep", steps=4), microbatches=2,
                             schedule="1f1b", parallel=ParallelConfig(pipe=2, row=2, data=2)),
                devices=devices)
    assert_trains_like(got, data_parallel(model="gpt-tiny-deep", steps=4))
    # Each stage's blocks are split over pipe (layers) and row (output features).
    kernel = field(got["state"], "params")["blocks"]["query"]["kernel"]  # (8 layers, 32, 32)
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 32, 16)}


@pytest.mark.parametrize("argv, message", [
    (["--row", "8"], "num_heads = 4 is not divisible by row=8"),
    (["--depth", "8", "--batch-size", "4"], "--batch-size = 4 is not divisible by data=1 × expert=1 × depth=8"),
])
def test_cli_tensor_parallel_bad_grid(argv, message, capsys):
    assert cli_main(["train", "--steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err
