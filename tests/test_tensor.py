"""AxoNN's tensor-parallel matmul and embedding (`axonn_jax.tp.tensor`): outputs and every
gradient equal the unsharded computation on each grid, and the compiled program holds exactly the
collectives of the algorithm."""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from axonn_jax import ParallelConfig, make_mesh
from axonn_jax._compat import shard_map, to_varying
from axonn_jax.analysis import hlo
from axonn_jax.analysis.hlo import collectives
from axonn_jax.tp.options import KernelOptions
from axonn_jax.tp.tensor import (dense_specs, kernel_spec, looks_up_rows, split_batch, split_dims,
                                 tp_attend, tp_dense, tp_dense_general, tp_embed)

from conftest import relative_difference

GRIDS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 1, 8), (2, 1, 4)]  # row, col, depth
B, T, D_IN, D_HID, VOCAB = 8, 4, 32, 16, 128  # no block size equals a whole weight


@pytest.fixture(scope="module")
def inputs():
    k = jax.random.split(jax.random.key(0), 6)
    return dict(x=jax.random.normal(k[0], (B, T, D_IN)), w1=jax.random.normal(k[1], (D_IN, D_HID)),
                b1=jax.random.normal(k[2], (D_HID,)), w2=jax.random.normal(k[3], (D_HID, D_IN)),
                b2=jax.random.normal(k[4], (D_IN,)), table=jax.random.normal(k[5], (VOCAB, D_IN)),
                tokens=jax.random.randint(k[0], (B, T), 0, VOCAB),
                positions=jnp.arange(T) * 7 % VOCAB)


def two_layers(dense, embed):
    """A normal layer, a transposed one, and two lookups (batched tokens and 1-D positions)."""
    def f(x, w1, b1, w2, b2, table, tokens, positions):
        h = jnp.tanh(dense(x + embed(tokens, table) + embed(positions, table)[None], w1, b1, False))
        return jnp.sum(jnp.sin(dense(h, w2, b2, True)))
    return f


NAMES = "x w1 b1 w2 b2 table tokens positions".split()


def args(inputs):
    return [inputs[n] for n in NAMES]


REFERENCE = two_layers(lambda x, w, b, t: x @ w + b, lambda tok, table: table[tok])
DIFF_ARGS = (0, 1, 2, 3, 4, 5)


def check_against_reference(value, grads, inputs):
    ref_value, ref_grads = jax.value_and_grad(REFERENCE, argnums=DIFF_ARGS)(*args(inputs))
    assert relative_difference(value, ref_value) <= 1e-5
    for name, g, r in zip("x w1 b1 w2 b2 table".split(), grads, ref_grads):
        assert g.shape == r.shape
        assert relative_difference(g, r) <= 1e-5, name


