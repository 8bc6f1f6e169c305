"""A model's functions as a train step computes them: parameters cast to the compute dtype for the
forward (the stored parameters keep theirs), activations in the compute dtype, the loss in float32,
and the blocks run with an activation plan (`offload.activations`). Every gradient engine, the
in-process ones (`step.engines`) and the message-driven MPI pipeline alike, computes through these."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .model import ModelFunctions


def cast_floating(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (integer leaves unchanged)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


@dataclasses.dataclass(frozen=True)
class ComputeFunctions:
    """`fns` in `dtype` with the block groups `groups` (`((count, wrap), ...)`: how
    `step.model.scan_layers` wraps runs of layers, e.g. in `jax.checkpoint` with a policy; None
    keeps every layer as it is).

        embed(params['embed'], batch) -> x           x: (rows, ...) in `dtype`
        blocks(stacked block params, x) -> x         the whole stack, with `groups`
        head(head params, y, batch) -> loss          float32 scalar: the mean loss of the rows
        loss(params, batch) -> loss                  the three in a row (params: the model's tree)
        stage(layers) -> (chunk params, x) -> x      a pipeline chunk of `layers` layers
    """

    fns: ModelFunctions
    dtype: Any
    groups: tuple | None = None

    def embed(self, params, batch):
        return self.fns.embed(cast_floating(params, self.dtype), batch).astype(self.dtype)

    def blocks(self, stacked, x, groups: tuple | None = None):
        return self.fns.run_blocks(cast_floating(stacked, self.dtype), x,
                                   self.groups if groups is None else groups)

    def head(self, head_params, y, batch):
        return self.fns.head(cast_floating(head_params, self.dtype), y, batch).astype(jnp.float32)

    def loss(self, params, batch):
        """The mean loss of `batch` (the model's parameter tree `{'embed', 'blocks', 'head'}`)."""
        x = self.embed(params["embed"], batch)
        return self.head(self.fns.head_params(params), self.blocks(params["blocks"], x), batch)

    def stage(self, layers: int) -> Callable:
        """`(chunk params, x) -> x` of a pipeline chunk of `layers` layers: the plan's decision
        for every layer (a stage's layers run one program, so a plan must be uniform there)."""
        groups = None if self.groups is None else ((layers, self.groups[0][1]),)
        return lambda params, x: self.blocks(params, x, groups)
