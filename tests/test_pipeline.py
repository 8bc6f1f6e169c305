"""Pipeline parallelism: schedule tables, gradients and loss trajectories equal to one device, the
memory bound of 1F1B, and clear errors."""

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
from axonn_jax.analysis import comm_model as cm, hlo
from axonn_jax.models.gpt import get_config
from axonn_jax.parallel.pipeline import make_schedule
from axonn_jax.train import TrainOptions, build_trainer

from conftest import (PARITY, adam_state, assert_learns, assert_states_match, assert_steps_match,
                      comparable_state, field, lm_batch, lm_batches, metrics_file,
                      relative_difference, run_steps)

MODEL = "gpt-tiny-deep"  # 8 layers: splits over 2, 4 and 8 stages
# Warm-up off; the default clip_norm = 1 clips (the gradient norms stay above it, asserted).
BASE = dict(model=MODEL, batch_size=16, seq_len=16, eval_batches=1, eval_every=100, **PARITY)


# ---------------------------------------------------------------- schedule tables (pure Python)

def _ticks(s):
    """{(kind, microbatch, virtual stage): tick} of a schedule, each operation exactly once."""
    p, m, v = s.num_stages, s.num_microbatches, s.virtual_stages
    tick = {}
    for kind, mbs, chunks in (("F", s.forward, s.forward_chunk), ("B", s.backward, s.backward_chunk),
                              ("W", s.weight, s.weight_chunk)):
        for t, stage in zip(*np.nonzero(mbs >= 0)):
            key = (kind, int(mbs[t, stage]), int(chunks[t, stage]) * p + int(stage))
            assert key not in tick, key
            tick[key] = int(t)
    kinds = "FBW" if s.split_backward else "FB"
    assert set(tick) == {(k, mb, j) for k in kinds for mb in range(m) for j in range(p * v)}
    return tick


def _check_slots(s, tick):
    """Replay the slot tables: every F and B reads its own microbatch's input (and cotangent), every W
    the residuals its B left, and no slot is overwritten while a later reader still needs it."""
    p, v = s.num_stages, s.virtual_stages
    for stage in range(p):
        stash, cots, wstash = {}, {}, {}
        for t in range(s.num_ticks):
            slot = s.slots["act_store"][t, stage]
            if slot >= 0:  # the sender's forward of the previous tick
                src = (stage - 1) % p
                mb, c = s.forward[t - 1, src], s.forward_chunk[t - 1, src] + (stage == 0)
                stash[slot] = (mb, c)
            slot = s.slots["cot_store"][t, stage]
            if slot >= 0:
                src = (stage + 1) % p
                cots[slot] = (s.backward[t - 1, src], s.backward_chunk[t - 1, src] - (stage == p - 1))
            for kind, mbs, chunks, table in (("F", s.forward, s.forward_chunk, "act_forward"),
                                             ("B", s.backward, s.backward_chunk, "act_backward")):
                if mbs[t, stage] < 0:
                    continue
                item, j = (mbs[t, stage], chunks[t, stage]), chunks[t, stage] * p + stage
                assert (s.slots[table][t, stage] < 0) == (j == 0)  # the first embeds again
                if j:
                    assert stash[s.slots[table][t, stage]] == item, (kind, t, stage)
                if kind == "B" and j < p * v - 1:
                    assert cots[s.slots["cot_backward"][t, stage]] == item
            if s.backward[t, stage] >= 0 and s.split_backward:
                wstash[s.slots["weight_store"][t, stage]] = s.backward[t, stage]
            if s.weight[t, stage] >= 0:
                assert wstash.pop(s.slots["weight_read"][t, stage]) == s.weight[t, stage]
        assert len(stash) <= s.stash_slots and len(cots) <= s.cotangent_slots


SCHEDULE_CASES = [(name, 1) for name in ("gpipe", "1f1b", "zb-h1")] + \
    [("interleaved-1f1b", 2), ("interleaved-1f1b", 4)]


