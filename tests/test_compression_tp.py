"""CGX compression composed with tensor and pipeline parallelism: every device compresses its own
gradient shard over `data` (`compression.sharded_compressed_psum`), nothing is gathered."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax._compat import shard_map
from axonn_jax.parallel import compression as C
from axonn_jax.analysis.hlo import collectives
from axonn_jax.run.data import Corpus
from axonn_jax.train import TrainOptions, build_trainer

from conftest import (COMPRESSED, PARITY, assert_states_match, assert_steps_match,
                      comparable_state, field, lm_batches, relative_difference, run_steps)

AXES = ("data", "pipe", "depth", "row", "col")
B = 64  # bucket size of the unit test

# Per data shard: leaf shape and how the tensor axes split it.
SHAPES = {"w": (32, 128), "b": (4, 96), "v": (8, 40), "s": (100,)}
SPECS = {"w": P("col", "row"), "b": P(None, "row"), "v": P(), "s": P("col")}
KW = dict(bits=3, bucket_size=B, min_size=100, overrides={"^b$": 5})  # b: replicated over col


def _compressed(mesh, fn, specs):
    """Jitted `fn(local tree, local residual)` in a shard_map manual over `data`, called on trees
    whose leaves carry a leading data axis, placed split over data and `specs`."""
    def f(t, r):
        out, new_r = fn(*jax.tree.map(lambda a: a[0], (t, r)))
        return out, jax.tree.map(lambda a: a[None], new_r)

    g = jax.jit(shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")),
                          out_specs=(P(), P("data")), axis_names={"data"}))
    place = lambda x, s: jax.device_put(x, NamedSharding(mesh, P("data", *s)))  # noqa: E731
    return lambda t, r: g(jax.tree.map(place, t, specs), jax.tree.map(place, r, specs))


def _on(x, dev):
    return next(s for s in x.addressable_shards if s.device == dev)


def test_sharded_compressed_psum_is_compressed_psum_of_each_shard(devices):
    """Nearest rounding: each device's shard of the result (and of the new residual) is bitwise
    compressed_psum of that shard alone over `data`. Stochastic rounding (whose noise also depends
    on how tensors are grouped into buffers): copies replicated over a tensor axis stay equal and
    every shard is within two quantization steps of the exact sum."""
    n = 2
    mesh = Mesh(np.asarray(devices).reshape(n, 1, 1, 2, 2), AXES)
    keys = jax.random.split(jax.random.key(0), 2 * len(SHAPES))
    tree = {k: jax.random.normal(keys[i], (n, *s)) * (i + 1) for i, (k, s) in enumerate(SHAPES.items())}
    residual = {k: 0.05 * jax.random.normal(keys[4 + i], (n, *s)) for i, (k, s) in enumerate(SHAPES.items())}
    sharded = lambda **kw: _compressed(mesh, lambda t, r: C.sharded_compressed_psum(  # noqa: E731
        t, SPECS, mesh, "data", residual=r, **KW, **kw), SPECS)(tree, residual)
    out, new_r = sharded()

    # Reference: plain compressed_psum on a data-only mesh of the same size, shard by shard.
    data_mesh = Mesh(np.asarray(devices[:n]).reshape(n, 1, 1, 1, 1), AXES)
    plain = _compressed(data_mesh, lambda t, r: C.compressed_psum(t, "data", residual=r, **KW),
                        {k: P() for k in SPECS})
    for dev in mesh.devices.flat:
        local = lambda t: {k: np.asarray(t[k])[(slice(None), *_on(out[k], dev).index)]  # noqa: E731
                           for k in t}
        ref_out, ref_r = plain(local(tree), local(residual))
        data_index = int(np.argwhere(mesh.devices == dev)[0][0])
        for k in out:
            np.testing.assert_array_equal(_on(out[k], dev).data, ref_out[k], err_msg=k)
            np.testing.assert_array_equal(_on(new_r[k], dev).data[0], np.asarray(ref_r[k])[data_index],
                                          err_msg=k)
    # The compressed leaves really were quantized (the check above compares like with like).
    x = {k: np.asarray(tree[k] + residual[k], np.float64) for k in tree}
    assert relative_difference(out["w"], x["w"].sum(0)) > 1e-4
    assert relative_difference(out["s"], x["s"].sum(0)) <= 1e-6

    noisy, _ = sharded(key=jax.random.key(7))
    for k, bits in (("w", 3), ("b", 5), ("v", 3)):
        assert np.any(np.asarray(noisy[k]) != np.asarray(out[k]))
        by_index: dict = {}
        for shard in noisy[k].addressable_shards:
            key = tuple((sl.start, sl.stop) for sl in shard.index)
            by_index.setdefault(key, []).append(np.asarray(shard.data))
            xs = x[k][(slice(None), *shard.index)].reshape(n, -1)
            # Each step is at most range / (2^b - 1); bucket ranges are within the shard's.
            first = np.ptp(xs, axis=1).sum() / (2 ** bits - 1)
            second = (np.ptp(xs.sum(0)) + 2 * first) / (2 ** bits - 1)
            err = np.abs(np.asarray(shard.data, np.float64).ravel() - xs.sum(0))
            assert err.max() <= first + second + 1e-5, k
        assert all(np.array_equal(c[0], c_i) for c in by_index.values() for c_i in c)
    assert any(len(c) > 1 for c in by_index.values())


def test_compressed_stages_compose_to_sharded_compressed_psum(devices):
    """The two stages (`sharded_compressed_stages`), run one after the other, give bitwise what
    `sharded_compressed_psum` gives with nearest rounding, residuals included; each stage holds
    one of the exchange's two collectives over `data`."""
    n = 2
    mesh = Mesh(np.asarray(devices).reshape(n, 1, 1, 2, 2), AXES)
    keys = jax.random.split(jax.random.key(1), 2 * len(SHAPES))
    tree = {k: jax.random.normal(keys[i], (n, *s)) * (i + 1) for i, (k, s) in enumerate(SHAPES.items())}
    residual = {k: 0.05 * jax.random.normal(keys[4 + i], (n, *s)) for i, (k, s) in enumerate(SHAPES.items())}

    def staged(t, r):
        scatter, gather = C.sharded_compressed_stages(SPECS, mesh, "data", **KW)
        value, new_r = scatter(t, r)
        return gather(value), new_r

    want = _compressed(mesh, lambda t, r: C.sharded_compressed_psum(
        t, SPECS, mesh, "data", residual=r, **KW), SPECS)(tree, residual)
    got = _compressed(mesh, staged, SPECS)(tree, residual)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- training ------------------------------------------------------------------------------------

