"""The GPU suite: one command that measures what a lent GPU machine should measure first.

    python benchmarks/gpu_suite.py [--out benchmarks/results] [--budget-s 420] [--hlo-dir D]
    python benchmarks/gpu_suite.py --tiny --out /tmp/suite           # CPU smoke run (the tests do it)

The sections run in the order of their value when a GPU is lent for minutes: (a), (f), (b), (d),
(c). Each one that fails is recorded with its one-line error and the others still run; the results
are written after each section, so a run cut short keeps what it measured; a section that would
start after `--budget-s` seconds is recorded as skipped (the search of (c) stops there too).

Writes `gpu_<device>.md` and `.json` (device: the accelerator's kind, e.g. `h100`) with:

(a) the measured bf16 matmul rate (square matmuls), next to the device's nominal dense bf16 peak;
(b) single-device training MFU of GPT-1.3B-class models: axonn_jax's train step against a plain
    `jax.jit` step of the same model, optimizer and batch (`analysis.step_bench`), in the same run;
(c) the largest GPT (layers of a fixed width) that trains with the optimizer state on the device,
    with `--offload-optimizer`, and with both offloads (optimizer state and activations), each with
    its step time and MFU (the largest size whose step compiles and runs);
(d) CGX quantize + dequantize throughput in GB/s of fp32 input, against the device's measured copy
    bandwidth; and chained copies of two sizes: the HBM rate a large kernel reaches and what each
    kernel costs beyond its bytes (`chained_copies`);
(e) overlap of tensor-parallel collectives with compute: needs several devices; recorded as skipped
    on one;
(f) step variants of one Llama (llama3.2-1b) on one device, each against the first in the same
    run: attention `xla` against `cudnn` (fused flash attention), `--remat none` against
    `selective` and `full` (attention `auto`: cuDNN on a GPU), and `--fp8` against bf16 (both
    `remat none`); each with its first step's loss (every variant starts from the same parameters
    and batch) and the operand types of its GEMMs (`analysis.hlo.gemm_operand_dtypes`: an FP8
    step's are f8), and its device time per step by kernel category from a profiler trace
    (`profiled_kernels`: matmul, attention, collective, other; GPUs only). A variant that cannot
    run here is recorded with its reason. `--hlo-dir`
    keeps each variant's compiled module, for the replay (`analysis.overlap`) to be checked
    against the measured time.

MFU = model FLOPs of the step (forward + backward, `GPTConfig.flops_per_token`) / step time / the
nominal peak. `--tiny` shrinks every size so the whole suite runs in seconds on a CPU, so it is
never broken when a GPU comes; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import statistics
import subprocess
import sys
import time
import traceback

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
    variant_batch: int = 2  # 4 × 2048 with XLA attention and no recompute needs 117 GB
    variant_layers: int | None = None  # the preset's depth
    variants: tuple[str, ...] | None = None  # names of `VARIANTS` to run (None: all)
    repeats: int = 5
    xla_options: str = "library"


TINY = Sizes(matmul=256, mfu_model="gpt-tiny", mfu_batch=4, seq_len=32, search_width=64,
             search_heads=4, search_batch=4, max_layers=1, cgx_elements=1 << 16,
             variant_model="llama-tiny", variant_batch=2, repeats=2)

VARIANTS = (  # name, model config overrides, train step options
    ("xla attention, remat none", {"attention": "xla"}, {}),
    ("cudnn attention, remat none", {"attention": "cudnn"}, {}),
    ("auto attention, remat none, fp8", {"attention": "auto"}, {"fp8": True}),
    # auto: cuDNN where it runs (a GPU in bf16), XLA elsewhere, so that the CPU smoke run covers
    # the remat modes too
    ("auto attention, remat selective", {"attention": "auto"}, {"remat": "selective"}),
    ("auto attention, remat full", {"attention": "auto"}, {"remat": "full"}),
)


_START = time.monotonic()


def log(*parts) -> None:
    print(f"[{time.monotonic() - _START:6.1f} s]", *parts, flush=True)


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


def matmul_rate(n: int, repeats: int, chain: int = 10) -> float:
    """bf16 FLOP/s of n×n by n×n matmuls, `chain` of them in one program (each reads the last's
    result, so none is hoisted; one dispatch per `chain`, so the host's share is negligible)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / n**0.5  # keeps the scale
    f = jax.jit(lambda x: jax.lax.fori_loop(0, chain, lambda _, y: y @ w, x))
    return chain * 2 * n**3 / timed(lambda: f(a), repeats)


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
                            baselines=("gspmd dp",), log=log, loss_rtol=1e-2)
    for r in report["rows"]:
        rows.append({"model": s.mfu_model, "variant": "axonn_jax" if r["name"].startswith("axonn")
                     else "plain jax.jit", "batch": s.mfu_batch, "seq_len": s.seq_len,
                     "step_time_s": r["step_time_s"], "mfu": flops / r["step_time_s"] / peak,
                     "peak_bytes": r["peak_bytes"], "loss": r["loss"]})
    return rows


