"""How far the compile-time figures are from a real GPU: the step variants the GPU suite measured
(`benchmarks/gpu_suite.py --hlo-dir`), each against

- the replay (`analysis.overlap`) of the module the GPU compiled and ran (autotuned: cuBLAS and
  cuDNN calls, asynchronous fusions), on the device's figures (`comm_model.MACHINES`: published
  ones, and for the H200 the device copy rate it was measured at);
- the same step compiled here without a GPU for an abstract H100 (`axonn-jax compile --target
  h100`: the path every full-scale figure of this project comes from; no autotuning, Triton GEMMs),
  its replay on the same figures and its compiled memory;
- `plan`'s prediction on the same figures (`axonn-jax plan --machine`): step time and memory.

    python benchmarks/gpu_calibration.py --run DIR [--out benchmarks/results]

DIR holds the suite's `gpu_<device>.json` and its `hlo/` folder (the modules); the H200 run of
2026-11-26: `mkdir /tmp/h200 && tar -C /tmp/h200 -xzf
benchmarks/results/gpu_nvidia_h200_modules.tar.gz`. Runs on the CPU
(the deviceless compile needs `make test`'s CUDA compile extra). Writes `gpu_calibration.md`/`.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def machine_for(device: str) -> str:
    """The `comm_model.MACHINES` name of a device kind (an H200 or an H100 node)."""
    return "h200-dgx" if "h200" in device.lower() else "h100-dgx"


def variant_args(v: dict, for_plan: bool = False) -> list[str]:
    """`axonn-jax compile` arguments of one suite variant (its name says attention, remat, fp8);
    `for_plan`: `plan`'s, which refuses `--attention cudnn` on this CPU host (`auto` in bf16 is
    the fused kernel to it) and counts the probabilities `--attention xla` keeps, not its time."""
    name = v["variant"]
    kernel = re.match(r"(\w+) attention", name).group(1)
    return ["--model", v["model"], "--devices", "1", "--batch-size", str(v["batch"]),
            "--seq-len", str(v["seq_len"]), "--dtype", "bfloat16", "--remat", remat_of(v),
            *(["--attention", kernel] if kernel == "xla" or not for_plan else []),
            *(["--fp8"] if "fp8" in name else [])]


def remat_of(v: dict) -> str:
    return re.search(r"remat (\w+)", v["variant"]).group(1)


def cli_json(*args: str):
    """The `--json` output of an `axonn-jax` command, run here on the CPU."""
    out = subprocess.run([sys.executable, "-m", "axonn_jax.run.cli", *args, "--json"], cwd=REPO,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                         text=True, timeout=1800, check=True)
    return json.loads(out.stdout)


def deviceless(v: dict, dump: pathlib.Path) -> tuple[dict, str]:
    """(`compile --json` of the variant for an abstract H100, its compiled module's text)."""
    report = cli_json("compile", "--target", "h100", *variant_args(v), "--dump-hlo", str(dump))
    report = report[0] if isinstance(report, list) else report
    return report, next(dump.glob("*.txt")).read_text()


def planned(v: dict, machine: str) -> dict:
    """`plan`'s row for the variant's grid (one device) and recompute policy on `machine`."""
    rows = cli_json("plan", *variant_args(v, for_plan=True), "--machine", machine)
    return next(r for r in rows if r["remat"] == remat_of(v))


def calibrate(run: pathlib.Path) -> dict:
    from axonn_jax.analysis import comm_model as cm, overlap

    suite = json.loads(next(run.glob("gpu_*.json")).read_text())
    name = machine_for(suite["device"])
    machine = cm.MACHINES[name]
    rows = []
    for v in suite["variants"]:
        module = run / "hlo" / (re.sub(r"[^a-z0-9]+", "_", v["variant"]) + ".txt")
        if "step_time_s" not in v or not module.exists():
            continue
        print(v["variant"], flush=True)
        report, text = deviceless(v, run / "deviceless" / module.stem)
        plan = planned(v, name)
        replay = overlap.report(module.read_text(), {}, machine)
        rows.append({
            "variant": v["variant"], "model": v["model"], "batch": v["batch"],
            "seq_len": v["seq_len"], "measured_s": v["step_time_s"],
            "measured_peak_bytes": v["peak_bytes"],
            "replay_gpu_module_s": replay.step_s,
            "replay_gpu_module_parts_s": {"matmul": replay.matmul_s, "other": replay.other_s},
            "profiled_kernels_s": v.get("kernels_s"),
            "replay_deviceless_s": overlap.report(text, {}, machine).step_s,
            "deviceless_peak_bytes": report["memory_per_device_bytes"],
            "plan_s": plan["step_time_s"], "plan_peak_bytes": plan["memory_per_device_bytes"]})
    return {"device": suite["device"], "jax_on_gpu": suite["jax"], "machine": machine.name,
            "suite_command": suite["command"], "rows": rows}


def markdown(r: dict) -> str:
    lines = [f"# Compile-time figures against a real {r['device']}", "",
             f"Measured with JAX {r['jax_on_gpu']} (`{r['suite_command']}`); replays on "
             f"`{r['machine']}`'s figures (`comm_model.MACHINES`); deviceless compiles and `plan` on this CPU "
             "machine (`python benchmarks/gpu_calibration.py --run DIR`). × = figure / measured.",
             "", "| variant | batch × seq | measured s | replay of the GPU's module | "
             "deviceless H100 compile, replayed | plan | measured peak GB | deviceless GB | "
             "plan GB |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        m, b = x["measured_s"], x["measured_peak_bytes"]
        lines.append(
            f"| {x['model']} {x['variant']} | {x['batch']} × {x['seq_len']} | {m:.4f} | "
            f"{x['replay_gpu_module_s']:.4f} ({x['replay_gpu_module_s'] / m:.2f}×) | "
            f"{x['replay_deviceless_s']:.4f} ({x['replay_deviceless_s'] / m:.2f}×) | "
            f"{x['plan_s']:.4f} ({x['plan_s'] / m:.2f}×) | {b / 1e9:.2f} | "
            f"{x['deviceless_peak_bytes'] / 1e9:.2f} ({x['deviceless_peak_bytes'] / b:.2f}×) | "
            f"{x['plan_peak_bytes'] / 1e9:.2f} ({x['plan_peak_bytes'] / b:.2f}×) |")
    profiled = [x for x in r["rows"] if "matmul" in (x.get("profiled_kernels_s") or {})]
    if profiled:  # the suite's profiles: kernel time by category against the replay's
        lines += ["", "| variant | profiled matmul + attention ms | replayed matmul ms | "
                  "profiled other ms | replayed other ms |", "|---|---|---|---|---|"]
        for x in profiled:
            k, parts = x["profiled_kernels_s"], x["replay_gpu_module_parts_s"]
            lines.append(f"| {x['variant']} | {(k['matmul'] + k.get('attention', 0)) * 1e3:.1f} "
                         f"| {parts['matmul'] * 1e3:.1f} | {k.get('other', 0) * 1e3:.1f} | "
                         f"{parts['other'] * 1e3:.1f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a GPU suite's output folder (with hlo/)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    result = calibrate(pathlib.Path(args.run))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_calibration.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_calibration.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
