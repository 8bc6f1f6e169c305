"""The objects of a run, built from its config (`run.options.RunConfig`): the model (a built-in
preset, or the caller's `StackedModel`), the optimizer, the mesh, and the train step with the
transport's parts (the MPI reducer, or the message-driven pipeline engine). The CLI, the loop, the
benchmarks and the tests all build their step here."""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from .. import models
from ..config import ParallelConfig
from ..mesh import make_mesh
from ..models import attention
from ..offload.precision import DTYPES
from ..step.model import StackedModel
from ..step.train_step import TrainStep, make_train_step
from . import options as opts
from .checkpoint import Checkpointer, RankZeroCheckpointer
from .distributed import ENV_NUM_PROCESSES
from .feeds import DOCUMENT_KEYS
from .options import RunConfig, make_optimizer, step_options


@dataclasses.dataclass
class Trainer:
    """A run's train step and what the loop needs around it.

    Attributes:
      options: the run's config, its grid resolved.
      model: the model the step trains.
      step: the train step (`step.train_step.TrainStep`).
      lr_schedule: the learning rate of a step number.
      example_batch: ShapeDtypeStructs of one global batch.
      preset: the built-in model the options name (None for a caller's model).
      is_main: this process reports (metrics, progress).
      make_checkpointer: `(directory, every, **Checkpointer options)` -> the run's checkpointer.
    """

    options: RunConfig
    model: StackedModel
    step: TrainStep
    lr_schedule: Callable[[int], Any]
    example_batch: Any
    preset: models.Preset | None
    is_main: bool
    make_checkpointer: Callable[..., Checkpointer]  # (directory, every, **Checkpointer options)

    def init_state(self, abstract: bool = False):
        """Fresh train state, created in its placement.

        The key comes from `options.run.seed`; the parameters come from the preset's checkpoint
        if it has one (each process reads its slices straight into the parameters' placement).

        Args:
          abstract: return ShapeDtypeStructs with the state's shardings, nothing allocated.

        Returns:
          (TrainState): the state (arrays, or ShapeDtypeStructs when `abstract`).
        """
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
        return self.step.init_state(jax.random.key(self.options.run.seed), self.local_example(),
                                    params)

    def local_example(self):
        """This process's share of the example batch.

        Returns:
          (Any): ShapeDtypeStructs like `example_batch`, the leading (row) dimension cut to
            this process's share.
        """
        return self.step.local_batch(self.example_batch)

    @property
    def bound(self):
        """The step bound to this run's batch shape (`step.train_step.BoundStep`).

        It holds the model functions, the activation plan, the parameter specs and the phases.
        """
        return self.step.bind(self.local_example())

    def place(self, host_batch):
        """A global host batch as this process's device arrays.

        Args:
          host_batch (Any): a numpy pytree of one global batch, shapes like `example_batch`.

        Returns:
          (Any): device arrays of this process's share: rows split over `data`, `expert` and
            `depth`, the sequence (dim 1) over `context`.
        """
        return self.step.place_batch(host_batch)


def lm_example(config: RunConfig):
    """The shapes of a language-model batch of the config's size.

    Args:
      config: the run's config (`data.batch_size`, `data.seq_len`, `data.sources`).

    Returns:
      A dict of int32 ShapeDtypeStructs of shape `(batch_size, seq_len)`: `inputs` and `targets`,
      or, when the config reads document sources, the packed documents' keys
      (`feeds.DOCUMENT_KEYS`, with their segment ids and positions).
    """
    shape = jax.ShapeDtypeStruct((config.data.batch_size, config.data.seq_len), jnp.int32)
    keys = DOCUMENT_KEYS if config.data.sources else ("inputs", "targets")
    return {k: shape for k in keys}


