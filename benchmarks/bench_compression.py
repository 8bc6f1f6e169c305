"""CGX compression: bytes on the wire, step time and validation loss, compressed against exact.

    python benchmarks/bench_compression.py [--devices 8] [--out benchmarks/results]

1. Wire bytes of the compiled train step (collectives parsed from its HLO), per bit width, and the
   analytic bytes per gradient element of the compressed exchange.
2. Median time of the gradient exchange alone (a synthetic tree of large matrices) and of the whole
   train step, compressed against `pmean`, after warm-up, in this process.
3. The issue's convergence check: 200 steps of gpt-tiny with `--data 8`, exact against 4 bits and
   2 bits (error feedback on), validation loss and the gap.

On simulated CPU devices the "wire" is a memory copy inside one process, so step times here show
the compute cost of quantizing, not a communication saving. Hook for the multi-process loopback
benchmark: start this script in every process with `--devices 0` after `jax.distributed.initialize`
(the launcher from the multi-process issue does that); all measurements use `jax.devices()`, the
global device list, and only process 0 writes results.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def median_time(fn, args, warmup=3, repeats=20):
    import jax

    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wire_and_step_time(model, seq_len, batch_size, bits, devices):
    """Collective bytes of the compiled train step and its median time (same batch every step)."""
    import numpy as np

    from axonn_jax import ParallelConfig
    from axonn_jax.analysis.hlo import wire_bytes
    from axonn_jax.train import TrainOptions, build_trainer

    trainer = build_trainer(TrainOptions(model=model, seq_len=seq_len, batch_size=batch_size,
                                         compress_bits=bits,
                                         parallel=ParallelConfig(data=len(devices))), devices)
    state = trainer.init_state()
    zeros = np.zeros((batch_size, seq_len), np.int32)
    batch = trainer.place({"inputs": zeros, "targets": zeros})
    compiled = trainer.step.lower(state, batch).compile()
    counted = wire_bytes(compiled.as_text())
    holder = {"state": state}

    def step():  # the step donates its state: thread it through
        holder["state"], metrics = compiled(holder["state"], batch)
        return metrics

    return counted, median_time(step, ())


def exchange_time(bits, devices, matrices=8, side=1024):
    """Median time of the gradient exchange alone on `matrices` fp32 [side, side] tensors per shard."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax._compat import shard_map
    from axonn_jax.parallel.compression import compressed_pmean
    from axonn_jax.analysis.hlo import wire_bytes

    n = len(devices)
    mesh = make_mesh(ParallelConfig(data=n), devices)

    def local(tree):
        tree = jax.tree.map(lambda a: a[0], tree)
        if bits == 0:
            return jax.lax.pmean(tree, "data")
        return compressed_pmean(tree, "data", bits=bits)[0]

    f = jax.jit(shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"}))
    sharding = NamedSharding(mesh, P("data"))
    tree = [jax.device_put(jax.random.normal(jax.random.key(i), (n, side, side)), sharding)
            for i in range(matrices)]
    counted = wire_bytes(f.lower(tree).compile().as_text())
    return sum(counted.values()), median_time(f, (tree,), repeats=10)


def convergence(devices, steps=200):
    from axonn_jax import ParallelConfig
    from axonn_jax.train import TrainOptions, train

    out = {}
    for name, extra in (("exact", {}), ("4bit", dict(compress_bits=4)),
                        ("2bit", dict(compress_bits=2)),
                        ("4bit_no_feedback", dict(compress_bits=4, error_feedback=False))):
        summary = train(TrainOptions(model="gpt-tiny", steps=steps, batch_size=16, seq_len=32,
                                     eval_batches=4, eval_every=steps,
                                     parallel=ParallelConfig(data=len(devices)), **extra), devices)
        out[name] = {"val_first": summary["val_history"][0][1],
                     "val_last": summary["val_history"][-1][1]}
    for name, row in out.items():
        row["gap_vs_exact"] = row["val_last"] / out["exact"]["val_last"] - 1
    return out


def markdown(results) -> str:
    lines = [f"# Compressed gradients (CGX) on {results['devices']} {results['platform']} devices",
             "", "## Wire bytes of the train step (from compiled HLO) and median step time", "",
             "| model | bits | wire bytes/device | vs exact | analytic (large buffers) | step ms |",
             "|---|---|---|---|---|---|"]
    for row in results["train_step"]:
        lines.append(f"| {row['model']} | {row['bits'] or 'exact'} | {row['wire_bytes']:,.0f} | "
                     f"{row['ratio']:.3f} | {row['analytic_ratio']:.3f} | "
                     f"{row['step_s'] * 1e3:.1f} |")
    lines += ["", "## Gradient exchange alone (8 × 1024² fp32 per shard)", "",
              "| bits | wire bytes/device | vs exact | median ms |", "|---|---|---|---|"]
    for row in results["exchange"]:
        lines.append(f"| {row['bits'] or 'exact'} | {row['wire_bytes']:,.0f} | {row['ratio']:.3f} | "
                     f"{row['time_s'] * 1e3:.1f} |")
    lines += ["", "## 200 steps of gpt-tiny (seq 32, batch 16), validation loss", "",
              "| run | first | last | gap vs exact |", "|---|---|---|---|"]
    for name, row in results["convergence"].items():
        lines.append(f"| {name} | {row['val_first']:.4f} | {row['val_last']:.4f} | "
                     f"{100 * row['gap_vs_exact']:+.2f}% |")
    lines += ["", "Simulated CPU devices share one process: collectives are memory copies, so the "
              "step times show the cost of quantizing, not a communication saving."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices; 0: use the devices JAX already has")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--steps", type=int, default=200, help="convergence run length")
    args = parser.parse_args(argv)
    if args.devices:
        from axonn_jax.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices)
    import jax

    from axonn_jax.parallel.compression import wire_bytes_per_element

    devices = jax.devices()
    results = {"devices": len(devices), "platform": devices[0].platform, "train_step": [],
               "exchange": []}
    for model, seq_len in (("gpt-tiny", 32), ("gpt-mini", 64)):
        base = None
        for bits in (0, 8, 4, 2):
            counted, step_s = wire_and_step_time(model, seq_len, 16, bits, devices)
            wire = sum(counted.values())
            base = base or wire
            # exact ring all-reduce: 2 · 4 bytes per element
            analytic = wire_bytes_per_element(bits, 1024) / 8 if bits else 1.0
            results["train_step"].append({"model": model, "bits": bits, "wire_bytes": wire,
                                          "ratio": wire / base, "analytic_ratio": analytic,
                                          "step_s": step_s, "collectives": counted})
            print(results["train_step"][-1]["model"], bits, f"{wire / base:.3f}",
                  f"{step_s * 1e3:.1f} ms", flush=True)
    base = None
    for bits in (0, 8, 4, 2):
        wire, t = exchange_time(bits, devices)
        base = base or wire
        results["exchange"].append({"bits": bits, "wire_bytes": wire, "ratio": wire / base,
                                    "time_s": t})
        print("exchange", bits, f"{wire / base:.3f}", f"{t * 1e3:.1f} ms", flush=True)
    results["convergence"] = convergence(devices, args.steps)
    if jax.process_index() == 0:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compression.json").write_text(json.dumps(results, indent=1))
        (out / "compression.md").write_text(markdown(results))
        print(markdown(results))


if __name__ == "__main__":
    main()
