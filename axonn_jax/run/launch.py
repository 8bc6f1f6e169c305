"""`axonn-jax launch`: run P processes of one job on this machine, over loopback.

Process 0's output goes to the terminal (and to its log); the others write only to their logs. When
any process fails, the launcher stops the rest and exits with the failing process's code and the
tail of its log, instead of leaving the survivors blocked in a collective; with `max_restarts` it
then starts the whole job again, from its newest checkpoint (`train --resume auto`). SIGTERM and
SIGUSR1 are passed on to every process (they save a checkpoint and stop together, `run.stopping`);
Ctrl-C stops all.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

from .distributed import (ENV_COORDINATOR, ENV_HEARTBEAT_TIMEOUT, ENV_LOCAL_DEVICES,
                          ENV_NUM_PROCESSES, ENV_PROCESS_ID, free_port)
from .stopping import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED

GRACE_S = 5.0
"""How long a stopped process may take to exit after SIGTERM before it gets SIGKILL."""
FINISH_GRACE_S = 60.0
"""How long the others may keep running after one process of the job has finished successfully
(they finish together: a straggler is stuck, e.g. waiting for a peer that will never answer)."""
POLL_S = 0.1
TAIL_LINES = 20
ENV_LAUNCHER_PID = "AXONN_LAUNCHER_PID"
NOT_RESTARTED = (2, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_INTERRUPTED)
"""Exit codes that a restart would only repeat (bad input, divergence) or that were asked for."""


@dataclasses.dataclass
class Failure:
    """Why the job stopped: `message` names the process, `exit_code` is the launcher's."""

    process_id: int
    message: str
    exit_code: int
    hung: bool = False

    @classmethod
    def of(cls, process_id: int, returncode: int) -> "Failure":
        """The failure of a process that exited with `returncode`.

        Args:
          process_id: the process.
          returncode: its `Popen.returncode` (negative: killed by that signal).

        Returns:
          The `Failure`; a killed process's exit code is 128 + the signal.
        """
        if returncode < 0:
            return cls(process_id, f"process {process_id} was killed by signal "
                                   f"{signal.Signals(-returncode).name}", 128 - returncode)
        return cls(process_id, f"process {process_id} exited with code {returncode}", returncode)


