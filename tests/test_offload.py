"""Host-offloaded optimizer state, mixed precision, and the activation keep/offload/recompute planner."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax.models import gpt
from axonn_jax.offload import activations
from axonn_jax.offload.optimizer import (lowered_for_gpu, on_device, partition_spec,
                                         placement_transfers)
from axonn_jax.run.loop import state_report
from axonn_jax.run.options import ConfigError
from axonn_jax.step.state import TrainState
from axonn_jax.step.update import make_update, update_chain
from axonn_jax.offload.precision import loss_scaler
from axonn_jax.train import TrainOptions, build_trainer

from conftest import (PARITY, adam_state, assert_states_match, assert_steps_match, comparable_state, field,
                      lm_batch, lm_batches, relative_difference, run_steps, state_tolerances)

STEPS = 3
TOKENS = (np.arange(4096, dtype=np.int64) * 7919 % 251).astype(np.int32)
# Warm-up off; the default clip_norm = 1 clips (the gradient norms stay above it, asserted).
SMALL = dict(model="gpt-tiny", steps=STEPS, batch_size=4, seq_len=16, lr=1e-2, **PARITY)


def run(devices, steps=STEPS, **kw):
    """(per-step records, final state, trainer, compiled step) of `steps` steps on a fixed token
    array."""
    options = TrainOptions(**{**SMALL, **kw})
    trainer = build_trainer(options, devices)
    state = trainer.init_state()
    compiled = trainer.step.lower(state, lm_batch(trainer, TOKENS, 0)).compile()
    state, records = run_steps(trainer, state, lm_batches(trainer, TOKENS), steps, step_fn=compiled)
    return records, state, trainer, compiled


@pytest.fixture(scope="module")
def reference(devices):
    records, state, trainer, _ = run(devices[:2], parallel=ParallelConfig(data=2))
    assert min(r["grad_norm"] for r in records) > trainer.options.optimizer.clip_norm  # clipping fires
    return records, comparable_state(trainer, state)


def test_offloaded_optimizer_gives_identical_losses_and_lives_on_host(reference, devices):
    records, state, trainer, compiled = run(devices[:2], parallel=ParallelConfig(data=2),
                                            offload_optimizer=True)
    # Per step the loss and gradient norm, at the end the fp32 masters and Adam's moments (which a
    # gradient scaled in the host-streamed update would change, although Adam's step would not).
    assert_steps_match(records, reference[0], 1e-6)
    assert_states_match(comparable_state(trainer, state), reference[1])
    params, opt_state = field(state, "params"), field(state, "opt_state")
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert kinds(state.params) == {"device"}
    assert kinds(state.opt_state["master"]) == {"pinned_host"}
    adam = adam_state(state.opt_state["inner"])
    assert kinds(adam.mu) == kinds(adam.nu) == {"pinned_host"}
    assert adam.count.sharding.memory_kind == "device"
    # Host copies are partitioned like their parameters and over `data` too where a dimension
    # allows (ZeRO-Offload): each data-parallel copy holds and streams its share.
    shard_elements = 0
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state["master"])):
        assert m.dtype == jnp.float32
        unsplit = tuple(None if e == "data" else e for e in m.sharding.spec)
        assert P(*unsplit) == P(*p.sharding.spec, *[None] * (len(unsplit) - len(p.sharding.spec)))
        shard_elements += m.addressable_shards[0].data.size
    assert shard_elements <= 0.55 * sum(p.size for p in jax.tree.leaves(state.params))
    report = state_report(state, compiled)
    n = report["num_params"]
    # master, mu, nu in fp32, each device's share of the split over data=2
    assert 0.5 * 3 * 4 * n <= report["state_bytes_host"] <= 0.55 * 3 * 4 * n
    assert report["state_bytes_device"] < 4.1 * n


@pytest.fixture(scope="module")
def one_device(devices):
    """`run` on one device with the state on it and the activations kept."""
    return run(devices[:1])


def test_offloaded_optimizer_on_one_device_follows_the_on_device_one(devices, one_device):
    """One device (nothing to split the host state over): fp32 losses, gradient norms, masters
    and moments equal to the on-device optimizer's."""
    records, state, trainer, _ = one_device
    off_records, off_state, off_trainer, _ = run(devices[:1], offload_optimizer=True)
    assert_steps_match(off_records, records, 1e-6)
    assert_states_match(comparable_state(off_trainer, off_state), comparable_state(trainer, state))
    for p, m in zip(jax.tree.leaves(off_state.params),
                    jax.tree.leaves(off_state.opt_state["master"])):
        assert m.sharding.spec == p.sharding.spec


