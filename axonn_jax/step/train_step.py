"""`make_train_step`: the one train-step builder, for any `StackedModel`, optax optimizer and grid.

A step has three phases:

1. **loss and gradients** of this device's rows: autodiff of `head(blocks(embed(batch)), batch)`,
   or the pipeline engine (`parallel.pipeline`) when the mesh has `pipe > 1`, in a shard_map manual
   over `data` (and `pipe`) and automatic over the tensor axes, whose layers
   (`axonn_jax.parallelize`) bring their own collectives;
2. **the reduction** of the gradients over `data` by a `GradientReducer` (exact or CGX-compressed;
   inside the same shard_map), and, for reducers between processes (MPI), a program of its own;
3. **the update** (`step.update`): clipping, loss scale, non-finite guard, and the optimizer on the
   device or streamed from host memory.

Without a reducer between processes the three phases are one jitted program. An `engine` (the
message-driven MPI pipeline, `transport.mpi_pipeline`) replaces phase 1 by a host loop over
per-microbatch programs.

Batches are pytrees of arrays with a leading batch axis, split over `data` and `depth`.
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

from .._compat import ensure_varying, shard_map, to_varying
from ..config import BATCH_AXES, check_grid
from ..mesh import config_of
from ..offload import activations
from ..offload.optimizer import HostOffloadedOptimizer
from ..offload.precision import DTYPES, check_dtype, loss_scaler, scale_of
from ..parallel import pipeline as pipeline_lib
from . import hosted
from .model import ModelFunctions, StackedModel
from .reducers import GradientReducer, compressed_mean, exact_mean
from .update import initial_state, make_update


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The modes of a train step (see `make_train_step`)."""

    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    offload_optimizer: bool = False
    remat: Any = "none"  # 'none' | 'full' | 'offload' | 'auto' | activations.Plan
    memory_budget_gb: float | None = None
    compress_bits: int = 0
    compress_bucket: int = 1024
    error_feedback: bool = True
    dtype: str = "float32"
    clip_norm: float | None = None
    seed: int = 0


def make_train_step(model: StackedModel, optimizer: optax.GradientTransformation, mesh, *,
                    reducer: GradientReducer | None = None, engine: Callable | None = None,
                    **options) -> "TrainStep":
    """The train step of `model` with `optimizer` on `mesh` (axes `data, pipe, depth, row, col`).

    options (see `StepOptions`):
      microbatches, schedule, virtual_stages: pipeline microbatches and timetable (`gpipe` |
        `1f1b` | `interleaved-1f1b` with `virtual_stages` chunks per device | `zb-h1`), pipe > 1.
      offload_optimizer: fp32 masters and optimizer state in host memory, streamed per layer;
        `optimizer` must then be elementwise (AdamW is), and clipping is `clip_norm`.
      remat: `none` | `full` | `offload` | `auto` (KARMA's planner within `memory_budget_gb`) or an
        `offload.activations.Plan`: what each block keeps for the backward.
      compress_bits, compress_bucket, error_feedback: CGX-compressed gradient mean over `data`.
      dtype: compute dtype (`float32` | `bfloat16` | `float16`): parameters are cast to it for the
        forward (masters stay fp32); float16 scales the loss; mixed precision skips non-finite steps.
      clip_norm: clip the gradients' global norm (None: no clipping); seed: stochastic rounding.
    reducer: a reducer between processes (`transport.mpi`); the gradients are first averaged over
      the local `data` devices exactly. engine: a host-driven gradient phase (the MPI pipeline),
      `engine(bound) -> an object like transport.mpi_pipeline's` (bound: the step bound to a batch
      shape, `BoundStep`: its model functions, stage functions and batch).
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(StepOptions)}
    if unknown:
        raise TypeError(f"make_train_step: unknown options {sorted(unknown)}")
    return TrainStep(model, optimizer, mesh, StepOptions(**options), reducer, engine)


def _cast_floating(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


def _shapes(tree) -> str:
    """`{path: shape}` of a pytree's leaves, for error messages."""
    return str({jax.tree_util.keystr(k): tuple(jnp.shape(v))
                for k, v in jax.tree_util.tree_leaves_with_path(tree)})


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


