"""The overlap report (`analysis.overlap`): the replay of a scheduled module on hand-written HLO
whose answer is known from the machine's rates, and on the step compiled for abstract H100s."""
import pytest

from axonn_jax.analysis import comm_model as cm, overlap

H100 = cm.MACHINES["h100-dgx"]
MESH = {"data": 2, "row": 8}

DOT = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

STRAIGHT = "HloModule s, is_scheduled=true, num_partitions=16\n" + DOT + """
ENTRY %main (x: bf16[1024,1024], y: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %y = bf16[1024,1024]{1,0} parameter(1)
  %ags = (bf16[1024,1024]{1,0}, bf16[8192,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,8]<=[16], dimensions={0}
  %f = bf16[1024,1024]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_dot
  %agd = bf16[8192,1024]{1,0} all-gather-done(%ags)
  %ar = bf16[1024,1024]{1,0} all-reduce(%f), channel_id=2, replica_groups={{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}, to_apply=%add
  ROOT %r = bf16[1024,1024]{1,0} add(%ar, %x)
}
"""

PIPELINED = "HloModule p, is_scheduled=true, num_partitions=16\n" + DOT + """
%body (p: (s32[], bf16[1024,1024], bf16[1024,1024])) -> (s32[], bf16[1024,1024], bf16[1024,1024]) {
  %p = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[1024,1024]{1,0} get-tuple-element(%p), index=1
  %prev = bf16[1024,1024]{1,0} get-tuple-element(%p), index=2
  %f = bf16[1024,1024]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %done = bf16[1024,1024]{1,0} all-reduce-done(%prev)
  %next = bf16[1024,1024]{1,0} all-reduce-start(%f), channel_id=1, replica_groups=[2,8]<=[16], to_apply=%add
  ROOT %t = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%i, %done, %next)
}

%cond (p: (s32[], bf16[1024,1024], bf16[1024,1024])) -> pred[] {
  %p = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%idle (q: bf16[1024,1024]) -> bf16[1024,1024] {
  ROOT %q = bf16[1024,1024]{1,0} parameter(0)
}

%send (q: bf16[1024,1024]) -> bf16[1024,1024] {
  %q = bf16[1024,1024]{1,0} parameter(0)
  %cps = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%q), channel_id=3, source_target_pairs={{0,8},{8,0}}
  ROOT %cpd = bf16[1024,1024]{1,0} collective-permute-done(%cps)
}

ENTRY %main (x: bf16[1024,1024], k: s32[]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %init = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%c0, %x, %x)
  %loop = (s32[], bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %y = bf16[1024,1024]{1,0} get-tuple-element(%loop), index=1
  ROOT %z = bf16[1024,1024]{1,0} conditional(%k, %y, %y), branch_computations={%idle, %send}
}
"""

DOT_S = overlap.instruction_seconds(2 * 1024**3, 2 * 1024**3, 3 * 2 * 1024**2, "bf16", H100)
MB2 = 2 * 1024**2


def test_a_window_with_a_matmul_hides_up_to_its_time():
    s = overlap.report(STRAIGHT, MESH, H100)
    found = {o.name: o for o in s.overlaps}
    ag, ar = found["ags"], found["ar"]
    assert ag.axes == ("row",) and ag.asynchronous and ag.with_compute
    assert ag.window_matmul_flops == 2 * 1024**3
    assert ag.comm_s == pytest.approx(cm.link_time("all-gather", 8 * MB2, 8, False, H100))
    assert ag.window_s == pytest.approx(DOT_S)
    assert ag.exposed_s == pytest.approx(max(0.0, ag.comm_s - DOT_S))
    # synchronous, across the two nodes (data): exposed whole, at the NICs' speed
    assert ar.axes == ("data",) and not ar.asynchronous and not ar.with_compute
    assert ar.comm_s == pytest.approx(cm.link_time("all-reduce", MB2, 2, True, H100))
    assert ar.exposed_s == pytest.approx(ar.comm_s)
    assert s.exposed_s == pytest.approx(ag.exposed_s + ar.exposed_s)
    assert s.matmul_s == pytest.approx(DOT_S)
    table = overlap.summary(s.overlaps)
    assert table["all-gather over row"]["with_compute"] == 1.0
    assert table["all-reduce over data"]["hidden"] == 0.0


