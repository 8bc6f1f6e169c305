"""The mixture-of-experts layer (`models.moe`), expert parallelism (`parallel.experts`) and the
Mixtral-style models (`models.mixtral`).

References are written here from the published formulas, never with the layer's own code: the
router and its losses in NumPy, the layer as a dense loop over experts (every token through every
expert, weighted by its routing weight, drops decided by a NumPy walk over the assignments in
priority order), Hugging Face's PyTorch Mixtral for checkpoints. Expert-parallel runs reduce
gradients as the train step will (design_axes.md): each shard differentiates its own loss with
parameters made varying, gradients are summed over the batch axes that do not split a parameter
and divided by the number of batch shards.
"""
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from axonn_jax._compat import ensure_varying, psum, shard_map
from axonn_jax.analysis import hlo
from axonn_jax.models import mixtral
from axonn_jax.models.moe import MoE, MoEConfig, balance_loss, route, z_loss
from axonn_jax.parallel import experts

D, FF, E, K = 16, 32, 8, 2
AXES = ("data", "expert")  # manual in the train step (design_axes.md); the rest automatic
NAMES = ("data", "pipe", "expert", "depth", "row", "col")


def _close(a, b, tol=1e-5):
    """Leaf by leaf: max |a - b| ≤ tol · max |b| (relative to the leaf's scale)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for path, x, y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(a),
                          jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, (path[0], x.shape, y.shape)
        scale = max(np.abs(y).max(), 1e-30)
        err = np.abs(x - y).max() / scale
        assert err <= tol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


# ----------------------------------------------------------------------------- references

def _np_route(logits, config):
    """NumPy: (weights, experts, probs) from the published formulas."""
    logits = np.asarray(logits, np.float64)
    if config.score == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, :config.top_k]
    weights = np.take_along_axis(scores, chosen, -1)
    if config.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    probs = scores / scores.sum(-1, keepdims=True)
    return weights, chosen, probs


def _np_losses(logits, config):
    """NumPy: (balance loss, z loss, tokens per expert) of router logits (T, E)."""
    _, chosen, probs = _np_route(logits, config)
    t, e = probs.shape
    load = np.bincount(chosen.ravel(), minlength=e)
    balance = e * np.sum(load / t * probs.mean(0))
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
    return balance, np.mean(lse ** 2), load


def _keep(chosen, slots_of, capacity):
    """NumPy walk over the assignments in priority order (all first choices by token, then all
    second choices, ...): an assignment is kept while its group (`slots_of(expert)`) has fewer
    than `capacity` kept ones. `(T, k)` bool."""
    t, k = chosen.shape
    used: dict = {}
    keep = np.zeros((t, k), bool)
    for j in range(k):
        for i in range(t):
            g = slots_of(chosen[i, j])
            if used.get(g, 0) < capacity:
                keep[i, j] = True
                used[g] = used.get(g, 0) + 1
    return keep


def _choices(params, x, config):
    """The experts NumPy's router picks, `(T, k)`."""
    return _np_route(np.asarray(x) @ np.asarray(params["router"]), config)[1]