def test_offloaded_activations_on_one_device_train_like_kept_ones(devices, one_device):
    """`--remat offload` on one device: the stack's backward is written by hand so that each
    layer's host-resident activations are fetched during the backward of the layer above
    (`ComputeFunctions.fetch_ahead`), and the fp32 run is the one that keeps them."""
    records, state, trainer, _ = one_device
    got_records, got, got_trainer, _ = run(devices[:1], remat="offload")
    assert got_trainer.bound.compute.fetch_ahead and not trainer.bound.compute.fetch_ahead
    assert_steps_match(got_records, records, 1e-6)
    assert_states_match(comparable_state(got_trainer, got), comparable_state(trainer, state))


def test_gradients_in_host_memory_on_one_device_train_like_the_device_state(devices, one_device):
    """`--offload-gradients` on one device, fp32: each block's gradient leaves for host memory as
    its backward finishes, and the offloaded update streams it back in; losses, gradient norms
    (the blocks' squares summed in the backward), masters and moments equal the on-device run's.
    """
    records, state, trainer, _ = one_device
    got_records, got, got_trainer, _ = run(devices[:1], offload_optimizer=True,
                                           offload_gradients=True)
    assert_steps_match(got_records, records, 1e-6)
    assert_states_match(comparable_state(got_trainer, got), comparable_state(trainer, state))


@pytest.mark.parametrize("dtype, grid", [
    ("bfloat16", dict(depth=2, row=2)),
    ("float32", dict(data=2)),
    pytest.param("float16", {}, marks=pytest.mark.extended),
    pytest.param("float16", dict(data=2), marks=pytest.mark.extended),
    pytest.param("float32", dict(row=2, col=2), marks=pytest.mark.extended),
    pytest.param("bfloat16", dict(data=2, row=2), marks=pytest.mark.extended),
])
def test_gradients_in_host_memory_train_like_device_gradients(devices, dtype, grid):
    """`--offload-gradients` on data and tensor grids and in 16 bits (fp16: with its loss
    scale): the same steps as the offloaded state with the gradients on the device. Over `data`
    each layer's gradient is averaged in the backward (in float32, divided before the cast back)
    where the device-gradient path averages the whole tree after it: bf16 rounds the mean of a
    layer once either way, from sums taken in another order."""
    grid = ParallelConfig(**grid)
    runs = [run(devices[:grid.num_devices], offload_optimizer=True, offload_gradients=on,
                dtype=dtype, parallel=grid) for on in (False, True)]
    (want, want_state, want_trainer, _), (got, got_state, got_trainer, _) = runs
    assert_steps_match(got, want, 1e-6 if dtype == "float32" else 1e-3)
    assert_states_match(comparable_state(got_trainer, got_state),
                        comparable_state(want_trainer, want_state), **state_tolerances(dtype))


