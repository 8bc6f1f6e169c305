"""The scale table: real models at 64, 256 and 1,024 devices, compiled without the hardware.

    python benchmarks/scale.py [--rows NAME ...] [--only axonn|gspmd] [--out benchmarks/results]

For each row (`ROWS`: a preset, a device count, the published batch and sequence length, and
either `plan`'s best grid or an explicit one) this compiles, one process per compile so that a
compiler abort or an out-of-memory kill stays one row:

- axonn_jax's train step (`axonn-jax compile --json`, bf16 compute, AdamW, fp32 master
  parameters) for abstract H100s (`analysis.targets`; every count here fits a topology of nodes
  of 8, so no row needs the CPU fallback), beside `plan`'s prediction of the same grid;
- the GSPMD baselines of `axonn-jax bench` (`analysis.step_bench.gspmd_step`: one `jax.jit` of
  the same model, loss, clipping and AdamW, GSPMD inserting every collective) at the same size:
  ZeRO-3 over all devices, and ZeRO-3 × Megatron tensor parallelism within a node of 8.

Writes scale.json and scale.md. `--rows` re-runs only the named rows and merges them into the
existing json/md (the other rows are kept as they were).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

LLAMA_SOURCE = ("Llama 3 paper (Dubey et al. 2024, §3.4.1): 405B pre-training starts with batches "
                "of 4M tokens in sequences of 4,096, i.e. 1,024 sequences; used for all Llama rows")
GPT_SOURCE = ("GPT-NeoX-20B (Black et al. 2022): sequences of 2,048, batch 1,538 (≈3.15M tokens); "
              "1,536 here so that it splits over the devices")
UNET_SOURCE = ("Stable Diffusion v1 model card (Rombach et al. 2022): batch 2,048 of 64×64 latents, "
               "the resolution of unet-28b; AxoNN's 28B U-Net publishes no batch")
LONG_SOURCE = ("Llama 3 paper, Table 4: the long-context stage trains 131,072-token sequences with "
               "context parallelism 16; here 4 sequences on context 16 × row 4")
MIXTRAL_SOURCE = ("Mixtral of Experts (Jiang et al. 2024) publishes no batch; 64 sequences of 4,096 "
                  "(256K tokens) on expert 8 × row 8")
DEEPSEEK_SOURCE = ("DeepSeekMoE (Dai et al. 2024) trains the 16B model on 4,096-token sequences; 64 of "
                   "them here, as the Mixtral row, on data 8 × expert 8 (8 of the 64 routed experts "
                   "per device), `--remat full`: without it the step needs 203 GB a device")


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: `flags` fix the grid (empty: `plan`'s best, `compile --top 1`)."""

    model: str
    devices: int
    batch: int
    seq: int
    source: str
    flags: tuple = ()

    def args(self) -> list[str]:
        seq = ["--seq-len", str(self.seq)] if self.seq else []  # 0: images
        return ["--model", self.model, "--devices", str(self.devices), "--batch-size",
                str(self.batch), *seq, "--dtype", "bfloat16",
                *(self.flags or ("--top", "1"))]


def _published() -> dict:
    rows = {}
    for n in (64, 256, 1024):
        for m in ("llama3-8b", "llama3-70b", "llama3-405b"):
            rows[f"{m}/{n}"] = Row(m, n, 1024, 4096, LLAMA_SOURCE)
        rows[f"gpt-20b/{n}"] = Row("gpt-20b", n, 1536, 2048, GPT_SOURCE)
        rows[f"unet-28b/{n}"] = Row("unet-28b", n, 2048, 0, UNET_SOURCE)
    # Collective matmuls off at 256: the per-block dot of plan's grid fails XLA:GPU's Triton
    # tiling without autotuning ("Couldn't find output tile sizes", as the GSPMD baselines' do)
    rows["unet-28b/256"] = Row("unet-28b", 256, 2048, 0, UNET_SOURCE,
                               ("--top", "1", "--collective-matmul", "off"))
    rows["llama3.1-8b/64 context16"] = Row("llama3.1-8b", 64, 4, 131072, LONG_SOURCE,
                                           ("--context", "16", "--row", "4", "--attention", "xla",
                                            "--remat", "full"))
    rows["mixtral-8x7b/64 expert8"] = Row("mixtral-8x7b", 64, 64, 4096, MIXTRAL_SOURCE,
                                          ("--expert", "8", "--row", "8", "--microbatches", "8",
                                           "--remat", "full"))
    rows["deepseek-moe-16b/64 expert8"] = Row("deepseek-moe-16b", 64, 64, 4096, DEEPSEEK_SOURCE,
                                              ("--data-parallel", "8", "--expert", "8",
                                               "--microbatches", "1", "--remat", "full"))
    return rows


