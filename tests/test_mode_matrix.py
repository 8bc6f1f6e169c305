"""The matrix of modes: every compute dtype × where the optimizer state lives × every grid axis
(each beside `data`, where the gradient exchange runs) trains like one device. Modes break where
they meet (bf16 + offloaded state + data aborted XLA:CPU while each mode alone passed), so the
cells are generated from the config tree, not listed by hand: a new dtype or axis enters the
matrix by itself.

The quick tier runs each dtype with each memory mode once, spread so that every axis runs; the
extended tier runs the rest of the product, so that `make test-all` has every pair of values
(dtype and memory, dtype and axis, memory and axis) and every triple. A cell the library
does not run yet is refused in one line, and the test says which (`REFUSED`)."""
import itertools

import jax
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run import options as options_lib
from axonn_jax.run.options import ConfigError
from axonn_jax.train import TrainOptions, build_trainer, train

from conftest import PARITY, assert_steps_match

OPTS = dict(steps=2, batch_size=8, seq_len=16, lr=1e-2, **PARITY)

LEAVES = {leaf.path: leaf for leaf in options_lib.leaves()}
DTYPES = LEAVES["precision.dtype"].choices()
# Where the optimizer state lives (each value of the tree's `memory.offload_optimizer`), and the
# blocks' gradients with it (`memory.offload_gradients`).
MEMORY = {"device": dict(offload_optimizer=False), "offload": dict(offload_optimizer=True),
          "offload-gradients": dict(offload_optimizer=True, offload_gradients=True)}
# Gradients leave for host memory only where nothing sums them after the backward: these axes
# (and accumulated microbatches) are refused in one line.
REFUSED = {("offload-gradients", axis) for axis in ("pipe", "context", "expert")}

# (model, grid, options) of each axis, with data = 2 beside it.
AXIS_GRIDS = {
    "data": ("gpt-tiny", dict(data=4), {}),
    "depth": ("gpt-tiny", dict(data=2, depth=2), {}),
    "row-col": ("gpt-tiny", dict(data=2, row=2, col=2), {}),
    "pipe": ("gpt-tiny", dict(data=2, pipe=2), dict(microbatches=2)),
    "context": ("gpt-tiny", dict(data=2, context=2), {}),
    "expert": ("mixtral-tiny", dict(data=2, expert=2), {}),
}

# Losses and gradient norms against one device of the same dtype, relative: fp32 to summation
# order; bf16 and fp16 to a few ulps of their mantissas, as the mixed-precision tests of
# test_user_models.py bound them.
RTOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
# A gradient norm after the first update sums the roundings of the update and of every gradient
# element: in bf16 its bound is twice the losses' (XLA versions that fuse differently round
# differently).
NORM_RTOL = {**RTOL, "bfloat16": 2e-2}
# A router in 16 bits: after the first update a rounding difference can send a token to another
# expert (a discrete choice), which moves the gradient norm by a few percent and the loss by up
# to a bf16 ulp or so, in fp16 too.
ROUTED_RTOL, ROUTED_NORM_RTOL = 1e-2, 0.1


def quick_cells():
    """The quick tier's (dtype, memory, axis) cells: each (dtype, memory) pair once, on the first
    axis not run yet that the pair can run (not `REFUSED`), else on the first one it can."""
    chosen, unused = set(), list(AXIS_GRIDS)
    for dtype, memory in itertools.product(DTYPES, MEMORY):
        runnable = [a for a in AXIS_GRIDS if (memory, a) not in REFUSED]
        axis = next((a for a in unused if a in runnable), runnable[0])
        unused = [a for a in unused if a != axis]
        chosen.add((dtype, memory, axis))
    return chosen


def cells():
    """Every (dtype, memory, axis): `quick_cells()` plain, the rest marked `extended`."""
    quick = quick_cells()
    return [pytest.param(d, m, a, id=f"{d}-{m}-{a}",
                         marks=() if (d, m, a) in quick else (pytest.mark.extended,))
            for d, a, m in itertools.product(DTYPES, AXIS_GRIDS, MEMORY)]


