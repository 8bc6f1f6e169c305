"""Start-up of a run's main process: the TensorBoard writer with and without PyTorch's import.

tensorboardX imports torch where it is installed; `run.hooks._summary_writer` imports it without.
Each variant runs in a fresh process (the package's import, then the writer's), alternating, and
the medians go to `benchmarks/results/startup.md`.

    .venv/bin/python benchmarks/startup.py --repeats 5
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "tensorboardX as installed (imports torch)":
        "import axonn_jax.run.cli; from tensorboardX import SummaryWriter",
    "run.hooks._summary_writer (without torch)":
        "import axonn_jax.run.cli; from axonn_jax.run.hooks import _summary_writer; "
        "_summary_writer()",
}


def seconds(code: str) -> float:
    """Wall seconds of `python -c code` in a fresh process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "startup.md"))
    args = p.parse_args()
    times = {name: [] for name in VARIANTS}
    seconds(next(iter(VARIANTS.values())))  # warm the file cache
    for _ in range(args.repeats):
        for name, code in VARIANTS.items():
            times[name].append(seconds(code))
    first, second = (statistics.median(t) for t in times.values())
    lines = ["# Start-up: the TensorBoard writer's import", "",
             f"`{' '.join(['python', *sys.argv])}`: {args.repeats} alternating fresh processes "
             "each, on this machine's CPU.", "",
             "| variant | median s | runs |", "|---|---|---|"]
    lines += [f"| {name} | {statistics.median(t):.2f} | {', '.join(f'{x:.2f}' for x in t)} |"
              for name, t in times.items()]
    lines += ["", f"Without torch: {first - second:.2f} s less, {second / first:.2f}× the time."]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
