"""Gradient reducers: the data-parallel mean of the gradients as an `init/reduce` pair.

Like an optax transform, so that every train step differs from another only in the reducer it is
given.

    state = reducer.init(params)                          # None when the reducer keeps nothing
    grads, state = reducer.reduce(grads, state, key)      # the mean over the data-parallel copies
    loss = reducer.mean(loss)                             # an exact mean of a few small values

`key`: the step's random key (`fold_in(TrainState.rng, step)`), for stochastic rounding.
`exact_mean` and `compressed_mean` (CGX, error-feedback residual in its state) run inside the train
step's shard_map, manual over `data`. Reducers between processes (`between_processes=True`, e.g.
`axonn_jax.transport.mpi`) run in a program of their own on one device of each process, after the
step has averaged the gradients over its local devices exactly.

A reducer owns its state everywhere it goes: its placement (`state_spec`), its layout in a
checkpoint (`saved` / `from_saved`), its resharding when a run resumes on another grid
(`reshard`), and the bytes its exchange sends (`wire_bytes`; the collectives behind them, as the
communication model counts them: `exchange_collectives`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import manual_axis_size, pmean, varying_axes
from ..collectives import FP32, Collective
from ..config import Axis, devices_inside
from ..parallel import compression, exchange


def _keep(saved, target):
    return None, ""


class LayerExchange(NamedTuple):
    """A reducer's exchange of the stacked blocks' gradients inside the backward, layer by layer.

    Run by `step.layer_exchange`, with per-layer state.

    Attributes:
      stages: `(axis, one layer's specs) -> stages`: the first takes `(one layer's gradients,
        its state slice or None, its key or None)` and returns `(its value, the new slice or
        None)`, the last returns their mean over axis.
      state_in: `(state, key) -> (the blocks' state stack (layers, ...) or None, key or None)`:
        what the backward takes from this device's reducer state (inside the step's shard_map)
        and the step's key.
      state_out: `(state, new stack) -> state`: the new stack placed.
    """

    stages: Callable
    state_in: Callable
    state_out: Callable


def exact_wire_bytes(shards, reduce_dtype: str = "float32") -> float:
    """Bytes one device sends in the exact exchange of gradient shards.

    Counted as 2 · (bytes of `reduce_dtype`) per element: a ring all-reduce's reduce-scatter
    share plus its all-gather's for a large group (the bfloat16 exchange's all-to-all and
    all-gather send as much).

    Args:
      shards: a pytree of arrays or ShapeDtypeStructs, one device's pieces of the gradients.
      reduce_dtype: the dtype the exchange sends (`float32` or `bfloat16`).

    Returns:
      The bytes, as a float.
    """
    itemsize = jnp.dtype(reduce_dtype).itemsize
    return float(sum(2 * itemsize * s.size for s in jax.tree.leaves(shards)))


class GradientReducer(NamedTuple):
    """The data-parallel mean of the gradients, with its state, as functions (see the module).

    Attributes:
      init: `init(params) -> state | None`.
      reduce: `reduce(grads, state, key) -> (grads, state)`: the mean over the data-parallel
        copies; `key` is the step's random key, for stochastic rounding.
      mean: `mean(tree) -> tree`, exact (the loss, the metrics).
      state_spec: `state_spec(param_spec) -> spec` of the state leaf of that parameter.
      saved: the state as checkpoints hold it (identity unless the state lives in several
        processes).
      from_saved: the inverse of `saved`.
      reshard: `reshard(saved, target) -> (state | None, note)`: a saved state whose shapes
        differ from `target`'s (ShapeDtypeStructs with shardings: this run's) made into this
        run's, or None to start afresh; `note` says what was done.
      wire_bytes: `wire_bytes(shards)`: bytes one device sends to reduce gradient shards of these
        shapes.
      between_processes: runs between processes on one device each (see the module docstring).
      process_index: this process's place among them (which rows of each global batch it
        trains on).
      process_count: how many processes there are.
      layer_exchange: how the blocks' gradients are reduced inside the backward when the engine
        does that (`LayerExchange`; None: the exact sum); `reduce` then gets them already
        reduced (invariant over the axis) and passes them through.
    """

    init: Callable[[Any], Any]
    reduce: Callable[[Any, Any, Any], tuple[Any, Any]]
    mean: Callable[[Any], Any]
    state_spec: Callable[[P], P] = lambda spec: spec
    saved: Callable[[Any], Any] = lambda state: state
    from_saved: Callable[[Any], Any] = lambda state: state
    reshard: Callable[[Any, Any], tuple[Any, str]] = _keep
    wire_bytes: Callable[[Any], float] = exact_wire_bytes
    between_processes: bool = False
    process_index: int = 0
    process_count: int = 1
    layer_exchange: LayerExchange | None = None


def exact_mean(axis: str = Axis.DATA, reduce_dtype: str = "float32",
               grad_specs=None) -> GradientReducer:
    """The exact mean over the mesh axis `axis`, sending `reduce_dtype`; no state.

    A gradient already summed over `axis` (invariant over it: the engine reduced it layer by
    layer) is only divided.

    Args:
      axis: the mesh axis of the data-parallel copies.
      reduce_dtype: the dtype the exchange sends (`parallel.exchange`).
      grad_specs: PartitionSpecs like the gradients, how the other mesh axes split them, or None.

    Returns:
      The `GradientReducer`, run inside the step's shard_map (manual over `axis`).
    """
    return GradientReducer(
        init=lambda params: None,
        reduce=lambda grads, state, key: (
            _mean_of_sums(grads, axis, reduce_dtype, grad_specs), state),
        mean=lambda tree: pmean(tree, axis),
        wire_bytes=lambda shards: exact_wire_bytes(shards, reduce_dtype))


def _mean_of_sums(grads, axis: str, reduce_dtype: str, grad_specs=None):
    """Every gradient's mean over `axis`: summed (those still varying over it) and divided by its
    size, 16-bit ones before they are cast back. One exchange per part of a dict (a model's
    `embed`, `blocks`, `head`): each can start as soon as the backward has produced its part, the
    head's while the layers' backward still runs."""
    if isinstance(grads, dict) and len(grads) > 1:
        return {k: _mean_of_sums(g, axis, reduce_dtype, None if grad_specs is None else
                                 grad_specs[k]) for k, g in grads.items()}
    size = manual_axis_size(axis)
    leaves, treedef = jax.tree.flatten(grads)
    varying = [i for i, g in enumerate(leaves) if axis in varying_axes(g)]
    if grad_specs is not None:
        spec_leaves = jax.tree.leaves(grad_specs, is_leaf=lambda s: isinstance(s, P))
        grad_specs = [spec_leaves[i] for i in varying]
    means = exchange.sum_over([leaves[i] for i in varying], axis, reduce_dtype, grad_specs,
                              divide_by=size)
    out = dict(zip(varying, means))
    return jax.tree.unflatten(treedef, [out[i] if i in out else g / size
                                        for i, g in enumerate(leaves)])


def resplit_residual(residual, shards: int):
    """CGX error-feedback residuals re-split onto another number of shards, same total correction.

    Every shard adds its residual to its gradient before the mean, so what the residuals still
    owe the mean is sum(residuals) / shards.

    Args:
      residual: `[old shards, *shape]`, one per data-parallel device.
      shards: the new number of shards.

    Returns:
      `[shards, *shape]`: the mean of each group of old shards when `shards` divides their
      number, each old shard repeated when their number divides `shards`; None when neither
      divides the other.
    """
    old = residual.shape[0]
    if old % shards == 0:
        return residual.reshape(shards, old // shards, *residual.shape[1:]).mean(axis=1)
    if shards % old == 0:
        return jnp.repeat(residual, shards // old, axis=0)
    return None


def reshard_residuals(saved, target) -> tuple[Any, str]:
    """`GradientReducer.reshard` of residuals `[shards, *shape]`, re-split onto the target's shards.

    Args:
      saved: the saved residuals, leaves `[old shards, *shape]`.
      target: ShapeDtypeStructs with shardings, leaves `[shards, *shape]` (this run's).

    Returns:
      `(residuals, note)`: the residuals re-split (`resplit_residual`) and placed like the
      target, or None (reset to zero) when a re-split is impossible; `note` says which.
    """
    old = jax.tree.leaves(saved)[0].shape[0]
    new = jax.tree.leaves(target)[0].shape[0]
    parts = [resplit_residual(r, new) for r in jax.tree.leaves(saved)]
    if any(p is None for p in parts):
        return None, (f"error-feedback residuals of {old} data-parallel shards cannot be "
                      f"re-split into {new}; reset to zero")
    placed = jax.tree.map(lambda r, t: jax.device_put(r, t.sharding),
                          jax.tree.unflatten(jax.tree.structure(target), parts), target)
    return placed, f"error-feedback residuals re-split from {old} to {new} data-parallel shards"


STACKED = ("blocks",)
"""The parts of a `StackedModel`'s parameters that stack layers on their leading axis: CGX's
size filter looks at one layer of them."""


def compressed_wire_bytes(bits: int, bucket_size: int,
                          min_size: int = compression.DEFAULT_MIN_SIZE,
                          overrides=None, node_shards: int = 1) -> Callable[[Any], float]:
    """`GradientReducer.wire_bytes` of CGX: packed values, a scale and an offset per bucket.

    For the shards the rules compress (`compression.bits_for_leaf` with `min_size` and
    `overrides`, each at its own width); the rest exact.

    Args:
      bits: the default width of a compressed value.
      bucket_size: elements per bucket.
      min_size: tensors below this many elements (and 1-D ones) stay exact.
      overrides: the parsed `PATTERN=BITS` rules (`compression.parse_rules`), or None.
      node_shards: shards per node under scope `inter-node` (1: `all`), whose compressed tensors
        are reduce-scattered exactly inside the node, each shard's `1 / node_shards` sent
        compressed, the packed result all-gathered.

    Returns:
      `wire(shards) -> bytes` one device sends for a pytree of gradient shards.
    """
    def wire(shards) -> float:
        sent = 0.0
        widths = compression.leaf_widths(shards, bits, min_size, overrides, STACKED)
        for s, (_, width) in zip(jax.tree.leaves(shards), widths):
            if not width:
                sent += s.size * 2 * s.dtype.itemsize
                continue
            packed = compression.bucket_bytes(width, bucket_size, s.dtype.itemsize) / bucket_size
            inside = (node_shards - 1) / node_shards * s.dtype.itemsize
            sent += s.size * (inside + packed / node_shards + packed)
        return sent

    return wire


def node_shards(mesh, axis: str = Axis.DATA, node_size: int | None = None) -> int:
    """Shards of the mesh axis `axis` inside one node.

    `node_size` devices per node over the devices the axes inside `axis` hold (mesh order: those
    axes change fastest across device ids).

    Args:
      mesh: the step's mesh.
      axis: the data-parallel mesh axis.
      node_size: devices per node (None: 8 on GPUs, an H100 node; on CPU the devices of the
        mesh's first process).

    Returns:
      The number of `axis`'s shards inside one node, at least 1.

    Raises:
      ValueError: (one line) where nodes split the axis's devices unevenly or the whole axis fits
        in one node (nothing would cross nodes).
    """
    devices = list(mesh.devices.flat)
    if node_size is None:
        node_size = 8 if devices[0].platform != "cpu" else sum(
            d.process_index == devices[0].process_index for d in devices)
    inner = devices_inside(dict(mesh.shape), axis)
    size = int(mesh.shape[axis])
    shards = max(1, node_size // inner)
    if node_size < 1 or node_size % inner and inner % node_size or size % shards:
        raise ValueError(f"compression scope inter-node: nodes of {node_size} devices do not "
                         f"split {axis}={size} (over {inner} devices each) evenly")
    if shards >= size:
        raise ValueError(f"compression scope inter-node: {axis}={size} fits in one node of "
                         f"{node_size} devices, nothing crosses nodes (use --compress-scope all "
                         f"or set --compress-node-size)")
    return shards


def compressed_mean(mesh, grad_specs, *, bits: int, bucket_size: int = compression.DEFAULT_BUCKET_SIZE,
                    error_feedback: bool = True, axis: str = Axis.DATA,
                    min_size: int = compression.DEFAULT_MIN_SIZE, rules=(),
                    rounding: str = "auto", in_backward: bool = True, scope: str = "all",
                    node_size: int | None = None) -> GradientReducer:
    """CGX: the mean over `axis` with every device's gradient shard quantized to `bits` bits.

    In buckets of `bucket_size` (see `parallel.compression.sharded_compressed_pmean`). With
    `error_feedback` the state is each device's residual: leaves `[size of axis, *param.shape]`,
    split over `axis` and like the parameter; without it the state is None.

    Args:
      mesh: the step's mesh.
      grad_specs: PartitionSpecs like the gradients, how the other mesh axes split them (each
        device compresses only its own shard).
      bits: the default width of a compressed value.
      bucket_size: elements per bucket (one scale and offset each).
      error_feedback: keep each device's residual and add it to the next step's gradient.
      axis: the data-parallel mesh axis.
      min_size: tensors below this many elements (and 1-D ones) stay exact (CGX's filter).
      rules: `PATTERN=BITS` strings (`compression.parse_rule`), the first whose regular
        expression is found in a parameter's '/'-joined path sets its width (`exact`: not
        compressed); other tensors follow CGX's filter.
      rounding: one of `compression.ROUNDINGS`: `auto` rounds to nearest with error feedback
        (measured better than stochastic with feedback at 2 bits) and stochastically without
        (which keeps the mean unbiased); stochastic noise comes from the step's key, so a run is
        reproducible.
      in_backward: offer the engine the blocks' exchange layer by layer inside the backward
        (`layer_exchange`: the same rules, each layer's residual, the key folded with the layer
        index); the engine uses it where it runs the exact exchange there too.
      scope: one of `compression.SCOPES`: `inter-node` sums each node's gradients exactly and
        compresses only between nodes of `node_size` devices (`node_shards`; the residuals keep
        their shape, each nonzero on the share its device quantizes:
        `compression.compressed_psum`).
      node_size: devices per node under `inter-node` (`node_shards`' default when None).

    Returns:
      The `GradientReducer`, run inside the step's shard_map (manual over `axis`).

    Raises:
      ValueError: on invalid `bits`, `bucket_size`, `scope`, `rules` or `rounding`, and as
        `node_shards` does under `inter-node`.
    """
    compression.check_args(bits, bucket_size)
    compression.check_scope(scope)
    overrides = compression.parse_rules(rules)
    stochastic = compression.stochastic(rounding, error_feedback)
    shards = int(mesh.shape[axis])
    local = node_shards(mesh, axis, node_size) if scope == "inter-node" else 1
    options = dict(bits=bits, bucket_size=bucket_size, min_size=min_size, overrides=overrides,
                   node_size=local if local > 1 else None)

    def init(params):
        return compression.init_residual(params, shards) if error_feedback else None

    def reduce(grads, residual, key):
        # Parts already reduced in the backward (invariant over `axis`) pass through; their
        # residuals were placed by `layer_exchange.state_out`.
        done = {k for k, g in grads.items() if not any(
            axis in varying_axes(a) for a in jax.tree.leaves(g))} if isinstance(grads, dict) else ()
        rest = {k: g for k, g in grads.items() if k not in done} if done else grads
        pick = (lambda t: {k: t[k] for k in rest}) if done else (lambda t: t)  # noqa: E731
        local = None if residual is None else jax.tree.map(lambda r: r[0], pick(residual))
        reduced, local = compression.sharded_compressed_pmean(
            rest, pick(grad_specs), mesh, axis, stacked=STACKED,
            key=key if stochastic else None, residual=local, **options)
        new = None if local is None else jax.tree.map(lambda r: r[None], local)
        if not done:
            return reduced, new
        return ({**grads, **reduced},
                None if residual is None else {**residual, **new})

    def layer_stages(axis_name, layer_specs):
        # The paths and size rule of the blocks' leaves as the whole-tree reducer sees them.
        scatter, gather = compression.sharded_compressed_stages(
            {"blocks": layer_specs}, None, axis_name, mean=True, **options)

        def first(g, r, k):
            value, new = scatter({"blocks": g}, None if r is None else {"blocks": r}, k)
            return value, None if new is None else new["blocks"]

        def last(value):
            return gather(value)["blocks"]

        return first, last

    layer = LayerExchange(
        layer_stages,
        state_in=lambda state, key: (
            None if state is None else jax.tree.map(lambda r: r[0], state["blocks"]),
            key if stochastic else None),
        state_out=lambda state, new: state if new is None else {
            **state, "blocks": jax.tree.map(lambda r: r[None], new)})
    return GradientReducer(init, reduce, mean=lambda tree: pmean(tree, axis),
                           state_spec=lambda spec: P(axis, *spec), reshard=reshard_residuals,
                           wire_bytes=compressed_wire_bytes(bits, bucket_size, min_size,
                                                            overrides, local),
                           layer_exchange=layer if in_backward else None)


def exchange_collectives(shards, parts: int, *, bits: int = 0, param_bytes: int = 4,
                         reduce_dtype: str = "float32", piece_bytes: int = 2,
                         bucket_size: int = compression.DEFAULT_BUCKET_SIZE,
                         min_size: int = compression.DEFAULT_MIN_SIZE,
                         axis: str = Axis.DATA, layers: int = 1,
                         node_shards: int = 1) -> list[Collective]:
    """The collectives one device issues to reduce its gradient shards over `axis`.

    `exact_mean`'s (`bits` 0): an all-reduce of `param_bytes` per element in float32, or with
    `reduce_dtype` bfloat16 an all-to-all and an all-gather of `piece_bytes` per element
    (`parallel.exchange`); or `compressed_mean`'s (CGX, each device compressing its own shards):
    the shards the size rule compresses (`compression.bits_for_leaf`) padded to whole buckets
    (`compression.bucket_bytes` each) and the buffer to `parts` shards, sent by an all-to-all and
    gathered back; the others in an exact all-reduce.

    Args:
      shards: the `collectives.ParameterShard`s one device holds.
      parts: the devices of `axis`.
      bits: CGX's width (0: the exact exchange).
      param_bytes: the bytes of one parameter element.
      reduce_dtype: the exact exchange's dtype (`float32` or `bfloat16`).
      piece_bytes: the bytes per element of the bfloat16 exchange's pieces (4 where XLA:CPU runs
        them in float32).
      bucket_size: CGX's elements per bucket.
      min_size: CGX's size filter (tensors below it stay exact).
      axis: the data-parallel mesh axis.
      layers: how many layers a block shard (not `outside_blocks`) stacks; the size rule looks
        at one, as the reducer does (`STACKED`).
      node_shards: `compressed_mean`'s shards per node under scope `inter-node`
        (`_inter_node_collectives`; `parts`: one node, nothing compressed).

    Returns:
      The `Collective`s, per device and step.
    """
    if node_shards == parts:
        bits = 0
    if not bits:
        exchanged = sum(s.elements if s.exchanged is None else s.exchanged for s in shards)
        if reduce_dtype == "bfloat16":
            return [Collective("all-to-all", (axis,), exchanged * piece_bytes),
                    Collective("all-gather", (axis,), exchanged * piece_bytes)]
        return [Collective("all-reduce", (axis,), exchanged * param_bytes)]
    widths = [compression.bits_for_leaf("", _one_layer(s, layers), bits, min_size)
              for s in shards]
    exact = sum(s.elements for s, w in zip(shards, widths) if not w)
    if node_shards > 1:
        return _inter_node_collectives([s for s, w in zip(shards, widths) if w], parts,
                                       node_shards, bits, bucket_size, param_bytes, axis,
                                       layers) + [
            Collective("all-reduce", (axis,), exact * param_bytes)]
    buckets = sum(math.ceil(s.elements / bucket_size) for s, w in zip(shards, widths) if w)
    packed = math.ceil(buckets / parts) * parts * compression.bucket_bytes(bits, bucket_size,
                                                                            param_bytes)
    return [Collective("all-to-all", (axis,), packed), Collective("all-gather", (axis,), packed),
            Collective("all-reduce", (axis,), exact * param_bytes)]


def _inter_node_collectives(shards, parts: int, node_shards: int, bits: int, bucket_size: int,
                            param_bytes: int, axis: str, layers: int = 1) -> list[Collective]:
    """The compressed shards' collectives under scope `inter-node`: each tensor padded to whole
    chunks, one per shard of a node, reduce-scattered exactly inside the node (a group of
    `node_shards` neighbours); the chunks in whole buckets, each buffer in whole parts per node,
    sent by an all-to-all between the `parts / node_shards` nodes; the packed result all-gathered
    between the nodes (each place's share), then inside each node. A block shard is exchanged
    layer by layer (inside the backward: one buffer per layer), the others in one buffer."""
    nodes = parts // node_shards
    elements, parts_sent = 0, 0  # reduce-scattered elements; buckets sent, buffers padded
    per_layer = [s for s in shards if _one_layer(s, layers) is not s]
    for group, count in ((per_layer, layers), ([s for s in shards if s not in per_layer], 1)):
        chunks = [math.ceil(s.elements / count / node_shards) for s in group]
        elements += count * node_shards * sum(chunks)
        parts_sent += count * math.ceil(sum(math.ceil(c / bucket_size) for c in chunks) / nodes)
    packed = parts_sent * nodes * compression.bucket_bytes(bits, bucket_size, param_bytes)
    return [Collective("reduce-scatter", (axis,), elements * param_bytes,
                       group_size=node_shards, span=node_shards),
            Collective("all-to-all", (axis,), packed, group_size=nodes),
            Collective("all-gather", (axis,), packed, group_size=nodes),
            Collective("all-gather", (axis,), packed * node_shards, group_size=node_shards,
                       span=node_shards)]


class _Layer(NamedTuple):
    ndim: int
    size: float


def _one_layer(shard, layers: int):
    """What the size rule sees of a block shard stacking `layers` layers: one of them."""
    if getattr(shard, "outside_blocks", True) or layers <= 1 or shard.ndim < 1:
        return shard
    return _Layer(shard.ndim - 1, shard.elements / layers)


def scalar_collectives(shards, grid) -> list[Collective]:
    """The all-reduces of the step's scalars on one device: the loss and the gradient norm's sums.

    The loss averaged over the batch (over depth by the engine, over data by the reducer's
    `mean`), and the gradient's squared norm: one float32 partial sum per parameter shard and per
    split dimension, over that dimension's axes. (XLA may add the partial sums of one group of
    devices before reducing them, fusing a few of these: the count is an upper bound, exact within
    a few scalars.)

    Args:
      shards: the `collectives.ParameterShard`s one device holds.
      grid: the run's `ParallelConfig`.

    Returns:
      The float32 `all-reduce` `Collective`s: two for the loss, then one per group of axes with
      the count of partial sums over it.
    """
    per_group: dict[tuple[str, ...], int] = {}
    for p in shards:
        for axes in p.splits:
            axes = tuple(a for a in axes if getattr(grid, a) > 1)
            if axes:
                per_group[axes] = per_group.get(axes, 0) + 1
    loss = [Collective("all-reduce", (Axis.DEPTH,), FP32),
            Collective("all-reduce", (Axis.DATA,), FP32)]
    return loss + [Collective("all-reduce", axes, FP32, n) for axes, n in per_group.items()]
