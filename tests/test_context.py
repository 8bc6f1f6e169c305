"""Context parallelism (`parallel.context`): the zig-zag layout and its positions; ring and
all-gather attention equal one device's attention (outputs and q/k/v gradients, fp32) for context
2, 4 and 8, with a data axis, grouped- and multi-query heads and packed documents; GPT and Llama
train two steps on a data × context grid as on one device; the compiled programs do the balanced
block schedule, overlap the ring's transfers with compute, send the bytes the communication model
states, and hold about 1/C of the activation memory."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from axonn_jax.analysis import hlo
from axonn_jax.models import attention, gpt, llama
from axonn_jax.parallel import context

from conftest import relative_difference

TOL = 1e-5


def plain(q, k, v, segment_ids=None, positions=None):
    """Causal softmax attention written out on one device: a query sees keys not later in the
    sequence, not later by position and in its segment."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, t, kv, h // kv, d), k) * d ** -0.5
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    if positions is not None:
        mask = mask & (positions[:, None, :] <= positions[:, :, None])
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :] == segment_ids[:, :, None])
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    return jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, -1), v).reshape(b, t, h, d)


def documents(rows, seq, seed=0):
    """(segment ids, positions restarting at each document), `(rows, seq)` int32: documents of
    random lengths, so some cross the chunk boundaries of every context size tried."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=3, replace=False))
        for i, (a, z) in enumerate(zip([0, *cuts], [*cuts, seq])):
            seg[r, a:z], pos[r, a:z] = i, np.arange(z - a)
    return jnp.asarray(seg), jnp.asarray(pos)


def qkvw(rows, seq, heads, kv_heads, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(rows, seq, heads, head_dim)] + [(rows, seq, kv_heads, head_dim)] * 2 \
        + [(rows, seq, heads, head_dim)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def grid(data, size):
    devices = np.array(jax.devices()[:data * size]).reshape(data, size)
    return Mesh(devices, ("data", "context"))


def sharded(fn, mesh, num_args):
    """`fn` of `num_args` `(rows, seq, ...)` arrays in sequence order, run on `mesh` with rows over
    `data` and the sequence over `context` in the zig-zag layout; output in sequence order."""
    size, spec = mesh.shape["context"], P("data", "context")
    inner = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_args, out_specs=spec)
    return lambda *args: context.unbalance(
        inner(*(None if a is None else context.balance(a, size) for a in args)), size)


def value_and_grads(attend, q, k, v, w, seg, pos):
    """(output, (dq, dk, dv) of sum(output · w)), from one compiled program."""
    def both(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg, pos), q, k, v)
        return out, pullback(w)
    return jax.jit(both)(q, k, v)


# ----------------------------------------------------------------------------- the layout

def test_balance_puts_chunks_i_and_mirror_on_device_i_and_positions_say_so():
    size, seq = 4, 16
    x = jnp.arange(2 * seq).reshape(2, seq)
    balanced = context.balance(x, size)
    np.testing.assert_array_equal(context.unbalance(balanced, size), x)
    local = np.asarray(balanced[0]).reshape(size, 2, seq // (2 * size))
    for i in range(size):  # device i: chunks i and 2C-1-i
        np.testing.assert_array_equal(local[i, 0] // 2, i)
        np.testing.assert_array_equal(local[i, 1] // 2, 2 * size - 1 - i)
    mesh = grid(1, size)
    got = jax.jit(jax.shard_map(lambda a: context.positions(a.shape[1])[None], mesh=mesh,
                                in_specs=P(None, "context"), out_specs=P(None, "context")))(x[:1])
    np.testing.assert_array_equal(got[0], balanced[0])
    np.testing.assert_array_equal(context.positions(6), np.arange(6))  # no context axis


def test_bad_input_gets_one_line_naming_the_numbers():
    q, k, v, _ = qkvw(2, 12, 4, 2)
    cases = [
        (lambda: context.check_sequence(100, 4), "sequence length 100 is not divisible by "
                                                 "2·context = 8"),
        (lambda: context.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)),
         "4 query heads are not divisible by 3 key/value heads"),
        (lambda: context.attention(q, k, v, segment_ids=jnp.zeros((2, 11), jnp.int32)),
         r"segment_ids must be \(rows, seq\) = \(2, 12\) integers, got \(2, 11\)"),
        (lambda: context.attention(q, k, v, scheme="x"), "one of ring, allgather"),
        (lambda: context.attention(q, k, v, query_tile=4), "query_tile 4 does not divide the "
                                                            "chunk length 6"),
        (lambda: gpt.GPTConfig(2, 32, 4, context_attention="x"), "one of ring, allgather"),
        (lambda: context.register(context.RING), "scheme 'ring' is already registered"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    mesh = grid(1, 4)
    run = lambda f, n: jax.jit(jax.shard_map(  # noqa: E731
        f, mesh=mesh, in_specs=(P(None, "context"),) * n, out_specs=P(None, "context")))
    with pytest.raises(ValueError, match="sequence length 20 is not divisible by 2·context = 8"):
        run(lambda q, k, v: context.attention(q, k, v), 3)(*(a[:, :20] for a in
                                                              qkvw(2, 20, 4, 2)[:3]))
    with pytest.raises(ValueError, match="cudnn does not run inside context parallelism"):
        run(lambda q, k, v: attention.causal_attention(q, k, v, "cudnn"), 3)(
            *qkvw(2, 16, 4, 2)[:3])


# ----------------------------------------------------------------------------- exactness

def test_one_device_masks_equal_plain_attention():
    """The library's one-device attention with packed documents (ids, restarting positions),
    outputs and gradients; positions = arange changes nothing."""
    q, k, v, w = qkvw(2, 24, 4, 2)
    seg, pos = documents(2, 24)
    ours = lambda q, k, v, s, p: attention.causal_attention(  # noqa: E731
        q, k, v, "xla", segment_ids=s, positions=p)
    for s, p in ((seg, pos), (seg, None), (None, jnp.broadcast_to(jnp.arange(24), (2, 24)))):
        got, want = value_and_grads(ours, q, k, v, w, s, p), value_and_grads(plain, q, k, v, w, s, p)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert relative_difference(a, b) <= TOL


CASES = [  # scheme, context, data, kv_heads (of 4 query heads), documents, query tile
    ("ring", 2, 1, 4, None, 4), ("ring", 4, 2, 2, "ids+positions", 512), ("ring", 8, 1, 1, "ids", 512),
    ("allgather", 2, 2, 1, "ids+positions", 512), ("allgather", 4, 1, 4, None, 2),
    ("allgather", 8, 1, 2, "ids+positions", 512),
]


@pytest.mark.parametrize("scheme, size, data, kv_heads, docs, tile", CASES,
                         ids=[f"{s}-context{c}-data{d}-kv{k}-{x or 'nodocs'}-tile{t}"
                              for s, c, d, k, x, t in CASES])
def test_context_attention_equals_one_device(scheme, size, data, kv_heads, docs, tile):
    """Outputs and q/k/v gradients of the context-parallel attention (sequence 32 over `size`
    devices in the zig-zag layout, rows over `data`; blocks of 32 / 2·size queries, run whole or
    in tiles of `tile`) equal one device's, fp32, relative ≤ 1e-5."""
    rows, seq = 2 * data, 32
    q, k, v, w = qkvw(rows, seq, 4, kv_heads, seed=size)
    seg, pos = documents(rows, seq, seed=size) if docs else (None, None)
    pos = pos if docs == "ids+positions" else None
    if docs:  # some document runs across a chunk boundary (one chunk: seq / 2·size tokens)
        cuts = np.arange(seq // (2 * size), seq, seq // (2 * size))
        assert np.any(np.asarray(seg)[:, cuts - 1] == np.asarray(seg)[:, cuts])
    assert_attention_equals_one_device(scheme, size, data, tile, q, k, v, w, seg, pos)


def assert_attention_equals_one_device(scheme, size, data, tile, q, k, v, w, seg, pos):
    """`context.attention` with `scheme` over `size` devices (rows over `data`, `tile` queries at
    a time): outputs and q/k/v gradients of `(q·w summed)` against one device's, relative ≤ TOL."""
    def kernel(q, k, v, s, p):
        return context.attention(q, k, v, scheme=scheme, segment_ids=s, positions=p,
                                 query_tile=tile)

    mesh = grid(data, size)
    ours = lambda q, k, v, s, p: sharded(kernel, mesh, 5)(q, k, v, s, p)  # noqa: E731
    got, want = value_and_grads(ours, q, k, v, w, seg, pos), value_and_grads(plain, q, k, v, w,
                                                                             seg, pos)
    for name, a, b in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_difference(a, b) <= TOL, name


# ----------------------------------------------------------------------------- models

def _parts(family, config):
    return family.Embedding(config), family.Block(config), family.Head(config)


def _model_loss(parts, params, batch):
    embed, block, head = parts
    x = embed.apply({"params": params["embed"]}, batch)
    side = {n: batch[n] for n in ("segment_ids", "positions") if n in batch}
    x, _ = lax.scan(lambda x, p: (block.apply({"params": p}, x, **side), None), x,
                    params["blocks"])
    return head.apply({"params": params["head"]}, x, batch)


def _init(parts, config, batch):
    embed, block, head = parts
    keys = jax.random.split(jax.random.key(0), config.num_layers + 2)
    x = embed.apply(embed.init(keys[0], batch), batch)
    return {"embed": embed.init(keys[0], batch)["params"],
            "blocks": jax.vmap(lambda key: block.init(key, x)["params"])(keys[2:]),
            "head": head.init(keys[1], x, batch)["params"]}


@pytest.mark.parametrize("family, scheme", [(gpt, "ring"), (llama, "allgather")],
                         ids=["gpt-ring", "llama-allgather"])
def test_models_train_on_data_by_context_as_on_one_device(family, scheme):
    """gpt-tiny / llama-tiny (grouped-query) on packed documents: two SGD steps on a data = 2 ×
    context = 4 grid (the embedding's positions and the rotary angles from the true positions)
    give one device's losses and final parameters, leaf by leaf."""
    name = "gpt-tiny" if family is gpt else "llama-tiny"
    config = dataclasses.replace(family.PRESETS[name], context_attention=scheme, attention="xla")
    parts, rows, seq = _parts(family, config), 4, 32
    rng = np.random.default_rng(1)
    seg, pos = documents(rows, seq, seed=3)
    batch = {"inputs": jnp.asarray(rng.integers(0, 256, (rows, seq)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 256, (rows, seq)), jnp.int32),
             "segment_ids": seg, "positions": pos}
    params = _init(parts, config, batch)
    mesh, size = grid(2, 4), 4
    on_grid = jax.shard_map(
        lambda p, b: lax.pmean(_model_loss(parts, p, b), ("data", "context")), mesh=mesh,
        in_specs=(P(), P("data", "context")), out_specs=P())
    spread = {n: context.balance(x, size) for n, x in batch.items()}

    def train(loss, batch):
        step = jax.jit(jax.value_and_grad(loss))
        p, losses = params, []
        for _ in range(2):
            value, g = step(p, batch)
            p = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
            losses.append(value)
        return losses, p

    want = train(lambda p, b: _model_loss(parts, p, b), batch)
    got = train(on_grid, spread)
    assert relative_difference(got[0], want[0]) <= TOL
    # GPT's key bias has a zero gradient in exact arithmetic (it adds one number to every score
    # of a row): its updates are rounding noise (~1e-9) on both sides and must stay that.
    for a, b, start in zip(*(jax.tree.leaves(t) for t in (got[1], want[1], params))):
        if np.max(np.abs(b - start)) < 1e-7:
            assert np.max(np.abs(a - start)) < 1e-7
        else:
            assert relative_difference(a, b) <= TOL


def test_rope_at_positions_equals_the_table_and_llama31_presets():
    """Rotary angles from positions equal the float64-rounded table (float32 rounding); the
    Llama 3.1 presets have the published parameter counts and 128k context with llama3 scaling
    (whose frequencies `tests/test_llama.py` checks against transformers' formula)."""
    c = llama.PRESETS["llama3.1-8b"]
    cos, sin = llama.rope_at(jnp.arange(256)[None], c.head_dim, c.rope_theta, c.rope_scaling)
    want = llama.rope_tables(256, c.head_dim, c.rope_theta, c.rope_scaling)
    # Angles up to 255 rad rounded to float32 (half an ulp: 8e-6) by two routes.
    np.testing.assert_allclose(cos[0], want[0], atol=2e-5)
    np.testing.assert_allclose(sin[0], want[1], atol=2e-5)
    assert c.num_params() == 8_030_261_248
    assert llama.PRESETS["llama3.1-70b"].num_params() == 70_553_706_496
    for name in ("llama3.1-8b", "llama3.1-70b"):
        assert llama.PRESETS[name].max_seq_len == 131072
        assert llama.PRESETS[name].rope_scaling == llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


# ----------------------------------------------------------------------------- compiled programs

def _compile(fn, mesh, shapes, grad=False):
    """`fn` on `mesh` (every argument `(rows, seq, ...)` over data × context) compiled for
    `shapes` [(shape, dtype)]; with `grad`, the gradient of the sum of its output by its first
    argument."""
    spec = P("data", "context")
    inner = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=spec)
    program = jax.grad(lambda x, *rest: jnp.sum(inner(x, *rest))) if grad else inner
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(program).lower(*args).compile()


