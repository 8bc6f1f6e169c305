"""Pipeline parallelism: schedule tables, gradients and loss trajectories equal to one device, the
memory bound of 1F1B, and clear errors."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import axonn_jax
from axonn_jax import ParallelConfig
from axonn_jax.run import data as data_lib
from axonn_jax.run.cli import main as cli_main
from axonn_jax.analysis import hlo
from axonn_jax.parallel.pipeline import make_schedule
from axonn_jax.train import TrainOptions, build_trainer

from conftest import lm_batch, relative_difference

MODEL = "gpt-tiny-deep"  # 8 layers: splits over 2, 4 and 8 stages
BASE = dict(model=MODEL, batch_size=16, seq_len=16, eval_batches=1, eval_every=100)


# ---------------------------------------------------------------- schedule tables (pure Python)

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_schedule_table(name, p, factor):
    m = factor * p
    s = make_schedule(name, p, m)
    f, b = s.forward, s.backward
    tick = {}
    for stage in range(p):
        assert sorted(f[:, stage][f[:, stage] >= 0]) == list(range(m))
        assert sorted(b[:, stage][b[:, stage] >= 0]) == list(range(m))
        for t in range(s.num_ticks):
            if f[t, stage] >= 0:
                tick["F", f[t, stage], stage] = t
            if b[t, stage] >= 0:
                tick["B", b[t, stage], stage] = t
    for mb in range(m):
        for stage in range(p):
            if stage:
                assert tick["F", mb, stage] > tick["F", mb, stage - 1]
            if stage < p - 1:
                assert tick["B", mb, stage] > tick["B", mb, stage + 1]
            assert tick["B", mb, stage] >= tick["F", mb, stage]  # F runs first within a tick
        if name == "gpipe":
            assert tick["B", mb, p - 1] >= max(tick["F", i, p - 1] for i in range(m))
    # With every stage costing the same, the lockstep ticks leave exactly (P−1)/(M+P−1) idle,
    # whatever a backward costs against a forward.
    for backward_cost in (1.0, 2.0, 3.0):
        step = s.step_time(1.0, backward_cost)
        assert 1 - m * (1 + backward_cost) / step == pytest.approx(s.predicted_bubble())
    # Stashed stage inputs: all M for GPipe, at most 2P−3 (bounded by stages) for 1F1B.
    if name == "gpipe":
        assert s.stash_slots == m
    else:
        assert s.stash_slots == (1 if p <= 2 else min(m, 2 * p - 3))


def test_bad_schedule_name():
    with pytest.raises(ValueError, match="--schedule must be one of"):
        make_schedule("zigzag", 2, 2)


# ---------------------------------------------------------------- the single-device reference

STEPS = 10


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    """A small token file (this file's bytes, repeated): quicker to load than the default corpus."""
    path = tmp_path_factory.mktemp("corpus") / "tokens.npy"
    text = open(__file__, "rb").read() * 4
    np.save(path, np.frombuffer(text, np.uint8).astype(np.int32))
    return str(path)


@pytest.fixture(scope="module")
def reference(devices, corpus_path):
    """Initial state (host), a batch with its loss and gradients, and a 10-step loss trajectory."""
    trainer = build_trainer(TrainOptions(**BASE, steps=STEPS), devices[:1])
    corpus = data_lib.Corpus.load(corpus_path, min_tokens=BASE["seq_len"] + 2)
    state = trainer.init_state()
    initial = jax.device_get(state)
    batch = jax.device_get(lm_batch(trainer, corpus.train, 0))
    loss, grads = jax.jit(jax.value_and_grad(trainer.model.loss))(state["params"], batch)
    trajectory = []
    for step in range(STEPS):
        state, metrics = trainer.step(state, lm_batch(trainer, corpus.train, step))
        trajectory.append(float(metrics["loss"]))
    assert trajectory[-1] < trajectory[0]
    return dict(initial=initial, batch=batch, loss=float(loss), grads=jax.device_get(grads),
                trajectory=trajectory, corpus=corpus)


def _pipeline_trainer(devices, grid, schedule, m):
    config = ParallelConfig(**grid)
    options = TrainOptions(**BASE, steps=STEPS, parallel=config, microbatches=m, schedule=schedule)
    return build_trainer(options, devices[:config.num_devices])


def _place(trainer, tree):
    """`tree` (host copies of a state) placed like `trainer`'s state."""
    return jax.device_put(tree, jax.tree.map(lambda s: s.sharding, trainer.init_state(abstract=True)))


# ---------------------------------------------------------------- gradients equal the reference

@pytest.mark.parametrize("grid, schedule, m", [
    (dict(pipe=4, data=2), "1f1b", 4),
    (dict(pipe=8), "gpipe", 16),
])
def test_gradients_equal_reference(reference, devices, grid, schedule, m):
    trainer = _pipeline_trainer(devices, grid, schedule, m)
    params = _place(trainer, reference["initial"])["params"]
    batch = trainer.place(reference["batch"])
    # (params, batch, loss scale, step, reducer state) -> (loss, grads, reducer state)
    args = (params, batch, np.float32(1.0), np.int32(0), None)
    compiled = jax.jit(trainer.bound.loss_and_grads).lower(*args).compile()
    # Activations and cotangents cross stages as point-to-point messages.
    assert "collective-permute" in compiled.as_text()
    loss, grads, _ = compiled(*args)
    assert grads["blocks"]["query"]["kernel"].sharding.spec == P("pipe")
    assert relative_difference(float(loss), reference["loss"]) <= 1e-6
    assert jax.tree.structure(grads) == jax.tree.structure(reference["grads"])
    # One vector: some leaves (the key bias) have true gradient 0 and only round-off.
    flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    ref_flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(reference["grads"])])
    assert relative_difference(flat, ref_flat) <= 1e-5


