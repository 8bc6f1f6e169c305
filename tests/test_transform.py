"""`axonn_jax.parallelize` on the GPT and small linen models: same parameter tree, parameters move
both ways, outputs and gradients equal the original's, parameters created sharded, clear errors."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import axonn_jax
from axonn_jax import KernelOptions, ParallelConfig, make_mesh
from axonn_jax.models import gpt
from axonn_jax.tp.parallelize import transpose_plan

from conftest import relative_difference

CONFIG = gpt.GPTConfig(num_layers=2, d_model=32, num_heads=4, max_seq_len=16)
TOKENS = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG.vocab_size)
DENSE_KERNELS = ("query", "key", "value", "attn_out", "mlp_up", "mlp_down")


def loss(model):
    return lambda p: gpt.cross_entropy(model.apply({"params": p}, TOKENS[:, :-1]), TOKENS[:, 1:])


@pytest.fixture(scope="module")
def reference():
    model = gpt.GPT(CONFIG)
    params = model.init(jax.random.key(0), TOKENS[:, :-1])["params"]
    return model, params, jax.jit(jax.value_and_grad(loss(model)))(params)


def sharded_init(model, mesh):
    """Init straight into the partition specs (the trainer's recipe)."""
    init = lambda key: model.init(key, TOKENS[:, :-1])["params"]
    specs = nn.get_partition_spec(jax.eval_shape(init, jax.random.key(0)))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(lambda k: nn.unbox(init(k)), out_shardings=shardings)(jax.random.key(0))


@pytest.mark.parametrize("grid", [(2, 2, 2)], ids=lambda g: "row%d_col%d_depth%d" % g)
def test_gpt_parallelized_equals_original(grid, reference, devices):
    row, col, depth = grid
    model, ref_params, (ref_loss, ref_grads) = reference
    mesh = make_mesh(ParallelConfig(row=row, col=col, depth=depth), devices)
    pmodel = axonn_jax.parallelize(model, mesh)
    assert isinstance(pmodel, gpt.GPT) and pmodel.config == model.config

    params = sharded_init(pmodel, mesh)
    # Same tree, same global shapes, same values (same initializers and RNG streams).
    assert jax.tree.structure(params) == jax.tree.structure(ref_params)
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        assert p.shape == r.shape and relative_difference(p, r) <= 1e-6  # jit vs eager rounding
    # Dense kernels: each device holds 1 / (row·col·depth) of them.
    for name in DENSE_KERNELS:
        kernel = params["blocks"][name]["kernel"]
        assert {s.data.nbytes for s in kernel.addressable_shards} == {kernel.nbytes // (row * col * depth)}

    value, grads = jax.jit(jax.value_and_grad(loss(pmodel)))(ref_params)  # the original's params
    assert relative_difference(value, ref_loss) <= 1e-5
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        r = ref_grads
        for k in path:
            r = r[k.key]
        if jax.tree_util.keystr(path) == "['blocks']['key']['bias']":
            # softmax is invariant to a key bias: its true gradient is 0, the reference is rounding
            assert float(jnp.max(jnp.abs(g))) <= 1e-5 * scale
        else:
            assert relative_difference(g, r) <= 1e-5, jax.tree_util.keystr(path)
    # ... and the original model runs on the parallelized model's parameters.
    assert relative_difference(jax.jit(loss(model))(params), ref_loss) <= 1e-5


def test_gpt_layers_alternate_transpose(devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    plan = transpose_plan(gpt.GPT(CONFIG), mesh, TOKENS[:, :-1])
    assert plan == {"blocks/query": False, "blocks/key": False, "blocks/value": False,
                    "blocks/attn_out": True, "blocks/mlp_up": False, "blocks/mlp_down": True,
                    "head/lm_head": False}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="up")(x))
        x = nn.DenseGeneral(8, name="down")(x)
        return nn.Dense(16, name="again")(nn.RMSNorm(name="norm")(x))


def test_small_mlp_with_dense_general_and_rmsnorm(devices):
    mesh = make_mesh(ParallelConfig(row=1, col=2, depth=4), devices)
    x = jax.random.normal(jax.random.key(2), (4, 8))
    model = MLP()
    params = model.init(jax.random.key(0), x)
    pmodel = axonn_jax.parallelize(model, mesh)
    assert transpose_plan(model, mesh, x) == {"up": False, "down": True, "again": False}
    f = lambda m: lambda p: jnp.sum(m.apply(p, x) ** 2)
    ref, ref_g = jax.value_and_grad(f(model))(params)
    out, g = jax.jit(jax.value_and_grad(f(pmodel)))(params)
    assert relative_difference(out, ref) <= 1e-5
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        assert relative_difference(a, b) <= 1e-5


class WithConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, (3,), feature_group_count=2, name="conv")(x)