def _on_device(x, dtype):
    """`x` (e.g. a host-resident fp32 master) as `dtype` in device memory, split like `x`."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding.with_memory_kind("device"))
    return jax.device_put(x, x.sharding.with_memory_kind("device")).astype(dtype)


@functools.lru_cache(maxsize=64)
def _take_program(sharding, index: tuple[int, ...]):
    return jax.jit(lambda x: jnp.take(x, jnp.asarray(index), axis=0), out_shardings=sharding)


def _abstract_batch(batch):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), batch)


class TrainStep:
    """`step(state, batch) -> (state, metrics)` and what a training loop needs around it.

    state: `{'step', 'params', 'opt_state'}` (+ `'precision'` for mixed precision, + `'reducer'`
    when the reducer keeps state, e.g. CGX error-feedback residuals), global arrays: parameters
    split over the tensor axes by their layers and, with `pipe > 1`, the blocks over `pipe` on
    their layer axis; optimizer state placed like its parameters (in `pinned_host` with
    `offload_optimizer`). Batches: pytrees of `(batch, ...)` arrays split over `data` and `depth`.
    The step is compiled for each batch shape it meets (`lower` / `compile` ahead of time).
    """

    def __init__(self, model, optimizer, mesh, options: StepOptions, reducer, engine):
        check_dtype(options.dtype)
        activations.check_options(options.remat, options.memory_budget_gb)
        self.model, self.optimizer, self.mesh, self.options = model, optimizer, mesh, options
        self.grid = config_of(mesh)
        self.process_reducer, self.engine = reducer, engine
        if engine is not None and reducer is None:
            raise ValueError("make_train_step: an engine needs a reducer between processes")
        if self.grid.pipe > 1:
            pipeline_lib.check_schedule(options.schedule, self.grid.pipe, options.microbatches,
                                        options.virtual_stages)
            pipeline_lib.check_layers(model.num_layers, self.grid.pipe, options.virtual_stages)
        elif options.virtual_stages > 1:
            raise ValueError(f"--virtual-stages {options.virtual_stages} needs --pipe > 1")
        if self.grid.pipe > 1 and options.remat == "auto":
            # Every stage runs one program, so a per-layer plan must be uniform.
            raise NotImplementedError("remat='auto' with pipe > 1 is not implemented yet")
        if options.compress_bits and reducer is None and self.grid.data == 1:
            raise ValueError(f"compress_bits={options.compress_bits} needs data > 1: with one "
                             "data-parallel copy there is no gradient exchange to compress")
        self.scaler = loss_scaler(options.dtype)
        self._bound: dict = {}

    # ------------------------------------------------------------------ layer order

    @functools.cached_property
    def layer_order(self):
        """Which model layer each position of the stored `blocks` stack holds (a numpy array), or
        None when they are in order. Interleaved stages store each device's chunks contiguously,
        so that the stack stays split over `pipe` in blocks (`parallel.pipeline.interleave_order`);
        `eval_loss`, checkpoints (`canonical_state`) and `canonical_params` see the model's order."""
        o = self.options
        if self.grid.pipe == 1 or o.virtual_stages == 1:
            return None
        return pipeline_lib.interleave_order(self.model.num_layers, self.grid.pipe,
                                             o.virtual_stages)

    def _reorder(self, tree, to_model: bool, take: Callable | None = None):
        """Every leaf under a `blocks` key whose leading axis is the layer axis, reordered from the
        stored order to the model's (`to_model`) or back; traceable (`take(x, index)`: how to
        reorder a leaf, `jnp.take` on axis 0 by default)."""
        order = self.layer_order
        if order is None:
            return tree
        index = np.argsort(order) if to_model else order
        layers = self.model.num_layers
        take = take or (lambda x, i: jnp.take(x, jnp.asarray(i), axis=0))

        def one(path, x):
            blocks = any(getattr(k, "key", None) == "blocks" for k in path)
            if blocks and getattr(x, "ndim", 0) and x.shape[0] == layers:
                return take(x, index)
            return x

        return jax.tree_util.tree_map_with_path(one, tree)

    def canonical_params(self, params):
        """`params` with the blocks in the model's layer order (for `StackedModel.loss`, sampling)."""
        return self._reorder(params, to_model=True)

    def canonical_state(self, state, inverse: bool = False):
        """The state as checkpoints hold it, so that they restore on any grid and in any mode:
        every block-stacked leaf (parameters, optimizer moments and masters, reducer residuals) in
        the model's layer order, and with `offload_optimizer` the fp32 masters as `params` and the
        inner optimizer state as `opt_state` (the tree of a run without offload). `inverse`: back
        to this step's state from such a tree, whose leaves are placed like
        `canonical_state(this step's state)` (masters in host memory; the compute-dtype parameters
        are made from them). Works on ShapeDtypeStructs too (the layout only). One program per
        leaf, so that host-resident leaves visit the device one at a time."""
        def take(x, i):
            if isinstance(x, jax.ShapeDtypeStruct):
                return x
            return _take_rows(x, tuple(int(j) for j in i))

        offload = self.options.offload_optimizer
        if not inverse:
            state = self._reorder(state, to_model=True, take=take)
            if offload:
                state = {**state, "params": state["opt_state"]["master"],
                         "opt_state": state["opt_state"]["inner"]}
            return state
        state = self._reorder(state, to_model=False, take=take)
        if offload:
            dtype = DTYPES[self.options.dtype]
            master = state["params"]
            state = {**state, "opt_state": {"master": master, "inner": state["opt_state"]},
                     "params": jax.tree.map(lambda m: _on_device(m, dtype), master)}
        return state

    # ------------------------------------------------------------------ binding to a batch shape

    def bind(self, batch) -> "BoundStep":
        """The step's programs for batches shaped like `batch` (built once per shape)."""
        key = jax.tree.structure(batch), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(batch))
        if key not in self._bound:
            self._bound[key] = BoundStep(self, _abstract_batch(batch))
        return self._bound[key]

    # ------------------------------------------------------------------ state and batches

    def init_state(self, key, example_batch, params=None):
        """Fresh state for batches like `example_batch`, created directly in its placement;
        `params`: start from these parameters (a tree like the model's, any placement: e.g. a
        pretrained checkpoint) instead of initializing them from `key`."""
        return self.bind(example_batch).init_state(key, params)

    def abstract_state(self, example_batch):
        """ShapeDtypeStructs of the state with their shardings (nothing allocated)."""
        return self.bind(example_batch).abstract_state()

    def state_shardings(self, example_batch):
        return jax.tree.map(lambda s: s.sharding, self.abstract_state(example_batch))

    def batch_shardings(self, batch):
        """NamedShardings of a batch pytree: leading axis over `data` and `depth`."""
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(BATCH_AXES)), batch)

    def batch_share(self) -> tuple[int, int]:
        """(index, count): this process trains on rows [index·B/count, (index+1)·B/count) of each
        global batch of B rows (count is 1 within one JAX program, the processes of a reducer
        between processes, or the pipelines of an MPI pipeline engine)."""
        if self.engine is not None:
            return self.engine.batch_share
        r = self.process_reducer
        return (0, 1) if r is None else (r.process_index, r.process_count)

    def local_batch(self, batch):
        """This process's share of a global batch (arrays or ShapeDtypeStructs): what the step,
        `init_state` and `eval_loss` are called with."""
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
        """A global host batch (a numpy pytree) as device arrays of this process's share: each
        process builds only the rows its devices hold."""
        local = self.local_batch(host_batch)
        return jax.tree.map(
            lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx]),
            local, self.batch_shardings(local))

    # ------------------------------------------------------------------ running

    def __call__(self, state, batch):
        return self.bind(batch).step(state, batch)

    def lower(self, state, batch):
        return self.bind(batch).lower(state, batch)

    def eval_loss(self, params, batch):
        """Mean loss of `batch` (all data-parallel copies, all processes)."""
        return self.bind(batch).eval_loss(params, batch)