def _layers(scheme, kv_heads, layers=2):
    """A stack of `layers` attention layers (a `lax.scan`, as the train step runs blocks):
    q, k, v slices of the running activation, `x + attention(...)`; the backward pass runs in its
    own loop, as in training. Segment ids optional."""
    def stack(x, seg=None):
        def layer(x, scale):
            y = context.attention(x * scale, x[:, :, :kv_heads] * scale,
                                  x[:, :, kv_heads:2 * kv_heads], scheme=scheme, segment_ids=seg)
            return x + y, None
        return lax.scan(layer, x, jnp.linspace(0.5, 1.0, layers))[0]
    return stack


SEQ, HEADS = 512, 8  # heads: as many as devices, for the schemes that split them


@pytest.fixture(scope="module")
def forward_programs():
    """Compiled forward passes: {(scheme, context): (hlo text, compiled)}, rows 1, sequence 512,
    8 heads of 64 (the matmuls dominate the elementwise work)."""
    out = {}
    for scheme in context.SCHEMES:
        for size in (2, 8):
            fn = lambda q, k, v, s: context.attention(  # noqa: E731
                q, k, v, scheme=scheme, segment_ids=s)
            compiled = _compile(fn, grid(1, size), [((1, SEQ, HEADS, 64), jnp.float32)] * 3
                                + [((1, SEQ), jnp.int32)])
            out[scheme, size] = compiled.as_text(), compiled
    return out


