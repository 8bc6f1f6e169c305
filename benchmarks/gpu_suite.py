"""The GPU suite: one command that measures what a lent GPU machine should measure first.

    python benchmarks/gpu_suite.py [--out benchmarks/results]        # on the GPU machine
    python benchmarks/gpu_suite.py --tiny --out /tmp/suite           # CPU smoke run (the tests do it)

Writes `gpu_<device>.md` and `.json` (device: the accelerator's kind, e.g. `h100`) with:

(a) the measured bf16 matmul rate (square matmuls), next to the device's nominal dense bf16 peak;
(b) single-device training MFU of GPT-1.3B-class models: axonn_jax's train step against a plain
    `jax.jit` step of the same model, optimizer and batch (`analysis.step_bench`), in the same run;
(c) the largest GPT (layers of a fixed width) that trains with the optimizer state on the device,
    with `--offload-optimizer`, and with both offloads (optimizer state and activations), each with
    its step time and MFU (the largest size whose step compiles and runs);
(d) CGX quantize + dequantize throughput in GB/s of fp32 input, against the device's measured copy
    bandwidth;
(e) overlap of tensor-parallel collectives with compute: needs several devices; recorded as skipped
    on one;
(f) step variants of one Llama (llama3.2-1b) on one device, each against the first in the same
    run: attention `xla` against `cudnn` (fused flash attention), `--remat none` against
    `selective` and `full` (attention `auto`: cuDNN on a GPU); a variant that cannot run here is
    recorded with its reason.

MFU = model FLOPs of the step (forward + backward, `GPTConfig.flops_per_token`) / step time / the
nominal peak. `--tiny` shrinks every size so the whole suite runs in seconds on a CPU, so it is
never broken when a GPU comes; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import time

from axonn_jax.analysis.flops import NOMINAL_BF16_PEAK


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything the suite sizes, full (GPU) or tiny (CPU smoke run)."""

    matmul: int = 8192
    mfu_model: str = "gpt-1.3b"
    mfu_batch: int = 8
    seq_len: int = 2048
    search_width: int = 4096
    search_heads: int = 32
    search_batch: int = 4
    max_layers: int = 256
    cgx_elements: int = 1 << 28
    variant_model: str = "llama3.2-1b"
    variant_batch: int = 4
    repeats: int = 5


TINY = Sizes(matmul=256, mfu_model="gpt-tiny", mfu_batch=4, seq_len=32, search_width=64,
             search_heads=4, search_batch=4, max_layers=1, cgx_elements=1 << 16,
             variant_model="llama-tiny", variant_batch=2, repeats=2)

VARIANTS = (  # name, model config overrides, train step options
    ("xla attention, remat none", {"attention": "xla"}, {}),
    ("cudnn attention, remat none", {"attention": "cudnn"}, {}),
    # auto: cuDNN where it runs (a GPU in bf16), XLA elsewhere, so that the CPU smoke run covers
    # the remat modes too
    ("auto attention, remat selective", {"attention": "auto"}, {"remat": "selective"}),
    ("auto attention, remat full", {"attention": "auto"}, {"remat": "full"}),
)


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (results waited for) after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int, repeats: int) -> float:
    """bf16 FLOP/s of an n×n by n×n matmul."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / timed(lambda: f(a), repeats)


def nominal_peak(kind: str, measured: float) -> tuple[float, str]:
    for name, peak in NOMINAL_BF16_PEAK.items():
        if name in kind.lower():
            return peak, f"nominal {name} dense bf16"
    return measured, "measured (no nominal peak known for this device)"


def lm_batch(config, batch: int, seq_len: int):
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq_len + 1))
    tokens = tokens.astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def mfu_comparison(s: Sizes, peak: float) -> list[dict]:
    """(b): axonn_jax's step and a plain jit step of the same model on one device."""
    import jax
    import jax.numpy as jnp
    import optax

    from axonn_jax import ParallelConfig
    from axonn_jax.analysis import step_bench
    from axonn_jax.models import gpt

    config = gpt.get_config(s.mfu_model)
    model = gpt.stacked(config, jnp.bfloat16)
    batch = lm_batch(config, s.mfu_batch, s.seq_len)
    flops = config.flops_per_token(s.seq_len) * s.mfu_batch * s.seq_len
    rows = []
    report = step_bench.run(model, batch, optax.adamw(1e-4), grids=[ParallelConfig()],
                            devices=jax.devices()[:1], repeats=s.repeats,
                            baselines=("gspmd dp",), log=lambda *_: None)
    for r in report["rows"]:
        rows.append({"model": s.mfu_model, "variant": "axonn_jax" if r["name"].startswith("axonn")
                     else "plain jax.jit", "batch": s.mfu_batch, "seq_len": s.seq_len,
                     "step_time_s": r["step_time_s"], "mfu": flops / r["step_time_s"] / peak,
                     "peak_bytes": r["peak_bytes"]})
    return rows