def tp_loss(mesh, options=KernelOptions()):
    return two_layers(lambda x, w, b, t: tp_dense(x, w, b, mesh, transpose=t, options=options),
                      lambda tok, table: tp_embed(tok, table, mesh))


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "row%d_col%d_depth%d" % g)
def test_tp_matches_reference_and_has_the_algorithms_collectives(grid, inputs, devices):
    row, col, depth = grid
    mesh = make_mesh(ParallelConfig(row=row, col=col, depth=depth), devices)
    step = jax.jit(jax.value_and_grad(tp_loss(mesh), argnums=DIFF_ARGS))
    value, grads = step(*args(inputs))
    check_against_reference(value, grads, inputs)

    found = collectives(step.lower(*args(inputs)).compile().as_text())
    shape = {"depth": depth, "row": row, "col": col}
    by_axes = {}
    for c in found:
        by_axes.setdefault((c.kind, hlo.group_axes(c.group, shape)), []).append(c.bytes)
    # The depth all-gathers rebuild only this device's (row, col) block of a weight; a whole weight
    # only when row = col = 1 (pure ZeRO-3 over depth).
    expected_gathers = {4 * D_IN * D_HID // (row * col), 4 * VOCAB * D_IN // (row * col)}
    if looks_up_rows(VOCAB, B * T // depth, shape):  # the batched lookup's rows cross depth,
        expected_gathers |= {4 * B * T, 4 * B * T * D_IN // col}  # not the table: ids, gradients
    if depth > 1:
        assert set(by_axes[("all-gather", ("depth",))]) == expected_gathers
        assert 4 * D_IN * D_HID // (row * col) in by_axes[("reduce-scatter", ("depth",))]
    # The batch stays split over the replicated axis (8 rows divide over depth × row and depth ×
    # col on every grid): each layer gathers its input's rows over its output axis and
    # reduce-scatters its partial sums over its input axis, forward (x, y) and backward (dy, dx),
    # and gathers x again for the weight gradient (XLA may merge that with the forward's gather).
    # The embedding's sums over row stay all-reduces.
    rows = {"row": 4 * B * T * D_IN // (depth * col), "col": 4 * B * T * D_HID // (depth * row)}
    for kind in ("all-gather", "reduce-scatter"):
        for axis, size in rows.items():
            if shape[axis] > 1:
                got = by_axes[(kind, (axis,))]
                assert set(got) == {size} and len(got) >= 2, (kind, axis, got)
    assert not {kind for kind, _ in by_axes} - {"all-gather", "reduce-scatter", "all-reduce"}


@pytest.mark.parametrize("grid", [(4, 2, 1), (1, 4, 2)], ids=lambda g: "row%d_col%d_depth%d" % g)
def test_collective_matmuls_match_reference_and_gather_rows_in_rings(grid, inputs, devices):
    """`KernelOptions(collective_matmuls=True)`: the same values and gradients, and each of the
    four matmuls whose input rows are gathered (both layers' forward and input gradient) gathers
    them in a ring of n − 1 collective-permutes of one row block instead of an all-gather; its
    reduce-scatter stays."""
    row, col, depth = grid
    mesh = make_mesh(ParallelConfig(row=row, col=col, depth=depth), devices)
    step = jax.jit(jax.value_and_grad(tp_loss(mesh, KernelOptions(collective_matmuls=True)),
                                      argnums=DIFF_ARGS))
    value, grads = step(*args(inputs))
    text = step.lower(*args(inputs)).compile().as_text()
    check_against_reference(value, grads, inputs)
    shape = {"depth": depth, "row": row, "col": col}
    found = {}
    for c in collectives(text):
        found.setdefault((c.kind, hlo.group_axes(c.group, shape)), []).append(c.bytes)
    rows = {"row": 4 * B * T * D_IN // (depth * row * col),  # one device's block of x / dx
            "col": 4 * B * T * D_HID // (depth * row * col)}  # of h / dh
    # (gather axis, scatter axis, the gathered block's axis in `rows`) of the four matmuls
    matmuls = [("row", "col", "row"), ("col", "row", "col"), ("col", "row", "col"), ("row", "col", "row")]
    permutes, scatters = {"row": [], "col": []}, {"row": 0, "col": 0}
    for gather, scatter, block in matmuls:
        permutes[gather] += [rows[block]] * (shape[gather] - 1)
        scatters[scatter] += shape[scatter] > 1
    for axis in ("row", "col"):
        assert sorted(found.get(("collective-permute", (axis,)), [])) == permutes[axis], axis
        assert len(found.get(("reduce-scatter", (axis,)), [])) == scatters[axis], axis


def test_tp_falls_back_to_the_replicated_layout(inputs, devices):
    """A batch that does not divide over depth × row keeps the replicated layout (all-reduces of
    the partial sums, no activation gathers) and the same values."""
    mesh = make_mesh(ParallelConfig(row=4, col=2, depth=1), devices)
    few = dict(inputs, x=inputs["x"][:2], tokens=inputs["tokens"][:2])
    step = jax.jit(jax.value_and_grad(tp_loss(mesh), argnums=DIFF_ARGS))
    value, grads = step(*args(few))
    check_against_reference(value, grads, few)
    kinds = {c.kind for c in collectives(step.lower(*args(few)).compile().as_text())}
    assert kinds == {"all-reduce"}


def test_tp_nested_in_data_parallel_step(inputs, devices):
    """Inside the trainer's data-manual shard_map: gradients per data shard, then pmean."""
    mesh = make_mesh(ParallelConfig(data=2, depth=2, row=2), devices)
    loss = tp_loss(mesh)

    def local(params, x, tokens):
        params = to_varying(params, ("data",))
        value, grads = jax.value_and_grad(
            lambda p, x: loss(x, *p, tokens, inputs["positions"]), argnums=(0, 1))(params, x)
        return jax.lax.psum(value, "data"), jax.lax.psum(grads[0], "data"), grads[1]

    step = jax.jit(shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                             out_specs=(P(), P(), P("data")), axis_names={"data"}))
    params = tuple(inputs[k] for k in ("w1", "b1", "w2", "b2", "table"))
    x = jax.device_put(inputs["x"], NamedSharding(mesh, P(("data", "depth"))))
    value, pgrads, xgrad = step(params, x, inputs["tokens"])
    check_against_reference(value, (xgrad, *pgrads), inputs)


@pytest.mark.parametrize("batch", [8, 64], ids=["rows_cross", "table_crosses"])
def test_embed_exchanges_the_table_or_the_rows_whichever_is_smaller(batch, inputs, devices):
    """row 2 × col 2 × depth 2: 8 sequences of 4 tokens put 32 tokens in a depth group, fewer than
    the 64 vocabulary rows of a row device: the looked-up rows cross depth. 64 sequences (256
    tokens) gather the table instead. Both equal `table[tokens]` in value and gradient."""
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    tokens = jax.random.randint(jax.random.key(1), (batch, T), 0, VOCAB)
    dy = jax.random.normal(jax.random.key(2), (batch, T, D_IN))

    def loss(embed):
        return lambda table: jnp.sum(jnp.sin(embed(tokens, table)) * dy)

    step = jax.jit(jax.value_and_grad(loss(lambda t, w: tp_embed(t, w, mesh))))
    value, grad = step(inputs["table"])
    want, want_grad = jax.value_and_grad(loss(lambda t, w: w[t]))(inputs["table"])
    assert relative_difference(value, want) <= 1e-5
    assert relative_difference(grad, want_grad) <= 1e-5
    shape = {"depth": 2, "row": 2, "col": 2}
    gathers = {c.bytes for c in collectives(step.lower(inputs["table"]).compile().as_text())
               if c.kind == "all-gather" and hlo.group_axes(c.group, shape) == ("depth",)}
    crossing = looks_up_rows(VOCAB, batch * T // 2, shape)
    assert crossing == (batch == 8)
    assert gathers == ({4 * batch * T, 4 * batch * T * D_IN // 2} if crossing
                       else {4 * VOCAB * D_IN // 4})


def test_bad_shapes_name_the_numbers(inputs, devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    with pytest.raises(ValueError, match="kernel out-features = 15 is not divisible by row = 2"):
        tp_dense(inputs["x"], jnp.ones((D_IN, 15)), None, mesh)
    with pytest.raises(ValueError, match=r"batch \(leading dim of x\) = 3 is not divisible by depth = 2"):
        tp_dense(jnp.ones((3, D_IN)), inputs["w1"], None, mesh)
    with pytest.raises(ValueError, match="vocabulary = 10 is not divisible by row×depth = 4"):
        tp_embed(inputs["tokens"], jnp.ones((10, D_IN)), mesh)


def test_kernel_spec_swaps_with_transpose():
    assert kernel_spec(False) == P(("col", "depth"), "row")
    assert kernel_spec(True) == P(("row", "depth"), "col")
    assert kernel_spec(False, out_in=True) == P(("row", "depth"), "col")  # the embedding's


def test_multi_dim_features_split_in_contiguous_blocks():
    sizes = {"row": 4, "col": 2, "depth": 2}
    assert split_dims((4, 16), ("row", "depth"), sizes) == ("row", "depth")  # 1 head per row
    assert split_dims((8, 16), ("row", "depth"), sizes) == (("row", "depth"), None)
    assert split_dims((2, 16), ("row",), sizes) is None  # half heads: no PartitionSpec says so
    assert dense_specs((32,), (4, 16), sizes) == (P(("col", "depth"), "row", None), P("row", None))
    assert dense_specs((4, 16), (32,), sizes, transpose=True) == (P("row", "depth", "col"), P("col"))


@pytest.mark.parametrize("grid", [(4, 2, 1), (2, 2, 2)], ids=lambda g: "row%d_col%d_depth%d" % g)
def test_attend_and_multi_dim_kernels_match_reference(grid, inputs, devices):
    """A tied head (`x @ table.T`, the table as an (out, in) kernel), an attention-style projection
    with kernel (in, heads, head_dim), and its transposed (heads, head_dim, out) partner."""
    row, col, depth = grid
    mesh = make_mesh(ParallelConfig(row=row, col=col, depth=depth), devices)
    k = jax.random.split(jax.random.key(5), 3)
    wq, bq = 0.2 * jax.random.normal(k[0], (D_IN, 4, 8)), jax.random.normal(k[1], (4, 8))
    wo = 0.1 * jax.random.normal(k[2], (4, 8, D_IN))

    def loss(attend, general):
        def f(x, table, wq, bq, wo):
            h = jnp.tanh(general(x, wq, bq, False, 1))  # (B, T, 4, 8)
            y = general(h, wo, None, True, 2)  # (B, T, D_IN)
            return jnp.sum(jnp.sin(attend(y, table)))
        return f

    ref = loss(lambda y, t: y @ t.T, lambda x, w, b, _, n: jnp.tensordot(x, w, n) + (0 if b is None else b))
    par = loss(lambda y, t: tp_attend(y, t, mesh),
               lambda x, w, b, t, n: tp_dense_general(x, w, b, mesh, t, n))
    operands = (inputs["x"], inputs["table"], wq, bq, wo)
    value, grads = jax.jit(jax.value_and_grad(par, argnums=range(5)))(*operands)
    ref_value, ref_grads = jax.value_and_grad(ref, argnums=range(5))(*operands)
    assert relative_difference(value, ref_value) <= 1e-5
    for name, g, r in zip("x table wq bq wo".split(), grads, ref_grads):
        assert relative_difference(g, r) <= 1e-5, name


def test_compiled_backward_leaves_room_for_overlap(devices):
    """What overlap needs from the program, checked on its compiled HLO (XLA:CPU runs collectives
    synchronously, so the overlap itself shows only on a GPU): each layer's input-gradient
    reduce-scatter over `row` and its weight-gradient matmul read the same cotangent and neither waits
    for the other, and every `depth` all-gather reads only its parameter, so a scheduler may issue
    it any time before use (prefetch)."""
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)

    def f(x, w1, w2):
        h = jnp.tanh(tp_dense(x, w1, None, mesh, transpose=False))
        return jnp.sum(jnp.sin(tp_dense(h, w2, None, mesh, transpose=True)))

    args = (jnp.ones((B, T, D_IN)), jnp.ones((D_IN, D_HID)), jnp.ones((D_HID, D_IN)))
    text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    program = hlo.instructions(text)
    by_op = lambda op: [i for i in program.values() if i.opcode == op]  # noqa: E731

    def producer(name):  # look through bitcasts (layout-only views)
        while program[name].opcode == "bitcast":
            name = program[name].operands[0]
        return program[name]

    axes = {c.name: hlo.group_axes(c.group, {"depth": 2, "row": 2, "col": 2})
            for c in collectives(text)}
    # Weight gradients: the matmuls whose results are reduce-scattered over `depth`; input
    # gradients: the backward's reduce-scatters over `row` or `col` (the batch stays split).
    weight_grads = [program[r.operands[0]] for r in by_op("reduce-scatter")
                    if axes[r.name] == ("depth",)]
    input_grads = [a for a in by_op("reduce-scatter")
                   if axes[a.name] != ("depth",) and "transpose(" in a.text]
    assert len(weight_grads) == 2 and len(input_grads) == 2
    for a in input_grads:
        partner = [w for w in weight_grads
                   if set(w.operands) & set(producer(a.operands[0]).operands)]
        assert len(partner) == 1, (a.name, [w.name for w in weight_grads])
        assert not hlo.depends_on(program, a.name, partner[0].name)
        assert not hlo.depends_on(program, partner[0].name, a.name)
    gathers = [g for g in by_op("all-gather") if axes[g.name] == ("depth",)]
    assert len(gathers) == 2
    assert all(program[g.operands[0]].opcode == "parameter" for g in gathers)


def test_kernel_options_are_static_and_part_of_the_jit_cache_key(inputs, devices):
    """The modes reach the kernel as an argument, not from the context it is traced in: one
    jitted function given other `KernelOptions` (static) compiles another program (FP8 operands,
    rings of permutes, the replicated layout's all-reduces), the same ones reuse it."""
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    x, w = inputs["x"], inputs["w1"]

    @functools.partial(jax.jit, static_argnames="options")
    def layer(x, w, options):
        return tp_dense(x, w, None, mesh, options=options)

    texts = {}
    for options in (KernelOptions(), KernelOptions(fp8=True),
                    KernelOptions(collective_matmuls=True), KernelOptions(replicated_rows=True),
                    KernelOptions()):
        texts[options] = layer.lower(x, w, options).as_text()  # StableHLO
        layer(x, w, options)
    assert layer._cache_size() == 4
    plain = texts[KernelOptions()]
    assert "f8E4M3FN" in texts[KernelOptions(fp8=True)] and "f8E4M3FN" not in plain
    assert "collective_permute" in texts[KernelOptions(collective_matmuls=True)]
    assert "collective_permute" not in plain
    assert "all_reduce" in texts[KernelOptions(replicated_rows=True)] and "all_reduce" not in plain
    sizes = dict(data=1, pipe=1, depth=2, row=2, col=2)
    assert split_batch((8,), sizes) and not split_batch((8,), sizes, replicated_rows=True)
