"""A model's functions as a train step computes them: parameters cast to the compute dtype for the
forward (the stored parameters keep theirs), activations in the compute dtype (in the model's own
where that is narrower: `activation_dtype`), the loss in float32, the blocks given the batch's side
inputs and run with an activation plan (`offload.activations`), their auxiliary losses added to the
loss and their other auxiliary outputs returned as metrics.
Every gradient engine, the in-process ones (`step.engines`) and the message-driven MPI pipeline
alike, computes through these."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import ensure_varying, manual_axis_size
from ..offload.optimizer import share_dimension
from ..parallel import exchange
from .gathers import unbatched_gathers
from .model import ModelFunctions, scan_layers


def cast_floating(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (integer leaves unchanged).

    Args:
      tree: a pytree of arrays.
      dtype: the floating dtype to cast to.

    Returns:
      The tree of the same structure, the arrays laid out as they were.
    """
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


def activation_dtype(model_dtype, dtype):
    """The dtype activations travel between the parts in under a compute dtype.

    A model computing in a narrower floating dtype keeps its own (widening them would only add
    bytes: the blocks compute in the model's dtype anyway).

    Args:
      model_dtype: the dtype the model's embedding produces.
      dtype: the step's compute dtype.

    Returns:
      `dtype`, or `model_dtype` when it is a narrower floating dtype.
    """
    model_dtype, dtype = jnp.dtype(model_dtype), jnp.dtype(dtype)
    narrower = jnp.issubdtype(model_dtype, jnp.floating) and model_dtype.itemsize < dtype.itemsize
    return model_dtype if narrower else dtype


def aux_loss(aux: dict) -> jax.Array:
    """The blocks' auxiliary loss (their `aux['loss']` summed over layers), float32.

    Args:
      aux: the blocks' auxiliary outputs, each with a leading layer axis.

    Returns:
      A float32 scalar (0 without a `loss` entry).
    """
    return jnp.sum(aux["loss"]).astype(jnp.float32) if "loss" in aux else jnp.float32(0.0)


def aux_metrics(aux: dict) -> dict:
    """The blocks' auxiliary outputs other than the loss (per layer: leading layer axis).

    Args:
      aux: the blocks' auxiliary outputs.

    Returns:
      `aux` without its `loss` entry.
    """
    return {k: v for k, v in aux.items() if k != "loss"}


