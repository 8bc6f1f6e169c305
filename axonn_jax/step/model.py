"""A model as the trainer sees it: an embedding, a stack of identical blocks, and a loss head.

The head returns the loss.

`StackedModel(embed, block, head, num_layers)` holds plain Flax modules, linen or NNX:

    embed(batch) -> x          batch: any pytree of arrays with a leading batch axis
    block(x, **side) -> x      `num_layers` times, parameters stacked on a leading layer axis;
                               `side`: the batch entries named by `side_inputs` that the batch
                               holds (e.g. `segment_ids`, `positions` of packed documents)
    block(...) -> (x, aux)     or, a block with auxiliary outputs (a mixture of experts): `aux`
                               a dict of arrays; `aux['loss']` (float32 scalar, weighted) is added
                               to the training loss, the other entries are metrics (per layer)
    head(x, batch) -> loss     a float scalar: the mean loss of the rows of `batch`
    head(x, batch, embed_params) -> loss    with `head_reads_embed` (weight tying: e.g. an
                               output layer that multiplies by the embedding's table)

Its parameters are the tree `{'embed': ..., 'blocks': ..., 'head': ...}`, every leaf of `blocks`
with a leading axis of length `num_layers`. Nothing here knows a model's parameter names: the step
builder (`axonn_jax.step.train_step`) needs only the three functions and their parameter trees,
which `StackedModel.bind` gives, made tensor-parallel with `axonn_jax.parallelize` when the mesh has
tensor axes.

NNX parts are modules (their parameters are their current values; `init`'s key is not used) or
functions `rngs -> Module` (initialized from `init`'s key). The block must be a function, or a
module whose parameters are already stacked on the layer axis (made with `nnx.vmap`), so that every
layer gets its own initial values. Parts may hold `nnx.Param`s only: other state (batch statistics,
caches) would need updating by the trainer, which it does not do.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..config import TENSOR_AXES, Axis
from ..mesh import config_of
from .layer_exchange import layer_runs, scan_exchanging, scan_runs

from ..parallel import context as context_lib
from ..tp.options import DEFAULT, KernelOptions
from ..tp.parallelize import parallelize

PARTS = ("embed", "blocks", "head")


def _abstract(tree):
    """ShapeDtypeStructs of a pytree of arrays (or of ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), tree)


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _refuse_flax_attention_over_context(next_fun, args, kwargs, context):
    """A linen interceptor: Flax's attention modules inside a step whose sequences are split
    over `context` would attend within each device's chunk only; refuse them (ValueError)."""
    if isinstance(context.module, nn.MultiHeadDotProductAttention) and \
            context.method_name == "__call__" and context_lib.axis_size(Axis.CONTEXT) > 1:
        raise ValueError(
            f"{type(context.module).__name__} ('{context.module.name}') would attend within each "
            f"device's chunk of the sequence over --context {context_lib.axis_size(Axis.CONTEXT)}; "
            "call axonn_jax.models.attention.causal_attention(q, k, v) in the block instead")
    return next_fun(*args, **kwargs)


class _LinenPart:
    """A linen module as `init(key, *args) -> params` and `apply(params, *args)`."""

    def __init__(self, module: nn.Module, name: str):
        self.module, self.name = module, name

    def init(self, key, *args, **kwargs):
        variables = self.module.init(key, *args, **kwargs)
        extra = sorted(set(variables) - {"params"})
        if extra:
            raise ValueError(f"StackedModel {self.name}: only 'params' variables are trained, "
                             f"the module also creates {extra}")
        return nn.unbox(variables.get("params", {}))

    def apply(self, params, *args, **kwargs):
        with nn.intercept_methods(_refuse_flax_attention_over_context):
            return self.module.apply({"params": params}, *args, **kwargs)

    def parallelize(self, mesh, kernels: KernelOptions, *args, **kwargs):
        """(the tensor-parallel part, its layers run with the kernels' modes `kernels`;
        PartitionSpecs of its parameters over the tensor axes)."""
        part = _LinenPart(parallelize(self.module, mesh, kernels=kernels), self.name)
        return part, part.specs(*args, **kwargs)

    def specs(self, *args, **kwargs):
        """PartitionSpecs of its parameters from their partitioning metadata (P() where none:
        e.g. a mixture of experts' weights over `expert`)."""
        boxed = jax.eval_shape(lambda k, a, kw: self.module.init(k, *a, **kw), jax.random.key(0),
                               args, kwargs)
        return _specs_or_replicated(nn.get_partition_spec(boxed.get("params", {})))