def _tail(path: pathlib.Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


_HEARTBEATS = re.compile(r"stopped sending heartbeats\):(.{0,400}?)(?:The tasks|RPC:|$)", re.S)


def _unresponsive(logs: list[pathlib.Path]) -> list[int]:
    """The processes that JAX's distributed runtime declared dead for missing heartbeats (a hung
    or stopped process), as the failed processes' logs name them."""
    for log in logs:
        try:
            text = log.read_text(errors="replace")[-20000:]
        except OSError:
            continue
        if m := _HEARTBEATS.search(text):
            named = m.group(1)
            ids = re.findall(r"task:(\d+)", named) if "task:" in named else re.findall(r"\d+", named)
            if ids:
                return sorted({int(i) for i in ids})
    return []


_STACK_DUMP = re.compile(rb"^(\*\*\* Check failure stack trace: \*\*\*|\s+@\s+0x)")
"""Lines of a C++ runtime's stack dump: they go to the log, not to the terminal."""


def _tee(stream, log_file, out) -> None:
    for line in iter(stream.readline, b""):
        log_file.write(line)
        log_file.flush()
        if not _STACK_DUMP.match(line):
            out.buffer.write(line)
            out.flush()


def follow_launcher() -> None:
    """In a process `launch` started: on Linux, be killed when the launcher dies.

    Even by SIGKILL, which the launcher cannot catch to stop its job; elsewhere, and in a process
    `launch` did not start, nothing. Called first thing by the CLI.
    """
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def _stop(procs: list[subprocess.Popen], graceful: bool = True) -> None:
    """SIGTERM every live process group (a `train` process then saves at its next step
    boundary), then SIGKILL whatever is left after GRACE_S; not `graceful`: SIGKILL at once."""
    live = [p for p in procs if p.poll() is None]
    signals = ((signal.SIGTERM, GRACE_S),) if graceful else ()
    for sig, wait in (*signals, (signal.SIGKILL, GRACE_S)):
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(POLL_S)
        live = [p for p in live if p.poll() is None]
        if not live:
            return


class _Signals:
    """While entered in the main thread: SIGTERM and SIGUSR1 are passed on to the job's process
    groups (and remembered in `received`), Ctrl-C raises KeyboardInterrupt even when the
    launcher was started with SIGINT ignored (as a shell's background job is)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, handler) for sig, handler in (
                (signal.SIGTERM, self._forward), (signal.SIGUSR1, self._forward),
                (signal.SIGINT, signal.default_int_handler))}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum, frame):
        self.received = signal.Signals(signum).name
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass


def launch(command: list[str], nprocs: int, devices_per_proc: int | None = None,
           port: int | None = None, log_dir: str | pathlib.Path = "axonn-launch-logs",
           stdout=None, max_restarts: int = 0, heartbeat_timeout: int | None = None) -> int:
    """Run `python -m axonn_jax <command>` as `nprocs` processes of one job; return the exit code.

    When `command` starts with a `.py` file, that script runs instead (`python script.py ...`,
    which joins the job with `axonn_jax.init_distributed()`). Each process gets
    `AXONN_COORDINATOR=127.0.0.1:port`, `AXONN_NUM_PROCESSES`, `AXONN_PROCESS_ID` and (when
    given) `AXONN_LOCAL_DEVICES=devices_per_proc` with `JAX_LOCAL_DEVICE_IDS` naming its share of
    the accelerators; the process ids go to `log_dir/launch.json`.

    Args:
      command: the `axonn_jax` command and its arguments, or a script and its arguments.
      nprocs: the processes (at least 1).
      devices_per_proc: the accelerators each process takes (None: not set).
      port: the coordinator's port on loopback (None: a free one, fresh for each restart).
      log_dir: where each process's log goes (`log_dir/proc<i>.log`).
      stdout: where process 0's output goes (None: `sys.stdout`).
      max_restarts: when a process fails, start the whole job again up to this many times (a
        `train` command with `--resume auto` added when it has no `--resume`), each restart
        logged in one line with its cause; not after bad input (exit code 2), divergence (3), a
        signal.
      heartbeat_timeout: seconds after which JAX's distributed runtime declares a process that
        stopped answering dead (`AXONN_HEARTBEAT_TIMEOUT`; JAX's default: 100).

    Returns:
      0 when all succeed, else the first failure's code (128 + signal for a killed process; 130
      after Ctrl-C; 75 when SIGTERM or SIGUSR1 stopped the job and it saved its checkpoint).

    Raises:
      ValueError: a size out of range, or no command.
    """
    if nprocs < 1:
        raise ValueError(f"--nprocs must be positive, got {nprocs}")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc must be positive, got {devices_per_proc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if heartbeat_timeout is not None and heartbeat_timeout < 1:
        raise ValueError(f"--heartbeat-timeout must be positive, got {heartbeat_timeout}")
    if not command:
        raise ValueError("nothing to launch: give the command after `--`, e.g. `-- train --steps 10`")
    stdout = stdout or sys.stdout
    log_dir = pathlib.Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ENV_NUM_PROCESSES: str(nprocs), ENV_LAUNCHER_PID: str(os.getpid()),
                              "PYTHONUNBUFFERED": "1"})
    if devices_per_proc is not None:
        env[ENV_LOCAL_DEVICES] = str(devices_per_proc)
    if heartbeat_timeout is not None:
        env[ENV_HEARTBEAT_TIMEOUT] = str(heartbeat_timeout)
    restarts = 0
    with _Signals() as signals:
        while True:
            # A fresh port each time: the last job's may not be free again yet.
            env[ENV_COORDINATOR] = f"127.0.0.1:{port or free_port()}"
            result = _run_job(command, nprocs, devices_per_proc, env, log_dir, stdout, signals,
                              restart=restarts)
            if not isinstance(result, Failure):
                return result
            failure = result
            if restarts == max_restarts or signals.received or failure.exit_code in NOT_RESTARTED:
                break
            restarts += 1
            print(f"axonn-jax launch: {failure.message}; restarting the job from its newest "
                  f"checkpoint (restart {restarts} of {max_restarts})", file=sys.stderr)
            if command[0] == "train" and not any(a.split("=")[0] == "--resume" for a in command):
                command = [*command, "--resume", "auto"]
    log = log_dir / f"proc{failure.process_id}.log"
    if failure.hung:  # its log ends in the runtime's stack dumps, not in the cause
        print(f"axonn-jax launch: {failure.message}; stopped the other processes (logs: "
              f"{log_dir})", file=sys.stderr)
    else:
        print(f"axonn-jax launch: {failure.message}; stopped the other processes.\n"
              f"--- last lines of {log} ---\n{_tail(log)}", file=sys.stderr)
    return failure.exit_code


def _run_job(command, nprocs, devices_per_proc, env, log_dir, stdout, signals,
             restart: int) -> int | Failure:
    """Start the job's processes and wait for them: the exit code when all finished (0, or 75
    when a signal stopped them), else the failure."""
    procs, threads = [], []
    signals.procs = procs
    try:
        for i in range(nprocs):
            log_path = log_dir / f"proc{i}.log"
            log = open(log_path, "ab" if restart else "wb")
            if restart:
                log.write(f"--- restart {restart} of the job ---\n".encode())
                log.flush()
            own_env = {**env, ENV_PROCESS_ID: str(i)}
            if devices_per_proc is not None:
                # On GPUs process i drives devices [i·K, (i+1)·K): JAX reads this variable (it sets
                # the CUDA/ROCm visible devices; the CPU backend ignores it).
                ids = range(i * devices_per_proc, (i + 1) * devices_per_proc)
                own_env["JAX_LOCAL_DEVICE_IDS"] = ",".join(map(str, ids))
            program = [] if command[0].endswith(".py") else ["-m", "axonn_jax"]
            p = subprocess.Popen(
                [sys.executable, *program, *command],
                env=own_env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if i == 0 else log, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group: stopped with all its children
            procs.append(p)
            if i == 0:
                t = threading.Thread(target=_tee, args=(p.stdout, log, stdout), daemon=True)
                t.start()
                threads.append((t, log))
            else:
                log.close()
        (log_dir / "launch.json").write_text(json.dumps(
            {"coordinator": env[ENV_COORDINATOR], "pids": [p.pid for p in procs]}))
        failure = _watch(procs)
        if failure is None:
            codes = [p.returncode for p in procs]
            return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
        time.sleep(POLL_S * 5)  # the others' last words (a process declared dead) reach the logs
        # A peer is gone: the others cannot finish a step, let alone save.
        _stop(procs, graceful=False)
        failed = [log_dir / f"proc{i}.log" for i, p in enumerate(procs) if p.poll()]
        if hung := _unresponsive(failed):
            names = ", ".join(map(str, hung))
            return Failure(hung[0], f"process{'es' if len(hung) > 1 else ''} {names} stopped "
                                    f"answering (no heartbeat)", 1, hung=True)
        return failure
    except KeyboardInterrupt:
        _stop(procs)  # before the message: the user sees it once all are gone
        print("axonn-jax launch: interrupted; stopped all processes", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        _stop(procs)
        for t, log in threads:
            t.join(timeout=GRACE_S)
            log.close()


def _watch(procs) -> Failure | None:
    """Wait until all processes succeed (None) or one fails (the first failure seen), or one is
    still running FINISH_GRACE_S after another finished."""
    first_done, finished = None, (0, EXIT_PREEMPTED)  # 75: stopped by a signal, saved
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, *finished)]
        if failed:
            # A killed process is the likelier root cause than a peer that lost its connection.
            i = min(failed, key=lambda i: (codes[i] >= 0, i))
            return Failure.of(i, codes[i])
        if all(c in finished for c in codes):
            return None
        done = [i for i, c in enumerate(codes) if c in finished]
        if first_done is None and done:
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > FINISH_GRACE_S:
            i = codes.index(None)
            return Failure(i, f"process {i} was still running {FINISH_GRACE_S:.0f} s after "
                              f"process {done[0]} finished", 1)
        time.sleep(POLL_S)


def main(args) -> int:
    """Entry point for the parsed `axonn-jax launch` arguments.

    Args:
      args: the parsed arguments (`command` may start with `--`).

    Returns:
      The exit code of `launch`.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return launch(command, args.nprocs, args.devices_per_proc, args.port, args.log_dir,
                  max_restarts=args.max_restarts, heartbeat_timeout=args.heartbeat_timeout)
