"""Every test runs on 8 simulated CPU devices; set before JAX starts."""
import atexit
import os
import pathlib
import shutil
import tempfile

# LLVM optimization level 0 halves XLA:CPU's compile time, most of a tiny test's time; losses
# agree with the default level's to ~1e-7. The scheduler flag keeps the simulated devices'
# collectives from starving each other of threads (`axonn_jax.mesh.CPU_SCHEDULER_FLAG`).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Default run directories of CLI runs (and of their child processes) go to a temporary folder, not
# into the checkout.
if "AXONN_RUNS" not in os.environ:
    os.environ["AXONN_RUNS"] = tempfile.mkdtemp(prefix="axonn-runs-")
    atexit.register(shutil.rmtree, os.environ["AXONN_RUNS"], True)
# One persistent compilation cache for the whole run: both pytest-xdist workers and every child
# process (a resumed job, a second launch of the same grid, a reference computed in several
# files) load what another compiled instead of compiling it again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="axonn-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
    config.addinivalue_line("markers", "extended: left out of `make test` (tests/extended.txt)")


def pytest_collection_modifyitems(config, items):
    """Mark the node ids listed in tests/extended.txt `extended` (`make test` deselects them)."""
    import pathlib

    listed = {line.strip() for line in (pathlib.Path(__file__).parent / "extended.txt")
              .read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.extended)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests need 8 simulated devices, JAX sees {len(devs)}"
    return devs


