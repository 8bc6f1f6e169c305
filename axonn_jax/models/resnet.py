"""A ResNet-style image classifier (the kind of CNN KARMA and CGX report), written with Flax's own
layers; `axonn_jax.parallelize` runs its convolutions tensor-parallel without touching this file.

`stacked(config)` is the trainer's form, a `StackedModel` on batches `{'images': (b, s, s, 3)
float32, 'labels': (b,) int32}`:

    embed  a 3×3 stem convolution and a strided 3×3 convolution to half the resolution
    block  a pre-activation residual block (GroupNorm, ReLU, 3×3 conv, twice), `num_layers` times
    head   GroupNorm, ReLU, global average pooling, a dense classifier, the mean cross-entropy

GroupNorm stands for BatchNorm: the trainer trains parameters only (no running statistics), and
GroupNorm splits over the tensor axes like its channels. Data: procedurally drawn shapes, one
class per kind of shape (`ShapeBatches`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..collectives import ModelCommunication, StepShape, from_parts
from ..config import Axis, ParallelConfig, check_divisible
from ..step.model import StackedModel
from ..tp.layers import GroupNorms
from ..tp.tensor import ConvLayer
from .unet import Layer

CLASSES = ("disc", "square", "horizontal stripes", "vertical stripes")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Shape of the classifier.

    Attributes:
      num_layers: residual blocks.
      channels: channels after the stem (twice that in the blocks).
      image_size: the images' side in pixels.
      num_groups: GroupNorm groups.
      num_classes: classes the classifier tells apart (`CLASSES`).
    """

    num_layers: int
    channels: int
    image_size: int = 8
    num_groups: int = 4
    num_classes: int = len(CLASSES)

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError naming the numbers unless the model splits evenly on `grid`.

        The convolutions' channels must split over col·depth and row·depth and the GroupNorm
        groups over row and col.

        Args:
          grid: the parallel grid.

        Raises:
          ValueError: a dimension does not divide over its axes (the message names the numbers).
        """
        for axes in ((Axis.COL, Axis.DEPTH), (Axis.ROW, Axis.DEPTH)):
            check_divisible("channels", self.channels, axes, grid)
        for axis in (Axis.ROW, Axis.COL):
            check_divisible("num_groups", self.num_groups, (axis,), grid)

    def layers(self) -> list[Layer]:
        """Every convolution and dense layer (`unet.Layer`s) in the order the model runs them.

        Returns:
          The stem's two, one block's two, the classifier (one row per image, after the
          pooling).
        """
        s, c, h = self.image_size, self.channels, -(-self.image_size // 2)
        return [Layer("embed", "stem", 9, 3, c, s * s, s * s),
                Layer("embed", "down", 9, c, 2 * c, h * h, s * s),
                Layer("block", "conv1", 9, 2 * c, 2 * c, h * h, h * h),
                Layer("block", "conv2", 9, 2 * c, 2 * c, h * h, h * h),
                Layer("head", "classifier", 1, 2 * c, self.num_classes, 1, 1)]

    def communication(self, step: StepShape) -> ModelCommunication:
        """What one train step communicates (`collectives.ModelCommunication`).

        On the most loaded pipeline stage: every convolution and the classifier a
        `tp.tensor.ConvLayer` laid out as `parallelize` traces it (`conv_layouts`), the GroupNorm
        vectors whole, the stage boundary a block's input. Not counted: GSPMD's re-layouts (the
        stem's three input channels, the pooled features), the GroupNorms' and the loss's
        collectives.

        Args:
          step: the train step's shape (grid, batch, microbatches, dtypes).

        Returns:
          The step's collectives, parameters, activations and FLOPs (`collectives.from_parts`).
        """
        g, layouts = step.grid, conv_layouts(self)
        copies = {"block": step.stage_layers(self.num_layers), "embed": 1, "head": 1}
        parts = [ConvLayer(layer.window, layer.cin, layer.cout, layer.pixels, layer.in_pixels,
                           layouts.get(layer.name, False), copies[layer.part],
                           stacked=layer.part == "block") for layer in self.layers()]
        width = 2 * self.channels
        parts += [GroupNorms(2 * width, copies["block"], stacked=True), GroupNorms(width)]
        pixels = self.layers()[2].pixels
        boundary = step.rows / step.microbatches * pixels * width / g.col * step.compute_bytes
        activations = sum((copies[layer.part] if layer.part == "block" else 1) * part.kept_bytes(step)
                          for layer, part in zip(self.layers(), parts))
        flops = 3 * 2 * step.batch * sum(
            layer.window * layer.cin * layer.cout * layer.pixels
            * (self.num_layers if layer.part == "block" else 1) for layer in self.layers())
        return from_parts(parts, step, boundary=boundary, flops=flops, activations=activations)

    def example_batch(self, batch_size: int) -> dict:
        """ShapeDtypeStructs of a batch of `batch_size` labeled images.

        Args:
          batch_size: images in the batch.

        Returns:
          `{'images': (batch_size, s, s, 3) float32, 'labels': (batch_size,) int32}` as
          ShapeDtypeStructs, `s` the image size.
        """
        s = self.image_size
        return {"images": jax.ShapeDtypeStruct((batch_size, s, s, 3), jnp.float32),
                "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

    def batches(self, seed: int, batch_size: int) -> "ShapeBatches":
        """`step -> batch`: the labeled images it trains on (`ShapeBatches`).

        Args:
          seed: the random seed of the drawn images.
          batch_size: images per batch.

        Returns:
          A `ShapeBatches`.
        """
        return ShapeBatches(self.image_size, seed, batch_size)


PRESETS: dict[str, ResNetConfig] = {
    "resnet-tiny": ResNetConfig(num_layers=2, channels=8),
    "resnet-small": ResNetConfig(num_layers=8, channels=32, image_size=32, num_groups=8),
}


class Stem(nn.Module):
    """`batch['images'] (b, s, s, 3) -> (b, s/2, s/2, 2·channels)`."""

    config: ResNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, batch):
        c = self.config.channels
        h = nn.relu(nn.Conv(c, (3, 3), dtype=self.dtype, name="stem")(batch["images"]))
        return nn.Conv(2 * c, (3, 3), strides=(2, 2), dtype=self.dtype, name="down")(h)


class Block(nn.Module):
    """A pre-activation residual block: `x + conv(relu(norm(conv(relu(norm(x))))))`."""

    config: ResNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        g, ch = self.config.num_groups, x.shape[-1]
        h = nn.relu(nn.GroupNorm(g, dtype=self.dtype, name="norm1")(x))
        h = nn.Conv(ch, (3, 3), dtype=self.dtype, name="conv1")(h)
        h = nn.relu(nn.GroupNorm(g, dtype=self.dtype, name="norm2")(h))
        return x + nn.Conv(ch, (3, 3), dtype=self.dtype, name="conv2")(h)


class Head(nn.Module):
    """Norm, ReLU, global average pooling, the classifier: the mean cross-entropy of the labels."""

    config: ResNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, batch):
        h = nn.relu(nn.GroupNorm(self.config.num_groups, dtype=self.dtype, name="norm")(x))
        logits = nn.Dense(self.config.num_classes, dtype=self.dtype, name="classifier")(
            h.mean(axis=(1, 2))).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(batch["labels"], logits.shape[-1]), axis=-1))


def stacked(config: ResNetConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> StackedModel:
    """The classifier as the trainer's `StackedModel`.

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: not used.

    Returns:
      A `StackedModel` of `Stem`, `Block` and `Head`, `config.num_layers` blocks.
    """
    return StackedModel(Stem(config, dtype), Block(config, dtype), Head(config, dtype),
                        config.num_layers)


@functools.lru_cache(maxsize=16)  # one entry per ResNet shape planned; each holds a small dict
def conv_layouts(config: ResNetConfig) -> dict[str, bool]:
    """`{layer name: transpose}` of the ResNet's layers, as `parallelize` traces them on one image.

    Args:
      config: the model's shape.

    Returns:
      `{layer name: transpose}`, keyed by `ResNetConfig.layers` names.
    """
    from .layouts import part_layouts

    embed, block, head = part_layouts(stacked(config), config.example_batch(1))
    return embed | block | head


@dataclasses.dataclass(frozen=True)
class ShapeBatches:
    """`batches(step)`: images of one shape each, labeled by the kind of shape (`CLASSES`).

    The shapes are a disc, a square, horizontal or vertical stripes, with random colours,
    positions, sizes, and pixel noise; a batch is a pure function of (seed, step).
    """

    image_size: int
    seed: int
    batch_size: int

    def __call__(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        s = self.image_size
        yy, xx = np.mgrid[0:s, 0:s].astype(np.float32) / max(s - 1, 1)
        labels = rng.integers(0, len(CLASSES), self.batch_size).astype(np.int32)
        out = rng.normal(0, 0.1, (self.batch_size, s, s, 3)).astype(np.float32)
        for b, label in enumerate(labels):
            fg, bg = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
            cy, cx, r = rng.uniform(0.3, 0.7, 3) * (1, 1, 0.6)
            period = rng.uniform(0.25, 0.5)
            mask = [(yy - cy) ** 2 + (xx - cx) ** 2 < r * r,
                    (abs(yy - cy) < r) & (abs(xx - cx) < r),
                    (yy / period) % 1 < 0.5, (xx / period) % 1 < 0.5][label]
            out[b] += np.where(mask[..., None], fg, bg)
        return {"images": out, "labels": labels}
