"""The explicit tensor-parallel layers (`axonn_jax.layers` for linen, `axonn_jax.layers_nnx`) equal
Flax's own layers, with parameters placed by their partition specs."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from axonn_jax import ParallelConfig, layers, layers_nnx, make_mesh

from conftest import relative_difference

TOKENS = jax.random.randint(jax.random.key(3), (8, 4), 0, 64)


@pytest.fixture(scope="module")
def mesh(devices):
    return make_mesh(ParallelConfig(row=2, col=2, depth=2), devices)


class LinenNet(nn.Module):
    mesh: object = None

    @nn.compact
    def __call__(self, t):
        tp = self.mesh is not None
        kw = dict(mesh=self.mesh) if tp else {}
        x = (layers.Embed if tp else nn.Embed)(64, 16, name="emb", **kw)(t)
        x = (layers.LayerNorm if tp else nn.LayerNorm)(name="ln")(x)
        x = jax.nn.gelu((layers.Dense if tp else nn.Dense)(32, name="up", **kw)(x))
        x = (layers.Dense(16, transpose=True, name="down", **kw) if tp else nn.Dense(16, name="down"))(x)
        return jnp.mean(x ** 2)


class NnxNet(nnx.Module):
    def __init__(self, mesh, rngs):
        tp = mesh is not None
        kw = dict(mesh=mesh) if tp else {}
        E, D, N = (layers_nnx.Embed, layers_nnx.Dense, layers_nnx.LayerNorm) if tp \
            else (nnx.Embed, nnx.Linear, nnx.LayerNorm)
        self.emb = E(64, 16, rngs=rngs, **kw)
        self.ln = N(16, rngs=rngs, **kw)
        self.up = D(16, 32, rngs=rngs, **kw)
        self.down = D(32, 16, rngs=rngs, **(dict(kw, transpose=True) if tp else {}))

    def __call__(self, t):
        return jnp.mean(self.down(jax.nn.gelu(self.up(self.ln(self.emb(t))))) ** 2)


def test_linen_layers_equal_flax(mesh):
    ref = LinenNet()
    params = ref.init(jax.random.key(0), TOKENS)
    par = LinenNet(mesh)
    boxed = jax.eval_shape(par.init, jax.random.key(0), TOKENS)
    specs = nn.get_partition_spec(boxed)["params"]
    assert specs["up"]["kernel"] == P(("col", "depth"), "row")
    assert specs["down"]["kernel"] == P(("row", "depth"), "col")
    assert specs["emb"]["embedding"] == P(("row", "depth"), "col") and specs["ln"]["scale"] == P("col")
    loss = lambda m: jax.value_and_grad(lambda p: m.apply(p, TOKENS))
    (a, ga), (b, gb) = loss(ref)(params), jax.jit(loss(par))(params)
    assert relative_difference(b, a) <= 1e-5
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga)):
        assert relative_difference(x, y) <= 1e-5


def test_nnx_layers_equal_flax(mesh):
    ref = NnxNet(None, nnx.Rngs(0))
    par = nnx.jit(lambda: NnxNet(mesh, nnx.Rngs(0)))()
    assert par.up.kernel[...].sharding.spec == P(("col", "depth"), "row")
    assert par.emb.embedding[...].sharding.spec == P(("row", "depth"), "col")
    loss = lambda m: nnx.value_and_grad(lambda m: m(TOKENS))(m)
    (a, ga), (b, gb) = loss(ref), nnx.jit(loss)(par)
    assert relative_difference(b, a) <= 1e-5
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga)):
        assert relative_difference(x, y) <= 1e-5