def parse_python(path):
    """`ast.parse` of a source file. CPython 3.11 can raise a spurious `SystemError: AST
    constructor recursion depth mismatch` in a process where other threads run (JAX's, orbax's;
    python/cpython#106905): the parse is tried once more then."""
    import ast

    source = pathlib.Path(path).read_text()
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def relative_difference(a, b):
    """max |a - b| / max |b| over arrays or sequences of numbers."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ----------------------------------------------------------------------------- parity checks
#
# "This configuration trains like one device" is checked in two parts, each by one helper:
# `assert_steps_match` compares every step's loss and pre-clip gradient norm (a gradient off by a
# constant factor changes the norm even where clipping and Adam hide it from the loss), and
# `assert_states_match` compares the final parameters and optimizer state leaf by leaf (Adam's
# moments carry any per-parameter scale error that Adam's normalized step hides). Parity runs
# switch the learning-rate warm-up off (`PARITY`), so that every step is a real update.

# Options of every parity run: no warm-up (step 1 would have lr = 0).
PARITY = dict(warmup_steps=0)

# A parameter whose gradient in the reference is below this fraction of the largest gradient is
# taken for one whose true gradient is zero (e.g. attention key biases: the softmax is invariant
# to adding q·b to every score; a bias or a per-sample offset right before a GroupNorm of one
# channel per group): its gradient is rounding noise, which Adam's normalized step turns into
# moves of about the learning rate, so neither its values nor its moments compare between runs.
ZERO_GRADIENT = 1e-6


def field(state, name: str, *default):
    """One field of a train state (`step`, `params`, `opt_state`, `reducer`, `precision`), or
    `default` when given and the state has no such field (or holds None there): the one place the
    tests know how the state is spelled."""
    value = state.get(name) if isinstance(state, dict) else getattr(state, name, None)
    if value is None:
        if default:
            return default[0]
        raise KeyError(name)
    return value


def adam_state(opt_state):
    """The one `optax.ScaleByAdamState` (count, mu, nu) inside an optimizer state."""
    import jax
    import optax

    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    assert len(found) == 1, found
    return found[0]


def records(history) -> list[dict]:
    """`[{'loss', 'grad_norm'}, ...]` of per-step metrics (a summary's `history`, the lines of a
    metrics.jsonl file as dicts, or the step's own metrics)."""
    return [{"loss": float(r["loss"]), "grad_norm": float(r["grad_norm"])} for r in history]


def metrics_file(path) -> list[dict]:
    """The per-step records of a metrics.jsonl file, in order."""
    import json
    import pathlib

    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def run_steps(trainer, state, batch, steps: int, start: int = 0, step_fn=None):
    """`steps` train steps of `trainer` from `state` on global host batches `batch(i)` for
    i = start, start + 1, ...; `step_fn`: a compiled step (default: `trainer.step`).
    Returns (state, records)."""
    step_fn = step_fn or trainer.step
    out = []
    for i in range(start, start + steps):
        state, metrics = step_fn(state, trainer.place(batch(i)))
        out.append(metrics)
    return state, records(out)


def _measured(**values) -> None:
    """With AXONN_TEST_MEASURE=FILE, one JSON line per comparison (the test, the largest relative
    differences found) appended to FILE, written before the comparison is asserted: how the
    tolerances of these tests were measured, and how to re-measure them."""
    import json

    path = os.environ.get("AXONN_TEST_MEASURE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), **values}) + "\n")


def assert_steps_match(got, want, rtol: float = 1e-5, norm_rtol: float | None = None) -> float:
    """Per step, the loss and the pre-clip gradient norm of `got` equal `want`'s (records, see
    `records`) within `rtol` (`norm_rtol` for the norms, default `rtol`), each relative to its own
    value. Returns the largest relative difference seen."""
    got, want = records(got), records(want)
    assert len(got) == len(want), (len(got), len(want))
    diffs = {key: [relative_difference(g[key], w[key]) for g, w in zip(got, want)]
             for key in ("loss", "grad_norm")}
    _measured(loss=max(diffs["loss"]), grad_norm=max(diffs["grad_norm"]))
    for key, tol in (("loss", rtol), ("grad_norm", rtol if norm_rtol is None else norm_rtol)):
        assert max(diffs[key]) <= tol, (key, [(g[key], w[key]) for g, w in zip(got, want)],
                                        diffs[key])
    return max(max(d) for d in diffs.values())


def assert_learns(history, at_most: float) -> float:
    """The last step's loss is at most `at_most` × the first step's (records; on a fixed dataset,
    so that a run that does not learn fails). Returns the ratio."""
    losses = [float(r["loss"]) for r in history]
    _measured(learned=losses[-1] / losses[0])
    assert losses[-1] <= at_most * losses[0], losses
    return losses[-1] / losses[0]


def comparable_state(trainer, state) -> dict:
    """`{'params', 'opt_state'}` of a train state as host arrays, as checkpoints hold them
    (`TrainStep.canonical_state`: the model's layer order, the fp32 masters as `params` and the
    inner optimizer state as `opt_state` under optimizer offload), so that states of any grid and
    mode compare."""
    import jax

    state = trainer.step.canonical_state(state)
    return jax.device_get({name: field(state, name) for name in ("params", "opt_state")})


# Tolerances of the final state (`assert_states_match`), by what differs from the reference run.
# The optimizer's moments carry the gradients (and any scale error of them) linearly; the
# parameters get more room, since Adam divides each element's step by that element's own gradient
# magnitude, so that where a gradient is small its rounding differences reach the parameter almost
# undamped (and feed back into the next gradients). Measured, largest leaf (moments, parameters),
# fp32: gpt-tiny on data=8 against one device (3.6e-6, 3.5e-5 after 4 steps); gpt-tiny-deep on
# pipe=4 × data=2 (from 2.3e-6, 9e-5 to 1.2e-4, 4.7e-4 in three runs of the same test: the sums
# of XLA:CPU's collectives are not reproducible to the last bit from run to run, and Adam
# amplifies that), on pipe=2 × row=2 × data=2 (1.6e-4, 9.9e-4 after 4 steps); gpt-tiny on
# data=2 × row=2 × col=2 (2.1e-5, 6.3e-4); the ViT on data=2 × row=2 × col=2 (1.4e-4, 1.4e-3).
# The bounds leave room for that variation; a wrong gradient moves some leaf's moments by O(1).
FP32 = dict(rtol=1e-3, params_rtol=1e-2)
# In 16-bit compute, and with compressed gradients, rounding (quantization) noise is far above
# fp32's: a zero gradient comes out at up to 3e-4 of the largest (the ViT's key bias in bf16),
# and the noise on small gradients flips Adam's steps, so that the parameters are not comparable
# leaf by leaf (the ViT's biases in bf16: 1.9); the moments are, more loosely. Measured:
# - bfloat16 compute on another grid: moments 6.1e-2 (llama-tiny), 5.7e-2 (ViT);
BF16 = dict(rtol=0.1, params_rtol=None, zero_gradient=1e-3)
# - float16 compute on another grid: moments 0.11 (the NNX regressor on data=2 × row=2 × col=2);
FP16 = dict(rtol=0.3, params_rtol=None, zero_gradient=1e-3)
# - CGX-compressed gradients against exact ones: moments 3.3e-2 (gpt-tiny, 8 bits), 0.23 (the
#   regressor, 4 bits without error feedback), 0.32 (resnet-tiny, 8 bits), 0.44 (the Llama
#   checkpoint, 8 bits, data=8). Any scale error of the gradients (×2) moves them by 1 or more.
COMPRESSED = dict(rtol=0.7, params_rtol=None, zero_gradient=1e-3)


def state_tolerances(dtype: str = "float32") -> dict:
    """The tolerance set (FP32, BF16, FP16) of a run in compute `dtype` against a reference in the
    same dtype on another grid."""
    return {"bfloat16": BF16, "float16": FP16}.get(dtype, FP32)


def _parameter_path(name: str) -> str:
    """The parameter a leaf of a state tree belongs to: `['params']['a']['b']` and
    `['opt_state'][0].mu['a']['b']` both give `['a']['b']` (a gradient tree's leaf: its name)."""
    if name.startswith("['params']"):
        return name[len("['params']"):]
    for moment in (".mu[", ".nu["):
        if moment in name:
            return name[name.index(moment) + 3:]
    return name


def zero_gradient_parameters(flat: dict, threshold: float = ZERO_GRADIENT) -> set[str]:
    """Parameter paths whose gradient is at most `threshold` of the largest (zero up to rounding,
    see ZERO_GRADIENT), from a flattened reference: its Adam second moments `nu` (a state), or its
    leaves (gradients)."""
    import numpy as np

    nu = {_parameter_path(k): v for k, v in flat.items() if ".nu[" in k}
    source, power = (nu, 2) if nu else (
        {k: v for k, v in flat.items() if np.issubdtype(v.dtype, np.floating)}, 1)
    size = {k: float(np.max(np.abs(v))) if v.size else 0.0 for k, v in source.items()}
    top = max(size.values(), default=0.0)
    return {k for k, v in size.items() if v <= threshold ** power * top}


def assert_states_match(got, want, rtol: float = FP32["rtol"],
                        params_rtol: float | None = FP32["params_rtol"],
                        skip=(), zero_gradient: float | None = ZERO_GRADIENT) -> dict[str, float]:
    """Trees `got` and `want` (states as `comparable_state` gives them, or any trees such as
    gradients) equal leaf by leaf: integer leaves exactly, float leaves each within a tolerance of
    their own largest magnitude (max |a - b| / max |b|): `params_rtol` under a top-level `params`
    key (None: not compared), `rtol` elsewhere (see FP32 and the other tolerance sets).
    Left out: the parameters whose reference gradient is at most `zero_gradient` of the largest
    (zero up to rounding: values and moments; `zero_gradient_parameters`; None: none left out);
    leaves whose path holds one of the `skip` strings.
    Returns the largest relative difference under each top-level key."""
    import jax
    import numpy as np

    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x)  # noqa: E731
                         for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    got, want = flat(got), flat(want)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    zero = set() if zero_gradient is None else zero_gradient_parameters(want, zero_gradient)
    errors, bad = {}, {}
    for name, w in want.items():
        part = name[2:].split("'", 1)[0]
        tolerance = params_rtol if part == "params" else rtol
        if tolerance is None or _parameter_path(name) in zero or any(s in name for s in skip):
            continue
        g = got[name]
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        err = errors.setdefault(part, {})[name] = relative_difference(g, w)
        if err > tolerance:
            bad[name] = err
    assert errors, "nothing compared"
    _measured(**{part: max(e.values()) for part, e in errors.items()})
    assert not bad, f"{len(bad)} leaves differ more than allowed: " + ", ".join(
        f"{k}: {v:.2e}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    return {part: max(e.values()) for part, e in errors.items()}


def lm_batch(trainer, tokens, step, seed_offset=0):
    """Language-model batch `step` of `tokens` for `trainer`'s options, placed on its devices."""
    from axonn_jax.run.data import lm_batch as make

    o = trainer.options
    return trainer.place(make(tokens, o.run.seed + seed_offset, step, o.data.batch_size,
                              o.data.seq_len))


def lm_batches(trainer, tokens, seed_offset=0):
    """`step -> global host batch` of language-model batches of `tokens` (see `lm_batch`)."""
    from axonn_jax.run.data import lm_batch as make

    o = trainer.options
    return lambda step: make(tokens, o.run.seed + seed_offset, step, o.data.batch_size,
                             o.data.seq_len)


def preset_trajectory(devices, family, name, grid=None, steps=3, **options):
    """Summary of `steps` steps of preset `name` of the model module `family` (`models.unet`,
    `models.resnet`: `PRESETS`, `stacked(config)`, `config.batches`) on one batch of its own
    drawn data, repeated (so that its loss must fall), no validation, on `grid` (a dict of
    ParallelConfig sizes; default one device), warm-up off: `history` (per-step records) and
    `state` (`comparable_state`)."""
    from axonn_jax import ParallelConfig
    from axonn_jax.train import TrainOptions, train
    from user_models import repeated

    grid, config = ParallelConfig(**(grid or {})), family.PRESETS[name]
    summary = train(TrainOptions(**{"steps": steps, "batch_size": 8, "lr": 1e-2, "parallel": grid,
                                    **PARITY, **options}),
                    model=family.stacked(config), data=repeated(config.batches(0, 8)),
                    devices=devices[:grid.num_devices])
    return {"history": summary["history"],
            "state": comparable_state(summary["trainer"], summary["state"])}
