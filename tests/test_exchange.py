"""The exact data-parallel exchange's wire dtype (`parallel.exchange`, `--reduce-dtype`): the
bfloat16 exchange sums like float32 up to one bfloat16 rounding, on leaves split over tensor axes
and leaves no axis size divides; and what each wire dtype does to a trajectory, on each path the
exchange takes (per layer inside the backward, the reducer after gradient accumulation, after a
pipeline)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax._compat import shard_map
from axonn_jax.parallel import exchange
from axonn_jax.train import TrainOptions, train

from conftest import PARITY, assert_steps_match, relative_difference

# Leaves as the tensor axis `row` splits them: a kernel, a vector split, replicated ones of sizes
# the data axis does not divide, a scalar.
SHAPES = {"kernel": ((8, 6), P(None, "row")), "bias": ((6,), P("row")), "odd": ((7,), P()),
          "norm": ((5, 3), P()), "scalar": ((), P())}


@pytest.mark.parametrize("dtype", exchange.REDUCE_DTYPES)
def test_sum_over_equals_the_float32_sum(devices, dtype):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "row"))
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    # Per data shard a different gradient: leading axis 4, split over data.
    grads = {k: jax.random.normal(key, (4, *shape)) for key, (k, (shape, _)) in zip(keys, SHAPES.items())}
    specs = {k: spec for k, (_, spec) in SHAPES.items()}

    def local(g):
        g = jax.tree.map(lambda x: x[0], g)
        return exchange.sum_over(g, "data", dtype, specs)

    # Placed split over row as `specs` say; the shard_map is manual over data only.
    grads = {k: jax.device_put(g, NamedSharding(mesh, P("data", *specs[k])))
             for k, g in grads.items()}
    summed = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"),), out_specs=P(),
                               axis_names={"data"}))(grads)
    for k, g in grads.items():
        # Each copy rounded to bfloat16 once and the float32 sum once: 2^-9 of the magnitudes.
        want, scale = np.asarray(g).sum(0), np.abs(np.asarray(g)).sum(0)
        bound = 2.0 ** -8 if dtype == "bfloat16" else 1e-6
        assert np.all(np.abs(np.asarray(summed[k]) - want) <= bound * scale), k
        assert summed[k].dtype == jnp.float32 and summed[k].shape == want.shape


def test_vary_sums_cotangents_like_pvary(devices):
    """`vary`'s transpose with a bfloat16 wire gives the gradients of `pvary`'s (a psum) within
    one rounding; in float32 exactly."""
    mesh = Mesh(np.array(devices[:4]), ("data",))
    w = jax.random.normal(jax.random.key(1), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(2), (8, 16))

    def grad(dtype):
        def local(w, x):
            return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ exchange.vary(w, "data", dtype)) ** 2))(w)

        return jax.jit(shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                                 axis_names={"data"}))(w, x)

    want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    assert relative_difference(grad("float32"), want) < 1e-6
    assert 0 < relative_difference(grad("bfloat16"), want) <= 2.0 ** -8


OPTS = dict(model="gpt-tiny", steps=3, batch_size=8, seq_len=16, lr=1e-2, **PARITY)


@pytest.fixture(scope="module")
def one_device(devices):
    return train(TrainOptions(**OPTS), devices=devices[:1])


# Losses and gradient norms against one device in float32 (measured: at most 1.9e-7 with float32;
# 8.0e-4 with bfloat16 on the wire, one rounding of every gradient sum before Adam).
@pytest.mark.parametrize("grid, extra", [
    (dict(data=4), {}),
    (dict(data=2, row=2, col=2), dict(microbatches=2)),
    (dict(data=2, pipe=2), dict(microbatches=2)),
], ids=["per-layer", "accumulated-tensor", "pipeline"])
def test_reduce_dtype_trajectories(devices, one_device, grid, extra):
    grid = ParallelConfig(**grid)
    runs = {dtype: train(TrainOptions(**OPTS, **extra, reduce_dtype=dtype, parallel=grid),
                         devices=devices[:grid.num_devices]) for dtype in exchange.REDUCE_DTYPES}
    ref = one_device["history"]
    assert assert_steps_match(runs["float32"]["history"], ref, 1e-5) < 1e-5
    assert 0 < assert_steps_match(runs["bfloat16"]["history"], ref, 5e-3)


def test_bad_wire_dtypes_are_refused_in_one_line():
    from axonn_jax.run.options import ConfigError, problems

    found = problems(TrainOptions(compress_bits=4, reduce_dtype="bfloat16"), ParallelConfig(data=2),
                     num_devices=2)
    assert any("reduce_dtype=bfloat16" in line for line in found), found
    with pytest.raises(ConfigError, match="--reduce-dtype must be one of float32, bfloat16"):
        TrainOptions(reduce_dtype="float16")
