"""Feeds: where the training loop takes its batches from, one interface for every kind of data.

    feed.example(step) -> batch      what the step is compiled for (a batch or its placed shapes)
    feed.batch(step) -> batch        the device batch of `step` (global arrays); asked twice, the
                                     same batch; a stateful feed is asked in order
    feed.first(n) -> [batch, ...]    the first n batches (validation: the same every time)
    feed.stateful                    its position is not a function of the step: the checkpoint
                                     keeps `state()` (every process calls it: a collective) and
                                     gives it back to `restore(state)`
    feed.stats() -> dict             the data metrics since the last call (`data_wait_s`, ...)
    feed.describe() -> str           what it reads, for the run's first lines
    feed.close()

`StepFeed` wraps a function `step -> host batch` (the token stream's random windows, drawn
images, a caller's data): stateless, placed by the step (`TrainStep.place_batch`). `DocumentFeed`
reads packed documents from Grain (`run.loader`): each process reads and tokenizes only the rows
its devices hold, and the global arrays are assembled from every process's rows.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .checkpoint import CheckpointMismatch

DOCUMENT_KEYS = ("inputs", "targets", "segment_ids", "positions")
"""The leaves of a batch of packed documents, each `(batch, seq_len)` int32 (`run.packing`)."""


class StepFeed:
    """Batches that are a function of the step; a batch's position is its step: nothing to save.

    Args:
      batches: `batches(step)` -> a global host batch.
      place: a host batch -> device arrays (`TrainStep.place_batch`).
      description: what it reads, for the run's first lines.
    """

    stateful = False

    def __init__(self, batches: Callable[[int], Any], place: Callable[[Any], Any],
                 description: str = ""):
        self._batches, self._place, self.description = batches, place, description
        self._wait: list[float] = []
        self._first: dict[int, list] = {}

    def example(self, step: int):
        """The batch the step is compiled for: batch `step` itself.

        Args:
          step: the step.

        Returns:
          The placed batch of `step`.
        """
        return self.batch(step)

    def batch(self, step: int):
        """The device batch of `step`, made and placed (the time it took counts in `stats`).

        Args:
          step: any step (the batch is a function of it).

        Returns:
          The placed batch.
        """
        t0 = time.perf_counter()
        batch = self._place(self._batches(step))
        self._wait.append(time.perf_counter() - t0)
        return batch

    def first(self, n: int) -> list:
        """The first `n` batches, made once and kept (validation: the same every time).

        Args:
          n: how many.

        Returns:
          The placed batches of steps `0 .. n - 1`.
        """
        if n not in self._first:
            self._first[n] = [self._place(self._batches(i)) for i in range(n)]
        return self._first[n]

    def stats(self) -> dict[str, float]:
        """The data metrics since the last call.

        Returns:
          `{'data_wait_s': the mean seconds `batch` took (making the host batch and placing
          it)}`, or empty when no batch was made.
        """
        wait, self._wait = self._wait, []
        return {"data_wait_s": sum(wait) / len(wait)} if wait else {}

    def describe(self) -> str:
        """What it reads, for the run's first lines.

        Returns:
          The description it was given.
        """
        return self.description

    def state(self):
        """Nothing: a step feed's position is its step."""
        return None

    def restore(self, state) -> None:
        """Nothing to restore: a step feed's position is its step.

        Args:
          state: ignored.
        """

    def close(self) -> None:
        """Nothing to close."""


