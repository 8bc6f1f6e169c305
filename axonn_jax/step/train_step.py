"""`make_train_step`: the one train-step builder, for any `StackedModel`, optax optimizer and grid.

A step is assembled from three parts chosen by the grid and the options, each behind one interface:

1. a **gradient engine** (`step.engines`): the loss and gradients of this device's rows, inside a
   shard_map manual over the batch axes (and `pipe`) and automatic over the tensor axes, whose
   layers (`axonn_jax.parallelize`) bring their own collectives: `SpmdEngine` (data and tensor
   grids, with gradient accumulation over microbatches) or `PipelineEngine` (`pipe > 1`, a
   schedule); or a host-driven engine (the message-driven MPI pipeline, `transport.mpi_pipeline`);
2. a **gradient reducer** (`step.reducers`): the mean over `data` (exact or CGX-compressed),
   inside the same shard_map, or between processes (MPI) in a program of its own (`step.hosted`);
3. an **optax update** (`step.update`): unscale, clip, skip-if-non-finite and the optimizer, with
   the optimizer state on the device or streamed from host memory (`offload.optimizer`).

They meet in a pure `train_step(state, batch) -> (state, metrics)` on a typed `TrainState`
(`step.state`). Batches are pytrees of arrays with a leading batch axis, split over `data` and
`depth`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from .._compat import (HOST_MEMORY_KIND, ensure_varying, in_host_memory, mesh_platform, pmean,
                       shard_map, tracing_in, with_memory_kind)
from ..batch_axis import DATA
from ..checks import NOT_YET, collect
from ..config import BATCH_AXES, Axis, ParallelConfig, check_grid
from ..mesh import config_of
from ..offload import activations
from ..offload.optimizer import (ParamUpdate, gradient_offload_problems, host_offload, on_device,
                                 partition_spec, share_dimension)
from ..offload.precision import DTYPES, check_dtype, loss_scaler
from ..parallel import compression, exchange, pipeline as pipeline_lib
from ..tp.options import KernelOptions
from ..tp.tensor import collective_matmuls_on
from . import batch_axes, hosted, xla_options
from .compute import ComputeFunctions, activation_dtype
from .engines import make_engine
from .model import ModelFunctions, StackedModel
from .reducers import GradientReducer, compressed_mean, exact_mean
from .state import TrainState
from .update import initial_state, make_update, update_chain


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The modes of a train step (see `make_train_step`)."""

    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    offload_optimizer: bool = False
    offload_gradients: bool = False
    remat: Any = "none"  # 'none' | 'full' | 'offload' | 'auto' | activations.Plan
    memory_budget_gb: float | None = None
    compress_bits: int = 0
    compress_bucket: int = 1024
    error_feedback: bool = True
    compress_min_size: int = 1024
    compress_rules: tuple = ()
    compress_rounding: str = "auto"
    compress_in_backward: bool = True
    compress_scope: str = "all"
    compress_node_size: int | None = None
    reduce_dtype: str = "float32"
    dtype: str = "float32"
    fp8: bool = False
    clip_norm: float | None = None
    xla_options: str = "library"
    collective_matmul: str = "auto"


def option_problems(grid: ParallelConfig, options: StepOptions, num_layers: int | None = None,
                    between_processes: bool = False) -> list[str]:
    """Why a step with these options cannot run on `grid`, one line each (empty: it can).

    Args:
      grid: the run's parallel configuration.
      options: the step's modes (`make_train_step`'s options).
      num_layers: the model's layers (checked against the pipeline's stages), or None.
      between_processes: the gradients are reduced between processes (MPI).

    Returns:
      One message per problem; those of options not implemented yet end with "is not
      implemented yet" (`NOT_YET`).
    """
    o, found = options, []

    collect(found, check_dtype, o.dtype)
    collect(found, exchange.check_reduce_dtype, o.reduce_dtype)
    if o.compress_bits and o.reduce_dtype != "float32":
        found.append(f"reduce_dtype={o.reduce_dtype} is the exact exchange's; with compress_bits="
                     f"{o.compress_bits} CGX sets what the exchange sends")
    collect(found, activations.check_options, o.remat, o.memory_budget_gb)
    found += pipeline_lib.option_problems(
        grid.pipe, schedule=o.schedule, microbatches=o.microbatches,
        virtual_stages=o.virtual_stages, num_layers=num_layers, per_layer_plan=o.remat == "auto")
    collect(found, compression.check_scope, o.compress_scope)
    if o.compress_bits and between_processes and o.compress_scope != "all":
        found.append(f"compress_scope={o.compress_scope} between processes (--transport mpi) "
                     f"{NOT_YET}")
    if o.compress_bits and not between_processes and grid.data == 1:
        found.append(f"compress_bits={o.compress_bits} needs data > 1: with one data-parallel copy "
                     "there is no gradient exchange to compress")
    if o.offload_gradients:
        found += gradient_offload_problems(grid, o.offload_optimizer, o.microbatches,
                                           bool(o.compress_bits), between_processes)
    return found


