"""`axonn_jax.parallelize` on Flax NNX modules: same variable paths and shapes, parameters placed
on the mesh, outputs and gradients equal the original's on four grids, state moves both ways,
abstract models stay abstract, transpose alternates, clear errors."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import axonn_jax
from axonn_jax import KernelOptions, ParallelConfig, layers_nnx, make_mesh
from axonn_jax.analysis.hlo import collectives
from axonn_jax.tp.tensor import kernel_spec
from axonn_jax.tp.parallelize import transpose_plan
from jax.sharding import PartitionSpec as P

from conftest import relative_difference

GRIDS = [(2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1)]  # (row, col, depth)
X = jax.random.normal(jax.random.key(2), (8, 16))
TOKENS = jax.random.randint(jax.random.key(3), (8, 4), 0, 64)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)
        self.out = nnx.Linear(16, 8, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.out(self.down(jax.nn.relu(self.up(x))))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class TinyLM(nnx.Module):
    """Embed, a stack of norm + MLP residual blocks, final norm and head: no attention."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


MODELS = {"mlp": (MLP, X), "tiny_lm": (TinyLM, TOKENS)}


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def flat(state):
    """`{path: array}` of a state (`nnx.to_flat_state` paths, `.value` unwrapped)."""
    return {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, (cls, x) in MODELS.items():
        model = cls(nnx.Rngs(0))
        out[name] = model, nnx.jit(nnx.value_and_grad(loss))(model, x)
    return out


def grid_id(grid):
    return "row%d_col%d_depth%d" % grid


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("grid", GRIDS, ids=grid_id)
def test_parallel_equals_original(grid, name, references, devices):
    row, col, depth = grid
    model, (ref_loss, ref_grads) = references[name]
    x = MODELS[name][1]
    mesh = make_mesh(ParallelConfig(row=row, col=col, depth=depth), devices)
    pmodel = axonn_jax.parallelize(model, mesh, example_args=(x,))
    assert type(pmodel) is type(model)
    assert isinstance(pmodel.head if name == "tiny_lm" else pmodel.up, layers_nnx.Dense)

    ref, par = flat(nnx.state(model)), flat(nnx.state(pmodel))
    assert ref.keys() == par.keys()
    for path, value in par.items():
        assert value.shape == ref[path].shape and bool(jnp.all(value == ref[path])), path
        if path.endswith("kernel"):  # each device holds 1 / (row·col·depth) of a dense kernel
            assert {s.data.nbytes for s in value.addressable_shards} == {value.nbytes // (row * col * depth)}
    assert type(model.head if name == "tiny_lm" else model.up) is nnx.Linear  # original untouched

    value, grads = nnx.jit(nnx.value_and_grad(loss))(pmodel, x)
    assert relative_difference(value, ref_loss) <= 1e-5
    ref_g, g = flat(ref_grads), flat(grads)
    assert ref_g.keys() == g.keys()
    for path in ref_g:
        assert relative_difference(g[path], ref_g[path]) <= 1e-5, path


def test_layers_alternate_transpose_and_norms_follow(devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    plan = transpose_plan(TinyLM(nnx.Rngs(0)), mesh, TOKENS)
    assert plan == {"blocks/0/up": False, "blocks/0/down": True, "blocks/1/up": False,
                    "blocks/1/down": True, "head": False}
    assert transpose_plan(MLP(nnx.Rngs(0)), mesh, X) == {"up": False, "down": True, "out": False}
    pmodel = axonn_jax.parallelize(TinyLM(nnx.Rngs(0)), mesh, example_args=(TOKENS,),
                                   transpose={"head": True})
    specs = {k: v.sharding.spec for k, v in flat(nnx.state(pmodel)).items()}
    assert specs["blocks/1/down/kernel"] == kernel_spec(True)
    assert specs["head/kernel"] == kernel_spec(True) and pmodel.head.transpose  # the override
    assert specs["blocks/0/ln/scale"] == specs["ln/bias"] == jax.P("col")  # residual stream: col
    assert specs["embed/embedding"] == jax.P(("row", "depth"), "col")
    # Without example inputs every dense layer is normal (a re-layout between up and down).
    plain = axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh)
    assert (plain.up.transpose, plain.down.transpose) == (False, False)
    with pytest.raises(ValueError, match="transpose names no nnx.Linear of the model: \\['nope'\\]"):
        axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh, transpose={"nope": True, "up": True})


def test_alternation_saves_relayout(devices):
    """Compiled forward of the MLP on row=2 × col=4: with the traced plan, per dense layer one
    all-gather of its input's rows (over row, col, row) and one reduce-scatter of its partial sums
    (over col, row, col) and nothing else; all-normal layers re-lay out between them."""
    mesh = make_mesh(ParallelConfig(row=2, col=4), devices)

    def forward_collectives(pmodel):
        graphdef, state = nnx.split(pmodel)
        text = jax.jit(lambda s: nnx.merge(graphdef, s)(X)).lower(state).compile().as_text()
        return [(c.kind, c.group_size) for c in collectives(text)]

    traced = axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh, example_args=(X,))
    assert sorted(forward_collectives(traced)) == [("all-gather", 2), ("all-gather", 2), ("all-gather", 4),
                                                   ("reduce-scatter", 2), ("reduce-scatter", 4),
                                                   ("reduce-scatter", 4)]
    plain = axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh)
    assert {kind for kind, _ in forward_collectives(plain)} - {"all-gather", "reduce-scatter"}