# ---------------------------------------------------------------- loss trajectories

@pytest.mark.parametrize("grid, schedule, m, steps", [
    (dict(pipe=4, data=2), "gpipe", 8, STEPS),
    (dict(pipe=8), "1f1b", 8, 3),
])
def test_pipeline_trajectory(reference, devices, grid, schedule, m, steps):
    trainer = _pipeline_trainer(devices, grid, schedule, m)
    state = _place(trainer, reference["initial"])
    got = []
    for step in range(steps):
        state, metrics = trainer.step(state, lm_batch(trainer, reference["corpus"].train, step))
        got.append(float(metrics["loss"]))
    assert relative_difference(got, reference["trajectory"][:steps]) <= 1e-5
    # The update keeps the layout: blocks (and their Adam moments) split over pipe.
    assert state["params"]["blocks"]["mlp_up"]["kernel"].sharding.spec == P("pipe")
    assert state["opt_state"][0].mu["blocks"]["mlp_up"]["kernel"].sharding.spec == P("pipe")
    assert state["params"]["embed"]["wte"]["embedding"].sharding.spec == P()


def test_offloaded_optimizer_with_pipeline_stages(reference, devices):
    """Host-resident masters and moments with `--pipe 4 --data 2`: the same trajectory as one
    device, the state on the host split over `pipe` like its parameters, and an update that moves
    no block state between stages (no all-gather or all-to-all in the compiled step)."""
    config = ParallelConfig(pipe=4, data=2)
    trainer = build_trainer(TrainOptions(**BASE, steps=3, parallel=config, microbatches=4,
                                         offload_optimizer=True), devices)
    state = trainer.init_state()
    # The update alone: only the gradient norm's all-reduce, no block state crossing stages.
    update = jax.jit(trainer.bound.update).lower(state, state["params"]).compile()
    assert {c.kind for c in hlo.collectives(update.as_text())} <= {"all-reduce"}
    batch = lm_batch(trainer, reference["corpus"].train, 0)
    compiled = trainer.step.lower(state, batch).compile()
    got = []
    for step in range(3):
        state, metrics = compiled(state, lm_batch(trainer, reference["corpus"].train, step))
        got.append(float(metrics["loss"]))
    assert relative_difference(got, reference["trajectory"][:3]) <= 1e-5
    master = state["opt_state"]["master"]["blocks"]["mlp_up"]["kernel"]
    assert master.sharding.memory_kind == "pinned_host" and master.sharding.spec == P("pipe")


def test_remat_inside_pipeline_stages(reference, devices):
    """`--remat full|offload` with `--pipe 2`: each stage's backward tick checkpoints its 4 blocks
    (same trajectory as one device) and holds less at its peak than keeping every block's
    intermediates."""
    temps = {}
    for remat in ("none", "full", "offload"):
        trainer = build_trainer(TrainOptions(**BASE, steps=2, parallel=ParallelConfig(pipe=2),
                                             microbatches=2, remat=remat), devices[:2])
        state = trainer.init_state()
        compiled = trainer.step.lower(state, lm_batch(trainer, reference["corpus"].train, 0)).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
        if remat == "none":
            continue
        got = []
        for step in range(2):
            state, metrics = compiled(state, lm_batch(trainer, reference["corpus"].train, step))
            got.append(float(metrics["loss"]))
        assert relative_difference(got, reference["trajectory"][:2]) <= 1e-5
    assert temps["full"] < temps["none"]


def test_remat_auto_with_pipeline_is_refused(devices):
    with pytest.raises(NotImplementedError, match="remat='auto' with pipe > 1"):
        build_trainer(TrainOptions(**BASE, parallel=ParallelConfig(pipe=2), microbatches=2,
                                   remat="auto", memory_budget_gb=1.0), devices[:2])


def test_cli_pipeline_with_data_trajectory(reference, corpus_path, tmp_path):
    """`--pipe 2 --microbatches 4 --schedule 1f1b` on 8 devices (data = 4), 10 steps."""
    out = tmp_path / "m.jsonl"
    rc = cli_main(["train", "--model", MODEL, "--steps", str(STEPS), "--batch-size", "16",
                   "--seq-len", "16", "--eval-batches", "1", "--eval-every", "100",
                   "--pipe", "2", "--microbatches", "4", "--schedule", "1f1b",
                   "--data", corpus_path, "--metrics-out", str(out)])
    assert rc == 0
    got = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    assert relative_difference(got, reference["trajectory"]) <= 1e-5