def make_train_step(model: StackedModel, optimizer: optax.GradientTransformation, mesh, *,
                    reducer: GradientReducer | None = None, engine: Callable | None = None,
                    **options) -> "TrainStep":
    """The train step of `model` with `optimizer` on `mesh` (axes `data, pipe, depth, row, col`).

    options (see `StepOptions`):
      microbatches: slices of each device's rows whose gradients are accumulated (with
        `pipe > 1`, the pipeline's microbatches); schedule, virtual_stages: the pipeline's
        timetable (`gpipe` | `1f1b` | `interleaved-1f1b` with `virtual_stages` chunks per device |
        `zb-h1`), pipe > 1.
      offload_optimizer: fp32 masters and optimizer state in host memory, streamed per layer;
        `optimizer` must then be elementwise (AdamW is).
      offload_gradients: with `offload_optimizer`, each block's gradient goes to host memory as
        its backward finishes, and the update streams it back in with the state: no gradient
        stack on the device (`offload.optimizer.gradient_offload_problems` says where it
        runs).
      remat: `none` | `full` | `offload` | `auto` (KARMA's planner within `memory_budget_gb`) or an
        `offload.activations.Plan`: what each block keeps for the backward.
      compress_bits, compress_bucket, error_feedback: CGX-compressed gradient mean over `data`;
        compress_min_size, compress_rules (`PATTERN=BITS` on parameter paths), compress_rounding
        (`nearest` | `stochastic` | `auto`): which tensors at which width, how values round;
        compress_scope (`all` | `inter-node`), compress_node_size (devices per node): where the
        exchange compresses (`step.reducers.compressed_mean`).
      reduce_dtype: what the exact gradient mean over `data` sends: `float32`, or `bfloat16`
        (half the bytes; the received pieces summed in float32: `parallel.exchange`).
      dtype: compute dtype (`float32` | `bfloat16` | `float16`): parameters are cast to it for the
        forward (masters stay fp32); float16 scales the loss; mixed precision skips non-finite steps.
      fp8: the dense layers' GEMMs in FP8 (e4m3 forward, e5m2 gradients, per-tensor current
        scaling: `axonn_jax.tp.fp8`), everything else in `dtype`; no state to carry.
      clip_norm: clip the gradients' global norm (None: no clipping).
      xla_options: `library` (on GPUs, the overlap options of `step.xla_options`) | `xla`
        (XLA's defaults).
      collective_matmul: `auto` (on for GPU meshes without fp8) | `on` | `off`: the
        tensor-parallel layers gather their input rows in rings interleaved with the matmul
        (`tp.options.KernelOptions.collective_matmuls`).

    Args:
      model: the model.
      optimizer: the optax optimizer (elementwise with `offload_optimizer`).
      mesh: the device mesh (`make_mesh`, axes `config.AXES`).
      reducer: a reducer between processes (`transport.mpi`); the gradients are first averaged
        over the local `data` devices exactly. None: the reducer inside the step.
      engine: a host-driven gradient engine (the MPI pipeline), `engine(bound) -> an object like
        transport.mpi_pipeline's` (bound: the step bound to a batch shape, `BoundStep`: its
        `compute` functions, `fns`, `model` and abstract `batch`); needs `reducer`.
      **options: the step's modes, the fields of `StepOptions` listed above.

    Returns:
      The `TrainStep`.

    Raises:
      TypeError: on an option that is not a field of `StepOptions`.
      ValueError: on options the grid cannot run (`option_problems`: the first problem), or an
        engine without a reducer.
      NotImplementedError: when the first problem is a combination not implemented yet.
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(StepOptions)}
    if unknown:
        raise TypeError(f"make_train_step: unknown options {sorted(unknown)}")
    return TrainStep(StepParts.of(model, optimizer, mesh, StepOptions(**options), reducer, engine))


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step is built from: the model, the optimizer, the mesh, the options.

    Also the mesh's grid, a reducer between processes and a host-driven engine (None:
    in-process).
    """

    model: StackedModel
    optimizer: optax.GradientTransformation
    mesh: Any
    grid: ParallelConfig
    options: StepOptions
    process_reducer: GradientReducer | None
    host_engine: Callable | None

    @classmethod
    def of(cls, model, optimizer, mesh, options: StepOptions, reducer, engine) -> "StepParts":
        """The parts of a step, the options checked against the mesh's grid.

        Args:
          model: the model.
          optimizer: the optax optimizer.
          mesh: the device mesh; its grid is `config_of(mesh)`.
          options: the step's modes.
          reducer: a reducer between processes, or None.
          engine: a host-driven engine factory, or None (needs `reducer`).

        Returns:
          The `StepParts`.

        Raises:
          ValueError: on the first problem `option_problems` or the collective-matmul option
            finds, or an engine without a reducer.
          NotImplementedError: when the first problem is a combination not implemented yet.
        """
        grid = config_of(mesh)
        if engine is not None and reducer is None:
            raise ValueError("make_train_step: an engine needs a reducer between processes")
        found = option_problems(grid, options, num_layers=model.num_layers,
                                between_processes=reducer is not None)
        try:
            collective_matmuls_on(options.collective_matmul, mesh_platform(mesh), options.fp8)
        except ValueError as e:
            found.append(str(e))
        if found:
            raise (NotImplementedError if found[0].endswith(NOT_YET) else ValueError)(found[0])
        return cls(model, optimizer, mesh, grid, options, reducer, engine)

    @functools.cached_property
    def layer_order(self) -> np.ndarray | None:
        """Which model layer each position of the stored `blocks` stack holds; None: in order.

        Interleaved stages store each device's chunks contiguously, so that the stack stays split
        over `pipe` in blocks (`parallel.pipeline.interleave_order`).
        """
        o = self.options
        if o.virtual_stages == 1:  # (more than one needs stages: `option_problems`)
            return None
        return pipeline_lib.interleave_order(self.model.num_layers, self.grid.pipe,
                                             o.virtual_stages)

    def reducer(self, grad_specs) -> GradientReducer:
        """The reducer inside the step: CGX-compressed or exact over `data`.

        Args:
          grad_specs: PartitionSpecs of how the tensor axes split the gradients; None when only
            its state's layout is needed.

        Returns:
          `compressed_mean` with `compress_bits` (and no reducer between processes), else
          `exact_mean` sending `reduce_dtype`.
        """
        o = self.options
        if o.compress_bits and self.process_reducer is None:
            return compressed_mean(self.mesh, grad_specs, bits=o.compress_bits,
                                   bucket_size=o.compress_bucket, error_feedback=o.error_feedback,
                                   min_size=o.compress_min_size, rules=o.compress_rules,
                                   rounding=o.compress_rounding,
                                   in_backward=o.compress_in_backward,
                                   scope=o.compress_scope, node_size=o.compress_node_size)
        return exact_mean(reduce_dtype=o.reduce_dtype, grad_specs=grad_specs)

    def state_reducer(self, grad_specs=None) -> GradientReducer:
        """The reducer whose state the train state holds (between processes, or in the step).

        Args:
          grad_specs: as `reducer` takes them.

        Returns:
          The reducer between processes, or else `reducer(grad_specs)`.
        """
        return self.process_reducer or self.reducer(grad_specs)

    @functools.cached_property
    def params_update(self) -> ParamUpdate:
        """The update chain (`step.update`) with its state on the device or in host memory."""
        o = self.options
        tx = update_chain(self.optimizer, clip_norm=o.clip_norm,
                          skip_non_finite=loss_scaler(o.dtype).guards)
        if o.offload_optimizer:
            return host_offload(tx, DTYPES[o.dtype], self.model.num_layers,
                                num_stages=self.grid.pipe, partition_axis=Axis.DATA,
                                partition_size=self.grid.data)
        return on_device(tx)