@pytest.mark.parametrize("grid, shares", [(dict(data=4), True), (dict(data=2, row=2), False)])
def test_gradients_in_host_memory_exchange_each_copys_share(devices, grid, shares):
    """`--offload-gradients` over `data`: each block leaf no tensor axis splits is
    reduce-scattered in the backward, each copy writing its share (on data 4 every block leaf; on
    data 2 × row 2 only the unsplit norms, the rest whole means), all of a layer's in one
    collective; the compiled step's bytes per kind over `data` are the communication model's."""
    from axonn_jax.analysis import comm_model as cm
    from axonn_jax.analysis.hlo import bytes_by_axes, collectives, group_axes
    from axonn_jax.run.plan import workload

    options = TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32,
                           parallel=ParallelConfig(**grid), offload_optimizer=True,
                           offload_gradients=True)
    trainer = build_trainer(options, devices[:options.parallel.num_devices])
    state = trainer.init_state(abstract=True)
    text = trainer.step.lower(state, trainer.bound.abstract_batch()).compile().as_text()
    got = bytes_by_axes(text, options.parallel.as_dict())
    want = cm.bytes_by_axes(workload(options, "cpu"), options.parallel)
    for key in {k for k in set(got) | set(want) if k[1] == ("data",)}:
        assert got.get(key, 0.0) == pytest.approx(want.get(key, 0.0), rel=0.01, abs=64), key
    scattered = got[("reduce-scatter", ("data",))]
    summed = got[("all-reduce", ("data",))]
    assert (scattered > summed) == shares, (scattered, summed)
    per_step = sum(c.executions for c in collectives(text) if c.kind == "reduce-scatter" and
                   group_axes(c.group, options.parallel.as_dict()) == ("data",))
    assert per_step == trainer.model.num_layers, per_step


@pytest.mark.parametrize("kw, message", [
    (dict(offload_gradients=True), "needs offload_optimizer"),
    (dict(offload_gradients=True, offload_optimizer=True, parallel=ParallelConfig(context=2)),
     "offload_gradients on context 2 .* is not implemented yet"),
    (dict(offload_gradients=True, offload_optimizer=True, parallel=ParallelConfig(data=2),
          compress_bits=8), "offload_gradients with compress_bits .* is not implemented yet"),
    (dict(offload_gradients=True, offload_optimizer=True, microbatches=2),
     "offload_gradients with microbatches=2 .* is not implemented yet"),
])
def test_gradients_in_host_memory_refused_where_something_sums_them(devices, kw, message):
    """Where the gradients are still summed after the backward (a batch axis besides `data`,
    accumulated microbatches, CGX's exchange) or no offloaded update reads them, the run is
    refused in one line."""
    grid = kw.get("parallel", ParallelConfig())
    with pytest.raises(ConfigError, match=message) as raised:
        build_trainer(TrainOptions(**{**SMALL, **kw}), devices[:grid.num_devices])
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("spec, shape, skip, expected", [
    (P(), (4, 64, 256), 1, P(None, None, "data")),  # the largest free dimension, not the layers
    (P(None, "row"), (64, 256), 0, P("data", "row")),  # a dimension another axis splits: kept
    (P(), (3, 5), 0, P()),  # nothing divisible: replicated over data
    (P(), (8,), 1, P()),  # a stack of scalars: the layer axis is never split
])
def test_partition_spec_splits_the_host_state_over_data(spec, shape, skip, expected):
    assert partition_spec(spec, shape, "data", 2, skip) == expected


@pytest.mark.parametrize("spec, shape, sizes, expected", [
    # a tensor grid names every dimension: the one with the most elements per device takes data
    (P(None, ("row", "depth"), "col"), (2, 64, 64), dict(row=1, depth=2, col=1),
     P(None, ("row", "depth"), ("col", "data"))),
    (P(None, "row"), (2, 64), dict(row=4), P(None, ("row", "data"))),
    (P(None, "row"), (2, 6), dict(row=2), P(None, "row")),  # 6 does not split over 2 × 2
])
def test_partition_spec_splits_over_data_beside_tensor_axes(spec, shape, sizes, expected):
    """On a tensor grid the host state is split over `data` too (ZeRO-Offload): each copy holds
    and streams its share, not the whole state."""
    assert partition_spec(spec, shape, "data", 2, 1, {**sizes, "data": 2}) == expected


