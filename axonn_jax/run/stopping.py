"""Stopping a run early and cleanly: preemption signals, Ctrl-C, divergence, and the exit codes.

SIGTERM (what a scheduler sends before it kills a job) and SIGUSR1 (what SLURM's
`--signal=USR1@SECONDS` sends before a time limit) ask the run to stop: the loop finishes the step
it is in, saves a checkpoint and returns; the command line then exits with `EXIT_PREEMPTED`.
Ctrl-C (SIGINT) does the same and exits with 130; a second Ctrl-C stops at once. In a job of
several processes, a signal that reaches only some of them still stops all at the same step: the
processes agree at every step boundary (`StopRequest.agreed`).
"""
from __future__ import annotations

import signal
import threading
from typing import Callable

EXIT_PREEMPTED = 75
"""Exit code of a run stopped by SIGTERM or SIGUSR1 after saving its checkpoint (sysexits'
EX_TEMPFAIL: try again later, e.g. requeue the job with `--resume auto`)."""
EXIT_DIVERGED = 3
"""Exit code of a run stopped by a non-finite loss (nothing of the diverged step is saved)."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as shells report it)."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Diverged(RuntimeError):
    """The loss of a step was not finite: the run stops before the step's state is kept."""


class StopRequest:
    """Catches `SIGNALS` while entered; says at a step boundary whether the run stops there.

    Enter it with `with StopRequest(agree):`; it catches signals only in the main thread
    (elsewhere nothing). A second Ctrl-C raises KeyboardInterrupt at once.

    Args:
      agree: `int -> int`, the number of the signal this process received (0: none) to the
        largest over the job's processes (the same answer on every process; identity for one
        process).
    """

    def __init__(self, agree: Callable[[int], int] = int):
        self.agree = agree
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.received = signal.Signals(signum)

    def agreed(self) -> str | None:
        """The name of the signal that stops the job at this step boundary, or None.

        A collective: every process calls it at every boundary, and gets the same answer.

        Returns:
          The signal's name (e.g. `SIGTERM`), or None to go on.
        """
        signum = int(self.agree(int(self.received or 0)))
        return signal.Signals(signum).name if signum else None


def process_agreement(transport: str) -> Callable[[int], int]:
    """`int -> int`: the largest of the processes' numbers, on every process.

    Args:
      transport: the run's `--transport`: `mpi` agrees over MPI, `xla` over JAX's distributed
        runtime (several JAX processes).

    Returns:
      The agreement function (`int`, the identity, in a single JAX process).
    """
    if transport == "mpi":
        from mpi4py import MPI

        from ..transport.mpi import world

        comm = world()[0]
        return lambda n: comm.allreduce(n, op=MPI.MAX)
    import jax

    if jax.process_count() == 1:
        return int
    import numpy as np
    from jax.experimental import multihost_utils

    return lambda n: int(np.max(multihost_utils.process_allgather(np.int32(n))))


def exit_code(signal_name: str | None) -> int:
    """The command line's exit code for a run that stopped on `signal_name`.

    Args:
      signal_name: the signal's name, or None for a run that finished.

    Returns:
      0 when finished, `EXIT_INTERRUPTED` after SIGINT, else `EXIT_PREEMPTED`.
    """
    if signal_name is None:
        return 0
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED
