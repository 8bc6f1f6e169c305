"""The data-parallel gradient exchange as MPI messages between processes (`train --transport mpi`).

Launched by `mpirun -n P axonn-jax train --transport mpi ...`: every process runs the ordinary
train step on its own devices (`--devices K` of them, a process-local mesh whose `data` axis splits
this process's rows) and the processes meet only through mpi4jax. A step is three compiled programs:

1. local loss and gradients, averaged over the process's devices (the `Trainer.loss_and_grads` of
   every other path, jitted on the local mesh);
2. the exchange on the process's first device (mpi4jax works on process-local, single-device
   arrays, and ordered effects cannot run on several devices in one program): the gradient pytree
   flattened into one vector and averaged over the processes with one `mpi4jax.allreduce`, or with
   `--compress-bits` CGX's compressed all-reduce across processes (`compression.compressed_psum`
   given MPI's collectives: quantize, `alltoall` of packed chunks, dequantize and sum the owned
   chunk in fp32, re-quantize, `allgather`), each process's error-feedback residual in its state;
3. the optimizer update (`Trainer.apply_grads`) on the local mesh.

Rank r of P trains on rows [r·B/P, (r+1)·B/P) of each global batch of B rows, so the averaged
gradient, and hence the loss trajectory, is that of one process holding the whole batch.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import data as data_lib
from ..checkpoint import Checkpointer
from ..distributed import ENV_NUM_PROCESSES
from ..offload import precision
from . import compression
from ..train import Trainer, TrainOptions, build_trainer


def world():
    """`(comm, rank, size)` of MPI's COMM_WORLD; a clear error when mpi4py/mpi4jax are missing."""
    try:
        import mpi4jax  # noqa: F401  (checked here so a missing build fails before any work)
        from mpi4py import MPI
    except ImportError as e:
        raise ValueError(f"--transport mpi needs mpi4py and mpi4jax (the `mpi` extra): {e}") from None
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def make_gradient_reducer(comm) -> Callable[[jax.Array], jax.Array]:
    """`reduce(v) -> mean of v over the processes of comm`, traceable, for a 1-D single-device `v`."""
    import mpi4jax
    from mpi4py import MPI

    size = comm.Get_size()

    def reduce(v):
        return mpi4jax.allreduce(v, op=MPI.SUM, comm=comm) / size

    return reduce


def exchange_fn(reduce: Callable) -> Callable:
    """`(loss, grads) -> (loss, grads)` averaged over processes: one message for the whole pytree."""

    def exchange(loss, grads):
        flat, unravel = ravel_pytree((loss, grads))
        return unravel(reduce(flat))

    return exchange


def mpi_collectives(comm) -> compression.Collectives:
    """The collectives `compression.compressed_psum` needs, between the processes of `comm`, on
    single-device arrays (this process is member `rank`)."""
    import mpi4jax
    from mpi4py import MPI

    def psum(xs):  # one message for all the exactly-reduced tensors
        flat, unravel = ravel_pytree(xs)
        return unravel(mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm))

    return compression.Collectives(comm.Get_size(), comm.Get_rank(), psum,
                                   lambda a: mpi4jax.alltoall(a, comm=comm),
                                   lambda a: mpi4jax.allgather(a, comm=comm))


def compressed_exchange_fn(comm, options: TrainOptions) -> Callable:
    """`(loss, grads, residual, step) -> (loss, grads, residual)`: the loss averaged exactly, the
    gradients with CGX compression (`options.compress_bits`, `compress_bucket`) across the
    processes of `comm`. residual: None, or this process's error-feedback residual (like `grads`).
    Without error feedback, rounding is stochastic with noise from (seed, step, rank)."""
    reduce_loss = make_gradient_reducer(comm)
    collectives = mpi_collectives(comm)

    def exchange(loss, grads, residual, step):
        key = None if residual is not None else \
            jax.random.fold_in(jax.random.key(options.seed), step)
        grads, residual = compression.compressed_pmean(
            grads, collectives, bits=options.compress_bits, bucket_size=options.compress_bucket,
            key=key, residual=residual)
        return reduce_loss(jnp.reshape(loss, (1,)))[0], grads, residual

    return exchange


