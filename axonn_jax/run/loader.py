"""Packed language-model batches from a weighted mixture of document sources, on Grain.

`make_batches(config, seq_len, global_batch, ...)` is the entry point: an iterator of this
process's rows of every global batch (numpy pytrees `{'inputs', 'targets', 'segment_ids',
'positions'}`, see `packing`), with `get_state` / `set_state` (JSON values) for exact resume and
`stats()` for the loop's metrics. `global_arrays` assembles the processes' rows into global
`jax.Array`s (`jax.make_array_from_process_local_data`).

How rows are made (the same whatever the number of processes or workers):

- Each source (`sources.open_source`) is split once into validation (the first `val_fraction` of
  its documents in a fixed shuffle) and training documents; training documents are shuffled
  again with the run's seed, every epoch differently (`EpochShuffle`).
- Row `r` of every global batch comes from *stream* `r` (global_batch streams): the documents
  `r, r + G, r + 2G, ...` of every source's order (`MapDataset.slice`), tokenized by Grain's
  `map` where the stream is read, mixed by the sources' weights (`MapDataset.mix`: exact
  document proportions, deterministic interleaving), and packed greedily into rows.
- A stream's position is two integers (next document, tokens of it already used); the state of
  the iterator is the positions of its streams. A process reads and tokenizes only the documents
  of its own rows' streams, so shares are disjoint and together cover the data, and a state saved
  by any number of processes restores on any other number (that divides the global batch) and
  any number of Grain workers. What cannot change on resume: the sources, their weights and
  fields, the seed, seq_len, the global batch, the split and the tokenizer (`DataStateMismatch`).
- Workers: with `workers > 0`, Grain's `mp_prefetch` runs the streams in that many processes
  (each a slice of this process's streams); with 0, a thread prefetches `prefetch` batches.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import sys
import time
from typing import Any

import numpy as np

try:
    import grain
    from grain.experimental import ThreadPrefetchIterDataset, index_shuffle
except ImportError as e:  # the `data` extra
    raise ImportError("document sources (data.sources) need grain: pip install 'axonn_jax[data]'") from e

from ..checks import check_choice
from . import packing, sources
from .sources import LONG_DOCUMENTS

STATE_VERSION = 1
SPLIT_SEED = 0x5EED
"""Seed of the fixed shuffle that picks each source's validation documents (never the run's seed:
changing the run's seed must not move documents between the splits)."""
CONFIG_KEYS = ("sources", "eos_id", "long_documents", "val_fraction", "seed", "workers", "prefetch")


class DataStateMismatch(ValueError):
    """A saved data state that does not belong to this data configuration."""


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture: its path, weight and field.

    Attributes:
      path: a file, a directory or a glob (see `sources`).
      weight: > 0: the share of documents drawn from it is weight / sum of weights.
      text_field: for JSONL, Parquet and ArrayRecord, the field of the text (default 'text').
      ids_field: or the field of pre-tokenized ids (not both).
    """

    path: str
    weight: float = 1.0
    text_field: str | None = None
    ids_field: str | None = None

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"data source path must be a non-empty string, got {self.path!r}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight)
                and self.weight > 0):
            raise ValueError(f"data source {self.path!r}: weight must be a number > 0, got "
                             f"{self.weight!r}")
        if self.text_field is not None and self.ids_field is not None:
            raise ValueError(f"data source {self.path!r}: give text_field or ids_field, not both")

    @classmethod
    def from_dict(cls, spec: dict | str) -> "SourceConfig":
        """The source of a config entry: a path, or a mapping `{path, weight, ...}`.

        Args:
          spec: a path string, or a mapping of the fields (`sources.source_fields` checks it).

        Returns:
          The `SourceConfig`.
        """
        if isinstance(spec, str):
            return cls(spec)
        return cls(**sources.source_fields(spec))

    @property
    def field(self) -> sources.Field:
        """The field its documents are read from (`sources.Field`)."""
        return sources.Field(text=self.text_field, ids=self.ids_field)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Documents for training: a weighted mixture of sources, and how they are read.

    Attributes:
      sources: the mixture (at least one).
      eos_id: the end-of-document token (None: the tokenizer's, 0 for byte-level tokens).
      long_documents: documents longer than a row are `split` or `refuse`d.
      val_fraction: the share of each source's documents held out for validation, in [0, 1).
      seed: the seed of the shuffles.
      workers: Grain worker processes (0: a thread).
      prefetch: the batches each prefetches.
    """

    sources: tuple[SourceConfig, ...]
    eos_id: int | None = None
    long_documents: str = "split"
    val_fraction: float = 0.01
    seed: int = 0
    workers: int = 0
    prefetch: int = 2

    def __post_init__(self):
        if not self.sources:
            raise ValueError("data.sources is empty: give at least one {path, weight}")
        check_choice("long_documents", self.long_documents, LONG_DOCUMENTS)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.workers < 0 or self.prefetch < 0:
            raise ValueError(f"workers and prefetch must be >= 0, got {self.workers} and "
                             f"{self.prefetch}")

    @classmethod
    def from_dict(cls, spec: dict) -> "DataConfig":
        """The config of a YAML / JSON mapping: `{sources: [{path, weight, ...}, ...], ...}`.

        Args:
          spec: the mapping; its keys are among `CONFIG_KEYS`.

        Returns:
          The `DataConfig`.

        Raises:
          ValueError: an unknown key, `sources` not a list, or a field out of range.
        """
        unknown = sorted(set(spec) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"data config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(CONFIG_KEYS)})")
        if not isinstance(spec.get("sources"), (list, tuple)):
            raise ValueError("data.sources must be a list of {path, weight, ...}")
        return cls(**{**spec, "sources": tuple(map(SourceConfig.from_dict, spec["sources"]))})