def build_trainer(config: RunConfig, devices=None, *, model: StackedModel | None = None,
                  example_batch=None) -> Trainer:
    """Check `config` against the devices and build the run's train step.

    Every problem of the config is reported at once (`run.options.ConfigError`).

    Args:
      config: the run's config; its grid is resolved here (`run.options.resolve_grid`; `data`
        None fills the devices).
      devices (Sequence[jax.Device] | None): the devices to run on (None: all of JAX's, or
        this process's local devices with `--transport mpi`).
      model: None for the model the config names (language-model batches from the config), or
        any `StackedModel`, whose batches look like `example_batch`.
      example_batch (Any): a global batch (arrays or ShapeDtypeStructs) for a caller's `model`.

    Returns:
      The run's `Trainer`.

    Raises:
      run.options.ConfigError: the config does not fit the devices or the model.
      ValueError: `model` is given with `init_from`, without `example_batch`, or with an
        `--attention` other than `auto`; or, with `--transport mpi`, the MPI world does not
        match the launch or the batch size does not divide over the processes.
      NotImplementedError: an option `--transport mpi --pipe > 1` does not run with.
    """
    num_devices = len(devices) if devices is not None else (
        len(jax.local_devices()) if config.run.transport == "mpi" else jax.device_count())
    if config.grid.data is None:
        config = opts.with_grid(config, opts.resolve_grid(config, num_devices))
    preset, platform = None, (devices or jax.devices())[0].platform
    if model is None:
        # The model's own checks first: the preset must exist to build it.
        opts.check(config, platform=platform)
        preset = opts.preset_of(config)
        dtype = DTYPES[config.precision.dtype]
        if preset.data == "tokens":
            # Over context the kernels are XLA einsums: `auto` means them there, not cuDNN.
            choice = "xla" if config.parallel.context > 1 and config.model.attention == "auto" \
                else config.model.attention
            preset = preset.with_config(
                attention=attention.resolve(choice, dtype,
                                            getattr(preset.config, "head_dim", None), platform),
                context_attention=config.model.context_attention)
        model = preset.build(dtype, config.parallel)
        example_batch = preset.config.example_batch(config.data.batch_size) \
            if preset.data == "images" else lm_example(config)
    elif config.model.init_from:
        raise ValueError("build_trainer: init_from builds the checkpoint's model; pass no model")
    elif example_batch is None:
        raise ValueError("build_trainer: a caller's model needs an example batch")
    elif config.model.attention != "auto":
        raise ValueError(f"--attention {config.model.attention} picks the built-in models' "
                         "attention; a caller's model chooses its own "
                         "(models.attention.causal_attention)")
    optimizer, lr_schedule = make_optimizer(config)
    build = _build_mpi if config.run.transport == "mpi" else _build_xla
    step, is_main, make_checkpointer = build(config, model, optimizer, preset, devices)
    return Trainer(config, model, step, lr_schedule, example_batch, preset, is_main,
                   make_checkpointer)


def _check(config: RunConfig, grid: ParallelConfig, preset, num_layers: int, rows: int,
           devices=None) -> None:
    """Every problem of the config on `grid` (and `devices`) at once (the model's own checks when
    it is built in)."""
    opts.check(config, grid, num_layers=num_layers, rows=rows,
               num_devices=None if devices is None else len(devices),
               platform=None if devices is None else devices[0].platform,
               builtin_model=preset is not None)


def _build_xla(config, model, optimizer, preset, devices):
    grid = config.parallel
    devices = list(devices) if devices is not None else jax.devices()
    _check(config, grid, preset, model.num_layers, config.data.batch_size, devices)
    mesh = make_mesh(grid, devices)
    step = make_train_step(model, optimizer, mesh, **step_options(config))
    return step, jax.process_index() == 0, lambda directory, every, **kw: Checkpointer(
        directory, every, canonical=step.canonical_state, reshard=step.reshard(), **kw)