def _take_rows(x, index: tuple[int, ...]):
    """`x[index]`, placed like `x`; a host-resident `x` (`pinned_host`) is reordered on the device
    (host arrays cannot be indexed), moved there and back outside the program (inside it, the
    transfers beside the reordering's collective-permutes stall XLA:CPU's rendezvous). Waits for
    the result: the reorderings of independent leaves, left in flight together, interleave their
    collective-permutes and deadlock XLA:CPU's thread pool."""
    sharding = x.sharding
    on_device = sharding.with_memory_kind("device")
    if sharding.memory_kind not in (None, "device"):
        moved = _take_program(on_device, index)(jax.device_put(x, on_device)).block_until_ready()
        return jax.device_put(moved, sharding)
    return _take_program(sharding, index)(x).block_until_ready()


@functools.lru_cache(maxsize=64)
def _take_program(sharding, index: tuple[int, ...]):
    return jax.jit(lambda x: jnp.take(x, jnp.asarray(index), axis=0), out_shardings=sharding)


def batch_spec(grid: ParallelConfig) -> P:
    """The PartitionSpec of every batch leaf.

    Args:
      grid: the run's parallel configuration.

    Returns:
      Rows over `BATCH_AXES`; with `context > 1` the sequence (dim 1) over `context`.
    """
    return batch_axes.global_spec(BATCH_AXES, grid)


def _manual_specs(specs, manual) -> Any:
    """Each PartitionSpec of `specs` with only the `manual` axes left (what a shard_map manual
    over them takes)."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.tree.map(lambda s: P(*(keep(e) for e in s)), specs,
                        is_leaf=lambda s: isinstance(s, P))


def _sum_over_unsplit(grads, specs, axes: tuple[str, ...], grid: ParallelConfig):
    """Gradients over the batch `axes` besides `data` (`expert`, `context`): each summed over the
    axes that do not split its parameter where the backward has not summed it already
    (`exchange.sum_over_unsplit`), and divided by all their sizes, so that with the mean over
    `data` after it every gradient is the global batch's mean."""
    if not axes:
        return grads
    total = float(np.prod([getattr(grid, a) for a in axes]))
    return exchange.sum_over_unsplit(grads, specs, axes, total)


def _abstract_batch(batch):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), batch)


def _shapes(tree) -> str:
    """`{path: shape}` of a pytree's leaves, for error messages."""
    return str({jax.tree_util.keystr(k): tuple(jnp.shape(v))
                for k, v in jax.tree_util.tree_leaves_with_path(tree)})


def reorder_blocks(tree, order: np.ndarray | None, num_layers: int, to_model: bool,
                   take: Callable | None = None):
    """Every `blocks` leaf whose leading axis is the layer axis, reordered (traceable).

    From the stored `order` to the model's (`to_model`) or back.

    Args:
      tree: a pytree holding `blocks` subtrees (parameters, optimizer state, a state dict).
      order: which model layer each stored position holds (`StepParts.layer_order`), or None.
      num_layers: the model's layers: leaves under `blocks` whose leading axis has this length
        are reordered.
      to_model: from the stored order to the model's (True) or back (False).
      take: `take(x, index)`: how to reorder a leaf (`jnp.take` on axis 0 by default).

    Returns:
      The tree with those leaves reordered; `tree` itself when `order` is None.
    """
    if order is None:
        return tree
    index = np.argsort(order) if to_model else order
    take = take or (lambda x, i: jnp.take(x, jnp.asarray(i), axis=0))

    def one(path, x):
        blocks = any(getattr(k, "key", None) == "blocks" for k in path)
        if blocks and getattr(x, "ndim", 0) and x.shape[0] == num_layers:
            return take(x, index)
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