class BoundStep:
    """A `TrainStep` bound to one batch shape: its model functions, plan, shardings, programs."""

    def __init__(self, step: TrainStep, batch):
        self.owner = step
        self.batch = batch  # abstract: this process's share (see TrainStep.local_batch)
        o, grid, mesh = step.options, step.grid, step.mesh
        rows = jax.tree.leaves(batch)[0].shape[0]
        check_grid(grid, batch_size=rows, microbatches=o.microbatches,
                   num_layers=step.model.num_layers)
        self.fns: ModelFunctions = step.model.bind(batch, mesh)
        self.compute_dtype = DTYPES[o.dtype]  # before the plan: `_block_cost` reads it
        self.plan = self._plan()
        self.groups = self.plan.layer_groups(step.model.offload_names) if self.plan else None
        self.offloaded = HostOffloadedOptimizer(
            step.optimizer, self.compute_dtype, step.model.num_layers, num_stages=grid.pipe) \
            if o.offload_optimizer else None
        self.reducer = self._reducer()
        self.specs = self._param_specs()
        self.engine = None if step.engine is None else step.engine(self)
        self._update = make_update(
            step.optimizer, scaler=step.scaler, clip_norm=o.clip_norm, offloaded=self.offloaded,
            all_reduce_squares=self.engine.sum_over_stages if self.engine else lambda s: s)

    # ------------------------------------------------------------------ pieces

    def _plan(self) -> activations.Plan | None:
        o, layers = self.owner.options, self.owner.model.num_layers
        if isinstance(o.remat, activations.Plan) or o.remat != "auto":
            return activations.uniform_plan(o.remat, layers)
        return activations.make_plan(
            layers, int(o.memory_budget_gb * 1e9), self._block_cost(), self._measure_peak,
            activations.device_spec())

    def _block_cost(self) -> activations.BlockCost:
        """One block's costs at this device's share of the activations (`data`, `depth` split)."""
        o, grid = self.owner.options, self.owner.grid
        x = self.fns.activation
        local = jax.ShapeDtypeStruct((x.shape[0] // (grid.data * grid.depth), *x.shape[1:]),
                                     self.compute_dtype if o.dtype != "float32" else x.dtype)
        dtype = self.compute_dtype  # the step casts the parameters to it before the blocks
        one_layer = jax.eval_shape(lambda p: jax.tree.map(lambda a: a[0].astype(dtype), p),
                                   jax.eval_shape(self.fns.init, jax.random.key(0))["blocks"])
        return activations.block_cost(self.fns.block, one_layer, local,
                                      self.owner.model.offload_names)

    def _measure_peak(self, plan: activations.Plan) -> int:
        """Compiled peak bytes per device of this step with activation `plan` (for the planner)."""
        s = self.owner
        other = TrainStep(s.model, s.optimizer, s.mesh,
                          dataclasses.replace(s.options, remat=plan, memory_budget_gb=None),
                          s.process_reducer, s.engine)
        bound = other.bind(self.batch)
        return activations.compiled_peak_bytes(
            bound.lower(bound.abstract_state(), bound.abstract_batch()).compile())

    def _reducer(self) -> GradientReducer:
        o = self.owner.options
        if o.compress_bits and self.owner.process_reducer is None:
            return compressed_mean(self.owner.mesh, self.fns.specs, bits=o.compress_bits,
                                   bucket_size=o.compress_bucket,
                                   error_feedback=o.error_feedback, seed=o.seed)
        return exact_mean()

    def _param_specs(self) -> dict:
        """Every parameter's PartitionSpec on the mesh: the tensor axes from its layer, plus `pipe`
        on the blocks' layer axis."""
        specs = self.fns.specs
        if self.owner.grid.pipe > 1:
            specs = {**specs, "blocks": jax.tree.map(lambda s: P("pipe", *s[1:]), specs["blocks"],
                                                     is_leaf=lambda s: isinstance(s, P))}
        return specs

    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.owner.mesh, spec)

    # ------------------------------------------------------------------ state

    def _init(self, key, params=None):
        s = self.owner
        params = self.fns.init(key) if params is None else params
        params = s._reorder(params, to_model=False)
        if self.engine is not None:
            params = self.engine.stage_params(params)
        state = initial_state(params, optimizer=s.optimizer, scaler=s.scaler,
                              offloaded=self.offloaded)
        reducer = self.state_reducer()
        red = reducer.init(params)
        if red is not None:
            state["reducer"] = red
        return state

    def state_reducer(self) -> GradientReducer:
        """The reducer whose state the train state holds (between processes, or in the step)."""
        return self.owner.process_reducer or self.reducer

    def _state_shardings(self, shapes):
        s = self.owner
        replicated = self._named(P())
        if self.engine is not None:  # one device per process: everything on it
            return jax.tree.map(lambda _: replicated, shapes)
        params = jax.tree.map(self._named, self.specs, is_leaf=lambda x: isinstance(x, P))
        out = {k: jax.tree.map(lambda _: replicated, v) for k, v in shapes.items()}
        out["params"] = params
        if self.offloaded is not None:
            out["opt_state"] = self.offloaded.state_shardings(shapes["opt_state"], params)
        else:
            out["opt_state"] = optax.tree_map_params(
                s.optimizer, lambda leaf, sharding, p: sharding if leaf.shape == p.shape else
                replicated, shapes["opt_state"], params, shapes["params"],
                transform_non_params=lambda _: replicated)
        if "reducer" in shapes:
            spec = self.state_reducer().state_spec
            out["reducer"] = jax.tree.map(lambda p: self._named(spec(p)), self.specs,
                                          is_leaf=lambda x: isinstance(x, P))
        return out

    @functools.cached_property
    def _abstract_state(self):
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        shardings = self._state_shardings(shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, shardings)

    def abstract_state(self):
        """ShapeDtypeStructs of the train state, with their shardings."""
        return self._abstract_state

    def abstract_batch(self):
        """ShapeDtypeStructs of the batch, with their shardings."""
        shardings = self.owner.batch_shardings(self.batch)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.batch, shardings)

    def state_shardings(self):
        return jax.tree.map(lambda a: a.sharding, self._abstract_state)

    def init_state(self, key, params=None):
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

    # ------------------------------------------------------------------ phase 1 and 2

    def loss_fn(self, params, batch):
        """The mean loss of `batch` in the compute dtype (parameters cast for the forward)."""
        fns, dtype = self.fns, self.compute_dtype
        params = _cast_floating(self.owner.canonical_params(params), dtype)
        x = fns.embed(params["embed"], batch).astype(dtype)
        y = fns.run_blocks(params["blocks"], x, self.groups)
        return fns.head(fns.head_params(params), y, batch).astype(jnp.float32)

    def _stage_functions(self, chunk_layers: int | None = None):
        """The pipeline engine's embed, stage and head functions (parameters cast, remat plan); the
        stage function runs one chunk of `chunk_layers` layers (default `num_layers / (pipe ·
        virtual_stages)`)."""
        fns, dtype, o = self.fns, self.compute_dtype, self.owner.options
        layers = chunk_layers or pipeline_lib.check_layers(
            self.owner.model.num_layers, self.owner.grid.pipe, o.virtual_stages)
        groups = None if self.groups is None else ((layers, self.groups[0][1]),)

        def embed(p, batch):
            return fns.embed(_cast_floating(p, dtype), batch).astype(dtype)

        def stage(p, x):
            return fns.run_blocks(_cast_floating(p, dtype), x, groups)

        def head(p, y, batch):
            return fns.head(_cast_floating(p, dtype), y, batch).astype(jnp.float32)

        return embed, stage, head

    def _local_loss_and_grads(self, params, batch, scale, step, red_state):
        """Inside the shard_map: this data shard's loss and gradients, reduced over `data`."""
        grid = self.owner.grid
        if grid.pipe > 1:
            params = ensure_varying(params, ("data", "pipe"))
            embed, stage, head = self._stage_functions()
            o = self.owner.options
            sched = pipeline_lib.make_schedule(o.schedule, grid.pipe, o.microbatches,
                                               o.virtual_stages)
            loss, (g_e, g_b, g_h) = pipeline_lib.pipeline_loss_and_grads(
                embed, stage, lambda p, y, b: head(p, y, b) * scale,
                (params["embed"], params["blocks"], self.fns.head_params(params)), batch, sched)
            g_e, g_h = self.fns.embed_and_head_grads(g_e, g_h)
            grads = {"embed": g_e, "blocks": g_b, "head": g_h}
        else:
            # Varying over `data`: each shard keeps its own gradients until the explicit reduction.
            params = to_varying(params, ("data",))
            loss, grads = jax.value_and_grad(lambda p: self.loss_fn(p, batch) * scale)(params)
        grads, red_state = self.reducer.reduce(grads, red_state, step)
        return self.reducer.mean(loss) / scale, grads, red_state

    def loss_and_grads(self, params, batch, scale, step, red_state):
        """`(params, batch, loss scale, step, reducer state) -> (loss, grads, reducer state)`:
        phases 1 and 2 on global arrays (gradients scaled by `scale`, averaged over `data`)."""
        grid = self.owner.grid
        if grid.pipe == 1 and grid.data == 1 and grid.tensor_parallel_size > 1:
            # Nothing to reduce; and XLA rejects an all-reduce over the size-1 `data` axis of
            # gradients that come out of the tensor-parallel shard_maps.
            loss, grads = jax.value_and_grad(lambda p: self.loss_fn(p, batch) * scale)(params)
            return loss / scale, grads, red_state
        if grid.pipe > 1:
            manual = {"data", "pipe"}
            p_specs = {"embed": P(), "blocks": P("pipe"), "head": P()}
            r_specs = {"embed": P("data"), "blocks": P("data", "pipe"), "head": P("data")}
        else:
            manual, p_specs, r_specs = {"data"}, P(), P("data")
        if red_state is None:
            r_specs = P("data")  # no leaves to match
        return shard_map(self._local_loss_and_grads, mesh=self.owner.mesh,
                         in_specs=(p_specs, P("data"), P(), P(), r_specs),
                         out_specs=(P(), p_specs, r_specs), axis_names=manual)(
            params, batch, scale, step, red_state)

    # ------------------------------------------------------------------ the step

    def update(self, state, grads):
        """Phase 3 (`step.update`) on gradients laid out like their parameters: GSPMD would
        otherwise give a replicated parameter the layout of its gradient (e.g. a position table
        added to feature-split activations), and the state would drift from step to step."""
        if self.engine is None:
            grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g, self._named(s)),
                                 grads, self.specs, is_leaf=lambda x: isinstance(x, P))
        return self._update(state, grads)

    def _train_step(self, state, batch):
        loss, grads, red = self.loss_and_grads(state["params"], batch, scale_of(state),
                                               state["step"], state.get("reducer"))
        new, metrics = self.update(state, grads)
        if red is not None:
            new["reducer"] = red
        return new, {"loss": loss, **metrics}

    def _eval(self, params, batch):
        grid = self.owner.grid
        if grid.data == 1 and grid.pipe == 1:
            return self.loss_fn(params, batch)
        return shard_map(lambda p, b: self.reducer.mean(self.loss_fn(p, b)), mesh=self.owner.mesh,
                         in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"})(params, batch)

    @functools.cached_property
    def programs(self) -> tuple[Callable, Callable]:
        """(step, eval_loss): jitted functions, or for the host-driven paths (`step.hosted`)
        callables with the same `.lower(...).compile()` interface."""
        s = self.owner
        if s.engine is not None:
            return hosted.engine_programs(self)
        if s.process_reducer is not None:
            return hosted.process_programs(self)
        return jax.jit(self._train_step, donate_argnums=0), jax.jit(self._eval)

    def step(self, state, batch):
        return self.programs[0](state, batch)

    def lower(self, state, batch):
        return self.programs[0].lower(state, batch)

    def eval_loss(self, params, batch):
        return self.programs[1](params, batch)
