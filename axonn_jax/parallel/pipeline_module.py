"""`axonn_jax.pipeline`: a Flax (linen) module transform in the spirit of `nn.scan` that turns a block
module and a layer count into a stack pipelined over the `pipe` mesh axis."""
from __future__ import annotations

from typing import Any

import flax.linen as nn

from .pipeline import PIPE_AXIS, check_layers, pipelined_stack


def _scan(block, length: int):
    # The stacked layer axis is not split by the tensor-parallel layers' partitioning.
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=length,
                   metadata_params={nn.PARTITION_NAME: None})


class Pipelined(nn.Module):
    """`length` copies of `block(*block_args, **block_kwargs)`, optionally pipelined over `pipe`.

    The parameters are stacked on a leading layer axis exactly as `nn.scan` stacks them (same
    parameter tree, same initial values). With `mesh=None` or `mesh.shape['pipe'] == 1` it is
    that `nn.scan`. Otherwise `__call__(x)` runs the stack as a GPipe pipeline of
    `microbatches` microbatches over `pipe` (`pipelined_stack`): place the parameters split over
    `pipe` on their leading axis; `x (b, ...)` is replicated. The block's `__call__(x, carry)`
    must return `(x, carry)` as `nn.scan` requires.
    """

    block: Any
    length: int
    mesh: Any = None
    microbatches: int = 1
    block_args: tuple = ()
    block_kwargs: Any = None

    def _stack(self, length: int, **module_kwargs):
        return _scan(self.block, length)(*self.block_args, **(self.block_kwargs or {}),
                                         **module_kwargs)

    @nn.compact
    def __call__(self, x, carry=None):
        stages = 1 if self.mesh is None else int(self.mesh.shape[PIPE_AXIS])
        if stages == 1 or self.is_initializing():
            layers = self._stack(self.length)
            nn.share_scope(self, layers)  # parameters directly under this module, as nn.scan has them
            return layers(x, carry)
        # One stage's slice of the stack, unbound: applied to that stage's parameters only.
        per_stage = self._stack(check_layers(self.length, stages), parent=None)
        params = self.variables["params"]

        def stage_fn(stage_params, h):
            return per_stage.apply({"params": stage_params}, h, carry)[0]

        return pipelined_stack(stage_fn, params, x, mesh=self.mesh,
                               num_microbatches=self.microbatches), carry


def pipeline(block, length: int, *, mesh=None, microbatches: int = 1):
    """A pipelined `nn.scan` of `length` blocks: a constructor of `Pipelined` modules.

    Like `nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True},
    length=length)`. x: `(b, ...)` with `b % microbatches == 0`; the stacked parameters
    `(length, ...)` are split over `pipe`. Schedule: GPipe (forward pipeline, then a
    hand-scheduled backward pipeline through a `jax.custom_vjp`); the loss-aware 1F1B schedule
    is `parallel.pipeline.pipeline_loss_and_grads`.

    Args:
      block (type[nn.Module]): the linen module class of one layer; its `__call__(x, carry)`
        returns `(x, carry)`.
      length: the number of blocks (`length % pipe == 0`).
      mesh (jax.sharding.Mesh | None): the mesh whose `pipe` axis splits the blocks into
        stages; None: no pipeline.
      microbatches: microbatches streamed through the stages by `ppermute`.

    Returns:
      (Callable[..., Pipelined]): a constructor `(*block_args, name=None, **block_kwargs) ->
        Pipelined`, a module whose `__call__(x, carry) -> (x, carry)` runs the `length` blocks
        split into `mesh.shape['pipe']` stages.

    Raises:
      ValueError: `microbatches` is not positive.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be positive, got {microbatches}")

    def make(*block_args, name: str | None = None, **block_kwargs) -> Pipelined:
        return Pipelined(block, length, mesh, microbatches, tuple(block_args), block_kwargs or None,
                         name=name)

    return make