@dataclasses.dataclass
class CompiledMpiStep:
    """The three programs of one step; called like a compiled `Trainer.train_step`.

    The exchange stays a `jax.jit` function: an ahead-of-time compiled program with mpi4jax's ordered
    effects fails from its second call on ("supplied 22 arguments but compiled program expected 23":
    the effect token is not threaded through a `Compiled` object in JAX 0.10.2).
    """

    grads: Callable
    exchange: Callable
    exchange_hlo: str
    update: Callable
    first_device: jax.Device
    replicated: NamedSharding
    compressed: bool = False

    def __call__(self, state, batch):
        loss, grads, _ = self.grads(state["params"], batch, precision.scale_of(state),
                                    state["step"], None)
        if not self.compressed:
            loss, grads = self.exchange(*jax.device_put((loss, grads), self.first_device))
            return self.update(state, *jax.device_put((loss, grads), self.replicated))
        out = self.exchange(*jax.device_put((loss, grads, state.get("compression"), state["step"]),
                                            self.first_device))
        return self.update(state, *jax.device_put(out, self.replicated))

    def as_text(self) -> str:
        return "\n\n".join((self.grads.as_text(), self.exchange_hlo, self.update.as_text()))

    def memory_analysis(self):
        """Of the gradient program, the one that holds the activations."""
        return self.grads.memory_analysis()


@dataclasses.dataclass
class MpiTrainStep:
    """`step(state, batch) -> (state, metrics)` with the gradient exchange over MPI between
    processes. State arrays are replicated over the local mesh; `batch` holds this process's rows."""

    trainer: Trainer
    reduce: Callable
    compressed_exchange: Callable | None = None
    _compiled: CompiledMpiStep | None = dataclasses.field(default=None, repr=False)

    def lower(self, state, batch):
        return _Lowered(self, state, batch)

    def compile(self, state, batch) -> CompiledMpiStep:
        mesh = self.trainer.mesh
        first = mesh.devices.flat[0]
        replicated = NamedSharding(mesh, P())
        scale = precision.scale_of(state)
        args = (state["params"], batch, scale, state["step"], None)
        grads = jax.jit(self.trainer.loss_and_grads).lower(*args).compile()
        out = jax.eval_shape(self.trainer.loss_and_grads, *args)[:2]
        on = lambda sharding: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), out)
        single = jax.sharding.SingleDeviceSharding(first)
        if self.compressed_exchange is None:
            exchange = jax.jit(exchange_fn(self.reduce))
            exchange_hlo = exchange.lower(*on(single)).compile().as_text()
            update = jax.jit(self.trainer.apply_grads, donate_argnums=0).lower(
                state, *on(replicated)).compile()
            return CompiledMpiStep(grads, exchange, exchange_hlo, update, first, replicated)
        residual = state.get("compression")
        place = lambda tree, sharding: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
        exchange = jax.jit(self.compressed_exchange)
        exchange_hlo = exchange.lower(*on(single), place(residual, single),
                                      place(state["step"], single)).compile().as_text()
        update = jax.jit(self.trainer.apply_grads, donate_argnums=0).lower(
            state, *on(replicated), place(residual, replicated)).compile()
        return CompiledMpiStep(grads, exchange, exchange_hlo, update, first, replicated,
                               compressed=True)

    def __call__(self, state, batch):
        if self._compiled is None:  # shapes are fixed for a run: compile once
            self._compiled = self.compile(state, batch)
        return self._compiled(state, batch)


@dataclasses.dataclass
class _Lowered:
    step: MpiTrainStep
    state: object
    batch: object

    def compile(self) -> CompiledMpiStep:
        return self.step.compile(self.state, self.batch)


