"""Host memory in the compiled H100 program: the optimizer state on the device, offloaded, and
offloaded with swapped activations, replayed with the host link.

    python benchmarks/offload_replay.py [--layers 6 12] [--batch 16] [--data 1 8]
        [--modes "on device" "offloaded state"] [--out benchmarks/results] [--append]

`--data` abstract H100s (`analysis.targets`, deviceless; a grid of `data` copies), a GPT of width
4096 (32 heads, sequences of 2,048, `--batch` of them per device: 32k tokens at 16), bf16 compute,
AdamW with fp32 masters, global-norm clipping. Per model depth, data-parallel width and memory
mode: the compiled peak and host bytes per device, and the schedule replayed by `analysis.overlap`
on `h100-dgx` (host copies on the host link, one stream per direction at `Machine.host_bw`): the
step, its compute, and the host transfers' bytes, time and exposed time. Writes
offload_replay.json and .md (`--append`: adds to the rows already there, replacing equal keys).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MODES = {"on device": {}, "offloaded state": dict(offload_optimizer=True),
         "offloaded state and gradients": dict(offload_optimizer=True, offload_gradients=True),
         "offloaded state, remat offload": dict(offload_optimizer=True, remat="offload"),
         "on device, remat full": dict(remat="full"),
         "on device, remat offload": dict(remat="offload")}


def measure(layers: int, batch: int, mode: dict, data: int = 1) -> dict:
    """One compile and replay (`MODES` entry `mode`) of a `layers`-deep width-4096 GPT on
    `data` H100s, `batch` sequences each."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axonn_jax import ParallelConfig, make_mesh, make_train_step
    from axonn_jax.analysis import compiled as cc, overlap, targets
    from axonn_jax.analysis.comm_model import MACHINES
    from axonn_jax.models import gpt

    config = gpt.GPTConfig(num_layers=layers, d_model=4096, num_heads=32, max_seq_len=2048,
                           vocab_size=50304)
    mesh = make_mesh(ParallelConfig(data=data), targets.h100_devices(data))
    step = make_train_step(gpt.stacked(config, jnp.bfloat16), optax.adamw(1e-4), mesh,
                           dtype="bfloat16", clip_norm=1.0, **mode)
    tokens = np.zeros((batch * data, 2049), np.int32)
    report, compiled = cc.compile_step(step, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                       capacity_bytes=targets.H100_CAPACITY_BYTES)
    schedule = overlap.report(compiled.as_text(), {"data": data}, MACHINES["h100-dgx"])
    host = {k: v for k, v in overlap.summary(schedule.overlaps).items() if k.endswith("over host")}
    import jax

    return {"layers": layers, "batch": batch, "data": data, "jaxlib": jax.__version__,
            "peak_gb": report.memory_per_device_bytes / 1e9,
            "host_gb": report.host_memory_per_device_bytes / 1e9, "step_s": schedule.step_s,
            "compute_s": schedule.matmul_s + schedule.other_s,
            "host_transfers": {k: {"gb": v["bytes"] / 1e9, "s": v["comm_s"],
                                   "exposed_s": v["exposed_s"]} for k, v in host.items()}}


def _jaxlib(row: dict) -> str:
    """The jaxlib that compiled `row` (rows written before the field existed: 0.10.2)."""
    return row.get("jaxlib", "0.10.2")


def markdown(rows: list[dict]) -> str:
    import datetime

    import jax

    lines = ["# Host memory in the compiled H100 program (replayed with the host link)", "",
             "`python benchmarks/offload_replay.py` (see its docstring). Abstract H100s, "
             "GPT of width 4096, sequences of 2,048, bf16 compute, AdamW, fp32 masters; "
             f"compiled deviceless by the jaxlib of each row (last run {jax.__version__}, "
             f"{datetime.date.today()}), replayed on `h100-dgx` (host link 55 GB/s each way). "
             "`data`: H100s, one data-parallel copy each; batch: sequences per H100; GB are "
             "per H100. A peak above 80 GB does not fit an H100: its replay is a bound, not a "
             "runnable step. With data > 1 `offloaded state` splits the host state over `data` "
             "(each H100 holds and streams 1/D of it); a `(before: …)` row is the same step "
             "compiled from commit 83c3988, where every data-parallel copy streamed all of it.",
             "", "| jaxlib | layers | data | batch | mode | peak GB | host GB | replayed step s | "
             "vs on device | compute s | host→device GB (s, exposed s) | "
             "device→host GB (s, exposed s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (_jaxlib(r), r["layers"], r.get("data", 1), r["batch"])  # noqa: E731
    base = {key(r): r["step_s"] for r in rows if r["mode"] == "on device"}
    for r in sorted(rows, key=lambda r: key(r)[:3]):  # stable: modes stay in run order
        h = r["host_transfers"]
        cell = lambda k: (f"{h[k]['gb']:.2f} ({h[k]['s']:.3f}, {h[k]['exposed_s']:.3f})"  # noqa
                          if k in h else "–")
        ref = base.get(key(r))
        ratio = f"{r['step_s'] / ref:.2f}×" if ref else "–"
        lines.append(f"| {_jaxlib(r)} | {r['layers']} | {r.get('data', 1)} | {r['batch']} | "
                     f"{r['mode']} | {r['peak_gb']:.1f} | "
                     f"{r['host_gb']:.1f} | {r['step_s']:.3f} | {ratio} | {r['compute_s']:.3f} | "
                     f"{cell('host-to-device over host')} | {cell('device-to-host over host')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--data", type=int, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--label", default="", help="appended to each row's mode name")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--append", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    out = pathlib.Path(args.out)
    rows = json.loads((out / "offload_replay.json").read_text()) if args.append else []
    for layers in args.layers:
        for data in args.data:
            for name in args.modes:
                row = {"mode": name + args.label,
                       **measure(layers, args.batch, MODES[name], data)}
                print(json.dumps(row), flush=True)
                same = lambda r: (r["mode"], _jaxlib(r), r["layers"], r.get("data", 1),  # noqa
                                  r["batch"]) == (row["mode"], row["jaxlib"], row["layers"],
                                                  row["data"], row["batch"])
                rows = [r for r in rows if not same(r)] + [row]
    (out / "offload_replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "offload_replay.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
