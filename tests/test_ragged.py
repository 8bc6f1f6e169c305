"""Ragged expert exchanges (`parallel.ragged`): on CPU, which cannot run `ragged-all-to-all`,
`ragged.reference` (the same interface from a padded all-to-all and masks) checks the offsets and
sizes of the GPU path against the padded exchange; on abstract H100s the compiled module holds
`ragged-all-to-all` and `analysis.hlo` charges its routed rows."""
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from axonn_jax._compat import shard_map
from axonn_jax.analysis import hlo, targets
from axonn_jax.parallel import experts, ragged
from axonn_jax.run.cli import main as cli_main

NO_CUDA = targets.cuda_compile_problem()
needs_cuda = pytest.mark.skipif(NO_CUDA is not None, reason=f"{NO_CUDA}")

D, FF, E, K = 16, 32, 8, 2


def test_reference_matches_the_documented_example(devices):
    """`jax.lax.ragged_all_to_all`'s docstring example, axis of 2, through `reference`."""
    mesh = Mesh(np.array(devices[:2]), ("x",))
    args = [np.array(a, np.int32) for a in (
        [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
        [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    f = shard_map(lambda *a: ragged.reference(*(x[0] for x in a), axis="x")[None], mesh=mesh,
                  in_specs=(P("x"),) * 6, out_specs=P("x"))
    np.testing.assert_array_equal(jax.jit(f)(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])


def _layer(mesh, ragged_exchange: bool, dispatch_factor=None, num_experts=E, axis_names=None):
    """`f(x, logits, w_gate, w_up, w_down) -> sum(y·r)`: `routed_swiglu` over `expert`, tokens
    and experts split over it (the mesh's other axes automatic, when `axis_names` says so)."""
    def local(x, logits, r, w_gate, w_up, w_down):
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
        y, dropped = experts.routed_swiglu(
            x, ids, weights, w_gate, w_up, w_down, num_experts=num_experts, axis="expert",
            dispatch_factor=dispatch_factor, ragged=ragged_exchange)
        return jax.lax.psum(jnp.sum(y * r), "expert"), jax.lax.psum(dropped, "expert")

    f = shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=(P(), P()),
                  axis_names=axis_names)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3, 4, 5), has_aux=True))


@pytest.mark.parametrize("expert,dispatch_factor", [(2, None), (4, None), (4, 0.6), (8, None)])
def test_ragged_exchange_matches_padded(devices, expert, dispatch_factor):
    """Loss, drops and every gradient (tokens, router logits, expert weights) of the ragged
    exchange equal the padded one's, float32, to 1e-6."""
    mesh = Mesh(np.array(devices[:expert]), ("expert",))
    keys = jax.random.split(jax.random.key(1), 6)
    t = 32 * expert
    inputs = (jax.random.normal(keys[0], (t, D)), jax.random.normal(keys[1], (t, E)),
              jax.random.normal(keys[2], (t, D)),
              *(jax.random.normal(k, s) / math.sqrt(s[1]) for k, s in
                zip(keys[3:], [(E, D, FF), (E, D, FF), (E, FF, D)])))
    (loss, dropped), grads = _layer(mesh, False, dispatch_factor)(*inputs)
    (got, got_dropped), got_grads = _layer(mesh, True, dispatch_factor)(*inputs)
    assert int(got_dropped) == int(dropped) and (dispatch_factor is None) == (int(dropped) == 0)
    np.testing.assert_allclose(got, loss, rtol=1e-6)
    for g, want in zip(got_grads, grads):
        assert float(jnp.max(jnp.abs(g - want))) <= 1e-6 * max(float(jnp.max(jnp.abs(want))), 1)


def _sharded_inputs(mesh, batch_axis: str, experts_axis, num_experts: int):
    """`(x, logits, r, w_gate, w_up, w_down)` of `32 × size of batch_axis` tokens, placed on
    `mesh`: the tokens over `batch_axis`, the experts over `experts_axis` (None: whole) and
    their features over (`col`, `row`) as the MoE layer's partitioning metadata says."""
    keys = jax.random.split(jax.random.key(1), 6)
    t = 32 * mesh.shape[batch_axis]
    shapes = [(num_experts, D, FF), (num_experts, D, FF), (num_experts, FF, D)]
    inputs = [jax.random.normal(keys[0], (t, D)), jax.random.normal(keys[1], (t, num_experts)),
              jax.random.normal(keys[2], (t, D)),
              *(jax.random.normal(k, s) / math.sqrt(s[1]) for k, s in zip(keys[3:], shapes))]
    specs = [P(batch_axis)] * 3 + [P(experts_axis, "col", "row")] * 2 \
        + [P(experts_axis, "row", "col")]
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inputs, specs)]


