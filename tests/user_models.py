"""Two models written the way users write them, unlike the GPT: a linen vision transformer classifying
images (batch `{'images', 'labels'}`, cross-entropy over classes) and an NNX sequence regressor
(batch `{'x', 'y'}`, mean squared error), each with its own synthetic data."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from axonn_jax import StackedModel

IMAGE, PATCH, CHANNELS, CLASSES, WIDTH = 8, 4, 3, 8, 32


class PatchEmbed(nn.Module):
    """`images (b, 8, 8, 3)` -> patch tokens `(b, 4, WIDTH)` plus learned positions."""

    @nn.compact
    def __call__(self, batch):
        x = batch["images"]
        b = x.shape[0]
        n = IMAGE // PATCH
        x = x.reshape(b, n, PATCH, n, PATCH, CHANNELS).transpose(0, 1, 3, 2, 4, 5)
        x = nn.Dense(WIDTH, name="proj")(x.reshape(b, n * n, -1))
        return x + self.param("pos", nn.initializers.normal(0.02), (n * n, WIDTH))


class EncoderBlock(nn.Module):
    """Pre-norm self-attention (two heads, dense projections) and a GELU MLP."""

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.LayerNorm(name="norm1")(x)
        q, k, v = (nn.Dense(d, name=n)(h).reshape(b, t, 2, d // 2) for n in ("q", "k", "v"))
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 2), axis=-1)
        x = x + nn.Dense(d, name="out")(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))
        h = nn.gelu(nn.Dense(2 * d, name="up")(nn.LayerNorm(name="norm2")(x)))
        return x + nn.Dense(d, name="down")(h)


class ClassifierHead(nn.Module):
    """Mean-pooled tokens -> class logits; the mean cross-entropy against `batch['labels']`
    (`take`: the labels' log-probabilities picked with `take_along_axis`, a gather with batching
    dimensions, instead of a one-hot sum)."""

    take: bool = False

    @nn.compact
    def __call__(self, x, batch):
        logits = nn.Dense(CLASSES, name="classes")(nn.LayerNorm(name="norm")(x).mean(axis=1))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        if self.take:
            return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], axis=1))
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["labels"], CLASSES), axis=-1))


def vit(num_layers: int = 4, take: bool = False) -> StackedModel:
    return StackedModel(PatchEmbed(), EncoderBlock(), ClassifierHead(take), num_layers)


def image_batches(batch_size: int, seed: int = 0):
    """`step -> batch`: noise images whose label is the patch that holds a bright square."""
    def batch(step):
        rng = np.random.default_rng([seed, step])
        labels = rng.integers(0, CLASSES, batch_size)
        images = rng.normal(0, 0.3, (batch_size, IMAGE, IMAGE, CHANNELS)).astype(np.float32)
        for i, label in enumerate(labels):
            r, c = divmod(int(label) % 4, 2)
            images[i, r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH, label // 4] += 2.0
        return {"images": images, "labels": labels.astype(np.int32)}
    return batch


FEATURES, STEPS_IN_SEQ, TARGETS = 8, 6, 4


class Mixer(nnx.Module):
    """A residual MLP block: `x (b, t, d)` -> same."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(self.norm(x))))


class Encoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(FEATURES, WIDTH, rngs=rngs)

    def __call__(self, batch):
        return self.proj(batch["x"])


class Regression(nnx.Module):
    """Per-step predictions of `TARGETS` values; the mean squared error against `batch['y']`."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.out = nnx.Linear(WIDTH, TARGETS, rngs=rngs)

    def __call__(self, x, batch):
        return jnp.mean((self.out(self.norm(x)).astype(jnp.float32) - batch["y"]) ** 2)


def regressor(num_layers: int = 4) -> StackedModel:
    """The NNX model: modules for the embedding and the head, a function `rngs -> block`."""
    return StackedModel(Encoder(nnx.Rngs(1)), lambda rngs: Mixer(WIDTH, rngs),
                        Regression(nnx.Rngs(2)), num_layers)


def sequence_batches(batch_size: int, seed: int = 0):
    """`step -> batch`: random sequences `x (b, 6, 8)`, targets `y (b, 6, 4)` a fixed function."""
    w = np.random.default_rng(123).normal(size=(FEATURES, TARGETS)).astype(np.float32)

    def batch(step):
        x = np.random.default_rng([seed, step]).normal(size=(batch_size, STEPS_IN_SEQ, FEATURES))
        x = x.astype(np.float32)
        return {"x": x, "y": np.tanh(x @ w).astype(np.float32)}
    return batch


def repeated(batches, count: int = 1):
    """`step -> batch` cycling over the first `count` batches of `batches`: a fixed dataset, on
    which a loss measured on the same batch again must have fallen."""
    return lambda step: batches(step % count)


# What the tests (and tests/user_train.py, as a user's script) train: per model, the model, its
# data (one batch, repeated) and the options. Warm-up off (every step a real update); the ViT's
# gradient norms stay above 1 (clipping fires at every step), the regressor is not clipped.
OPTIONS = dict(steps=3, batch_size=8, lr=1e-2, warmup_steps=0)
SETUPS = {"vit": (vit, image_batches, dict(clip_norm=1.0)),
          "regressor": (regressor, sequence_batches, dict(clip_norm=None)),
          "vit-take": (lambda: vit(take=True), image_batches, dict(clip_norm=1.0))}


def setup(name: str):
    """(model, data, TrainOptions keywords) of model `name` (see SETUPS)."""
    make_model, make_data, options = SETUPS[name]
    return make_model(), repeated(make_data(OPTIONS["batch_size"])), {**OPTIONS, **options}