def _trains(layers: int, s: Sizes, options: dict) -> dict | None:
    """One step of a `layers`-deep GPT at the search width, or None when it does not fit."""
    import jax
    import jax.numpy as jnp
    import optax

    from axonn_jax import make_mesh, ParallelConfig, make_train_step
    from axonn_jax.models import gpt

    config = gpt.GPTConfig(num_layers=layers, d_model=s.search_width, num_heads=s.search_heads,
                           max_seq_len=s.seq_len, vocab_size=50304 if s.search_width >= 1024 else 256)
    step = make_train_step(gpt.stacked(config, jnp.bfloat16), optax.adamw(1e-4),
                           make_mesh(ParallelConfig(), jax.devices()[:1]), dtype="bfloat16",
                           **options)
    batch = lm_batch(config, s.search_batch, s.seq_len)
    try:
        state = step.init_state(jax.random.key(0), batch)
        placed = step.place_batch(batch)
        compiled = step.lower(state, placed).compile()
        holder = {"state": state}

        def one():
            holder["state"], metrics = compiled(holder["state"], placed)
            return metrics

        seconds = timed(one, 1)
    except Exception as e:  # out of memory shows up as several error types
        if re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM|Allocat", str(e)):
            return None
        raise
    flops = config.flops_per_token(s.seq_len) * s.search_batch * s.seq_len
    return {"layers": layers, "params": config.num_params(), "step_time_s": seconds,
            "flops": flops}


def step_variants(s: Sizes, peak: float) -> list[dict]:
    """(f): `VARIANTS` of one Llama's bf16 train step on one device: step time, MFU, peak bytes;
    `error` (one line) for a variant that cannot run here (cuDNN on a CPU)."""
    import jax
    import jax.numpy as jnp
    import optax

    from axonn_jax import ParallelConfig, make_mesh, make_train_step
    from axonn_jax.models import attention, get
    from axonn_jax.offload.activations import compiled_peak_bytes

    preset = get(s.variant_model)
    batch = lm_batch(preset.config, s.variant_batch, s.seq_len)
    flops = preset.config.flops_per_token(s.seq_len) * s.variant_batch * s.seq_len
    rows = []
    for name, overrides, options in VARIANTS:
        row = {"variant": name, "model": s.variant_model, "batch": s.variant_batch,
               "seq_len": s.seq_len}
        try:
            attention.check(overrides.get("attention", "auto"), jnp.bfloat16,
                            preset.config.head_dim)
            model = preset.with_config(**overrides).build(jnp.bfloat16)
            step = make_train_step(model, optax.adamw(1e-4), make_mesh(ParallelConfig(),
                                   jax.devices()[:1]), dtype="bfloat16", **options)
            state, placed = step.init_state(jax.random.key(0), batch), step.place_batch(batch)
            compiled = step.lower(state, placed).compile()
            holder = {"state": state}

            def one():
                holder["state"], metrics = compiled(holder["state"], placed)
                return metrics

            seconds = timed(one, s.repeats)
            row.update(step_time_s=seconds, mfu=flops / seconds / peak,
                       peak_bytes=compiled_peak_bytes(compiled))
        except ValueError as e:  # a variant this device cannot run: its one-line reason
            row["error"] = str(e).splitlines()[0]
        rows.append(row)
    return rows


def largest_model(s: Sizes, peak: float) -> list[dict]:
    """(c): the deepest GPT at the search width that trains, per memory mode (doubling, then
    bisection on the layer count)."""
    rows = []
    for name, options in (("optimizer state on device", {}),
                          ("--offload-optimizer", {"offload_optimizer": True}),
                          ("--offload-optimizer --remat offload",
                           {"offload_optimizer": True, "remat": "offload"})):
        best, lo, hi = None, 0, None
        layers = 1
        while layers <= s.max_layers:
            got = _trains(layers, s, options)
            if got is None:
                hi = layers
                break
            best, lo = got, layers
            layers *= 2
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            got = _trains(mid, s, options)
            lo, hi, best = (mid, hi, got) if got else (lo, mid, best)
        row = {"mode": name, "width": s.search_width, "capped": hi is None}
        if best:
            row.update(best, mfu=best["flops"] / best["step_time_s"] / peak)
        rows.append(row)
    return rows