def refused_with_mpi_pipeline(config: RunConfig) -> str | None:
    """The option `--transport mpi --pipe > 1` does not run, spelled as a flag, or None.

    Args:
      config: the run's config.

    Returns:
      The first such option as its flag (e.g. `--offload-optimizer`), or None when all run.
    """
    c = config.parallel
    m = config.memory
    for flag, used in (("--row/--col/--depth", c.tensor_parallel_size > 1),
                       (f"--data-parallel {c.data} (more than one device per process)", c.data > 1),
                       ("--offload-optimizer", m.offload_optimizer),
                       (f"--remat {m.remat}", m.remat != "none"),
                       ("--memory-budget", m.budget_gb is not None),
                       (f"--compress-bits {config.compression.bits}", config.compression.bits),
                       ("--sample-tokens", config.model.sample_tokens),
                       ("--export-to", config.model.export_to)):  # each process: one stage
        if used:
            return flag
    return None


def _build_mpi(config, model, optimizer, preset, devices):
    """The MPI transport's step: with a pipeline, a process per stage (`_build_mpi_pipeline`);
    otherwise data parallelism between the processes, each process's devices one mesh."""
    from ..transport import mpi, mpi_pipeline

    comm, rank, size = mpi.world()
    launched = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    if size == 1 and launched > 1:
        raise ValueError(f"--transport mpi runs under `mpirun -n P`, but this process is one of "
                         f"{launched} started by `axonn-jax launch` (MPI sees 1); use --transport xla")
    devices = list(devices if devices is not None else jax.local_devices())
    grid, batch_size = config.parallel, config.data.batch_size
    if mpi_pipeline.runs_stages(grid):
        return _build_mpi_pipeline(config, model, optimizer, preset, devices[0], comm, rank)
    if batch_size % size:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the {size} MPI processes")
    _check(config, grid, preset, model.num_layers, batch_size // size)
    if config.compression.bits:  # between the processes; exact over each process's devices
        c = config.compression
        reducer = mpi.mpi_compressed_mean(comm, bits=c.bits, bucket_size=c.bucket,
                                          error_feedback=c.error_feedback, min_size=c.min_size,
                                          rules=c.rules, rounding=c.rounding)
    else:
        reducer = mpi.mpi_mean(comm)
    step = make_train_step(model, optimizer, make_mesh(grid, devices), reducer=reducer,
                           **{**step_options(config), "compress_bits": 0})
    return step, rank == 0, lambda directory, every, **kw: RankZeroCheckpointer(
        directory, every, comm, canonical=step.canonical_state, reshard=step.reshard(), **kw)


def _build_mpi_pipeline(config, model, optimizer, preset, device, comm, rank):
    """A process per pipeline stage, message-driven (`transport.mpi_pipeline`): the processes
    form `data` copies of a `pipe`-stage pipeline, each running its stage on one `device`."""
    from ..transport import mpi_pipeline

    grid, p = config.parallel, config.pipeline
    if flag := refused_with_mpi_pipeline(config):
        raise NotImplementedError(f"{flag} with --transport mpi --pipe > 1 is not implemented yet")
    position = mpi_pipeline.stage_position(comm, grid.pipe)
    _check(config, ParallelConfig(data=position.num_groups, pipe=grid.pipe), preset,
           model.num_layers, config.data.batch_size)
    reducer, engine = mpi_pipeline.mpi_pipeline(position, p.schedule, p.microbatches,
                                                p.virtual_stages)
    step = make_train_step(model, optimizer, make_mesh(ParallelConfig(), [device]),
                           reducer=reducer, engine=engine,
                           **{**step_options(config), "microbatches": 1, "schedule": "1f1b",
                              "virtual_stages": 1})
    stage = f"stage-{position.stage}-of-{position.num_stages}"
    return step, rank == 0, lambda directory, every, **kw: RankZeroCheckpointer(
        pathlib.Path(directory) / stage, every, position.data_comm,
        canonical=step.canonical_state, reshard=step.reshard(), **kw)
