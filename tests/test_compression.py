"""CGX compression: quantizer bounds, the compressed all-reduce, its wire bytes, and training with it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax._compat import shard_map
from axonn_jax.run.checkpoint import Checkpointer
from axonn_jax.run.cli import main as cli_main
from axonn_jax.run.data import Corpus
from axonn_jax.step.state import TrainState
from axonn_jax.parallel import compression as C
from axonn_jax.analysis.hlo import collective_bytes, collectives, wire_bytes
from axonn_jax.train import TrainOptions, train

from conftest import lm_batch, relative_difference

B = 64  # bucket size of the unit tests: several buckets per tensor, tiny arrays


def bucket_scales(x, bits, bucket=B):
    """Per-element max-min scale of the bucket holding it (x: flat, whole buckets)."""
    xb = np.asarray(x, np.float64).reshape(-1, bucket)
    scale = (xb.max(1) - xb.min(1)) / (2 ** bits - 1)
    return np.repeat(scale, bucket)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip_and_size(bits):
    q = jax.random.randint(jax.random.key(bits), (3, 128), 0, 2 ** bits).astype(jnp.uint8)
    packed = C.pack_bits(q, bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 128 * bits // 8)
    np.testing.assert_array_equal(C.unpack_bits(packed, bits), q)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_nearest_rounding_error_bound(bits):
    # Buckets of very different ranges, including a constant one (scale 0).
    x = jax.random.normal(jax.random.key(0), (8 * B,)) * jnp.repeat(10.0 ** jnp.arange(-3, 5), B)
    x = x.at[:B].set(0.25)
    qx = C.quantize(x, bits, B)
    assert qx.packed.nbytes == x.size * bits // 8 and qx.scale.dtype == x.dtype
    err = np.abs(np.asarray(C.dequantize(qx, bits).ravel(), np.float64) - np.asarray(x, np.float64))
    scale = bucket_scales(x, bits)
    slack = 1e-6 * np.abs(np.asarray(x)) + 1e-30  # fp32 rounding of the dequantized value
    assert np.all(err <= scale + slack)  # the bound: range / (2^b - 1)
    assert np.all(err <= scale / 2 + slack)  # nearest rounding: half a step
    assert err[:B].max() == 0.0
    assert err.max() > 0.2 * scale.max()  # a bound that cannot be met by accident


def test_stochastic_rounding_unbiased():
    bits, draws = 2, 4000
    x = jax.random.normal(jax.random.key(1), (2 * B,))
    keys = jax.random.split(jax.random.key(2), draws)
    deq = jax.vmap(lambda k: C.dequantize(C.quantize(x, bits, B, key=k), bits).ravel())(keys)
    scale = bucket_scales(x, bits)
    err = np.abs(np.asarray(deq) - np.asarray(x))
    assert np.all(err < scale * (1 + 1e-6))  # one step at most
    # Mean of `draws` rounding errors each within +-scale: std <= scale / (2 sqrt(draws)).
    bias = np.abs(np.asarray(deq).mean(0) - np.asarray(x))
    assert np.all(bias <= 5 * scale / (2 * np.sqrt(draws)))
    nearest = np.abs(np.asarray(C.dequantize(C.quantize(x, bits, B), bits).ravel()) - np.asarray(x))
    assert nearest.max() > 10 * (5 * scale / (2 * np.sqrt(draws))).max()  # nearest is biased


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="bits must be an integer in 1..8, got 9"):
        C.check_args(9, 1024)
    with pytest.raises(ValueError, match="multiple of 8.*got 100"):
        C.check_args(4, 100)
    with pytest.raises(ValueError, match="bit width for 'w' must be an integer in 0..8.*got 12"):
        jax.eval_shape(lambda t: C.compressed_psum(t, "data", overrides={"w": 12}),
                       {"w": jnp.zeros((64, 64))})


@pytest.fixture(scope="module")
def data_mesh(devices):
    return Mesh(np.asarray(devices).reshape(8, 1, 1, 1, 1), ("data", "pipe", "depth", "row", "col"))


def run_psum(mesh, tree, residual, **kwargs):
    """compressed_psum over 8 shards; `tree`/`residual` leaves carry a leading shard axis."""
    def f(t, r):
        t, r = jax.tree.map(lambda a: a[0], (t, r))
        out, new_r = C.compressed_psum(t, "data", residual=r, **kwargs)
        return out, jax.tree.map(lambda a: a[None], new_r)

    g = shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P("data")),
                  axis_names={"data"})
    return jax.jit(g)(tree, residual)


def test_compressed_psum_within_two_quantization_bound(data_mesh):
    bits, n = 3, 8
    keys = jax.random.split(jax.random.key(3), 4)
    tree = {
        "w": jax.random.normal(keys[0], (n, 6, 40)) * 3,  # 240 elements: 3.75 buckets per shard
        "v": jax.random.normal(keys[1], (n, 2, 96)),  # compressed at 8 bits by an override
        "b": jax.random.normal(keys[2], (n, 500)),  # 1-D: exact
        "s": jax.random.normal(keys[3], (n, 4, 8)),  # < min_size: exact
    }
    residual = jax.tree.map(lambda a: 0.1 * jnp.cos(a), tree)
    out, new_r = run_psum(data_mesh, tree, residual, bits=bits, bucket_size=B, min_size=100,
                          overrides={"v$": 8})
    x = jax.tree.map(lambda a, r: np.asarray(a + r, np.float64), tree, residual)
    exact = jax.tree.map(lambda a: a.sum(0), x)
    for k in ("b", "s"):
        assert relative_difference(out[k], exact[k]) <= 1e-6
        assert not np.any(np.asarray(new_r[k]))
    for k, b in (("w", bits), ("v", 8)):
        flat = x[k].reshape(n, -1)
        size = flat.shape[1]
        padded = np.pad(flat, ((0, 0), (0, -size % B)), mode="edge")
        first = np.stack([bucket_scales(p, b)[:size] for p in padded])  # [n, size]
        # The sum each owner re-quantizes: what the shards sent, i.e. inputs minus residuals.
        sent = (flat - np.asarray(new_r[k], np.float64).reshape(n, -1)).sum(0)
        second = bucket_scales(np.pad(sent, (0, -size % B), mode="edge"), b)[:size]
        err = np.abs(np.asarray(out[k], np.float64).ravel() - exact[k].ravel())
        slack = 1e-5 * np.abs(flat).sum(0)
        assert np.all(err <= first.sum(0) + second + slack)  # the bound
        assert np.all(err <= (first.sum(0) + second) / 2 + slack)  # nearest: half steps
        # The residual is exactly what the first quantization lost: the rest is the second one.
        assert np.all(np.abs(np.asarray(out[k]).ravel() - sent) <= second / 2 + slack)
        assert np.all(np.abs(np.asarray(new_r[k]).reshape(n, -1)) <= first / 2 + slack)
        assert err.max() > 0.05 * (first.sum(0) + second).max()
    # The mean is the sum over the shard count.
    mean, _ = run_psum(data_mesh, tree, residual, bits=bits, bucket_size=B, min_size=100,
                       overrides={"v$": 8}, mean=True)
    for k in tree:
        assert relative_difference(np.asarray(mean[k]) * n, np.asarray(out[k])) <= 1e-5


def test_stochastic_compressed_psum_within_bound(data_mesh):
    bits, n = 2, 8
    tree = {"w": jax.random.normal(jax.random.key(5), (n, 4, 64))}
    zeros = jax.tree.map(jnp.zeros_like, tree)
    outs = [run_psum(data_mesh, tree, zeros, bits=bits, bucket_size=B, min_size=1,
                     key=jax.random.key(k))[0]["w"] for k in range(2)]
    x = np.asarray(tree["w"], np.float64).reshape(n, -1)
    first = np.stack([bucket_scales(p, bits) for p in x]).sum(0)
    # The re-quantized sum's range is at most the exact sum's range plus the first errors.
    exact = x.sum(0)
    second = bucket_scales(exact, bits) + 2 * first.reshape(-1, B).max(1).repeat(B) / (2 ** bits - 1)
    for out in outs:
        err = np.abs(np.asarray(out, np.float64).ravel() - exact)
        assert np.all(err <= first + second + 1e-5 * np.abs(x).sum(0))
    assert np.any(np.asarray(outs[0]) != np.asarray(outs[1]))  # the key drives the rounding


def test_error_feedback_cancels_accumulated_error(data_mesh):
    """Over repeated exchanges of the same gradients, feedback keeps the running sum of what was
    delivered close to the true running sum; without it the rounding bias accumulates."""
    n, rounds = 8, 50
    g = {"w": jax.random.normal(jax.random.key(4), (n, 4, 64))}
    exact = np.asarray(g["w"]).sum(0)
    step = jax.jit(functools.partial(run_psum, data_mesh, bits=2, bucket_size=B, min_size=1))
    total = {True: 0.0, False: 0.0}
    for feedback in (True, False):
        r = jax.tree.map(jnp.zeros_like, g)
        for _ in range(rounds):
            out, new_r = step(g, r)
            total[feedback] = total[feedback] + np.asarray(out["w"])
            r = new_r if feedback else r
    # Mean over elements: with feedback only the (unfed) second quantization's error is left, and
    # it varies from round to round; measured ratios 0.10-0.13 at 50 rounds.
    drift = {k: np.abs(v / rounds - exact).mean() for k, v in total.items()}
    assert drift[True] < 0.3 * drift[False], drift


def test_hlo_byte_counter_on_known_program(data_mesh):
    f = shard_map(lambda x: jax.lax.psum(x, "data"), mesh=data_mesh, in_specs=P("data"),
                  out_specs=P(), axis_names={"data"})
    text = jax.jit(f).lower(jnp.zeros((8, 1000))).compile().as_text()
    assert [c.kind for c in collectives(text)] == ["all-reduce"]
    assert sum(collective_bytes(text).values()) == 4000
    assert sum(wire_bytes(text).values()) == 2 * 7 / 8 * 4000


# --- training ------------------------------------------------------------------------------------

STEPS = 100  # benchmarks/bench_compression.py runs the 200 steps
TRAIN = dict(model="gpt-tiny", steps=STEPS, batch_size=16, seq_len=32, eval_batches=2,
             eval_every=STEPS, parallel=ParallelConfig(data=8))


@pytest.fixture(scope="module")
def runs(devices, tmp_path_factory):
    out = {}
    for name, extra in (("exact", {}), ("4bit", dict(compress_bits=4))):
        hlo = tmp_path_factory.mktemp(name)
        out[name] = train(TrainOptions(**TRAIN, **extra, dump_hlo=str(hlo)), devices=devices)
        out[name]["hlo"] = (hlo / "train_step.hlo.txt").read_text()
    out["corpus"] = Corpus.load(None, min_tokens=TRAIN["seq_len"] + 2).train
    return out


def test_4bit_gradient_exchange_moves_a_sixth_of_the_bytes(runs):
    exact = sum(wire_bytes(runs["exact"]["hlo"]).values())
    compressed = wire_bytes(runs["4bit"]["hlo"])
    assert compressed["all-to-all"] > 0 and compressed["all-gather"] > 0
    assert sum(compressed.values()) <= exact / 6, (compressed, exact)


def test_4bit_training_matches_uncompressed_validation_loss(runs):
    exact, compressed = runs["exact"]["val_history"][-1][1], runs["4bit"]["val_history"][-1][1]
    assert runs["exact"]["val_history"][0][1] - exact > 2.0  # it learned something
    assert abs(compressed - exact) <= 0.02 * exact, (compressed, exact)


def test_2bit_with_error_feedback_still_trains(devices):
    run = train(TrainOptions(**TRAIN, compress_bits=2), devices=devices)
    val = run["val_history"]
    assert val[-1][1] < val[0][1] - 2.0, val
    assert np.all(np.isfinite([r["loss"] for r in run["history"]]))


def test_error_feedback_state_is_per_data_shard_and_resumes(runs, tmp_path):
    trainer, state = runs["4bit"]["trainer"], runs["4bit"]["state"]
    residual = jax.tree.leaves(state.reducer)
    params = jax.tree.leaves(state.params)
    assert [r.shape for r in residual] == [(8, *p.shape) for p in params]
    assert all(r.sharding.spec[0] == "data" for r in residual)
    assert any(np.any(np.asarray(r)) for r in residual)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)  # the generic checkpointer: any pytree
    ckpt.maybe_save(STEPS, state.as_dict(), force=True)
    ckpt.close()
    restored, spare = (TrainState.from_dict(Checkpointer(tmp_path / "ckpt").restore(
        state.as_dict())) for _ in range(2))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(a, b)

    def continue_from(s, n=3):  # the step donates `s`
        out = []
        for i in range(n):
            s, metrics = trainer.step(s, lm_batch(trainer, runs["corpus"], STEPS + i))
            out.append(float(metrics["loss"]))
        return out

    resumed = continue_from(restored)
    assert resumed == continue_from(state)
    # The residual matters: dropping it changes the trajectory (so the check above can fail).
    spare = spare.replace(reducer=jax.tree.map(jnp.zeros_like, spare.reducer))
    assert continue_from(spare)[1:] != resumed[1:]


def test_no_error_feedback_keeps_no_state(devices):
    from axonn_jax.train import build_trainer

    trainer = build_trainer(TrainOptions(**{**TRAIN, "compress_bits": 4, "error_feedback": False}),
                            devices=devices)
    state = trainer.init_state()
    assert state.reducer is None
    lowered = trainer.step.lower(state, trainer.bound.abstract_batch())
    text = lowered.as_text()
    assert "all_to_all" in text and "all_gather" in text
    assert "threefry" in text  # stochastic rounding's noise (nearest rounding draws none)


@pytest.mark.parametrize("argv, message", [
    (["--compress-bits", "9"], "bits must be an integer in 1..8, got 9"),
    (["--compress-bits", "4", "--compress-bucket", "100"], "multiple of 8"),
])
def test_cli_bad_compression_flags(argv, message, capsys):
    assert cli_main(["train", "--steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err