def test_update_moves_state_per_layer_not_in_bulk(devices):
    """Lowered for a GPU (CPU drops in-jit placements): every transfer is one layer's slice or one
    small parameter, and their number does not grow with the number of layers."""
    counts = {}
    for model in ("gpt-mini", "gpt-tiny-deep"):
        trainer = build_trainer(TrainOptions(model=model, batch_size=2, seq_len=8, dtype="bfloat16",
                                             offload_optimizer=True), devices[:1])
        state = trainer.init_state(abstract=True)
        bound = trainer.bound
        moves = placement_transfers(lowered_for_gpu(bound.programs[0], state, bound.abstract_batch()))
        params = state.params
        layers = trainer.model.num_layers
        layer_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])}
        block_slices = {(1, *s) for s in layer_shapes}  # layer i of each of the (one) stages
        others = {tuple(x.shape) for k, v in params.items() if k != "blocks"
                  for x in jax.tree.leaves(v)}
        shapes = {tuple(int(d) for d in t[len("tensor<"):-1].split("x")[:-1]) for _, t in moves}
        assert shapes <= block_slices | others
        assert not any(s and s[0] == layers and s[1:] in layer_shapes for s in shapes)
        by_kind = collections.Counter(kind for kind, _ in moves)
        stacked, leaves = len(jax.tree.leaves(params["blocks"])), len(jax.tree.leaves(params))
        # master, mu and nu of each parameter leaf, each way: in its bucket, or in the loop body,
        # which updates two layers (and is not unrolled further).
        assert by_kind == {"device": 3 * (leaves + stacked), "pinned_host": 3 * (leaves + stacked)}
        counts[layers] = len(moves)
    assert counts[4] == counts[8]


def test_bf16_device_state_bytes_per_parameter(devices):
    """AdamW + bf16: device-resident parameters + gradients + optimizer state per parameter."""
    per_param = {}
    for offload in (False, True):
        trainer = build_trainer(TrainOptions(**SMALL, dtype="bfloat16", offload_optimizer=offload),
                                devices[:1])
        state = trainer.init_state(abstract=True)
        nbytes = lambda x: x.size * x.dtype.itemsize
        n = sum(x.size for x in jax.tree.leaves(state.params))
        device = sum(nbytes(x) for x in jax.tree.leaves(state) if x.sharding.memory_kind == "device")
        grads = sum(nbytes(x) for x in jax.tree.leaves(state.params))  # in the params' dtype
        per_param[offload] = (device + grads) / n
    assert per_param[True] <= 4.5
    assert per_param[False] >= 16


def test_fp16_step_with_inf_gradients_is_skipped(devices):
    # Two data shards: 16-bit gradients cross an all-reduce (see `_compat.pmean`).
    options = TrainOptions(**SMALL, dtype="float16", offload_optimizer=True,
                           parallel=ParallelConfig(data=2))
    trainer = build_trainer(options, devices[:2])
    state = trainer.init_state()
    step = trainer.step.lower(state, lm_batch(trainer, TOKENS, 0)).compile()
    state, metrics = step(state, lm_batch(trainer, TOKENS, 0))
    assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["loss"]))
    # A loss scale near fp32's maximum overflows the scaled loss: the step must change nothing.
    state = state.replace(precision={**state.precision, "scale": jnp.asarray(3e38, jnp.float32)})
    held = lambda s: jax.tree.map(np.asarray, (s.params, s.opt_state))  # noqa: E731
    before = held(state)
    state, metrics = step(state, lm_batch(trainer, TOKENS, 1))
    after = held(state)
    assert int(metrics["skipped_steps"]) == 1 and int(state.precision["skipped_steps"]) == 1
    assert float(state.precision["scale"]) == pytest.approx(1.5e38)
    # The fp32 masters and the moments exactly; the fp16 device copy, re-made from the kept
    # masters, within one fp16 ulp: an update's own fp16 copy can round an element the other way
    # than the cast of the stored master (measured: 1 element of 32768).
    jax.tree.map(np.testing.assert_array_equal, after[1], before[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2**-10, atol=0), after[0],
                 before[0])
    state, metrics = step(state, lm_batch(trainer, TOKENS, 2))  # scale still huge: skipped again
    assert int(metrics["skipped_steps"]) == 2