@pytest.mark.parametrize("size", [2, 4, 8])
def test_every_device_computes_the_balanced_schedule(size, forward_programs):
    """Load balance, measured three ways.
    1. Useful work per device: (query, key) pairs the causal mask leaves, counted from the
       positions each device holds: equal in the zig-zag layout; a contiguous split gives the
       last device (4C-1)/3 times the first's (about twice at C = 2, more beyond).
    2. The kernels' own slot rule, run with concrete device indices, computes exactly the
       chunk pairs with work (2C + 1 on every device, of the 4C a dense ring attends).
    3. The compiled programs (context 2 and 8): no conditional (every device runs the same
       instructions), a while loop of C - 1 (ring) / C (all-gather) steps (XLA inlines a loop
       of one), and FLOPs per device within 15% of the matmuls of the 2C + 1 blocks
       (`context.flops`; the rest is the online softmax's elementwise work, about 10 operations
       per output element and 8 per score of each block: under 12% with blocks of 32 × 32 and
       head_dim 64), where attending all 4C blocks would be 1.6× (C = 2) to 1.9× (C = 8)
       that; so the spread between devices is 0 (≤ 5%)."""
    seq, mesh = SEQ, grid(1, size)
    zigzag = np.asarray(jax.jit(jax.shard_map(
        lambda x: context.positions(x.shape[1])[None], mesh=mesh, in_specs=P(None, "context"),
        out_specs=P(None, "context")))(jnp.zeros((1, seq))))[0].reshape(size, -1)
    contiguous = np.arange(seq).reshape(size, -1)
    pairs = lambda held: [int(np.sum(p + 1)) for p in held]  # noqa: E731  keys at or before
    balanced, naive = pairs(zigzag), pairs(contiguous)
    assert (max(balanced) - min(balanced)) / max(balanced) <= 0.05
    assert naive[-1] / naive[0] > 1.9
    assert [len(b) for b in context.block_schedule(size, "contiguous")] == \
        [4 * i + 3 for i in range(size)]
    for i, (kernel, useful) in enumerate(zip(context.kernel_blocks(size),
                                             context.block_schedule(size))):
        assert sorted(kernel) == sorted(useful) and len(kernel) == 2 * size + 1, i
    for scheme, trips in (("ring", size - 1), ("allgather", size)):
        if (scheme, size) not in forward_programs:
            continue
        text = forward_programs[scheme, size][0]
        assert " conditional(" not in text
        assert [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)] \
            == ([trips] if trips > 1 else []), scheme
        ratio = hlo.flops(text) / context.flops((1, SEQ // size, HEADS, 64), size,
                                                backward=False)
        assert 1.0 <= ratio <= 1.15, (scheme, ratio)


def test_ring_transfer_overlaps_the_block_compute(forward_programs):
    """In the compiled ring loop (context 8) the key/value transfer neither waits for a matmul
    nor feeds one: a scheduler can run it during the step's compute."""
    text = forward_programs["ring", 8][0]
    entry = hlo.instructions(text)
    loop = next(i for i in entry.values() if i.opcode == "while")
    body = re.search(r"\bbody=%?([\w.\-]+)", loop.text).group(1)
    program = hlo.instructions(text, body)
    permutes = [n for n, i in program.items() if i.opcode.startswith("collective-permute")]

    def has_dot(i):  # a dot, or a fusion around one
        callee = re.search(r"\bcalls=%?([\w.\-]+)", i.text)
        return i.opcode == "dot" or (callee is not None and any(
            j.opcode == "dot" for j in hlo.instructions(text, callee.group(1)).values()))
    compute = [n for n, i in program.items() if has_dot(i)]
    assert permutes and compute
    for p in permutes:
        for m in compute:
            assert not hlo.depends_on(program, p, m) and not hlo.depends_on(program, m, p)


@pytest.mark.parametrize("scheme", context.SCHEMES)
def test_collective_bytes_match_the_model(scheme, forward_programs):
    """Bytes of the collectives in the compiled programs equal `context.collectives`: the
    forward pass alone (context 2, 8, with segment ids), and forward + backward of two scanned
    layers on a data = 2 × context = 4 grid, all over the `context` axis. (The layers take no
    segment ids: ids are the same in every layer, and XLA hoists some of their hops out of the
    layer loop, so the model's count of them is an upper bound there.)"""
    for size in (2, 8):
        got = hlo.bytes_by_axes(forward_programs[scheme, size][0], {"context": size}, buffers=True)
        want = {}
        for kind, axis, nbytes in context.collectives(scheme, (1, SEQ // size, HEADS, 64),
                                                      jnp.float32, size, segment_ids=True,
                                                      backward=False):
            want[kind, (axis,)] = want.get((kind, (axis,)), 0) + nbytes
        assert got == want, (size, got, want)
    rows, seq, layers = 4, 64, 2
    compiled = _compile(_layers(scheme, kv_heads=2, layers=layers), grid(2, 4),
                        [((rows, seq, 4, 16), jnp.float32)], grad=True)
    got = hlo.bytes_by_axes(compiled.as_text(), {"data": 2, "context": 4}, buffers=True)
    want = {}
    for kind, axis, nbytes in context.collectives(scheme, (rows // 2, seq // 4, 2, 16),
                                                  jnp.float32, 4,
                                                  q_shape=(rows // 2, seq // 4, 4, 16)):
        want[kind, (axis,)] = want.get((kind, (axis,)), 0) + layers * nbytes
    assert got == want


def test_activation_memory_per_device_falls_as_one_over_context():
    """Temporary memory of the gradient of two scanned ring-attention layers (their saved
    activations and the blocks' scores), per device, at context 2 and 8 over context 1: at most
    1.25/C of it (the saved output, log-sum-exp and inputs are 1/C; the c × c scores 1/C²)."""
    shapes = [((1, 256, 4, 32), jnp.float32), ((1, 256), jnp.int32)]
    temp = {size: _compile(_layers("ring", 2), grid(1, size), shapes, grad=True)
            .memory_analysis().temp_size_in_bytes for size in (1, 2, 8)}
    for size in (2, 8):
        assert temp[size] <= 1.25 * temp[1] / size, temp


@pytest.mark.parametrize("scheme", context.SCHEMES)
def test_no_hop_masks_are_hoisted_out_of_the_layer_loop(scheme):
    """The gradient of scanned attention layers holds one hop's masks at a time: JAX's
    loop-invariant residual hoisting once lifted the masks (functions of the device index) out
    of the layer scan, all hops' at once, `bool[C - 1, ...]` (15 GiB at 131,072 tokens over
    context 16), unless they depend on the layer's data (`context._device`)."""
    size, spec = 4, P("data", "context")
    inner = jax.shard_map(_layers(scheme, 1, layers=3), mesh=grid(1, size), in_specs=(spec,),
                          out_specs=spec)
    x = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)  # query heads: one per device
    text = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(inner(x))))(x))
    hops = size - 1 if scheme == "ring" else size
    stacked = [a for a in re.findall(r"bool\[([0-9,]+)\]", text)
               if a.count(",") >= 3 and int(a.split(",")[0]) == hops]
    assert not stacked, stacked


@pytest.mark.parametrize("family", ["llama", "gpt", "mixtral"])
def test_plan_counts_the_kernels_flops_over_context(family):
    """Over context the FLOPs `plan` says a step runs (`executed_flops`) hold the kernels' matmuls
    (`context.flops`: the 2C + 1 blocks the causal mask leaves, of the 4C that attending every
    score computes, and a backward that computes the scores again) instead of the models'
    every-score count: Llama-3.1-8B (grouped-query heads) and GPT-20B at 131,072 tokens on
    context 16 × row 4 (before: every score, 1.55× the compiled H100 step's FLOPs for the Llama;
    now 1.04×, benchmarks/results/scale.md)."""
    from axonn_jax.analysis import comm_model as cm
    from axonn_jax.config import ParallelConfig
    from axonn_jax.models import get

    name = {"llama": "llama3.1-8b", "gpt": "gpt-20b", "mixtral": "mixtral-8x7b"}[family]
    config = get(name).config
    batch, seq, grid = 4, 131072, ParallelConfig(context=16, row=4)
    found = cm.declared(cm.Workload(config, batch, seq), grid)
    head_dim = config.d_model // config.num_heads if family == "gpt" else config.head_dim
    q_shape = (batch, seq // grid.context, config.num_heads // grid.row, head_dim)
    kernels = context.flops(q_shape, grid.context) * config.num_layers * grid.num_devices
    scores = config.score_flops_per_token(seq) * batch * seq
    assert kernels / scores == pytest.approx(context.flops_share(16))
    whole = cm.declared(cm.Workload(config, batch, seq), ParallelConfig(row=4))
    if family == "mixtral":  # the experts' executed FLOPs beside: the kernels replace the scores
        assert found.executed_flops - whole.executed_flops == pytest.approx(kernels - scores,
                                                                             rel=1e-9)
        return
    assert found.executed_flops == pytest.approx(found.flops - scores + kernels, rel=1e-12)
    assert whole.executed_flops is None and whole.flops == found.flops