# ---------------------------------------------------------------- memory

ROWS, WIDTH, LAYERS = 512, 64, 1  # a toy stack whose stashed activations dominate its temporaries


def _toy_temp_bytes(devices, p, m, schedule):
    """Compiled temporary bytes of the engine on a stack of `tanh(x W)` layers, M microbatches of
    ROWS rows (the microbatch size is fixed, so the batch grows with M)."""
    from axonn_jax._compat import ensure_varying, shard_map
    from axonn_jax.parallel.pipeline import pipeline_loss_and_grads

    mesh = jax.sharding.Mesh(np.asarray(devices[:p]), ("pipe",))
    sched = make_schedule(schedule, p, m)
    embed = lambda table, batch: table[batch["tokens"]]
    stage = lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
    head = lambda v, x, batch: jnp.mean((x @ v - batch["targets"]) ** 2)

    def local(params, batch):
        params = ensure_varying(params, ("pipe",))
        return pipeline_loss_and_grads(embed, stage, head, params, batch, sched)

    specs = (P(), P("pipe"), P())
    fn = shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs),
                   axis_names={"pipe"})
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = (shape(16, WIDTH), shape(LAYERS * p, WIDTH, WIDTH), shape(WIDTH))
    args = (params, {"tokens": jax.ShapeDtypeStruct((ROWS * m,), jnp.int32),
                     "targets": shape(ROWS * m)})
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_memory_bounded_gpipe_grows(devices):
    """M = P and M = 4P at a fixed microbatch size: 1F1B's compiled temporary memory stays put,
    GPipe's grows by the 3P extra stashed stage inputs (ROWS · WIDTH float32 each)."""
    p = 4
    stash_entry = ROWS * WIDTH * 4
    one_f1b = {m: _toy_temp_bytes(devices, p, m, "1f1b") for m in (p, 4 * p)}
    gpipe = {m: _toy_temp_bytes(devices, p, m, "gpipe") for m in (p, 4 * p)}
    assert one_f1b[4 * p] <= 1.3 * one_f1b[p]
    assert gpipe[4 * p] - gpipe[p] >= 0.9 * 3 * p * stash_entry
    assert gpipe[4 * p] >= 1.5 * gpipe[p]


# ---------------------------------------------------------------- the Flax transform

class _Residual(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, carry):
        return x + jnp.tanh(nn.Dense(self.width)(x)), carry


class _Net(nn.Module):
    mesh: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x, _ = axonn_jax.pipeline(_Residual, 8, mesh=self.mesh, microbatches=4)(16, name="stack")(
            x, None)
        return nn.Dense(1)(x)


def test_flax_pipeline_transform(devices):
    """`axonn_jax.pipeline` keeps nn.scan's parameters and, over pipe = 4, its loss and gradients."""
    x = jax.random.normal(jax.random.key(1), (8, 5))
    params = _Net().init(jax.random.key(0), x)
    scanned = nn.scan(_Residual, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=8)(16)
    expected = scanned.init(jax.random.key(0), jnp.ones((8, 16)), None)["params"]
    assert jax.tree.map(jnp.shape, params["params"]["stack"]) == jax.tree.map(jnp.shape, expected)

    mesh = axonn_jax.make_mesh(ParallelConfig(pipe=4), devices[:4])
    placed = jax.tree_util.tree_map_with_path(lambda path, a: jax.device_put(a, NamedSharding(
        mesh, P("pipe") if "stack" in jax.tree_util.keystr(path) else P())), params)
    loss = lambda net, p: jnp.mean(net.apply(p, x) ** 2)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss(_Net(), p)))(params)
    step = jax.jit(jax.value_and_grad(lambda p: loss(_Net(mesh), p))).lower(placed).compile()
    assert "collective-permute" in step.as_text()
    got_loss, got_grads = step(placed)
    assert relative_difference(got_loss, ref_loss) <= 1e-6
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        assert relative_difference(g, r) <= 1e-5


# ---------------------------------------------------------------- clear errors

def test_layers_not_divisible_by_stages(devices):
    with pytest.raises(ValueError, match="num_layers = 8 is not divisible by pipe = 3"):
        build_trainer(TrainOptions(model=MODEL, parallel=ParallelConfig(pipe=3)), devices[:3])


@pytest.mark.parametrize("argv, message", [
    (["--pipe", "2", "--microbatches", "3"], "not divisible by data × microbatches = 4 × 3"),
    (["--microbatches", "2"], "--microbatches 2 needs --pipe > 1"),
])
def test_cli_bad_pipeline_input(argv, message, capsys):
    assert cli_main(["train", "--model", MODEL, "--steps", "1", "--batch-size", "16", *argv]) == 2
    assert message in capsys.readouterr().err