def _two_in_flight(second_groups: str) -> str:
    """Two all-gathers in flight at once: one over `row` (inside a node), the other over
    `second_groups`."""
    return "HloModule t, is_scheduled=true, num_partitions=16\n" + DOT + f"""
ENTRY %main (x: bf16[1024,1024]) -> (bf16[8192,1024], bf16[2048,1024]) {{
  %x = bf16[1024,1024]{{1,0}} parameter(0)
  %a = (bf16[1024,1024]{{1,0}}, bf16[8192,1024]{{1,0}}) all-gather-start(%x), channel_id=1, replica_groups=[2,8]<=[16], dimensions={{0}}
  %b = (bf16[1024,1024]{{1,0}}, bf16[2048,1024]{{1,0}}) all-gather-start(%x), channel_id=2, replica_groups={second_groups}, dimensions={{0}}
  %ad = bf16[8192,1024]{{1,0}} all-gather-done(%a)
  %bd = bf16[2048,1024]{{1,0}} all-gather-done(%b)
  ROOT %r = (bf16[8192,1024]{{1,0}}, bf16[2048,1024]{{1,0}}) tuple(%ad, %bd)
}}
"""


def test_collectives_on_different_links_run_at_once():
    """In flight together, a collective inside the nodes (NVLink) and one across them (the
    NICs) take the longer of their times; two on the same links take the sum."""
    inside = cm.link_time("all-gather", 8 * MB2, 8, False, H100)
    across = overlap.report(_two_in_flight("{{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},{7,15}}"),
                            MESH, H100)
    nic = cm.link_time("all-gather", 2 * MB2, 2, True, H100)
    assert across.step_s == pytest.approx(max(inside, nic))
    within = overlap.report(_two_in_flight("[8,2]<=[16]"), MESH, H100)
    pair = cm.link_time("all-gather", 2 * MB2, 2, False, H100)
    assert within.step_s == pytest.approx(inside + pair)


def test_a_pipelined_collective_hides_behind_the_next_iteration():
    """A start at the end of a loop body whose done is in the next iteration (carried through the
    loop tuple) has the next iteration's matmul to hide behind; the last one's done is after the
    loop. Of a conditional's branches the one with collectives counts (`hlo`'s convention). The
    permute crosses the nodes: it runs on the NICs while the last all-reduce (inside the node)
    is still on NVLink."""
    s = overlap.report(PIPELINED, MESH, H100)
    found = {o.name: o for o in s.overlaps}
    ar, cp = found["next"], found["cps"]
    assert ar.executions == 4 and ar.asynchronous
    comm = cm.link_time("all-reduce", MB2, 8, False, H100)
    steady = max(0.0, comm - DOT_S)
    assert ar.exposed_s == pytest.approx((3 * steady + comm) / 4)
    assert ar.window_matmul_flops == pytest.approx(3 / 4 * 2 * 1024**3)
    assert cp.executions == 1 and cp.axes == ("data",)
    assert s.step_s == pytest.approx(4 * DOT_S + 3 * steady + cp.comm_s)


HOST = "HloModule h, is_scheduled=true, num_partitions=1\n" + DOT + """
%to_host (p0: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  ROOT %c = bf16[1024,1024]{1,0:S(5)} copy(%p0)
}

ENTRY %main (x: bf16[1024,1024], h: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %h = bf16[1024,1024]{1,0:S(5)} parameter(1)
  %in = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0:S(5)}, u32[]) copy-start(%h)
  %out = (bf16[1024,1024]{1,0:S(5)}, bf16[1024,1024]{1,0}, u32[]) copy-start(%x)
  %f = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot
  %ind = bf16[1024,1024]{1,0} copy-done(%in)
  %outd = bf16[1024,1024]{1,0:S(5)} copy-done(%out)
  %sync = bf16[1024,1024]{1,0:S(5)} fusion(%f), kind=kLoop, calls=%to_host
  ROOT %r = bf16[1024,1024]{1,0} add(%ind, %f)
}
"""