# ----------------------------------------------------------------------------- streams

def _seed(seed: int, k: int) -> int:
    """Source k's shuffle seed (32 bits, Grain's range)."""
    return int(np.random.SeedSequence([seed, k]).generate_state(1)[0])


class EpochShuffle(grain.MapDataset):
    """The parent's elements in a new order every epoch.

    Element `e·n + i` is the parent's `perm_e[i]`, `perm_e` a permutation drawn from (seed, e);
    `epochs` None: without end.

    (Grain's `shuffle().repeat()` does the same with its Feistel `index_shuffle`, whose cost per
    index is highest for small sets: sets of up to `TABLE_MAX` get a permutation table per epoch
    instead (4 MiB at most), the last few epochs kept; larger ones use `index_shuffle`.)"""

    TABLE_MAX = 1 << 20
    TABLES_KEPT = 3

    def __init__(self, parent: grain.MapDataset, seed: int, epochs: int | None = None):
        super().__init__(parent)
        self._n, self._seed, self._epochs = len(parent), seed, epochs
        self._tables: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return sys.maxsize if self._epochs is None else self._n * self._epochs

    def __getstate__(self):  # pickled into Grain's workers without the tables
        return {**self.__dict__, "_tables": {}}

    def _shuffled(self, epoch: int, i: int) -> int:
        if self._n > self.TABLE_MAX:
            return int(index_shuffle(i, max_index=self._n - 1, seed=(self._seed + epoch) % 2**32,
                                     rounds=4))
        if epoch not in self._tables:
            if len(self._tables) >= self.TABLES_KEPT:
                self._tables.pop(min(self._tables))
            rng = np.random.default_rng([self._seed, epoch])
            self._tables[epoch] = rng.permutation(self._n).astype(np.int32)
        return int(self._tables[epoch][i])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, i = divmod(index, self._n)
        return self._parent[self._shuffled(epoch, i)]


def split_documents(reader, val_fraction: float, split: str, name: str) -> grain.MapDataset:
    """The documents of one split of a source.

    Validation is the first ceil(val_fraction·N) documents of a fixed shuffle (`SPLIT_SEED`),
    training the rest.

    Args:
      reader: the source's random-access reader (`sources.open_source`), N documents.
      val_fraction: the share held out for validation.
      split: 'train' or 'val'.
      name: the source's name for errors.

    Returns:
      The split's documents, a `grain.MapDataset`.

    Raises:
      ValueError: the source holds too few documents for both splits, or `split` is 'val' with
        `val_fraction` giving none.
    """
    n = len(reader)
    n_val = math.ceil(n * val_fraction)
    if n_val >= n:
        raise ValueError(f"data source {name!r} holds {n} document(s): too few to hold out "
                         f"val_fraction {val_fraction} (training and validation need one each)")
    if split == "val" and not n_val:
        raise ValueError("validation batches need val_fraction > 0")
    docs = EpochShuffle(grain.MapDataset.source(reader), SPLIT_SEED, epochs=1)
    return docs[:n_val] if split == "val" else docs[n_val:]