OPTS = dict(steps=3, batch_size=16, seq_len=32, **PARITY)


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(None, min_tokens=OPTS["seq_len"] + 2).train


def run(options, devices, corpus):
    """(per-step records, final state, trainer) of `options.steps` train steps (no evaluation)."""
    trainer = build_trainer(options, devices)
    state, records = run_steps(trainer, trainer.init_state(), lm_batches(trainer, corpus),
                               options.run.steps)
    return records, state, trainer


def assert_tracks(got, ref):
    """(records, state, trainer) `got` (8-bit gradients) and `ref`: the losses within 1e-3, the
    gradient norms within 5e-3 (measured 4.6e-4 and 2.7e-3: buckets of 1024 quantized in steps of
    range/255), the final state leaf by leaf within COMPRESSED, and not equal (the gradients
    really were quantized)."""
    assert 0 < assert_steps_match(got[0], ref[0], 1e-3, 5e-3)
    assert_states_match(*(comparable_state(r[2], r[1]) for r in (got, ref)), **COMPRESSED)


def _residual_specs_follow_params(state, trainer):
    flat_p = jax.tree_util.tree_leaves_with_path(field(state, "params"))
    flat_r = dict(jax.tree_util.tree_leaves_with_path(field(state, "reducer")))
    assert len(flat_r) == len(flat_p)
    split = 0
    for path, p in flat_p:
        r = flat_r[path]
        assert r.shape == (trainer.options.parallel.data, *p.shape)
        want = P("data", *p.sharding.spec)
        assert r.sharding.is_equivalent_to(NamedSharding(trainer.step.mesh, want), r.ndim), (path, r.sharding)
        split += any(e is not None for e in p.sharding.spec)
    assert split > 0  # some residuals are split over the tensor axes, not gathered
    assert any(np.any(np.asarray(r)) for r in flat_r.values())


