"""The grouped matmul of dropless experts (`parallel.grouped_matmul`): its Pallas kernels, run in
interpret mode on CPU, against `jax.lax.ragged_dot` (the reference: jaxlib's own grouped
matmul), forward and both gradients; the platform switch; the kernels laid out over tensor axes
(`parallel.experts.expert_matmul`); and how `analysis.hlo` counts the kernels' declared FLOPs.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from axonn_jax.analysis import hlo
from axonn_jax.parallel import experts, grouped_matmul as gm


def _close(a, b, tol=1e-5):
    """Leaf by leaf: max |a - b| ≤ tol · max |b|."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        assert np.abs(x - y).max() <= tol * max(np.abs(y).max(), 1e-30), np.abs(x - y).max()


def _operands(m, k, n, sizes, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32)
    w = jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32)
    ct = jax.random.normal(keys[2], (m, n), jnp.float32)
    return x, w, jnp.array(sizes, jnp.int32), ct


def _value_and_grads(matmul, x, w, sizes, ct):
    """`(y, dy/dx, dy/dw)` of `Σ matmul(x, w, sizes)·ct`."""
    y, vjp = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
    return (y, *vjp(ct))


@pytest.mark.parametrize("m, k, n, sizes", [
    (200, 32, 64, [50, 0, 93]),  # an empty group, rows past the groups, rows not a tile multiple
    (128, 64, 128, [64, 64]),  # groups on tile boundaries, every row routed
    (96, 16, 32, [0, 0, 1, 0]),  # one row
    (64, 32, 256, [0, 0]),  # nothing routed: zeros
    (100, 24, 176, [30, 50]),  # features padded to whole tiles (a DeepSeek expert's 1408 / 8)
])
def test_kernels_equal_ragged_dot(m, k, n, sizes):
    """Forward, input gradient and weight gradient of the kernels (interpret mode) equal
    `ragged_dot`'s in float32 to 1e-5 of their scale; rows past the groups come out zero."""
    x, w, sizes, ct = _operands(m, k, n, sizes)
    kernel = functools.partial(gm.grouped_matmul, interpret=True)
    got = _value_and_grads(kernel, x, w, sizes, ct)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, ct)
    _close(got, want)
    routed = int(sizes.sum())
    assert not np.asarray(got[0][routed:]).any() and not np.asarray(got[1][routed:]).any()


def test_kernels_in_bfloat16():
    """bf16 operands, float32 accumulation: within bf16's rounding of `ragged_dot`'s."""
    x, w, sizes, ct = _operands(192, 64, 128, [70, 0, 100])
    x, w, ct = (a.astype(jnp.bfloat16) for a in (x, w, ct))
    kernel = functools.partial(gm.grouped_matmul, interpret=True)
    got = _value_and_grads(kernel, x, w, sizes, ct)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, sizes, ct)
    _close(got, want, tol=2e-2)


def test_platform_switch():
    """GPU meshes get the kernels, CPU `ragged_dot`."""
    assert gm.use_kernel("gpu") and not gm.use_kernel("cpu")
    jaxpr = str(jax.make_jaxpr(lambda x, w, s: gm.grouped_matmul(x, w, s))(
        *_operands(64, 32, 64, [10, 20])[:3]))
    assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr  # this process is on CPU


def test_declared_flops():
    """Routed rows plus one tile per group, at most every row."""
    assert gm.declared_flops(1000, 8, 4, 2, 100) == 2 * 8 * 4 * (100 + 2 * gm.TILE_M)
    assert gm.declared_flops(100, 8, 4, 2, 100) == 2 * 8 * 4 * 100


def test_hlo_counts_the_declared_flops():
    """`analysis.hlo.flops` counts a kernel custom call at the FLOPs its name declares (the
    `op_name` metadata of a compiled Pallas call), other custom calls at nothing."""
    text = """HloModule m

ENTRY %main (a: bf16[8,4], b: bf16[2,4,4]) -> bf16[8,4] {
  %a = bf16[8,4]{1,0} parameter(0)
  %b = bf16[2,4,4]{2,1,0} parameter(1)
  %k = bf16[8,4]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/axonn_grouped_matmul_fwd_flops_1234/pallas_call"}
  ROOT %o = bf16[8,4]{1,0} custom-call(%k), custom_call_target="something_else"
}
"""
    assert hlo.flops(text) == 1234
    assert hlo.FlopCounter(text, matmuls_only=True).computation("main") == 1234