@pytest.mark.parametrize("name, v", SCHEDULE_CASES)
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_schedule_table(name, v, p, factor):
    m = factor * p
    s = make_schedule(name, p, m, v)
    tick = _ticks(s)
    for (kind, mb, j), t in tick.items():
        if kind == "F" and j:
            assert t > tick["F", mb, j - 1]
        if kind == "B":
            assert t > tick["B", mb, j + 1] if j < p * v - 1 else t >= tick["F", mb, j]
        if kind == "W":
            assert t >= tick["B", mb, j]  # W runs after its B (within a tick: F, B, W)
        if kind == "B" and name == "gpipe":
            assert t >= max(tick["F", i, p - 1] for i in range(m))
    _check_slots(s, tick)
    # Equal stages: the lockstep ticks leave each stage idle exactly the published time, whatever
    # the costs of forward, input gradient and weight gradient (ZB-H1: once M ≥ 2P−2, when a W
    # costs no more than an F or a B).
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.7), (1.0, 3.0, 0.0)):
        if s.split_backward:
            if w == 0.0 or m < 2 * p - 2:
                continue
            step = s.step_time(f, b, w)
        else:
            step = s.step_time(f / v, (b + w) / v)
        assert 1 - m * (f + b + w) / step == pytest.approx(s.predicted_bubble(f, b, w))
    one_f1b = make_schedule("1f1b", p, m)
    if name == "gpipe":
        assert s.stash_slots == (m if p > 1 else 1)
    elif name == "1f1b":
        assert s.stash_slots == (1 if p <= 2 else min(m, 2 * p - 3))
        assert s.in_flight == min(m, 2 * p - 1)
    elif name == "zb-h1":  # at 1F1B's memory: as many microbatches in flight, its stage inputs
        assert s.in_flight == one_f1b.in_flight and s.stash_slots == one_f1b.stash_slots
    else:  # interleaved: more chunk inputs in flight, bounded whatever M is
        assert s.stash_slots <= (v - 1) * p + 2 * p


def test_zero_bubble_and_interleaved_bubbles():
    """The published bubbles (equal costs of forward, input and weight gradient): ZB-H1 idles a
    third as long as 1F1B, interleaving over V chunks a V-th."""
    p, m = 4, 16
    one_f1b = make_schedule("1f1b", p, m).step_time(1, 2) - 3 * m
    assert make_schedule("zb-h1", p, m).step_time(1, 1, 1) - 3 * m == pytest.approx(one_f1b / 3)
    for v in (2, 4):
        got = make_schedule("interleaved-1f1b", p, m, v).step_time(1 / v, 2 / v) - 3 * m
        assert got == pytest.approx(one_f1b / v)


