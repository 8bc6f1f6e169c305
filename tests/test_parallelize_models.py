"""`axonn_jax.parallelize` on Flax code written elsewhere: transformers' Flax GPT-2 (tied and untied
head), BERT, Llama and OPT modules, transformers written as the Flax docs write them (linen
`nn.SelfAttention` / `nn.MultiHeadDotProductAttention` with `nn.scan` and a tied `Embed.attend`
head; NNX `nnx.MultiHeadAttention` in an `nnx.vmap` stack run by `nnx.scan`), and user-style
subclasses of Flax layers. On two grids (row=4 × col=2, depth=2 × row=2 × col=2): the loss and
every gradient equal the original model's, every weight matrix is split (the few tables the grid
does not divide are named), the layer axes of stacks stay unsplit."""
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from transformers import BertConfig, GPT2Config, LlamaConfig, OPTConfig
from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule
from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule
from transformers.models.opt.modeling_flax_opt import FlaxOPTForCausalLMModule

import axonn_jax
from axonn_jax import AsDense, ParallelConfig, Replicated, make_mesh

from conftest import relative_difference

ROW4_COL2 = dict(row=4, col=2)
CUBE = dict(depth=2, row=2, col=2)
B, T, V, D, H = 4, 8, 64, 32, 4
TOKENS = jax.random.randint(jax.random.key(1), (B, T), 0, V)
MASK = jnp.ones((B, T), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(T), (B, T))


def random_params(module, *args):
    """Parameters of the linen `module` drawn on the host (no compile): every weight and bias
    non-zero, so that a misplaced bias shows."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(module.init, jax.random.key(0), *args)["params"]
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype), shapes)


def assert_same(value, grads, ref_value, ref_grads):
    """Loss within 1e-5 relative; each gradient leaf within 1e-5 of the larger of its own max and
    1e-3 × the largest gradient's norm (some true gradients are exactly zero)."""
    assert relative_difference(value, ref_value) <= 1e-5
    ref = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    assert ref.keys() == got.keys()
    floor = 1e-3 * max(float(jnp.linalg.norm(g)) for g in ref.values())
    for path, r in ref.items():
        scale = max(float(jnp.max(jnp.abs(r))), floor)
        err = float(jnp.max(jnp.abs(got[path] - r)))
        assert err <= 1e-5 * scale, (jax.tree_util.keystr(path), err, scale)


def assert_split(report, whole=()):
    """Every parameter with two or more dims is split over the grid, except the `whole` paths,
    each of which carries a note saying why."""
    left = {p.path: p.note for p in report.replicated if len(p.shape) >= 2}
    assert set(left) == set(whole), left
    assert all(left.values()), left


# -- linen: transformers' Flax modules


def gpt2(tied):
    config = GPT2Config(vocab_size=V, n_positions=16, n_embd=D, n_layer=1, n_head=H,
                        tie_word_embeddings=tied)
    return FlaxGPT2LMHeadModule(config), (TOKENS, MASK, POSITIONS)


def bert():
    config = BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                        intermediate_size=2 * D, max_position_embeddings=16)
    return FlaxBertForMaskedLMModule(config), (TOKENS, MASK, jnp.zeros_like(TOKENS), POSITIONS, None)


def llama():
    config = LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                         num_key_value_heads=2, intermediate_size=2 * D, max_position_embeddings=16)
    return FlaxLlamaForCausalLMModule(config), (TOKENS, MASK, POSITIONS)


def opt():
    config = OPTConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                       ffn_dim=2 * D, max_position_embeddings=16, word_embed_proj_dim=D)
    return FlaxOPTForCausalLMModule(config), (TOKENS, MASK, POSITIONS)


# name: (module and inputs, grid, rules, parameters the grid leaves whole (with a note))
TRANSFORMERS = {
    # GPT-2's FlaxConv1D layers (kernel (out, in)) run by the built-in rule (tp.rules)
    "gpt2_tied": (lambda: gpt2(True), ROW4_COL2, {}, ()),
    "gpt2_untied": (lambda: gpt2(False), CUBE, {}, ()),
    # BERT's token-type table has 2 rows: it cannot be split 4 ways and stays whole, named.
    "bert": (bert, ROW4_COL2, {}, ("bert/embeddings/token_type_embeddings/embedding",)),
    # 2 grouped-query key/value heads kept whole by a rule (not a "left whole" surprise).
    "llama": (llama, CUBE, {"*/k_proj": Replicated(), "*/v_proj": Replicated()},
              ("model/layers/0/self_attn/k_proj/kernel", "model/layers/0/self_attn/v_proj/kernel")),
    # OPT's learned positions subclass nn.Embed with an offset: a (16 + 2, 32) table.
    "opt": (opt, ROW4_COL2, {}, ("model/decoder/embed_positions/embedding",)),
}