def kernel_categories(text: str) -> dict[str, str]:
    """`{instruction name: matmul | attention | collective | other}` for every instruction of a
    compiled module: matmul where `analysis.hlo` counts tensor-core FLOPs (GEMM fusions, cuBLAS
    calls), attention for cuDNN's fused attention, collective for a collective or its start."""
    from axonn_jax.analysis import hlo

    matmuls = hlo.FlopCounter(text, matmuls_only=True)
    out = {}
    for instrs in matmuls.comps.values():
        shapes = {}
        for instr in instrs:
            shapes[instr.name] = instr.shape
            if "__cudnn$fmha" in instr.rest:
                out[instr.name] = "attention"
            elif instr.opcode.removesuffix("-start") in hlo.KINDS:
                out[instr.name] = "collective"
            elif instr.opcode not in ("while", "conditional", "call") and \
                    matmuls.instruction(shapes, instr) > 0:
                out[instr.name] = "matmul"
            else:
                out[instr.name] = "other"
    return out


def profiled_kernels(run_step, text: str, steps: int = 3) -> dict:
    """Device time per step by kernel category (`kernel_categories` of the module `text`), from a
    profiler trace of `steps` calls of `run_step()`: the events of the device's "XLA Ops" line,
    named after the module's instructions (`unattributed`: names not in it). A backend whose
    trace has no such line (XLA:CPU) gets `skipped`."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    categories = kernel_categories(text)
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        for _ in range(steps):
            jax.block_until_ready(run_step())
        jax.profiler.stop_trace()
        files = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(files[0])
        totals: dict[str, float] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if line.name != "XLA Ops":
                    continue
                for event in line.events:
                    key = categories.get(event.name, "unattributed")
                    totals[key] = totals.get(key, 0.0) + event.duration_ns * 1e-9 / steps
    return totals or {"skipped": "no device 'XLA Ops' line in this backend's trace"}


_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM|Allocat")


def _trains(layers: int, s: Sizes, options: dict) -> dict | None:
    """One step of a `layers`-deep GPT at the search width, or None when it does not fit; in a
    process of its own, so that no trial runs in memory an earlier one left behind (on an H200
    the offload rows ran out of device memory after the on-device trials of the same process)."""
    trial = json.dumps({"layers": layers, "sizes": dataclasses.asdict(s), "options": options})
    out = subprocess.run([sys.executable, __file__, "--trial", trial], capture_output=True,
                         text=True)
    if out.returncode:  # not out of memory (the trial returns None then): its own last words
        raise RuntimeError(f"the {layers}-layer trial failed: "
                           f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _trial(spec: str) -> dict | None:
    """`_trains` inside the trial's process (`--trial SPEC`)."""
    spec = json.loads(spec)
    sizes = spec["sizes"]
    return _train_once(spec["layers"], Sizes(**{**sizes, "variants": None}), spec["options"])


