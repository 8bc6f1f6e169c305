"""FP8 training (`--fp8`, `axonn_jax.tp.fp8`): the tensor-parallel dense layer's FP8 GEMMs against
their definition, and a tensor grid's fp8 run against one device's."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from axonn_jax import ParallelConfig, make_mesh
from axonn_jax.tp.options import KernelOptions
from axonn_jax.tp.tensor import tp_dense
from axonn_jax.train import TrainOptions, train

from conftest import PARITY, assert_steps_match

SHORT = dict(steps=3, batch_size=8, seq_len=32, eval_batches=1, eval_every=10, clip_norm=None,
             fp8=True, **PARITY)


def qdq(a, dtype):
    """`a` through `dtype` with the per-tensor current scale: the definition, in numpy."""
    a = np.asarray(a, np.float32)
    s = np.float32(np.max(np.abs(a)) / float(ml_dtypes.finfo(dtype).max))
    return (a / s).astype(dtype).astype(np.float32) * s


def _dense_grads(mesh, x, w, b, transpose=False, rings=False):
    options = KernelOptions(fp8=True, collective_matmuls=rings)

    def loss(x, w, b):
        return jnp.sum(jnp.sin(tp_dense(x, w, b, mesh, transpose, options=options)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    permutes = "collective-permute" in step.lower(x, w, b).as_text(dialect="hlo")
    assert permutes == rings  # the rings gather the float8 rows
    return jax.device_get(step(x, w, b))


def test_fp8_dense_is_its_definition_on_every_grid(devices):
    """One device's fp8 layer is e4m3(x) @ e4m3(w) forward and e5m2(dy) against them backward,
    each with its tensor's amax scale (numpy reference); row2×col2 (transposed) and
    depth2×row2×col2, with and without collective matmuls, give the same to fp32 rounding: every
    device quantizes with the global amax, and a ring's blocks are the gathered rows."""
    k = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k[0], (16, 8, 32)), 0.1 * jax.random.normal(k[1], (32, 64))
    b = jax.random.normal(k[2], (64,))
    one = make_mesh(ParallelConfig(), devices[:1])
    loss, (dx, dw, db) = _dense_grads(one, x, w, b)
    e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    qx, qw = qdq(x, e4), qdq(w, e4)
    y = qx @ qw + np.asarray(b)
    dy = qdq(np.cos(y), e5)  # the loss's output gradient, through e5m2
    np.testing.assert_allclose(loss, np.sum(np.sin(y)), rtol=1e-5)
    np.testing.assert_allclose(dx, dy @ qw.T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("bsi,bso->io", qx, dy), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(db, np.cos(y).sum((0, 1)), rtol=1e-4)  # the bias sees dy as it is
    assert abs(float(np.sum(np.sin(np.asarray(x) @ np.asarray(w) + np.asarray(b)))) - loss) > 1e-2
    for grid, transpose, rings in [(dict(row=2, col=2), True, False),
                                   (dict(depth=2, row=2, col=2), False, False),
                                   (dict(depth=2, row=2, col=2), False, True)]:
        mesh = make_mesh(ParallelConfig(**grid), devices[:int(np.prod(list(grid.values())))])
        got = _dense_grads(mesh, x, w, b, transpose, rings)
        np.testing.assert_allclose(got[0], loss, rtol=1e-5)
        for g, r in zip(got[1], (dx, dw, db)):
            assert np.max(np.abs(g - r)) <= 1e-6 * np.max(np.abs(r)), (grid, transpose)


@pytest.fixture(scope="module")
def one_device_fp8(devices):
    """SHORT on one device (gpt-tiny, fp8 GEMMs, fp32 elsewhere), and gpt-tiny-deep with 2
    microbatches (the pipeline's reference), computed when first asked for."""
    cache = {}

    def run(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = train(TrainOptions(**{**SHORT, **options}), devices=devices[:1])
        return cache[key]

    return run


@pytest.mark.parametrize("grid", [ParallelConfig(), ParallelConfig(row=2)], ids=["one", "row2"])
def test_the_train_step_runs_its_dense_layers_in_fp8(devices, grid):
    """`make_train_step(..., fp8=True)` reaches the dense layers: its program holds e4m3 and e5m2
    values, one without `fp8` none (found on an H200: a field added to the step's compute
    functions had taken `fp8`'s place, so `--fp8` ran bf16 GEMMs on one device and failed to
    trace on tensor grids)."""
    import optax

    from axonn_jax import make_train_step
    from axonn_jax.models import get

    preset = get("llama-tiny")
    tokens = np.random.default_rng(0).integers(0, preset.config.vocab_size, (2, 17), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = make_mesh(grid, devices[:grid.row])
    for fp8 in (True, False):
        step = make_train_step(preset.build(jnp.bfloat16), optax.adamw(1e-4), mesh,
                               dtype="bfloat16", fp8=fp8)
        bound = step.bind(batch)
        text = step.lower(bound.abstract_state(), bound.abstract_batch()).as_text()
        assert ("f8E4M3FN" in text and "f8E5M2" in text) == fp8


def test_fp8_data_parallel_first_step_equals_one_device(devices, one_device_fp8):
    """data=2: each copy quantizes with the amax of the whole batch (pmax over `data`), so the
    first step is one device's to the bit (quantizing with each copy's own amax moves the first
    loss by 2e-3). After the first update the two runs hold parameters that differ in the last bit
    (the gradients are summed in another order, as in fp32, where the runs stay within 1e-7); an
    fp8 rounding turns such a difference into a whole e4m3/e5m2 step of an element, so later steps
    track (FP8_TRACKS) rather than equal."""
    got = train(TrainOptions(**SHORT, parallel=ParallelConfig(data=2)), devices=devices[:2])
    want = one_device_fp8()["history"]
    assert_steps_match(got["history"][:1], want[:1], 1e-6)
    assert_steps_match(got["history"], want, **FP8_TRACKS)


def test_fp8_pipeline_tracks_one_device(devices, one_device_fp8):
    """pipe=2 × data=2, 1F1B over 2 microbatches, against one device accumulating 2 microbatches:
    each stage's layers quantize their own tensors (amax over `data`, never over `pipe`). In
    separate processes pipe=2 and one device gave equal first losses to the bit; within one
    process (after other fp8 runs) one device's own first loss moved by 7e-4 (see
    FP8_TRACKS), so the bounds are those of the tensor grid."""
    options = dict(model="gpt-tiny-deep", microbatches=2)
    got = train(TrainOptions(**SHORT, **options, schedule="1f1b",
                             parallel=ParallelConfig(pipe=2, data=2)), devices=devices[:4])
    assert_steps_match(got["history"], one_device_fp8(**options)["history"], **FP8_TRACKS)


# Whole fp8 runs are not reproducible to the bit: one device's gpt-tiny first-step loss was
# 5.970718 in fresh processes and 5.970694 / 5.971047 after other fp8 runs in the same process
# (gpt-tiny-deep: 5.771322 against 5.767110); the cause is not established (fp8 rounding turns a
# last-bit difference of an operand into a whole e4m3/e5m2 step of that element). Tensor grids
# part from one device by as much (losses 5e-5 at step 1, up to 1.3e-3 after 3 steps, gradient
# norms up to 8e-3). These bounds show that a run tracks another, no more.
FP8_TRACKS = dict(rtol=5e-3, norm_rtol=3e-2)


def test_fp8_tensor_grid_tracks_one_device(devices, one_device_fp8):
    """data2×row2 against one device: the layer itself is exact on tensor grids
    (`test_fp8_dense_is_its_definition_on_every_grid`); whole runs track (FP8_TRACKS)."""
    got = train(TrainOptions(**SHORT, parallel=ParallelConfig(data=2, row=2)), devices=devices[:4])
    assert_steps_match(got["history"], one_device_fp8()["history"], **FP8_TRACKS)


def test_fp8_step_compiled_for_h100_has_float8_gemms(tmp_path, capsys):
    """gpt-tiny on row2×col2, bf16 with --fp8, compiled for 4 abstract H100s: every GEMM of the
    step (the dense layers' forward, input and weight gradients, the head's; attention runs in
    cuDNN) reads float8, most of them both operands (measured 2026-11-26: 18 of 27; XLA upcasts
    one operand of 9, the backward input gradients' among them, to bf16). Without --fp8: none.
    Both without collective matmuls (`auto` rings the bf16 step only), so the GEMMs pair up."""
    from collections import Counter

    from axonn_jax.analysis import hlo
    from axonn_jax.run.cli import main as cli_main
    from test_compile_h100 import NO_CUDA

    if NO_CUDA is not None:
        pytest.skip(NO_CUDA)
    found = {}
    for fp8 in (True, False):
        out = tmp_path / str(fp8)
        argv = ["compile", "--devices", "4", "--batch-size", "8", "--seq-len", "64", "--model",
                "gpt-tiny", "--row", "2", "--col", "2", "--dtype", "bfloat16", "--dump-hlo",
                str(out), "--json", "--collective-matmul", "off",  # bf16 would ring (auto)
                *(["--fp8"] if fp8 else [])]
        assert cli_main(argv) == 0
        capsys.readouterr()
        found[fp8] = Counter(hlo.gemm_operand_dtypes(next(out.glob("*.txt")).read_text()))
    f8 = lambda types: sum(t.startswith("f8") for t in types)  # noqa: E731
    assert sum(found[True].values()) == sum(found[False].values()) >= 17, found
    assert all(f8(t) >= 1 for t in found[True]), found[True]
    assert sum(n for t, n in found[True].items() if f8(t) == 2) >= 12, found[True]
    assert not any(f8(t) for t in found[False]), found[False]