def test_state_moves_both_ways(references, devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    model, (ref, ref_grads) = references["mlp"]
    pmodel = axonn_jax.parallelize(MLP(nnx.Rngs(1)), mesh, example_args=(X,))
    graphdef, pstate = nnx.split(pmodel)
    grad = jax.jit(jax.value_and_grad(lambda s: loss(nnx.merge(graphdef, s), X)))
    assert relative_difference(grad(pstate)[0], ref) > 1e-3  # different weights before the update

    # Original -> parallel, keeping the placement: raw values put on the parallel arrays' shardings.
    shardings = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(nnx.state(pmodel)))
    nnx.update(pmodel, jax.device_put(nnx.to_pure_dict(nnx.state(model)), shardings))
    assert pmodel.down.kernel[...].sharding.spec == kernel_spec(True)
    value, grads = grad(nnx.state(pmodel))
    assert relative_difference(value, ref) <= 1e-5
    ref_grads = flat(ref_grads)
    for path, g in flat(grads).items():
        assert relative_difference(g, ref_grads[path]) <= 1e-5, path

    # A plain nnx.update with the original's state also runs (GSPMD lays the arrays out inside).
    nnx.update(pmodel, nnx.state(model))
    assert relative_difference(grad(nnx.state(pmodel))[0], ref) <= 1e-5

    # Parallel -> original.
    other = MLP(nnx.Rngs(2))
    nnx.update(other, nnx.state(axonn_jax.parallelize(model, mesh)))
    assert relative_difference(loss(other, X), ref) <= 1e-5


def test_abstract_model_is_created_sharded(references, devices):
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    abstract = nnx.eval_shape(lambda: TinyLM(nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype)
    pmodel = axonn_jax.parallelize(abstract, mesh, example_args=(tokens,))
    assert isinstance(pmodel.head.kernel.get_value(), jax.ShapeDtypeStruct)
    shardings = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(nnx.state(pmodel)))
    assert shardings["head"]["kernel"].spec == kernel_spec(False)
    # Initialize straight into the shards (threefry is partitionable: same values as unsharded).
    init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(TinyLM(nnx.Rngs(0)))), out_shardings=shardings)
    nnx.update(pmodel, init())
    kernel = pmodel.blocks[0].up.kernel[...]
    assert {s.data.nbytes for s in kernel.addressable_shards} == {kernel.nbytes // 8}
    assert relative_difference(nnx.jit(loss)(pmodel, TOKENS), references["tiny_lm"][1][0]) <= 1e-5


class WithConv(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Linear(8, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, (3,), feature_group_count=2, rngs=rngs)


class Odd(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 5, rngs=rngs)])