def _dense_moe(params, x, config, chosen, keep=None):
    """The layer as a dense loop over experts: `(y, aux loss)`, for the routing choices `chosen`
    (`(T, k)`, from `_choices`); weights stay differentiable. keep: `(T, k)` bool, the assignments
    not dropped."""
    p = params
    logits = x @ p["router"]
    scores = jax.nn.softmax(logits) if config.score == "softmax" else jax.nn.sigmoid(logits)
    weights = jnp.take_along_axis(scores, jnp.asarray(chosen), -1)
    if config.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    if keep is not None:
        weights = weights * keep
    y = 0.0
    for e in range(config.num_experts):
        gate = jnp.sum(weights * (chosen == e), -1)
        f = (jax.nn.silu(x @ p["w_gate"][e]) * (x @ p["w_up"][e])) @ p["w_down"][e]
        y = y + gate[:, None] * f
    if config.num_shared_experts:
        h = jax.nn.silu(x @ p["shared_gate"]["kernel"]) * (x @ p["shared_up"]["kernel"])
        y = y + h @ p["shared_down"]["kernel"]
    probs = scores / scores.sum(-1, keepdims=True)
    load = np.bincount(chosen.ravel(), minlength=config.num_experts)
    balance = config.num_experts * jnp.sum(load / x.shape[0] * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return y, config.aux_loss_weight * balance + config.z_loss_weight * z


def _init(config, tokens=64, seed=0):
    init = jax.jit(lambda key: nn.unbox(MoE(config).init(key, jnp.zeros((tokens, D)))["params"]))
    params = init(jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (tokens, D))
    r = jax.random.normal(jax.random.key(seed + 2), (tokens, D))
    return params, x, r


# ----------------------------------------------------------------------------- router and losses

@pytest.mark.parametrize("score,renormalize", [("softmax", True), ("softmax", False),
                                               ("sigmoid", True), ("sigmoid", False)])
def test_router_and_losses_match_numpy(score, renormalize):
    config = MoEConfig(E, 3, FF, score=score, renormalize=renormalize)
    logits = 2.0 * jax.random.normal(jax.random.key(0), (64, E))
    weights, chosen, probs = route(logits, config)
    w_ref, c_ref, p_ref = _np_route(logits, config)
    np.testing.assert_array_equal(chosen, c_ref)
    _close(weights, w_ref.astype(np.float32))
    _close(probs, p_ref.astype(np.float32))
    balance, z, load = _np_losses(logits, config)
    ours = np.bincount(np.asarray(chosen).ravel(), minlength=E)
    _close(balance_loss(probs, jnp.asarray(ours, jnp.float32), 64), np.float32(balance))
    _close(z_loss(logits), np.float32(z))
    # Uniform routing probabilities give the loss's floor, top_k.
    _close(balance_loss(jnp.full((64, E), 1 / E), jnp.full((E,), 64 * 3 / E), 64), np.float32(3))


def test_layer_aux_matches_numpy():
    config = MoEConfig(E, K, FF, aux_loss_weight=0.3, z_loss_weight=0.02, capacity_factor=0.5)
    params, x, _ = _init(config)
    _, aux = jax.jit(MoE(config).apply)({"params": params}, x)
    balance, z, load = _np_losses(np.asarray(x) @ np.asarray(params["router"]), config)
    _close(aux["balance_loss"], np.float32(balance))
    _close(aux["z_loss"], np.float32(z))
    _close(aux["loss"], np.float32(0.3 * balance + 0.02 * z))
    np.testing.assert_array_equal(aux["expert_load"], load)
    capacity = math.ceil(0.5 * 64 * K / E)
    assert float(aux["dropped_tokens"]) == np.maximum(load - capacity, 0).sum() > 0


# ----------------------------------------------------------------------------- one device

LAYER_CONFIGS = {
    "dropless": MoEConfig(E, K, FF, aux_loss_weight=0.1, z_loss_weight=0.01),
    # capacity E/k: every expert has room for every token, nothing drops
    "capacity": MoEConfig(E, K, FF, aux_loss_weight=0.1, z_loss_weight=0.01, capacity_factor=E / K),
    "sigmoid-shared": MoEConfig(E, 3, FF, score="sigmoid", num_shared_experts=2,
                                aux_loss_weight=0.1),
    "capacity-shared": MoEConfig(E, 3, FF, renormalize=False, num_shared_experts=1,
                                 capacity_factor=E / 3, z_loss_weight=0.01),
}


def _loss(apply, params, x, r):
    y, aux = apply(params, x)
    return jnp.sum(y * r) / x.shape[0] + aux


@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_layer_matches_dense_loop(name):
    """Outputs, the aux loss and the gradients of every parameter and of the input equal the
    dense loop's (fp32)."""
    config = LAYER_CONFIGS[name]
    params, x, r = _init(config)
    chosen = _choices(params, x, config)
    layer = lambda p, x: (lambda y, a: (y, a["loss"]))(*MoE(config).apply({"params": p}, x))  # noqa: E731
    dense = lambda p, x: _dense_moe(p, x, config, chosen)  # noqa: E731
    _close(jax.jit(layer)(params, x), jax.jit(dense)(params, x))
    grad = lambda f: jax.jit(jax.grad(lambda p, x: _loss(f, p, x, r), argnums=(0, 1)))(  # noqa: E731
        params, x)
    _close(grad(layer), grad(dense))


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_drops_counted(factor):
    """With capacity `ceil(factor·T·k/E)` per expert, the dropped assignments are those past an
    expert's capacity in priority order; the output equals the dense loop without them."""
    config = MoEConfig(E, K, FF, capacity_factor=factor)
    params, x, r = _init(config)
    y, aux = jax.jit(MoE(config).apply)({"params": params}, x)
    chosen = _choices(params, x, config)
    keep = _keep(chosen, lambda e: e, math.ceil(factor * 64 * K / E))
    assert float(aux["dropped_tokens"]) == (~keep).sum() > 0
    _close(y, jax.jit(lambda p, x: _dense_moe(p, x, config, chosen, keep)[0])(params, x))


# ----------------------------------------------------------------------------- expert parallel

def _mesh(devices, data=1, expert=1, row=1, col=1):
    shape = (data, 1, expert, 1, row, col)
    return Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), NAMES)