def _train_once(layers: int, s: Sizes, options: dict) -> dict | None:
    import jax
    import jax.numpy as jnp
    import optax

    from axonn_jax import make_mesh, ParallelConfig, make_train_step
    from axonn_jax.models import gpt

    config = gpt.GPTConfig(num_layers=layers, d_model=s.search_width, num_heads=s.search_heads,
                           max_seq_len=s.seq_len, vocab_size=50304 if s.search_width >= 1024 else 256)
    step = make_train_step(gpt.stacked(config, jnp.bfloat16), optax.adamw(1e-4),
                           make_mesh(ParallelConfig(), jax.devices()[:1]), dtype="bfloat16",
                           xla_options=s.xla_options, **options)
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
        if _OUT_OF_MEMORY.search(str(e)):
            return None
        raise
    flops = config.flops_per_token(s.seq_len) * s.search_batch * s.seq_len
    return {"layers": layers, "params": config.num_params(), "step_time_s": seconds,
            "flops": flops}


def step_variants(s: Sizes, peak: float, hlo_dir: pathlib.Path | None = None,
                  deadline: float = math.inf) -> list[dict]:
    """(f): `VARIANTS` of one Llama's bf16 train step on one device: step time, MFU, peak bytes,
    the first step's loss, the count of GEMMs per operand types; `error` (one line) for a variant
    that cannot run here (cuDNN on a CPU), `skipped` for one that would start after `deadline`.
    `hlo_dir`: write each compiled module there."""
    import collections

    import jax
    import jax.numpy as jnp
    import optax

    from axonn_jax import ParallelConfig, make_mesh, make_train_step
    from axonn_jax.analysis import hlo
    from axonn_jax.models import attention, get
    from axonn_jax.offload.activations import compiled_peak_bytes

    preset = get(s.variant_model)
    if s.variant_layers:
        preset = preset.with_config(num_layers=s.variant_layers)
    batch = lm_batch(preset.config, s.variant_batch, s.seq_len)
    flops = preset.config.flops_per_token(s.seq_len) * s.variant_batch * s.seq_len
    rows = []
    for name, overrides, options in VARIANTS:
        if s.variants is not None and name not in s.variants:
            continue
        row = {"variant": name, "model": s.variant_model, "batch": s.variant_batch,
               "seq_len": s.seq_len, "layers": preset.config.num_layers}
        if time.monotonic() > deadline:
            rows.append({**row, "error": "skipped: time budget spent"})
            continue
        log(f"(f) {name}")
        try:
            attention.check(overrides.get("attention", "auto"), jnp.bfloat16,
                            preset.config.head_dim)
            model = preset.with_config(**overrides).build(jnp.bfloat16)
            step = make_train_step(model, optax.adamw(1e-4), make_mesh(ParallelConfig(),
                                   jax.devices()[:1]), dtype="bfloat16",
                                   xla_options=s.xla_options, **options)
            state, placed = step.init_state(jax.random.key(0), batch), step.place_batch(batch)
            compiled = step.lower(state, placed).compile()
            text = compiled.as_text()
            if hlo_dir is not None:
                hlo_dir.mkdir(parents=True, exist_ok=True)
                (hlo_dir / (re.sub(r"[^a-z0-9]+", "_", name) + ".txt")).write_text(text)
            holder = {}
            holder["state"], metrics = compiled(state, placed)
            row["loss"] = float(metrics["loss"])

            def one():
                holder["state"], metrics = compiled(holder["state"], placed)
                return metrics

            seconds = timed(one, s.repeats)
            try:  # a profiler that cannot start here costs the row its profile only
                row["kernels_s"] = profiled_kernels(one, text)
            except Exception as e:
                row["kernels_s"] = {"skipped": f"{type(e).__name__}: {str(e)[:200]}"}
            gemms = collections.Counter("×".join(t) for t in hlo.gemm_operand_dtypes(text))
            row.update(step_time_s=seconds, mfu=flops / seconds / peak,
                       peak_bytes=compiled_peak_bytes(compiled), gemm_operand_types=dict(gemms))
        except Exception as e:  # a variant this device cannot run (cuDNN on a CPU, out of memory)
            if not (isinstance(e, ValueError) or _OUT_OF_MEMORY.search(str(e))):
                raise
            row["error"] = str(e).splitlines()[0][:200]
        rows.append(row)
    return rows