@pytest.mark.parametrize("args, message", [
    (("zigzag", 2, 2), "--schedule must be one of"),
    (("1f1b", 2, 2, 2), "--virtual-stages 2 needs --schedule interleaved-1f1b"),
    (("interleaved-1f1b", 4, 6, 2), "--microbatches 6 is not a multiple of 4"),
])
def test_bad_schedule(args, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(*args)


# ---------------------------------------------------------------- the single-device reference

STEPS = 10


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    """A small token file (this file's bytes, repeated): quicker to load than the default corpus."""
    path = tmp_path_factory.mktemp("corpus") / "tokens.npy"
    text = open(__file__, "rb").read() * 4
    np.save(path, np.frombuffer(text, np.uint8).astype(np.int32))
    return str(path)


SNAPSHOTS = (1, 2, 3, STEPS)  # the steps after which the reference keeps its state


@pytest.fixture(scope="module")
def reference(devices, corpus_path):
    """Initial state (host), a batch with its loss and gradients, a 10-step trajectory (per-step
    records) and the state after each of SNAPSHOTS steps (`comparable_state`)."""
    trainer = build_trainer(TrainOptions(**BASE, steps=STEPS), devices[:1])
    corpus = data_lib.Corpus.load(corpus_path, min_tokens=BASE["seq_len"] + 2)
    state = trainer.init_state()
    initial = jax.device_get(state.as_dict())
    batch = jax.device_get(lm_batch(trainer, corpus.train, 0))
    loss, grads = jax.jit(jax.value_and_grad(trainer.model.loss))(field(state, "params"), batch)
    trajectory, states, done = [], {}, 0
    for until in SNAPSHOTS:
        state, got = run_steps(trainer, state, lm_batches(trainer, corpus.train), until - done,
                               done)
        trajectory += got
        states[until], done = comparable_state(trainer, state), until
    assert_learns(trajectory, 0.9)  # measured 0.80 after 10 steps
    assert min(r["grad_norm"] for r in trajectory) > trainer.options.optimizer.clip_norm  # clipping fires
    return dict(initial=initial, batch=batch, loss=float(loss), grads=jax.device_get(grads),
                trajectory=trajectory, states=states, corpus=corpus)


def assert_follows_reference(reference, trainer, state, got):
    """Records `got` of the first steps and the state after them equal the reference's."""
    assert_steps_match(got, reference["trajectory"][:len(got)])
    assert_states_match(comparable_state(trainer, state), reference["states"][len(got)])


def _pipeline_trainer(devices, grid, schedule, m, v=1):
    config = ParallelConfig(**grid)
    options = TrainOptions(**BASE, steps=STEPS, parallel=config, microbatches=m, schedule=schedule,
                           virtual_stages=v)
    return build_trainer(options, devices[:config.num_devices])


def _place(trainer, tree):
    """`tree` (host copies of a state, layers in the model's order) placed like `trainer`'s state,
    in the order it stores its layers."""
    placed = jax.device_put(tree, jax.tree.map(lambda s: s.sharding,
                                               trainer.init_state(abstract=True).as_dict()))
    return trainer.step.canonical_state(placed, inverse=True)


# ---------------------------------------------------------------- gradients equal the reference

@pytest.mark.parametrize("grid, schedule, m, v", [
    (dict(pipe=4, data=2), "1f1b", 4, 1),
    (dict(pipe=8), "gpipe", 16, 1),
    (dict(pipe=2, row=2, col=2), "zb-h1", 2, 1),  # tensor-parallel stages: split shard_maps
    (dict(pipe=2, data=4), "interleaved-1f1b", 4, 2),
])
def test_gradients_equal_reference(reference, devices, grid, schedule, m, v):
    trainer = _pipeline_trainer(devices, grid, schedule, m, v)
    params = _place(trainer, reference["initial"]).params
    batch = trainer.place(reference["batch"])
    # (params, batch, loss scale, step key, reducer state) -> (loss, grads, reducer state, metrics)
    args = (params, batch, np.float32(1.0), jax.random.key(0), None)
    compiled = jax.jit(trainer.bound.loss_and_grads).lower(*args).compile()
    # Activations and cotangents cross stages as point-to-point messages, as many as the
    # communication model counts from the tick table.
    work = cm.Workload(get_config(MODEL), BASE["batch_size"], BASE["seq_len"], compute_bytes=4,
                       microbatches=m, schedule=schedule, virtual_stages=v, platform="cpu")
    assert hlo.wire_bytes(compiled.as_text())["collective-permute"] == \
        cm.bytes_by_kind(work, ParallelConfig(**grid))["collective-permute"]
    loss, grads, _, _ = compiled(*args)
    assert grads["blocks"]["query"]["kernel"].sharding.spec[0] == "pipe"
    grads = trainer.step.canonical_params(grads)
    assert relative_difference(float(loss), reference["loss"]) <= 1e-6
    assert jax.tree.structure(grads) == jax.tree.structure(reference["grads"])
    # Leaf by leaf (the key biases' true gradient is 0: only round-off, left out).
    assert_states_match(jax.device_get(grads), reference["grads"])


def test_zero_bubble_defers_the_weight_gradients(devices):
    """ZB-H1's W operation computes the blocks' kernel gradients (dot products), its B the input
    gradient; B and W together do the work of 1F1B's backward, not more (compiled FLOPs of one
    microbatch's operations on a 4-layer stage)."""
    from axonn_jax.parallel.backward_split import split_backward

    trainer = _pipeline_trainer(devices, dict(pipe=2, data=4), "zb-h1", 2)
    fns = trainer.bound.fns
    params = jax.eval_shape(fns.init, jax.random.key(0))["blocks"]
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((4, *a.shape[1:]), a.dtype), params)
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)

    def backward(p, x, g):
        (_, aux), vjp = jax.vjp(fns.run_blocks, p, x)  # blocks give (x, aux)
        g_p, g_x = vjp((g, jax.tree.map(jnp.zeros_like, aux)))
        return g_x, g_p

    split = split_backward(backward, (params, x, x), w_free=(True, False, False), num_b_outputs=1)
    assert not split.early_index  # every kernel gradient waits for W
    residuals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in split.residual_avals]
    flops = lambda f, *a: jax.jit(f).lower(*a).compile().cost_analysis()["flops"]  # noqa: E731
    b, w, full = flops(split.b, params, x, x), flops(split.w, (params,), residuals), \
        flops(backward, params, x, x)
    forward = flops(fns.run_blocks, params, x)
    assert w > 0.5 * forward and b + w <= 1.02 * full