class WithHeads(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral((2, 4), name="heads")(x)


class PerBatchKernels(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(8, batch_dims=(0,), name="batched")(x)


class Odd(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="odd")(x)


@pytest.mark.parametrize("module, error, message", [
    (WithConv(), NotImplementedError, "layer 'conv' \\(Conv\\) has feature_group_count = 2"),
    (WithHeads(), ValueError, "layer 'heads' \\(DenseGeneral\\): kernel \\(8, 2, 4\\) dim 1 = 2 is not divisible by row = 4"),
    (PerBatchKernels(), NotImplementedError, "layer 'batched' \\(DenseGeneral batch_dims=\\(0,\\)\\)"),
    (Odd(), ValueError, "layer 'odd' \\(Dense\\): tp_dense: kernel out-features = 6 is not divisible by row = 4"),
])
def test_unsupported_layers_are_named(module, error, message, devices):
    mesh = make_mesh(ParallelConfig(row=4, col=2), devices)
    with pytest.raises(error, match=message):
        axonn_jax.parallelize(module, mesh).init(jax.random.key(0), jnp.ones((2, 8, 8)))


def test_attention_kernels_flatten_without_relayout(devices):
    """nn.MultiHeadDotProductAttention on row=4 × col=2: kernels (d_model, heads, head_dim) with
    heads over row run as 2-D layers on the flattened features, with no communication beyond the
    algorithm's: the forward holds only the input's rows gathered over row (once for query, key and
    value) and their partial sums reduce-scattered over col, and the transposed output
    projection's input gathered over col and its sums reduce-scattered over row."""
    from axonn_jax.analysis.hlo import collectives

    mesh = make_mesh(ParallelConfig(row=4, col=2), devices)
    x = jax.random.normal(jax.random.key(0), (4, 8, 32))
    model = axonn_jax.parallelize(nn.MultiHeadDotProductAttention(num_heads=4), mesh)
    specs = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x))["params"]
    assert specs["query"]["kernel"] == jax.P(("col", "depth"), "row", None)
    assert specs["out"]["kernel"] == jax.P(("row", "depth"), None, "col")
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), {"params": specs})
    params = jax.jit(lambda k: nn.unbox(model.init(k, x)), out_shardings=shardings)(jax.random.key(0))
    x = jax.device_put(x, NamedSharding(mesh, jax.P("depth", None, "col")))
    text = jax.jit(model.apply).lower(params, x).compile().as_text()
    assert sorted((c.kind, c.group_size) for c in collectives(text)) == \
        [("all-gather", 2), ("all-gather", 4)] + [("reduce-scatter", 2)] * 3 + [("reduce-scatter", 4)]


def test_replicated_rule_keeps_a_module_and_everything_inside_whole(devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    reports = []
    model = axonn_jax.parallelize(gpt.GPT(CONFIG), mesh, rules={"blocks": axonn_jax.Replicated()},
                                  report=reports.append, max_replicated=0)
    specs = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), TOKENS[:, :-1]))
    for name in DENSE_KERNELS:
        assert specs["params"]["blocks"][name]["kernel"] == jax.P()
        assert reports[0][f"blocks/{name}/kernel"].note == "kept whole by a Replicated rule"
    assert specs["params"]["head"]["lm_head"]["kernel"] == jax.P(("col", "depth"), "row")


class _Wrapped(nn.Module):
    """A dense layer inside a module that asks for the replicated layout (or not)."""

    tp_replicated_rows: bool

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(x)


def test_kernel_options_are_fixed_in_the_parallel_module(reference, devices):
    """`parallelize(..., kernels=...)` fixes the kernels' modes in the module it returns, with no
    context around the call: a jitted function taking the module as a static argument compiles one
    program per module, FP8 operands only where asked. A module whose `tp_replicated_rows` is True
    runs the layers inside it in the replicated layout (all-reduces instead of reduce-scatters)."""
    model, params, _ = reference
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)

    @functools.partial(jax.jit, static_argnums=0)
    def logits(module, p, tokens):
        return module.apply({"params": p}, tokens)

    texts = []
    for kernels in (KernelOptions(), KernelOptions(fp8=True)):
        module = axonn_jax.parallelize(model, mesh, kernels=kernels)
        texts.append(logits.lower(module, params, TOKENS[:, :-1]).as_text())
        logits(module, params, TOKENS[:, :-1])
    assert logits._cache_size() == 2
    assert "f8E4M3FN" not in texts[0] and "f8E4M3FN" in texts[1]

    x = jnp.ones((8, 4, 32))
    for replicated in (False, True):
        module = axonn_jax.parallelize(_Wrapped(replicated), mesh)
        p = nn.unbox(module.init(jax.random.key(0), x))
        text = jax.jit(module.apply).lower(p, x).as_text()
        assert ("all_reduce" in text, "reduce_scatter" in text) == (replicated, not replicated)