@pytest.fixture
def patched_kernels(monkeypatch):
    """`expert_matmul` takes the kernel path on this CPU process, with `ragged_dot` standing in
    for the kernels (tested above; interpret mode cannot carry the manual axes' types through
    its loops inside a shard_map), so what is tested is the layout over the tensor axes."""
    monkeypatch.setattr(gm, "use_kernel", lambda platform=None: True)
    monkeypatch.setattr(gm, "grouped_matmul", lambda x, w, s, **_: jax.lax.ragged_dot(x, w, s))


@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 2, 2)])
def test_expert_matmul_over_tensor_axes(patched_kernels, shape):
    """The kernel path of `expert_matmul` inside a shard_map manual over `expert`, with `row`
    and `col` automatic (as in the train step), laid out as AxoNN splits a dense layer: gate
    and up projections, then the down projection, equal `ragged_dot`'s, values and gradients."""
    devices = np.array(jax.devices()[:4]).reshape(shape)
    mesh = Mesh(devices, ("expert", "row", "col"))
    r, d, ff, local = 96, 32, 64, 2
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    rows = jax.random.normal(keys[0], (shape[0] * r, d))
    w_gate, w_up = (jax.random.normal(k, (shape[0] * local, d, ff)) / 4 for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (shape[0] * local, ff, d)) / 4
    sizes = jnp.tile(jnp.array([30, 50], jnp.int32), shape[0])

    def swiglu(rows, sizes, w_gate, w_up, w_down, kernel):
        def body(rows, sizes, w_gate, w_up, w_down):
            if kernel:
                g, u = experts.expert_matmul(rows, (w_gate, w_up), sizes, axes=("col", "row"))
                (y,) = experts.expert_matmul(jax.nn.silu(g) * u, (w_down,), sizes,
                                             axes=("row", "col"))
            else:
                dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes)  # noqa: E731
                y = dot(jax.nn.silu(dot(rows, w_gate)) * dot(rows, w_up), w_down)
            return jnp.sum(y * jnp.cos(rows))[None]

        spec = P("expert")
        loss = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=P("expert"),
                             axis_names=frozenset({"expert"}))
        return jnp.sum(loss(rows, sizes, w_gate, w_up, w_down))

    args = (rows, sizes, w_gate, w_up, w_down)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(rows, P("expert")), put(sizes, P("expert")),
            *(put(w, P("expert", "col", "row")) for w in (w_gate, w_up)),
            put(w_down, P("expert", "row", "col")))

    def run(kernel):
        f = jax.value_and_grad(functools.partial(swiglu, kernel=kernel), argnums=(0, 2, 3, 4))
        with jax.set_mesh(mesh):
            return jax.jit(f)(*args)

    _close(run(True), run(False))


def test_grouped_swiglu_with_the_kernels(monkeypatch):
    """`experts.grouped_swiglu` on the kernel path (the kernels in interpret mode, one device):
    gate and up in one kernel, then down, equal the `ragged_dot` path, values and gradients;
    empty slots (id = the number of experts) come out zero."""
    r, d, ff, local = 80, 32, 48, 3
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    rows = jax.random.normal(keys[0], (r, d))
    ids = jax.random.randint(keys[1], (r,), 0, local + 1)  # id `local`: an empty slot
    w_gate, w_up = (jax.random.normal(k, (local, d, ff)) / 4 for k in keys[2:4])
    w_down = jax.random.normal(keys[4], (local, ff, d)) / 4

    def loss(rows, w_gate, w_up, w_down):
        y = experts.grouped_swiglu(rows, ids, w_gate, w_up, w_down, routed_rows=r // 2)
        return jnp.sum(y * jnp.cos(rows)), y

    want = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        rows, w_gate, w_up, w_down)
    monkeypatch.setattr(gm, "use_kernel", lambda platform=None: True)
    monkeypatch.setattr(gm, "grouped_matmul",
                        functools.partial(gm.grouped_matmul, interpret=True))
    got = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        rows, w_gate, w_up, w_down)
    _close(got, want)
    assert not np.asarray(got[0][1][np.asarray(ids) == local]).any()
