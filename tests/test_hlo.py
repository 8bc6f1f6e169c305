"""The HLO collective-bytes parser on hand-written and compiled programs, and AxoNN's analytic byte
count against the compiled program."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from axonn_jax.analysis.gspmd import BlockShape, analytic_bytes, axonn_variant
from axonn_jax.analysis.hlo import collective_bytes, collectives, group_axes, wire_bytes

HLO = """HloModule jit_step, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %w = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ag = f32[16,8]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[1,8]{1,0} reduce-scatter(%w), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %w)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[4,8], y: bf16[2,2]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %y = bf16[2,2]{1,0} parameter(1)
  %ar = (f32[4,8]{1,0}, bf16[2,2]{1,0}) all-reduce(%x, %y), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %one = f32[4,8]{1,0} all-reduce(%x), channel_id=4, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %cps = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
  %init = (s32[], f32[4,8]{1,0}) tuple(%c0, %x)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_parser_counts_kinds_groups_and_loop_trips():
    found = {c.name: c for c in collectives(HLO)}
    assert set(found) == {"ar", "cps", "ag", "rs"}  # the group-of-one all-reduce moves nothing
    assert (found["ar"].bytes, found["ar"].group_size, found["ar"].executions) == (128 + 8, 2, 1)
    assert (found["ag"].bytes, found["ag"].group_size, found["ag"].executions) == (512, 4, 3)
    assert (found["rs"].bytes, found["rs"].group_size) == (32 * 4, 4)  # input = result × group
    assert found["cps"].bytes == 128
    assert collective_bytes(HLO) == {"all-reduce": 136, "all-gather": 1536, "reduce-scatter": 384,
                                     "all-to-all": 0, "collective-permute": 128}
    wire = wire_bytes(HLO)
    assert wire["all-reduce"] == pytest.approx(136.0) and wire["all-gather"] == pytest.approx(1152.0)


@pytest.mark.parametrize("attrs, group", [
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}, use_global_device_ids=true", (0, 2)),
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1), use_global_device_ids=true", (0, 2)),
    ("replica_groups=[2,4]<=[8], dimensions={0}", (0, 1, 2, 3)),
    # mesh form: the ids laid out on the named mesh, a group spans the axes in braces
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) "
     "{'axis_0'}, use_global_device_ids=true", (0, 1)),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) "
     "{'axis_1'}", (0, 2)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", (0, 1, 2, 3)),
    # a permute: its first pair between two devices
    ("source_target_pairs={{0,0},{1,4},{2,2},{3,6}}", (1, 4)),
])
def test_groups_in_every_spelling_map_to_mesh_axes(attrs, group):
    from axonn_jax.analysis.hlo import _first_group

    assert _first_group(attrs, 8) == group
    shape = {"data": 2, "pipe": 1, "depth": 1, "row": 2, "col": 2}
    assert group_axes((0, 1), shape) == ("col",)
    assert group_axes((0, 2, 4, 6), shape) == ("data", "row")
    assert group_axes((1, 4), shape) == ("data", "col")


@pytest.mark.parametrize("shape", ["f32[1024]{0}",  # jaxlib 0.10: the result alone
                                   "((f32[1024]{0}), f32[1024]{0})"])  # 0.12: (operands), result
def test_all_reduce_start_counts_its_result_once(shape):
    text = (f"HloModule m, num_partitions=8\n\nENTRY %main (x: f32[1024]) -> f32[1024] {{\n"
            f"  %x = f32[1024]{{0}} parameter(0)\n"
            f"  %s = {shape} all-reduce-start(%x), channel_id=1, replica_groups=[1,8]<=[8], "
            f"to_apply=%add\n"
            f"  ROOT %d = f32[1024]{{0}} all-reduce-done(%s)\n}}\n")
    assert collective_bytes(text)["all-reduce"] == 1024 * 4


def test_loop_without_trip_count_is_an_error():
    with pytest.raises(ValueError, match="no known_trip_count"):
        collectives(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))


@pytest.mark.parametrize("grid", [(2, 2, 2), (2, 1, 2, 2)], ids=lambda g: "row%d_col%d_depth%d" % g[:3] + ("_data%d" % g[3] if len(g) > 3 else ""))
def test_axonn_bytes_match_the_analytic_count(grid, devices):
    w = BlockShape(d_model=64, layers=2, heads=4, batch=8, seq=8)
    _, step, params, x = axonn_variant(w, grid, devices)
    measured = collective_bytes(step.lower(params, x).compile().as_text())
    expected = analytic_bytes(w, *grid)
    for kind, n in expected.items():
        assert measured[kind] == pytest.approx(n, rel=0.05), kind


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