def _assert_same(layer, inputs):
    """`layer(ragged)` with and without the GPU path: no drops, the loss (fp32, 1e-5: the partial
    sums over row are added in another order) and every gradient (1e-6) alike."""
    (loss, _), grads = layer(False)(*inputs)
    (got, dropped), got_grads = layer(True)(*inputs)
    assert int(dropped) == 0
    np.testing.assert_allclose(got, loss, rtol=1e-5)
    for g, want in zip(got_grads, grads):
        assert float(jnp.max(jnp.abs(g - want))) <= 1e-6 * max(float(jnp.max(jnp.abs(want))), 1)


@pytest.mark.parametrize("expert,row,col,num_experts", [(2, 2, 1, 8), (4, 2, 1, 4), (2, 2, 2, 4)])
def test_ragged_exchange_over_tensor_axes_matches_padded(devices, expert, row, col, num_experts):
    """With the experts' features split over automatic `row` and `col` axes, the ragged layer
    (manual over them, its sums over `row` added per token after the return exchange) gives the
    padded layer's loss and gradients (GSPMD's layout), float32: one local expert and several."""
    mesh = Mesh(np.array(devices[:expert * row * col]).reshape(expert, row, col),
                ("expert", "row", "col"))
    _assert_same(functools.partial(_layer, mesh, num_experts=num_experts, axis_names={"expert"}),
                 _sharded_inputs(mesh, "expert", "expert", num_experts))


@pytest.mark.parametrize("data,row,col", [(2, 2, 2), (1, 2, 4)])
def test_dropless_over_tensor_axes_without_an_expert_axis(devices, data, row, col):
    """Every expert on every device (no `expert` axis), features over automatic `row` and `col`:
    the GPU path (the assignments sorted through the grouped kernels, manual over the tensor
    axes, sums over `row` per token) equals GSPMD's layout of the same layer in loss and every
    gradient, inside a shard_map over `data` and outside any (`data` = 1)."""
    mesh = Mesh(np.array(devices[:data * row * col]).reshape(data, row, col),
                ("data", "row", "col"))

    def layer(ragged_path):
        def local(x, logits, r, w_gate, w_up, w_down):
            weights, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
            y, dropped = experts.routed_swiglu(x, ids, weights, w_gate, w_up, w_down,
                                               num_experts=4, ragged=ragged_path)
            return jnp.sum(y * r), dropped

        if data > 1:
            f = shard_map(lambda *a: jax.lax.psum(local(*a), "data"), mesh=mesh,
                          in_specs=(P("data"),) * 3 + (P(),) * 3, out_specs=(P(), P()),
                          axis_names={"data"})
        else:
            def f(*a):
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    return local(*a)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3, 4, 5), has_aux=True))

    _assert_same(layer, _sharded_inputs(mesh, "data", None, 4))


def test_dropless_over_tensor_axes_in_bfloat16(devices):
    """The GPU path in bfloat16 on XLA:CPU, outside any shard_map over row × col: every sum it
    issues (the combine weights' gradient over row and col among them) runs in float32 there,
    where a 16-bit all-reduce in a partly manual shard_map aborts the process; the loss equals
    GSPMD's layout's to bfloat16's precision."""
    mesh = Mesh(np.array(devices[:8]).reshape(1, 2, 4), ("data", "row", "col"))
    inputs = _sharded_inputs(mesh, "data", None, 4)
    inputs[0], inputs[2] = inputs[0].astype(jnp.bfloat16), inputs[2].astype(jnp.bfloat16)

    def loss(ragged_path):
        def f(x, logits, r, w_gate, w_up, w_down):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                weights, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
                y, _ = experts.routed_swiglu(x, ids, weights, w_gate, w_up, w_down,
                                             num_experts=4, ragged=ragged_path)
                return jnp.sum((y * r).astype(jnp.float32))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 3, 4, 5)))(*inputs)[0]

    np.testing.assert_allclose(loss(True), loss(False), rtol=2e-2)