def test_on_device_guard_skips_non_finite_updates():
    """The shared update (`step.update`): clipping and the 16-bit skip guard on the device."""
    adamw = optax.adamw(0.1)
    tx = update_chain(adamw, clip_norm=0.25, skip_non_finite=True)
    update = jax.jit(make_update(on_device(tx), scaler=loss_scaler("float16")))
    params = {"w": jnp.ones((3,)), "b": jnp.zeros((2,))}
    precision = {**loss_scaler("float16").init(), "scale": jnp.float32(4.0)}
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                       rng=jax.random.key_data(jax.random.key(0)), precision=precision)
    bad = {"w": jnp.array([1.0, jnp.inf, 0.0]), "b": jnp.ones((2,))}
    new, metrics = update(state, bad)
    assert int(metrics["skipped_steps"]) == 1 and float(new.precision["scale"]) == 2.0
    jax.tree.map(np.testing.assert_array_equal, (new.params, new.opt_state),
                 (params, state.opt_state))
    new, metrics = update(state, jax.tree.map(jnp.ones_like, params))
    assert int(metrics["skipped_steps"]) == 0
    norm = np.sqrt(5) / 4  # unscaled by the loss scale 4: above clip_norm, so clipped to 0.25
    assert float(metrics["grad_norm"]) == pytest.approx(norm)
    clipped = jax.tree.map(lambda p: jnp.full_like(p, 0.25 / 4 / norm), params)
    updates, _ = adamw.update(clipped, adamw.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new.params,
                 optax.apply_updates(params, updates))


def test_layer_groups_keep_the_model_function(devices):
    """Mixed per-layer decisions (offload, recompute, selective, keep) change memory, not loss or
    gradients."""
    config = gpt.GPTConfig(num_layers=4, d_model=32, num_heads=2, max_seq_len=16)
    model = gpt.stacked(config)
    tokens = jnp.asarray(TOKENS[:68].reshape(4, 17))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    fns = model.bind(batch)
    params = jax.jit(fns.init)(jax.random.key(0))
    plan = activations.Plan(activations.PLAN_ORDER)
    assert plan.groups() == tuple((1, d) for d in activations.PLAN_ORDER)

    def loss_and_grads(groups):
        return jax.jit(jax.value_and_grad(lambda p: fns.loss(p, batch, groups)))(params)

    ref = loss_and_grads(None)
    got = loss_and_grads(plan.layer_groups(model.offload_names))
    assert relative_difference(got[0], ref[0]) <= 1e-6
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
        assert relative_difference(g, r) <= 1e-5


SPEC = activations.DeviceSpec("test", flops_per_s=1e12, host_bytes_per_s=1e9)


@pytest.fixture(scope="module")
def block_cost():
    config = gpt.get_config("gpt-tiny")
    block = gpt.Block(config)
    x = jax.ShapeDtypeStruct((8, 64, config.d_model), jnp.float32)
    params = jax.eval_shape(block.init, jax.random.key(0), x)["params"]
    return activations.block_cost(lambda p, h: block.apply({"params": p}, h), params, x,
                                  gpt.ACTIVATION_NAMES)


def test_block_cost_measurements(block_cost):
    c = block_cost
    assert c.device_bytes["keep"] > 10 * c.device_bytes["recompute"] > 0
    assert c.device_bytes["offload"] == c.device_bytes["recompute"]  # the block input only
    # selective keeps on the device what offload moves to the host (the named matmul outputs).
    assert c.device_bytes["selective"] - c.device_bytes["recompute"] == c.host_bytes["offload"] > 0
    assert c.device_bytes["selective"] < c.device_bytes["keep"]
    assert c.host_bytes["keep"] == c.host_bytes["recompute"] == c.host_bytes["selective"] == 0
    assert 0 < c.extra_flops["offload"] == c.extra_flops["selective"] < c.extra_flops["recompute"]
    assert c.extra_flops["recompute"] <= c.forward_flops and c.extra_flops["keep"] == 0