class _NnxPart:
    """An NNX module (or a function `rngs -> module`) as `init(key, *args)` and `apply`.

    graphdef/abstract: the structure and the parameter shapes of one module (one layer);
    values(key): its parameters as a pure dict (all layers, stacked, for a stacked block).
    """

    def __init__(self, graphdef, abstract, values: Callable, name: str):
        self.graphdef, self.abstract, self.values, self.name = graphdef, abstract, values, name

    @classmethod
    def create(cls, module_or_factory, name: str, num_layers: int = 1) -> "_NnxPart":
        if isinstance(module_or_factory, nnx.Module):
            module = module_or_factory
            values = lambda key: _pure_params(module, name)  # noqa: E731
            one = _single_layer(module, name, num_layers)
        else:
            factory = module_or_factory

            def values(key):
                if num_layers == 1:
                    return _pure_params(factory(nnx.Rngs(key)), name)
                keys = jax.random.split(key, num_layers)
                return jax.vmap(lambda k: _pure_params(factory(nnx.Rngs(k)), name))(keys)

            one = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
        graphdef, abstract = nnx.split(one, nnx.Param)
        return cls(graphdef, abstract, values, name)

    def init(self, key, *args, **kwargs):
        return self.values(key)

    def module(self, params):
        state = jax.tree.map(lambda v: v, self.abstract)  # a fresh State to fill
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def apply(self, params, *args, **kwargs):
        return self.module(params)(*args, **kwargs)

    def parallelize(self, mesh, kernels: KernelOptions, *args, **kwargs):
        tp = parallelize(nnx.merge(self.graphdef, self.abstract), mesh, example_args=args,
                         kernels=kernels)
        graphdef, abstract = nnx.split(tp, nnx.Param)
        part = _NnxPart(graphdef, abstract, self.values, self.name)
        return part, part.specs()

    def specs(self, *args, **kwargs):
        """PartitionSpecs of its parameters from their sharding metadata (P() where none)."""
        specs = nnx.to_pure_dict(nnx.get_partition_spec(self.abstract))
        return jax.tree.map(lambda s: P(*s) if isinstance(s, tuple) else P(), specs,
                            is_leaf=lambda s: s is None or isinstance(s, (tuple, P)))


def _specs_or_replicated(specs):
    """Linen's partition specs with P() for the leaves that carry none."""
    return jax.tree.map(lambda s: s if isinstance(s, P) else P(), specs,
                        is_leaf=lambda s: s is None or isinstance(s, P))


def _pure_params(module: nnx.Module, name: str) -> dict:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    others = {type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(
        x, nnx.Variable))}
    if others:
        raise ValueError(f"StackedModel {name}: only nnx.Param variables are trained, the module "
                         f"also holds {sorted(others)}")
    return nnx.to_pure_dict(params)


def _single_layer(module: nnx.Module, name: str, num_layers: int) -> nnx.Module:
    """An abstract one-layer copy of `module` (its parameters may be stacked on the layer axis)."""
    if num_layers == 1:
        return nnx.eval_shape(lambda: module)
    graphdef, params = nnx.split(module, nnx.Param)
    shapes = [x.shape for x in jax.tree.leaves(params)]
    if not shapes or any(not s or s[0] != num_layers for s in shapes):
        raise ValueError(
            f"StackedModel {name}: an NNX block module must hold its {num_layers} layers' "
            f"parameters stacked on a leading axis (made with nnx.vmap); got parameter shapes "
            f"{shapes}. Pass a function `rngs -> block` instead to create one per layer.")
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    return nnx.merge(graphdef, one)


def _part(module, name: str, num_layers: int = 1):
    if isinstance(module, nn.Module):
        return _LinenPart(module, name)
    if isinstance(module, nnx.Module) or callable(module):
        return _NnxPart.create(module, name, num_layers)
    raise TypeError(f"StackedModel {name}: expected a flax.linen Module, an nnx.Module or a "
                    f"function rngs -> nnx.Module, got {type(module).__name__}")