def linen_loss(model, args):
    return lambda p: jnp.mean(model.apply({"params": p}, *args)[0] ** 2)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformers_modules(name, devices):
    make, grid, rules, whole = TRANSFORMERS[name]
    model, args = make()
    params = random_params(model, *args)
    ref = jax.jit(jax.value_and_grad(linen_loss(model, args)))(params)
    reports = []
    pmodel = axonn_jax.parallelize(model, make_mesh(ParallelConfig(**grid), devices), rules=rules,
                                   report=reports.append)
    # Model code reading self.variables (tied heads) sees plain arrays in init and in apply.
    boxed = jax.eval_shape(pmodel.init, jax.random.key(0), *args)["params"]
    assert jax.tree.structure(nn.unbox(boxed)) == jax.tree.structure(params)
    jax.eval_shape(lambda p: pmodel.apply({"params": p}, *args), boxed)
    assert_split(reports[0], whole)
    # the original's parameters, laid out by the parallel layers as they go
    assert_same(*jax.jit(jax.value_and_grad(linen_loss(pmodel, args)))(params), *ref)


class TorchStyleLinear(nn.Module):
    """A dense layer that calls `lax.dot_general` itself, its kernel `(out, in)` as in torch."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


class OwnLinears(nn.Module):
    @nn.compact
    def __call__(self, x):
        return TorchStyleLinear(D, name="down")(nn.gelu(TorchStyleLinear(3 * D, name="up")(x)))


def test_unknown_dense_modules_are_named_never_silent(devices, caplog):
    """A module that calls `lax.dot_general` itself: without a rule its weights stay whole, named
    in a note and in the report; `max_replicated` makes that an error; an AsDense rule splits
    them."""
    model, args = OwnLinears(), (jnp.ones((B, T, D)),)
    mesh = make_mesh(ParallelConfig(**ROW4_COL2), devices)
    reports = []
    with caplog.at_level(logging.WARNING, logger="axonn_jax.parallelize"):
        jax.eval_shape(axonn_jax.parallelize(model, mesh, report=reports.append).init,
                       jax.random.key(0), *args)
    whole = {p.path for p in reports[0].replicated if len(p.shape) == 2}
    assert whole == {"up/weight", "down/weight"}
    assert reports[0].replicated_bytes >= (3 + 3) * D * D * 4
    assert "2 weight(s) that no tensor-parallel layer used" in caplog.text
    assert "up/weight (96, 32)" in caplog.text
    strict = axonn_jax.parallelize(model, mesh, max_replicated=1000)
    with pytest.raises(ValueError, match="2 parameter\\(s\\) above max_replicated = 1000 elements"
                                         ".*'up/weight' \\(96, 32\\)"):
        jax.eval_shape(strict.init, jax.random.key(0), *args)
    ruled = axonn_jax.parallelize(model, mesh, report=reports.append,
                                  rules={TorchStyleLinear: AsDense(kernel="weight", bias=None,
                                                                   out_in=True)})
    params = random_params(model, *args)
    ref = jax.jit(jax.value_and_grad(linen_loss(model, args)))(params)
    assert_same(*jax.jit(jax.value_and_grad(linen_loss(ruled, args)))(params), *ref)
    assert_split(reports[-1])


# -- linen: the Flax docs' transformer, scanned; subclasses


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=H, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x)))
        return x + nn.Dense(D)(h), None


class LinenTransformer(nn.Module):
    """Token and position embeddings, `nn.scan` over 2 blocks as users write it (no
    `metadata_params` unless `named_layers`), final norm, logits from the tied table."""

    named_layers: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(V, D)
        x = embed(tokens) + nn.Embed(16, D, name="pos")(jnp.arange(tokens.shape[1]))
        meta = {"metadata_params": {nn.PARTITION_NAME: None}} if self.named_layers else {}
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=2, **meta)
        x, _ = blocks(name="blocks")(x, None)
        return embed.attend(nn.LayerNorm()(x))


class Doubled(nn.Dense):
    def __call__(self, x):
        return super().__call__(x) * 2


class OffsetEmbed(nn.Embed):
    """OPT's learned positions: its own table shape and an offset around Flax's lookup."""

    offset: int = 2

    def setup(self):
        self.embedding = self.param("embedding", self.embedding_init,
                                    (self.num_embeddings + self.offset, self.features))

    def __call__(self, positions):
        return super().__call__(positions + self.offset)


class Subclasses(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D)(tokens) + OffsetEmbed(14, D, name="pos")(jnp.arange(tokens.shape[1]))
        x = Doubled(2 * D, name="up")(x)
        x = nn.MultiHeadDotProductAttention(num_heads=H, name="mha")(x, x)
        return nn.DenseGeneral(D, axis=(-2, -1), name="flat")(x.reshape(B, T, H, -1))


LINEN = {"transformer": (LinenTransformer(), CUBE), "subclasses": (Subclasses(), ROW4_COL2)}


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
@pytest.mark.parametrize("name", LINEN)
def test_linen_models_written_elsewhere(name, devices):
    model, grid = LINEN[name]
    params = random_params(model, TOKENS)
    loss = lambda m: lambda p: jnp.mean(m.apply({"params": p}, TOKENS) ** 2)  # noqa: E731
    ref = jax.jit(jax.value_and_grad(loss(model)))(params)
    reports = []
    pmodel = axonn_jax.parallelize(model, make_mesh(ParallelConfig(**grid), devices),
                                   report=reports.append)
    specs = nn.get_partition_spec(jax.eval_shape(pmodel.init, jax.random.key(0), TOKENS))["params"]
    assert_split(reports[0])
    if name == "transformer":  # layer axis first and unsplit; heads over row
        assert specs["blocks"]["SelfAttention_0"]["query"]["kernel"] == P(None, ("col", "depth"), "row", None)
        assert specs["blocks"]["SelfAttention_0"]["out"]["kernel"] == P(None, ("row", "depth"), None, "col")
    else:  # the subclass's own table shape, whole-number split
        assert specs["pos"]["embedding"] == P(("row", "depth"), "col")
    assert_same(*jax.jit(jax.value_and_grad(loss(pmodel)))(params), *ref)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")
def test_linen_scan_with_metadata_params_places_the_same(devices):
    mesh = make_mesh(ParallelConfig(**CUBE), devices)
    specs = [nn.get_partition_spec(jax.eval_shape(axonn_jax.parallelize(LinenTransformer(named_layers=n), mesh).init,
                                                  jax.random.key(0), TOKENS)) for n in (False, True)]
    assert specs[0] == specs[1]


# -- NNX: the Flax docs' transformer (nnx.vmap stack, nnx.scan forward, MultiHeadAttention)


class DoubledLinear(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) * 2


class OffsetNnxEmbed(nnx.Embed):
    def __init__(self, num_embeddings, features, *, offset, rngs):
        super().__init__(num_embeddings + offset, features, rngs=rngs)
        self.offset = offset

    def __call__(self, positions):
        return super().__call__(positions + self.offset)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = DoubledLinear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class MiniGPT(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.pos = OffsetNnxEmbed(14, D, offset=2, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NnxBlock(rngs)

        self.blocks = create(rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        x = forward(x, self.blocks)
        return self.embed.attend(self.ln(x))


def nnx_loss(model, tokens):
    return jnp.mean(model(tokens) ** 2)


@pytest.fixture(scope="module")
def mini_gpt():
    model = nnx.jit(lambda: MiniGPT(nnx.Rngs(0)))()
    return model, nnx.jit(nnx.value_and_grad(nnx_loss))(model, TOKENS)


def test_nnx_docs_transformer(mini_gpt, devices):
    model, (ref, ref_grads) = mini_gpt
    reports = []
    pmodel = axonn_jax.parallelize(model, make_mesh(ParallelConfig(**CUBE), devices),
                                   example_args=(TOKENS,), report=reports.append)
    assert_split(reports[0])
    # the stacked layer axis stays unsplit; heads over row; the output projection transposed
    assert reports[0]["blocks/attn/query/kernel"].spec == P(None, ("col", "depth"), "row", None)
    assert reports[0]["blocks/attn/out/kernel"].spec == P(None, ("row", "depth"), None, "col")
    assert reports[0]["blocks/up/kernel"].spec == P(None, ("col", "depth"), "row")
    assert isinstance(pmodel.blocks.up, DoubledLinear) and isinstance(pmodel.pos, OffsetNnxEmbed)
    value, grads = nnx.jit(nnx.value_and_grad(nnx_loss))(pmodel, TOKENS)
    assert_same(value, nnx.to_pure_dict(grads), ref, nnx.to_pure_dict(ref_grads))


def test_nnx_stack_without_example_args_keeps_the_layer_axis(mini_gpt, devices):
    """Without a traced layout every dense layer is normal; the layer axis is still never split."""
    reports = []
    axonn_jax.parallelize(mini_gpt[0], make_mesh(ParallelConfig(**ROW4_COL2), devices),
                          report=reports.append)
    assert_split(reports[0])
    for layer in ("attn/query", "up"):
        assert tuple(reports[0][f"blocks/{layer}/kernel"].spec)[:2] == (None, ("col", "depth"))
    assert reports[0]["blocks/attn/out/kernel"].spec == P(None, ("col", "depth"), None, "row")
    assert reports[0]["blocks/ln1/scale"].spec == P(None, "col")