def _first_guess(s: Sizes) -> int:
    """The search's first layer count: a power of two near half of what the device's memory
    holds at 16 bytes per parameter (fp32 weights, gradients and two moments), 1 where the device
    does not say its memory."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    fits = stats.get("bytes_limit", 0) / (16 * 12 * s.search_width**2)
    return max(1, 2 ** int(math.log2(fits / 2))) if fits >= 2 else 1


def largest_model(s: Sizes, peak: float, deadline: float = math.inf) -> list[dict]:
    """(c): the deepest GPT at the search width that trains, per memory mode (doubling from
    `_first_guess`, then bisection on the layer count to within an eighth), until `deadline` (`time.monotonic()`): a search stopped
    there keeps the deepest that trained and says so (`stopped`)."""
    rows = []
    for name, options in (("optimizer state on device", {}),
                          ("--offload-optimizer", {"offload_optimizer": True}),
                          ("--offload-optimizer --remat offload",
                           {"offload_optimizer": True, "remat": "offload"})):
        best, lo, hi, stopped = None, 0, None, False
        layers = _first_guess(s)
        while layers <= s.max_layers and not (stopped := time.monotonic() > deadline):
            log(f"(c) {name}: {layers} layers")
            got = _trains(layers, s, options)
            if got is None:
                hi = layers
                break
            best, lo = got, layers
            layers *= 2
        while hi is not None and hi - lo > max(1, lo // 8) and not (stopped := time.monotonic() > deadline):
            mid = (lo + hi) // 2
            log(f"(c) {name}: {mid} layers")
            got = _trains(mid, s, options)
            lo, hi, best = (mid, hi, got) if got else (lo, mid, best)
        row = {"mode": name, "width": s.search_width, "capped": hi is None and not stopped,
               "stopped": stopped}
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
            "copy_bandwidth_gb_s": 2 * nbytes / t_copy / 1e9,
            "chained_copy": chained_copies((s.cgx_elements // 4, s.cgx_elements), s.repeats)}


def copy_seconds(elements: int, repeats: int, chain: int = 10) -> float:
    """Seconds of one device copy (read + write) of `elements` fp32 values, `chain` of them in one
    program (each reads the last's result through an optimization barrier, so that XLA fuses
    none): one dispatch per `chain`, so the host's share is negligible, as for `matmul_rate`."""
    import jax
    import jax.numpy as jnp

    def run(v):
        for _ in range(chain):
            v = jax.lax.optimization_barrier(v * 2.0)
        return v

    x = jnp.ones((elements,), jnp.float32)
    f = jax.jit(run)
    return timed(lambda: f(x), repeats) / chain