def test_host_copies_run_on_the_host_link_one_stream_per_direction():
    """Copies between host memory (`S(5)`) and the device take their bytes at the machine's host
    link rate: an asynchronous one hides behind the compute in its window, the two directions run
    at once (the device-to-host copy started beside the host-to-device one waits for nothing
    more), and a synchronous one holds the compute stream for its whole transfer."""
    s = overlap.report(HOST, {}, H100)
    found = {o.name: o for o in s.overlaps}
    link = MB2 / H100.host_bw
    assert {o.kind for o in s.overlaps} == set(overlap.HOST_KINDS)
    assert found["in"].kind == "host-to-device" and found["in"].wire_bytes == MB2
    assert found["in"].comm_s == pytest.approx(link)
    assert found["in"].exposed_s == pytest.approx(link - DOT_S)
    assert found["out"].kind == "device-to-host" and found["out"].exposed_s == pytest.approx(0.0)
    assert not found["sync"].asynchronous and found["sync"].exposed_s == pytest.approx(link)
    table = overlap.summary(s.overlaps)
    assert table["device-to-host over host"]["bytes"] == 2 * MB2
    assert s.step_s >= 2 * link


SLICED_INTO_PLACE = """HloModule u, is_scheduled=true, num_partitions=1

%cast_layer (p0: bf16[24,512,1024], p1: s32[], p2: f32[24,512,1024]) -> bf16[24,512,1024] {
  %p0 = bf16[24,512,1024]{2,1,0} parameter(0)
  %p2 = f32[24,512,1024]{2,1,0} parameter(2)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %s = f32[1,512,1024]{2,1,0} dynamic-slice(%p2, %p1, %c0, %c0), dynamic_slice_sizes={1,512,1024}
  %b = bf16[1,512,1024]{2,1,0} convert(%s)
  ROOT %u = bf16[24,512,1024]{2,1,0} dynamic-update-slice(%p0, %b, %p1, %c0, %c0)
}

%cast_last (p0: f32[24,512,1024]) -> bf16[1,512,1024] {
  %p0 = f32[24,512,1024]{2,1,0} parameter(0)
  %v = f32[24,512,1024]{2,1,0} bitcast(%p0)
  %s = f32[1,512,1024]{2,1,0} slice(%v), slice={[23:24], [0:512], [0:1024]}
  ROOT %b = bf16[1,512,1024]{2,1,0} convert(%s)
}

ENTRY %main (a: bf16[24,512,1024], i: s32[], w: f32[24,512,1024]) -> bf16[24,512,1024] {
  %a = bf16[24,512,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[24,512,1024]{2,1,0} parameter(2)
  %last = bf16[1,512,1024]{2,1,0} fusion(%w), kind=kLoop, calls=%cast_last
  ROOT %f = bf16[24,512,1024]{2,1,0} fusion(%a, %i, %w), kind=kLoop, calls=%cast_layer
}
"""


def test_a_layer_cast_into_a_stack_touches_one_layer():
    """One layer of an fp32 stack sliced, cast and written into a bf16 stack in place (a scan
    saving its layers' cast weights): the kernel reads the f32 layer and writes the bf16 layer,
    nothing of the two stacks beyond them. The same for the last layer taken by a static slice
    (a loop's peeled iteration)."""
    costs = overlap._Costs(SLICED_INTO_PLACE, H100)
    main = {i.name: i for i in costs.comps[costs.counter.entry]}
    shapes = {name: i.shape for name, i in main.items()}
    assert costs.memory_bytes(main["f"], shapes) == 512 * 1024 * (4 + 2) + 4  # and the index
    assert costs.memory_bytes(main["last"], shapes) == 512 * 1024 * (4 + 2)