@dataclasses.dataclass(frozen=True)
class StackedModel:
    """An embedding, `num_layers` identical blocks and a loss head (see the module docstring).

    Attributes:
      embed: the embedding: a linen module, an NNX module or a function `rngs -> nnx.Module`;
        `embed(batch) -> x`.
      block: one block, `block(x, **side) -> x` or `-> (x, aux)`: a linen module, a function
        `rngs -> nnx.Module`, or an NNX module whose parameters are stacked on the layer axis.
      head: the loss head, `head(x, batch) -> loss` (with `head_reads_embed`:
        `head(x, batch, embed_params)`).
      num_layers: how many blocks; a positive integer.
      offload_names: `checkpoint_name`s of a block's intermediates that `remat='offload'` moves
        to host memory (None: the outputs of every matmul without batch dimensions and of every
        tensor-parallel dense layer).
      head_reads_embed: the head is called with the embedding's parameters as a third argument
        (tied weights): they are stored once, in `params['embed']`, and their gradient is the sum
        of both uses.
      side_inputs: the entries of a (dict) batch handed to every block as keyword arguments when
        the batch holds them, or a function `batch -> dict` of them.

    Raises:
      ValueError: when `num_layers` is not a positive integer.
    """

    embed: Any
    block: Any
    head: Any
    num_layers: int
    offload_names: tuple[str, ...] | None = None
    head_reads_embed: bool = False
    side_inputs: tuple[str, ...] | Callable = ()

    def side(self, batch) -> dict:
        """The side inputs of `batch` for the blocks (see the class docstring).

        Args:
          batch: a batch (a dict when `side_inputs` names entries), arrays or ShapeDtypeStructs.

        Returns:
          `{name: entry}` of the `side_inputs` the batch holds, or what the `side_inputs`
          function returns; {} for a batch that is not a dict.
        """
        if callable(self.side_inputs):
            return dict(self.side_inputs(batch))
        if not isinstance(batch, dict):
            return {}
        return {k: batch[k] for k in self.side_inputs if k in batch}

    def __post_init__(self):
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"StackedModel: num_layers must be a positive integer, got "
                             f"{self.num_layers!r}")

    @functools.cached_property
    def _parts(self):
        return (_part(self.embed, "embed"), _part(self.block, "block", self.num_layers),
                _part(self.head, "head"))

    def init(self, key, example_batch) -> dict:
        """Parameters `{'embed', 'blocks', 'head'}` for batches shaped like `example_batch`.

        The plain modules' values (unsplit, identical on every grid); each block's leaves stacked
        on a leading layer axis of length `num_layers`.

        Args:
          key: a JAX random key.
          example_batch: a batch of arrays or ShapeDtypeStructs, each with a leading batch axis.

        Returns:
          The parameter tree.

        Raises:
          ValueError: when a part creates variables besides parameters (linen collections other
            than `params`, NNX variables other than `nnx.Param`), or an NNX block module's
            parameters are not stacked on a leading axis of `num_layers`.
          TypeError: when a part is neither a linen module, an NNX module nor a function.
        """
        return ModelFunctions.of(self, _abstract(example_batch)).init(key)

    def loss(self, params, batch):
        """The mean loss of `batch`: head(blocks(embed(batch)), batch), on one device.

        Args:
          params: the parameters `{'embed', 'blocks', 'head'}` (`init`'s tree).
          batch: a batch of arrays, each with a leading batch axis.

        Returns:
          The float scalar loss, the blocks' auxiliary losses included.
        """
        return ModelFunctions.of(self, _abstract(batch)).loss(params, batch)

    def bind(self, example_batch, mesh=None, kernels: KernelOptions = DEFAULT) -> "ModelFunctions":
        """The model's functions for batches shaped like `example_batch`.

        Tensor-parallel over `mesh`'s `depth, row, col` axes when they hold more than one
        device, or when `kernels.fp8` (the FP8 GEMMs are the tensor-parallel kernel's,
        `tp.fp8`); the tensor-parallel layers run with the modes `kernels`.

        Args:
          example_batch: a batch of arrays or ShapeDtypeStructs, each with a leading batch axis.
          mesh: the mesh (`make_mesh`), or None for the plain modules.
          kernels: the tensor-parallel kernels' modes (`tp.options.KernelOptions`).

        Returns:
          The `ModelFunctions`.

        Raises:
          ValueError: with `kernels.fp8` and a mesh without the axes `depth, row, col`.
        """
        return ModelFunctions.of(self, _abstract(example_batch), mesh, kernels)


def split_aux(out) -> tuple[Any, dict]:
    """A block's output as (x, aux): `aux` is {} for a block without auxiliary outputs.

    Args:
      out: what a block returns: `x`, or `(x, aux)` with `aux` a dict of arrays.

    Returns:
      `(x, aux)`.
    """
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out
    return out, {}