def chained_copies(sizes: tuple[int, int], repeats: int) -> dict:
    """(d): one kernel's time against the bytes it moves, from chained copies of two sizes (both
    above the L2 cache on a GPU): the slope is the HBM rate a large kernel reaches, the intercept
    what each kernel costs beyond its bytes (launch, ramp and tail), the two figures the replay's
    memory-bound kernels depend on.

    Args:
      sizes: fp32 elements of the smaller and the larger copy.
      repeats: timed calls of each chain (median).

    Returns:
      `{"bytes": [read + written per copy], "seconds": [per copy], "hbm_bw_gb_s",
      "per_kernel_us"}`; the last two None where the larger copy was not the slower.
    """
    moved = [8 * n for n in sizes]  # 4 bytes read and 4 written per element
    seconds = [copy_seconds(n, repeats) for n in sizes]
    slope = (seconds[1] - seconds[0]) / (moved[1] - moved[0])
    fitted = slope > 0
    return {"bytes": moved, "seconds": seconds,
            "hbm_bw_gb_s": 1 / slope / 1e9 if fitted else None,
            "per_kernel_us": (seconds[0] - slope * moved[0]) * 1e6 if fitted else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes (figures mean nothing)")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="start no section after this many seconds")
    p.add_argument("--hlo-dir", default=None, help="keep the variants' compiled modules here")
    p.add_argument("--sections", default=None,
                   help="comma-separated: matmul, variants, mfu, cgx, tp_overlap, largest_model "
                        "(default: all); the others are recorded as not asked for")
    p.add_argument("--variant-model", default=None, help="(f)'s preset (default llama3.2-1b)")
    p.add_argument("--variant-layers", type=int, default=None, help="(f)'s depth (default: the "
                   "preset's)")
    p.add_argument("--variant-batch", type=int, default=None)
    p.add_argument("--variants", default=None, help="(f)'s variants to run, ';'-separated names")
    p.add_argument("--xla-options", default="library", choices=("library", "xla"),
                   help="the train steps' XLA options (`--xla-options` of `train`)")
    p.add_argument("--trial", default=None, help=argparse.SUPPRESS)  # one (c) trial, JSON
    args = p.parse_args(argv)
    if args.trial:
        print(json.dumps(_trial(args.trial)))
        return 0
    import jax

    s = TINY if args.tiny else Sizes()
    s = dataclasses.replace(s, xla_options=args.xla_options, variant_layers=args.variant_layers,
                            variants=tuple(args.variants.split(";")) if args.variants else None,
                            **{k: v for k, v in (("variant_model", args.variant_model),
                                                 ("variant_batch", args.variant_batch)) if v})
    deadline = time.monotonic() + args.budget_s
    device = jax.devices()[0]
    kind = re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device.device_kind, "platform": device.platform,
              "devices": jax.device_count(), "jax": jax.__version__, "tiny": args.tiny,
              "command": " ".join(["python benchmarks/gpu_suite.py", *(argv or sys.argv[1:])])}
    peak = NOMINAL_BF16_PEAK.get("h100")
    hlo_dir = pathlib.Path(args.hlo_dir) if args.hlo_dir else None
    sections = (("matmul", lambda: matmul_section(s)),
                ("variants", lambda: step_variants(s, peak, hlo_dir, deadline)),
                ("mfu", lambda: mfu_comparison(s, peak)),
                ("cgx", lambda: cgx_throughput(s)),
                ("tp_overlap", lambda: {"skipped": f"needs several devices, {jax.device_count()} "
                                        "here" if jax.device_count() < 2 else "not measured yet"}),
                ("largest_model", lambda: largest_model(s, peak, deadline)))
    chosen = args.sections.split(",") if args.sections else [name for name, _ in sections]
    for name, run in sections:
        if name not in chosen:
            result[name] = {"skipped": "not asked for (--sections)"}
        elif time.monotonic() > deadline:
            result[name] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
        else:
            log(f"section {name}")
            try:
                result[name] = run()
            except Exception as e:  # recorded; the other sections still run
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if name == "matmul" and "peak_flops_per_s" in result[name]:
            peak = result[name]["peak_flops_per_s"]
        (out / f"gpu_{kind}.json").write_text(json.dumps(result, indent=1))
        (out / f"gpu_{kind}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def matmul_section(s: Sizes) -> dict:
    """(a): the measured bf16 matmul rate and the peak MFU divides by."""
    import jax

    rate = matmul_rate(s.matmul, s.repeats)
    peak, source = nominal_peak(jax.devices()[0].device_kind, rate)
    return {"n": s.matmul, "bf16_flops_per_s": rate, "peak_flops_per_s": peak,
            "peak_source": source}


def _not_run(section) -> str | None:
    """The one line of a section that did not run (skipped or failed), else None."""
    if isinstance(section, dict) and ("skipped" in section or "error" in section):
        return f"not run: {section.get('skipped') or section.get('error')}"
    return None if section is not None else "not run"


def _table(section, header: list[str], rows) -> list[str]:
    """A markdown table of `rows` (lines), or the one line of a section that did not run."""
    if _not_run(section):
        return [_not_run(section)]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def _mfu_rows(r: dict):
    for row in r["mfu"]:
        yield (f"| {row['model']} | {row['variant']} | {row['batch']} × {row['seq_len']} | "
               f"{row['step_time_s']:.4f} | {row['mfu']:.1%} | {row['peak_bytes'] / 1e9:.2f} | "
               f"{row['loss']:.4f} |")


def _largest_rows(r: dict):
    for row in r["largest_model"]:
        note = " (search cap)" if row["capped"] else \
            " (at least: search stopped by the time budget)" if row["stopped"] else ""
        if "layers" not in row:
            yield f"| {row['mode']} | {row['width']} | none{note or ' fits'} | | | |"
            continue
        yield (f"| {row['mode']} | {row['width']} | {row['layers']}{note} | "
               f"{row['params'] / 1e9:.2f} B | {row['step_time_s']:.3f} | {row['mfu']:.1%} |")


def _variant_rows(r: dict):
    first = next((v["step_time_s"] for v in r["variants"] if "step_time_s" in v), None)
    for v in r["variants"]:
        depth = f" ({v['layers']} layers)" if "layers" in v else ""
        head = f"| {v['model']}{depth} | {v['variant']} | {v['batch']} × {v['seq_len']} | "
        if "error" in v:
            yield head + f"not run: {v['error']} | | | | | | |"
            continue
        gemms = ", ".join(f"{k}: {n}" for k, n in sorted(v["gemm_operand_types"].items()))
        k = v.get("kernels_s", {})
        kernels = "/".join(f"{k.get(c, 0) * 1e3:.1f}" for c in ("matmul", "attention", "other")) \
            if "skipped" not in k and k else "—"
        yield head + (f"{v['step_time_s']:.4f} | {v['step_time_s'] / first:.2f} | "
                      f"{v['mfu']:.1%} | {v['peak_bytes'] / 1e9:.2f} | {v['loss']:.4f} | "
                      f"{gemms or 'none named'} | {kernels} |")


def _chained(c: dict) -> str:
    """(d)'s chained copies in words (empty where the run predates them)."""
    k = c.get("chained_copy")
    if not k:
        return ""
    sizes = " and ".join(f"{b / 1e9:.2f} GB in {t * 1e6:.0f} µs" for b, t in
                         zip(k["bytes"], k["seconds"]))
    fit = (f": HBM rate {k['hbm_bw_gb_s']:.1f} GB/s (read + written), "
           f"{k['per_kernel_us']:.1f} µs per kernel" if k["hbm_bw_gb_s"] else "")
    return f"; chained copies (ten per dispatch) moving {sizes}{fit}"


def markdown(r: dict) -> str:
    lines = [f"# GPU suite: {r['device']} ({r['devices']} device(s), JAX {r['jax']})", "",
             f"Command: `{r['command']}`" + ("  (tiny sizes: smoke run, figures mean nothing)"
                                              if r["tiny"] else ""), ""]
    for section, source in r.get("sources", {}).items():  # a table merged from several runs
        lines += [f"- {section}: `{source}`"]
    lines += [""] if r.get("sources") else []
    m, c = r.get("matmul"), r.get("cgx")
    lines += [f"(a) bf16 matmul: {_not_run(m)}" if _not_run(m) else
              f"(a) bf16 matmul {m['n']}²: {m['bf16_flops_per_s'] / 1e12:.2f} TFLOP/s measured; "
              f"peak used for MFU: {m['peak_flops_per_s'] / 1e12:.1f} TFLOP/s ({m['peak_source']})",
              "", "(b) single-device training", ""]
    lines += _table(r.get("mfu"), ["model", "step", "batch × seq", "step time s", "MFU",
                                   "peak GB", "first loss"],
                    () if _not_run(r.get("mfu")) else _mfu_rows(r))
    lines += ["", "(c) the largest GPT that trains (fixed width, layers searched)", ""]
    lines += _table(r.get("largest_model"), ["memory mode", "width", "layers", "parameters",
                                             "step time s", "MFU"],
                    () if _not_run(r.get("largest_model")) else _largest_rows(r))
    lines += ["", f"(d) CGX: {_not_run(c)}" if _not_run(c) else
              f"(d) CGX {c['bits']}-bit quantize + dequantize of {c['elements']:,} fp32 values: "
              f"{c['quantize_dequantize_gb_s']:.1f} GB/s of input; device copy bandwidth "
              f"{c['copy_bandwidth_gb_s']:.1f} GB/s (one copy per dispatch)" + _chained(c), "",
              f"(e) tensor-parallel overlap: {(r.get('tp_overlap') or {}).get('skipped')}", "",
              "(f) step variants on one device (time relative to the first row)", ""]
    lines += _table(r.get("variants"), ["model", "variant", "batch × seq", "step time s",
                                        "× first", "MFU", "peak GB", "first loss",
                                        "GEMM operand types",
                                        "profiled ms: matmul/attention/other"],
                    () if _not_run(r.get("variants")) else _variant_rows(r))
    return "\n".join(lines + [""])


if __name__ == "__main__":
    sys.exit(main())
