"""Run directories: everything about one training run in one place.

    RUN_DIR/
      config.yaml      the effective config (`axonn-jax train --config RUN_DIR/config.yaml` reruns it)
      metrics.jsonl    one JSON object per step
      train.log        what the run printed
      checkpoints/     orbax checkpoints: --checkpoint-every, --stop-at, a stopping signal
                       (`--resume RUN_DIR` continues)
      hlo/             the optimized HLO of the compiled train step
      tensorboard/     TensorBoard event files (`tensorboard --logdir RUN_DIR/tensorboard`)
      profile/         jax.profiler traces of `--profile-steps A:B`
      plots/           `axonn-jax report RUN_DIR`'s PNGs and summary
      logs/            `axonn-jax launch`'s per-process logs

The command line's default is `runs/<model>-<YYYYmmdd-HHMMSS>` (`$AXONN_RUNS/...` when that is set,
e.g. to a scratch file system); `train(TrainOptions(run_dir=...))` fills the same directory
(all but `config.yaml` and `train.log`, which are the command line's).
"""
from __future__ import annotations

import datetime
import os
import pathlib
import re
import sys

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LOG = "train.log"
CHECKPOINTS = "checkpoints"
HLO = "hlo"
TENSORBOARD = "tensorboard"
PROFILE = "profile"
PLOTS = "plots"
LAUNCH_LOGS = "logs"
ENV_ROOT = "AXONN_RUNS"
"""Where default run directories go (default: `runs` in the working directory)."""


def default_run_dir(name: str, root: str | pathlib.Path | None = None, now=None) -> pathlib.Path:
    """A fresh run directory's path, `root/<name>-<YYYYmmdd-HHMMSS>`, not yet created.

    Args:
      name: the run's name (e.g. the model's; characters other than letters, digits, `_.-`
        become `_`).
      root: where it goes (None: `$AXONN_RUNS`, else `runs`).
      now: the time it is named by (None: now).

    Returns:
      The path, with `-2`, `-3`, ... appended when it is taken.
    """
    root = root or os.environ.get(ENV_ROOT) or "runs"
    now = now or datetime.datetime.now()
    stem = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{now:%Y%m%d-%H%M%S}"
    path, n = pathlib.Path(root) / stem, 1
    while path.exists():
        n += 1
        path = pathlib.Path(root) / f"{stem}-{n}"
    return path


def agree(text: str, transport: str = "xla") -> str:
    """Process 0's `text` on every process of the job; a collective.

    A default run directory chosen by the clock must be one directory. The text is broadcast
    over MPI under `--transport mpi`, over JAX's distributed runtime when it spans several
    processes (its first 1024 UTF-8 bytes).

    Args:
      text: this process's text.
      transport: the run's `--transport`, `xla` or `mpi`.

    Returns:
      Process 0's text (`text` itself in a single process).
    """
    if transport == "mpi":
        from ..transport.mpi import world

        return world()[0].bcast(text, root=0)
    import jax

    if jax.process_count() == 1:
        return text
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.zeros(1024, np.uint8)
    encoded = text.encode()[:1024]
    raw[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(agreed[agreed != 0].tolist()).decode()


def with_run_dir(config):
    """`config` with the outputs it leaves unset placed in its `run_dir`.

    Args:
      config: a `run.options.RunConfig`.

    Returns:
      The config with its metrics file, HLO dump and, when it checkpoints, stops at `stop_at` or
      resumes, checkpoint directory in the run directory; unchanged without a `run_dir`.
    """
    r, c = config.run, config.checkpoint
    if not r.run_dir:
        return config
    root = pathlib.Path(r.run_dir)
    checkpoints = c.every > 0 or c.resume or c.stop_at > 0
    return config.replace(**{
        "run.metrics_out": r.metrics_out or str(root / METRICS),
        "checkpoint.dir": c.dir or (str(root / CHECKPOINTS) if checkpoints else None),
        "run.dump_hlo": r.dump_hlo or str(root / HLO)})


_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


class Tee:
    """A text stream writing to the `sys.stdout` of its creation and to a log file.

    The `sys.stdout` is the one of its creation: a live progress display that later redirects
    `sys.stdout` into its console must not loop back. The log gets plain complete lines: terminal
    escape codes removed, and of a line redrawn with carriage returns only its last state (a live
    progress bar appears once, as it ended).

    Args:
      log_path: the log file (appended to).
    """

    def __init__(self, log_path: str | pathlib.Path):
        self.out = sys.stdout
        self.log = open(log_path, "a", encoding="utf-8")
        self.pending = ""

    def write(self, text: str) -> int:
        """Write `text` to the stream, and its complete lines, made plain, to the log.

        Args:
          text: any text.

        Returns:
          The characters written, `len(text)`.
        """
        self.out.write(text)
        self.pending += _ESCAPE.sub("", text)
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.log.write(line.rsplit("\r", 1)[-1] + "\n")
        self.log.flush()
        return len(text)

    def flush(self) -> None:
        """Flush the stream and the log."""
        self.out.flush()
        self.log.flush()

    def isatty(self) -> bool:
        """Whether the stream is a terminal.

        Returns:
          The stream's `isatty()`.
        """
        return self.out.isatty()

    def fileno(self) -> int:
        """The stream's file descriptor.

        Returns:
          The stream's `fileno()`.
        """
        return self.out.fileno()

    @property
    def encoding(self) -> str:
        """The stream's encoding (default `utf-8`)."""
        return getattr(self.out, "encoding", "utf-8")

    def log_only(self, text: str) -> None:
        """Write `text` to the log alone (e.g. a traceback the terminal shows in its own way).

        Args:
          text: the text; a newline is added when it lacks one.
        """
        self.log.write(text if text.endswith("\n") else text + "\n")
        self.log.flush()

    def close(self) -> None:
        """Write an unfinished last line to the log and close the log (not the stream)."""
        if self.pending.strip():
            self.log.write(self.pending.rsplit("\r", 1)[-1] + "\n")
        self.log.close()