def test_planner_moves_with_the_budget(block_cost):
    layers, base = 6, 50 * 2**20
    keep_all = base + layers * (block_cost.device_bytes["keep"] - block_cost.device_bytes["recompute"])
    plans = [activations.plan(block_cost, layers, budget, base, SPEC)
             for budget in np.linspace(keep_all * 1.01, base * 1.001, 12).astype(int)]
    assert plans[0].decisions == ("keep",) * layers and plans[0].predicted_extra_s == 0
    kept = [p.decisions.count("keep") for p in plans]
    assert kept == sorted(kept, reverse=True) and kept[-1] == 0 and len(set(kept)) > 2
    times = [p.predicted_extra_s for p in plans]
    assert times == sorted(times)
    for p in plans:
        assert p.predicted_peak <= p.budget
        # Offloaded blocks first, then recomputed, selective and kept ones.
        order = [activations.PLAN_ORDER.index(d) for d in p.decisions]
        assert sorted(order) == order
    assert any("selective" in p.decisions for p in plans)  # it pays between keep and recompute


def test_planner_infeasible_budget_names_the_smallest(block_cost):
    base = 50 * 2**20
    smallest = base  # offloaded and recomputed blocks keep only their input, as in the base
    with pytest.raises(ValueError, match=f"smallest feasible budget .* \\({smallest:,} bytes"):
        activations.plan(block_cost, 6, base - 1, base, SPEC)
    assert activations.plan(block_cost, 6, smallest, base, SPEC).predicted_peak == smallest


def test_auto_plan_end_to_end(devices):
    """`--remat auto` measures the all-recompute step's compiled peak and plans within the budget."""
    budget_gb = 0.0135  # a little above the all-offload peak on XLA:CPU (12.7 MB)
    trainer = build_trainer(TrainOptions(model="gpt-tiny", batch_size=16, seq_len=64,
                                         remat="auto", memory_budget_gb=budget_gb), devices[:1])
    plan = trainer.bound.plan
    assert plan.predicted_peak <= budget_gb * 1e9 and "keep" not in plan.decisions
    assert "predicted peak" in plan.describe()


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_auto_plan_in_16_bits(devices, dtype):
    """The planner measures the blocks in the compute dtype (it once read it before it was set)."""
    budget_gb = 0.0215
    trainer = build_trainer(TrainOptions(model="gpt-tiny", batch_size=16, seq_len=64, dtype=dtype,
                                         remat="auto", memory_budget_gb=budget_gb), devices[:1])
    assert trainer.bound.plan.predicted_peak <= budget_gb * 1e9


@pytest.mark.parametrize("kw, message", [
    (dict(remat="full", memory_budget_gb=1.0), "--memory-budget is used by --remat auto only"),
    (dict(remat="auto"), "--remat auto needs a positive --memory-budget"),
])
def test_bad_remat_flags(devices, kw, message):
    with pytest.raises(ValueError, match=message):
        build_trainer(TrainOptions(**SMALL, **kw), devices[:1])


def test_offloaded_state_checkpoint_round_trip(devices, tmp_path):
    from axonn_jax.run.checkpoint import Checkpointer

    trainer = build_trainer(TrainOptions(**SMALL, dtype="bfloat16", offload_optimizer=True),
                            devices[:1])
    state = trainer.init_state().as_dict()  # the generic checkpointer holds any pytree
    writer = Checkpointer(tmp_path, 1)
    writer.maybe_save(1, state, force=True)
    writer.close()
    reader = Checkpointer(tmp_path, 1)
    restored = reader.restore(state)
    reader.close()
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored["opt_state"]["master"])} == {
        "pinned_host"}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored, state)
