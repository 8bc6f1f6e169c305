"""Hooks of the training loop (`run.loop`): each does one thing around the steps, the way Levanter's
trainer hooks do. A hook has three optional methods, called on every process:

    start(loop)     after the step is compiled and the state restored, before the first step
    step(info)      after each step; `info.record` is the step's metrics, which hooks may extend
    end(loop)       after the last step, also when the loop stops on an error

`start` and `step` run in the order the loop was given the hooks (validation before the metrics
file, so the file holds `val_loss`), `end` in the reverse order. Hooks that write files or print do so on the main process only.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class StepInfo:
    """`step`: steps done, this one included; `state`: the state after it; `record`: its metrics."""

    step: int
    state: Any
    record: dict


class Hook:
    """A hook of the training loop: override any of `start`, `step` and `end`."""

    def start(self, loop) -> None:
        """Called after the step is compiled and the state restored, before the first step.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """

    def step(self, info: StepInfo) -> None:
        """Called after each step; `info.record` is the step's metrics, which hooks may extend.

        Args:
          info: the step just done.
        """

    def end(self, loop) -> None:
        """Called after the last step, also when the loop stops on an error.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """


class HloDump(Hook):
    """Writes the optimized HLO of the compiled train step to `directory/train_step.hlo.txt`."""

    def __init__(self, directory: str):
        self.directory = pathlib.Path(directory)

    def start(self, loop):
        """Write the compiled step's HLO text (main process).

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if loop.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "train_step.hlo.txt").write_text(loop.compiled.as_text())


class Validation(Hook):
    """The validation loss before the first step, every `every` steps and after the last.

    Adds `val_loss` to the record and keeps `history` [(step, loss), ...].

    Args:
      evaluate: `evaluate(params) -> float`, the mean loss over the validation batches.
      every: evaluate after each multiple of this many steps.
      last_step: the run's last step (evaluated too).
    """

    def __init__(self, evaluate: Callable[[Any], float], every: int, last_step: int):
        self.evaluate, self.every, self.last_step = evaluate, every, last_step
        self.history: list[tuple[int, float]] = []

    def start(self, loop):
        """Evaluate the restored or fresh parameters and print the loss.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        loss = self.evaluate(loop.state.params)
        self.history.append((loop.start_step, loss))
        loop.console.print(f"validation loss at step {loop.start_step}: {loss:.4f}")

    def step(self, info):
        """Evaluate after a multiple of `every` steps or the last step; adds `val_loss`.

        Args:
          info: the step just done.
        """
        if info.step % self.every == 0 or info.step == self.last_step:
            info.record["val_loss"] = self.evaluate(info.state.params)
            self.history.append((info.step, info.record["val_loss"]))

    def end(self, loop):
        """Print the first and the last validation loss.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if self.history:
            loop.console.print(f"validation loss: first {self.history[0][1]:.4f} -> last "
                               f"{self.history[-1][1]:.4f}")


class MetricsFile(Hook):
    """One JSON object per step in `path`, written by the main process.

    Appended to when the run resumes, after the records of steps beyond the restored one are
    dropped (those a crashed job wrote after its checkpoint).

    Args:
      path: the `metrics.jsonl` file.
      append: the run resumes: keep the records up to the restored step.
    """

    def __init__(self, path: str, append: bool):
        self.path, self.append, self.file = path, append, None

    def start(self, loop):
        """Open the file (main process), dropping records past the starting step when appending.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if not loop.is_main:
            return
        path = pathlib.Path(self.path)
        if self.append and path.is_file():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if _record_step(line) <= loop.start_step]
            path.write_text("".join(kept))
        self.file = open(self.path, "a" if self.append else "w")

    def step(self, info):
        """Write the step's record as one line and flush.

        Args:
          info: the step just done.
        """
        if self.file:
            self.file.write(json.dumps(info.record) + "\n")
            self.file.flush()

    def end(self, loop):
        """Close the file.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if self.file:
            self.file.close()


def _record_step(line: str) -> float:
    """The `step` of one line of a metrics file (infinity for a line that is not a record, such
    as the half-written last line of a killed job)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class Checkpoints(Hook):
    """Saves the state every `checkpointer.every` steps, and at the end.

    The end includes `--stop-at`, a signal that stopped the loop, and an error that stopped it,
    so that `--resume` continues from where it stopped; a diverged state is never saved (the loop
    does not keep it).

    Args:
      checkpointer: the run's `run.checkpoint.Checkpointer`.
    """

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def step(self, info):
        """Save the state if the step is due.

        Args:
          info: the step just done.
        """
        self.checkpointer.maybe_save(info.step, info.state)

    def end(self, loop):
        """Save the last state unless a failed step consumed it, then close the checkpointer.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        import jax

        c = self.checkpointer
        # Not after a diverged or failed step that consumed (donated) the state.
        if not any(x.is_deleted() for x in jax.tree.leaves(loop.state) if isinstance(x, jax.Array)):
            try:
                c.maybe_save(int(loop.state.step), loop.state, force=True)
            except Exception as e:  # a failure of its own after the run's error
                if loop.completed:
                    raise
                loop.console.print(f"checkpoint: could not save step {int(loop.state.step)} "
                                   f"after the error: {str(e).splitlines()[0] if str(e) else e!r}")
        c.close()