ASYNC_UPDATE = """HloModule a, is_scheduled=true

%fused_dus (p0: f32[8,256], p1: s32[], p2: f32[256]) -> f32[8,256] {
  %p0 = f32[8,256]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[256]{0} parameter(2)
  %row = f32[1,256]{1,0} bitcast(%p2)
  %c0 = s32[] constant(0)
  ROOT %u = f32[8,256]{1,0} dynamic-update-slice(%p0, %row, %p1, %c0)
}

ENTRY %main (s: f32[8,256], i: s32[], r: f32[256]) -> f32[8,256] {
  %s = f32[8,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %r = f32[256]{0} parameter(2)
  %fs = ((f32[8,256]{1,0}, s32[], f32[256]{0}), f32[8,256]{1,0}, u32[]) fusion-start(%s, %i, %r), kind=kLoop, calls=%fused_dus
  ROOT %fd = f32[8,256]{1,0} fusion-done(%fs)
}
"""


def test_kernels_and_hbm_bytes_per_call():
    """`kernels` counts each fusion and collective start once per loop trip, the costlier
    branch of a conditional, no `-done`; an asynchronous fusion (`fusion-start`, whose shape
    holds its whole operands) costs what it touches, as if run synchronously: the updated row
    written, the row and the index read."""
    assert overlap.kernel_count(STRAIGHT) == 4  # all-gather, dot, all-reduce, add
    assert overlap.kernel_count(PIPELINED) == 4 * 2 + 1  # (dot, all-reduce) per trip; the send
    assert overlap.kernel_count(ASYNC_UPDATE) == 1
    assert overlap.hbm_bytes(ASYNC_UPDATE) == 2 * 256 * 4 + 4


PLACED_THEN_SLICED = """HloModule d, is_scheduled=true, num_partitions=16

%placed (p0: bf16[256,1024], p1: bf16[256,1024], p2: bf16[256,1024], p3: bf16[256,1024], p4: s32[], p5: s32[], p6: s32[]) -> bf16[256,1024] {
  %p0 = bf16[256,1024]{1,0} parameter(0)
  %p1 = bf16[256,1024]{1,0} parameter(1)
  %p2 = bf16[256,1024]{1,0} parameter(2)
  %p3 = bf16[256,1024]{1,0} parameter(3)
  %p4 = s32[] parameter(4)
  %p5 = s32[] parameter(5)
  %p6 = s32[] parameter(6)
  %zero = bf16[] constant(0)
  %c0 = s32[] constant(0)
  %base = bf16[512,1024]{1,0} broadcast(%zero), dimensions={}
  %b0 = bf16[256,1024]{1,0} bitcast(%p0)
  %u0 = bf16[512,1024]{1,0} dynamic-update-slice(%base, %b0, %p4, %c0)
  %u1 = bf16[512,1024]{1,0} dynamic-update-slice(%u0, %p1, %p5, %c0)
  %v0 = bf16[512,1024]{1,0} dynamic-update-slice(%base, %p2, %p4, %c0)
  %v1 = bf16[512,1024]{1,0} dynamic-update-slice(%v0, %p3, %p5, %c0)
  %m = bf16[512,1024]{1,0} multiply(%u1, %v1)
  %s = bf16[256,1024]{1,0} dynamic-slice(%m, %p6, %c0), dynamic_slice_sizes={256,1024}
  ROOT %r = bf16[256,1024]{1,0} copy(%s)
}

ENTRY %main (a: bf16[256,1024], b: bf16[256,1024], c: bf16[256,1024], d: bf16[256,1024], i: s32[], j: s32[], k: s32[]) -> bf16[256,1024] {
  %a = bf16[256,1024]{1,0} parameter(0)
  %b = bf16[256,1024]{1,0} parameter(1)
  %c = bf16[256,1024]{1,0} parameter(2)
  %d = bf16[256,1024]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %j = s32[] parameter(5)
  %k = s32[] parameter(6)
  ROOT %f = bf16[256,1024]{1,0} fusion(%a, %b, %c, %d, %i, %j, %k), kind=kLoop, calls=%placed
}
"""


def test_a_slice_of_placed_blocks_reads_one_block_per_chain():
    """A fusion whose result is a dynamic slice of blocks placed into buffers (two chains of
    dynamic-update-slices multiplied, as a ring's gathered rows feed an activation) reads each
    element from one block of each chain, not every block: 2 blocks read, 1 written."""
    block = 256 * 1024 * 2
    s = overlap.report(PLACED_THEN_SLICED, MESH, H100)
    assert s.other_s == pytest.approx(3 * block / H100.hbm_bw, rel=1e-4)  # + 3 indices


CUBLAS = """HloModule c, is_scheduled=true, num_partitions=16

ENTRY %main (x: bf16[2048,4096], w: bf16[4096,1024]) -> bf16[2048,1024] {
  %x = bf16[2048,4096]{1,0} parameter(0)
  %w = bf16[4096,1024]{1,0} parameter(1)
  %g = (bf16[2048,1024]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %r = bf16[2048,1024]{1,0} get-tuple-element(%g), index=0
}
"""


def test_a_cublas_gemm_counts_as_its_dot():
    """On a real GPU XLA's autotuner may run a dot as a cuBLAS call instead of a Triton fusion:
    the replay charges it the dot's FLOPs (2·m·n·k) at the matmul rate, and its operand types are
    the GEMM's."""
    from axonn_jax.analysis import hlo

    flops = 2.0 * 2048 * 1024 * 4096
    s = overlap.report(CUBLAS, MESH, H100)
    assert s.matmul_s == pytest.approx(flops / H100.matmul_rate("bf16"), rel=1e-6)
    assert hlo.gemm_operand_dtypes(CUBLAS) == [("bf16", "bf16")]


FP8_GEMMS = """HloModule f, is_scheduled=true, num_partitions=16

%upcast (p0: f8e4m3fn[2048,4096], p1: bf16[4096,1024]) -> bf16[2048,1024] {
  %p0 = f8e4m3fn[2048,4096]{1,0} parameter(0)
  %p1 = bf16[4096,1024]{1,0} parameter(1)
  %c = bf16[2048,4096]{1,0} convert(%p0)
  ROOT %d = bf16[2048,1024]{1,0} dot(%c, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%quantized (p0: bf16[2048,4096], p1: bf16[4096,1024]) -> f32[2048,1024] {
  %p0 = bf16[2048,4096]{1,0} parameter(0)
  %p1 = bf16[4096,1024]{1,0} parameter(1)
  %q0 = f8e4m3fn[2048,4096]{1,0} convert(%p0)
  %q1 = f8e4m3fn[4096,1024]{1,0} convert(%p1)
  ROOT %d = f32[2048,1024]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f8e4m3fn[2048,4096], y: bf16[2048,4096], w: bf16[4096,1024]) -> f32[2048,1024] {
  %x = f8e4m3fn[2048,4096]{1,0} parameter(0)
  %y = bf16[2048,4096]{1,0} parameter(1)
  %w = bf16[4096,1024]{1,0} parameter(2)
  %a = bf16[2048,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%upcast
  ROOT %b = f32[2048,1024]{1,0} fusion(%y, %w), kind=kCustom, calls=%quantized
}
"""


def test_a_gemm_runs_at_the_rate_of_what_its_dot_reads():
    """A GEMM fusion is charged at the FP8 rate when its dot reads two float8 operands, whatever
    its parameters: one upcasting a float8 parameter to bf16 for its dot runs at bf16's rate,
    one quantizing bf16 parameters to float8 in its prologue at the FP8 rate (within the casts'
    elementwise FLOPs, 2%)."""
    flops = 2.0 * 2048 * 1024 * 4096
    s = overlap.report(FP8_GEMMS, MESH, H100)
    want = flops / H100.matmul_rate("bf16") + flops / H100.matmul_rate("f8e4m3fn")
    assert H100.matmul_rate("f8e4m3fn") > 1.5 * H100.matmul_rate("bf16")
    assert s.matmul_s == pytest.approx(want, rel=2e-2)
    assert s.kernels["main/a"] == pytest.approx(flops / H100.matmul_rate("bf16"), rel=2e-2)
    assert s.kernels["main/b"] == pytest.approx(flops / H100.matmul_rate("f8e4m3fn"), rel=2e-2)


def test_hidden_shares_per_axis_and_mode():
    """A collective over several axes hides the least of theirs; a pipeline mode falls back to
    the spmd figure of an axis it did not measure; an axis never measured hides nothing."""
    from axonn_jax.analysis import hidden_shares as hs

    spmd, zb = hs.SHARES["spmd"], hs.SHARES["zb-h1"]
    assert hs.hidden_share(("row",), "zb-h1") == zb["row"] != spmd["row"]
    assert hs.hidden_share(("col",), "zb-h1") == spmd["col"]
    assert hs.hidden_share(("data", "col"), "spmd") == min(spmd["data"], spmd["col"])
    assert hs.hidden_share(("expert",)) == 0.0 and hs.hidden_share(()) == 0.0
    rows = {"all-reduce over data": {"comm_s": 4.0, "exposed_s": 1.0},
            "all-gather over row": {"comm_s": 1.0, "exposed_s": 1.0},
            "reduce-scatter over row": {"comm_s": 1.0, "exposed_s": 0.0},
            "all-reduce over data+row": {"comm_s": 9.0, "exposed_s": 9.0}}
    assert hs.axis_shares(rows) == {"data": 0.75, "row": 0.5}


def test_plan_exposes_what_the_stream_is_busy_for():
    """Without a pipeline, with rings: each collective waits for the share of the compute time
    the communication stream is busy, so the step exposes comm² / compute; twice the batch
    (twice the compute, the same gradient bytes) exposes less of the data-parallel exchange.
    Here the exchange runs after the backward (two microbatches accumulated); issued layer by
    layer inside it (one microbatch), only its last layer's share is exposed while the link has
    room in the backward."""
    from axonn_jax import ParallelConfig
    from axonn_jax.models.gpt import get_config

    grid = ParallelConfig(data=16)
    shares = []
    for batch in (1024, 2048):
        work = cm.Workload(get_config("gpt-1.3b"), batch=batch, seq_len=1024, microbatches=2)
        assert work.step(grid).rings and not work.step(grid).layer_sums
        comm = sum(cm._collective_time(c, grid, H100) for c in cm.collectives(work, grid))
        p = cm.predict(work, grid, H100)
        compute = p.compute_s - cm.update_seconds(work, grid, H100, p.memory_breakdown)
        assert sum(p.exposed_comm_s.values()) == pytest.approx(comm * comm / compute)
        assert set(p.exposed_comm_by_axis) == {"data"}
        shares.append(p.exposed_comm_by_axis["data"] / comm)
    assert shares[1] == pytest.approx(shares[0] / 2, rel=0.05)
    assert cm.stream_utilisation(3.0, 2.0) == 1.0 and cm.stream_utilisation(1.0, 0.0) == 1.0
    config = get_config("gpt-1.3b")
    layered = cm.Workload(config, batch=2048, seq_len=1024)
    assert layered.step(grid).layer_sums
    comm = sum(cm._collective_time(c, grid, H100) for c in cm.collectives(layered, grid))
    p = cm.predict(layered, grid, H100)
    assert p.exposed_comm_by_axis["data"] == pytest.approx(comm / config.num_layers)


def test_plan_exposes_what_the_measured_schedule_cannot_hide(monkeypatch):
    """Rows gathered whole (`--collective-matmul off`): the exposed data-parallel time is the
    exchange's time less the measured hidden share of that mode (the backward pass is far
    longer here), and falls as the share rises."""
    from axonn_jax import ParallelConfig
    from axonn_jax.analysis import hidden_shares as hs
    from axonn_jax.models.gpt import get_config

    work = cm.Workload(get_config("gpt-1.3b"), batch=4096, seq_len=1024, collective_matmul="off")
    grid = ParallelConfig(data=16)
    data_s = sum(cm._collective_time(c, grid, H100) for c in cm.collectives(work, grid)
                 if c.axes == ("data",))
    for share in (0.0, 0.5):
        monkeypatch.setitem(hs.SHARES, "spmd-gathers", {"data": share})
        p = cm.predict(work, grid, H100)
        assert p.compute_s * 2 / 3 > data_s * share
        assert p.exposed_comm_by_axis["data"] == pytest.approx(data_s * (1 - share))


