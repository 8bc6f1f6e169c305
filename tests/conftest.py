"""Every test runs on 8 simulated CPU devices; set before JAX starts."""
import atexit
import os
import shutil
import tempfile

# LLVM optimization level 0 halves XLA:CPU's compile time, most of a tiny test's time; losses
# agree with the default level's to ~1e-7.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
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


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests need 8 simulated devices, JAX sees {len(devs)}"
    return devs


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

# Leaves whose true gradient is exactly zero, so that their values after a few Adam steps are
# rounding noise amplified to about the learning rate (mu / sqrt(nu) of noise is ±1): attention
# key biases (the softmax is invariant to adding q·b to every key's score).
ZERO_GRADIENT = ("['key']['bias']", "['k']['bias']")


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


def assert_steps_match(got, want, rtol: float = 1e-5, norm_rtol: float | None = None) -> float:
    """Per step, the loss and the pre-clip gradient norm of `got` equal `want`'s (records, see
    `records`) within `rtol` (`norm_rtol` for the norms, default `rtol`), each relative to its own
    value. Returns the largest relative difference seen."""
    got, want = records(got), records(want)
    assert len(got) == len(want), (len(got), len(want))
    worst = 0.0
    for key, tol in (("loss", rtol), ("grad_norm", rtol if norm_rtol is None else norm_rtol)):
        diffs = [relative_difference(g[key], w[key]) for g, w in zip(got, want)]
        assert max(diffs) <= tol, (key, [(g[key], w[key]) for g, w in zip(got, want)], diffs)
        worst = max(worst, *diffs)
    return worst


def comparable_state(trainer, state) -> dict:
    """`{'params', 'opt_state'}` of a train state as host arrays, as checkpoints hold them
    (`TrainStep.canonical_state`: the model's layer order, the fp32 masters as `params` and the
    inner optimizer state as `opt_state` under optimizer offload), so that states of any grid and
    mode compare."""
    import jax

    state = trainer.step.canonical_state(state)
    return jax.device_get({"params": field(state, "params"), "opt_state": field(state, "opt_state")})


def assert_states_match(got, want, rtol: float = 1e-5, params_rtol: float = 1e-4,
                        skip=ZERO_GRADIENT) -> dict[str, float]:
    """Trees `got` and `want` (see `comparable_state`) equal leaf by leaf: integer leaves exactly,
    float leaves each within a tolerance of their own largest magnitude (max |a - b| / max |b|):
    `params_rtol` under `params`, `rtol` elsewhere (the optimizer's moments, which carry any scale
    error of the gradients). The parameters get more room: Adam divides each element's step by
    that element's own gradient magnitude, so where a gradient is small its rounding differences
    (other sums, other orders) reach the parameter almost undamped (measured 3.5e-5 after 4 steps
    of gpt-tiny at lr 3e-3, data=8 against one device). Leaves whose path holds one of the `skip`
    strings are left out (`ZERO_GRADIENT` by default). Returns the largest relative difference
    of each part (`params`, `opt_state`)."""
    import jax
    import numpy as np

    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x)  # noqa: E731
                         for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    got, want = flat(got), flat(want)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    errors, bad = {}, {}
    for name, w in want.items():
        if any(s in name for s in skip):
            continue
        g = got[name]
        assert g.shape == w.shape, (name, g.shape, w.shape)
        if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        part = name[2:].split("'", 1)[0]
        err = errors.setdefault(part, {})[name] = relative_difference(g, w)
        if err > (params_rtol if part == "params" else rtol):
            bad[name] = err
    assert errors, "nothing compared"
    assert not bad, f"{len(bad)} leaves differ more than allowed: " + ", ".join(
        f"{k}: {v:.2e}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1]))
    return {part: max(e.values()) for part, e in errors.items()}


def lm_batch(trainer, tokens, step, seed_offset=0):
    """Language-model batch `step` of `tokens` for `trainer`'s options, placed on its devices."""
    from axonn_jax.run.data import lm_batch as make

    o = trainer.options
    return trainer.place(make(tokens, o.seed + seed_offset, step, o.batch_size, o.seq_len))


def lm_batches(trainer, tokens, seed_offset=0):
    """`step -> global host batch` of language-model batches of `tokens` (see `lm_batch`)."""
    from axonn_jax.run.data import lm_batch as make

    o = trainer.options
    return lambda step: make(tokens, o.seed + seed_offset, step, o.batch_size, o.seq_len)


def preset_trajectory(devices, family, name, grid=None, steps=3, **options):
    """Summary of `steps` steps of preset `name` of the model module `family` (`models.unet`,
    `models.resnet`: `PRESETS`, `stacked(config)`, `config.batches`) on its own drawn data, no
    validation, on `grid` (a dict of ParallelConfig sizes; default one device), warm-up off:
    `history` (per-step records) and `state` (`comparable_state`)."""
    from axonn_jax import ParallelConfig
    from axonn_jax.train import TrainOptions, train

    grid, config = ParallelConfig(**(grid or {})), family.PRESETS[name]
    summary = train(TrainOptions(**{"steps": steps, "batch_size": 8, "lr": 1e-2, "parallel": grid,
                                    **PARITY, **options}),
                    model=family.stacked(config), data=config.batches(0, 8),
                    devices=devices[:grid.num_devices])
    return {"history": summary["history"],
            "state": comparable_state(summary["trainer"], summary["state"])}
