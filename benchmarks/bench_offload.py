"""Optimizer-state offload off/on, and activation remat modes: bytes per parameter, peak, step time.

    python benchmarks/bench_offload.py [--model gpt-mini] [--devices 8] [--steps 10] [--out DIR]

For each configuration it builds the trainer with `axonn_jax.train.build_trainer` (the code path of
`axonn-jax train`), compiles the step, and records: device-resident train-state bytes per parameter
(from each array's `sharding.memory_kind`; also with the gradients, which have the device
parameters' dtype), host-resident bytes per parameter, the compiled peak per device
(`memory_analysis`), and the median step time after one warm-up step. On simulated CPU devices host
and device memory are one pool: placement is real (memory kinds), memory savings and transfer costs
are not, so peaks and times here do not show what a GPU would gain.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--budget-gb", type=float, nargs="+", default=[0.05, 0.033],
                   help="--memory-budget values for remat auto")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = p.parse_args(argv)

    from axonn_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import jax
    import numpy as np

    from axonn_jax import ParallelConfig
    from axonn_jax.run.data import lm_batch
    from axonn_jax.run.loop import state_report
    from axonn_jax.train import TrainOptions, build_trainer

    tokens = (np.arange(1 << 16, dtype=np.int64) * 7919 % 251).astype(np.int32)
    device_name = (f"{args.devices} simulated CPU devices" if jax.devices()[0].platform == "cpu"
                   else f"{args.devices}× {jax.devices()[0].device_kind}")
    rows = []
    configs = [("float32", False, "none"), ("float32", True, "none"),
               ("bfloat16", False, "none"), ("bfloat16", True, "none"),
               ("bfloat16", True, "full"), ("bfloat16", True, "offload")]
    configs += [("bfloat16", True, ("auto", gb)) for gb in args.budget_gb]
    for dtype, offload, remat in configs:
        remat, budget = remat if isinstance(remat, tuple) else (remat, None)
        options = TrainOptions(model=args.model, steps=args.steps, batch_size=args.batch_size,
                               seq_len=args.seq_len, dtype=dtype, offload_optimizer=offload,
                               remat=remat, memory_budget_gb=budget,
                               parallel=ParallelConfig(data=args.devices))
        trainer = build_trainer(options, jax.devices()[: args.devices])
        state = trainer.init_state()
        batch_of = lambda step: trainer.place(lm_batch(tokens, 0, step, args.batch_size,  # noqa: E731
                                                       args.seq_len))
        compiled = trainer.step.lower(state, batch_of(0)).compile()
        report = state_report(state, compiled)
        n = report["num_params"]
        grad_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
        times, losses = [], []
        for step in range(args.steps + 1):
            batch = batch_of(step)
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
            times.append(time.perf_counter() - t0)
        row = {
            "dtype": dtype, "offload_optimizer": offload, "remat": remat,
            "plan": (trainer.bound.plan.describe(report["peak_bytes_compiled"])
                     if trainer.bound.plan else None),
            "num_params": n,
            "device_state_bytes_per_param": report["state_bytes_device"] / n,
            "device_state_and_grad_bytes_per_param": (report["state_bytes_device"] + grad_bytes) / n,
            "host_state_bytes_per_param": report["state_bytes_host"] / n,
            "peak_bytes_compiled": report["peak_bytes_compiled"],
            "step_time_s_median": float(np.median(times[1:])),
            "losses": losses,
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device_name, "model": args.model, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "steps": args.steps, "jax": jax.__version__,
              "note": "CPU: host and device memory are one pool; placement is real, savings are not",
              "rows": rows}
    (out / "offload_cpu.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Offload benchmark: {args.model}, batch {args.batch_size}×{args.seq_len}, "
             f"{device_name} (data={args.devices})", "",
             "On CPU host and device memory are one pool: the placement of state (memory kinds) is "
             "real, the peak and time savings are not; measure those on a GPU. Step times were taken "
             "on 2 shared, heavily loaded cores: noise, not a comparison.", "",
             "| dtype | offload optimizer | remat | device state B/param | + grads B/param | "
             "host B/param | compiled peak MiB | step ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['offload_optimizer']} | {r['remat']} | "
                     f"{r['device_state_bytes_per_param']:.2f} | "
                     f"{r['device_state_and_grad_bytes_per_param']:.2f} | "
                     f"{r['host_state_bytes_per_param']:.2f} | {r['peak_bytes_compiled'] / 2**20:.1f} | "
                     f"{r['step_time_s_median'] * 1e3:.1f} |")
    plans = [f"- remat {r['remat']}: {r['plan']}" for r in rows if r["plan"]]
    lines += ["", "Activation plans:", *plans, ""]
    same = rows[0]["losses"] == rows[1]["losses"]
    lines.append(f"fp32 losses with and without offload identical: {same}")
    (out / "offload_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
