"""Orbax checkpoints of the train state, saved cooperatively by all processes.

A step directory holds two items, three with a stateful data feed: `state` (the train state as
`TrainStep.canonical_state` gives it: layers in the model's order and the optimizer state of a run
without offload, so that it restores on any grid, device count and process count, with or without
`--offload-optimizer`), `meta` (JSON: the step, the run's seed and a checksum of every leaf) and
`data` (JSON: the position of a feed of documents, `run.feeds`, whose next batch is the one after
the step). Saves are orbax's: atomic (written into a temporary directory that is renamed when
complete) and asynchronous (the state is copied to host memory, then written in a background thread
while training goes on).

`restore` tries the newest step first and falls back to older ones when a step is damaged (files
missing, truncated or overwritten, a garbage manifest, a checksum that differs, non-finite values),
with a one-line note naming the step it skipped (renamed to `STEP.damaged`, so that a later save of
the same step is possible); a step without a readable data position where a stateful feed needs
one is damaged alike. A checkpoint of another model, or a data position of other data (another
mixture, seed, seq_len, global batch...), is an error, not a fallback.
"""
from __future__ import annotations

import functools
import logging
import pathlib
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

STATE, META, DATA = "state", "meta", "data"
DAMAGED = ".damaged"


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the model (another model, not a damaged step)."""


class DamagedStep(ValueError):
    """One step of the checkpoint directory cannot be used."""


def _short(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message, shortened (orbax and TensorStore errors run to
    many lines)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(". See full TensorStore details")[0]
    if text.startswith("Encountered error while reading array"):
        text = "a data file is missing or unreadable (" + text[len("Encountered "):] + ")"
    return text if len(text) <= limit else text[:limit] + "..."


@functools.partial(jax.jit, static_argnums=1)
def _digest_program(x, kind: str):
    if kind == "b":
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if kind == "f" else jnp.bool_(True)
    return jnp.sum(bits, dtype=jnp.uint32), finite


def digests(tree) -> dict[str, tuple[int, bool]]:
    """The checksum of every array leaf and whether all its values are finite.

    The checksum is the wrap-around uint32 sum of the leaf's bits (exact whatever the sharding
    or summation order). One small program per leaf, each finished before the next starts:
    host-resident leaves visit the device one at a time, and independent programs with
    all-reduces never run together (on XLA:CPU they can take all of its threads and deadlock).

    Args:
      tree: a pytree of global jax.Arrays, any sharding or memory kind; leaves that are not
        arrays or whose items are not 1, 2 or 4 bytes are skipped.

    Returns:
      `{path: (checksum, finite)}`, the path as `jax.tree_util.keystr` spells it.
    """
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(x, jax.Array) or jnp.dtype(x.dtype).itemsize not in (1, 2, 4):
            continue
        if x.sharding.memory_kind not in (None, "device"):
            x = jax.device_put(x, x.sharding.with_memory_kind("device"))
        kind = "f" if jnp.issubdtype(x.dtype, jnp.floating) else \
            "b" if x.dtype == jnp.bool_ else "i"
        checksum, finite = _digest_program(x, kind)
        out[jax.tree_util.keystr(path)] = (int(checksum), bool(finite))
    return out


def _with_fields(state, template, keys):
    """`state` with the fields `keys` taken from `template` (TrainStates or dicts)."""
    if isinstance(state, dict):
        return {**state, **{k: template[k] for k in keys}}
    return state.replace(**{k: getattr(template, k) for k in keys})


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves the train state every `every` steps; restores the newest step that restores.

    See the module docstring for what a step holds and how damaged steps are skipped. The state
    is a pytree of global jax.Arrays; each process writes the shards it owns, and restore places
    every array with the sharding (and memory kind) of the template it is given, each process
    reading the shards its devices hold.

    Args:
      directory: where the steps go (created; an existing file is a ValueError).
      every: save after each multiple of this many steps (0: only forced saves).
      keep: the newest `keep` steps are kept (at least 1).
      keep_every: and every step that is a multiple of it, forever (0: none).
      canonical: `canonical(state, inverse=False)`: the state as checkpoints hold it (a dict of
        its fields) and back (`TrainStep.canonical_state`); None: the state as it is.
      reshard: `{field: reshard(saved, target) -> (value | None, note)}` for fields whose saved
        shapes may differ from this run's (`TrainStep.reshard`: the reducer's residuals on
        another data-parallel size); such a field is read as saved, replicated, and handed to
        its function (None: it starts from the template's values).
      info: JSON values saved beside the state (e.g. the seed, which with the step fixes the
        data position and every random choice).
      note: `note(text)` prints one-line notes (default: standard error).
      read_only: open the directory to read only (no saves, nothing created).
      asynchronous: `maybe_save` returns once the state is copied to host memory (False: once
        it is written).
      data: the run's feed (`run.feeds`): when it is `stateful`, its `state()` is saved as the
        item `data` and restored with its `restore(state)` (a ValueError: the step is damaged; a
        CheckpointMismatch: an error).
    """

    def __init__(self, directory: str | pathlib.Path, every: int = 0, keep: int = 3,
                 keep_every: int = 0, canonical=None, reshard: dict | None = None,
                 info: dict | None = None,
                 note: Callable[[str], None] | None = None, read_only: bool = False,
                 asynchronous: bool = True, data=None):
        import orbax.checkpoint as ocp

        self.directory = pathlib.Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"--checkpoint-dir {str(directory)!r} is a file, not a directory")
        if keep < 1 or keep_every < 0:
            raise ValueError(f"--keep must be at least 1 and --keep-every at least 0, got {keep} "
                             f"and {keep_every}")
        self.every = every
        self._canonical = canonical or (lambda state, inverse=False: state)
        self.reshard = dict(reshard or {})
        self.info = dict(info or {})
        self.data = data if getattr(data, "stateful", False) else None
        self.note = note or (lambda text: print(text, file=sys.stderr))
        _quiet_orbax()
        options = ocp.CheckpointManagerOptions(read_only=True) if read_only else \
            ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every or None,
                                         create=True, enable_async_checkpointing=asynchronous)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=(STATE, META, DATA),
                item_handlers={STATE: ocp.PyTreeCheckpointHandler(),
                               META: ocp.JsonCheckpointHandler(),
                               DATA: ocp.JsonCheckpointHandler()})
        except OSError as e:
            raise ValueError(f"--checkpoint-dir {str(directory)!r}: {_short(e)}") from None

    def canonical(self, state, inverse: bool = False):
        """The state as the checkpoint holds it, or back; also on ShapeDtypeStructs.

        Args:
          state: a train state (or, with `inverse`, the checkpoint's dict of its fields).
          inverse: convert the checkpoint's form back to the train state.

        Returns:
          The converted pytree.
        """
        return self._canonical(state, inverse=inverse)

    def latest_step(self) -> int | None:
        """The newest saved step, or None when the directory holds none.

        Returns:
          The step number, or None.
        """
        return self._manager.latest_step()

    @property
    def is_writer(self) -> bool:
        """This process renames damaged steps (all processes write their shards)."""
        return jax.process_index() == 0

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Save the state after `step` steps if it is a multiple of `every` (or `force`).

        A state with non-finite values is not saved (a note says so), so that it never replaces
        good steps; a step already saved is not saved again.

        Args:
          step: the steps taken.
          state: the train state (global jax.Arrays in their placement).
          force: save whatever `every` says.

        Returns:
          Whether a save started.
        """
        if not self._due(step, force) or step == self.latest_step():
            return False
        return self._write(step, self.canonical(state), force)

    def _due(self, step: int, force: bool) -> bool:
        return force or (self.every > 0 and step % self.every == 0)

    def _write(self, step: int, tree, force: bool) -> bool:
        import orbax.checkpoint as ocp

        sums = digests(tree)
        bad = [k for k, (_, finite) in sums.items() if not finite]
        if bad:
            self.note(f"checkpoint: not saving step {step}: non-finite values in {bad[0]}"
                      + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
            return False
        meta = {**self.info, "step": int(step), "checksums": {k: s for k, (s, _) in sums.items()}}
        items = {STATE: ocp.args.PyTreeSave(tree), META: ocp.args.JsonSave(meta)}
        if self.data is not None:  # every process: gathering the position is a collective
            items[DATA] = ocp.args.JsonSave(self.data.state())
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, template):
        """The newest state that restores, placed like `template`.

        Damaged steps are skipped with a note and renamed to `STEP.damaged`; a stateful data
        feed continues from the position saved with the step restored.

        Args:
          template: a pytree of arrays: the fresh state, whose shardings place the restored
            arrays and whose values fill what the checkpoint lacks.

        Returns:
          The restored train state.

        Raises:
          FileNotFoundError: the directory holds no checkpoint.
          CheckpointMismatch: it holds another model's, or a data position of other data.
          ValueError: no step restores.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"--resume: no checkpoint found in {str(self.directory)!r}")
        skipped = []
        for i, step in enumerate(steps):
            try:
                state = self._restore_step(step, template)
            except DamagedStep as e:
                skipped.append((step, str(e)))
                if i + 1 < len(steps):
                    self.note(f"checkpoint step {step} in {self.directory} is damaged ({e}); "
                              f"skipped, trying step {steps[i + 1]}")
                continue
            if skipped:
                self._set_aside([s for s, _ in skipped])
            return state
        raise ValueError(f"--resume: no step of {str(self.directory)!r} restores: " +
                         "; ".join(f"step {s}: {why}" for s, why in skipped))

    def _restore_step(self, step: int, template):
        import orbax.checkpoint as ocp

        path = self.directory / str(step)
        if (path / "default").is_dir() and not (path / STATE).exists():
            raise DamagedStep("written by an older axonn_jax (one 'default' item, no checksums), "
                              "which this version does not read")
        try:
            saved = self._manager.item_metadata(step)[STATE]
            meta = self._manager.restore(step, args=ocp.args.Composite(
                **{META: ocp.args.JsonRestore()}))[META]
        except Exception as e:  # orbax raises many types for damaged files
            raise DamagedStep(f"unreadable metadata: {_short(e)}") from None
        if saved is None or not isinstance(meta, dict) or "checksums" not in meta:
            raise DamagedStep("not an axonn_jax checkpoint step (no state or checksums)")
        target = _abstract(self.canonical(_abstract(template)))
        _check_same_model(saved, target, step, self.directory)
        abstract, resharded, missing = self._restore_target(saved, target)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                STATE: ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True)}))[STATE]
        except Exception as e:
            raise DamagedStep(_short(e)) from None
        sums = digests(restored)
        for key, (checksum, finite) in sums.items():
            if key in meta["checksums"] and checksum != meta["checksums"][key]:
                raise DamagedStep(f"checksum of {key} differs from the one saved")
            if not finite:
                raise DamagedStep(f"non-finite values in {key}")
        if self.info.get("seed") is not None and meta.get("seed") not in (None, self.info["seed"]):
            self.note(f"checkpoint step {step} was written with seed {meta['seed']}; continuing "
                      f"with seed {self.info['seed']} (other data from here on)")
        for key in resharded:
            restored[key], note = self.reshard[key](restored[key], target[key])
            if restored[key] is None:
                del restored[key]
                missing.append(key)
            if note:
                self.note(f"checkpoint step {step}: {note}")
        for key in sorted(set(saved) - set(target)):
            self.note(f"checkpoint step {step}: its {key!r} state is not used by this run")
        if missing:
            self.note(f"checkpoint step {step} holds no {', '.join(sorted(missing))}; "
                      "they start afresh")
        self._restore_data(step)
        return _with_fields(self.canonical(restored, inverse=True), template, missing)

    def _restore_data(self, step: int) -> None:
        """The data feed continues from the position saved with `step` (DamagedStep when the step
        holds none or a garbled one; the feed's CheckpointMismatch for one of other data)."""
        import orbax.checkpoint as ocp

        if self.data is None:
            return
        try:
            position = self._manager.restore(step, args=ocp.args.Composite(
                **{DATA: ocp.args.JsonRestore()}))[DATA]
        except Exception as e:  # missing or unreadable: orbax raises many types
            raise DamagedStep(f"no readable data position ({_short(e)})") from None
        try:
            self.data.restore(position)
        except CheckpointMismatch:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedStep(f"its data position does not fit this run's data: {_short(e)}") \
                from None

    def _restore_target(self, saved, target):
        """(what to read, fields to reshard, fields the checkpoint lacks): a field with a reshard
        function whose saved shapes differ from the target's is read as saved, replicated."""
        abstract = {k: v for k, v in target.items() if k in saved}
        missing = [k for k in target if k not in saved]
        resharded = []
        for key in [k for k in abstract if k in self.reshard]:
            flat_saved = {jax.tree_util.keystr(p): m for p, m in
                          jax.tree_util.tree_leaves_with_path(saved[key])}
            leaves = jax.tree_util.tree_leaves_with_path(abstract[key])
            shapes = [tuple(flat_saved[jax.tree_util.keystr(p)].shape) for p, _ in leaves]
            if any(s != x.shape for s, (_, x) in zip(shapes, leaves)):
                resharded.append(key)
                mesh = jax.tree.leaves(target["params"])[0].sharding.mesh
                replicated = NamedSharding(mesh, P())
                abstract[key] = jax.tree.unflatten(
                    jax.tree.structure(abstract[key]),
                    [jax.ShapeDtypeStruct(s, x.dtype, sharding=replicated)
                     for s, (_, x) in zip(shapes, leaves)])
        return abstract, resharded, missing

    def _set_aside(self, steps: list[int]) -> None:
        """Rename damaged steps to `STEP.damaged` (kept for inspection, out of orbax's way)."""
        if self.is_writer:
            for s in steps:
                path = self.directory / str(s)
                if path.exists():
                    aside = path.with_name(f"{s}{DAMAGED}")
                    n = 1
                    while aside.exists():
                        n += 1
                        aside = path.with_name(f"{s}{DAMAGED}-{n}")
                    path.rename(aside)
        self._barrier()
        self._manager.reload()

    def _barrier(self) -> None:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("axonn_jax checkpoint set aside")

    def wait(self):
        """Block until the pending asynchronous save is written."""
        self._manager.wait_until_finished()

    def close(self):
        """Wait for the pending save to be written, then close the checkpoint manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _check_same_model(saved, target, step: int, directory) -> None:
    """CheckpointMismatch when the saved parameters differ in names or shapes from the model's."""
    flat = lambda tree: {jax.tree_util.keystr(p): tuple(getattr(x, "shape", ()))  # noqa: E731
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    if "params" not in saved:
        raise DamagedStep("no parameters in the step")
    have, want = flat(saved["params"]), flat(target["params"])
    if have == want:
        return
    extra, lacking = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    shapes = [k for k in want if k in have and have[k] != want[k]]
    what = (f"parameter {shapes[0]} is {have[shapes[0]]} there, {want[shapes[0]]} here" if shapes
            else f"it lacks {lacking[0]}" if lacking else f"it has {extra[0]}, unknown here")
    raise CheckpointMismatch(
        f"--resume: {str(directory)!r} (step {step}) holds another model's checkpoint: {what}"
        + (f" ({len(shapes) + len(lacking) + len(extra) - 1} more differences)"
           if len(shapes) + len(lacking) + len(extra) > 1 else ""))


def _quiet_orbax() -> None:
    """Orbax and TensorStore log warnings and tracebacks of failed reads that `restore` reports
    as one line itself."""
    for name in ("absl", "orbax"):
        logging.getLogger(name).setLevel(logging.ERROR)


class RankZeroCheckpointer(Checkpointer):
    """Checkpoints of a `--transport mpi` job: rank 0 writes, every rank reads.

    The processes of `comm` are separate JAX programs holding the same replicated state, so its
    rank 0 writes it (orbax, single-process) and every rank reads it. What differs between them
    (each process's error-feedback residual) the state's owner gathers for the save and hands
    back on restore (`GradientReducer.saved`), inside `canonical`, which every rank calls.

    Args:
      directory: where the steps go (rank 0 creates it).
      every: save after each multiple of this many steps.
      comm: the MPI communicator of the processes.
      canonical: as `Checkpointer`'s.
      **kwargs: the other `Checkpointer` options (ranks other than 0 take only `info`, `note`
        and `reshard`, and open the directory read-only).
    """

    def __init__(self, directory: str | pathlib.Path, every: int, comm, canonical=None, **kwargs):
        self.rank, self.comm = comm.Get_rank(), comm
        if self.rank == 0:
            super().__init__(directory, every, canonical=canonical, **kwargs)
        comm.Barrier()  # the directory exists before the readers open it
        if self.rank != 0:
            super().__init__(directory, every, canonical=canonical, read_only=True,
                             **{k: v for k, v in kwargs.items() if k in ("info", "note", "reshard")})

    @property
    def is_writer(self) -> bool:
        """This process is rank 0, which writes the steps and renames damaged ones."""
        return self.rank == 0

    def _barrier(self) -> None:
        self.comm.Barrier()

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Save the state after `step` steps if due, as `Checkpointer.maybe_save`; rank 0 writes.

        Every rank must call it: the state's canonical form gathers what differs between them.

        Args:
          step: the steps taken.
          state: the train state.
          force: save whatever `every` says.

        Returns:
          Whether a save started (False on every rank but 0).
        """
        if not self._due(step, force):
            return False
        tree = self.canonical(state)  # every rank: what differs between them is gathered
        return self.rank == 0 and step != self.latest_step() and self._write(step, tree, force)