class SaveWhenStopped(Hook):
    """For a run without periodic checkpoints: saves the state when a signal stops it.

    Args:
      make: `make()` builds the checkpointer the state is saved into, then.
    """

    def __init__(self, make: Callable[[], Any]):
        self.make = make

    def end(self, loop):
        """Save the state if a signal stopped the loop.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if loop.stopped is not None:
            c = self.make()
            c.maybe_save(int(loop.state.step), loop.state, force=True)
            c.close()


class Progress(Hook):
    """A progress bar with the loss and throughput (a line per validation when not on a terminal)."""

    def start(self, loop):
        """Start the bar at the starting step (shown on the main process only).

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                   TimeRemainingColumn)

        self.console = loop.console
        self.bar = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                       console=loop.console, disable=not loop.is_main)
        self.bar.start()
        self.task = self.bar.add_task("train", total=loop.trainer.options.run.steps,
                                      completed=loop.start_step, info="")

    def step(self, info):
        """Advance the bar; print a line per validation when not on a terminal.

        Args:
          info: the step just done.
        """
        r = info.record
        if "val_loss" in r and not self.console.is_terminal:
            self.console.print(f"step {info.step}: loss {r['loss']:.4f} val_loss "
                               f"{r['val_loss']:.4f} {r['examples_per_s']:,.1f} examples/s")
        self.bar.update(self.task, advance=1, info=f"loss {r['loss']:.3f} "
                        f"{r['step_time_s'] * 1e3:.0f} ms/step")

    def end(self, loop):
        """Stop the bar.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        self.bar.stop()


class Sample(Hook):
    """At the end, prints `generate(params) -> str` (e.g. a language model's continuation)."""

    def __init__(self, generate: Callable[[Any], str]):
        self.generate, self.text = generate, None

    def end(self, loop):
        """Print the sample of a completed run (kept in `text`).

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if not loop.completed:
            return
        self.text = self.generate(loop.state.params)
        loop.console.print("[bold]sample:[/]")
        loop.console.print(self.text, markup=False, highlight=False)


class DeviceMemory(Hook):
    """Adds the accelerator memory in use after each step and the peak so far.

    They are the most loaded of this process's devices in the mesh (`memory_bytes_in_use`,
    `memory_peak_bytes`), where the backend reports them (GPUs and TPUs do; XLA:CPU does not, and
    then nothing is added).
    """

    def start(self, loop):
        """Find this process's devices of the mesh.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        import jax

        local = set(jax.local_devices())
        self.devices = [d for d in loop.trainer.step.mesh.devices.flat if d in local]

    def step(self, info):
        """Add `memory_bytes_in_use` and `memory_peak_bytes` where the backend reports them.

        Args:
          info: the step just done.
        """
        stats = [s for s in (d.memory_stats() for d in self.devices) if s]
        if stats:
            info.record["memory_bytes_in_use"] = max(s.get("bytes_in_use", 0) for s in stats)
            info.record["memory_peak_bytes"] = max(s.get("peak_bytes_in_use", 0) for s in stats)