def _take_leaf(x, index):
    """One leaf reordered in a program of its own (`_take_rows`); layouts pass through."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return _take_rows(x, tuple(int(j) for j in index))


class TrainStep:
    """`step(state, batch) -> (state, metrics)` and what a training loop needs around it.

    state: a `TrainState` of global arrays (see there for their placement). Batches: pytrees of
    `(batch, ...)` arrays split over `data` and `depth`. The step is compiled for each batch shape
    it meets (`lower` / `compile` ahead of time).
    """

    def __init__(self, parts: StepParts):
        self.parts = parts
        self._bound: dict = {}

    @property
    def model(self) -> StackedModel:
        """The model the step trains."""
        return self.parts.model

    @property
    def mesh(self):
        """The device mesh the step runs on."""
        return self.parts.mesh

    @property
    def grid(self) -> ParallelConfig:
        """The mesh's parallel configuration (axis sizes)."""
        return self.parts.grid

    @property
    def options(self) -> StepOptions:
        """The step's modes."""
        return self.parts.options

    @property
    def layer_order(self):
        """Which model layer each stored block position holds (`StepParts.layer_order`)."""
        return self.parts.layer_order

    # ------------------------------------------------------------------ checkpoint layout

    def canonical_params(self, params):
        """`params` with the blocks in the model's layer order (for `StackedModel.loss`, sampling).

        Args:
          params: the parameters as the state holds them (blocks in the stored order).

        Returns:
          The parameters, the blocks' layer axis reordered (`params` itself when in order).
        """
        return reorder_blocks(params, self.layer_order, self.model.num_layers, to_model=True)

    def canonical_state(self, state: TrainState, inverse: bool = False):
        """The state as checkpoints hold it (a dict), so that it restores on any grid and mode.

        Every block-stacked leaf (parameters, optimizer moments and masters, reducer residuals)
        in the model's layer order, the parameters and optimizer state of a run without offload
        (`ParamUpdate.canonical`), and the reducer's state as it saves it
        (`GradientReducer.saved`). Works on ShapeDtypeStructs too (the layout only). One program
        per leaf, so that host-resident leaves visit the device one at a time.

        Args:
          state: this step's `TrainState`; with `inverse`, a dict as this method returns, whose
            leaves are placed like `canonical_state(this step's state)`.
          inverse: back to this step's `TrainState` from such a dict.

        Returns:
          The checkpoint's dict (`TrainState.as_dict`'s fields), or with `inverse` the
          `TrainState`.
        """
        order, layers = self.layer_order, self.model.num_layers
        update, reducer = self.parts.params_update, self.state_reducer
        if not inverse:
            tree = reorder_blocks(state.as_dict(), order, layers, to_model=True, take=_take_leaf)
            tree["params"], tree["opt_state"] = update.canonical(tree["params"],
                                                                 tree["opt_state"])
            if "reducer" in tree:
                tree["reducer"] = reducer.saved(tree["reducer"])
            return tree
        tree = dict(state)
        if "reducer" in tree:
            tree["reducer"] = reducer.from_saved(tree["reducer"])
        tree = reorder_blocks(tree, order, layers, to_model=False, take=_take_leaf)
        tree["params"], tree["opt_state"] = update.from_canonical(tree["params"],
                                                                  tree["opt_state"])
        return TrainState.from_dict(tree)

    @property
    def state_reducer(self) -> GradientReducer:
        """The reducer whose state the train state holds (its layout and resharding)."""
        return self.parts.state_reducer()

    def reshard(self) -> dict[str, Callable]:
        """How a checkpoint's field whose shapes differ from this step's becomes this step's.

        Used by `run.checkpoint`.

        Returns:
          `{state field: reshard(saved, target) -> (value | None, note)}`: the reducer's
          `GradientReducer.reshard`.
        """
        return {"reducer": self.state_reducer.reshard}

    # ------------------------------------------------------------------ binding to a batch shape

    def bind(self, batch) -> "BoundStep":
        """The step's programs for batches shaped like `batch` (built once per shape).

        Args:
          batch: a batch pytree (this process's share) of arrays or ShapeDtypeStructs.

        Returns:
          The `BoundStep`, cached by the batch's structure, shapes and dtypes.

        Raises:
          ValueError: when the grid cannot split the batch (`config.check_grid`), a batch axis
            refuses the batch (`step.batch_axes.check_batch`), or as `StackedModel.bind` raises.
        """
        key = jax.tree.structure(batch), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(batch))
        if key not in self._bound:
            self._bound[key] = BoundStep(self.parts, _abstract_batch(batch))
        return self._bound[key]

    # ------------------------------------------------------------------ state and batches

    def init_state(self, key, example_batch, params=None) -> TrainState:
        """Fresh state for batches like `example_batch`, created directly in its placement.

        Args:
          key: a JAX random key: the parameters' initial values (unless `params`) and the run's
            random stream.
          example_batch: a batch (this process's share) of arrays or ShapeDtypeStructs.
          params: start from these parameters (a tree like the model's, any placement: e.g. a
            pretrained checkpoint) instead of initializing them from `key`.

        Returns:
          The `TrainState`, placed as `state_shardings` says.

        Raises:
          ValueError: when `params` do not match the model's tree and shapes.
        """
        return self.bind(example_batch).init_state(key, params)

    def abstract_state(self, example_batch) -> TrainState:
        """ShapeDtypeStructs of the state with their shardings (nothing allocated).

        Args:
          example_batch: a batch (this process's share) of arrays or ShapeDtypeStructs.

        Returns:
          A `TrainState` of ShapeDtypeStructs.
        """
        return self.bind(example_batch).abstract_state()

    def state_shardings(self, example_batch):
        """The shardings of the state for batches like `example_batch`.

        Args:
          example_batch: a batch (this process's share) of arrays or ShapeDtypeStructs.

        Returns:
          A `TrainState` of shardings.
        """
        return jax.tree.map(lambda s: s.sharding, self.abstract_state(example_batch))

    def batch_shardings(self, batch):
        """NamedShardings of a batch pytree (`batch_spec`).

        Args:
          batch: a batch pytree.

        Returns:
          A NamedSharding per leaf: rows over `data`, `expert` and `depth`, the sequence (dim 1)
          over `context`.
        """
        spec = batch_spec(self.grid)
        return jax.tree.map(lambda _: NamedSharding(self.mesh, spec), batch)

    def batch_share(self) -> tuple[int, int]:
        """This process's share of each global batch, as `(index, count)`.

        This process trains on rows [index·B/count, (index+1)·B/count) of each global batch of B
        rows.

        Returns:
          `(index, count)`: count is 1 within one JAX program, the processes of a reducer
          between processes, or the pipelines of an MPI pipeline engine.
        """
        if self.parts.host_engine is not None:
            return self.parts.host_engine.batch_share
        r = self.parts.process_reducer
        return (0, 1) if r is None else (r.process_index, r.process_count)

    def local_batch(self, batch):
        """This process's share of a global batch: what the step, `init_state` and `eval_loss` take.

        Args:
          batch: the global batch, arrays or ShapeDtypeStructs with a leading batch axis.

        Returns:
          Its rows of this process (`batch_share`); `batch` itself with one share.
        """
        index, count = self.batch_share()
        if count == 1:
            return batch

        def share(a):
            size = a.shape[0] // count
            if isinstance(a, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype)
            return a[index * size:(index + 1) * size]

        return jax.tree.map(share, batch)

    def place_batch(self, host_batch):
        """A global host batch as device arrays of this process's share.

        Each process builds only the rows its devices hold.

        Args:
          host_batch: the global batch, a numpy pytree with a leading batch axis.

        Returns:
          Global arrays of this process's share, placed as `batch_shardings` says.
        """
        local = self.local_batch(host_batch)
        return jax.tree.map(
            lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx]),
            local, self.batch_shardings(local))

    # ------------------------------------------------------------------ running

    def __call__(self, state, batch):
        return self.bind(batch).step(state, batch)

    def lower(self, state, batch):
        """The step lowered for `state` and `batch` (`.compile()` gives the compiled step).

        Args:
          state: a `TrainState`, of arrays or ShapeDtypeStructs with shardings.
          batch: a batch (this process's share), of arrays or ShapeDtypeStructs.

        Returns:
          A `jax.stages.Lowered`, or for the host-driven paths an object with the same
          `.compile()`.
        """
        return self.bind(batch).lower(state, batch)

    def eval_loss(self, params, batch):
        """Mean loss of `batch` (all data-parallel copies, all processes).

        Args:
          params: the parameters as the state holds them.
          batch: a batch (this process's share).

        Returns:
          The scalar loss (the forward in the compute dtype).
        """
        return self.bind(batch).eval_loss(params, batch)


