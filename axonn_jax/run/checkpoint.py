"""Orbax checkpoints of the train state, saved cooperatively by all processes."""
from __future__ import annotations

import pathlib

import jax


class Checkpointer:
    """Saves the train state every `every` steps under `directory`; restores the latest one.

    The state is a pytree of global jax.Arrays; each process writes the shards it owns, and restore
    places every array with the sharding (and memory kind) of the template it is given.
    `canonical(state, inverse=False)`: the state as checkpoints hold it (`TrainStep.canonical_state`:
    layers in the model's order, whatever the grid stores), and back with `inverse`.
    """

    def __init__(self, directory: str | pathlib.Path, every: int = 0, keep: int = 3,
                 canonical=None):
        import orbax.checkpoint as ocp

        self.directory = pathlib.Path(directory).absolute()
        self.every = every
        if canonical is not None:
            self.canonical = canonical
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    @staticmethod
    def canonical(state, inverse: bool = False):
        return state

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Save after `step` steps if it is a multiple of `every` (or `force`)."""
        import orbax.checkpoint as ocp

        if not force and (self.every <= 0 or step % self.every):
            return False
        if step == self.latest_step():
            return False
        return self._manager.save(step, args=ocp.args.StandardSave(self.canonical(state)),
                                  force=force)

    def restore(self, template):
        """The latest state, placed like `template` (a pytree of arrays or ShapeDtypeStructs).

        Raises FileNotFoundError when the directory holds no checkpoint.
        """
        import orbax.checkpoint as ocp

        step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {str(self.directory)!r}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template
        )
        try:
            restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # orbax raises many types for mismatched or damaged checkpoints
            raise ValueError(
                f"cannot restore checkpoint step {step} from {str(self.directory)!r} into this model/"
                f"grid (was it written by a different configuration, or is it damaged?): {e}"
            ) from e
        return self.canonical(restored, inverse=True)

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()


class RankZeroCheckpointer(Checkpointer):
    """Checkpoints of a `--transport mpi` job. The processes of `comm` are separate JAX programs
    holding the same replicated state, so its rank 0 writes it (orbax, single-process) and every
    rank reads it."""

    def __init__(self, directory: str | pathlib.Path, every: int, comm, canonical=None):
        import orbax.checkpoint as ocp

        self.rank = comm.Get_rank()
        if canonical is not None:
            self.canonical = canonical
        if self.rank == 0:
            super().__init__(directory, every)
        comm.Barrier()  # the directory exists before the readers open it
        if self.rank != 0:
            self.directory = pathlib.Path(directory).absolute()
            self.every = every
            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(read_only=True))

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        return self.rank == 0 and super().maybe_save(step, state, force)