def _manual(spec: P) -> P:
    """`spec` over the manual axes only (what a shard_map manual over them takes)."""
    keep = lambda e: tuple(a for a in ((e,) if isinstance(e, str) else e) if a in AXES) or None  # noqa: E731
    return P(*(None if e is None else keep(e) for e in spec))


def _specs(tree):
    """Expert weights split over `expert` on their expert dim (from the layer's partitioning
    metadata), the rest replicated."""
    return jax.tree.map(lambda s: P(*s) if isinstance(s, P) else P(), nn.get_partition_spec(tree),
                        is_leaf=lambda s: s is None or isinstance(s, P))


def _step_grads(loss_fn, specs, mesh, num_inputs: int):
    """`f(params, *inputs) -> (mean loss, aux, grads)` of `loss_fn(params, *inputs) -> (loss,
    aux)` over the rows of the inputs split over data·expert, in a shard_map manual over those
    (the tensor axes automatic, parameters placed by `specs`), gradients reduced as the train
    step reduces them."""
    shards = mesh.shape["data"] * mesh.shape["expert"]
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    manual = jax.tree.map(_manual, specs, is_leaf=is_spec)

    def local(params, *inputs):
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(
            ensure_varying(params, AXES), *inputs)
        g = jax.tree.map(lambda a, s: psum(a, tuple(x for x in AXES if x not in jax.tree.leaves(
            tuple(s)))) / shards, g, manual, is_leaf=is_spec)
        return psum(loss, AXES) / shards, aux, g

    step = jax.jit(shard_map(local, mesh=mesh, in_specs=(manual,) + (P(AXES),) * num_inputs,
                             out_specs=(P(), P(), manual), axis_names=set(AXES)))
    place = lambda params: jax.tree.map(  # noqa: E731
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs, is_leaf=is_spec)
    return lambda params, *inputs: step(place(params), *inputs)


def _layer_loss(config):
    def loss(p, x, r):
        y, aux = MoE(config).apply({"params": p}, x)
        metrics = {"expert_load": aux["expert_load"], "dropped_tokens": aux["dropped_tokens"]}
        return jnp.sum(y * r) / x.shape[0] + aux["loss"], metrics
    return loss


@pytest.mark.parametrize("data,expert,mode", [(1, 2, "dropless"), (1, 8, "dropless"),
                                              (2, 4, "dropless"), (1, 4, "capacity"),
                                              (2, 2, "capacity-shared")])
