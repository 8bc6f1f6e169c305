"""Tensor-parallel convolutions: `tp_conv`, and `parallelize` on linen and NNX conv nets
(Conv, strided Conv, ConvTranspose, GroupNorm, Dense) equal the original model, outputs and
gradients, on several grids; clear errors for what does not split."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import axonn_jax
from axonn_jax import ParallelConfig, make_mesh

from conftest import relative_difference

X = jax.random.normal(jax.random.key(1), (4, 8, 8, 8))
GRIDS = [dict(row=2, col=2, depth=2), dict(data=2, row=2, col=2), dict(row=4, col=2)]


class LinenNet(nn.Module):
    transpose_kernel: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(16, (3, 3), name="c1")(x)
        h = nn.silu(nn.GroupNorm(num_groups=4, name="gn1")(h))
        h = nn.Conv(8, (3, 3), strides=2, padding="CIRCULAR", name="c2")(h)
        h = nn.GroupNorm(num_groups=4, name="gn2")(h)
        h = nn.ConvTranspose(16, (2, 2), strides=(2, 2), transpose_kernel=self.transpose_kernel,
                             name="up")(h)
        h = nn.Conv(8, (1, 1), use_bias=False, name="c3")(nn.silu(h))
        rgb = nn.Conv(3, (3, 3), name="rgb")(h)  # 3 channels: the layer stays whole
        return nn.Dense(8, name="out")(h.mean(axis=(1, 2))), rgb


def linen_loss(model):
    return lambda p, x: sum(jnp.mean(jnp.square(y)) for y in model.apply({"params": p}, x))


@pytest.fixture(scope="module")
def linen_reference():
    model = LinenNet(transpose_kernel=True)
    params = jax.jit(model.init)(jax.random.key(0), X)["params"]
    return model, params, jax.jit(jax.value_and_grad(linen_loss(model)))(params, X)


def check_close(value, grads, ref_value, ref_grads):
    assert relative_difference(value, ref_value) <= 1e-5
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.shape == r.shape and relative_difference(g, r) <= 1e-5


@pytest.mark.parametrize("grid", GRIDS[:2], ids=lambda g: "_".join(f"{k}{v}" for k, v in g.items()))
def test_linen_conv_net_equals_original(grid, linen_reference, devices):
    model, params, (ref_value, ref_grads) = linen_reference
    mesh = make_mesh(ParallelConfig(**grid), devices)
    pmodel = axonn_jax.parallelize(model, mesh)
    specs = nn.get_partition_spec(jax.eval_shape(pmodel.init, jax.random.key(0), X))["params"]
    assert specs["c1"]["kernel"] == jax.sharding.PartitionSpec(None, None, ("col", "depth"), "row")
    assert specs["c2"]["kernel"] == jax.sharding.PartitionSpec(None, None, ("row", "depth"), "col")
    assert specs["gn1"]["scale"] == jax.sharding.PartitionSpec("row")
    assert specs["rgb"]["kernel"] == jax.sharding.PartitionSpec()
    value, grads = jax.jit(jax.value_and_grad(linen_loss(pmodel)))(params, X)
    check_close(value, grads, ref_value, ref_grads)


class ReplicatedRowsNet(LinenNet):
    tp_replicated_rows = True  # what `parallelize` reads (`tp.options.KernelOptions`)


@pytest.mark.parametrize("model, images, split", [(LinenNet(), 4, True), (LinenNet(), 1, False),
                                                  (ReplicatedRowsNet(), 4, False)],
                         ids=["images_split", "images_do_not_divide", "replicated_rows"])
def test_linen_conv_layouts_equal_original(model, images, split, devices):
    """Both layouts of `tp_conv` on row 2 × col 2: 4 images split over each feature axis (the
    backward reads the rows gathered over `depth` alone); 1 does not divide so, and a module
    asking for the replicated layout keeps it."""
    x = X[:images]
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    ref_value, ref_grads = jax.jit(jax.value_and_grad(linen_loss(model)))(params, x)
    mesh = make_mesh(ParallelConfig(row=2, col=2), devices[:4])
    step = jax.value_and_grad(linen_loss(axonn_jax.parallelize(model, mesh)))
    batch_splits = {spec[0] for spec in shard_map_input_specs(jax.make_jaxpr(step)(params, x))
                    if len(spec) == 4}  # the convolutions' (images, height, width, channels)
    assert batch_splits == ({("depth", "row"), ("depth", "col"), "depth"} if split else {"depth"})
    check_close(*jax.jit(step)(params, x), ref_value, ref_grads)


def shard_map_input_specs(jaxpr) -> list:
    """The first input's PartitionSpec of every shard_map in `jaxpr`, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out.append(tuple(eqn.params["in_specs"][0]))
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                out += shard_map_input_specs(inner)
    return out


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.gn1 = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
        self.c2 = nnx.Conv(16, 8, (3, 3), strides=2, rngs=rngs)
        self.up = nnx.ConvTranspose(8, 16, (2, 2), strides=(2, 2), rngs=rngs)
        self.gn2 = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
        self.c3 = nnx.Conv(16, 8, (1, 1), use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = self.c2(nnx.silu(self.gn1(self.c1(x))))
        return self.c3(nnx.silu(self.gn2(self.up(h))))


def nnx_loss(model, x):
    return jnp.mean(jnp.square(model(x)))


@pytest.mark.parametrize("grid", GRIDS[2:], ids=lambda g: "_".join(f"{k}{v}" for k, v in g.items()))
def test_nnx_conv_net_equals_original(grid, devices):
    model = nnx.jit(lambda: NnxNet(nnx.Rngs(0)))()
    ref_value, ref_grads = nnx.jit(nnx.value_and_grad(nnx_loss))(model, X)
    mesh = make_mesh(ParallelConfig(**grid), devices)
    pmodel = axonn_jax.parallelize(model, mesh, example_args=(X,))
    specs = nnx.get_partition_spec(nnx.state(pmodel, nnx.Param))
    assert tuple(specs["c2"]["kernel"].get_value()) == (None, None, ("row", "depth"), "col")
    assert tuple(specs["c1"]["kernel"].get_value()) == (None, None, ("col", "depth"), "row")
    assert tuple(specs["gn2"]["scale"].get_value()) == ("row",)
    value, grads = nnx.jit(nnx.value_and_grad(nnx_loss))(pmodel, X)
    check_close(value, nnx.state(grads), ref_value, nnx.state(ref_grads))


def test_group_norm_groups_must_divide(devices):
    mesh = make_mesh(ParallelConfig(row=4, col=2), devices)
    bad_groups = nnx.GroupNorm(16, num_groups=2, rngs=nnx.Rngs(0))

    class Net(nnx.Module):
        def __init__(self):
            self.c, self.gn = nnx.Conv(8, 16, (3, 3), rngs=nnx.Rngs(0)), bad_groups

        def __call__(self, x):
            return self.gn(self.c(x))

    with pytest.raises(ValueError, match=r"layer 'gn' \(GroupNorm\): num_groups = 2 \(channels "
                                         r"16\) is not divisible by row = 4"):
        axonn_jax.parallelize(Net(), mesh, example_args=(X,))
