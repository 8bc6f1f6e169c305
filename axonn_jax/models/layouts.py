"""The layouts `parallelize` picks for a model's parts, traced abstractly: what a model's
`communication` (the communication model's declaration) lays its layers out by."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ParallelConfig
from ..mesh import make_mesh
from ..step.model import StackedModel
from ..tp.parallelize import transpose_plan


def part_layouts(model: StackedModel, batch) -> tuple[dict[str, bool], ...]:
    """The `{layer path: transpose}` that `parallelize` chooses for each part of a linen model.

    Traced abstractly on one device.

    Args:
      model: the model's `StackedModel` (its embedding, block and head).
      batch: a batch as ShapeDtypeStructs.

    Returns:
      `(embedding's, block's, head's)`, each `{dense or convolution layer path: transpose}`.
    """
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
    batch = zeros(batch)
    embed_params = jax.eval_shape(model.embed.init, jax.random.key(0), batch)["params"]
    act = zeros(jax.eval_shape(model.embed.apply, {"params": embed_params}, batch))
    head_args = (act, batch, zeros(embed_params)) if model.head_reads_embed else (act, batch)
    return (transpose_plan(model.embed, mesh, batch), transpose_plan(model.block, mesh, act),
            transpose_plan(model.head, mesh, *head_args))
