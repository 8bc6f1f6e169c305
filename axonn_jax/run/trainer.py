"""The objects of a run, built from `TrainOptions`: the model (a built-in preset, or the caller's
`StackedModel`), the optimizer, the mesh, and the train step with the transport's parts (the MPI
reducer, or the message-driven pipeline engine). The CLI, the loop, the benchmarks and the tests
all build their step here."""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .. import models
from ..models import attention
from ..config import ParallelConfig, check_grid
from ..mesh import make_mesh
from ..offload.precision import DTYPES
from ..step.model import StackedModel
from ..step.train_step import TrainStep, make_train_step
from .checkpoint import Checkpointer, RankZeroCheckpointer
from .distributed import ENV_NUM_PROCESSES
from .options import TrainOptions, make_optimizer


@dataclasses.dataclass
class Trainer:
    """A run's train step and what the loop needs around it.

    example_batch: ShapeDtypeStructs of one global batch; `preset`: the built-in model the options
    name (None for a caller's model); `is_main`: this process reports (metrics, progress).
    """

    options: TrainOptions
    model: StackedModel
    step: TrainStep
    lr_schedule: Callable[[int], Any]
    example_batch: Any
    preset: models.Preset | None
    is_main: bool
    make_checkpointer: Callable[..., Checkpointer]  # (directory, every, **Checkpointer options)

    def init_state(self, abstract: bool = False):
        """Fresh state (from `options.seed`, parameters from the preset's checkpoint if it has
        one), created in its placement (`abstract`: ShapeDtypeStructs with those shardings,
        nothing allocated)."""
        if abstract:
            return self.step.abstract_state(self.local_example())
        params = None
        if self.preset is not None and self.preset.checkpoint:
            # Read straight into the parameters' placement: each process reads its slices.
            bound = self.bound
            shapes = jax.eval_shape(bound.fns.init, jax.random.key(0))
            abstract = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=NamedSharding(self.step.mesh, spec)), shapes, bound.specs)
            params = models.load_pretrained(self.preset, abstract)
        return self.step.init_state(jax.random.key(self.options.seed), self.local_example(), params)

    def local_example(self):
        """This process's share of the example batch (ShapeDtypeStructs)."""
        return self.step.local_batch(self.example_batch)

    @property
    def bound(self):
        """The step bound to this run's batch shape: its model functions, activation plan,
        parameter specs and phases (`step.train_step.BoundStep`)."""
        return self.step.bind(self.local_example())

    def place(self, host_batch):
        """A global host batch as this process's device arrays."""
        return self.step.place_batch(host_batch)


def lm_example(options: TrainOptions):
    """The shapes of a language-model batch of the options' size."""
    shape = jax.ShapeDtypeStruct((options.batch_size, options.seq_len), jnp.int32)
    return {"inputs": shape, "targets": shape}


def build_trainer(options: TrainOptions, devices=None, *, model: StackedModel | None = None,
                  example_batch=None) -> Trainer:
    """Validate `options` against the devices and build the run's train step.

    model: None for the preset `options.model` (language-model batches from `options`), or any
    `StackedModel`, whose batches look like `example_batch` (a global batch: arrays or
    ShapeDtypeStructs).
    """
    preset = None
    if model is None:
        preset = models.pretrained(options.init_from) if options.init_from else \
            models.get(options.model)
    if preset is not None and preset.data == "images":
        model = preset.build(DTYPES[options.dtype], options.parallel)
        example_batch = preset.config.example_batch(options.batch_size)
    elif preset is not None:
        if options.seq_len > preset.config.max_seq_len:
            raise ValueError(f"--seq-len {options.seq_len} exceeds {preset.name}'s max_seq_len "
                             f"{preset.config.max_seq_len}")
        head_dim = getattr(preset.config, "head_dim", None)
        # `auto` means what the devices' platform runs (e.g. cuDNN on abstract H100s from a CPU host)
        platform = (devices or jax.devices())[0].platform
        preset = preset.with_config(attention=attention.resolve(
            options.attention, DTYPES[options.dtype], head_dim, platform))
        model = preset.build(DTYPES[options.dtype], options.parallel)
        example_batch = lm_example(options)
    elif options.init_from:
        raise ValueError("build_trainer: init_from builds the checkpoint's model; pass no model")
    elif example_batch is None:
        raise ValueError("build_trainer: a caller's model needs an example batch")
    elif options.attention != "auto":
        raise ValueError(f"--attention {options.attention} picks the built-in models' attention; "
                         "a caller's model chooses its own (models.attention.causal_attention)")
    optimizer, lr_schedule = make_optimizer(options)
    build = _build_mpi if options.transport == "mpi" else _build_xla
    step, is_main, make_checkpointer = build(options, model, optimizer, preset, devices)
    return Trainer(options, model, step, lr_schedule, example_batch, preset, is_main,
                   make_checkpointer)