def test_chunk_plan_offsets(devices):
    """Both sides packed: each sender's chunks follow one another, each receiver stacks its rows
    in the senders' order, the receive sizes are the senders' counts clipped to the chunk, and the
    way back swaps the roles."""
    mesh = Mesh(np.array(devices[:4]), ("expert",))
    counts = np.array([[3, 0, 5, 9], [1, 2, 3, 4], [0, 0, 0, 0], [8, 8, 8, 8]], np.int32)
    f = shard_map(lambda c: tuple(a[None] for a in dataclasses.astuple(
        ragged.chunk_plan(c[0], 8, "expert"))), mesh=mesh, in_specs=P("expert"),
        out_specs=(P("expert"),) * 6)
    starts, send, lands, recv, recv_at, peer_starts = (np.asarray(a) for a in jax.jit(f)(counts))
    sent = np.minimum(counts, 8)
    np.testing.assert_array_equal(send, sent)
    np.testing.assert_array_equal(starts, np.cumsum(sent, 1) - sent)
    np.testing.assert_array_equal(recv, sent.T)
    np.testing.assert_array_equal(recv_at, np.cumsum(sent.T, 1) - sent.T)
    np.testing.assert_array_equal(lands, recv_at.T)  # where mine land = where they take them
    np.testing.assert_array_equal(peer_starts, starts.T)


def test_hlo_charges_the_routed_rows():
    """A `ragged-all-to-all` counts as an all-to-all of the routed rows its frontend attribute
    declares (the operand is the padded buffer), the whole result without one."""
    text = """HloModule m, num_partitions=4

ENTRY %main (p: bf16[64,16]) -> bf16[64,16] {
  %p = bf16[64,16]{1,0} parameter(0)
  %o = bf16[64,16]{1,0} parameter(1)
  %a = s32[4]{0} parameter(2)
  %r = bf16[64,16]{1,0} ragged-all-to-all(%p, %o, %a, %a, %a, %a), replica_groups={{0,1,2,3}}, frontend_attributes={axonn_routed_rows="16"}
  ROOT %q = bf16[64,16]{1,0} ragged-all-to-all(%r, %o, %a, %a, %a, %a), replica_groups={{0,1,2,3}}
}
"""
    found = hlo.collectives(text)
    assert [(c.kind, c.bytes) for c in found] == [("all-to-all", 16 * 16 * 2),
                                                  ("all-to-all", 64 * 16 * 2)]


@needs_cuda
def test_h100_exchange_is_ragged(tmp_path, capsys):
    """Mixtral-tiny on 8 abstract H100s, expert 4 × row 2: the token exchanges compile to
    `ragged-all-to-all`, and the all-to-all bytes `analysis.hlo` reads equal `plan`'s."""
    assert cli_main(["compile", "--target", "h100", "--model", "mixtral-tiny", "--devices", "8",
                     "--batch-size", "8", "--seq-len", "64", "--expert", "4", "--row", "2",
                     "--dtype", "bfloat16", "--dump-hlo", str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    text = next(tmp_path.glob("*.txt")).read_text()
    assert "ragged-all-to-all" in text
    compiled = hlo.bytes_by_axes(text, report["grid"], buffers=True)
    assert compiled[("all-to-all", ("expert",))] > 0
    assert report["fits"]
    # The routed rows (and counts and offsets), not the padded buffers: as `plan` models them.
    assert report["comm_bytes_per_device"]["all-to-all"] == pytest.approx(
        report["predicted"]["comm_bytes_per_device"]["all-to-all"], rel=1e-9)


def test_model_counts_routed_rows_times_imbalance():
    """`experts.collectives`: a ragged exchange moves `tokens·top_k` rows (× the imbalance, capped
    by the padded buffer of `expert·tokens·top_k` rows); the padded one the whole buffer."""
    def rows_bytes(**kw):
        return sorted({b for kind, _, b in experts.collectives(64, 16, 8, 2, 4, dtype_bytes=2, **kw)
                       if kind == "all-to-all"})[-1]
    assert rows_bytes() == 4 * 64 * 2 * 16 * 2
    assert rows_bytes(ragged=True) == 64 * 2 * 16 * 2
    assert rows_bytes(ragged=True, imbalance=1.5) == 1.5 * 64 * 2 * 16 * 2
    assert rows_bytes(ragged=True, imbalance=9.0) == rows_bytes()
