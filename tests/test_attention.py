"""The attention core (`models.attention`): `jax.nn.dot_product_attention` with the implementation
picked in one place equals the plain softmax attention (outputs and gradients, causal mask,
grouped- and multi-query heads), in the GPT and Llama models too; a choice that cannot run here
fails with one line."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axonn_jax.models import attention, gpt, llama
from axonn_jax.run.cli import main as cli_main


def plain_attention(q, k, v, implementation=None, **unused):
    """Softmax attention with a causal mask, written out (the models' core before
    `jax.nn.dot_product_attention`); `implementation` and the masks' keywords (None in these
    tests) are ignored."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * d ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, h, d)


def _close(a, b, tol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_heads, implementation", [
    (4, "xla"), (2, "xla"), (1, "xla"),  # multi-head, grouped-query, multi-query
    (2, "auto"),  # XLA's here
])
def test_core_equals_plain_attention(kv_heads, implementation):
    rng = np.random.default_rng(kv_heads)
    q = jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 12, kv_heads, 8)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ours = lambda q, k, v: attention.causal_attention(q, k, v, implementation)  # noqa: E731
    _close(jax.jit(ours)(q, k, v), jax.jit(plain_attention)(q, k, v))
    grad = lambda fn: jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    _close(grad(ours), grad(plain_attention))