def shuffle_sources(parts, seed: int, epochs: int | None = None) -> list[grain.MapDataset]:
    """Each source's documents, shuffled every epoch and repeated.

    Args:
      parts: each source's documents (`grain.MapDataset`s).
      seed: the run's data seed; source k shuffles by the seed (seed, k).
      epochs: the repeats (None: without end).

    Returns:
      One `EpochShuffle` per source.
    """
    return [EpochShuffle(part, _seed(seed, k), epochs) for k, part in enumerate(parts)]


def stream_documents(shuffled, weights, tokenize, stream: int, streams: int) -> grain.MapDataset:
    """The tokenized documents of `stream` of `streams`.

    Of each source's shuffled documents (`shuffle_sources`), those at `stream + k·streams`, mixed
    by `weights` (Grain's `mix`: exact document proportions, deterministic interleaving).

    Args:
      shuffled: each source's shuffled documents.
      weights: each source's weight.
      tokenize: a document -> its token ids (`sources.DocumentTokenizer`).
      stream: this stream's index (a row of the global batch).
      streams: the number of streams (the global batch).

    Returns:
      The stream's documents as token ids, a `grain.MapDataset`.
    """
    per_source = [docs.slice(slice(stream, None, streams)).map(tokenize) for docs in shuffled]
    return per_source[0] if len(per_source) == 1 else grain.MapDataset.mix(per_source, weights)


class _Stream:
    """`doc_at(j)` for `packing.pack_row`: the j-th document of a stream (None past its end),
    keeping the last one read (a document that did not fit is read again for the next row)."""

    def __init__(self, docs: grain.MapDataset):
        self.docs, self._last, self.read = docs, (None, None), 0

    def __call__(self, j: int):
        if j >= len(self.docs):
            return None
        if self._last[0] != j:
            self._last = (j, self.docs[j])
            self.read += 1
        return self._last[1]


class _Rows(grain.IterDataset):
    """Grain dataset whose elements are one packed row of each of `streams` (a sub-batch), with
    the streams' positions after it, the documents it read and the seconds it took (`busy_s`).
    Grain's `mp_prefetch` gives each worker a slice of the streams (`set_slice`)."""

    def __init__(self, build, streams: list[int], start: dict, row_len: int, split_long: bool):
        super().__init__()
        self.build, self.streams, self.start = build, streams, start
        self.row_len, self.split_long = row_len, split_long

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        self.streams = self.streams[sl]

    def __iter__(self):
        return _RowsIterator(self)


class _RowsIterator(grain.DatasetIterator):
    """Packs the next row of each stream; its Grain state is the streams' positions."""

    def __init__(self, ds: _Rows):
        super().__init__()
        self._ds = ds
        self._docs = {r: _Stream(ds.build(r)) for r in ds.streams}
        self._pos = {r: tuple(ds.start[r]) for r in ds.streams}

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        read = sum(d.read for d in self._docs.values())
        rows = []
        for r in self._ds.streams:
            row, self._pos[r] = packing.pack_row(self._docs[r], self._pos[r], self._ds.row_len,
                                                 self._ds.split_long)
            rows.append(row)
        tokens, segments, positions = (np.stack(x) for x in zip(*rows))
        return {"streams": np.asarray(self._ds.streams, np.int64), "tokens": tokens,
                "segment_ids": segments, "positions": positions,
                "after": np.asarray([self._pos[r] for r in self._ds.streams], np.int64),
                "documents": np.int64(sum(d.read for d in self._docs.values()) - read),
                "busy_s": np.float64(time.perf_counter() - t0)}

    def get_state(self) -> dict:
        return {"positions": {str(r): list(p) for r, p in self._pos.items()}}

    def set_state(self, state: dict) -> None:
        self._pos = {r: tuple(state["positions"][str(r)]) for r in self._ds.streams}