def cgx_throughput(s: Sizes) -> dict:
    """(d): quantize + dequantize of fp32 gradients, against a device copy (read + write)."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.parallel import compression

    x = jax.random.normal(jax.random.key(0), (s.cgx_elements,), jnp.float32)
    round_trip = jax.jit(lambda v: compression.dequantize(compression.quantize(v, 4, 1024), 4))
    copy = jax.jit(lambda v: v * 2.0)
    nbytes = x.size * 4
    t_cgx, t_copy = timed(lambda: round_trip(x), s.repeats), timed(lambda: copy(x), s.repeats)
    return {"elements": s.cgx_elements, "bits": 4, "bucket": 1024,
            "quantize_dequantize_gb_s": nbytes / t_cgx / 1e9,
            "copy_bandwidth_gb_s": 2 * nbytes / t_copy / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes (figures mean nothing)")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    import jax

    s = TINY if args.tiny else Sizes()
    device = jax.devices()[0]
    kind = re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")
    rate = matmul_rate(s.matmul, s.repeats)
    peak, peak_source = nominal_peak(device.device_kind, rate)
    result = {"device": device.device_kind, "platform": device.platform,
              "devices": jax.device_count(), "jax": jax.__version__, "tiny": args.tiny,
              "command": " ".join(["python benchmarks/gpu_suite.py", *(argv or sys.argv[1:])]),
              "matmul": {"n": s.matmul, "bf16_flops_per_s": rate, "peak_flops_per_s": peak,
                         "peak_source": peak_source},
              "mfu": mfu_comparison(s, peak), "largest_model": largest_model(s, peak),
              "cgx": cgx_throughput(s),
              "tp_overlap": {"skipped": f"needs several devices, {jax.device_count()} here"}
              if jax.device_count() < 2 else {"skipped": "not measured yet"},
              "variants": step_variants(s, peak)}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_{kind}.json").write_text(json.dumps(result, indent=1))
    (out / f"gpu_{kind}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(r: dict) -> str:
    m = r["matmul"]
    lines = [f"# GPU suite: {r['device']} ({r['devices']} device(s), JAX {r['jax']})", "",
             f"Command: `{r['command']}`" + ("  (tiny sizes: smoke run, figures mean nothing)"
                                              if r["tiny"] else ""), "",
             f"(a) bf16 matmul {m['n']}²: {m['bf16_flops_per_s'] / 1e12:.2f} TFLOP/s measured; "
             f"peak used for MFU: {m['peak_flops_per_s'] / 1e12:.1f} TFLOP/s ({m['peak_source']})",
             "", "(b) single-device training", "",
             "| model | step | batch × seq | step time s | MFU | peak GB |", "|---|---|---|---|---|---|"]
    for row in r["mfu"]:
        lines.append(f"| {row['model']} | {row['variant']} | {row['batch']} × {row['seq_len']} | "
                     f"{row['step_time_s']:.4f} | {row['mfu']:.1%} | {row['peak_bytes'] / 1e9:.2f} |")
    lines += ["", "(c) the largest GPT that trains (fixed width, layers searched)", "",
              "| memory mode | width | layers | parameters | step time s | MFU |",
              "|---|---|---|---|---|---|"]
    for row in r["largest_model"]:
        if "layers" in row:
            capped = " (search cap)" if row["capped"] else ""
            lines.append(f"| {row['mode']} | {row['width']} | {row['layers']}{capped} | "
                         f"{row['params'] / 1e9:.2f} B | {row['step_time_s']:.3f} | {row['mfu']:.1%} |")
        else:
            lines.append(f"| {row['mode']} | {row['width']} | none fits | | | |")
    c = r["cgx"]
    lines += ["", f"(d) CGX {c['bits']}-bit quantize + dequantize of {c['elements']:,} fp32 values: "
              f"{c['quantize_dequantize_gb_s']:.1f} GB/s of input; device copy bandwidth "
              f"{c['copy_bandwidth_gb_s']:.1f} GB/s", "",
              f"(e) tensor-parallel overlap: {r['tp_overlap']['skipped']}", "",
              "(f) step variants on one device (time relative to the first row)", "",
              "| model | variant | batch × seq | step time s | × first | MFU | peak GB |",
              "|---|---|---|---|---|---|---|"]
    first = next((v["step_time_s"] for v in r["variants"] if "step_time_s" in v), None)
    for v in r["variants"]:
        head = f"| {v['model']} | {v['variant']} | {v['batch']} × {v['seq_len']} | "
        if "error" in v:
            lines.append(head + f"not run: {v['error']} | | | |")
        else:
            lines.append(head + f"{v['step_time_s']:.4f} | {v['step_time_s'] / first:.2f} | "
                         f"{v['mfu']:.1%} | {v['peak_bytes'] / 1e9:.2f} |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    sys.exit(main())