class NarrowNorm(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(6, rngs=rngs)


@pytest.mark.parametrize("cls, error, message", [
    (WithConv, NotImplementedError, "layer 'conv' \\(Conv\\) has feature_group_count = 2"),
    (Odd, ValueError, "layer 'layers/1' \\(Linear\\): kernel \\(8, 5\\) dim 1 = 5 is not divisible by row = 2"),
    (NarrowNorm, ValueError, "layer 'norm' \\(LayerNorm\\): scale \\(6,\\) dim 0 = 6 is not divisible by col = 4"),
])
def test_unsupported_layers_are_named(cls, error, message, devices):
    mesh = make_mesh(ParallelConfig(row=2, col=4), devices)
    with pytest.raises(error, match=message):
        axonn_jax.parallelize(cls(nnx.Rngs(0)), mesh)


def test_example_args_are_nnx_only(devices):
    import flax.linen as nn

    mesh = make_mesh(ParallelConfig(row=2, col=4), devices)
    with pytest.raises(TypeError, match="example_args / example_kwargs are for NNX modules"):
        axonn_jax.parallelize(nn.Dense(8), mesh, example_args=(X,))


class WithState(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.steps = nnx.Variable(3)


def test_other_variables_are_replicated_on_the_mesh(devices):
    mesh = make_mesh(ParallelConfig(row=2, col=4), devices)
    pmodel = axonn_jax.parallelize(WithState(nnx.Rngs(0)), mesh)
    key = pmodel.drop.rngs.key[...]
    assert key.sharding.mesh == mesh and key.sharding.spec == jax.P()
    assert pmodel.steps.get_value() == 3 and isinstance(pmodel.steps.get_value(), int)


class TorchLinear(nnx.Module):
    """A custom dense module parallelize does not know: torch-style `(out, in)` weight, its own matmul."""

    def __init__(self, din, dout, rngs):
        self.weight = nnx.Param(0.3 * jax.random.normal(rngs.params(), (dout, din)))
        self.bias = nnx.Param(0.1 * jax.random.normal(rngs.params(), (dout,)))

    def __call__(self, x):
        return x @ self.weight[...].T + self.bias[...]


class Custom(nnx.Module):
    def __init__(self, rngs):
        self.up = TorchLinear(16, 32, rngs)
        self.down = TorchLinear(32, 16, rngs)
        self.gate = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return self.gate(self.down(jax.nn.relu(self.up(x))))


def test_custom_dense_modules_by_rule(devices, caplog):
    """Unknown: left whole, named in a note and the report, an error under max_replicated. With an
    AsDense rule: split and run tensor-parallel (transpose traced as for nnx.Linear); a Replicated
    rule keeps a layer whole, as asked, without a note."""
    from axonn_jax import AsDense, Replicated

    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    model = Custom(nnx.Rngs(0))
    reports = []
    with caplog.at_level("WARNING", logger="axonn_jax.parallelize"):
        axonn_jax.parallelize(model, mesh, report=reports.append)
    assert {p.path for p in reports[0].replicated if len(p.shape) == 2} == {"up/weight", "down/weight"}
    assert "2 weight(s) that no tensor-parallel layer used" in caplog.text
    with pytest.raises(ValueError, match="2 parameter\\(s\\) above max_replicated = 256 elements "
                                         "would stay whole on every device: 'down/weight' \\(16, 32\\)"):
        axonn_jax.parallelize(model, mesh, max_replicated=256)

    rules = {TorchLinear: AsDense(kernel="weight", out_in=True), "gate": Replicated()}
    pmodel = axonn_jax.parallelize(model, mesh, rules=rules, example_args=(X,),
                                   report=reports.append, max_replicated=0)
    report = reports[-1]
    assert report["up/weight"].spec == P(("row", "depth"), "col")  # (out, in): out over row×depth
    assert report["down/weight"].spec == P(("col", "depth"), "row")  # transposed
    assert report["gate/kernel"].parts == 1 and report["gate/kernel"].note.startswith("kept whole")
    assert isinstance(pmodel.up, TorchLinear) and type(pmodel.gate) is nnx.Linear
    value, grads = nnx.jit(nnx.value_and_grad(loss))(pmodel, X)
    ref, ref_grads = nnx.value_and_grad(loss)(model, X)
    assert relative_difference(value, ref) <= 1e-5
    for path, g in flat(grads).items():
        assert relative_difference(g, flat(ref_grads)[path]) <= 1e-5, path


def test_rules_are_checked(devices):
    mesh = make_mesh(ParallelConfig(row=2, col=4), devices)
    with pytest.raises(TypeError, match="rules\\['up'\\] must be AsDense\\(...\\) or Replicated\\(\\)"):
        axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh, rules={"up": "replicated"})


def test_kernel_options_are_static_in_the_graph_definition(devices):
    """`parallelize(..., kernels=...)` gives each dense layer its kernels' modes as a static
    attribute: the graph definitions differ (so `jax.jit` of the split model caches on them), and
    the program computes FP8 GEMMs only where asked, with no context around the call."""
    mesh = make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)
    graphdefs, texts = [], []
    for kernels in (KernelOptions(), KernelOptions(fp8=True)):
        graphdef, state = nnx.split(axonn_jax.parallelize(MLP(nnx.Rngs(0)), mesh, kernels=kernels,
                                                          example_args=(X,)))
        graphdefs.append(graphdef)
        texts.append(jax.jit(lambda s: nnx.merge(graphdef, s)(X)).lower(state).as_text())
    assert graphdefs[0] != graphdefs[1]
    assert "f8E4M3FN" not in texts[0] and "f8E4M3FN" in texts[1]
