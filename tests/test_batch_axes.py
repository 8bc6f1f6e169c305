"""The trainer's batch splits follow one device: the `expert` and `context` axes and gradient
accumulation (`microbatches` without a pipeline). Built-in models trained through `train` on
grids with these axes (alone, with `data`, with tensor-parallel and pipeline axes) give one
device's per-step losses and gradient norms and its final parameters and Adam moments, leaf by
leaf. The kernels themselves are tested against dense references in test_moe.py and
test_context.py; here the step's part: the batch split over the axis, the gradient of every
parameter summed over the batch axes that do not split it, the mean over the global batch."""
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.train import TrainOptions, train

from conftest import FP32, PARITY, assert_states_match, assert_steps_match, comparable_state

# Warm-up off, no clipping (so that a uniform scale error shows in the moments, not only the norm).
OPTS = dict(steps=3, batch_size=8, seq_len=32, lr=1e-2, clip_norm=None, **PARITY)


@pytest.fixture(scope="module")
def one_device(devices):
    """The single-device run of each model (computed when first asked for)."""
    cache = {}

    def run(model: str):
        if model not in cache:
            cache[model] = train(TrainOptions(**OPTS, model=model), devices=devices[:1])
        return cache[model]

    return run


def assert_trains_like(got, ref):
    assert_steps_match(got["history"], ref["history"], 1e-5)
    assert_states_match(comparable_state(got["trainer"], got["state"]),
                        comparable_state(ref["trainer"], ref["state"]), **FP32)


@pytest.mark.parametrize("model, grid, options", [
    ("gpt-tiny", dict(data=2, context=2), dict(context_attention="ring")),
    ("llama-tiny", dict(context=2, row=2), dict(context_attention="allgather")),
    ("gpt-tiny-deep", dict(pipe=2, context=2, data=2),
     dict(context_attention="allgather", microbatches=2, schedule="1f1b")),
], ids=["data2-context2-ring", "context2-row2-allgather", "pipe2-context2-data2"])
def test_context_grids_train_like_one_device(devices, one_device, model, grid, options):
    grid = ParallelConfig(**grid)
    got = train(TrainOptions(**OPTS, **options, model=model, parallel=grid),
                devices=devices[:grid.num_devices])
    assert_trains_like(got, one_device(model))


@pytest.mark.parametrize("grid, options", [
    (dict(data=2, expert=2), {}),
    (dict(expert=2, row=2), {}),
    (dict(pipe=2, expert=2), dict(microbatches=1, schedule="1f1b")),
], ids=["data2-expert2", "expert2-row2", "pipe2-expert2"])
def test_expert_grids_train_like_one_device(devices, one_device, grid, options):
    grid = ParallelConfig(**grid)
    got = train(TrainOptions(**OPTS, **options, model="mixtral-tiny", parallel=grid),
                devices=devices[:grid.num_devices])
    assert_trains_like(got, one_device("mixtral-tiny"))


def test_gradient_accumulation_trains_like_one_device(devices, one_device):
    """--microbatches without --pipe: each device's rows in two slices, their gradients averaged."""
    got = train(TrainOptions(**OPTS, model="gpt-tiny", microbatches=2,
                             parallel=ParallelConfig(data=2)), devices=devices[:2])
    assert_trains_like(got, one_device("gpt-tiny"))
