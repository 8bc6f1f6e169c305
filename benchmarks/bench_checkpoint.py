"""What checkpointing costs the training loop: the median wall-clock time of one step followed by a
save (`Checkpointer.maybe_save`, every `--every` steps), with no checkpoints, with asynchronous
saves (orbax copies the state to host memory, then writes it in a background thread while the next
steps run) and with synchronous ones (the loop waits until the step directory is complete).

    python benchmarks/bench_checkpoint.py [--model gpt-mini] [--devices 8] [--steps 12] [--every 1]

Results go to benchmarks/results/checkpoint.json and checkpoint.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(trainer, batch, steps: int, every: int, mode: str) -> dict:
    """Median and mean seconds per step (step + save) over `steps` steps after one warm-up step
    (and one warm-up save), and the time `close` then waits for the last write."""
    import jax

    state = trainer.init_state()
    compiled = trainer.step.lower(state, batch).compile()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as directory:
        ckpt = None if mode == "none" else trainer.make_checkpointer(
            directory, every, keep=2, asynchronous=mode == "async")
        if ckpt is not None:  # the first save compiles its checksum programs: not timed
            ckpt.maybe_save(1, state, force=True)
            ckpt.wait()
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            float(metrics["loss"])  # the loop waits for the step's metrics
            if ckpt is not None:
                ckpt.maybe_save(i + 2, state)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if ckpt is not None:
            ckpt.close()
        drain = time.perf_counter() - t0
    return {"mode": mode, "median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "close_wait_s": drain, "step_times_s": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    from axonn_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import jax
    import numpy as np

    from axonn_jax import ParallelConfig
    from axonn_jax.run.trainer import build_trainer
    from axonn_jax.train import TrainOptions

    options = TrainOptions(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                           parallel=ParallelConfig(data=jax.device_count()))
    trainer = build_trainer(options)
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len + 1))
    batch = trainer.place({"inputs": tokens[:, :-1].astype(np.int32),
                           "targets": tokens[:, 1:].astype(np.int32)})
    state_mb = sum(x.nbytes for x in jax.tree.leaves(trainer.init_state())) / 2**20
    rows = [measure(trainer, batch, args.steps, args.every, m) for m in ("none", "async", "sync")]
    for r in rows:
        r["overhead_median"] = r["median_s"] / rows[0]["median_s"] - 1
        r["overhead_mean"] = r["mean_s"] / rows[0]["mean_s"] - 1
    result = {"model": args.model, "devices": jax.device_count(), "backend": jax.default_backend(),
              "state_MiB": state_mb, "every": args.every, "steps": args.steps, "rows": rows}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Checkpoint overhead: {args.model} ({state_mb:.1f} MiB of train state), "
             f"{jax.device_count()} {jax.default_backend()} devices, a save every {args.every} "
             f"step(s), {args.steps} steps", "", "| saves | median s/step | mean s/step | overhead "
             "(median) | overhead (mean) | close waits s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['median_s']:.4f} | {r['mean_s']:.4f} | "
                     f"{r['overhead_median']:+.0%} | {r['overhead_mean']:+.0%} | "
                     f"{r['close_wait_s']:.3f} |")
    (out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