def _scalars(record: dict) -> dict[str, float]:
    """The record's numbers by name; a per-layer list of numbers (the blocks' metrics, e.g. a
    mixture of experts' `dropped_tokens`) as one scalar per layer, `name/layer_i`."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            out.update({f"{k}/layer_{i}": float(x) for i, x in enumerate(v)})
    return out


def _summary_writer():
    """tensorboardX's `SummaryWriter` class, imported without PyTorch.

    tensorboardX imports torch where it is installed, only to accept torch tensors, which this
    library never writes; torch's import is most of a small run's start-up
    (`benchmarks/startup.py`). Where torch is already loaded, nothing changes.

    Returns:
      `tensorboardX.SummaryWriter`.
    """
    import sys

    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard(Hook):
    """TensorBoard event files in `directory` (tensorboardX), written by the main process.

    Every numeric metric of each step goes under its `metrics.jsonl` name (loss, val_loss, lr,
    grad_norm, tokens_per_s, examples_per_s, step_time_s, memory, loss_scale, ...) at its step,
    the blocks' per-layer metrics one scalar per layer (`name/layer_i`) and per-layer vectors (a
    mixture of experts' tokens per expert) as histograms, and the run's constants (`loop.report`:
    parameter count, state and compiled peak bytes, compression ratio) once, under `run/`, at the
    starting step. View with `tensorboard --logdir DIR`.

    Args:
      directory: where the event files go.
    """

    def __init__(self, directory: str | pathlib.Path):
        self.directory, self.writer, self.constants = pathlib.Path(directory), None, set()

    def start(self, loop):
        """Open the writer (main process) and write the run's constants under `run/`.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if not loop.is_main:
            return
        import logging

        SummaryWriter = _summary_writer()
        # A non-finite metric is recorded as it is; tensorboardX's warning about it would break the
        # one-line error of a diverged run.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self.writer = SummaryWriter(str(self.directory))
        self.constants = set(loop.report)
        for name, value in _scalars(loop.report).items():
            self.writer.add_scalar(f"run/{name}", value, loop.start_step)

    def step(self, info):
        """Write the step's scalars and per-layer histograms, then flush.

        Args:
          info: the step just done.
        """
        if self.writer is None:
            return
        for name, value in _scalars(info.record).items():
            if name not in self.constants:
                self.writer.add_scalar(name, value, info.step)
        for name, value in info.record.items():
            if isinstance(value, list) and value and isinstance(value[0], list):
                for i, row in enumerate(value):
                    self.writer.add_histogram(f"{name}/layer_{i}", np.asarray(row), info.step)
        self.writer.flush()

    def end(self, loop):
        """Close the writer.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if self.writer is not None:
            self.writer.close()


def parse_step_range(text: str) -> tuple[int, int]:
    """`"A:B"` -> (A, B): steps A to B, both included, numbered from 1 as in `metrics.jsonl`.

    Args:
      text: `--profile-steps`'s value.

    Returns:
      `(A, B)`.

    Raises:
      ValueError: not `A:B` with 1 <= A <= B.
    """
    first, sep, last = str(text).partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or not 1 <= a <= b:
        raise ValueError(f"--profile-steps takes A:B with 1 <= A <= B (steps A to B), got {text!r}")
    return a, b


class Profile(Hook):
    """A `jax.profiler` trace of steps `first..last` (numbered from 1) in `directory`.

    The trace is viewable in TensorBoard's profile plugin or Perfetto (`perfetto_trace.json.gz`);
    every process traces its own devices (under `process<i>/` when there are several), the main
    one prints where it is.

    Args:
      directory: where the trace goes.
      first: the first step traced.
      last: the last step traced.
    """

    def __init__(self, directory: str | pathlib.Path, first: int, last: int):
        self.directory, self.first, self.last = pathlib.Path(directory), first, last
        self.tracing = False

    def start(self, loop):
        """Start tracing now if the first traced step is the next one (or already passed).

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        import jax

        if jax.process_count() > 1:
            self.directory = self.directory / f"process{jax.process_index()}"
        self.console = loop.console
        if loop.start_step + 1 >= self.first and loop.start_step < self.last:
            self._start()

    def _start(self):
        import jax

        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        self.tracing = True

    def _stop(self, step: int):
        import jax

        jax.profiler.stop_trace()  # the loop has waited for the step's results
        self.tracing = False
        traces = sorted(self.directory.glob("plugins/profile/*/"))
        where = traces[-1] if traces else self.directory
        self.console.print(f"profile of steps {self.first}-{step} written to {where} "
                           f"(tensorboard --logdir {self.directory}, or perfetto_trace.json.gz "
                           f"in ui.perfetto.dev)")

    def step(self, info):
        """Start tracing before step `first`; stop after step `last`.

        Args:
          info: the step just done.
        """
        if info.step == self.first - 1 and not self.tracing:
            self._start()
        elif info.step == self.last and self.tracing:
            self._stop(info.step)

    def end(self, loop):
        """Stop a trace still running.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if self.tracing:
            self._stop(int(loop.state.step))


class ExportPretrained(Hook):
    """At the end of a completed run, `write(state)` (e.g. a Hugging Face directory of its params).

    Called on every process: gathering sharded parameters is collective.

    Args:
      write: `write(state)`, the exporter.
    """

    def __init__(self, write: Callable[[Any], None]):
        self.write = write

    def end(self, loop):
        """Export the state of a completed run.

        Args:
          loop: the training loop (`run.loop.Loop`).
        """
        if loop.completed:
            self.write(loop.state)
            loop.console.print("exported the trained model")