# ---------------------------------------------------------------- loss trajectories

@pytest.mark.parametrize("grid, schedule, m, v, steps", [
    (dict(pipe=4, data=2), "gpipe", 8, 1, STEPS),
    (dict(pipe=8), "1f1b", 8, 1, 3),
    (dict(pipe=4, data=2), "zb-h1", 8, 1, 3),
    (dict(pipe=2, data=4), "interleaved-1f1b", 4, 2, 3),
])
def test_pipeline_trajectory(reference, devices, tmp_path, grid, schedule, m, v, steps):
    trainer = _pipeline_trainer(devices, grid, schedule, m, v)
    state = _place(trainer, reference["initial"])
    state, got = run_steps(trainer, state, lm_batches(trainer, reference["corpus"].train), steps)
    assert_follows_reference(reference, trainer, state, got)
    # The update keeps the layout: blocks (and their Adam moments) split over pipe.
    params = field(state, "params")
    assert params["blocks"]["mlp_up"]["kernel"].sharding.spec == P("pipe")
    assert adam_state(field(state, "opt_state")).mu["blocks"]["mlp_up"]["kernel"].sharding.spec == P("pipe")
    assert params["embed"]["wte"]["embedding"].sharding.spec == P()
    if v > 1:
        # Checkpoints hold the model's layer order: one device restores exactly these parameters.
        saver = trainer.make_checkpointer(str(tmp_path), 1)
        saver.maybe_save(steps, state, force=True)
        saver.close()
        single = build_trainer(TrainOptions(**BASE, steps=STEPS), devices[:1])
        restored = single.make_checkpointer(str(tmp_path), 1).restore(single.init_state())
        expected = jax.device_get(trainer.step.canonical_params(params))
        for a, b in zip(jax.tree.leaves(jax.device_get(field(restored, "params"))),
                        jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)


def test_offloaded_optimizer_with_pipeline_stages(reference, devices):
    """Host-resident masters and moments with `--pipe 4 --data 2`: the same trajectory as one
    device, the state on the host split over `pipe` like its parameters (and over `data`, each
    copy streaming its share), and an update that moves no block state between stages (no
    all-gather or all-to-all over `pipe` in the compiled step)."""
    config = ParallelConfig(pipe=4, data=2)
    trainer = build_trainer(TrainOptions(**BASE, steps=STEPS, parallel=config, microbatches=4,
                                         offload_optimizer=True), devices)
    state = trainer.init_state()
    # The update alone: over `pipe` only the gradient norm's all-reduce, no block state crossing
    # stages (the new parameters are all-gathered over `data`, which splits the host state).
    update = jax.jit(trainer.bound.update).lower(state, field(state, "params")).compile()
    over_pipe = {c.kind for c in hlo.collectives(update.as_text())
                 if "pipe" in hlo.group_axes(c.group, config.as_dict())}
    assert over_pipe <= {"all-reduce"}, over_pipe
    batch = lm_batch(trainer, reference["corpus"].train, 0)
    compiled = trainer.step.lower(state, batch).compile()
    state, got = run_steps(trainer, state, lm_batches(trainer, reference["corpus"].train), 3,
                           step_fn=compiled)
    assert_follows_reference(reference, trainer, state, got)
    master = field(state, "opt_state")["master"]["blocks"]["mlp_up"]["kernel"]
    assert master.sharding.memory_kind == "pinned_host" and master.sharding.spec[0] == "pipe"


