"""The HLO byte counter against collectives whose sizes are known by construction."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from axonn_jax.parallel.hlo import collective_bytes, collectives, wire_bytes


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices).reshape(2, 4), ("a", "b"))


def _bytes(mesh, f, in_specs, out_specs, *args):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                              check_vma=False))
    text = g.lower(*args).compile().as_text()
    return collective_bytes(text), wire_bytes(text)


def test_each_kind_counts_ring_wire_bytes(mesh):
    x = jnp.ones((8, 64), jnp.float32)

    buffers, wire = _bytes(mesh, lambda x: jax.lax.psum(x, "b"), P("a"), P("a"), x)
    assert buffers["all-reduce"] == 4 * 64 * 4
    assert wire["all-reduce"] == pytest.approx(2 * 3 / 4 * 4 * 64 * 4)

    _, wire = _bytes(mesh, lambda x: jax.lax.all_gather(x, "b", tiled=True), P(None, "b"),
                     P(), x)
    assert wire["all-gather"] == pytest.approx(3 / 4 * 8 * 64 * 4)

    _, wire = _bytes(mesh, lambda x: jax.lax.psum_scatter(x, "b", tiled=True), P(), P("b"), x)
    assert wire["reduce-scatter"] == pytest.approx(3 / 4 * 8 * 64 * 4)

    _, wire = _bytes(mesh, lambda x: jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)]),
                     P("a", "b"), P("a", "b"), x)
    assert wire["collective-permute"] == pytest.approx(4 * 16 * 4)

    _, wire = _bytes(mesh, lambda x: jax.lax.all_to_all(x, "b", 0, 0, tiled=True), P("a"), P("a"), x)
    assert wire["all-to-all"] == pytest.approx(3 / 4 * 4 * 64 * 4)


def test_loops_multiply_by_trip_count(mesh):
    def f(ws, x):
        y, _ = jax.lax.scan(lambda x, w: (jax.lax.psum(x @ w, "a"), None), x, ws)
        return y

    buffers, wire = _bytes(mesh, f, (P(), P()), P(), jnp.ones((5, 4, 4)), jnp.ones((2, 4)))
    assert buffers["all-reduce"] == 5 * 2 * 4 * 4
    assert wire["all-reduce"] == pytest.approx(5 * (2 * 1 / 2) * 2 * 4 * 4)


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY"):
        collective_bytes("HloModule m\n")


def test_conditional_counts_its_heaviest_branch(mesh):
    def f(x):
        light = lambda x: jax.lax.psum(x[:1], "b").sum() + x.sum()  # noqa: E731
        heavy = lambda x: jax.lax.psum(x, "b").sum()  # noqa: E731
        return jax.lax.cond(jax.lax.axis_index("b") == 0, heavy, light, x)

    buffers, _ = _bytes(mesh, f, P("a"), P(), jnp.ones((8, 64)))
    assert buffers["all-reduce"] == 4 * 64 * 4
