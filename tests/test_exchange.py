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


def test_sum_over_unsplit_sums_each_leaf_over_the_batch_axes_that_leave_it_whole(devices):
    """Over data × expert: a shared leaf is summed over both, an expert's weights (split over
    `expert`) over `data` only, and a leaf already summed (invariant) is only divided."""
    from axonn_jax._compat import ensure_varying

    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "expert"))
    shared = jax.random.normal(jax.random.key(0), (2, 4, 3))  # per (data, expert) shard
    experts = jax.random.normal(jax.random.key(1), (2, 4, 5))  # each expert shard's own rows
    specs = {"shared": P(), "experts": P("expert"), "summed": P()}

    def local(shared, experts, summed):
        tree = {"shared": ensure_varying(shared[0, 0], ("data", "expert")),
                "experts": ensure_varying(experts[0], ("data",)), "summed": summed}
        return exchange.sum_over_unsplit(tree, specs, ("data", "expert"), divide_by=2.0)

    out = jax.jit(shard_map(
        local, mesh=mesh, in_specs=(P("data", "expert"), P("data", "expert"), P()),
        out_specs={"shared": P(), "experts": P("expert"), "summed": P()},
        axis_names={"data", "expert"}))(shared, experts, jnp.ones(3))
    np.testing.assert_allclose(out["shared"], np.asarray(shared).sum((0, 1)) / 2, rtol=1e-6)
    np.testing.assert_allclose(out["experts"], np.asarray(experts).sum(0) / 2, rtol=1e-6)
    np.testing.assert_allclose(out["summed"], np.full(3, 0.5))


def _stack_grads(exchanged: bool, dtype: str, devices, width: int = 16):
    """The jitted gradient function and arguments of a 5-layer stack (runs of 2 plain and 3 rematerialized layers, an auxiliary
    loss per layer) over data = 4: by `scan_layers` with `exchange` (the hand-written backward), or
    by autodiff with one sum over `data` after the backward."""
    from axonn_jax._compat import ensure_varying
    from axonn_jax.step.model import scan_layers

    mesh = Mesh(np.array(devices[:4]), ("data",))
    k = jax.random.split(jax.random.key(3), 3)
    stacked = {"w": 0.3 * jax.random.normal(k[0], (5, width, width)),
               "b": 0.1 * jax.random.normal(k[1], (5, width))}
    x = jax.random.normal(k[2], (8, width))
    groups = ((2, None), (3, jax.checkpoint))

    def block(p, h):
        y = jnp.tanh(h @ p["w"].astype(h.dtype) + p["b"].astype(h.dtype))
        return y, {"loss": jnp.mean(y.astype(jnp.float32) ** 2)}

    def local(stacked, x):
        def loss(stacked):
            options = dict(exchange=lambda g: exchange.sum_over(g, "data", dtype),
                           prepare=lambda p: ensure_varying(p, ("data",))) if exchanged else {}
            y, aux = scan_layers(block, stacked, x, groups, **options)
            return jnp.sum(jnp.sin(y)) + jnp.sum(aux["loss"])

        if exchanged:
            return jax.grad(loss)(stacked)
        grads = jax.grad(loss)(ensure_varying(stacked, ("data",)))
        return exchange.sum_over(grads, "data", dtype)

    return jax.jit(shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                             axis_names={"data"})), (stacked, x)