def test_xla_options_only_for_gpu_meshes_without_a_pipeline():
    import jax

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax.analysis import targets
    from axonn_jax.step import xla_options as xo
    from axonn_jax.step.engines import make_engine
    from axonn_jax.step.train_step import StepOptions

    cpu = make_mesh(ParallelConfig(data=2), jax.devices("cpu")[:2])
    assert xo.compiler_options(cpu) is None
    with pytest.raises(ValueError, match="xla_options must be one of"):
        xo.compiler_options(cpu, "fast")
    if targets.cuda_compile_problem() is None:
        h100 = targets.h100_devices(8)
        gpu = make_mesh(ParallelConfig(data=2, depth=2, row=2), h100)
        got = xo.compiler_options(gpu)
        # Each option under its own name or, where this XLA renamed it, its successor's.
        assert xo.GPU_OPTIONS and all(k in got or xo.SUCCESSORS[k][0] in got
                                      for k in xo.GPU_OPTIONS)
        # Several axes, row or col among them or not: their collectives run beside each other.
        assert got[xo.OVERLAP_LIMIT] == xo.GPU_OPTIONS[xo.OVERLAP_LIMIT] > 1
        no_tensor = xo.compiler_options(make_mesh(ParallelConfig(data=2, depth=4), h100))
        assert no_tensor == got
        # One axis: its collectives share its links, one in flight (XLA's default).
        one_axis = xo.compiler_options(make_mesh(ParallelConfig(data=8), h100))
        assert one_axis == {**got, xo.OVERLAP_LIMIT: 1}
        assert xo.compiler_options(gpu, "xla") is None
        # The pipeline's engine compiles with XLA's defaults.
        pipelined = make_engine(None, ParallelConfig(data=4, pipe=2), StepOptions(microbatches=2))
        assert xo.compiler_options(make_mesh(ParallelConfig(data=4, pipe=2), h100),
                                   tuned=pipelined.gpu_overlap_options) is None


def test_options_this_xla_refuses_are_renamed_or_dropped_with_a_warning(monkeypatch):
    """A newer jaxlib may rename or retire a flag (0.11.2 refuses the pipelined all-gather's
    boolean): the step then compiles with its successor, or without it and a warning that names
    it, instead of every GPU step failing."""
    import jax

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax.step import xla_options as xo

    mesh = make_mesh(ParallelConfig(), jax.devices("cpu")[:1])
    known = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 1}
    with pytest.warns(UserWarning, match="no option xla_gpu_no_such_option"):
        assert xo.accepted(mesh, {**known, "xla_gpu_no_such_option": True}) == known
    monkeypatch.setitem(xo.SUCCESSORS, "xla_gpu_renamed_option",
                        ("xla_gpu_memory_limit_slop_factor", 100))
    assert xo.accepted(mesh, {**known, "xla_gpu_renamed_option": True}) == {
        **known, "xla_gpu_memory_limit_slop_factor": 100}


def test_data_parallel_gradients_are_reduced_inside_the_backward_scan(devices):
    """`SpmdEngine.layer_reduce`: the exact data-parallel all-reduce of the blocks' gradients is
    issued in the backward loop's body, layer by layer (what lets the schedule hide it:
    benchmarks/results/layer_exchange.md), not once after the loop; trajectories:
    tests/test_train.py. (gpt-tiny-deep: the backward loop of gpt-tiny's two layers has one
    iteration, which XLA unrolls.)"""
    import re

    from axonn_jax import ParallelConfig
    from axonn_jax.analysis import compiled as cc
    from axonn_jax.analysis.hlo_module import read_module
    from axonn_jax.train import TrainOptions, build_trainer

    trainer = build_trainer(TrainOptions(model="gpt-tiny-deep", batch_size=4, seq_len=16,
                                         steps=1, parallel=ParallelConfig(data=2)), devices[:2])
    _, compiled = cc.compile_step(trainer.step, trainer.local_example(), capacity_bytes=1e12)
    text = compiled.as_text()
    comps = read_module(text).computations
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    assert any(i.opcode in ("all-reduce", "all-reduce-start") for b in bodies for i in comps[b])
