"""Gradient reducers between MPI processes (`train --transport mpi`, launched by `mpirun -n P`).

Every process runs the ordinary train step on its own devices (a process-local mesh whose `data`
axis splits this process's rows) and the processes meet only through mpi4jax, in a program of its
own on the process's first device (`step.hosted`):

- `mpi_mean`: the gradient pytree flattened into one vector and averaged with one
  `mpi4jax.allreduce`;
- `mpi_compressed_mean`: CGX's compressed all-reduce across processes (`compression.compressed_psum`
  given MPI's collectives: quantize, `alltoall` of packed chunks, dequantize and sum the owned chunk
  in fp32, re-quantize, `allgather`), each process's error-feedback residual in the reducer state.

Rank r of P trains on rows [r·B/P, (r+1)·B/P) of each global batch of B rows, so the averaged
gradient, and hence the loss trajectory, is that of one process holding the whole batch.
"""
from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ..parallel import compression
from ..step.reducers import STACKED, GradientReducer, compressed_wire_bytes, reshard_residuals


def world():
    """`(comm, rank, size)` of MPI's COMM_WORLD; a clear error when mpi4py/mpi4jax are missing.

    Returns:
      (the communicator, this process's rank, the number of processes).

    Raises:
      ValueError: mpi4py or mpi4jax cannot be imported.
    """
    try:
        import mpi4jax  # noqa: F401  (checked here so a missing build fails before any work)
        from mpi4py import MPI
    except ImportError as e:
        raise ValueError(f"--transport mpi needs mpi4py and mpi4jax (the `mpi` extra): {e}") from None
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def allreduce_sum(tree, comm):
    """The sum of a pytree over the processes of `comm`, as one message (traceable, one device).

    Args:
      tree: a pytree of arrays on this process's one device.
      comm: an MPI communicator.

    Returns:
      The summed pytree (`tree` itself with one process).
    """
    import mpi4jax
    from mpi4py import MPI

    if comm.Get_size() == 1:
        return tree
    flat, unravel = ravel_pytree(tree)
    return unravel(mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm))


def mpi_mean(comm) -> GradientReducer:
    """The exact mean over the processes of `comm`: one allreduce of the flattened gradients.

    Args:
      comm: an MPI communicator.

    Returns:
      The `GradientReducer` (no state).
    """
    size = comm.Get_size()
    mean = lambda tree: jax.tree.map(lambda x: x / size, allreduce_sum(tree, comm))  # noqa: E731
    return GradientReducer(init=lambda params: None,
                           reduce=lambda grads, state, key: (mean(grads), state), mean=mean,
                           between_processes=True, process_index=comm.Get_rank(),
                           process_count=size)


def mpi_collectives(comm) -> compression.Collectives:
    """The collectives `compression.compressed_psum` needs, between the processes of `comm`.

    Args:
      comm: an MPI communicator.

    Returns:
      Sum, all-to-all and all-gather on single-device arrays (this process is member `rank`).
    """
    import mpi4jax

    return compression.Collectives(comm.Get_size(), comm.Get_rank(),
                                   lambda xs: allreduce_sum(xs, comm),
                                   lambda a: mpi4jax.alltoall(a, comm=comm),
                                   lambda a: mpi4jax.allgather(a, comm=comm))


def mpi_compressed_mean(comm, *, bits: int, bucket_size: int = compression.DEFAULT_BUCKET_SIZE,
                        error_feedback: bool = True,
                        min_size: int = compression.DEFAULT_MIN_SIZE, rules=(),
                        rounding: str = "auto") -> GradientReducer:
    """CGX's compressed mean over the processes of `comm`.

    In a checkpoint the residuals of all processes are one leaf `[processes, *shape]` per
    parameter (the layout of the one-program trainer's residuals, one per data-parallel device),
    gathered to rank 0, which writes; on restore each rank takes its own, re-split as the
    one-program residuals are when the number of processes changed.

    Args:
      comm: an MPI communicator.
      bits: the compressed width.
      bucket_size: values per quantization bucket.
      error_feedback: keep this process's residual (like the parameters) as the reducer state.
      min_size: with `rules` and `rounding`: which tensors are compressed at which width and how
        values are rounded, as `step.reducers.compressed_mean` takes them.
      rules: see `min_size`.
      rounding: see `min_size` (stochastic noise from the step's key).

    Returns:
      The `GradientReducer`.

    Raises:
      ValueError: bad `bits`, `bucket_size`, `rules` or `rounding` (`compression`'s checks).
    """
    compression.check_args(bits, bucket_size)
    overrides = compression.parse_rules(rules)
    stochastic = compression.stochastic(rounding, error_feedback)
    collectives = mpi_collectives(comm)
    exact = mpi_mean(comm)
    rank, size = comm.Get_rank(), comm.Get_size()

    def init(params):
        return jax.tree.map(jnp.zeros_like, params) if error_feedback else None

    def reduce(grads, residual, key):
        return compression.compressed_pmean(grads, collectives, bits=bits, bucket_size=bucket_size,
                                            min_size=min_size, overrides=overrides,
                                            stacked=STACKED, key=key if stochastic else None,
                                            residual=residual)

    def saved(residual):
        """`[processes, *shape]` leaves of every rank's residual (ShapeDtypeStructs alike); only
        rank 0 gets the values (collective: every rank calls it)."""
        if residual is None:
            return None
        if isinstance(jax.tree.leaves(residual)[0], jax.ShapeDtypeStruct):
            return jax.tree.map(lambda r: jax.ShapeDtypeStruct((size, *r.shape), r.dtype,
                                                               sharding=r.sharding), residual)
        gathered = comm.gather(jax.tree.map(np.asarray, residual), root=0)
        if rank != 0:
            return residual  # not saved
        return jax.tree.map(lambda r, *ranks: jax.device_put(np.stack(ranks), r.sharding),
                            residual, *gathered)

    def from_saved(stacked):
        if stacked is None or isinstance(jax.tree.leaves(stacked)[0], jax.ShapeDtypeStruct):
            return None if stacked is None else jax.tree.map(
                lambda r: jax.ShapeDtypeStruct(r.shape[1:], r.dtype, sharding=r.sharding), stacked)
        return jax.tree.map(lambda r: jax.device_put(r[rank], r.sharding), stacked)

    return exact._replace(init=init, reduce=reduce, saved=saved, from_saved=from_saved,
                          reshard=reshard_residuals,
                          wire_bytes=compressed_wire_bytes(bits, bucket_size, min_size,
                                                           overrides))