@pytest.mark.parametrize("dtype", exchange.REDUCE_DTYPES)
def test_layer_exchange_gives_the_gradients_of_autodiff(devices, dtype):
    """`scan_layers(..., exchange=)` (`step.layer_exchange`: each layer's gradients exchanged in
    the backward of the layer below) gives autodiff's gradients summed over `data`, across runs of
    layers with different remat wrapping and with the layers' auxiliary losses: in float32 to
    rounding, with a bfloat16 wire within one bfloat16 rounding of them."""
    fn, args = _stack_grads(False, "float32", devices)
    want = fn(*args)
    fn, args = _stack_grads(True, dtype, devices)
    got = fn(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    bound = 1e-6 if dtype == "float32" else 2.0 ** -8
    for key in want:
        difference = relative_difference(got[key], want[key])
        assert difference < bound, key
        assert difference > 0 or dtype == "float32", key  # the bfloat16 wire rounds


def test_layer_exchange_keeps_no_copy_of_the_parameters(devices):
    """The forward saves each layer's pullback without the layer's parameters (the backward slices
    them from the stack again): the compiled temporaries are no larger than autodiff's, where a
    stacked copy of the parameters would add 1.3 MB."""
    temp = {}
    for exchanged in (False, True):
        fn, args = _stack_grads(exchanged, "float32", devices, width=256)
        temp[exchanged] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp[True] <= temp[False], temp


def test_a_pullback_is_saved_without_its_parameters_and_sentinels():
    """What the forward saves of a layer's pullback: its arrays but the layer's parameters (put
    back from the stack in the backward) and leaves that are no arrays (JAX 0.11's `jax.vjp`
    marks arguments it does not need with sentinel objects), which stay as they are."""
    from axonn_jax.step.layer_exchange import _with_params, _without_params

    param, residual, sentinel = jnp.ones(3), jnp.zeros(2), object()
    saved, treedef, where = _without_params({"p": param, "r": residual, "s": sentinel},
                                            {"w": param})
    assert len(saved) == 1 and saved[0] is residual
    rebuilt = _with_params(saved, treedef, where, {"w": 2 * param})
    assert rebuilt["s"] is sentinel and rebuilt["r"] is residual
    np.testing.assert_array_equal(rebuilt["p"], 2 * param)


OPTS = dict(model="gpt-tiny", steps=3, batch_size=8, seq_len=16, lr=1e-2, **PARITY)


@pytest.fixture(scope="module")
def one_device(devices):
    return train(TrainOptions(**OPTS), devices=devices[:1])


# Losses and gradient norms against one device in float32: a float32 wire within 1e-5 in the
# loss and 5e-5 in the norm (Adam turns the reassociation noise of a near-zero gradient element
# into a whole step of either sign: measured up to 1.1e-5 in the third step's norm with jax
# 0.12.0.1, flax 0.12.12, numpy 2.5.5, 1.9e-7 with the versions before); bfloat16 on the wire
# within 5e-3 (measured 8.0e-4: one rounding of every gradient sum before Adam).
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
    assert assert_steps_match(runs["float32"]["history"], ref, 1e-5, norm_rtol=5e-5) < 5e-5
    assert 0 < assert_steps_match(runs["bfloat16"]["history"], ref, 5e-3)


@pytest.mark.parametrize("model, grid, norm_rtol", [
    ("gpt-tiny", dict(data=2, context=2), 5e-3),
    # A rounded sum can move a token to another expert: the norm then moves by a few percent.
    ("mixtral-tiny", dict(data=2, expert=2), 5e-2),
])
def test_bfloat16_wire_over_several_batch_axes_tracks_float32(devices, model, grid, norm_rtol):
    """With `context` or `expert` beside `data` each layer's gradients are exchanged in the
    backward over the axes that leave each parameter whole (an expert's weights over `data`, the
    rest over both: two packed groups): a bfloat16 wire stays within its rounding of the float32
    exchange on the same grid, and differs from it."""
    options = dict(model=model, steps=3, batch_size=8, seq_len=16, lr=1e-2,
                   parallel=ParallelConfig(**grid), **PARITY)
    runs = {dtype: train(TrainOptions(**options, reduce_dtype=dtype), devices=devices[:4])
            for dtype in exchange.REDUCE_DTYPES}
    assert 0 < assert_steps_match(runs["bfloat16"]["history"], runs["float32"]["history"], 5e-3,
                                  norm_rtol=norm_rtol)


def test_bad_wire_dtypes_are_refused_in_one_line():
    from axonn_jax.run.options import ConfigError, problems

    found = problems(TrainOptions(compress_bits=4, reduce_dtype="bfloat16"), ParallelConfig(data=2),
                     num_devices=2)
    assert any("reduce_dtype=bfloat16" in line for line in found), found
    with pytest.raises(ConfigError, match="--reduce-dtype must be one of float32, bfloat16"):
        TrainOptions(reduce_dtype="float16")