ROWS = _published()

GSPMD = {  # name: (mesh shape of n devices, axis names), as analysis.step_bench.GSPMD_LAYOUTS
    "gspmd fsdp": (lambda n: (n,), ("fsdp",)),
    "gspmd fsdp x tp=8": (lambda n: (n // 8, 8), ("fsdp", "tp")),
}

NOTES: dict[str, str] = {
    "llama3.1-8b/64 context16":
        "Every collective equals `plan`'s per kind and mesh axes to the byte: `--remat` runs "
        "the ring kernel's forward again in the backward, its 15 hops per layer included "
        "(`ContextAttention` marks them `rematerialized`; before, the permutes were 1.23× "
        "`plan`), XLA:GPU sends the key/value gradients' last hop home in bf16 (it casts before "
        "the hop), and the token table's sum over row is a reduce-scatter where the rows then "
        "split over row (`Table`). FLOPs: `plan` counts the ring kernels' work, 2C + 1 of the "
        "4C blocks of scores (`context.flops_share`, 0.60 of the every-score count at C = 16; "
        "before 1.55× the compiled); the 4% left is the online softmax's elementwise work. "
        "Memory 39.8 GB, within 2% of `plan`: it was 59.3 GB while JAX's loop-invariant "
        "residual hoisting lifted every hop's masks out of the layer scan at once (15 GiB of "
        "bool, `parallel.context._device` now ties them to the layer's data), and `plan` "
        "counted a bf16 copy of every parameter and gradient that XLA fuses into the matmuls "
        "without depth gathers or a microbatch loop. (`--attention xla` is given as when this "
        "row was first compiled; `auto` now also resolves to the XLA core over context.)",
    "mixtral-8x7b/64 expert8":
        "Every collective kind equals `plan`'s (within 0.01%); memory 0.93× (`plan` still counts "
        "the padded exchange's buffers). Each accumulated microbatch holds one sequence per "
        "device, which the dense layers cannot split over `row` (`StepShape.layer_rows` divides "
        "by the microbatches without a pipeline too), so they run in the replicated layout: no "
        "all-gathers or reduce-scatters over `row`. Per layer and microbatch the step "
        "all-reduces over `row` the attention's input gradients once and its o_proj sums twice "
        "(forward, and again in `--remat full`'s recompute); the experts' sums over `row` are "
        "added per token after the return exchange (`parallel.experts`): the outputs once (the "
        "recompute keeps the exchanges' results, not the output) and the tokens' gradient once, "
        "76.1 GB over `row` in all where they were added per received row before (767.6 GB). "
        "The all-to-alls carry the routed rows (ragged). FLOPs 1.38× the ideal: the "
        "grouped-matmul kernels (`parallel.grouped_matmul`) run the routed rows plus one tile per "
        "expert and call (`--remat full` alone makes 1.33×; jaxlib's dense `ragged_dot` made "
        "8.99×), `benchmarks/results/moe_grouped.md`.",
    "unet-28b/256":
        "FLOPs 0.93× the ideal: `analysis.hlo.flops` counts the convolutions (XLA's and cuDNN's "
        "`__cudnn$conv*` calls, as XLA's cost analysis does, padding excluded). Convolutions now "
        "keep the images split like the dense layers (`tp.tensor.tp_conv`, 2026-11-29): the "
        "all-gathers and reduce-scatters are within 13% of `plan`'s and the all-reduces equal; "
        "the all-to-alls and permutes are GSPMD's re-layouts of the skip concatenations and 1×1 "
        "skip convolutions, which `plan` leaves out (docs/models/unet-cnn.md). Before, with "
        "convolutions in the replicated layout, GSPMD gathered whole batches between them and the "
        "dense layers (on data 4 × depth 8 × row 4 × col 2, all-gathers 99.9 GB against `plan`'s "
        "10.9). Memory 0.98×: `ConvLayer.kept_bytes`. The GSPMD baselines do not compile "
        "for the abstract H100 here: XLA:GPU's Triton GEMM tiling ('Couldn't find output tile "
        "sizes') rejects the attention output projection's dot (no autotuning without a GPU); "
        "on a real H100, or with another jaxlib, to be retried.",
    "unet-28b/64":
        "A pipeline (data 4 × pipe 2 × row 4 × col 2, 16 microbatches), which `plan` picks now "
        "that its memory counts convolutions in the batch-split layout (before: no grid of 64 "
        "fits). It fits (75.9 GB), but `plan` undercounts it (67.2 GB). FLOPs within 10%: the "
        "last stage runs the up path and the head's recomputed down path beside its ten blocks, "
        "1.32× the mean stage (13.6 against 10.3 TFLOP an image forward), and `plan` now runs "
        "the pipeline at that stage's pace (`ModelCommunication.busiest_stage`; 0.71× the "
        "compiled FLOPs when it took every stage as the mean). The gathers and scatters (1.34×, "
        "1.40×) and GSPMD's re-layouts inside the stages (22.7 GB of all-to-alls, 106.7 GB of "
        "permutes) are not traced yet; the rows without a pipeline agree within 15%.",
    "unet-28b/1024":
        "As unet-28b/256 (FLOPs 0.93× the ideal; convolutions in the dense layers' layout). "
        "The all-gathers and collective permutes together (20.6 GB) equal `plan`'s all-gathers "
        "(20.7 GB); the compiled step moves 6.4 GB of them as 1,441 collective permutes (5.5 GB over "
        "col). "
        "Memory 0.94× (0.61× while `plan` counted three kept arrays per layer in the replicated "
        "layout).",
    "llama3-8b/1024":
        "Collectives as the compiling backend makes them (`collectives.StepShape.platform`): "
        "depth's kernel gathers and gradient reduce-scatters in the compute dtype (bf16 on the "
        "H100; XLA:CPU's f32 only for `--target cpu`), the input-gradient reduce-scatters of "
        "layers reading one input added before one scatter (XLA:GPU's reassociation), `--remat "
        "full` repeating the output reduce-scatters the block's backward reads. All-gathers and "
        "reduce-scatters equal `plan`'s on every row without a pipeline. Memory 0.92×: the "
        "safe side.",
    "llama3-8b/256":
        "Data 32 × depth 8, `--remat selective` (the pick since `plan` counts the logits and "
        "one recomputed block as never live together): memory and every collective within 5% of "
        "`plan`'s. The earlier pick (data 8 × depth 16 × row 2) showed every collective equal "
        "per kind and mesh axes, after `plan` learnt that XLA:GPU makes the token table's "
        "lookup sum over row a reduce-scatter where the batch-split layout splits the rows over "
        "row (before, all-reduces 0.69×).",
    "llama3-70b/256":
        "`plan`'s pick is now data 8 × depth 8 × row 4 (51.0% predicted on DGX nodes): its "
        "memory model no longer rejects it (`plan` had counted the logits beside a recomputed "
        "block, in fp32). Its schedule replayed at 16.0 s (46.4% MFU) at XLA's default memory "
        "limit for the latency-hiding scheduler, which stopped overlapping the data all-reduces "
        "near it; with the library's limit (`step/xla_options.py`, 125%) 14.06 s (52.9%) in "
        "75.2 GB (75.8 before), against 14.09 s (52.8%) for data 4 × depth 16 × row 4; `plan` "
        "predicts 53.4% (DGX nodes) and `plan --verify 3` keeps its order (docs/planner.md). Every "
        "collective equals `plan`'s per kind and mesh axes, the collective matmuls' permutes "
        "included.",
    "gpt-20b/1024":
        "`plan` picks a 1F1B pipeline (data 32 × pipe 4 × row 4 × col 2, 16 microbatches) since "
        "its exposed time follows the communication stream's load (`comm_model."
        "stream_utilisation`): the data-parallel exchange of the earlier pick, data 128 × depth 2 "
        "× row 4 (selective), replays 0.45 s exposed of a 1.17 s step (the law: 0.46 s; the "
        "per-axis shares had said 0.10 s). Which of the two is faster is not settled here: the "
        "pipeline's replay, 2.04 s against 1.02 s predicted (matmuls 1.02, other kernels 0.69, "
        "exposed 0.34), is an upper bound (the replay runs every `lax.cond`'s heavier branch: "
        "each stage's forward and backward in the bubble's ticks, the head on every stage), and "
        "`plan`'s pipeline figures rest on shares measured on a 1.9B case. All-reduces 1.36× and "
        "FLOPs 1.55× `plan`'s: "
        "the compiled count takes the 19 ticks of each pass as run for 16 microbatches (1.19×); "
        "the rest is not traced. The earlier pick's notes: "
        "every collective equals `plan`'s per kind and mesh axes (before, all-reduces 0.84×: "
        "with rows whole over row, XLA:GPU adds the input gradients of q, k and v before one "
        "all-reduce over row, as it does their reduce-scatters when split (`DenseLayer`); the "
        "biases' and the position table's gradients are summed over depth in bf16).",
    "llama3-405b/1024":
        "All-gathers and reduce-scatters equal (see llama3-8b/1024). Memory 0.89×: the safe side.",
    "gpt-20b/64":
        "Data 4 × depth 16, `--remat full`: every collective equals `plan`'s; memory 0.91× "
        "(0.82× at XLA's default scheduler memory limit: the library's 125% keeps more live, "
        "64.5 → 71.7 GB, and replays 0.4% slower, 11.08 → 11.12 s) "
        "`plan`'s: one recomputed block is counted with the working set read off Llama steps "
        "(six activations of the MLP's hidden width for SwiGLU's gate, up and product), where "
        "GPT's GELU MLP keeps fewer, and the logits with their gradient (the compiled step "
        "keeps one bf16[24, 2048, 50304]); the safe side.",
    "llama3-70b/64":
        "Pipe 8 × depth 2 × row 4, 256 microbatches: all-gathers 1.09× `plan`'s (1.23× before "
        "`plan` counted the tables' and head's depth gathers per microbatch inside a GPU "
        "pipeline's ticks, see llama3-8b/64): the compiled count takes all 270 ticks' "
        "conditionals as run for 256 microbatches (1.055×), and the head gathers its kernel "
        "again in the last stage's backward; the FLOPs count the bubble's ticks (CAUSES); a 3.4 "
        "GB all-to-all is one of GSPMD's re-layouts.",
    "llama3-8b/64":
        "Data 8 × depth 8, `--remat full` (the pick since `plan` counts the logits and one "
        "recomputed block as never live together): collectives equal, memory 0.92× `plan`'s "
        "(65.9 GB; 50.1 GB and 0.70× at XLA's default scheduler memory limit, where XLA's own "
        "rematerialization recomputed more: the library's 125% replays 1.6% faster, 6.26 → "
        "6.16 s). The earlier "
        "pick, data 4 × pipe 2 × depth 8 with 16 microbatches, all-gathered 1.34× `plan`'s over "
        "depth: per tick the stage's kernels three times (forward, the backward tick's "
        "recomputed forward, its backward) and the embedding's and head's tables four times, "
        "which `plan` took as hoisted out of the tick loop; on a GPU they sit in the stages' "
        "`lax.cond` branches, so `plan` now counts them per microbatch (0.96× the compiled "
        "step's run ticks, `tests/test_comm_model.py`).",
}
"""Why a row's compiled figures part from `plan`'s by more than 10% (from the compiled HLO),
beyond the causes that `CAUSES` gives for every row, or what was traced to make them agree."""

CAUSES = [
    "**FLOPs** (every pipeline row): the compiled stage program runs a forward and a backward "
    "on every tick of the schedule, the bubble's ticks included (the HLO's FLOPs count the tick "
    "loop's body × its trip count, M + P − 1 ticks for M microbatches), and cuDNN's attention "
    "forward runs again inside the backward (the nested shard_map recomputes it); `plan` counts "
    "the model's 6·N·tokens. Not a cost the GPU pays in full (a bubble tick's work is masked), "
    "so `plan` is left as it is.",
    "**all-reduce** (pipeline rows with data > 1): XLA's GPU pipeline merges the data-parallel "
    "all-reduce of the embedding's and head's gradients with their sum over the stages into one "
    "all-reduce over data × pipe (compiled `all-reduce over data+pipe` = the embedding and head "
    "parameters of a device × 4 bytes × 2(g − 1)/g, g = data · pipe; Llama-3-8B/64: 8.27 GB, "
    "exactly); `plan` counts the two all-reduces separately, as the CPU program runs them (where "
    "`tests/test_comm_model.py` checks it to 5%). The compiled total is therefore lower.",
    "**tensor-parallel bytes inside pipeline stages** (all-reduce over row): the compiled tick "
    "loop runs a forward and a backward in each of its M + 2(P − 1) ticks and the HLO count "
    "takes every tick's conditional as run, as for the FLOPs; per tick the row all-reduces equal "
    "`plan`'s per microbatch (Llama-3-70B/256 data 4 × pipe 16 × row 4: 6 of one microbatch's "
    "activations per layer, the forward's 2 twice and the backward's 2, XLA:GPU adding the "
    "input gradients of q, k, v and of gate, up before one all-reduce each; compiled / `plan` = "
    "286 / 256 ticks = 1.117). Before `plan` counted 5 input-gradient all-reduces a layer, "
    "1.5× the compiled per tick (the old note's 35–38% below).",
]

GSPMD_CHILD = """
import json, sys, time
from axonn_jax.mesh import use_cpu_platform
use_cpu_platform()
sys.path.insert(0, {bench!r})
import jax.numpy as jnp, numpy as np
import scale
from axonn_jax.analysis import step_bench, targets
from axonn_jax.analysis.flops import compiled_flops
from axonn_jax.analysis.hlo import wire_bytes
from axonn_jax.models import get
from axonn_jax.offload.activations import compiled_peak_bytes
import optax
row = scale.ROWS[{row!r}]
preset = get(row.model)
if preset.data == "images":
    batch = preset.config.example_batch(row.batch)
else:
    batch = {{k: np.zeros((row.batch, row.seq), np.int32) for k in ("inputs", "targets")}}
batch = {{k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}}
devices = targets.h100_devices(row.devices)
step_bench.GSPMD_LAYOUTS.update(scale.GSPMD)
step, state, placed = step_bench.gspmd_step({layout!r}, preset.build(jnp.bfloat16),
                                            optax.adamw(1e-3), batch, devices, 1.0,
                                            abstract=True)
t0 = time.perf_counter()
compiled = step.lower(state, placed).compile()
by_kind = wire_bytes(compiled.as_text())
print(json.dumps({{"name": {layout!r}, "comm_bytes_per_device": by_kind,
                  "memory_per_device_bytes": compiled_peak_bytes(compiled),
                  "flops_per_device": compiled_flops(compiled),
                  "compile_s": time.perf_counter() - t0}}))
"""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _child(args: list[str], timeout: float) -> tuple[object | None, str | None, float]:
    """(parsed JSON the child printed last, error line, wall seconds)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"compile did not finish in {timeout:.0f} s", time.perf_counter() - t0
    wall = time.perf_counter() - t0
    text = out.stdout.strip()
    start = min([i for i in (text.find("["), text.find("{")) if i >= 0], default=-1)
    if start >= 0:
        try:
            return json.loads(text[start:]), None, wall
        except json.JSONDecodeError:
            pass
    if out.returncode < 0:
        return None, f"killed by signal {-out.returncode} (out of memory?)", wall
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith((" ", "W", "I0"))]
    errors = [ln for ln in lines if "Error:" in ln or "error:" in ln]
    return None, (errors or lines or ["?"])[-1][:300], wall


def run_row(name: str, row: Row, parts: set, timeout: float, old: dict | None = None) -> dict:
    """Compile row `name`'s `parts` ({"axonn", "gspmd"}); the other part is kept from `old`."""
    out = dict(old or {})
    if "axonn" in parts:
        out.update(_axonn(name, row, timeout))
    if "gspmd" in parts:
        out["gspmd"] = []
        for layout in GSPMD:
            code = GSPMD_CHILD.format(bench=str(REPO / "benchmarks"), row=name, layout=layout)
            got, error, wall = _child([sys.executable, "-c", code], timeout)
            out["gspmd"].append(got or {"name": layout, "error": error})
            print(f"  {layout}: {error or 'compiled'} ({wall:.0f} s)", flush=True)
    return out


def _axonn(name: str, row: Row, timeout: float) -> dict:
    from axonn_jax.analysis.compiled import CompileReport, disagreements

    cmd = [sys.executable, "-m", "axonn_jax", "compile", "--target", "h100", *row.args(), "--json"]
    out = {"row": dataclasses.asdict(row), "target": "h100", "error": None, "compiled": None,
           "disagreements": [],
           "command": "axonn-jax compile --target h100 " + " ".join(row.args())}
    reports, error, wall = _child(cmd, timeout)
    out["wall_s"] = wall
    if reports == []:
        out["error"] = f"plan: no grid of {row.devices} devices fits in 80 GB"
    elif reports is None:
        out["error"] = error
    else:
        r = reports[0]
        out["compiled"] = r
        fields = {f.name for f in dataclasses.fields(CompileReport)}
        out["disagreements"] = disagreements(CompileReport(**{k: r[k] for k in fields}))
    print(f"{name}: {out.get('error') or 'compiled'} ({wall:.0f} s)", flush=True)
    return out


def _gb(x) -> str:
    return f"{x / 1e9:.1f}"


def _pair(got, want) -> str:
    if not want:
        return f"{_gb(got)} vs –"
    return f"{_gb(got)} vs {_gb(want)} ({got / want:.2f}×)"


def _grid(r: dict) -> str:
    return "×".join(f"{k} {v}" for k, v in r["grid"].items() if v > 1) + f", M {r['microbatches']}"


def _comm(r: dict) -> str:
    p = (r.get("predicted") or {}).get("comm_bytes_per_device", {})
    kinds = sorted(k for k in set(r["comm_bytes_per_device"]) | set(p)
                   if r["comm_bytes_per_device"].get(k) or p.get(k))
    return "; ".join(f"{k} {_pair(r['comm_bytes_per_device'].get(k, 0), p.get(k, 0))}"
                     for k in kinds) or "none"


def _gspmd_cell(g: dict) -> str:
    if "error" in g:
        return f"no: {g['error'][:80]}"
    wire = sum(g["comm_bytes_per_device"].values())
    return f"{_gb(wire)} GB wire, {_gb(g['memory_per_device_bytes'])} GB"


def markdown(results: dict) -> str:
    head = ["row", "plan's grid", "memory GB compiled vs plan (compiled/plan)", "fits 80 GB",
            "collective GB per kind, compiled vs plan (compiled/plan)", "FLOPs / ideal (plan)", "compile s",
            *GSPMD]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {name} | not run yet (`--rows {name}`) |" + " |" * (len(head) - 2)
              for name in ROWS if name not in results]
    for name, res in results.items():
        g = [_gspmd_cell(x) for x in res.get("gspmd", [])] or ["not run"] * len(GSPMD)
        if not res.get("compiled"):
            lines.append(f"| {name} | {res['error']} | | | | | | " + " | ".join(g) + " |")
            continue
        r = res["compiled"]
        p = r.get("predicted") or {}
        ideal = r.get("model_flops_per_device")
        flops = (f"{r['flops_per_device'] / ideal:.2f} ({p['flops_per_device'] / ideal:.2f})"
                 if ideal and p else "–")
        lines.append(f"| {name} | {_grid(r)} | "
                     f"{_pair(r['memory_per_device_bytes'], p.get('memory_per_device_bytes'))} | "
                     f"{'yes' if r['fits'] else '**no**'} | {_comm(r)} | {flops} | "
                     f"{r['compile_s']:.0f} | " + " | ".join(g) + " |")
    sources = sorted({res["row"]["source"] for res in results.values()})
    gaps = [f"- **{name}**: " + ("; ".join(res["disagreements"]) or "every figure within 10%")
            + (f"\n  - why: {NOTES[name]}" if name in NOTES else "")
            for name, res in results.items()
            if res.get("disagreements") or (name in NOTES and res.get("compiled"))]
    return "\n".join([
        "# The scale table: plan's grid compiled for abstract H100s", "",
        "Every row compiled with today's `plan` (its grid, microbatches and remat mode: the "
        "compiled report's `remat` in scale.json).", "",
        "`python benchmarks/scale.py` (re-run rows: `--rows NAME ...`). Every row is compiled for "
        "abstract H100 SXM GPUs in nodes of 8 (`analysis.targets`, deviceless: nothing runs or "
        "is allocated); no row needed the CPU fallback. bf16 compute, fp32 master parameters, "
        "AdamW state on the device, no recompute unless the row says so. Per device, one step; "
        "GB = 1e9 bytes. Memory: the compiled peak (arguments + outputs − aliased + temporaries) "
        "against `plan`'s; collectives: wire bytes by kind (loop bodies × trip count) against "
        "`plan`'s; FLOPs: the compiled module's against the model's ideal (6·N·tokens), `plan`'s "
        "in brackets. GSPMD: the baselines of `axonn-jax bench` (`analysis.step_bench`: one jit "
        "of the same model and update) compiled the same way, ZeRO-3 over all devices and "
        "ZeRO-3 × Megatron TP 8: wire bytes and peak memory per device. A GSPMD baseline "
        "computes the whole batch in one jit (no accumulation, no recompute), so its memory is "
        "that of the whole batch at once, and its terabytes of wire bytes (not yet broken "
        "down by op here) include GSPMD's re-layouts of those whole-batch activations: these "
        "are `bench`'s untuned baselines, not a tuned pjit run (remat, accumulation); 'not run': each GSPMD compile takes 1–2 minutes on "
        "this shared 2-core machine and did not fit the session (`--only gspmd --rows NAME` "
        "adds them). Every compile stayed under 2 GB of this machine's RAM (none was skipped "
        "for memory); `plan: no grid ... fits` rows are those where the planner finds no grid "
        "under 80 GB, so nothing is compiled.", "",
        *lines, "", "## Where the compiler and `plan` differ by more than 10%", "",
        *(gaps or ["none"]), "", "Causes common to the rows (read from the compiled HLO):", "",
        *(f"- {c}" for c in CAUSES), "", "## Batch and sequence sources", "",
        *(f"- {s}" for s in sources), "", "## Commands", "",
        *(f"- {name}: `{res['command']}`" for name, res in results.items()), ""])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", nargs="*", default=None, help=f"any of: {', '.join(ROWS)}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--only", choices=["axonn", "gspmd"], default=None,
                   help="compile only axonn_jax's step or only the GSPMD baselines (the other "
                        "part of each row is kept from the existing json)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per compile")
    p.add_argument("--md-only", action="store_true", help="rewrite scale.md from scale.json")
    args = p.parse_args()
    if args.md_only:
        path = pathlib.Path(args.out) / "scale.json"
        (path.parent / "scale.md").write_text(markdown(json.loads(path.read_text())))
        return 0
    unknown = sorted(set(args.rows or ()) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    out = pathlib.Path(args.out)
    path = out / "scale.json"
    merge = path.exists() and (args.rows or args.only)
    results = json.loads(path.read_text()) if merge else {}
    parts = {args.only} if args.only else {"axonn", "gspmd"}
    for name in args.rows or ROWS:
        results[name] = run_row(name, ROWS[name], parts, args.timeout, results.get(name))
        ordered = {n: results[n] for n in ROWS if n in results}
        path.write_text(json.dumps(ordered, indent=1) + "\n")
        (out / "scale.md").write_text(markdown(ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