@dataclasses.dataclass(frozen=True)
class ComputeFunctions:
    """A model's functions `fns` as a train step computes them in `dtype`.

    `groups` are the block groups (`((count, wrap), ...)`: how `step.model.scan_layers` wraps
    runs of layers, e.g. in `jax.checkpoint` with a policy; None keeps every layer as it is).
    The modes of the tensor-parallel kernels (FP8 GEMMs, gathers in rings) are those `fns` was
    bound with (`StackedModel.bind`'s `kernels`).

        embed(params['embed'], batch) -> x            x: (rows, ...) in `activation_dtype`
        blocks(stacked, x, batch) -> (x, aux)         the whole stack, with `groups`
        head(head params, y, batch) -> loss           float32 scalar: the mean loss of the rows
        loss_and_metrics(params, batch) -> (loss, metrics)   the three in a row, the blocks'
                                                      auxiliary loss added (params: the model's
                                                      tree `{'embed', 'blocks', 'head'}`)
        stage(layers) -> (chunk params, x, batch) -> (x, aux loss, metrics)   a pipeline chunk
    """

    fns: ModelFunctions
    dtype: Any
    _: dataclasses.KW_ONLY  # the modes by name: a field added here must not shift the others
    groups: tuple | None = None
    vary_layers: tuple[str, ...] = ()
    """The manual axes each layer's gradients are summed over inside the backward (the stack
    arrives invariant over them; over several, each gradient over those that do not split its
    parameter): the stack's backward is written by hand
    (`step.layer_exchange`), each layer's sum running while the layer below computes its
    backward (`SpmdEngine.layer_reduce`)."""
    layer_mean: bool = False
    """Those sums divided by the axis' size in float32, before the cast back to the stored
    dtype: means, for 16-bit gradients (an offloaded state's device parameters), whose sum of
    copies could overflow, and for gradients that leave for host memory
    (`--offload-gradients`), which nothing divides afterwards."""
    reduce_dtype: str = "float32"
    """The dtype those sums send (`parallel.exchange`)."""
    layer_stages: Callable | None = None
    """Another exchange for those layers than the exact sum: `(axis, one layer's specs) ->
    stages` with state (CGX's, `step.reducers.LayerExchange`), whose per-layer state and key
    `blocks` takes as `layer_state`; the layers come out with its result (a mean)."""
    fetch_ahead: bool = False
    """Whether the stack's backward is written by hand without an exchange, so that each
    layer's activations offloaded to host memory are fetched while the layer above runs its
    backward (`step.layer_exchange`; with `vary_layers` they always are)."""

    @property
    def _layer_specs(self):
        """How the tensor axes split one layer's parameters (the stack's specs without the
        layer axis)."""
        return jax.tree.map(lambda s: P(*s[1:]), self.fns.specs["blocks"],
                            is_leaf=lambda s: isinstance(s, P))

    def _layer_sum(self, axes: tuple[str, ...]) -> tuple:
        """The stages of one layer's exchange over `axes`: `layer_stages`' over its one axis,
        the exact sum in `reduce_dtype` over one axis, or over several (a batch axis besides
        `data`) each gradient's sum over those that do not split its parameter."""
        if self.layer_stages is not None:
            (axis,) = axes
            return self.layer_stages(axis, self._layer_specs)
        if len(axes) == 1:
            size = manual_axis_size(axes[0]) if self.layer_mean else 1
            return exchange.sum_over_stages(axes[0], self.reduce_dtype, self._layer_specs, size)
        return exchange.sum_over_unsplit_stages(axes, self.reduce_dtype, self._layer_specs)

    def _layer_shares(self, axes: tuple[str, ...]) -> Callable:
        """The exchange of one layer's gradients that leave for host memory: over one axis,
        the means of the leaves whose offloaded state is split so
        (`offload.optimizer.share_dimension`) reduce-scattered together to this copy's shares
        (`exchange.mean_shares`), each other leaf's whole mean."""
        (axis,) = axes
        sizes = dict(jax.sharding.get_abstract_mesh().shape)

        def means(tree):
            leaves, treedef = jax.tree.flatten(tree)
            specs = treedef.flatten_up_to(self._layer_specs)
            dims = [share_dimension(s, g.shape, axis, sizes) for g, s in zip(leaves, specs)]
            out = [g if d is not None else exchange.sum_divided(g, axis, sizes[axis])
                   for g, d in zip(leaves, dims)]
            shared = [i for i, d in enumerate(dims) if d is not None]
            if shared:
                for i, share in zip(shared, exchange.mean_shares(
                        [leaves[i] for i in shared], [dims[i] for i in shared], axis)):
                    out[i] = share
            return jax.tree.unflatten(treedef, out)

        return means

    # Each part runs with its gathers' batching dimensions written into their indices
    # (`step.gathers`: XLA's partitioner aborts on such gathers split over two automatic axes).

    def embed(self, params, batch):
        """The model's embedding of `batch`, parameters cast to the compute dtype.

        Args:
          params: the model's `params['embed']`.
          batch: the batch's arrays.

        Returns:
          x `(rows, ...)` in `activation_dtype`.
        """
        def embed(p, b):
            x = self.fns.embed(cast_floating(p, self.dtype), b)
            return x.astype(activation_dtype(x.dtype, self.dtype))

        return unbatched_gathers(embed)(params, batch)

    def blocks(self, stacked, x, batch, groups: tuple | None = None, layer_state=None,
               sink=None):
        """The stack on `x` with the plan's groups (or `groups`).

        Args:
          stacked: the stacked block parameters (leading layer axis).
          x: the activations `(rows, ...)`.
          batch: the batch's arrays (the blocks read its side inputs).
          groups: the block groups (None: the plan's `groups`).
          layer_state: the per-layer state and key of `layer_stages` (`(state stacks or None,
            key or None)`).
          sink: None, or the host stacks each layer's gradient is written to as the backward
            finishes it (`step.layer_exchange.scan_exchanging`'s; `--offload-gradients`).

        Returns:
          `(x, aux)`: the stack's output and the blocks' auxiliary outputs (leading layer axis).
        """
        groups = self.groups if groups is None else groups
        if self.vary_layers:  # cast per layer, after the cast to varying: the sums stay fp32
            axes = self.vary_layers
            stages = self._layer_sum(axes)
            if sink is not None:  # each copy's share of the mean; written to host one
                # iteration after its exchange, which would else be made to end before it
                stages = (self._layer_shares(axes), lambda g: g)
            if self.layer_stages is not None:
                layer_state = (None, None) if layer_state is None else layer_state
            prepare = lambda p: cast_floating(ensure_varying(p, axes), self.dtype)  # noqa: E731
        elif self.fetch_ahead or sink is not None:
            stages, prepare = (lambda g: g), (lambda p: cast_floating(p, self.dtype))
        else:
            return unbatched_gathers(lambda s, x, b: self.fns.run_blocks(
                cast_floating(s, self.dtype), x, groups, self.fns.model.side(b)))(stacked, x, batch)

        # The custom backward traces each layer itself: its gathers are rewritten there.
        def block(p, h, **side):
            return unbatched_gathers(lambda p, h, side: self.fns.block(p, h, **side))(p, h, side)

        return unbatched_gathers(lambda s, x, b, st, sk: scan_layers(
            block, s, x, groups, self.fns.model.side(b), exchange=stages, prepare=prepare,
            layer_state=st, sink=sk))(stacked, x, batch, layer_state, sink)

    def head(self, head_params, y, batch):
        """The model's head: the mean loss of the rows, float32.

        Args:
          head_params: the head's parameters (`ModelFunctions.head_params`).
          y: the stack's output `(rows, ...)`.
          batch: the batch's arrays.

        Returns:
          A float32 scalar.
        """
        return unbatched_gathers(lambda p, y, b: self.fns.head(
            cast_floating(p, self.dtype), y, b).astype(jnp.float32))(head_params, y, batch)

    def loss_and_metrics(self, params, batch, layer_state=None, sink=None):
        """The mean loss of `batch`, the blocks' auxiliary losses included, and their metrics.

        Args:
          params: the model's tree `{'embed', 'blocks', 'head'}`.
          batch: the batch's arrays.
          layer_state, sink: `blocks`'.

        Returns:
          `(loss, metrics)`: a float32 scalar and the blocks' other auxiliary outputs.
        """
        x = self.embed(params["embed"], batch)
        y, aux = self.blocks(params["blocks"], x, batch, layer_state=layer_state, sink=sink)
        loss = self.head(self.fns.head_params(params), y, batch) + aux_loss(aux)
        return loss, aux_metrics(aux)

    def loss(self, params, batch):
        """The mean loss of `batch`, the blocks' auxiliary losses included.

        Args:
          params: the model's tree `{'embed', 'blocks', 'head'}`.
          batch: the batch's arrays.

        Returns:
          A float32 scalar.
        """
        return self.loss_and_metrics(params, batch)[0]

    def stage(self, layers: int) -> Callable:
        """The stage function of a pipeline chunk of `layers` layers (`parallel.pipeline`'s).

        It runs the plan's decision for every layer (a stage's layers run one program, so a plan
        must be uniform there).

        Args:
          layers: the chunk's layers.

        Returns:
          `(chunk params, x, batch) -> (x, auxiliary loss, metrics)`.
        """
        groups = None if self.groups is None else ((layers, self.groups[0][1]),)

        def run(params, x, batch):
            y, aux = self.blocks(params, x, batch, groups)
            return y, aux_loss(aux), aux_metrics(aux)

        return run