@pytest.mark.parametrize("config", [
    gpt.GPTConfig(num_layers=1, d_model=32, num_heads=4, vocab_size=64, max_seq_len=16),
    llama.LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                      vocab_size=64, max_seq_len=16),  # grouped-query heads
], ids=["gpt", "llama"])
def test_models_equal_plain_attention(config):
    """The whole network: logits and parameter gradients with `--attention xla` equal those of
    the plain core (both in one compiled program)."""
    module = gpt if isinstance(config, gpt.GPTConfig) else llama
    net = module.network(dataclasses.replace(config, attention="xla"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)

    def loss(p):
        logits = net.apply({"params": p}, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    @jax.jit
    def both(key):
        params = net.init(key, tokens)["params"]
        ours = jax.value_and_grad(loss, has_aux=True)(params)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "causal_attention", plain_attention)
            plain = jax.value_and_grad(loss, has_aux=True)(params)
        return ours, plain

    ours, plain = both(jax.random.key(0))
    _close(ours, plain, 1e-5)


def test_resolve_picks_in_one_place():
    assert attention.resolve("auto", jnp.float32) == "xla"  # this CPU
    assert attention.resolve("xla", jnp.bfloat16, 64, platform="gpu") == "xla"
    assert attention.resolve("auto", jnp.bfloat16, 64, platform="gpu") == "cudnn"
    assert attention.resolve("auto", jnp.float32, 64, platform="gpu") == "xla"
    assert attention.resolve("auto", jnp.bfloat16, 12, platform="gpu") == "xla"
    assert attention.resolve("cudnn", jnp.float16, 128, platform="gpu") == "cudnn"
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.resolve("cudnn", jnp.float32, 64, platform="gpu")
    with pytest.raises(ValueError, match="must be one of auto, xla, cudnn"):
        gpt.get_config("gpt-tiny", attention="flash")


def test_cli_cudnn_here_is_one_line(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN runs on this backend")
    assert cli_main(["train", "--steps", "1", "--attention", "cudnn", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "--attention cudnn needs a CUDA GPU (this backend is cpu)" in err
    assert err.count("\n") == 1


def test_attention_flag_with_a_callers_model_is_refused(devices):
    """No flag is silently ignored: a caller's model picks its own attention."""
    from axonn_jax.train import TrainOptions, build_trainer
    from user_models import image_batches, vit

    with pytest.raises(ValueError, match="--attention xla picks the built-in models' attention"):
        build_trainer(TrainOptions(attention="xla"), devices[:1], model=vit(),
                      example_batch=image_batches(4)(0))


def _xla_core(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@pytest.mark.parametrize("grid, kv_heads", [
    (dict(data=2, row=2, col=2), 2),  # heads split over row, batch over col
    (dict(data=2, depth=2, row=2), 1),  # batch over depth; query heads share one key/value head
    (dict(depth=2, row=2, col=2), 2),  # no batch shard_map: the step traces under its mesh
], ids=["row-col-gqa", "depth-row-mqa", "no-shard-map-depth-row-col"])
def test_fully_manual_core_equals_the_core(devices, grid, kv_heads):
    """The fully manual shard_map that cuDNN's attention runs in inside the train step's
    shard_map (manual over `data`, automatic over the tensor axes), or at the top of a step with
    none (`data` = 1: traced under the step's mesh, `_compat.tracing_in`), differentiated through
    a scan over two layers (where JAX 0.10's own residuals of a nested shard_map fail to lower):
    outputs and gradients equal the core's. Here with XLA's core: the mechanism is the same for
    cuDNN's (whose JAX partitioner does not exist for abstract H100s: test_compile_h100)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax._compat import shard_map, tracing_in

    mesh = make_mesh(ParallelConfig(**grid), devices)
    rng = np.random.default_rng(kv_heads)
    q = jnp.asarray(rng.normal(size=(8, 12, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(8, 12, kv_heads, 8)), jnp.float32) for _ in range(2))

    def step(attend):  # as the train step: autodiff inside the shard_map, manual over `data`
        def loss(q, k, v):
            def layer(x, _):  # keys and values from the carry, as in a model's blocks
                q, k, v = x
                y = attend(q, k, v)
                return (y * 0.5 + q, k + 0.1 * y[:, :, :kv_heads], v - 0.1 * y[:, :, :kv_heads]), None
            y = jax.lax.scan(layer, (q, k, v), None, length=2)[0]
            return sum(jnp.sum(a * a) for a in y)

        def local(*a):
            value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(*a)
            return value[None], grads

        def top(*a):  # the step of a grid with no batch shard_map
            with tracing_in(mesh):
                return jax.value_and_grad(loss, argnums=(0, 1, 2))(*a)

        if "data" not in grid:
            return jax.jit(top)
        return jax.jit(shard_map(local, mesh=mesh, in_specs=(P("data"),) * 3,
                                 out_specs=(P("data"), (P("data"),) * 3), axis_names={"data"}))

    ours = lambda q, k, v: attention.fully_manual(_xla_core, q, k, v)  # noqa: E731
    batch = "data" if "data" in grid else "depth"
    placed = [jax.device_put(a, NamedSharding(mesh, P(batch))) for a in (q, k, v)]
    traced = [step(attend).trace(*placed) for attend in (ours, _xla_core)]
    shard_maps = [str(t.jaxpr).count("shard_map[") for t in traced]
    assert shard_maps[1] == ("data" in grid)  # the step's own shard_map, or none
    assert shard_maps[0] > shard_maps[1]  # attention in its own
    _close(*(t.lower().compile()(*placed) for t in traced), 1e-5)


def test_platform_is_the_meshs(devices):
    """Code that depends on the platform asks the mesh it runs on (inside the step's shard_map, or
    the step's mesh where it has none), not this process: a program compiled here for abstract GPUs is a GPU program."""
    from jax.sharding import PartitionSpec as P

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax._compat import manual_axes, mesh_platform, shard_map, tracing_in

    mesh = make_mesh(ParallelConfig(data=2), devices[:2])
    assert mesh_platform(mesh) == mesh_platform(mesh.abstract_mesh) == "cpu"
    assert mesh_platform() is None  # no mesh in context
    seen = []

    def local(x):  # tracing_in: a no-op inside a shard_map (its axes stay manual); the mesh of
        with tracing_in(mesh):  # a step without one (data 1 beside tensor axes)
            seen.append((mesh_platform(), attention.resolve("auto", jnp.bfloat16, 64),
                         manual_axes()))
        return x

    jax.jit(shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                      axis_names={"data"})).trace(jnp.zeros(2))
    jax.jit(local).trace(jnp.zeros(2))
    assert seen == [("cpu", "xla", ("data",)), ("cpu", "xla", ())]
    assert mesh_platform() is None  # left as it was