# ----------------------------------------------------------------------------- the iterator

def _parse_absl_flags() -> None:
    """Mark absl's flags parsed (their defaults) when no `absl.app` did: with JAX loaded, Grain
    0.2's `mp_prefetch` reads one of its flags and fails otherwise (google/grain#1355)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@dataclasses.dataclass
class _Meter:
    """Sums since the last `Batches.stats()`."""

    batches: int = 0
    wait_s: float = 0.0
    busy_max_s: float = 0.0
    busy_s: float = 0.0
    tokens: int = 0
    slots: int = 0
    documents: int = 0


class Batches:
    """Iterator of this process's rows of every global batch; made by `make_batches`.

    `rows` is a range of the global batch's rows. Each batch is numpy `{'inputs', 'targets',
    'segment_ids', 'positions'}`, each `(len(rows), seq_len)` int32.
    """

    def __init__(self, build, rows: range, streams: int, row_len: int, split_long: bool,
                 workers: int, prefetch: int, fingerprint: str):
        self.rows, self.streams, self.row_len = rows, streams, row_len
        self.fingerprint = fingerprint
        self._build, self._split_long = build, split_long
        self._workers, self._prefetch = min(workers, len(rows)), prefetch
        self._positions = {r: (0, 0) for r in rows}
        self._batches, self._meter, self._it = 0, _Meter(), None
        self._start()

    def _start(self) -> None:
        self.close()
        ds = _Rows(self._build, list(self.rows), dict(self._positions), self.row_len,
                   self._split_long)
        if self._workers:
            _parse_absl_flags()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=self._workers, per_worker_buffer_size=max(self._prefetch, 1)))
        elif self._prefetch:
            ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=self._prefetch)
        self._it = iter(ds)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        # Grain interleaves its workers' outputs in turn: one sub-batch of each makes a batch.
        parts = [next(self._it) for _ in range(max(self._workers, 1))]
        wait = time.perf_counter() - t0
        streams = np.concatenate([p["streams"] for p in parts])
        order = np.argsort(streams)
        if not np.array_equal(streams[order], np.asarray(self.rows)):
            raise RuntimeError(f"data workers returned rows {sorted(streams)} for rows {self.rows}")
        for r, after in zip(streams, np.concatenate([p["after"] for p in parts])):
            self._positions[int(r)] = (int(after[0]), int(after[1]))
        rows = [np.concatenate([p[k] for p in parts])[order]
                for k in ("tokens", "segment_ids", "positions")]
        self._batches += 1
        busy = [float(p["busy_s"]) for p in parts]
        m = self._meter
        m.batches, m.wait_s, m.busy_max_s, m.busy_s = (m.batches + 1, m.wait_s + wait,
                                                       m.busy_max_s + max(busy), m.busy_s + sum(busy))
        m.tokens, m.slots = m.tokens + int((rows[1] > 0).sum()), m.slots + rows[1].size
        m.documents += sum(int(p["documents"]) for p in parts)
        return packing.lm_batch(*rows)

    def stats(self) -> dict[str, float]:
        """The input pipeline's metrics since the last call.

        Returns:
          `data_wait_s` (mean seconds `next` waited for a batch: the time a step stalls on
          input), `data_batches_per_s` (batches per second the pipeline makes when nothing waits
          on it: its workers' busy time, workers in parallel), `data_worker_s` (worker seconds
          per batch, all workers), `data_padding` (fraction of row slots that are padding) and
          `data_documents` (documents read and tokenized per batch, by this process). Empty
          when no batch was taken.
        """
        m, self._meter = self._meter, _Meter()
        if not m.batches:
            return {}
        return {"data_wait_s": m.wait_s / m.batches,
                "data_batches_per_s": m.batches / m.busy_max_s if m.busy_max_s else math.inf,
                "data_worker_s": m.busy_s / m.batches, "data_padding": 1 - m.tokens / m.slots,
                "data_documents": m.documents / m.batches}

    def get_state(self) -> dict:
        """This process's position, a JSON value.

        Returns:
          The version, fingerprint, streams, batches taken and the positions of its rows'
          streams (see `merge_states` / `gather_state` for the whole job's).
        """
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "streams": self.streams,
                "batches": self._batches,
                "positions": {str(r): list(self._positions[r]) for r in self.rows}}

    def set_state(self, state: dict) -> None:
        """Continue from `state`: the next batch is the one that followed when it was saved.

        Args:
          state: this process's or the whole job's state (`get_state`, `gather_state`), saved by
            any number of processes and workers.

        Raises:
          DataStateMismatch: the state belongs to other data, or lacks one of this process's
            rows.
        """
        check_state(state, self.fingerprint, self.streams)
        missing = [r for r in self.rows if str(r) not in state["positions"]]
        if missing:
            raise DataStateMismatch(f"the data state holds no position for row(s) {missing[:4]} "
                                    "(a state of other processes only: merge all processes' states)")
        self._positions = {r: tuple(state["positions"][str(r)]) for r in self.rows}
        self._batches = int(state["batches"])
        self._start()

    def close(self) -> None:
        """Stop Grain's worker processes or prefetch thread."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _fingerprint(config: DataConfig, eos_id: int, tokenizer, seq_len: int, global_batch: int,
                 split: str) -> str:
    """What the batches depend on (not the workers, prefetch or processes), hashed."""
    digest = None
    if tokenizer is not None:
        digest = hashlib.sha256(pathlib.Path(tokenizer).read_bytes()).hexdigest()
    what = {"sources": [dataclasses.astuple(s) for s in config.sources], "eos_id": eos_id,
            "long_documents": config.long_documents, "val_fraction": config.val_fraction,
            "seed": config.seed, "tokenizer": digest, "seq_len": seq_len,
            "global_batch": global_batch, "split": split}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def make_batches(config: DataConfig, seq_len: int, global_batch: int, tokenizer=None,
                 process_index: int | None = None, process_count: int | None = None, *,
                 vocab_size: int | None = None, split: str = "train",
                 rows: range | None = None) -> Batches:
    """This process's rows of packed global batches `(global_batch, seq_len)` of `config`.

    Bad input (a missing file, a field that does not exist, a weight <= 0, ...) raises here,
    with one line naming the file; what only reading shows (a malformed line, a document too
    long with long_documents: refuse) raises from `next` the same way.

    Args:
      config: the mixture and how it is read.
      seq_len: tokens per row.
      global_batch: rows per global batch (G).
      tokenizer: a `tokenizer.json` (None: one token per UTF-8 byte).
      process_index: this process, i (default: JAX's); it holds rows `[i·G/n, (i+1)·G/n)` of
        every global batch and reads only their documents.
      process_count: the processes, n (default: JAX's); they must divide G.
      vocab_size: ids must be below it.
      split: 'train' or 'val' (the held-out documents).
      rows: the rows this process holds instead (a contiguous range, e.g.
        `process_rows(sharding, ...)`).

    Returns:
      The `Batches` iterator.

    Raises:
      ValueError: a bad split, size, row range or source.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if seq_len < 1 or global_batch < 1:
        raise ValueError(f"seq_len and global_batch must be positive, got {seq_len} and {global_batch}")
    if rows is None:
        import jax

        i = jax.process_index() if process_index is None else process_index
        n = jax.process_count() if process_count is None else process_count
        if global_batch % n:
            raise ValueError(f"global batch of {global_batch} rows does not split over {n} processes")
        rows = range(i * global_batch // n, (i + 1) * global_batch // n)
    if not rows or rows.step != 1 or rows.start < 0 or rows.stop > global_batch:
        raise ValueError(f"rows {rows} are not a contiguous range of the {global_batch} rows")
    eos_id = sources.resolve_eos(tokenizer, config.eos_id, vocab_size)
    parts = [split_documents(sources.open_source(s.path, s.field, eos_id), config.val_fraction,
                             split, s.path) for s in config.sources]
    tokenize = sources.DocumentTokenizer(tokenizer, eos_id, vocab_size)
    for part in parts:
        tokenize(part[0])  # ids outside the vocabulary, a broken tokenizer: fail here, not later
    build = functools.partial(stream_documents, shuffle_sources(parts, config.seed),
                              [s.weight for s in config.sources], tokenize, streams=global_batch)
    return Batches(build, rows, global_batch, seq_len + 1, config.long_documents == "split",
                   config.workers, config.prefetch,
                   _fingerprint(config, eos_id, tokenizer, seq_len, global_batch, split))


# ----------------------------------------------------------------------------- state of a job

def check_state(state: Any, fingerprint: str, streams: int) -> None:
    """Raise DataStateMismatch unless `state` is a data state of this configuration.

    Args:
      state: a saved data state (any JSON value).
      fingerprint: the configuration's fingerprint (`Batches.fingerprint`).
      streams: the configuration's streams (the global batch).

    Raises:
      DataStateMismatch: another version, damaged positions, or other data.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or \
            not isinstance(state.get("positions"), dict):
        raise DataStateMismatch(f"not a data state of this version ({STATE_VERSION}): "
                                f"{str(state)[:80]}")
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and x >= 0 for x in p)
               for p in state["positions"].values()):
        raise DataStateMismatch("a damaged data state: positions are not pairs of integers >= 0")
    if state.get("fingerprint") != fingerprint or state.get("streams") != streams:
        raise DataStateMismatch(
            "the data state was saved for other data (sources, weights, fields, seed, seq_len, "
            f"global batch of {state['streams']} rows or tokenizer differ); its batches cannot "
            "continue exactly")


def merge_states(states: list[dict]) -> dict:
    """One state for the whole job from each process's `get_state()`.

    Args:
      states: every process's state; processes that hold the same rows (e.g. replicas over
        `pipe`) must agree on them.

    Returns:
      The first state with the positions of every row, sorted by row.

    Raises:
      DataStateMismatch: a state of other data, states at different batches, or processes that
        disagree on a row's position.
    """
    first = states[0]
    positions: dict[str, list] = {}
    for state in states:
        check_state(state, first["fingerprint"], first["streams"])
        if state["batches"] != first["batches"]:
            raise DataStateMismatch(f"processes' data states are at different batches: "
                                    f"{first['batches']} and {state['batches']}")
        for r, p in state["positions"].items():
            if positions.setdefault(r, p) != p:
                raise DataStateMismatch(f"processes disagree on the position of row {r}")
    return {**first, "positions": dict(sorted(positions.items(), key=lambda kv: int(kv[0])))}


def gather_state(batches: Batches) -> dict:
    """The whole job's data state, on every process.

    A collective: every process calls it, e.g. when the checkpoint is saved. The checkpoint
    stores it as JSON and `set_state` restores it on any number of processes.

    Args:
      batches: this process's iterator.

    Returns:
      The merged state (`merge_states`).
    """
    import jax
    from jax.experimental import multihost_utils

    local = batches.get_state()
    if jax.process_count() == 1:
        return local
    blob = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:blob.size] = blob
    every = np.asarray(multihost_utils.process_allgather(padded))
    return merge_states([json.loads(every[i, :sizes[i]].tobytes()) for i in range(len(sizes))])


# ----------------------------------------------------------------------------- global arrays

def process_rows(sharding, global_batch: int, seq_len: int) -> range:
    """The rows of a `(global_batch, seq_len)` batch that this process's devices hold.

    Args:
      sharding: the batch's sharding (rows split over the data axes).
      global_batch: rows per global batch.
      seq_len: tokens per row.

    Returns:
      A contiguous range of rows (as a data axis ordered by process gives them).

    Raises:
      ValueError: the process's rows are not one contiguous range.
    """
    spans = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
                    for s in sharding.addressable_devices_indices_map((global_batch, seq_len)).values()})
    start, stop = spans[0]
    for a, b in spans[1:]:
        if a > stop:
            raise ValueError(f"this process's devices hold rows {spans} of the batch, not one "
                             "contiguous range")
        stop = max(stop, b)
    return range(start, stop)


def global_arrays(local: dict, sharding, global_batch: int) -> dict:
    """Global `(global_batch, seq_len)` arrays of every process's rows.

    Args:
      local: this process's rows of a batch (from `Batches`), each `(rows, seq_len)`.
      sharding: the global arrays' sharding.
      global_batch: rows per global batch.

    Returns:
      The batch's global `jax.Array`s (`jax.make_array_from_process_local_data`), by key.
    """
    import jax

    return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
            for k, v in local.items()}