def scan_layers(block: Callable, stacked, x, groups=None, side: dict | None = None,
                exchange: Callable | None = None, prepare: Callable | None = None,
                layer_state=None, sink=None):
    """`x` through the stacked layers, as one `lax.scan` per group of consecutive layers.

    A remat policy is fixed when a scan body is traced, so layers with different decisions need
    different scans; slicing one parameter stack keeps the parameter tree independent of the
    plan. With `exchange` and `prepare`, the backward exchanges each layer's gradients while the
    layer below runs its backward (`step.layer_exchange`). Each layer's output is cast to the
    dtype of its input.

    Args:
      block: `block(layer_params, x, **side) -> x | (x, aux)`.
      stacked: the blocks' parameters, every leaf `(layers, ...)`.
      x: the stack's input, `(rows, ...)`.
      groups: `((count, wrap), ...)`: counts sum to the layers; `wrap` maps the layer function
        to another, e.g. `jax.checkpoint` with a policy; None keeps it. None: one group of all
        layers.
      side: keyword arguments handed to every block (the batch's side inputs), or None.
      exchange: one layer's gradients -> their exchange, e.g. a sum over `data` (or a tuple of
        stages, as `scan_exchanging` takes it); None: plain autodiff.
      prepare: one layer's stored parameters -> what `block` takes (with `exchange`).
      layer_state: an exchange's per-layer state and key, as `scan_exchanging` takes them.
      sink: host stacks for the gradients, as `scan_exchanging` takes them (with `exchange`).

    Returns:
      (x, aux): the stack's output and every aux entry stacked on a leading layer axis ({} for
      blocks without auxiliary outputs).

    Raises:
      ValueError: when the group counts do not cover the stack's layers.
    """
    side = side or {}

    def layer(p, h):
        y, aux = split_aux(block(p, h, **side))
        return y.astype(h.dtype), aux  # activations stay in the dtype they came in

    runs = layer_runs(layer, stacked, groups or ((jax.tree.leaves(stacked)[0].shape[0], None),))
    if exchange is not None:
        return scan_exchanging(runs, stacked, x, exchange, prepare, layer_state, sink)
    return scan_runs(runs, stacked, x)


