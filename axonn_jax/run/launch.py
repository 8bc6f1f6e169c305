"""`axonn-jax launch`: run P processes of one job on this machine, over loopback.

Process 0's output goes to the terminal (and to its log); the others write only to their logs. When
any process fails, the launcher stops the rest and exits with the failing process's code and the
tail of its log, instead of leaving the survivors blocked in a collective. Ctrl-C stops all.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from .distributed import (ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                          free_port)

GRACE_S = 5.0
"""How long a stopped process may take to exit after SIGTERM before it gets SIGKILL."""
FINISH_GRACE_S = 60.0
"""How long the others may keep running after one process of the job has finished successfully
(they finish together: a straggler is stuck, e.g. waiting for a peer that will never answer)."""
POLL_S = 0.1
TAIL_LINES = 20
ENV_LAUNCHER_PID = "AXONN_LAUNCHER_PID"


@dataclasses.dataclass
class Failure:
    """Why the job stopped: `message` names the process, `exit_code` is the launcher's."""

    process_id: int
    message: str
    exit_code: int

    @classmethod
    def of(cls, process_id: int, returncode: int) -> "Failure":
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


def _tee(stream, log_file, out) -> None:
    for line in iter(stream.readline, b""):
        log_file.write(line)
        log_file.flush()
        out.buffer.write(line)
        out.flush()


def follow_launcher() -> None:
    """In a process `launch` started: on Linux, be killed when the launcher dies, even by SIGKILL,
    which it cannot catch to stop its job (elsewhere: nothing). Called first thing by the CLI."""
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live process group, then SIGKILL whatever is left after GRACE_S."""
    live = [p for p in procs if p.poll() is None]
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
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


def launch(command: list[str], nprocs: int, devices_per_proc: int | None = None,
           port: int | None = None, log_dir: str | pathlib.Path = "axonn-launch-logs",
           stdout=None) -> int:
    """Run `python -m axonn_jax <command>` (or, when `command` starts with a `.py` file, that
    script: `python script.py ...`, which joins the job with `axonn_jax.init_distributed()`) as
    `nprocs` processes of one job; returns the exit code.

    Each process gets `AXONN_COORDINATOR=127.0.0.1:port`, `AXONN_NUM_PROCESSES`, `AXONN_PROCESS_ID`
    and (when given) `AXONN_LOCAL_DEVICES=devices_per_proc` with `JAX_LOCAL_DEVICE_IDS` naming its
    share of the accelerators; logs go to `log_dir/proc<i>.log` and the
    process ids to `log_dir/launch.json`. Returns 0 when all succeed, else the first failure's code
    (128 + signal for a killed process; 130 after Ctrl-C).
    """
    if nprocs < 1:
        raise ValueError(f"--nprocs must be positive, got {nprocs}")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc must be positive, got {devices_per_proc}")
    if not command:
        raise ValueError("nothing to launch: give the command after `--`, e.g. `-- train --steps 10`")
    stdout = stdout or sys.stdout
    port = port or free_port()
    log_dir = pathlib.Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}",
                              ENV_NUM_PROCESSES: str(nprocs), ENV_LAUNCHER_PID: str(os.getpid()),
                              "PYTHONUNBUFFERED": "1"})
    if devices_per_proc is not None:
        env[ENV_LOCAL_DEVICES] = str(devices_per_proc)
    procs, logs, threads = [], [], []
    try:
        for i in range(nprocs):
            log_path = log_dir / f"proc{i}.log"
            log = open(log_path, "wb")
            logs.append(log_path)
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
    except KeyboardInterrupt:
        _stop(procs)  # before the message: the user sees it once all are gone
        print("axonn-jax launch: interrupted; stopped all processes", file=sys.stderr)
        return 130
    finally:
        _stop(procs)
        for t, log in threads:
            t.join(timeout=GRACE_S)
            log.close()
    if failure is None:
        return 0
    log = logs[failure.process_id]
    print(f"axonn-jax launch: {failure.message}; stopped the other processes.\n"
          f"--- last lines of {log} ---\n{_tail(log)}", file=sys.stderr)
    return failure.exit_code


def _watch(procs) -> Failure | None:
    """Wait until all processes succeed (None) or one fails (the first failure seen), or one is
    still running FINISH_GRACE_S after another finished."""
    first_done = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            # A killed process is the likelier root cause than a peer that lost its connection.
            i = min(failed, key=lambda i: (codes[i] >= 0, i))
            return Failure.of(i, codes[i])
        if all(c == 0 for c in codes):
            return None
        if first_done is None and 0 in codes:
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > FINISH_GRACE_S:
            i = codes.index(None)
            return Failure(i, f"process {i} was still running {FINISH_GRACE_S:.0f} s after "
                              f"process {codes.index(0)} finished", 1)
        time.sleep(POLL_S)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(args) -> int:
    """Entry point for the parsed `axonn-jax launch` arguments."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    # A terminated launcher stops its job. Ctrl-C too, even when the launcher was started with
    # SIGINT ignored (as a shell's background job is), which its children would also inherit.
    previous = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGTERM, _raise_interrupt), (signal.SIGINT, signal.default_int_handler))}
    try:
        return launch(command, args.nprocs, args.devices_per_proc, args.port, args.log_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