def test_expert_parallel_matches_one_device(devices, data, expert, mode):
    """Loss, routing metrics and every gradient on a (data, expert) grid equal one device's."""
    config = LAYER_CONFIGS[mode]
    mesh = _mesh(devices, data, expert)
    boxed = jax.eval_shape(MoE(config).init, jax.random.key(0), jnp.zeros((64, D)))["params"]
    params, x, r = _init(config)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(_layer_loss(config), has_aux=True))(
        params, x, r)
    got_loss, got_metrics, got_grads = _step_grads(_layer_loss(config), _specs(boxed), mesh, 2)(
        params, x, r)
    _close(got_loss, loss)
    _close(got_metrics, metrics)
    _close(got_grads, grads)


def _np_dispatch_drops(chosen, shards, expert, rows_per_device):
    """Assignments dropped by the per-destination chunks: each shard's own walk (`_keep`)."""
    per_shard = chosen.shape[0] // shards
    per_device = E // expert
    return sum((~_keep(chosen[s * per_shard:(s + 1) * per_shard], lambda e: e // per_device,
                       rows_per_device)).sum() for s in range(shards))


def test_dispatch_factor_drops_counted(devices):
    """Dropless over `expert` with `dispatch_factor` < the worst case: assignments past a
    destination's chunk are dropped, counted, and their tokens get the rest of their experts."""
    data, expert, factor = 2, 4, 0.6
    config = MoEConfig(E, K, FF, dispatch_factor=factor)
    mesh = _mesh(devices, data, expert)
    boxed = jax.eval_shape(MoE(config).init, jax.random.key(0), jnp.zeros((64, D)))["params"]
    params, x, r = _init(config)
    _, metrics, _ = _step_grads(_layer_loss(config), _specs(boxed), mesh, 2)(params, x, r)
    chosen = _choices(params, x, config)
    rows = math.ceil(factor * (64 // mesh.size) * K / expert)
    assert rows == experts.layout(64 // mesh.size, K, E, expert, None, factor)[1]
    dropped = _np_dispatch_drops(chosen, mesh.size, expert, rows)
    assert float(metrics["dropped_tokens"]) == dropped > 0


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_all_to_all_bytes_match_the_formula(devices, mode):
    """The compiled expert-parallel forward and backward issues the collectives
    `experts.collectives` states (kind, group, bytes), and no others."""
    config = LAYER_CONFIGS[mode]
    data, expert, tokens = 2, 4, 64
    mesh = _mesh(devices, data, expert)
    boxed = jax.eval_shape(MoE(config).init, jax.random.key(0), jnp.zeros((tokens, D)))["params"]
    params, x, r = _init(config, tokens)
    specs = jax.tree.map(_manual, _specs(boxed), is_leaf=lambda s: isinstance(s, P))

    def local(p, x, r):  # the input's gradient too, as in a model
        return jax.grad(lambda p, x: _layer_loss(config)(p, x, r)[0], argnums=(0, 1))(
            ensure_varying(p, AXES), x)

    stacked = jax.tree.map(lambda s: P(AXES, *s[1:]), specs, is_leaf=lambda s: isinstance(s, P))
    step = jax.jit(shard_map(local, mesh=mesh, in_specs=(specs, P(AXES), P(AXES)),
                             out_specs=(stacked, P(AXES)), axis_names=set(AXES)))
    text = step.lower(params, x, r).compile().as_text()
    measured = sorted((c.kind, c.group_size, c.total_bytes) for c in hlo.collectives(text))
    predicted = sorted((kind, math.prod(mesh.shape[a] for a in axes), size)
                       for kind, axes, size in experts.collectives(
                           tokens // mesh.size, D, E, K, expert, batch_axes=AXES,
                           capacity_factor=config.capacity_factor))
    assert measured == predicted


# ----------------------------------------------------------------------------- bad input

def test_bad_input_one_line_errors(devices):
    with pytest.raises(ValueError, match=r"top_k = 9 must be between 1 and num_experts = 8"):
        MoEConfig(8, 9, FF)
    for factor in (0, -1.0):
        with pytest.raises(ValueError, match=rf"capacity_factor = {factor} must be > 0"):
            MoEConfig(8, 2, FF, capacity_factor=factor)
    with pytest.raises(ValueError, match=r"dispatch_factor = 0 must be > 0"):
        MoEConfig(8, 2, FF, dispatch_factor=0)
    with pytest.raises(ValueError, match=r"num_experts = 6 is not divisible by expert = 4"):
        MoEConfig(6, 2, FF).check_expert_axis(4)
    with pytest.raises(ValueError, match=r"num_experts = 6 is not divisible by expert = 4"):
        mixtral.MixtralConfig(2, 64, 4, 32, num_experts=6).check_grid(
            type("Grid", (), dict(data=1, pipe=1, expert=4, depth=1, row=1, col=1))())
    # Inside a shard_map manual over `expert`, the layer refuses experts that do not split.
    mesh = _mesh(devices, expert=4)
    config = MoEConfig(6, 2, FF)
    params = nn.unbox(jax.eval_shape(MoE(config).init, jax.random.key(0), jnp.zeros((8, D)))["params"])
    f = shard_map(lambda p, x: MoE(config).apply({"params": p}, x)[0], mesh=mesh,
                  in_specs=(P(), P(AXES)), out_specs=P(AXES), axis_names=set(AXES))
    with pytest.raises(ValueError, match=r"num_experts = 6 is not divisible by the expert axis \(4\)"):
        jax.eval_shape(f, params, jnp.zeros((8, D)))


# ----------------------------------------------------------------------------- Mixtral

TOKENS = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
MIXTRAL = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
               router_aux_loss_coef=0.02)


def _torch_mixtral(path):
    """Logits `(b, t, vocab)` and each layer's balance loss, by transformers' PyTorch Mixtral, of
    the Hugging Face directory `path`."""
    import torch
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = MixtralForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
        balance = [float(load_balancing_loss_func((r,), model.config.num_local_experts,
                                                  model.config.num_experts_per_tok))
                   for r in out.router_logits]
    return out.logits.numpy(), np.array(balance)


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory):
    """A Hugging Face Mixtral directory written by transformers (random weights, the router's
    scaled up so that routing is decisive) and its logits and balance losses."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL, initializer_range=0.1))
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path, safe_serialization=True)
    return (path, *_torch_mixtral(path))


def test_mixtral_checkpoint_matches_transformers(hf_mixtral, tmp_path):
    """Our logits and per-layer balance losses on a transformers-written Mixtral equal
    transformers' PyTorch Mixtral's; our export loads back into transformers with its logits."""
    from conftest import relative_difference

    path, want, want_balance = hf_mixtral
    module, params = mixtral.from_pretrained(path)
    c = module.config
    assert (c.num_experts, c.top_k, c.d_ff, c.aux_loss_weight) == (8, 2, 32, 0.02)
    logits, aux = jax.jit(lambda p, t: module.apply({"params": p}, t, return_aux=True))(
        params, TOKENS)
    assert relative_difference(logits, want) <= 1e-5
    _close(aux["balance_loss"], want_balance.astype(np.float32))
    assert float(aux["expert_load"].sum()) == c.num_layers * TOKENS.size * c.top_k
    mixtral.to_pretrained(module, params, tmp_path)
    again, balance = _torch_mixtral(tmp_path)
    assert relative_difference(again, want) <= 1e-6 and relative_difference(balance, want_balance) <= 1e-6


def test_mixtral_export_refuses_what_the_format_cannot_hold(tmp_path):
    module = mixtral.network(mixtral.PRESETS["deepseek-moe-tiny"])
    with pytest.raises(ValueError, match="no shared experts; this model has score = 'sigmoid'"):
        mixtral.to_pretrained(module, {}, tmp_path)
    with pytest.raises(ValueError, match="sliding_window = 64"):
        mixtral.config_from_hf({"model_type": "mixtral", "hidden_act": "silu", "sliding_window": 64,
                                "max_position_embeddings": 128})


def _model_loss(fns):
    """Mean token cross-entropy plus every layer's aux loss, and the layers' routing metrics."""
    def loss(params, batch):
        def layer(h, p):
            h, aux = fns.block(p, h)
            return h, aux
        x, aux = jax.lax.scan(layer, fns.embed(params["embed"], batch), params["blocks"])
        metrics = {"expert_load": aux["expert_load"], "dropped_tokens": aux["dropped_tokens"]}
        return fns.head(fns.head_params(params), x, batch) + aux["loss"].sum(), metrics
    return loss


@pytest.mark.parametrize("preset,grid,overrides", [
    ("mixtral-tiny", dict(data=2, expert=2, row=2), {}),
    ("deepseek-moe-tiny", dict(expert=4, col=2), {"capacity_factor": 4.0}),
])
def test_mixtral_training_matches_one_device(devices, preset, grid, overrides):
    """Two SGD updates of the Mixtral-style StackedModel (blocks returning `(x, aux)`, aux
    losses added) on a grid of data, expert and tensor axes, as the train step will run it
    (manual over data and expert, the model made tensor-parallel by `StackedModel.bind`):
    losses, routing metrics, gradients and final parameters equal one device's, leaf by leaf."""
    import dataclasses

    config = dataclasses.replace(mixtral.PRESETS[preset], **overrides)
    model = mixtral.stacked(config)
    rng = np.random.default_rng(1)
    batches = [{"inputs": rng.integers(0, 256, (8, 16)).astype(np.int32),
                "targets": rng.integers(0, 256, (8, 16)).astype(np.int32)} for _ in range(2)]
    fns = model.bind(batches[0])
    params = jax.jit(fns.init)(jax.random.key(0))
    mesh = _mesh(devices, **grid)
    tensor = model.bind(batches[0], mesh)
    # The tensor axes' layout from parallelize; the expert axis' from the layer's metadata.
    boxed = jax.eval_shape(lambda: mixtral.network(config).init(jax.random.key(0), TOKENS))
    specs = jax.tree.map(lambda t, e: P(*(a or b for a, b in itertools.zip_longest(t, e))),
                         tensor.specs, _specs(boxed["params"]), is_leaf=lambda s: isinstance(s, P))
    # Each expert's matmuls split over the tensor axes, the experts over `expert`.
    assert specs["blocks"]["moe"]["w_gate"] == P(None, "expert", "col", "row")
    assert specs["blocks"]["moe"]["w_down"] == P(None, "expert", "row", "col")
    one_device = jax.jit(jax.value_and_grad(_model_loss(fns), has_aux=True))
    sharded = _step_grads(lambda p, i, t: _model_loss(tensor)(p, {"inputs": i, "targets": t}),
                          specs, mesh, 2)
    ours, theirs = params, params
    for batch in batches:
        (loss, metrics), grads = one_device(theirs, batch)
        got_loss, got_metrics, got_grads = sharded(ours, batch["inputs"], batch["targets"])
        _close(got_loss, loss)
        _close(got_metrics, metrics)
        _close(got_grads, grads)
        theirs = jax.tree.map(lambda p, g: p - 0.5 * g, theirs, grads)
        ours = jax.tree.map(lambda p, g: p - 0.5 * g, ours, got_grads)
    _close(ours, theirs)


@pytest.mark.parametrize("name", list(mixtral.PRESETS))
def test_preset_parameter_counts(name):
    """`num_params` counts the parameter tree (shapes only); Mixtral 8x7B has its published
    46.7B parameters, 12.9B of them active per token."""
    config = mixtral.PRESETS[name]
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(mixtral.network(config).init, jax.random.key(0), tokens)
    assert sum(math.prod(a.shape) for a in jax.tree.leaves(nn.unbox(shapes))) == config.num_params()
    if name == "mixtral-8x7b":
        active = config.num_params() - config.num_layers * 3 * config.d_model * config.d_ff * (
            config.num_experts - config.top_k)
        assert round(config.num_params() / 1e9, 1) == 46.7 and round(active / 1e9, 1) == 12.9


def test_hlo_counts_ragged_dot_flops():
    """`analysis.hlo.flops` counts a grouped matmul and both its transposes (as JAX lowers them
    for a GPU: `ragged-dot` instructions) at 2·m·k·n each, whatever the group sizes."""
    m, k, n, groups = 64, 16, 24, 4
    sizes = jnp.array([10, 0, 30, 24], jnp.int32)
    f = jax.value_and_grad(lambda x, w: jax.lax.ragged_dot(x, w, sizes).sum(), argnums=(0, 1))
    lowered = jax.jit(f).trace(jnp.ones((m, k)), jnp.ones((groups, k, n))).lower(
        lowering_platforms=("cuda",)).as_text(dialect="hlo")
    assert lowered.count("ragged-dot(") == 3
    extra = hlo.flops(lowered) - 3 * 2 * m * k * n
    assert 0 <= extra <= 2 * m * n  # the sum and its broadcast gradient


def test_routing_options_reach_the_model_and_the_plan(devices):
    """`--moe-dispatch-factor` / `--moe-capacity-factor` (YAML `model.moe_*`) set the preset's
    routing for the trainer and `plan` alike: over expert = 4 a dispatch factor of 1 drops
    assignments (counted per layer) and shrinks the planned padded all-to-all (CPU; a GPU's
    ragged one sends the routed rows either way); one of 4 (a whole
    device's rows may go anywhere) drops none and trains exactly like the dropless default.
    A model without experts, or a factor ≤ 0, is refused in one line."""
    from axonn_jax import ParallelConfig
    from axonn_jax.analysis import comm_model as cm
    from axonn_jax.run.options import ConfigError, check
    from axonn_jax.run.plan import workload
    from axonn_jax.train import TrainOptions, train

    base = dict(model="mixtral-tiny", steps=2, batch_size=8, seq_len=32, eval_batches=1,
                eval_every=10, parallel=ParallelConfig(expert=4))
    runs = {f: train(TrainOptions(**base, moe_dispatch_factor=f), devices=devices[:4])["history"]
            for f in (None, 1.0, 4.0)}
    assert all(sum(r["dropped_tokens"]) == 0 for r in runs[None] + runs[4.0])
    assert all(sum(r["dropped_tokens"]) > 0 for r in runs[1.0])
    assert [r["loss"] for r in runs[4.0]] == [r["loss"] for r in runs[None]]
    grid = ParallelConfig(expert=4)
    a2a = {(f, p): cm.bytes_by_kind(workload(TrainOptions(**base, moe_dispatch_factor=f), p),
                                    grid)["all-to-all"] for f in (None, 1.0) for p in ("cpu", "gpu")}
    assert 0 < a2a[1.0, "cpu"] < a2a[None, "cpu"]  # the padded exchange's chunks shrink
    # The GPU's ragged exchange sends the routed rows either way (parallel.ragged).
    assert 0 < a2a[1.0, "gpu"] == a2a[None, "gpu"] < a2a[None, "cpu"]
    for options, message in [(dict(model="gpt-tiny", moe_dispatch_factor=1.0),
                              "--moe-dispatch-factor: gpt-tiny has no mixture-of-experts layers"),
                             (dict(model="mixtral-tiny", moe_capacity_factor=0.0),
                              "--moe-capacity-factor 0.0 must be > 0")]:
        with pytest.raises(ConfigError, match=message):
            check(TrainOptions(**options), ParallelConfig())