def test_remat_inside_pipeline_stages(reference, devices):
    """`--remat full|offload` with `--pipe 2`: each stage's backward tick checkpoints its 4 blocks
    (the gradients and the trajectory of one device) and holds less at its peak than keeping every
    block's intermediates. After one step Adam's moments are (1 − b1)·g and (1 − b2)·g² of
    the clipped gradient g, and the pre-clip norm is compared: the state after step 1 compares
    the gradients leaf by leaf."""
    temps = {}
    for remat in ("none", "full", "offload"):
        trainer = build_trainer(TrainOptions(**BASE, steps=STEPS, parallel=ParallelConfig(pipe=2),
                                             microbatches=2, remat=remat), devices[:2])
        state = trainer.init_state()
        compiled = trainer.step.lower(state, lm_batch(trainer, reference["corpus"].train, 0)).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
        if remat == "none":
            continue
        got = []
        for step in range(2):
            state, more = run_steps(trainer, state, lm_batches(trainer, reference["corpus"].train),
                                    1, step, step_fn=compiled)
            got += more
            assert_follows_reference(reference, trainer, state, got)
    assert temps["full"] < temps["none"]


def test_remat_auto_with_pipeline_is_refused(devices):
    with pytest.raises(ValueError, match="remat='auto' with pipe > 1 is not implemented"):
        build_trainer(TrainOptions(**BASE, parallel=ParallelConfig(pipe=2), microbatches=2,
                                   remat="auto", memory_budget_gb=1.0), devices[:2])


def test_cli_pipeline_with_data_trajectory(reference, corpus_path, tmp_path):
    """`--pipe 2 --microbatches 4 --schedule 1f1b` on 8 devices (data = 4), 10 steps."""
    out = tmp_path / "m.jsonl"
    rc = cli_main(["train", "--model", MODEL, "--steps", str(STEPS), "--batch-size", "16",
                   "--seq-len", "16", "--eval-batches", "1", "--eval-every", "100",
                   "--warmup-steps", str(PARITY["warmup_steps"]),
                   "--pipe", "2", "--microbatches", "4", "--schedule", "1f1b",
                   "--data", corpus_path, "--metrics-out", str(out)])
    assert rc == 0
    assert_steps_match(metrics_file(out), reference["trajectory"])


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
    layers = lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]
    stage = lambda w, x, batch: (layers(w, x), jnp.float32(0.0), {})
    head = lambda v, x, batch: jnp.mean((x @ v - batch["targets"]) ** 2)

    def local(params, batch):
        params = ensure_varying(params, ("pipe",))
        return pipeline_loss_and_grads(embed, stage, head, params, batch, sched)[:2]

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
    (["--pipe", "2", "--microbatches", "2", "--virtual-stages", "2"],
     "--virtual-stages 2 needs --schedule interleaved-1f1b"),
    (["--pipe", "4", "--microbatches", "4", "--schedule", "interleaved-1f1b", "--virtual-stages", "4"],
     "num_layers = 8 is not divisible by pipe × virtual stages = 4 × 4"),
])
def test_cli_bad_pipeline_input(argv, message, capsys):
    assert cli_main(["train", "--model", MODEL, "--steps", "1", "--batch-size", "16", *argv]) == 2
    assert message in capsys.readouterr().err
