"""FP8 against bf16 in the compiled H100 step, replayed (issue 38 item 6): a Llama of Llama-3-8B's
width (4096) or Llama-3-70B's (8192), a few layers, on one abstract H100 (deviceless), bf16
compute with and without `--fp8`; the schedule replayed by `analysis.overlap` on `h100-dgx`, and
its kernels broken down (`breakdown`): GEMMs by the element types their dots read, cuDNN
attention, the kernels that take an amax or quantize to float8, and the rest.

    python benchmarks/fp8_replay.py [--models 4096:4 4096:8 8192:1 8192:2] [--batch 2]
        [--seq-len 4096] [--recipes bf16 current delayed-emulated] [--out benchmarks/results]
        [--append]

`delayed-emulated` is no recipe of the library: it compiles `--fp8` with each operand quantized
by a constant scale while its amax is still taken (and kept alive by the GEMM's result), the data
flow of delayed scaling (the quantization does not wait for the amax), to bound what delayed
scaling would save. Its losses mean nothing. Writes fp8_replay.json and .md under `--out`
(`--append`: adds to the rows already there, replacing equal keys). Width 8192 stops at 2
layers: 4 need more than an H100's memory (XLA then rematerializes). No GPU runs this: every
figure is the replay's.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PRESETS = {4096: "llama3-8b", 8192: "llama3-70b"}
NOTES = "<!-- written by hand below: kept when the tables are made again -->"
KINDS = ("gemm f8", "gemm bf16", "attention", "amax", "amax+quantize", "quantize", "other")


@contextlib.contextmanager
def emulated_delayed():
    """Within it, `tp_dense`'s FP8 operands are quantized with a constant scale while their amax
    is still reduced and added (times 0) to the GEMM's result: delayed scaling's data flow."""
    import jax.numpy as jnp

    from axonn_jax.tp import fp8, tensor

    pending = []
    gemm = tensor._Fp8Gemm
    saved = gemm.__dict__["operand"], gemm.__dict__["dot"]  # the staticmethod itself

    def operand(self, a, role, scale=None):
        dtype = fp8.BACKWARD if role == "dy" else fp8.FORWARD
        if scale is None:
            pending.append(jnp.max(jnp.abs(a)).astype(jnp.float32))
            scale = jnp.float32(1.0)
        return fp8.quantize(a, dtype, scale), scale

    def dot(a, b, dimension_numbers, dtype):
        y = fp8.dot(a, b, dimension_numbers, dtype)
        while pending:
            y = y + (0.0 * pending.pop()).astype(y.dtype)
        return y

    gemm.operand, gemm.dot = operand, staticmethod(dot)
    tensor._dense_fn.cache_clear()
    try:
        yield
    finally:
        gemm.operand, gemm.dot = saved
        tensor._dense_fn.cache_clear()


def compile_text(width: int, layers: int, batch: int, seq_len: int, recipe: str) -> str:
    """The compiled module (text) of one train step: `layers` blocks of the preset of `width`,
    `batch` sequences of `seq_len` on one abstract H100, AdamW, clipping; `recipe`: `bf16`,
    `current` (`--fp8`) or `delayed-emulated`."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from axonn_jax import ParallelConfig, make_mesh, make_train_step
    from axonn_jax.analysis import targets
    from axonn_jax.models import get

    model = get(PRESETS[width]).with_config(num_layers=layers, max_seq_len=seq_len)
    mesh = make_mesh(ParallelConfig(), targets.h100_devices(1))
    step = make_train_step(model.build(jnp.bfloat16), optax.adamw(1e-4), mesh, dtype="bfloat16",
                           clip_norm=1.0, fp8=recipe != "bf16")
    tokens = np.zeros((batch, seq_len + 1), np.int32)
    bound = step.bind({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    with emulated_delayed() if recipe == "delayed-emulated" else contextlib.nullcontext():
        lowered = bound.lower(bound.abstract_state(), bound.abstract_batch())
    return lowered.compile().as_text()


def _ops(module, comp: str, seen: set) -> list:
    """The instructions of `comp` and of every computation it calls, once each."""
    from axonn_jax.analysis.hlo_module import called

    out = []
    for i in module.computations.get(comp, ()):
        out.append(i)
        for c in called(i.rest):
            if c not in seen:
                seen.add(c)
                out += _ops(module, c, seen)
    return out


def kernel_kind(module, comp: str, name: str) -> tuple[str, bool]:
    """(`KINDS` entry, whether an amax is fused with the kernel producing its tensor) of kernel
    `name` of computation `comp`: a GEMM by what its dot reads, cuDNN attention, a kernel with an
    abs-max reduction and / or a cast to float8, the rest `other`."""
    from axonn_jax.analysis import hlo
    from axonn_jax.analysis.hlo_module import arrays, called

    instr = next(i for i in module.computations[comp] if i.name == name)
    ops = [o for c in called(instr.rest) for o in _ops(module, c, set())]
    if "cudnn" in instr.rest:
        return "attention", False
    dots = [o for o in ops if o.opcode == "dot"] + ([instr] if hlo.is_cublas_gemm(instr) else [])
    if dots:
        types = {o.name: o.shape for o in ops + list(module.computations[comp])}
        f8 = all(a.dtype.startswith("f8") for d in dots for o in d.operands[:2]
                 for a in arrays(types.get(o, "")))
        return ("gemm f8" if f8 else "gemm bf16"), False
    opcodes = {o.opcode for o in ops}
    amax = "reduce" in opcodes and "abs" in opcodes
    cast = any(o.opcode == "convert" and o.shape.startswith("f8") for o in ops)
    outputs = arrays(instr.shape)
    producer = amax and any(a.dtype == "bf16" and len(a.dims) > 1 for a in outputs)
    return ("amax+quantize" if amax and cast else "amax" if amax else
            "quantize" if cast else "other"), producer


def breakdown(text: str) -> dict:
    """The replayed step of compiled module `text` on `h100-dgx` and its compute by `KINDS`
    (milliseconds per step, kernel counts), with the GEMMs' operand types (`hlo`)."""
    from axonn_jax.analysis import hlo, overlap
    from axonn_jax.analysis.comm_model import MACHINES
    from axonn_jax.analysis.hlo_module import read_module

    schedule = overlap.report(text, {}, MACHINES["h100-dgx"])
    module = read_module(text)
    ms, count = collections.Counter(), collections.Counter()
    fused = 0
    for key, seconds in schedule.kernels.items():
        comp, name = key.rsplit("/", 1)
        kind, producer = kernel_kind(module, comp, name)
        ms[kind] += seconds * 1e3
        count[kind] += 1
        fused += producer
    types = collections.Counter("×".join(t) for t in hlo.gemm_operand_dtypes(text))
    return {"step_ms": schedule.step_s * 1e3, "ms": {k: ms[k] for k in KINDS},
            "kernels": {k: count[k] for k in KINDS}, "amax_fused_with_producer": fused,
            "gemm_operands": dict(types)}


def markdown(rows: list[dict]) -> str:
    """The results page: per model and recipe, the replayed step against bf16's and its parts."""
    import jax

    lines = ["# FP8 against bf16, compiled for one H100 and replayed (issue 38 item 6)", "",
             f"Compiled deviceless by jaxlib {jax.__version__} (`analysis.targets`, no "
             "autotuning) on the shared CPU machine and replayed by `analysis.overlap` on "
             "`h100-dgx` (bf16 GEMMs at 794.5 TFLOP/s, FP8 GEMMs at 1402.6: the large-matmul "
             "rates of `comm_model.MACHINES`; HBM 3.35 TB/s). **No GPU ran this.**", "",
             "    python benchmarks/fp8_replay.py --out benchmarks/results", "",
             f"Batch {rows[0]['batch']} × {rows[0]['seq_len']} tokens on one device, AdamW "
             "with fp32 masters, clipping, cuDNN attention, no recompute. ms per step; `× bf16`: "
             "the step over bf16's; GEMMs by what their dots read.", "",
             "| width | layers | recipe | step ms | × bf16 | GEMM f8 | GEMM bf16 | attention | "
             "amax | amax+quantize | quantize | other | GEMMs (operand types) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["width"], r["layers"]): r["step_ms"] for r in rows if r["recipe"] == "bf16"}
    for r in rows:
        bf16 = base.get((r["width"], r["layers"]))
        ratio = f"{r['step_ms'] / bf16:.3f}" if bf16 else "—"
        gemms = ", ".join(f"{k}: {n}" for k, n in sorted(r["gemm_operands"].items()))
        lines.append(f"| {r['width']} | {r['layers']} | {r['recipe']} | {r['step_ms']:.1f} | "
                     f"{ratio} | " + " | ".join(f"{r['ms'][k]:.1f}" for k in KINDS) +
                     f" | {gemms} |")
    lines += ["", "Per block (the step of the most layers less the step of the fewest, over the "
              "layers between): what a deep model tends to. One layer compiles without the layer "
              "loop (its GEMMs are not the loop's), so width 8192's row is indicative.", "",
              "| width | layers | recipe | ms per block | × bf16 |", "|---|---|---|---|---|"]
    for width in sorted({r["width"] for r in rows}):
        steps = {(r["recipe"], r["layers"]): r["step_ms"] for r in rows if r["width"] == width}
        layers = sorted({n for _, n in steps})
        if len(layers) < 2:
            continue
        lo, hi = layers[0], layers[-1]
        per = {rec: (steps[(rec, hi)] - steps[(rec, lo)]) / (hi - lo)
               for rec, _ in steps if (rec, lo) in steps and (rec, hi) in steps}
        for rec, v in per.items() if "bf16" in per else ():
            lines.append(f"| {width} | {lo} → {hi} | {rec} | {v:.2f} | {v / per['bf16']:.3f} |")
    return "\n".join(lines) + "\n"


def _key(row: dict) -> tuple:
    return row["width"], row["layers"], ["bf16", "current", "delayed-emulated"].index(row["recipe"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["4096:4", "4096:8", "8192:1", "8192:2"],
                   help="WIDTH:LAYERS")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--recipes", nargs="+", default=["bf16", "current", "delayed-emulated"])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--append", action="store_true")
    args = p.parse_args(argv)
    import jax

    out = pathlib.Path(args.out)
    rows = json.loads((out / "fp8_replay.json").read_text()) if args.append else []
    for spec in args.models:
        width, layers = map(int, spec.split(":"))
        for recipe in args.recipes:
            text = compile_text(width, layers, args.batch, args.seq_len, recipe)
            row = {"width": width, "layers": layers, "recipe": recipe, "batch": args.batch,
                   "seq_len": args.seq_len, "jaxlib": jax.__version__, **breakdown(text)}
            rows = [r for r in rows if _key(r) != _key(row)] + [row]
            print(json.dumps(row), flush=True)
    rows.sort(key=_key)
    (out / "fp8_replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    page = out / "fp8_replay.md"
    kept = page.read_text().partition(NOTES)[2] if page.exists() else ""
    page.write_text(markdown(rows) + (f"\n{NOTES}{kept}" if kept else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