def test_flops_follow_cost_analysis_and_multiply_loops():
    """`hlo.flops` counts as XLA's cost analysis does on a program without loops, and a scanned
    body once per iteration (where `cost_analysis()` counts it once)."""
    from axonn_jax.analysis.hlo import flops

    x, w, ws = jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((4, 128, 128))
    plain = jax.jit(lambda x, w: jax.nn.softmax(x @ w).sum() + jnp.mean(x ** 2)).lower(x, w).compile()
    assert flops(plain.as_text()) == pytest.approx(_cost_flops(plain), rel=1e-6)

    def scan(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

    scanned = jax.jit(jax.grad(scan)).lower(x, ws).compile()
    matmuls = 2 * 4 * 2 * 64 * 128 * 128  # forward and input gradient of 4 layers
    assert matmuls <= flops(scanned.as_text()) <= 1.01 * matmuls
    assert _cost_flops(scanned) < 0.3 * matmuls


def _cost_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


_FUSED_COMPARE = """
%fused_compare (q: s32[]) -> pred[] {
  %q = s32[] parameter(0)
  %bound = s32[] constant(5)
  ROOT %lt = pred[] compare(%q, %bound), direction=LT
}
"""
_COUNTING_COND = """%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %iv = s32[] get-tuple-element(%p), index=0
  ROOT %c = pred[] fusion(%iv), kind=kLoop, calls=%fused_compare
}"""
_CONSTANT_COND = """%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}"""


def test_trip_count_derived_from_the_loop_condition():
    """A loop XLA rewrote without recording its trip count (the accumulation loop of a large
    step, its body sunk): the count comes from the condition's compare with a constant (through a
    fusion) and the induction variable's constant start (through a copy)."""
    counted = (HLO.replace(_CONSTANT_COND, _FUSED_COMPARE + _COUNTING_COND)
               .replace("  %init = (s32[], f32[4,8]{1,0}) tuple(%c0, %x)",
                        "  %c2 = s32[] constant(2)\n  %c0 = s32[] copy(%c2)\n"
                        "  %init = (s32[], f32[4,8]{1,0}) tuple(%c0, %x)")
               .replace('"known_trip_count":{"n":"3"}',
                        '"known_induction_variable":{"tuple_index":"0"}'))
    assert _COUNTING_COND in counted and "copy(%c2)" in counted
    found = {c.name: c for c in collectives(counted)}
    assert found["ag"].executions == 3  # 5 - 2


@pytest.mark.parametrize("groups", [1, 4])
def test_convolutions_count_as_cost_analysis_does(groups):
    """A convolution's FLOPs (2 × output × input features per group × window), as XLA's cost
    analysis counts them; its two gradients are convolutions of the same count (the input
    gradient's padded positions not counted)."""
    from axonn_jax.analysis.hlo import flops

    x, w = jnp.ones((2, 16, 16, 8)), jnp.ones((3, 3, 8 // groups, 16))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=groups,
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    forward = jax.jit(conv).lower(x, w).compile()
    want = 2 * (2 * 14 * 14 * 16) * (8 // groups) * 9
    assert flops(forward.as_text()) == pytest.approx(_cost_flops(forward)) == want
    both = jax.jit(jax.grad(lambda x, w: conv(x, w).sum(), argnums=(0, 1))).lower(x, w).compile()
    assert flops(both.as_text()) == pytest.approx(2 * want)  # the input gradient's padding too


# cuDNN's convolution calls in a compiled H100 module (3×3, 16 -> 16 features, 1 × 4 × 4): each
# keeps the forward's dim_labels; the backward ones read (output gradient, kernel) and
# (input, output gradient).
_CUDNN_CONVS = """HloModule m

ENTRY %main (x: bf16[1,4,4,16], k: bf16[16,3,3,16], dy: bf16[1,4,4,16]) -> bf16[16,3,3,16] {
  %x = bf16[1,4,4,16]{3,2,1,0} parameter(0)
  %k = bf16[16,3,3,16]{3,2,1,0} parameter(1)
  %dy = bf16[1,4,4,16]{3,2,1,0} parameter(2)
  %f = (bf16[1,4,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward"
  %di = (bf16[1,4,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dk = (bf16[16,3,3,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %r = bf16[16,3,3,16]{3,2,1,0} get-tuple-element(%dk), index=0
}
"""


def test_cudnn_convolutions_count_as_the_forward():
    """The scale table's U-Net rows counted no convolution (cuDNN calls on the H100): each of
    forward, input gradient and kernel gradient is the forward's: 2 × 16 output features × 16
    input features × the 10 × 10 (output, window) pairs inside the padded 4 × 4 image."""
    from axonn_jax.analysis.hlo import flops

    assert flops(_CUDNN_CONVS) == 3 * 2 * 16 * 16 * 10 * 10
