"""Does the communication model rank grids like the real train step? Every grid of 8 simulated
devices that the trainer runs, ranked by predicted step time (`comm_model.predict`, `cpu` machine
preset) and by measured step time, with Spearman's rank correlation.

    python benchmarks/bench_comm_model.py [--model gpt-tiny] [--batch 16] [--seq-len 64] [--steps 5]

Measured: median wall-clock time of `--steps` train steps after one warm-up step (compile excluded).
Bytes by kind are checked against the compiled HLO in tests/test_comm_model.py, not here. On a
shared 2-core host the 8 simulated devices contend for the same cores, so measured time is total
work under contention more than parallel speed.
Results go to benchmarks/results/comm_model.json and comm_model.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timing import median_step_time  # noqa: E402  (benchmarks/timing.py)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "comm_model"))
    args = p.parse_args()

    from axonn_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(8)
    import jax
    import numpy as np

    from axonn_jax.models.gpt import get_config
    from axonn_jax.analysis import comm_model as cm
    from axonn_jax.run.data import lm_batch
    from axonn_jax.train import TrainOptions, build_trainer

    machine = cm.MACHINES["cpu"]
    work = cm.Workload(get_config(args.model), args.batch, args.seq_len, compute_bytes=4,
                       schedule="gpipe", platform=machine.platform)
    ranked = cm.plan(work, 8, machine)
    tokens = np.arange(100_000) % 256
    rows = []
    for q in ranked:
        options = TrainOptions(model=args.model, batch_size=args.batch, seq_len=args.seq_len,
                               parallel=q.grid, microbatches=q.microbatches, schedule="gpipe")
        trainer = build_trainer(options, jax.devices())
        batch = trainer.place(lm_batch(tokens, 0, 0, args.batch, args.seq_len))
        measured, _ = median_step_time(trainer.step, trainer.init_state(), batch, args.steps)
        row = {"grid": {k: v for k, v in q.grid.as_dict().items()}, "microbatches": q.microbatches,
               "predicted_s": q.step_time_s, "measured_s": measured}
        rows.append(row)
        print(json.dumps(row), flush=True)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    result = {"device": "8 simulated CPU devices", "model": args.model, "batch": args.batch,
              "seq_len": args.seq_len, "machine_preset": "cpu", "spearman": rho, "grids": rows}
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    by_measured = sorted(range(len(rows)), key=lambda i: rows[i]["measured_s"])
    lines = ["# Communication model: predicted vs measured step time\n",
             f"{args.model}, batch {args.batch} × {args.seq_len} tokens, fp32, 8 simulated CPU "
             f"devices, `cpu` machine preset; measured = median of {args.steps} steps.\n",
             f"Spearman rank correlation: **{rho:.2f}** over {len(rows)} grids.\n",
             "| grid | M | predicted ms (rank) | measured ms (rank) |",
             "|---|---|---|---|"]
    for i, r in enumerate(rows):
        grid = ",".join(f"{k}={v}" for k, v in r["grid"].items() if v > 1) or "1 device"
        lines.append(f"| {grid} | {r['microbatches']} | {r['predicted_s'] * 1e3:.1f} ({i + 1}) | "
                     f"{r['measured_s'] * 1e3:.1f} ({by_measured.index(i) + 1}) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"spearman {rho:.3f}")


if __name__ == "__main__":
    main()