def _check(options: TrainOptions, grid: ParallelConfig, preset, num_layers: int, batch_size: int):
    check_grid(grid, batch_size=batch_size, microbatches=options.microbatches,
               num_layers=num_layers, flags=True)
    if preset is not None and grid.tensor_parallel_size > 1:
        preset.check_grid(grid)


def _build_xla(options, model, optimizer, preset, devices):
    mesh = make_mesh(options.parallel, devices)
    _check(options, options.parallel, preset, model.num_layers, options.batch_size)
    step = make_train_step(model, optimizer, mesh, **options.step_options())
    return step, jax.process_index() == 0, lambda directory, every, **kw: Checkpointer(
        directory, every, canonical=step.canonical_state, **kw)


def refused_with_mpi_pipeline(options: TrainOptions) -> str | None:
    """The option `--transport mpi --pipe > 1` does not run, spelled as a flag, or None."""
    c = options.parallel
    for flag, used in (("--row/--col/--depth", c.tensor_parallel_size > 1),
                       (f"--data-parallel {c.data} (more than one device per process)", c.data > 1),
                       ("--offload-optimizer", options.offload_optimizer),
                       (f"--remat {options.remat}", options.remat != "none"),
                       ("--memory-budget", options.memory_budget_gb is not None),
                       (f"--compress-bits {options.compress_bits}", options.compress_bits),
                       ("--sample-tokens", options.sample_tokens)):
        if used:
            return flag
    return None


def _build_mpi(options, model, optimizer, preset, devices):
    from ..transport import mpi, mpi_pipeline

    comm, rank, size = mpi.world()
    launched = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    if size == 1 and launched > 1:
        raise ValueError(f"--transport mpi runs under `mpirun -n P`, but this process is one of "
                         f"{launched} started by `axonn-jax launch` (MPI sees 1); use --transport xla")
    devices = list(devices if devices is not None else jax.local_devices())
    step_options = options.step_options()
    grid = options.parallel
    if grid.pipe > 1:  # a process per pipeline stage, message-driven
        if flag := refused_with_mpi_pipeline(options):
            raise NotImplementedError(f"{flag} with --transport mpi --pipe > 1 is not implemented yet")
        position = mpi_pipeline.stage_position(comm, grid.pipe)
        # The processes form `data` copies of a `pipe`-stage pipeline.
        check_grid(ParallelConfig(data=position.num_groups, pipe=grid.pipe),
                   batch_size=options.batch_size, microbatches=options.microbatches,
                   num_layers=model.num_layers, flags=True)
        reducer, engine = mpi_pipeline.mpi_pipeline(position, options.schedule, options.microbatches,
                                                    options.virtual_stages)
        step = make_train_step(model, optimizer, make_mesh(ParallelConfig(), devices[:1]),
                               reducer=reducer, engine=engine,
                               **{**step_options, "microbatches": 1, "schedule": "1f1b",
                                  "virtual_stages": 1})
        stage = f"stage-{position.stage}-of-{position.num_stages}"
        return step, rank == 0, lambda directory, every, **kw: RankZeroCheckpointer(
            pathlib.Path(directory) / stage, every, position.data_comm, **kw)
    if options.batch_size % size:
        raise ValueError(f"--batch-size {options.batch_size} is not divisible by the {size} MPI "
                         "processes")
    _check(options, grid, preset, model.num_layers, options.batch_size // size)
    if options.compress_bits:  # between the processes; exact over each process's devices
        reducer = mpi.mpi_compressed_mean(comm, bits=options.compress_bits,
                                          bucket_size=options.compress_bucket,
                                          error_feedback=options.error_feedback, seed=options.seed)
    else:
        reducer = mpi.mpi_mean(comm)
    step = make_train_step(model, optimizer, make_mesh(grid, devices), reducer=reducer,
                           **{**step_options, "compress_bits": 0})
    return step, rank == 0, lambda directory, every, **kw: RankZeroCheckpointer(
        directory, every, comm, canonical=step.canonical_state, **kw)