class DocumentFeed:
    """Packed documents from Grain, as global `(global_batch, seq_len)` arrays.

    The feed's position is the iterator's: `state()` gathers every process's
    (`loader.gather_state`), `restore(state)` continues from it.

    Args:
      make: `make()` -> a fresh `run.loader.Batches` of this process's rows.
      sharding: the global arrays' sharding (`loader.global_arrays`).
      global_batch: rows per global batch.
      seq_len: tokens per row.
    """

    stateful = True

    def __init__(self, make: Callable[[], Any], sharding, global_batch: int, seq_len: int):
        self._make, self.sharding = make, sharding
        self.global_batch, self.seq_len = global_batch, seq_len
        self._batches = None
        self._next = 0  # the step whose batch the iterator yields next
        self._last: tuple[int, Any] | None = None
        self._first: dict[int, list] = {}

    @property
    def batches(self):
        """The iterator of this process's rows (made when first needed)."""
        if self._batches is None:
            self._batches = self._make()
        return self._batches

    def example(self, step: int):
        """The placed shapes of a batch, what the step is compiled for.

        Args:
          step: ignored (every batch has these shapes).

        Returns:
          `{key: ShapeDtypeStruct((global_batch, seq_len), int32, sharding)}` of `DOCUMENT_KEYS`.
        """
        shape = jax.ShapeDtypeStruct((self.global_batch, self.seq_len), jnp.int32,
                                     sharding=self.sharding)
        return {k: shape for k in DOCUMENT_KEYS}

    def _global(self, local):
        from . import loader

        return loader.global_arrays(local, self.sharding, self.global_batch)

    def batch(self, step: int):
        """The device batch of `step`: the next batch, or the last one asked again.

        Args:
          step: the step after the last one asked (or the last one again).

        Returns:
          Global arrays of `DOCUMENT_KEYS`, each `(global_batch, seq_len)` int32.

        Raises:
          ValueError: a step out of order (restore the data position first).
        """
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if step != self._next:
            raise ValueError(f"the documents are read in order: the feed is at step {self._next}, "
                             f"step {step} was asked (restore the data position first)")
        batch = self._global(next(self.batches))
        self._next, self._last = step + 1, (step, batch)
        return batch

    def first(self, n: int) -> list:
        """The first `n` batches, from an iterator of their own, made once and kept.

        Args:
          n: how many.

        Returns:
          The first `n` global batches (validation: the same every time).
        """
        if n not in self._first:
            batches = self._make()
            try:
                self._first[n] = [self._global(next(batches)) for _ in range(n)]
            finally:
                batches.close()
        return self._first[n]

    def stats(self) -> dict[str, float]:
        """The data metrics since the last call.

        Returns:
          `run.loader.Batches.stats` (empty before the first batch).
        """
        return self._batches.stats() if self._batches is not None else {}

    def describe(self) -> str:
        """What it reads, for the run's first lines.

        Returns:
          The rows and tokens per row, and which rows this process reads.
        """
        b = self.batches
        return (f"documents packed into {b.streams} rows of {self.seq_len} tokens, this process "
                f"reading rows {b.rows.start}-{b.rows.stop - 1}")

    def state(self) -> dict:
        """The whole job's data position; a collective: every process calls it.

        Returns:
          The gathered state (`loader.gather_state`), a JSON value.
        """
        from . import loader

        return loader.gather_state(self.batches)

    def restore(self, state) -> None:
        """Continue from a gathered `state`: the next batch is the one after it.

        Args:
          state: a state from `state()`, of any number of processes.

        Raises:
          CheckpointMismatch: it belongs to other data (a config change: an error, not damage).
          ValueError: a garbled one.
        """
        b = self.batches
        if isinstance(state, dict) and "fingerprint" in state and \
                (state["fingerprint"], state.get("streams")) != (b.fingerprint, b.streams):
            raise CheckpointMismatch(
                "--resume: the checkpoint's data position is of other data (the sources, weights, "
                "fields, seed, seq_len, global batch or tokenizer differ), so its batches cannot "
                "continue; resume with the run's data config or start a new run")
        b.set_state(state)
        self._next, self._last = int(state["batches"]), None

    def close(self) -> None:
        """Stop the iterator's Grain workers or prefetch thread."""
        if self._batches is not None:
            self._batches.close()


def document_feeds(config, sharding, tokenizer=None, vocab_size: int | None = None
                   ) -> tuple[DocumentFeed, DocumentFeed | None]:
    """The training and validation feeds of the config's document sources (`data.sources`).

    Each process reads the rows of the global batch that `sharding` puts on its devices. Bad
    input in the sources or in the first batch's documents (a missing file, a malformed record, a
    field that does not exist, a refused long document) raises here.

    Args:
      config: the run's config (`run.options.RunConfig`).
      sharding: the sharding of a `(batch, seq_len)` leaf of the batch.
      tokenizer: a `tokenizer.json` (None: byte-level tokens).
      vocab_size: ids must be below it.

    Returns:
      `(training feed, validation feed)`; the validation feed is None with val_fraction 0.
    """
    from . import loader

    d = config.data
    data = loader.DataConfig.from_dict(d.loader_config(config.run.seed))
    rows = loader.process_rows(sharding, d.batch_size, d.seq_len)

    def make(split: str):
        return lambda: loader.make_batches(data, d.seq_len, d.batch_size, tokenizer, rows=rows,
                                           vocab_size=vocab_size, split=split)

    train = DocumentFeed(make("train"), sharding, d.batch_size, d.seq_len)
    # The first batch now: bad input (a malformed record, a missing field, a refused long
    # document) fails before the step compiles, not minutes later (a resume re-positions it).
    train.batch(0)
    validation = DocumentFeed(make("val"), sharding, d.batch_size, d.seq_len) \
        if d.val_fraction > 0 else None
    return train, validation