def _on_mesh(specs, mesh):
    """`specs` without the axes `mesh` lacks or holds once (metadata of a layout for another
    grid, e.g. a mixture of experts' `col`/`row` names without tensor parallelism)."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n and n in mesh.shape and mesh.shape[n] > 1)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda s: P(*(keep(e) for e in s)), specs,
                        is_leaf=lambda s: isinstance(s, P))


@dataclasses.dataclass(frozen=True)
class ModelFunctions:
    """A `StackedModel` bound to a batch shape (and a mesh): its three pure functions.

        embed(params['embed'], batch) -> x
        block(layer_params, x) -> x          one layer's slice of params['blocks']
        head(head_params(params), x, batch) -> scalar loss

    `head_params(params)` is `params['head']`, or `(params['head'], params['embed'])` when the
    head reads the embedding's parameters; `embed_and_head_grads` folds gradients taken with
    respect to it back into the two parts.

    `specs`: PartitionSpecs like the parameters over the tensor axes (`depth, row, col`; the layer
    axis of the blocks unsplit); `activation`: the ShapeDtypeStruct of `x` for the whole batch.
    """

    model: StackedModel
    embed: Callable
    block: Callable
    head: Callable
    specs: dict
    activation: jax.ShapeDtypeStruct
    init: Callable  # key -> params (the plain modules: identical values on every grid)

    @classmethod
    def of(cls, model: StackedModel, batch, mesh=None,
           kernels: KernelOptions = DEFAULT) -> "ModelFunctions":
        """The functions of `model` for batches shaped like `batch` (`StackedModel.bind`).

        Tensor-parallel (`axonn_jax.parallelize`) when `mesh` has the axes `depth, row, col` and
        they hold more than one device, or when `kernels.fp8`; else only what the modules'
        metadata splits (with a mesh, limited to its axes that hold more than one device).

        Args:
          model: the model.
          batch: a batch of ShapeDtypeStructs, each with a leading batch axis.
          mesh: the mesh, or None.
          kernels: the tensor-parallel kernels' modes (`tp.options.KernelOptions`; its FP8
            kernel needs the tensor axes).

        Returns:
          The `ModelFunctions`.

        Raises:
          ValueError: with `kernels.fp8` and a mesh without the axes `depth, row, col`.
        """
        embed, block, head = model._parts
        init_parts = (embed, block, head)
        e_abs = jax.eval_shape(embed.init, jax.random.key(0), batch)
        x = jax.eval_shape(embed.apply, e_abs, batch)
        side = model.side(batch)  # ShapeDtypeStructs
        head_extra = (e_abs,) if model.head_reads_embed else ()
        specs = None
        has_axes = mesh is not None and all(a in mesh.axis_names for a in TENSOR_AXES)
        if kernels.fp8 and not has_axes:
            raise ValueError("fp8 runs the dense layers' tensor-parallel kernel: it needs a mesh "
                             "with axes depth, row, col (make_mesh)")
        tensor = has_axes and (kernels.fp8 or
                               config_of(mesh).tensor_parallel_size > 1)
        if tensor:
            (embed, e_spec), (block, b_spec), (head, h_spec) = (
                embed.parallelize(mesh, kernels, batch),
                block.parallelize(mesh, kernels, x, **side),
                head.parallelize(mesh, kernels, x, batch, *head_extra))
            specs = {"embed": e_spec, "blocks": jax.tree.map(lambda s: P(None, *s), b_spec,
                                                             is_leaf=lambda s: isinstance(s, P)),
                     "head": h_spec}

        def init(key):
            k_embed, k_blocks, k_head = jax.random.split(key, 3)
            b, h = _zeros(batch), _zeros(x)
            part = init_parts[1]
            if isinstance(part, _NnxPart):  # NNX stacks its layers itself (see _NnxPart.create)
                p_blocks = part.init(k_blocks, h)
            else:
                keys = jax.random.split(k_blocks, model.num_layers)
                p_blocks = jax.vmap(lambda k: part.init(k, h, **_zeros(side)))(keys)
            p_embed = init_parts[0].init(k_embed, b)
            extra = (p_embed,) if model.head_reads_embed else ()
            return {"embed": p_embed, "blocks": p_blocks,
                    "head": init_parts[2].init(k_head, h, b, *extra)}

        if specs is None:  # no tensor parallelism: only what the modules' metadata splits
            specs = {"embed": embed.specs(batch),
                     "blocks": jax.tree.map(lambda s: P(None, *s), block.specs(x, **side),
                                            is_leaf=lambda s: isinstance(s, P)),
                     "head": head.specs(x, batch, *head_extra)}
            if mesh is not None:
                specs = _on_mesh(specs, mesh)
        head_apply = head.apply
        if model.head_reads_embed:
            head_apply = lambda hp, y, b: head.apply(hp[0], y, b, hp[1])  # noqa: E731
        return cls(model, embed.apply, block.apply, head_apply, specs, x, init)

    def head_params(self, params):
        """What `head` takes of the model's parameters (see the class docstring).

        Args:
          params: the parameters `{'embed', 'blocks', 'head'}`.

        Returns:
          `params['head']`, or `(params['head'], params['embed'])` with `head_reads_embed`.
        """
        if self.model.head_reads_embed:
            return params["head"], params["embed"]
        return params["head"]

    def embed_and_head_grads(self, g_embed, g_head_params):
        """(embedding gradients, head gradients) from those of `embed`'s and `head_params`' inputs.

        A tied head's gradient of the embedding is added to the embedding's.

        Args:
          g_embed: the gradients of `params['embed']` through `embed`.
          g_head_params: the gradients of `head_params(params)`.

        Returns:
          `(embedding gradients, head gradients)`, like `params['embed']` and `params['head']`.
        """
        if self.model.head_reads_embed:
            g_head, g_tied = g_head_params
            return jax.tree.map(jnp.add, g_embed, g_tied), g_head
        return g_embed, g_head_params

    def run_blocks(self, stacked, x, groups=None, side: dict | None = None):
        """`(x, aux)`: `x` through the stacked blocks (see `scan_layers`).

        Args:
          stacked: `params['blocks']`, every leaf `(layers, ...)`.
          x: the embedding's output, `(rows, ...)`.
          groups: `scan_layers`' groups of layers, or None for one.
          side: the batch's side inputs for the blocks, or None.

        Returns:
          `(x, aux)`: the stack's output and the blocks' aux entries stacked over the layers.
        """
        return scan_layers(self.block, stacked, x, groups, side)

    def loss(self, params, batch, groups=None):
        """The mean loss of `batch`, the blocks' auxiliary losses included.

        Args:
          params: the parameters `{'embed', 'blocks', 'head'}`.
          batch: a batch of arrays shaped like the bound one.
          groups: `scan_layers`' groups of layers, or None for one.

        Returns:
          The float scalar loss: the head's plus the sum of the blocks' `aux['loss']`.
        """
        x = self.embed(params["embed"], batch)
        y, aux = self.run_blocks(params["blocks"], x, groups, self.model.side(batch))
        loss = self.head(self.head_params(params), y, batch)
        return loss + jnp.sum(aux["loss"]) if "loss" in aux else loss