@pytest.fixture(scope="module")
def one_device(devices):
    """The single-device run of each (model, dtype), state on the device."""
    cache = {}

    def run(model, dtype):
        if (model, dtype) not in cache:
            cache[model, dtype] = train(TrainOptions(**OPTS, model=model, dtype=dtype),
                                        devices=devices[:1])
        return cache[model, dtype]

    return run


@pytest.mark.parametrize("dtype, memory, axis", cells())
def test_mode_trains_like_one_device(devices, one_device, dtype, memory, axis):
    """Each cell trains like one device of its dtype, or is refused in one line (`REFUSED`)."""
    model, grid, extra = AXIS_GRIDS[axis]
    grid = ParallelConfig(**grid)
    if (memory, axis) in REFUSED:
        with pytest.raises(ConfigError, match="is not implemented yet") as refused:
            build_trainer(TrainOptions(**OPTS, **extra, **MEMORY[memory], model=model,
                                       dtype=dtype, parallel=grid), devices[:grid.num_devices])
        # one line per problem (the config reports them all at once)
        assert all(line.endswith("is not implemented yet")
                   for line in str(refused.value).splitlines())
        return
    got = train(TrainOptions(**OPTS, **extra, **MEMORY[memory], model=model, dtype=dtype,
                             parallel=grid), devices=devices[:grid.num_devices])
    routed = axis == "expert" and dtype != "float32"
    assert_steps_match(got["history"], one_device(model, dtype)["history"],
                       max(RTOL[dtype], ROUTED_RTOL) if routed else RTOL[dtype],
                       norm_rtol=ROUTED_NORM_RTOL if routed else NORM_RTOL[dtype])
    assert got["history"][-1].get("skipped_steps", 0) == 0


def test_quick_cells_cover_each_dtype_memory_pair_and_each_axis():
    """The quick tier's cells meet every (dtype, memory) pair and run every axis; the two tiers
    together hold the whole product."""
    quick = [c.values for c in cells() if not c.marks]
    assert {(d, m) for d, m, _ in quick} == set(itertools.product(DTYPES, MEMORY))
    assert {a for _, _, a in quick} == set(AXIS_GRIDS)
    assert len(cells()) == len(DTYPES) * len(MEMORY) * len(AXIS_GRIDS)


# CGX's 8-bit exchange over data 2, where its error-feedback residuals live in the train state.
COMPRESSED = dict(OPTS, model="gpt-tiny", compress_bits=8, parallel=ParallelConfig(data=2))
QUANTIZED_RTOL = 1e-2


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=() if d == "bfloat16" else
                                                (pytest.mark.extended,)) for d in DTYPES])
def test_compressed_exchange_with_offloaded_state_tracks_the_device_state(devices, dtype):
    """The residuals are made like the gradients they correct (the device copy's dtype under
    offload): 16-bit offload once returned bfloat16 residuals for float32 ones and the second
    step was refused ("compiled with float32 ... called with bfloat16")."""
    runs = {memory: train(TrainOptions(**COMPRESSED, **MEMORY[memory], dtype=dtype),
                          devices=devices[:2]) for memory in ("device", "offload")}
    # 16 bits: a gradient element rounded differently before it is quantized can land on the
    # next 8-bit level, which moves the norm by more than the dtype's own rounding.
    rtol = RTOL[dtype] if dtype == "float32" else max(RTOL[dtype], QUANTIZED_RTOL)
    assert_steps_match(runs["offload"]["history"], runs["device"]["history"], rtol,
                       norm_rtol=max(NORM_RTOL[dtype], rtol))
    residuals = jax.tree.leaves(runs["offload"]["state"].reducer)
    assert residuals and {r.dtype for r in residuals} == \
        {p.dtype for p in jax.tree.leaves(runs["offload"]["state"].params)}