class BoundStep:
    """The step's parts bound to one batch shape.

    The model's functions, the activation plan, the parameter shardings, the engine, the
    reducer, the update and the programs.

    Args:
      parts: what the step is built from.
      batch: abstract, this process's share (`TrainStep.local_batch`).

    Raises:
      ValueError: when the grid cannot split the batch (`config.check_grid`), a batch axis
        refuses the batch (`step.batch_axes.check_batch`: a sequence that does not cut into the
        context axis's chunks), or as `StackedModel.bind` raises.
    """

    def __init__(self, parts: StepParts, batch):
        self.parts, self.batch = parts, batch
        o, grid, mesh = parts.options, parts.grid, parts.mesh
        self.model = parts.model
        rows = jax.tree.leaves(batch)[0].shape[0]
        check_grid(grid, batch_size=rows, microbatches=o.microbatches)
        batch_axes.check_batch(batch, grid)
        self.fns: ModelFunctions = parts.model.bind(batch, mesh, self.kernels)
        self.compute_dtype = DTYPES[o.dtype]
        self.scaler = loss_scaler(o.dtype)
        self.specs = self._param_specs()
        self.reducer = parts.reducer(self.fns.specs)
        self.host_engine = None  # built last: it computes with the plan's functions
        self.plan = self._plan()
        self.compute = self.compute_with(self.plan)
        self.engine = self._engine(self.compute)
        if parts.host_engine is not None:
            self.host_engine = parts.host_engine(self)

    # ------------------------------------------------------------------ pieces

    @property
    def kernels(self) -> KernelOptions:
        """The modes of the model's tensor-parallel kernels (`tp.options.KernelOptions`).

        FP8 GEMMs with `fp8`; gathers in rings as `collective_matmul` decides on this mesh.
        """
        o = self.parts.options
        rings = collective_matmuls_on(o.collective_matmul, mesh_platform(self.parts.mesh), o.fp8)
        return KernelOptions(fp8=o.fp8, collective_matmuls=rings)

    def compute_with(self, plan: activations.Plan | None) -> ComputeFunctions:
        """The model's functions in the compute dtype, its blocks run with `plan`.

        Args:
          plan: the activation plan (what each block keeps for the backward), or None.

        Returns:
          The `ComputeFunctions`, with the step's fp8 and collective-matmul options.
        """
        groups = plan.layer_groups(self.model.offload_names) if plan else None
        return ComputeFunctions(self.fns, self.compute_dtype, groups=groups,
                                fetch_ahead=plan is not None and "offload" in plan.decisions)

    def _engine(self, compute: ComputeFunctions):
        o = self.parts.options
        in_step = bool(o.compress_bits) and self.parts.process_reducer is None
        layer = self.reducer.layer_exchange if in_step else None
        return make_engine(compute, self.parts.grid, o, compressed=in_step,
                           layer_stages=None if layer is None else layer.stages)

    def _plan(self) -> activations.Plan | None:
        o, layers = self.parts.options, self.model.num_layers
        if isinstance(o.remat, activations.Plan) or o.remat != "auto":
            return activations.uniform_plan(o.remat, layers)
        return activations.make_plan(
            layers, int(o.memory_budget_gb * 1e9), self._block_cost(), self._measure_peak,
            activations.device_spec(self.parts.mesh.devices.flat[0]))

    def _block_cost(self) -> activations.BlockCost:
        """One block's costs at this device's share of the activations (`data`, `depth` split)."""
        grid = self.parts.grid
        x = self.fns.activation
        local = jax.ShapeDtypeStruct((x.shape[0] // (grid.data * grid.depth), *x.shape[1:]),
                                     activation_dtype(x.dtype, self.compute_dtype))
        dtype = self.compute_dtype  # the step casts the parameters to it before the blocks
        one_layer = jax.eval_shape(lambda p: jax.tree.map(lambda a: a[0].astype(dtype), p),
                                   jax.eval_shape(self.fns.init, jax.random.key(0))["blocks"])
        return activations.block_cost(self.fns.block, one_layer, local, self.model.offload_names)

    def _measure_peak(self, plan: activations.Plan) -> int:
        """Compiled peak bytes per device of this step with activation `plan` (for the planner):
        the same parts, the blocks run with `plan`."""
        step = jax.jit(self._train_step_fn(self._engine(self.compute_with(plan))),
                       donate_argnums=0)
        return activations.compiled_peak_bytes(
            step.lower(self.abstract_state(), self.abstract_batch()).compile())

    @property
    def state_reducer(self) -> GradientReducer:
        """The reducer whose state the train state holds (between processes, or in the step)."""
        return self.parts.process_reducer or self.reducer

    def _param_specs(self) -> dict:
        """Every parameter's PartitionSpec on the mesh: the tensor axes from its layer, plus `pipe`
        on the blocks' layer axis (`parallel.pipeline.stage_specs`)."""
        return pipeline_lib.stage_specs(self.fns.specs, self.parts.grid.pipe)

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.parts.mesh, spec)

    @functools.cached_property
    def _param_shardings(self):
        """The parameters' NamedShardings (a tree like the parameters)."""
        return jax.tree.map(self._named, self.specs, is_leaf=lambda x: isinstance(x, P))

    # ------------------------------------------------------------------ state

    def _init(self, key, params=None) -> TrainState:
        parts = self.parts
        params = self.fns.init(key) if params is None else params
        params = reorder_blocks(params, parts.layer_order, self.model.num_layers, to_model=False)
        if self.host_engine is not None:
            params = self.host_engine.stage_params(params)
        return initial_state(params, params_update=parts.params_update, scaler=self.scaler,
                             rng=jax.random.key_data(key),
                             reducer=self.state_reducer)

    def _state_shardings(self, shapes: TrainState) -> TrainState:
        replicated = self._named(P())
        if self.host_engine is not None:  # one device per process: everything on it
            return jax.tree.map(lambda _: replicated, shapes)
        params = self._param_shardings
        out = jax.tree.map(lambda _: replicated, shapes)
        out = out.replace(params=params, opt_state=self.parts.params_update.state_shardings(
            shapes.opt_state, params))
        if shapes.reducer is not None:
            spec = self.state_reducer.state_spec
            out = out.replace(reducer=jax.tree.map(lambda p: self._named(spec(p)), self.specs,
                                                   is_leaf=lambda x: isinstance(x, P)))
        return out

    @functools.cached_property
    def _abstract_state(self) -> TrainState:
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        shardings = self._state_shardings(shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, shardings)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs of the train state, with their shardings.

        Returns:
          A `TrainState` of ShapeDtypeStructs.
        """
        return self._abstract_state

    def abstract_batch(self):
        """ShapeDtypeStructs of the batch, with their shardings.

        Returns:
          The bound batch's ShapeDtypeStructs, each split as `batch_spec` says.
        """
        shardings = jax.tree.map(lambda _: self._named(batch_spec(self.parts.grid)), self.batch)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.batch, shardings)

    def state_shardings(self):
        """The shardings of the train state.

        Returns:
          A `TrainState` of shardings.
        """
        return jax.tree.map(lambda a: a.sharding, self._abstract_state)

    def init_state(self, key, params=None) -> TrainState:
        """Fresh state, created directly in its placement (`TrainStep.init_state`).

        Args:
          key: a JAX random key.
          params: start from these parameters (a tree like the model's) instead of `key`'s.

        Returns:
          The `TrainState`.

        Raises:
          ValueError: when `params` do not match the model's tree and shapes.
        """
        shardings = self.state_shardings()
        if params is None:
            return jax.jit(self._init, out_shardings=shardings)(key)
        abstract = jax.eval_shape(self.fns.init, key)
        if jax.tree.structure(params) != jax.tree.structure(abstract) or any(
                jnp.shape(p) != a.shape for p, a in zip(jax.tree.leaves(params),
                                                        jax.tree.leaves(abstract))):
            raise ValueError("init_state: the given parameters do not match the model's: "
                             f"{_shapes(params)} vs {_shapes(abstract)}")
        params = jax.tree.map(lambda p, a: jnp.asarray(p, a.dtype), params, abstract)
        return jax.jit(self._init, out_shardings=shardings)(key, params)

    # ------------------------------------------------------------------ phases 1 and 2

    def loss_fn(self, params, batch):
        """The mean loss of `batch` in the compute dtype (parameters cast for the forward).

        Args:
          params: the parameters as the state holds them (blocks in the stored order).
          batch: a batch shaped like the bound one.

        Returns:
          The scalar loss.
        """
        return self.compute.loss(reorder_blocks(params, self.parts.layer_order,
                                                self.model.num_layers, to_model=True), batch)

    def loss_and_grads(self, params, batch, scale, key, red_state, engine=None, sink=None):
        """Phases 1 and 2 on global arrays: the loss and the gradients averaged over the batch axes.

        Args:
          params: the parameters as the state holds them.
          batch: a batch shaped like the bound one.
          scale: the loss scale the gradients are multiplied by.
          key: the step's random key (`TrainState.step_key`).
          red_state: the reducer's state, or None.
          engine: another engine than the step's (the planner's measurements), or None.
          sink: host stacks for the blocks' gradients (`_gradient_sink`, `offload_gradients`),
            or None.

        Returns:
          `(loss, grads, reducer state, metrics)`: the mean loss, the gradients like `params`
          (scaled by `scale`; with `sink` the blocks' are its host stacks, averaged in the
          backward), the reducer's new state and the blocks' per-layer metrics in the model's
          layer order. With `sink`, also the host gradients' per-layer sums of squares, as a
          fifth.
        """
        engine = engine or self.engine
        sunk = {} if sink is None else {"sink": sink}
        if not engine.manual_axes:
            with tracing_in(self.parts.mesh):  # the mesh a shard_map would have put in context
                loss, grads, metrics, *squares = engine.loss_and_grads(params, batch, scale,
                                                                       **sunk)
            return (loss, grads, red_state, metrics, *squares)
        manual = engine.manual_axes
        p_specs = _manual_specs(self.specs, manual)
        extra = tuple(a for a in batch_axes.extra_axes(self.parts.grid) if a in manual)

        layer = self.reducer.layer_exchange
        with_state = layer is not None and getattr(engine, "layer_stages", None) is not None \
            and engine.exchanges_layers
        averaged = getattr(engine, "layer_mean", False) and engine.exchanges_layers

        def local(params, batch, scale, key, red_state, sink):
            batch = batch_axes.lay_out(batch, manual, self.parts.grid)
            squares = None
            if with_state:  # the blocks' reduction (and their state's update) in the backward
                loss, grads, metrics, new = engine.loss_and_grads(
                    params, batch, scale, layer.state_in(red_state, key))
                red_state = layer.state_out(red_state, new)
            elif sink is not None:  # the blocks' means in host memory already
                loss, grads, metrics, squares = engine.loss_and_grads(params, batch, scale,
                                                                      sink=sink)
            else:
                loss, grads, metrics = engine.loss_and_grads(params, batch, scale)
            grads = _sum_over_unsplit(grads, p_specs, extra, self.parts.grid)
            # The blocks averaged in the backward (`SpmdEngine.layer_mean`) skip the reducer.
            done = {"blocks": grads["blocks"]} if averaged else {}
            grads, red_state = self.reducer.reduce({**grads, **dict.fromkeys(done, {})},
                                                   red_state, key)
            mean = lambda x: self.reducer.mean(pmean(x, extra) if extra else x)  # noqa: E731
            return mean(loss), {**grads, **done}, red_state, mean(metrics), squares

        r_specs = jax.tree.map(lambda s: P(Axis.DATA, *s), p_specs,
                               is_leaf=lambda s: isinstance(s, P)) if red_state is not None \
            else P(Axis.DATA)
        sink_specs, g_specs = None, p_specs
        if sink is not None:
            sink_specs = {"grads": _manual_specs(self._sink_specs(sink["grads"]), manual),
                          "squares": P()}
            g_specs = {**p_specs, "blocks": sink_specs["grads"]}
        loss, grads, red_state, metrics, squares = shard_map(
            local, mesh=self.parts.mesh,
            in_specs=(p_specs, batch_axes.local_spec(manual), P(), P(), r_specs, sink_specs),
            out_specs=(P(), g_specs, r_specs, engine.metric_spec, None if sink is None else P()),
            axis_names=set(manual))(params, batch, scale, key, red_state, sink)
        # Per-layer metrics in the model's layer order (interleaved stages store theirs otherwise).
        order = self.parts.layer_order
        if order is not None:
            metrics = jax.tree.map(lambda a: jnp.take(a, jnp.asarray(np.argsort(order)), axis=0),
                                   metrics)
        return (loss, grads, red_state, metrics) + (() if sink is None else (squares,))

    # ------------------------------------------------------------------ the step

    def update(self, state: TrainState, grads, host_squares=None):
        """Phase 3 (`step.update`) on gradients laid out like their parameters.

        GSPMD would otherwise give a replicated parameter the layout of its gradient (e.g. a
        position table added to feature-split activations), and the state would drift from step
        to step.

        Args:
          state: the `TrainState`.
          grads: the reduced gradients like `state.params`, times the loss scale (the blocks'
            in host memory with `offload_gradients`).
          host_squares: the per-layer sums of squares of the gradients in host memory, or None.

        Returns:
          `(state, metrics)`: the new state (step + 1) and the update's metrics (`grad_norm`,
          and with mixed precision `loss_scale` and `skipped_steps`).
        """
        like_params = lambda tree: jax.tree.map(  # noqa: E731
            lambda g, s: g if in_host_memory(g) else jax.lax.with_sharding_constraint(g, s),
            tree, self._param_shardings)
        if self.host_engine is None:
            grads = like_params(grads)
            sum_squares, laid_out = (lambda s: s), self._param_shardings  # noqa: E731
        else:  # one device per process: nothing to lay out
            sum_squares, laid_out = self.host_engine.sum_over_stages, None
        new, metrics = make_update(self.parts.params_update, scaler=self.scaler,
                                   sum_squares=sum_squares,
                                   param_shardings=laid_out)(state, grads, host_squares)
        if self.host_engine is None:
            # The offloaded update already lays each new parameter out so, each piece as it
            # writes it; the constraint holds every leaf where the next step expects it.
            new = new.replace(params=like_params(new.params),
                              opt_state=self._laid_out_state(new.opt_state))
        return new, metrics

    def _laid_out_state(self, opt_state):
        """`opt_state` constrained to its shardings (`ParamUpdate.state_shardings`), memory kinds
        left as they are: a piece-wise update leaves the layout of what it writes to GSPMD."""
        shardings = self.parts.params_update.state_shardings(opt_state, self._param_shardings)
        return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(
            x, NamedSharding(s.mesh, s.spec)), opt_state, shardings)

    def _sink_specs(self, blocks) -> Any:
        """How the host stacks of the blocks' gradients are split (`offload_gradients`): over
        `data` too, each copy writing its share of the mean, where the offloaded state is split
        so (`offload.optimizer.share_dimension`), else like the blocks.

        Args:
          blocks: the block parameters (or their gradients), stacked.

        Returns:
          A PartitionSpec per leaf of `blocks`.
        """
        sizes, axis = dict(self.parts.mesh.shape), DATA.name

        def spec(b, s):
            if sizes[axis] == 1 or share_dimension(s, b.shape, axis, sizes, skip=1) is None:
                return s
            return partition_spec(s, b.shape, axis, sizes[axis], 1, sizes)

        return jax.tree.map(spec, blocks, self.specs["blocks"],
                            is_leaf=lambda x: isinstance(x, P) or x is None)

    def _gradient_sink(self, blocks) -> dict:
        """Where the blocks' gradients go in the backward with `offload_gradients`: host stacks
        split as `_sink_specs` says (`scan_exchanging`'s sink; XLA allocates them without
        writing) and their per-layer sums of squares."""
        sink = {"grads": jax.tree.map(lambda b, s: jax.device_put(
            jnp.zeros(b.shape, b.dtype), with_memory_kind(self._named(s), HOST_MEMORY_KIND)),
            blocks, self._sink_specs(blocks), is_leaf=lambda x: isinstance(x, P) or x is None)}
        return {**sink, "squares": jnp.zeros((self.model.num_layers,), jnp.float32)}

    def _train_step_fn(self, engine) -> Callable:
        def train_step(state: TrainState, batch):
            sink = self._gradient_sink(state.params["blocks"]) \
                if self.parts.options.offload_gradients else None
            loss, grads, red, metrics, *squares = self.loss_and_grads(
                state.params, batch, state.loss_scale, state.step_key(), state.reducer, engine,
                sink)
            new, update_metrics = self.update(state, grads, *squares)
            return new.replace(reducer=red), {"loss": loss, **metrics, **update_metrics}

        return train_step

    def _eval(self, params, batch):
        grid = self.parts.grid
        manual = frozenset(batch_axes.manual_axes(grid))
        if not self.engine.manual_axes:  # nothing splits the rows: no shard_map
            with tracing_in(self.parts.mesh):
                return self.loss_fn(params, batch)

        def local(p, b):
            loss = self.loss_fn(ensure_varying(p, tuple(sorted(manual))),
                                batch_axes.lay_out(b, manual, grid))
            return pmean(loss, tuple(sorted(manual)))

        return shard_map(local, mesh=self.parts.mesh,
                         in_specs=(_manual_specs(self.specs, manual), batch_axes.local_spec(manual)),
                         out_specs=P(), axis_names=set(manual))(params, batch)

    @functools.cached_property
    def programs(self) -> tuple[Callable, Callable]:
        """(step, eval_loss): jitted functions, or the host-driven paths' (`step.hosted`).

        The host-driven paths' are callables with the same `.lower(...).compile()` interface.
        """
        if self.host_engine is not None:
            return hosted.engine_programs(self)
        if self.parts.process_reducer is not None:
            return hosted.process_programs(self)
        options = xla_options.compiler_options(self.parts.mesh, self.parts.options.xla_options,
                                               self.engine.gpu_overlap_options)
        return (jax.jit(self._train_step_fn(self.engine), donate_argnums=0,
                        compiler_options=options), jax.jit(self._eval))

    def step(self, state, batch):
        """One train step, `(state, batch) -> (state, metrics)`; `state` is donated.

        Args:
          state: the `TrainState`.
          batch: a batch shaped like the bound one.

        Returns:
          `(state, metrics)`: the new state and `{"loss", per-layer metrics, update metrics}`.
        """
        return self.programs[0](state, batch)

    def lower(self, state, batch):
        """The step program lowered for `state` and `batch`.

        Args:
          state: a `TrainState`, of arrays or ShapeDtypeStructs with shardings.
          batch: a batch shaped like the bound one.

        Returns:
          A `jax.stages.Lowered`, or for the host-driven paths an object with the same
          `.compile()`.
        """
        return self.programs[0].lower(state, batch)

    def eval_loss(self, params, batch):
        """Mean loss of `batch` over all data-parallel copies and processes.

        Args:
          params: the parameters as the state holds them.
          batch: a batch shaped like the bound one.

        Returns:
          The scalar loss.
        """
        return self.programs[1](params, batch)
