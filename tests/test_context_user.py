"""A user's own StackedModel over the context axis (issue 26): a block written with plain Flax
layers that calls the library's attention function (`axonn_jax.models.attention.
causal_attention`) trains with `context = 2` like one device; a block that calls Flax's
attention module instead is refused with a one-line message (it would attend within each
device's chunk only)."""
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from axonn_jax import ParallelConfig, StackedModel
from axonn_jax.models.attention import causal_attention
from axonn_jax.train import TrainOptions, train

from conftest import FP32, PARITY, assert_states_match, assert_steps_match, comparable_state

VOCAB, D, HEADS, SEQ = 32, 16, 2, 16


class Embed(nn.Module):
    @nn.compact
    def __call__(self, batch):
        return nn.Embed(VOCAB, D)(batch["inputs"])


class Block(nn.Module):
    flax_attention: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        if self.flax_attention:
            mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
            return x + nn.MultiHeadDotProductAttention(HEADS)(h, mask=mask)
        q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), name=n)(h) for n in "qkv")
        x = x + nn.DenseGeneral(D, axis=(-2, -1), name="out")(causal_attention(q, k, v, "xla"))
        return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))


class Head(nn.Module):
    @nn.compact
    def __call__(self, x, batch):
        logits = nn.Dense(VOCAB)(nn.LayerNorm()(x)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def batches(step):
    tokens = np.random.default_rng([0, step]).integers(0, VOCAB, (4, SEQ + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def run(devices, grid, flax_attention=False):
    model = StackedModel(Embed(), Block(flax_attention), Head(), 2)
    options = TrainOptions(steps=3, batch_size=4, seq_len=SEQ, lr=1e-2, clip_norm=None,
                           parallel=grid, **PARITY)
    return train(options, model=model, data=batches, devices=devices[:grid.num_devices])


def test_user_model_trains_over_context_like_one_device(devices):
    """Per-step losses and gradient norms, final parameters and Adam moments leaf by leaf: a
    wrong chunk order, a missing gradient sum over context or attention within a chunk fails."""
    ref = run(devices, ParallelConfig())
    got = run(devices, ParallelConfig(context=2))
    assert_steps_match(got["history"], ref["history"], 1e-5)
    assert_states_match(comparable_state(got["trainer"], got["state"]),
                        comparable_state(ref["trainer"], ref["state"]), **FP32)


def test_flax_attention_module_over_context_is_refused(devices):
    with pytest.raises(ValueError, match="causal_attention"):
        run(devices, ParallelConfig(context=2), flax_attention=True)
