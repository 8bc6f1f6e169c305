"""Compressed against exact data-parallel gradients across processes on this machine.

Each configuration runs as `axonn-jax launch --nprocs P --devices-per-proc 1 -- train ...`: P
processes with one CPU device each, their collectives over loopback (gloo, TCP). Wire bytes come
from the compiled train step's HLO (`--dump-hlo`); step time is the median `step_time_s` of process
0's metrics after two warm-up steps. Results: benchmarks/results/compression_multiproc.{json,md}.

Unshaped loopback moves bytes at memory speed, so it is never communication-bound. `--link-mbit`
caps the loopback interface with a token-bucket filter (`tc qdisc ... tbf`, needs root; removed
afterwards) to emulate a slower link between the processes: every process's traffic to the others
shares that one bucket, as it would share one NIC. `0` leaves loopback unshaped. Run it in a
private network namespace so that the cap leaves the machine's own loopback alone:
`unshare -n sh -c 'ip link set lo up; python benchmarks/bench_compression_multiproc.py ...'`.

    python benchmarks/bench_compression_multiproc.py [--models gpt-small] [--link-mbit 0 1000 500]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

from axonn_jax.analysis.hlo import wire_bytes

REPO = pathlib.Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def shaped_loopback(mbit: int):
    """Cap `lo` at `mbit` Mbit/s for the duration (0: leave it alone)."""
    if not mbit:
        yield
        return
    if os.geteuid() != 0:
        raise SystemExit("--link-mbit shapes the loopback interface with tc and needs root")
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", "1mb", "latency", "200ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=True)


def run(model: str, bits: int, nprocs: int, steps: int, batch: int, seq: int, work: pathlib.Path):
    """(median step seconds, wire bytes per device per step) of one multi-process training run."""
    tag = f"{model}-{bits or 'exact'}"
    metrics, hlo = work / f"{tag}.jsonl", work / f"hlo-{tag}"
    cmd = [sys.executable, "-m", "axonn_jax", "launch", "--nprocs", str(nprocs),
           "--devices-per-proc", "1", "--log-dir", str(work / f"logs-{tag}"), "--",
           "train", "--model", model, "--steps", str(steps), "--batch-size", str(batch),
           "--seq-len", str(seq), "--eval-batches", "1", "--eval-every", str(steps),
           "--data", str(REPO / "axonn_jax"), "--metrics-out", str(metrics), "--dump-hlo", str(hlo)]
    if bits:
        cmd += ["--compress-bits", str(bits)]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][2:]
    wire = sum(wire_bytes((hlo / "train_step.hlo.txt").read_text()).values())
    return statistics.median(times), wire


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt-mini", "gpt-small"])
    p.add_argument("--bits", nargs="+", type=int, default=[0, 4])
    p.add_argument("--link-mbit", nargs="+", type=int, default=[0],
                   help="loopback rate caps to measure at, Mbit/s (0: unshaped)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mbit in args.link_mbit:
            with shaped_loopback(mbit):
                for model in args.models:
                    for bits in args.bits:
                        step_s, wire = run(model, bits, args.nprocs, args.steps, args.batch_size,
                                           args.seq_len, pathlib.Path(tmp))
                        rows.append({"link_mbit": mbit, "model": model, "bits": bits,
                                     "step_s": step_s, "wire_bytes": wire})
                        print(rows[-1], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = f"{args.nprocs} processes × 1 CPU device, loopback (gloo over TCP), {platform.machine()}"
    (out / "compression_multiproc.json").write_text(json.dumps({"device": device, **vars(args),
                                                                "rows": rows}, indent=1))
    lines = [f"# Compressed gradients across processes ({device})", "",
             f"batch {args.batch_size} × {args.seq_len} tokens, median of steps 3–{args.steps}. "
             "Link: loopback capped with `tc ... tbf` (unshaped: memory speed).", "",
             "| link | model | bits | wire bytes/device/step | vs exact | step ms | vs exact |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["bits"] == 0
                    and b["link_mbit"] == r["link_mbit"])
        link = f"{r['link_mbit']} Mbit/s" if r["link_mbit"] else "unshaped"
        lines.append(f"| {link} | {r['model']} | {r['bits'] or 'exact'} | {r['wire_bytes']:,.0f} | "
                     f"{r['wire_bytes'] / base['wire_bytes']:.3f} | {r['step_s'] * 1e3:.0f} | "
                     f"{r['step_s'] / base['step_s']:.2f} |")
    (out / "compression_multiproc.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
