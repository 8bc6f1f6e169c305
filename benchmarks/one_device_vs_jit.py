"""The library's one-device train step against a plain `jax.jit` step, kernel by kernel, compiled
for one abstract H100 (deviceless) and replayed.

    python benchmarks/one_device_vs_jit.py [--model gpt-1.3b] [--batch 2] [--seq-len 2048]
                                           [--top 25] [--out benchmarks/results]

Both steps train the same model (`models.gpt`, bf16 compute, cuDNN attention: the process's own
backend is the CPU, so `auto` would give the plain step XLA's attention), AdamW and global-norm
clipping: `analysis.step_bench.axonn_step` on one device and `analysis.step_bench.gspmd_step`
("gspmd dp" on one device: `jax.value_and_grad` of the loss and the same update). Each compiled
module is replayed by `analysis.overlap` on `h100-dgx`; every kernel's replayed time is summed
by the JAX operation it came from (its `op_name`, with the transformation wrappers removed).
Writes one_device_vs_jit.json and .md: the two steps, their kernel counts and HBM bytes
(`analysis.overlap.kernel_count`, `hbm_bytes`), how many instructions either module has that the
other lacks, and the operations whose time differs most.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
_WRAPPERS = re.compile(r"jit\(\w+\)/|while/body/|closed_call/|checkpoint/|"
                       r"rematted_computation/|jvp\(|transpose\(|\)")


def _operation(instr) -> str:
    """The JAX operation a kernel came from: its `op_name` without jit/jvp/transpose/loop
    wrappers."""
    found = re.search(r'op_name="([^"]*)"', instr.rest)
    return _WRAPPERS.sub("", found.group(1)) if found else instr.opcode


def kernel_times(text: str) -> tuple[float, dict[str, list[float]]]:
    """(replayed step seconds, {operation: [seconds, kernels]} per step) of a compiled module."""
    from axonn_jax.analysis import overlap
    from axonn_jax.analysis.comm_model import MACHINES

    found: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    weight = [1.0]
    run, seconds = overlap._Replay.run, overlap._Costs.seconds

    def counted_run(self, comp, t, w, *args, **kwargs):
        outer, weight[0] = weight[0], w
        try:
            return run(self, comp, t, w, *args, **kwargs)
        finally:
            weight[0] = outer

    def counted_seconds(self, instr, shapes):
        flops, matmul, s = seconds(self, instr, shapes)
        if s:
            row = found[("matmul " if matmul else "") + _operation(instr)]
            row[0] += s * weight[0]
            row[1] += weight[0]
        return flops, matmul, s

    overlap._Replay.run, overlap._Costs.seconds = counted_run, counted_seconds
    try:
        step = overlap.report(text, {"data": 1}, MACHINES["h100-dgx"]).step_s
    finally:
        overlap._Replay.run, overlap._Costs.seconds = run, seconds
    return step, dict(found)


def unshared_instructions(a: str, b: str) -> int:
    """How many instructions of module `a` or `b` the other lacks, instructions taken as (opcode,
    result shape) over every computation (names and metadata aside)."""
    from axonn_jax.analysis.hlo_module import read_module

    def bag(text):
        return collections.Counter((i.opcode, re.sub(r"\{[^}]*\}", "", i.shape))
                                   for comp in read_module(text).computations.values()
                                   for i in comp)

    x, y = bag(a), bag(b)
    return sum(((x - y) + (y - x)).values())


def compiled_texts(model_name: str, batch: int, seq_len: int) -> dict[str, str]:
    """{"plain jit": module text, "axonn_jax": module text} for one abstract H100."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axonn_jax.analysis import step_bench, targets
    from axonn_jax.models import gpt

    config = dataclasses.replace(gpt.get_config(model_name), attention="cudnn")
    model = gpt.stacked(config, jnp.bfloat16)
    tokens = np.zeros((batch, seq_len + 1), np.int32)
    example = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return step_bench.one_device_modules(model, optax.adamw(1e-4), example,
                                         targets.h100_devices(1)[0])


def markdown(report: dict, top: int) -> str:
    """The report as a page: both steps, then the `top` operations whose time or kernels differ."""
    plain, ours = report["steps"]["plain jit"], report["steps"]["axonn_jax"]
    lines = [f"# One device: axonn_jax's step against a plain `jax.jit` step ({report['model']}, "
             f"batch {report['batch']} × {report['seq_len']})", "",
             f"`python benchmarks/one_device_vs_jit.py` (its docstring says how), jaxlib "
             f"{report['jaxlib']}, {report['date']}: compiled for one abstract H100 and replayed "
             "on `h100-dgx`. No GPU ran this.", "",
             "| step | replayed s | kernels per step | HBM GB per step |", "|---|---|---|---|",
             f"| plain jit | {plain['step_s']:.4f} | {plain['kernels']:.0f} | "
             f"{plain['hbm_bytes'] / 1e9:.2f} |",
             f"| axonn_jax | {ours['step_s']:.4f} ({ours['step_s'] / plain['step_s']:.3f}×) | "
             f"{ours['kernels']:.0f} | {ours['hbm_bytes'] / 1e9:.2f} |", "",
             "Kernels and HBM bytes: `analysis.overlap.kernel_count` and `hbm_bytes` (loop bodies "
             "once per trip; what `tests/test_compile_h100.py` compares on a smaller GPT). "
             f"Instructions of either module the other lacks (opcode and result shape, over every "
             f"computation): {report['unshared_instructions']}. What differed before and why: "
             "[one_device_vs_jit_notes.md](one_device_vs_jit_notes.md).", "",
             "The operations whose replayed time differs most (ms per step, kernels per step):", "",
             "| operation | plain jit ms (kernels) | axonn_jax ms (kernels) |", "|---|---|---|"]
    differing = [r for r in report["differences"] if r["plain_kernels"] != r["axonn_kernels"]
                 or abs(r["plain_ms"] - r["axonn_ms"]) > 1e-6]
    if not differing:
        lines[-4:] = ["No operation's replayed time or kernel count differs."]
    for row in differing[:top]:
        lines.append(f"| `{row['operation']}` | {row['plain_ms']:.3f} ({row['plain_kernels']:.0f}) "
                     f"| {row['axonn_ms']:.3f} ({row['axonn_kernels']:.0f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    import datetime

    import jax

    from axonn_jax.analysis import overlap

    steps, ops = {}, {}
    texts = compiled_texts(args.model, args.batch, args.seq_len)
    for name, text in texts.items():
        step, ops[name] = kernel_times(text)
        steps[name] = {"step_s": step, "kernels": overlap.kernel_count(text),
                       "hbm_bytes": overlap.hbm_bytes(text)}
    plain, ours = ops["plain jit"], ops["axonn_jax"]
    rows = [{"operation": op, "plain_ms": 1e3 * plain.get(op, [0, 0])[0],
             "plain_kernels": plain.get(op, [0, 0])[1], "axonn_ms": 1e3 * ours.get(op, [0, 0])[0],
             "axonn_kernels": ours.get(op, [0, 0])[1]} for op in set(plain) | set(ours)]
    rows.sort(key=lambda r: -abs(r["axonn_ms"] - r["plain_ms"]))
    report = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len,
              "jaxlib": jax.__version__, "date": str(datetime.date.today()), "steps": steps,
              "unshared_instructions": unshared_instructions(*texts.values()),
              "differences": rows}
    out = pathlib.Path(args.out)
    (out / "one_device_vs_jit.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "one_device_vs_jit.md").write_text(markdown(report, args.top))
    print(markdown(report, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
