"""A diffusion U-Net (residual conv blocks with GroupNorm, strided down-sampling, transposed-conv
up-sampling, skip connections, self-attention at the lowest resolution, a timestep embedding)
trained with the denoising loss, written with Flax's own layers; `axonn_jax.parallelize` runs its
convolutions and dense layers tensor-parallel without touching this file.

`stacked(config)` is the trainer's form, a `StackedModel` on batches `{'images': (b, s, s, c)
float32 in [-1, 1], 'noise': same shape, 't': (b,) int32}` (the noise and the timestep are part
of the batch, so a step is a pure function of its batch):

    embed  the down path (`DownPath`: noisy image, timestep embedding, stem, residual blocks and
           strided convolutions down to the lowest resolution) -> the activation `(b, r + 1, r,
           C)`: the lowest-resolution features `(b, r, r, C)` with one more spatial row holding
           the timestep embedding projected to C channels (a spatial row: it never splits over
           the tensor axes, and the blocks slice it off for free)
    block  the bottleneck: a residual block conditioned on that row, then self-attention; these
           identical blocks are the stack (and what the pipeline splits)
    head   the up path, which needs the down path's skip connections: it reads the embedding's
           parameters (`head_reads_embed`) and recomputes the down path from the batch, then
           residual blocks on [features, skip] and transposed convolutions up to the image, and
           returns the mean squared error of the predicted noise.

Recomputing the down path in the head costs one more forward (and a second backward) of the
down path, the price of the stacked-block form whose activation is one array; gradients are
exact (the embedding's gradient is the sum over both uses).

Tensor-parallel layout: in a block the activation's channels stay split over `col` (conv1 normal,
conv2 transposed; query/key/value normal, attention output transposed), so the blocks need no
re-layout; a block's timestep projection is two dense layers, so its output lands on whatever
axis the preceding convolution's output is split over. Convolutions and dense layers keep the
images split over the tensor axes alike (`tp.tensor.split_batch`), so in the down and up paths
the 1×1 skip convolutions of channel changes and the channel concatenation of the skips are
re-laid out by GSPMD with all-to-alls and permutes of one device's share, not gathers of the
batch.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..collectives import ModelCommunication, StepShape, from_parts
from ..config import Axis, ParallelConfig, check_divisible
from ..step.model import StackedModel
from ..tp.layers import GroupNorms
from ..tp.tensor import ConvLayer


class Layer(NamedTuple):
    """One convolution or dense layer, as the parameter count and the communication model read it.

    Attributes:
      part: 'embed', 'block' (one bottleneck block) or 'head'.
      name: its path in the part (the embedding's under 'down/').
      window: kernel positions (1 for a dense layer).
      cin: input channels.
      cout: output channels.
      pixels: output positions per image (1 for the timestep layers).
      in_pixels: input positions per image (1 for the timestep layers).
    """

    part: str
    name: str
    window: int
    cin: int
    cout: int
    pixels: int
    in_pixels: int


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Shape of a U-Net.

    Attributes:
      num_layers: bottleneck blocks (the stack).
      channels: channels at full resolution; level i has `channels · channel_mult[i]` (each
        level halves the resolution).
      num_res_blocks: residual blocks per level in the down path (one more in the up path).
      num_groups: GroupNorm groups.
      num_heads: attention heads at the lowest resolution.
      timesteps: steps of the noise schedule.
    """

    num_layers: int
    channels: int
    channel_mult: tuple[int, ...] = (1, 2)
    num_res_blocks: int = 1
    image_size: int = 8
    in_channels: int = 3
    num_groups: int = 4
    num_heads: int = 2
    timesteps: int = 1000

    def __post_init__(self):
        scale = 2 ** (len(self.channel_mult) - 1)
        if self.image_size % scale:
            raise ValueError(f"image_size = {self.image_size} is not divisible by 2^(levels - 1) = "
                             f"{scale}")
        for c in self.level_channels:
            if c % self.num_groups:
                raise ValueError(f"channels {c} are not divisible by num_groups = {self.num_groups}")
        if self.bottleneck_channels % self.num_heads:
            raise ValueError(f"bottleneck channels {self.bottleneck_channels} are not divisible "
                             f"by num_heads = {self.num_heads}")

    @property
    def level_channels(self) -> tuple[int, ...]:
        """Channels of each resolution level, `channels · channel_mult[i]`."""
        return tuple(self.channels * m for m in self.channel_mult)

    @property
    def bottleneck_channels(self) -> int:
        """Channels at the lowest resolution (the bottleneck blocks')."""
        return self.level_channels[-1]

    @property
    def bottleneck_size(self) -> int:
        """Side in pixels of the lowest resolution."""
        return self.image_size // 2 ** (len(self.channel_mult) - 1)

    @property
    def time_channels(self) -> int:
        """Features of the timestep embedding, `4 · channels`."""
        return 4 * self.channels

    def layers(self) -> list[Layer]:
        """Every convolution and dense layer (`Layer`s) in the order the model runs them.

        Used for the parameter count, the FLOPs and the communication model.

        Returns:
          The embedding's, one bottleneck block's, the head's (which also recomputes the
          embedding's).
        """
        c, t, s = self.channels, self.time_channels, self.image_size
        out = [Layer("embed", "time1", 1, c, t, 1, 1), Layer("embed", "time2", 1, t, t, 1, 1),
               Layer("embed", "stem", 9, self.in_channels, c, s * s, s * s)]
        skips, ch, lowest = [c], c, len(self.channel_mult) - 1

        def res(part, name, cin, cout, tin, px):
            rows = [Layer(part, f"{name}/conv1", 9, cin, cout, px, px),
                    Layer(part, f"{name}/time1", 1, tin, cout, 1, 1),
                    Layer(part, f"{name}/time2", 1, cout, cout, 1, 1),
                    Layer(part, f"{name}/conv2", 9, cout, cout, px, px)]
            return rows + ([Layer(part, f"{name}/skip", 1, cin, cout, px, px)] if cin != cout else [])

        def attn(part, name, ch, px):
            return [Layer(part, f"{name}/{n}", 1, ch, ch, px, px)
                    for n in ("query", "key", "value", "out")]

        for i, lc in enumerate(self.level_channels):
            px = (s >> i) ** 2
            for j in range(self.num_res_blocks):
                out += res("embed", f"down{i}_{j}", ch, lc, t, px)
                out += attn("embed", f"down{i}_{j}_attn", lc, px) if i == lowest else []
                ch = lc
                skips.append(ch)
            if i != lowest:
                out.append(Layer("embed", f"downsample{i}", 9, ch, ch, px // 4, px))
                skips.append(ch)
        bc, bpx = self.bottleneck_channels, self.bottleneck_size ** 2
        out.append(Layer("embed", "time_row", 1, t, bc, 1, 1))
        out += res("block", "res", bc, bc, bc, bpx) + attn("block", "attn", bc, bpx)
        for i in reversed(range(len(self.level_channels))):
            lc, px = self.level_channels[i], (s >> i) ** 2
            for j in range(self.num_res_blocks + 1):
                out += res("head", f"up{i}_{j}", ch + skips.pop(), lc, t, px)
                out += attn("head", f"up{i}_{j}_attn", lc, px) if i == lowest else []
                ch = lc
            if i:
                out.append(Layer("head", f"upsample{i}", 4, ch, ch, px * 4, px))
        out.append(Layer("head", "out_conv", 9, ch, self.in_channels, s * s, s * s))
        return out

    def num_params(self) -> int:
        """Parameters: kernels, biases and the GroupNorms' scales and biases.

        Returns:
          The number of parameters of the whole model.
        """
        total = 0
        for layer in self.layers():
            total += (layer.window * layer.cin + 1) * layer.cout * (
                self.num_layers if layer.part == "block" else 1)
        return total + 2 * self._norm_channels()

    def norm_channels(self) -> dict[str, int]:
        """Channels normalized by GroupNorms (each has a scale and a bias), per part.

        Returns:
          `{'embed': ..., 'block': ..., 'head': ...}`: the embedding's, one block's, the head's.
        """
        n = {"embed": 0, "block": 0, "head": self.level_channels[0]}  # the output norm
        for layer in self.layers():
            if layer.name.endswith("conv1"):  # norm1 on the block's input, norm2 on conv1's output
                n[layer.part] += layer.cin + layer.cout
            elif layer.name.endswith("/query"):
                n[layer.part] += layer.cin
        return n

    def _norm_channels(self) -> int:
        """Channels normalized by GroupNorms in the whole model."""
        n = self.norm_channels()
        return n["embed"] + self.num_layers * n["block"] + n["head"]

    def flops_per_image(self) -> float:
        """Training FLOPs of one image, attention scores included.

        Forward + backward = 3× forward; the head's recomputed down path adds one forward and
        one backward of it.

        Returns:
          The training FLOPs of one image.
        """
        fwd = self._forward_flops()
        return 3 * (2 * fwd["embed"] + self.num_layers * fwd["block"] + fwd["head"])

    def _forward_flops(self) -> dict[str, float]:
        """Forward FLOPs of one image in each part (one block's for `block`)."""
        fwd = {"embed": 0.0, "block": 0.0, "head": 0.0}
        for layer in self.layers():
            fwd[layer.part] += 2 * layer.window * layer.cin * layer.cout * layer.pixels
            if layer.name.endswith("/query"):  # scores and the weighted sum
                fwd[layer.part] += 2 * 2 * layer.pixels ** 2 * layer.cin
        return fwd

    def _busiest_stage(self, step: StepShape) -> float:
        """The last pipeline stage's FLOPs over the mean stage's: its blocks, the up path and
        the head's recomputed down path, where the first stage runs its blocks and the down
        path once (1 without a pipeline)."""
        if not step.pipelined:
            return 1.0
        fwd = self._forward_flops()
        last = step.stage_layers(self.num_layers) * fwd["block"] + fwd["head"] + fwd["embed"]
        return step.grid.pipe * 3 * last / self.flops_per_image()

    def communication(self, step: StepShape) -> ModelCommunication:
        """What one train step communicates (`collectives.ModelCommunication`).

        On the most loaded pipeline stage (the last: its blocks, the head and the head's
        recomputed down path):
        every convolution and dense layer a `tp.tensor.ConvLayer` laid out as `parallelize`
        traces it (`conv_layouts`), the GroupNorm vectors whole, the stage boundary the
        bottleneck's activation with its timestep row, the head reading all of the embedding's
        parameters. Not counted: GSPMD's re-layouts of skip concatenations and of layers whose
        input arrives on the other axis (the down and up paths'), GroupNorm collectives.

        Args:
          step: the train step's shape (grid, batch, microbatches, dtypes).

        Returns:
          The step's collectives, parameters, activations and FLOPs (`collectives.from_parts`).
        """
        g, layouts = step.grid, conv_layouts(self)
        copies = {"block": step.stage_layers(self.num_layers), "embed": 1, "head": 1}
        # Without a pipeline the device also runs the head's recomputed down path.
        runs = {"embed": 1 if step.pipelined else 2}
        convs = {part: [] for part in copies}
        for layer in self.layers():
            convs[layer.part].append(ConvLayer(
                layer.window, layer.cin, layer.cout, layer.pixels, layer.in_pixels,
                layouts.get(layer.name, False), copies[layer.part], runs.get(layer.part, 1),
                stacked=layer.part == "block"))
        for part, channels in self.norm_channels().items():
            convs[part].append(GroupNorms(channels, copies[part], part == "block"))
        embed = sum(p.elements for part in convs["embed"] for p in part.parameters(step))
        r, c = self.bottleneck_size, self.bottleneck_channels
        boundary = step.rows / step.microbatches * (r + 1) * r * c / g.col * step.compute_bytes
        return from_parts([p for part in convs.values() for p in part], step, boundary=boundary,
                          flops=self.flops_per_image() * step.batch, head_reads=embed,
                          activations=self._activation_bytes(step, layouts),
                          busiest_stage=self._busiest_stage(step))

    def _activation_bytes(self, step: StepShape, layouts: dict[str, bool]) -> float:
        """Activation bytes one device keeps for the backward (`ConvLayer.kept_bytes`), the
        blocks' over a stage, the down path's twice (the embedding's and the head's)."""
        total = 0.0
        for layer in self.layers():
            n = step.stage_layers(self.num_layers) if layer.part == "block" else \
                2 if layer.part == "embed" else 1
            conv = ConvLayer(layer.window, layer.cin, layer.cout, layer.pixels, layer.in_pixels,
                             layouts.get(layer.name, False))
            total += n * conv.kept_bytes(step)
        return total

    def check_grid(self, grid: ParallelConfig) -> None:
        """Raise ValueError naming the numbers unless the model splits evenly on `grid`.

        Every convolution and dense layer must split (channels over col·depth and row·depth;
        the stem and the output convolution, with the image's channels, stay whole), the
        GroupNorm groups over row and col, the heads over row.

        Args:
          grid: the parallel grid.

        Raises:
          ValueError: a dimension does not divide over its axes (the message names the
            numbers).
        """
        for layer in self.layers():
            if layer.name.endswith("time1") or layer.name == "time_row":  # any input layout
                continue
            if self.in_channels in (layer.cin, layer.cout):  # the image's channels stay whole
                continue
            for axes in ((Axis.COL, Axis.DEPTH), (Axis.ROW, Axis.DEPTH)):
                check_divisible(f"{layer.name} channels", layer.cin, axes, grid)
                check_divisible(f"{layer.name} channels", layer.cout, axes, grid)
        for axis in (Axis.ROW, Axis.COL):
            check_divisible("num_groups", self.num_groups, (axis,), grid)
        check_divisible("num_heads", self.num_heads, (Axis.ROW,), grid)

    def example_batch(self, batch_size: int) -> dict:
        """ShapeDtypeStructs of a batch of `batch_size` images.

        Args:
          batch_size: images in the batch.

        Returns:
          `{'images', 'noise': (batch_size, s, s, in_channels) float32, 't': (batch_size,)
          int32}` as ShapeDtypeStructs, `s` the image size.
        """
        image = jax.ShapeDtypeStruct((batch_size, self.image_size, self.image_size,
                                      self.in_channels), jnp.float32)
        return {"images": image, "noise": image, "t": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

    def batches(self, seed: int, batch_size: int) -> "ImageBatches":
        """`step -> batch`: the denoising batches it trains on (`ImageBatches`).

        Args:
          seed: the random seed of the drawn images, noise and timesteps.
          batch_size: images per batch.

        Returns:
          An `ImageBatches`.
        """
        return ImageBatches(self, seed, batch_size)


PRESETS: dict[str, UNetConfig] = {
    "unet-tiny": UNetConfig(num_layers=2, channels=8, channel_mult=(1, 2), image_size=8, num_groups=8,
                            num_heads=4),
    "unet-small": UNetConfig(num_layers=4, channels=32, channel_mult=(1, 2, 2), image_size=32,
                             num_groups=8, num_heads=4),
    # The scale of AxoNN's 28B-parameter U-Net: wide channels, the bottleneck stack holding most
    # of the parameters (for `plan`; far beyond these machines).
    "unet-28b": UNetConfig(num_layers=20, channels=1600, channel_mult=(1, 2, 4), num_res_blocks=2,
                           image_size=64, num_groups=32, num_heads=64),
}


def noise_level(t, timesteps: int):
    """ᾱ_t of the cosine schedule (Nichol & Dhariwal).

    Args:
      t: integer timesteps, any shape.
      timesteps: steps of the schedule.

    Returns:
      The fraction of the image's variance left at step `t` of `timesteps`, float32, shaped
      like `t`.
    """
    s = 0.008
    f = jnp.cos((t.astype(jnp.float32) / timesteps + s) / (1 + s) * jnp.pi / 2) ** 2
    return f / math.cos(s / (1 + s) * math.pi / 2) ** 2


def timestep_embedding(t, dim: int):
    """Sinusoidal embedding of integer timesteps.

    Args:
      t: integer timesteps, shape `(b,)`.
      dim: the embedding's features (even).

    Returns:
      `[cos, sin]` of the timesteps times `dim / 2` frequencies, float32, shape `(b, dim)`.
    """
    half = dim // 2
    freqs = jnp.exp(-math.log(10_000) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class ResBlock(nn.Module):
    """A residual block conditioned on a timestep embedding.

    GroupNorm, SiLU, 3×3 conv; plus the timestep's projection (two dense layers); GroupNorm,
    SiLU, 3×3 conv; residual (a 1×1 conv when the channels change).
    """

    channels: int
    num_groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, t):
        norm = lambda name: nn.GroupNorm(self.num_groups, dtype=self.dtype, name=name)  # noqa: E731
        conv = lambda name: nn.Conv(self.channels, (3, 3), dtype=self.dtype, name=name)  # noqa: E731
        h = conv("conv1")(nn.silu(norm("norm1")(x)))
        s = nn.Dense(self.channels, dtype=self.dtype, name="time1")(nn.silu(t))
        s = nn.Dense(self.channels, dtype=self.dtype, name="time2")(nn.silu(s))
        h = conv("conv2")(nn.silu(norm("norm2")(h + s[:, None, None, :])))
        if x.shape[-1] != self.channels:
            x = nn.Conv(self.channels, (1, 1), dtype=self.dtype, name="skip")(x)
        return x + h


class Attention(nn.Module):
    """Residual multi-head self-attention over the pixels of `x (b, r, r, c)`."""

    num_heads: int
    num_groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        b, hh, ww, c = x.shape
        h = nn.GroupNorm(self.num_groups, dtype=self.dtype, name="norm")(x)
        heads = lambda name: nn.Dense(c, dtype=self.dtype, name=name)(h).reshape(  # noqa: E731
            b, hh * ww, self.num_heads, c // self.num_heads)
        q, k, v = heads("query"), heads("key"), heads("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, hh, ww, c)
        return x + nn.Dense(c, dtype=self.dtype, name="out")(y)


class DownPath(nn.Module):
    """The noisy image and timestep embedding, then the down path.

    `batch -> (x (b, r, r, C), temb (b, 4·channels), skips)`.
    """

    config: UNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, batch):
        c = self.config
        abar = noise_level(batch["t"], c.timesteps)[:, None, None, None]
        x = jnp.sqrt(abar) * batch["images"] + jnp.sqrt(1 - abar) * batch["noise"]
        temb = nn.Dense(c.time_channels, dtype=self.dtype, name="time1")(
            timestep_embedding(batch["t"], c.channels))
        temb = nn.Dense(c.time_channels, dtype=self.dtype, name="time2")(nn.silu(temb))
        h = nn.Conv(c.channels, (3, 3), dtype=self.dtype, name="stem")(x.astype(self.dtype))
        skips, lowest = [h], len(c.channel_mult) - 1
        for i, ch in enumerate(c.level_channels):
            for j in range(c.num_res_blocks):
                h = ResBlock(ch, c.num_groups, self.dtype, name=f"down{i}_{j}")(h, temb)
                if i == lowest:
                    h = Attention(c.num_heads, c.num_groups, self.dtype, name=f"down{i}_{j}_attn")(h)
                skips.append(h)
            if i != lowest:
                h = nn.Conv(ch, (3, 3), strides=(2, 2), dtype=self.dtype, name=f"downsample{i}")(h)
                skips.append(h)
        return h, temb, skips


class Embedding(nn.Module):
    """The down path, its lowest-resolution features and the timestep row.

    `batch -> (b, r + 1, r, C)` (see the module docstring).
    """

    config: UNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, batch):
        x, temb, _ = DownPath(self.config, self.dtype, name="down")(batch)
        row = nn.Dense(self.config.bottleneck_channels, dtype=self.dtype, name="time_row")(
            nn.silu(temb))
        b, _, w, ch = x.shape
        return jnp.concatenate([x, jnp.broadcast_to(row[:, None, None, :], (b, 1, w, ch))], axis=1)


class Block(nn.Module):
    """One bottleneck block: a residual block conditioned on the timestep row, then self-attention.

    The row passes through. `(b, r + 1, r, C)` -> same shape.
    """

    config: UNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, act):
        c = self.config
        x, row = act[:, :-1], act[:, -1:]
        x = ResBlock(c.bottleneck_channels, c.num_groups, self.dtype, name="res")(x, row[:, 0, 0])
        x = Attention(c.num_heads, c.num_groups, self.dtype, name="attn")(x)
        return jnp.concatenate([x, row.astype(x.dtype)], axis=1)


class Head(nn.Module):
    """The up path and the denoising loss: the mean squared error of the predicted noise.

    The up path runs on the bottleneck's output and the down path's skips (recomputed from the
    batch with the embedding's parameters). `predict(act, batch, embed_params)` gives the
    prediction itself.
    """

    config: UNetConfig
    dtype: Any = jnp.float32

    @nn.compact
    def predict(self, act, batch, embed_params):
        """The predicted noise of the batch's noisy images.

        Args:
          act: the last bottleneck block's output, shape `(b, r + 1, r, C)`.
          batch: the denoising batch (`images`, `noise`, `t`).
          embed_params: the embedding's parameters (its down path runs again from the batch).

        Returns:
          The predicted noise, shape `(b, s, s, in_channels)`.
        """
        c = self.config
        down = DownPath(c, self.dtype, parent=None)  # unbound: it runs the embedding's parameters
        _, temb, skips = down.apply({"params": embed_params["down"]}, batch)
        h, lowest = act[:, :-1], len(c.channel_mult) - 1
        for i in reversed(range(len(c.level_channels))):
            ch = c.level_channels[i]
            for j in range(c.num_res_blocks + 1):
                h = jnp.concatenate([h, skips.pop().astype(h.dtype)], axis=-1)
                h = ResBlock(ch, c.num_groups, self.dtype, name=f"up{i}_{j}")(h, temb)
                if i == lowest:
                    h = Attention(c.num_heads, c.num_groups, self.dtype, name=f"up{i}_{j}_attn")(h)
            if i:
                h = nn.ConvTranspose(ch, (2, 2), strides=(2, 2), dtype=self.dtype,
                                     name=f"upsample{i}")(h)
        h = nn.silu(nn.GroupNorm(c.num_groups, dtype=self.dtype, name="out_norm")(h))
        return nn.Conv(c.in_channels, (3, 3), dtype=self.dtype, name="out_conv")(h)

    def __call__(self, act, batch, embed_params):
        eps = self.predict(act, batch, embed_params).astype(jnp.float32)
        return jnp.mean(jnp.square(eps - batch["noise"]))


def stacked(config: UNetConfig, dtype=jnp.float32, grid: ParallelConfig | None = None) -> StackedModel:
    """The U-Net as the trainer's `StackedModel` (see the module docstring).

    Args:
      config: the model's shape.
      dtype: the layers' computation dtype.
      grid: not used.

    Returns:
      A `StackedModel` of `Embedding`, `Block` and `Head` (which reads the embedding's
      parameters), `config.num_layers` blocks.
    """
    return StackedModel(Embedding(config, dtype), Block(config, dtype), Head(config, dtype),
                        config.num_layers, head_reads_embed=True)


@functools.lru_cache(maxsize=16)  # one entry per U-Net shape planned; each holds a small dict
def conv_layouts(model: UNetConfig) -> dict[str, bool]:
    """`{layer name: transpose}` of a U-Net's layers, as `parallelize` traces them.

    The parts of a narrow copy of the same architecture (the layout does not depend on widths)
    are traced abstractly on one device.

    Args:
      model: the model's shape.

    Returns:
      `{layer name: transpose}`, keyed by `UNetConfig.layers` names.
    """
    from .layouts import part_layouts

    small = dataclasses.replace(model, channels=4, num_groups=1, num_heads=1, num_layers=1,
                                image_size=2 ** len(model.channel_mult), in_channels=1)
    embed, block, head = part_layouts(stacked(small), small.example_batch(1))
    found = {name.removeprefix("down/"): t for name, t in embed.items()} | block
    # the head's recomputed down path keeps the embedding's own layout
    return found | {name: t for name, t in head.items() if name not in found}


def images(seed: int, step: int, batch_size: int, size: int, channels: int = 3) -> np.ndarray:
    """Batch `step` of procedurally drawn images, a pure function of (seed, step).

    Each is a smooth two-colour gradient background with a filled disc and a filled square of
    random colours, positions and sizes.

    Args:
      seed: the random seed.
      step: the batch's index.
      batch_size: images in the batch.
      size: the images' side in pixels.
      channels: colour channels.

    Returns:
      float32 images in [-1, 1], shape `(batch_size, size, size, channels)`.
    """
    rng = np.random.default_rng([seed, step])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    out = np.empty((batch_size, size, size, channels), np.float32)
    for b in range(batch_size):
        c0, c1, disc, square = rng.uniform(-1, 1, (4, channels)).astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        ramp = (np.cos(angle) * xx + np.sin(angle) * yy + 1) / 2
        img = c0 * (1 - ramp[..., None]) + c1 * ramp[..., None]
        cy, cx, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.15, 0.35)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = disc
        y0, x0, side = rng.uniform(0, 0.6), rng.uniform(0, 0.6), rng.uniform(0.2, 0.4)
        img[(yy >= y0) & (yy < y0 + side) & (xx >= x0) & (xx < x0 + side)] = square
        out[b] = img
    return out


@dataclasses.dataclass(frozen=True)
class ImageBatches:
    """`batches(step)`: denoising batches of drawn images, Gaussian noise and uniform timesteps.

    The images come from `images`; a batch is a pure function of (seed, step).
    """

    config: UNetConfig
    seed: int
    batch_size: int

    def __call__(self, step: int) -> dict:
        c = self.config
        rng = np.random.default_rng([self.seed, step, 1])
        x = images(self.seed, step, self.batch_size, c.image_size, c.in_channels)
        return {"images": x, "noise": rng.standard_normal(x.shape).astype(np.float32),
                "t": rng.integers(0, c.timesteps, self.batch_size).astype(np.int32)}
