"""CGX's accuracy over a long run: validation loss of compressed against exact gradients.

Each variant trains the same model from the same seed on the same batches with `axonn-jax train`
(one process, `--devices D --data-parallel D` simulated CPU devices), and reads the validation
loss from its metrics file every `--eval-every` steps. The gap is the last validation loss over
exact's, minus one. Results: benchmarks/results/compression_convergence.{json,md}.

    python benchmarks/bench_compression_convergence.py [--model gpt-small] [--steps 1000]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

VARIANTS = {"exact": [], "4 bits": ["--compress-bits", "4"],
            "4 bits, stochastic": ["--compress-bits", "4", "--compress-rounding", "stochastic"],
            "8 bits": ["--compress-bits", "8"]}


def run(args, flags: list[str], work: pathlib.Path) -> dict:
    """One training run's validation history `[(step, val_loss)]` and its wall time."""
    metrics = work / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "axonn_jax", "train", "--model", args.model,
           "--devices", str(args.devices), "--data-parallel", str(args.devices),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--eval-every", str(args.eval_every),
           "--eval-batches", str(args.eval_batches), "--data", args.data,
           "--metrics-out", str(metrics), *flags]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    history = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return {"history": history, "wall_s": time.perf_counter() - start}


def markdown(args, rows: dict) -> str:
    """The results page."""
    exact = rows["exact"]["history"][-1][1]
    lines = [f"# CGX over {args.steps} steps: {args.model}, data {args.devices} (CPU)", "",
             f"batch {args.batch_size} × {args.seq_len} tokens, data `{args.data}`, validation "
             f"loss over {args.eval_batches} held-out batches every {args.eval_every} steps.", "",
             "| run | " + " | ".join(f"step {s}" for s, _ in rows["exact"]["history"])
             + " | gap vs exact |",
             "|---|" + "---|" * (len(rows["exact"]["history"]) + 1)]
    for name, row in rows.items():
        last = row["history"][-1][1]
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for _, v in row["history"])
                     + f" | {100 * (last / exact - 1):+.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--data", default=str(REPO / "axonn_jax"))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if "exact" not in args.variants:
        p.error("--variants needs exact: the gap is measured against it")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            rows[name] = run(args, VARIANTS[name], pathlib.Path(tmp))
            print(name, rows[name], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compression_convergence.json").write_text(json.dumps({**vars(args), "rows": rows},
                                                                 indent=1))
    (out / "compression_convergence.md").write_text(markdown(args, rows))
    print(markdown(args, rows))


if __name__ == "__main__":
    main()
