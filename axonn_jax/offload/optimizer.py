"""Where the optimizer state lives: on the device, or in host memory (AxoNN).

Both are a `ParamUpdate`: how the update phase of a step turns gradients into new parameters with
an optax transformation `tx` (`step.update` builds the chain: unscale, clip, skip-if-non-finite,
the optimizer), and where the state of `tx` is kept.

- `on_device(tx)`: `tx`'s state placed like its parameters; `optax.apply_updates`.
- `host_offload(tx, ...)`: fp32 master weights and `tx`'s state in `pinned_host` memory; the
  parameters the model computes with (`params`, in the compute dtype: bf16 / fp16 / fp32) stay in
  device memory, sharded as the model shards them. Its state is `{'master', 'inner'}`: the fp32
  masters and `tx`'s state, each leaf with the sharding of its parameter, and with data
  parallelism split over `data` as well (ZeRO-Offload, `partition_spec`): each data-parallel
  copy holds, streams and updates 1/D of the host state, and the new parameters in the compute
  dtype are all-gathered over `data`, each piece as the update writes it (laid out like its
  parameter: `apply`'s `param_shardings`). The state's shared scalars (Adam's `count`) stay on
  the device.

The offloaded update streams the host state through the device in pieces: one `fori_loop`
iteration per layer of the stacked `blocks` parameters (leading layer axis), then buckets of at most
`bucket_bytes` of the other parameters. With pipeline stages the layer axis is split over `pipe`,
so iteration `i` updates layer `i` of every stage at once (the stack viewed as `(stages, layers per
stage, …)`) and no state crosses between stages. Each piece is `device_put` to the device, run
through `tx`, and put back to `pinned_host`, so the compiled program holds one piece of fp32 state
on the device at a time and XLA can overlap the transfers of one piece with the arithmetic of the
next. So `tx` must be elementwise apart from shared scalars (AdamW is): what needs the whole
gradient tree (its global norm, whether it is finite) reaches it as an extra argument computed once
(`step.update`), and no full fp32 copy of the gradients is ever made.

On CPU, `device_put` inside `jit` lowers to nothing (JAX 0.10 emits the placement annotations only
for GPU/TPU); host and device share memory there. `lowered_for_gpu` lowers a step for CUDA so its
per-piece transfers can be inspected without a GPU.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from .._compat import HOST_MEMORY_KIND, in_host_memory, with_memory_kind
from ..checks import NOT_YET
from ..batch_axis import DATA
from ..config import AXES, TENSOR_AXES
from ..parallel.exchange import spec_axes

DEFAULT_BUCKET_BYTES = 256 * 2**20


class ParamUpdate(NamedTuple):
    """The update phase's parameters and optimizer state.

    init(fp32 params) -> (params, opt_state): the parameters the model computes with and the
      optimizer state of `tx`.
    apply(grads, opt_state, params, param_shardings=None, **extra) -> (params, opt_state): one
      step of `tx` (param_shardings: the parameters' NamedShardings, which a piece-wise update
      lays its new pieces out by; extra: the chain's extra arguments, e.g. `loss_scale`,
      `grad_norm`, `finite`).
    state_shardings(opt_state, param_shardings) -> shardings of `opt_state` (arrays or
      ShapeDtypeStructs).
    canonical(params, opt_state) -> (params, opt_state) as checkpoints hold them (fp32
      parameters, `tx`'s state); `from_canonical(params, opt_state)` back (ShapeDtypeStructs too).
    """

    init: Callable
    apply: Callable
    state_shardings: Callable
    canonical: Callable = lambda params, opt_state: (params, opt_state)
    from_canonical: Callable = lambda params, opt_state: (params, opt_state)


def _replicated_like(param_shardings):
    any_sharding = jax.tree.leaves(param_shardings)[0]
    return NamedSharding(any_sharding.mesh, P())


def on_device(tx: optax.GradientTransformation) -> ParamUpdate:
    """`tx` with its state on the device, each leaf placed like its parameter.

    A state leaf shaped otherwise (e.g. a count) is replicated.

    Args:
      tx: an optax transformation.

    Returns:
      The `ParamUpdate`.
    """
    def init(params):
        return params, tx.init(params)

    def apply(grads, opt_state, params, param_shardings=None, **extra):
        del param_shardings  # the update is laid out like its operands
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        return optax.apply_updates(params, updates), opt_state

    def state_shardings(opt_state, param_shardings):
        replicated = _replicated_like(param_shardings)
        shapes = jax.tree.map(lambda s: s, param_shardings)
        return optax.tree_map_params(
            tx, lambda leaf, sharding: sharding, opt_state, shapes,
            transform_non_params=lambda _: replicated)

    return ParamUpdate(init, apply, state_shardings)


def host_offload(tx: optax.GradientTransformation, compute_dtype, num_layers: int,
                 num_stages: int = 1, stacked_key: str = "blocks",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, partition_axis: str | None = None,
                 partition_size: int = 1) -> ParamUpdate:
    """`tx` streamed per piece over fp32 masters and state in `pinned_host`.

    See the module docstring.

    Args:
      tx: an optax transformation, elementwise apart from shared scalars.
      compute_dtype: dtype of the device parameters (the model's compute dtype).
      num_layers: length of the leading axis of the stacked `stacked_key` parameters.
      num_stages: pipeline stages the layer axis is split over (`pipe`); each loop iteration
        updates one layer per stage.
      stacked_key: the top-level key of the stacked layer parameters.
      bucket_bytes: the most fp32 master bytes one streamed piece holds (`buckets`).
      partition_axis: a mesh axis the parameters are replicated over (`data`).
      partition_size: its size; above 1, each host-resident leaf is split over it as well
        (ZeRO-Offload: each copy streams and updates its share, `partition_spec`) and the new
        device parameters are all-gathered over it.

    Returns:
      The `ParamUpdate`.
    """
    offload = _Streamed(tx, compute_dtype, num_layers, num_stages, stacked_key, bucket_bytes,
                        partition_axis if partition_size > 1 else None, partition_size)
    return ParamUpdate(offload.init, offload.apply, offload.state_shardings,
                       offload.canonical, offload.from_canonical)


class _Role:
    """Marks a leaf of the optimizer state: the index of the parameter it belongs to, or None for a
    shared scalar such as `count` (a plain object, so it stays a pytree leaf)."""

    def __init__(self, param: int | None):
        self.param = param


def _without_axis(sharding: NamedSharding, axis: str | None) -> NamedSharding:
    """`sharding` with mesh `axis` (if any) removed from its spec (memory kind not kept)."""
    if axis is None:
        return sharding
    drop = lambda e: (None if e == axis else e) if not isinstance(e, tuple) else \
        tuple(a for a in e if a != axis) or None
    return NamedSharding(sharding.mesh, P(*(drop(e) for e in sharding.spec)))


def _on_device(x, dtype, axis: str | None = None):
    """`x` (e.g. a host-resident fp32 master) as `dtype` in device memory, split like `x` except
    over `axis` (the axis `host_offload` partitions its state over, not its parameters)."""
    sharding = with_memory_kind(_without_axis(x.sharding, axis), "device")
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)
    return jax.device_put(x, sharding).astype(dtype)


def _none_is_leaf(x) -> bool:
    return x is None


def _roles(inner: optax.GradientTransformation, state, params) -> list[_Role]:
    """One `_Role` per leaf of `state` (in `jax.tree.leaves` order)."""
    index = jax.tree.unflatten(jax.tree.structure(params), range(len(jax.tree.leaves(params))))
    roles = optax.tree_map_params(inner, lambda _, j: _Role(j), state, index,
                                  transform_non_params=lambda _: _Role(None))
    return jax.tree.leaves(roles, is_leaf=lambda x: isinstance(x, _Role))


def stacked_mask(params, key: str, num_layers: int) -> list[bool]:
    """Per parameter leaf: True for leaves under `key` whose leading axis is the layer axis.

    Args:
      params: the parameter pytree.
      key: the top-level key of the stacked layers.
      num_layers: the length of the layer axis.

    Returns:
      One flag per leaf, in `tree_flatten` order.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [bool(path) and getattr(path[0], "key", None) == key and x.ndim >= 1
            and x.shape[0] == num_layers for path, x in flat]


def partition_spec(spec: P, shape: tuple[int, ...], axis: str, size: int, skip: int,
                   axis_sizes: dict[str, int] | None = None) -> P:
    """`spec` with `axis` added on the dimension with the most elements per device it divides.

    A dimension another axis splits takes `axis` too (the pair as a tuple) where `size` still
    divides its share: on a tensor-parallel grid every dimension names a tensor axis, of one
    device or more.

    Args:
      spec: the parameter's PartitionSpec (not naming `axis`).
      shape: the parameter's global shape.
      axis, size: the mesh axis to add and its size.
      skip: leading dimensions never split over `axis` (a stack's layer axis, which the
        update loop indexes).
      axis_sizes: the mesh's axis sizes (None: a dimension another axis names is not split
        further).

    Returns:
      The host copy's spec; `spec` itself where no dimension qualifies (a small leaf stays
      replicated over `axis`).
    """
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    names = [() if e is None else e if isinstance(e, tuple) else (e,) for e in entries]
    shares = [shape[d] // math.prod((axis_sizes or {}).get(n, 1) for n in names[d])
              for d in range(len(shape))]
    free = [d for d in range(skip, len(shape)) if (axis_sizes is not None or not names[d])
            and shape[d] % (shape[d] // shares[d] * size) == 0]
    if not free:
        return spec
    best = max(free, key=lambda d: shares[d])
    entry = axis if not names[best] else (*names[best], axis)
    return P(*entries[:best], entry, *entries[best + 1:])


def share_dimension(spec: P, shape: tuple[int, ...], axis: str, axis_sizes: dict[str, int],
                    skip: int = 0) -> int | None:
    """The dimension `axis` splits the offloaded state of an otherwise unsplit parameter on.

    Unsplit: no other axis of more than one device splits the parameter. Then a shard_map manual
    over `axis` alone holds each copy's share of the state as a block of its own
    (`--offload-gradients` writes each copy's share of a gradient there). A parameter a tensor
    axis splits has none (`partition_spec` may pair `axis` with that axis; the communication
    model, which does not know the parameter's dimensions, could not tell), nor one that no
    dimension of which `axis` divides.

    Args:
      spec: the parameter's PartitionSpec (not naming `axis`).
      shape: its global shape.
      axis: the axis the state is split over (`data`).
      axis_sizes: the mesh's axis sizes.
      skip: leading dimensions never split (a stack's layer axis).

    Returns:
      The dimension, or None.
    """
    if any(axis_sizes.get(n, 1) > 1 for n in spec_axes(spec)):
        return None
    host = partition_spec(spec, shape, axis, axis_sizes[axis], skip, axis_sizes)
    return next((d for d, entry in enumerate(host) if axis in spec_axes((entry,))), None)


def buckets(sizes: list[int], indices: list[int], bucket_bytes: int) -> list[list[int]]:
    """Group parameter `indices` greedily, in order, into lists of at most `bucket_bytes` bytes.

    Args:
      sizes: each leaf's fp32 master bytes, by leaf index.
      indices: the leaves to group, in order.
      bucket_bytes: the most bytes of one bucket.

    Returns:
      The buckets; a leaf larger than a bucket is a bucket of its own.
    """
    groups: list[list[int]] = []
    used = 0
    for i in indices:
        if groups and used + sizes[i] <= bucket_bytes:
            groups[-1].append(i)
            used += sizes[i]
        else:
            groups.append([i])
            used = sizes[i]
    return groups


@dataclasses.dataclass(frozen=True)
class _Streamed:
    """`host_offload`'s parts (see there)."""

    inner: optax.GradientTransformation
    compute_dtype: Any
    num_layers: int
    num_stages: int
    stacked_key: str
    bucket_bytes: int
    partition_axis: str | None = None
    partition_size: int = 1

    def init(self, params):
        """fp32 `params` -> (device params in `compute_dtype`, opt_state {'master', 'inner'})."""
        master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        device = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        return device, {"master": master, "inner": self.inner.init(master)}

    def state_shardings(self, opt_state, param_shardings):
        """Shardings of `opt_state` (arrays or ShapeDtypeStructs): master and per-parameter moments
        on `pinned_host` with the sharding of their parameter (split over `partition_axis` as
        well, `partition_spec`); shared scalars replicated on device."""
        host = jax.tree.map(lambda s: with_memory_kind(s, HOST_MEMORY_KIND),
                            self._partitioned(opt_state["master"], param_shardings))
        scalar = _replicated_like(param_shardings)
        inner = optax.tree_map_params(self.inner, lambda _, s: s, opt_state["inner"], host,
                                      transform_non_params=lambda _: scalar)
        return {"master": host, "inner": inner}

    def _partitioned(self, master, param_shardings):
        """The parameters' shardings, split over `partition_axis` where one is set."""
        if self.partition_axis is None:
            return param_shardings
        leaves, treedef = jax.tree.flatten(param_shardings)
        stacked = stacked_mask(master, self.stacked_key, self.num_layers)
        shapes = [x.shape for x in jax.tree.leaves(master)]
        return jax.tree.unflatten(treedef, [
            NamedSharding(s.mesh, partition_spec(s.spec, shape, self.partition_axis,
                                                 self.partition_size, int(k),
                                                 dict(s.mesh.shape)))
            for s, shape, k in zip(leaves, shapes, stacked)])

    def canonical(self, params, opt_state):
        """(fp32 masters, `tx`'s state): the tree of a run without offload."""
        return opt_state["master"], opt_state["inner"]

    def from_canonical(self, master, inner):
        """Back from `canonical`: the device parameters are made from the masters."""
        return jax.tree.map(lambda m: _on_device(m, self.compute_dtype, self.partition_axis),
                            master), \
            {"master": master, "inner": inner}

    def apply(self, grads, opt_state, params, param_shardings=None, **extra):
        """One step of `tx` over the streamed pieces. grads: like `params` (compute dtype; in
        host memory too, `--offload-gradients`: streamed in with the state); param_shardings:
        the parameters' NamedShardings (None: their layout is left to GSPMD); extra: `tx`'s
        extra arguments. Returns (params, opt_state)."""
        param_leaves, param_def = jax.tree.flatten(params)
        state_leaves, state_def = jax.tree.flatten(opt_state["inner"])
        pieces = _Pieces(self.inner, _roles(self.inner, opt_state["inner"], params), param_def,
                         state_def, jax.tree.leaves(grads), extra,
                         self._param_layouts(param_shardings))
        scalars = pieces.scalars(state_leaves)
        carry = (jax.tree.leaves(opt_state["master"]), state_leaves, param_leaves, scalars)
        stacked = stacked_mask(params, self.stacked_key, self.num_layers)
        if layer_index := [j for j, s in enumerate(stacked) if s]:
            carry = self._layer_loop(pieces, layer_index, carry)
        master, state_leaves, param_leaves, new_scalars = carry
        sizes = [x.size * 4 for x in param_leaves]
        for group in buckets(sizes, [j for j, s in enumerate(stacked) if not s], self.bucket_bytes):
            new_m, new_s = pieces.update(group, lambda x: x, scalars, master, state_leaves)
            master, state_leaves, param_leaves = pieces.write(
                new_m, new_s, lambda full, x: x, master, state_leaves, param_leaves)
            new_scalars = pieces.scalars(new_s)
        scalar_iter = iter(new_scalars)
        state_leaves = [next(scalar_iter) if r.param is None else x
                        for r, x in zip(pieces.roles, state_leaves)]
        new_opt_state = {"master": jax.tree.unflatten(param_def, master),
                         "inner": jax.tree.unflatten(state_def, state_leaves)}
        return jax.tree.unflatten(param_def, param_leaves), new_opt_state

    def _param_layouts(self, param_shardings) -> list | None:
        """The parameters' shardings as a flat list (device memory), where the state is split
        over `partition_axis` and the new pieces must be gathered; else None."""
        if param_shardings is None or self.partition_axis is None:
            return None
        return [NamedSharding(s.mesh, s.spec) for s in jax.tree.leaves(param_shardings)]

    def _layer_loop(self, pieces: "_Pieces", layer_index: list[int], carry: tuple) -> tuple:
        """The stacked leaves `layer_index` updated one layer per loop iteration (layer i of
        every pipeline stage together: `(stages, ...)`, local to each stage under `pipe`).

        Args:
          pieces: the step's `_Pieces`.
          layer_index: the flat indices of the stacked parameters.
          carry: `(master leaves, state leaves, device parameter leaves, shared scalars)`.

        Returns:
          The carry after every layer (the scalars: the last layer's new ones).
        """
        stages = self.num_stages
        per_stage = lambda x: x.reshape(stages, self.num_layers // stages, *x.shape[1:])  # noqa: E731
        scalars = carry[3]

        def body(i, carry):
            master, state_leaves, param_leaves, _ = carry
            pick = lambda x: jax.lax.dynamic_index_in_dim(per_stage(x), i, 1, keepdims=False)  # noqa: E731
            put = lambda full, x: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
                per_stage(full), x, i, 1).reshape(full.shape)
            new_m, new_s = pieces.update(layer_index, pick, scalars, master, state_leaves)
            out = pieces.write(new_m, new_s, put, master, state_leaves, param_leaves)
            return (*out, pieces.scalars(new_s))

        # Two layers per iteration: XLA schedules one iteration at a time, and only inside an
        # iteration can a layer's write-back and gather run beside the next layer's reads. A
        # loop unrolled whole replayed slower (`benchmarks/results/offload_replay.md`).
        trips = self.num_layers // stages
        return jax.lax.fori_loop(0, trips, body, carry, unroll=2 if trips > 2 else 1)


class _Pieces:
    """One `_Streamed.apply`'s update of pieces of the parameters: their gradients, masters and
    state brought to the device, `tx` run on them, the results written back where they live."""

    def __init__(self, inner: optax.GradientTransformation, roles: list, param_def, state_def,
                 grad_leaves: list, extra: dict, param_shardings: list | None = None):
        self.inner, self.roles, self.extra = inner, roles, extra
        self.param_def, self.state_def, self.grad_leaves = param_def, state_def, grad_leaves
        self.param_shardings = param_shardings  # one NamedSharding per parameter, or None

    def scalars(self, state_leaves: list) -> list:
        """The state's leaves that belong to no parameter (shared scalars: Adam's count)."""
        return [a for r, a in zip(self.roles, state_leaves) if r.param is None]

    def update(self, index: list[int], pick: Callable, scalars: list, master: list,
               state_leaves: list):
        """Update parameters `index`; `pick` takes a leaf's piece of `master` and `state_leaves`
        (a loop's carried ones: reading the arrays the loop writes lets XLA update them in place,
        where reading the loop's inputs kept a second copy of the host state). Returns the new
        pieces on the device: masters and state leaves (None where not updated; the shared
        scalars new)."""
        chosen = set(index)
        sel = lambda leaves: [pick(x) if j in chosen else None for j, x in enumerate(leaves)]  # noqa: E731
        g = [None if x is None else jax.device_put(x, jax.memory.Space.Device)
             if in_host_memory(x) else x for x in sel(self.grad_leaves)]
        m = [None if x is None else jax.device_put(x, jax.memory.Space.Device)
             for x in sel(master)]
        s_in, scalar_iter = [], iter(scalars)
        for r, x in zip(self.roles, state_leaves):
            if r.param is None:
                s_in.append(next(scalar_iter))
            else:
                s_in.append(jax.device_put(pick(x), jax.memory.Space.Device)
                            if r.param in chosen else None)
        g_tree, m_tree = (jax.tree.unflatten(self.param_def, g),
                          jax.tree.unflatten(self.param_def, m))
        updates, new_state = self.inner.update(
            g_tree, jax.tree.unflatten(self.state_def, s_in), m_tree, **self.extra)
        new_m = jax.tree.leaves(optax.apply_updates(m_tree, updates), is_leaf=_none_is_leaf)
        return new_m, jax.tree.leaves(new_state, is_leaf=_none_is_leaf)

    def write(self, new_m, new_s, put: Callable, master, state_leaves, param_leaves):
        """The new pieces written with `put(full, piece)`: masters and state back into the memory
        their arrays live in (an update must be in the memory space of the array it updates),
        the device parameters cast to their dtype and laid out like their parameter (with a
        state split over `data`, each piece is gathered here, beside its write-back to host
        memory, rather than the whole stack after the update). Returns `(master,
        state_leaves, param_leaves)`."""
        back = lambda full, x: jax.device_put(x, jax.typeof(full).memory_space)  # noqa: E731
        master = [x if a is None else put(x, back(x, a)) for x, a in zip(master, new_m)]
        layouts = self.param_shardings or [None] * len(param_leaves)
        param_leaves = [x if a is None else put(x, _laid_out(a.astype(x.dtype), s))
                        for x, a, s in zip(param_leaves, new_m, layouts)]
        state_leaves = [x if r.param is None or a is None else put(x, back(x, a))
                        for r, x, a in zip(self.roles, state_leaves, new_s)]
        return master, state_leaves, param_leaves


def _laid_out(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def gradient_offload_problems(grid, offload_optimizer: bool, microbatches: int,
                              compressed: bool = False, between_processes: bool = False
                              ) -> list[str]:
    """Why the blocks' gradients cannot go to host memory in the backward on `grid`.

    They leave each layer's backward as it finishes (`step.layer_exchange`), after that layer's
    exact mean over `data`, so nothing may still sum them afterwards: no axis besides `data` and
    the tensor axes (whose layers sum their own), no accumulation over microbatches, no CGX
    exchange and no exchange between processes. The offloaded update streams them back in with
    its state.

    Args:
      grid: the run's parallel configuration.
      offload_optimizer: whether the optimizer state is in host memory.
      microbatches: the step's microbatches.
      compressed: whether CGX compresses the data-parallel exchange.
      between_processes: whether the gradients are reduced between processes (MPI).

    Returns:
      One message per problem (empty: they can).
    """
    found = []
    if not offload_optimizer:
        found.append("offload_gradients needs offload_optimizer: the update that reads the "
                     "gradients from host memory is the offloaded one")
    summed = {a: getattr(grid, a) for a in AXES
              if a not in TENSOR_AXES and a != DATA.name and getattr(grid, a) > 1}
    if summed:
        found.append("offload_gradients on " + " × ".join(f"{a} {n}" for a, n in summed.items())
                     + f" (gradients summed over that axis after the backward) {NOT_YET}")
    if microbatches > 1:
        found.append(f"offload_gradients with microbatches={microbatches} (gradients "
                     f"accumulated on the device) {NOT_YET}")
    if compressed:
        found.append(f"offload_gradients with compress_bits (CGX's exchange) {NOT_YET}")
    if between_processes:
        found.append(f"offload_gradients with --transport mpi {NOT_YET}")
    return found


def lowered_for_gpu(jitted, *args) -> str:
    """StableHLO text of `jitted(*args)` lowered for CUDA.

    There in-jit `device_put`s between memory kinds appear as `annotate_device_placement` custom
    calls (CPU drops them).

    Args:
      jitted: a jitted function.
      *args: its arguments (arrays or ShapeDtypeStructs).

    Returns:
      The lowered module's text.
    """
    return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def placement_transfers(hlo_text: str) -> list[tuple[str, str]]:
    """(destination memory kind, tensor type) of every placement annotation in lowered StableHLO.

    Args:
      hlo_text: StableHLO text (`lowered_for_gpu`).

    Returns:
      The pairs, in order.
    """
    import re

    pattern = re.compile(r"annotate_device_placement.*_xla_buffer_placement = \"(\w+)\".*"
                         r"-> (tensor<[^>]*>)")
    return [m.groups() for m in pattern.finditer(hlo_text)]
