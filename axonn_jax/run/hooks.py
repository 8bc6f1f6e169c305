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


@dataclasses.dataclass
class StepInfo:
    """`step`: steps done, this one included; `state`: the state after it; `record`: its metrics."""

    step: int
    state: Any
    record: dict


class Hook:
    def start(self, loop) -> None:
        pass

    def step(self, info: StepInfo) -> None:
        pass

    def end(self, loop) -> None:
        pass


class HloDump(Hook):
    """Writes the optimized HLO of the compiled train step to `directory/train_step.hlo.txt`."""

    def __init__(self, directory: str):
        self.directory = pathlib.Path(directory)

    def start(self, loop):
        if loop.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "train_step.hlo.txt").write_text(loop.compiled.as_text())


class Validation(Hook):
    """The mean loss over `evaluate(params) -> float` before the first step, every `every` steps
    and after the last; adds `val_loss` to the record and keeps `history` [(step, loss), ...]."""

    def __init__(self, evaluate: Callable[[Any], float], every: int, last_step: int):
        self.evaluate, self.every, self.last_step = evaluate, every, last_step
        self.history: list[tuple[int, float]] = []

    def start(self, loop):
        loss = self.evaluate(loop.state["params"])
        self.history.append((loop.start_step, loss))
        loop.console.print(f"validation loss at step {loop.start_step}: {loss:.4f}")

    def step(self, info):
        if info.step % self.every == 0 or info.step == self.last_step:
            info.record["val_loss"] = self.evaluate(info.state["params"])
            self.history.append((info.step, info.record["val_loss"]))

    def end(self, loop):
        if self.history:
            loop.console.print(f"validation loss: first {self.history[0][1]:.4f} -> last "
                               f"{self.history[-1][1]:.4f}")


class MetricsFile(Hook):
    """One JSON object per step in `path` (appended to when the run resumes)."""

    def __init__(self, path: str, append: bool):
        self.path, self.append, self.file = path, append, None

    def start(self, loop):
        if loop.is_main:
            self.file = open(self.path, "a" if self.append else "w")

    def step(self, info):
        if self.file:
            self.file.write(json.dumps(info.record) + "\n")
            self.file.flush()

    def end(self, loop):
        if self.file:
            self.file.close()


class Checkpoints(Hook):
    """Saves the state every `checkpointer.every` steps, and at the end (also when the loop stops on
    an error, so that `--resume` continues from where it stopped)."""

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def step(self, info):
        self.checkpointer.maybe_save(info.step, info.state)

    def end(self, loop):
        c = self.checkpointer
        c.maybe_save(int(loop.state["step"]), loop.state, force=c.every > 0)
        c.close()


class Progress(Hook):
    """A progress bar with the loss and throughput (a line per validation when not on a terminal)."""

    def start(self, loop):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                   TimeRemainingColumn)

        self.console = loop.console
        self.bar = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                       console=loop.console, disable=not loop.is_main)
        self.bar.start()
        self.task = self.bar.add_task("train", total=loop.trainer.options.steps,
                                      completed=loop.start_step, info="")

    def step(self, info):
        r = info.record
        if "val_loss" in r and not self.console.is_terminal:
            self.console.print(f"step {info.step}: loss {r['loss']:.4f} val_loss "
                               f"{r['val_loss']:.4f} {r['examples_per_s']:,.1f} examples/s")
        self.bar.update(self.task, advance=1, info=f"loss {r['loss']:.3f} "
                        f"{r['step_time_s'] * 1e3:.0f} ms/step")

    def end(self, loop):
        self.bar.stop()


class Sample(Hook):
    """At the end, prints `generate(params) -> str` (e.g. a language model's continuation)."""

    def __init__(self, generate: Callable[[Any], str]):
        self.generate, self.text = generate, None

    def end(self, loop):
        if not loop.completed:
            return
        self.text = self.generate(loop.state["params"])
        loop.console.print("[bold]sample:[/]")
        loop.console.print(self.text, markup=False, highlight=False)


class ExportPretrained(Hook):
    """At the end of a completed run, `write(params)` (e.g. a Hugging Face directory; called on
    every process: gathering sharded parameters is collective)."""

    def __init__(self, write: Callable[[Any], None]):
        self.write = write

    def end(self, loop):
        if loop.completed:
            self.write(loop.state["params"])
            loop.console.print("exported the trained model")