@dataclasses.dataclass
class MpiTrainer(Trainer):
    """A `Trainer` for process `rank` of `size`: its mesh holds this process's devices only, its
    batches this process's rows of the global batch of `global_batch_size`."""

    rank: int = 0
    size: int = 1
    global_batch_size: int = 0
    keeps_residual: bool = False  # compressed exchange with error feedback

    def init_state(self, abstract: bool = False):
        """The local trainer's state; with compression and error feedback plus `'compression'`:
        this process's residual, zeros like the parameters and placed like them (each process
        keeps its own)."""
        state = super().init_state(abstract)
        if self.keeps_residual:
            zeros = lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding)  # noqa: E731
            like = lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding)  # noqa: E731
            state["compression"] = jax.tree.map(like if abstract else zeros, state["params"])
        return state

    def batch(self, tokens: np.ndarray, step: int, seed_offset: int = 0):
        """Rows `[rank·b, (rank+1)·b)` (b = global batch / size) of global batch `step`, split over
        the local `data` axis: `(b, seq_len + 1)` int32."""
        o = self.options
        offsets = data_lib.batch_offsets(len(tokens), o.seed + seed_offset, step,
                                         self.global_batch_size, o.seq_len)
        mine = offsets.reshape(self.size, -1)[self.rank]
        return jax.make_array_from_callback(
            (len(mine), o.seq_len + 1), self.batch_sharding,
            lambda idx: data_lib.batch_rows(tokens, mine[idx[0]], o.seq_len))


def build_mpi_trainer(options: TrainOptions, devices=None) -> MpiTrainer:
    """The trainer of this MPI process: `options.parallel` is the grid of one process's devices
    (default: all its local devices), and the global data-parallel size is `data × processes`."""
    if options.compress_bits:
        compression.check_args(options.compress_bits, options.compress_bucket)
        if options.error_feedback and options.checkpoint_dir:
            raise NotImplementedError(
                "--transport mpi --compress-bits with error feedback and --checkpoint-dir is not "
                "implemented yet (rank 0 alone writes the checkpoint, and each process's residual "
                "differs); add --no-error-feedback")
    comm, rank, size = world()
    launched = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    if size == 1 and launched > 1:
        raise ValueError(f"--transport mpi runs under `mpirun -n P`, but this process is one of "
                         f"{launched} started by `axonn-jax launch` (MPI sees 1); use --transport xla")
    if options.parallel.pipe > 1:  # a process per pipeline stage, message-driven
        from .mpi_pipeline import build_pipeline_trainer

        return build_pipeline_trainer(options, comm)
    if options.batch_size % size:
        raise ValueError(f"--batch-size {options.batch_size} is not divisible by the {size} MPI "
                         "processes")
    reduce = make_gradient_reducer(comm)
    # Inside a process the gradients are averaged exactly over its devices; only the exchange
    # between processes is compressed.
    local = dataclasses.replace(options, batch_size=options.batch_size // size, compress_bits=0)
    base = build_trainer(local, devices if devices is not None else jax.local_devices())
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer)}
    trainer = MpiTrainer(**fields, rank=rank, size=size, global_batch_size=options.batch_size,
                         keeps_residual=bool(options.compress_bits and options.error_feedback))
    trainer.train_step = MpiTrainStep(base, reduce, compressed_exchange_fn(comm, options)
                                      if options.compress_bits else None)
    first = base.mesh.devices.flat[0]
    mean_loss = jax.jit(lambda loss: reduce(jnp.reshape(loss, (1,)))[0])
    trainer.eval_loss = lambda params, batch: mean_loss(
        jax.device_put(base.eval_loss(params, batch), first))
    return trainer


class RankZeroCheckpointer(Checkpointer):
    """Checkpoints of a `--transport mpi` job. The processes of `comm` (default: all) are separate
    JAX programs holding the same replicated state, so its rank 0 writes it (orbax, single-process)
    and every rank reads it."""

    def __init__(self, directory: str | pathlib.Path, every: int = 0, keep: int = 3, comm=None):
        import orbax.checkpoint as ocp

        comm = comm or world()[0]
        self.rank = comm.Get_rank()
        if self.rank == 0:
            super().__init__(directory, every, keep)
        comm.Barrier()  # the directory exists before the readers open it
        if self.rank != 0:
            self.directory = pathlib.Path(directory).absolute()
            self.every = every
            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(read_only=True))

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        return self.rank == 0 and super().maybe_save(step, state, force)