def test_tensor_parallel_8bit_tracks_exact_trajectory(devices, corpus):
    grid = ParallelConfig(data=2, depth=2, row=2)
    exact = run(TrainOptions(**OPTS, parallel=grid), devices, corpus)
    packed = run(TrainOptions(**OPTS, parallel=grid, compress_bits=8), devices, corpus)
    assert_tracks(packed, exact)
    _residual_specs_follow_params(*packed[1:])


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(np.prod([int(d) for d in dims.split(",")])).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _axes_of(hlo_text: str, name: str, mesh_shape) -> frozenset:
    """Mesh axes spanned by the replica groups of instruction `name` (partition id i is device
    `mesh.devices.flat[i]`), from any of XLA's three spellings of the groups."""
    line = next(l for l in hlo_text.splitlines() if re.match(rf"\s*(ROOT\s+)?%?{re.escape(name)} =", l))
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    # jaxlib 0.12 leaves `device_ids` out when they are the mesh's own order.
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
                     r" \{([^}]*)\}", line)
    if iota:
        group = _iota(iota.group(2), iota.group(3)).reshape(
            [int(d) for d in iota.group(1).split(",")])[0]
    elif mesh:
        sizes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        dims = mesh.group(2) or ",".join(n for _, n in sizes)
        ids = _iota(dims, mesh.group(3)).reshape([int(n) for _, n in sizes])
        spanned = re.findall(r"'(\w+)'", mesh.group(4))
        group = ids[tuple(slice(None) if a in spanned else 0 for a, _ in sizes)]
    else:
        group = [int(x) for x in re.search(r"replica_groups=\{\{([0-9,]*)\}", line).group(1).split(",")]
    coords = np.stack(np.unravel_index(np.ravel(group), mesh_shape), axis=1)
    return frozenset(a for a, c in zip(AXES, coords.T) if len(set(c)) > 1)


def _bytes_by_axes(hlo_text: str, mesh_shape) -> dict:
    out: dict = {}
    for c in collectives(hlo_text):
        key = (c.kind, _axes_of(hlo_text, c.name, mesh_shape))
        out[key] = out.get(key, 0.0) + c.wire_bytes
    return out


def _step_hlo(options, devices):
    trainer = build_trainer(options, devices)
    state = trainer.init_state(abstract=True)
    return trainer.step.lower(state, trainer.bound.abstract_batch()).compile().as_text(), trainer


@pytest.mark.parametrize("grid", [dict(data=2, depth=2, col=2)],
                         ids=["data2-depth2-col2"])
def test_tensor_parallel_4bit_step_moves_a_sixth_of_the_data_bytes(devices, grid):
    config = ParallelConfig(**grid)
    shape = [config.as_dict()[a] for a in AXES]
    exact, _ = _step_hlo(TrainOptions(**OPTS, parallel=config), devices)
    packed, trainer = _step_hlo(TrainOptions(**OPTS, parallel=config, compress_bits=4), devices)
    exact, packed = _bytes_by_axes(exact, shape), _bytes_by_axes(packed, shape)
    data = frozenset({"data"})
    on_data = lambda b: sum(v for (k, axes), v in b.items() if axes == data)  # noqa: E731
    assert on_data(packed) <= on_data(exact) / 6, (packed, exact)
    # Everything off the data axis is the tensor-parallel step's own traffic, byte for byte: no
    # gradient was gathered or re-laid out for the compression.
    off = lambda b: {k: v for k, v in b.items() if k[1] != data}  # noqa: E731
    assert off(packed) == off(exact)
    # The compressed all-gather moves each device's shard, packed: at most a sixth of the fp32
    # bytes of this device's gradients.
    params = jax.tree.leaves(trainer.init_state(abstract=True).params)
    local_grad_bytes = sum(4 * np.prod(p.sharding.shard_shape(p.shape)) for p in params)
    assert 0 < packed[("all-gather", data)] <= local_grad_bytes / 6


def test_pipeline_tensor_parallel_compressed_tracks_data_parallel(devices, corpus):
    short = dict(OPTS, model="gpt-tiny-deep", batch_size=8)
    ref = run(TrainOptions(**short, parallel=ParallelConfig(data=2)), devices[:2], corpus)
    got = run(TrainOptions(**short, microbatches=2, schedule="1f1b", compress_bits=8,
                           parallel=ParallelConfig(pipe=2, row=2, data=2)), devices, corpus)
    assert_tracks(got, ref)
    _residual_specs_follow_params(*got[1:])
    # Stage blocks' residuals are split over pipe (layers) and row, like their parameters.
    r = field(got[1], "reducer")["blocks"]["query"]["kernel"]  # (2 data, 8 layers, 32, 32)
    assert {s.data.shape for s in r.addressable_shards} == {(1, 4, 32, 16)}
