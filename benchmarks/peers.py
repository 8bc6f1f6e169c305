"""MaxText's train step beside axonn_jax's, both compiled for the same abstract H100s.

    benchmarks/make_peer_venv.sh            # once: .peers-venv (Python 3.12, MaxText 0.2.5)
    .peers-venv/bin/python benchmarks/peers.py [--rows NAME ...] [--out benchmarks/results]

For each row (a Llama-3 model, a device count, a global batch of sequences) this compiles, one
process per compile, MaxText 0.2.5's `train_step` (through its own `train_compile` functions, called
as a library: config, abstract state, shardings, jit) and axonn_jax's (`axonn-jax compile`) for the
same compile-only H100 SXM devices in nodes of 8 (`analysis.targets.h100_devices`; no GPU is used,
XLA compiles real sm_90 executables). Both sides: bf16 compute, fp32 master parameters, AdamW,
gradient clipping at 1.0, cuDNN flash attention, one jaxlib. Per device it reports:

- the compiled peak memory (`memory_analysis()`, as `analysis.compiled.memory` reads it);
- collective wire bytes by kind and by mesh axes (`analysis.compiled.communication`: this repo's
  HLO reader, loop bodies × trip count);
- FLOPs (`analysis.hlo.flops`, loops × trip count: XLA's `cost_analysis()` returns None for
  these compile-only GPU executables);
- the schedule replayed on DGX H100 nodes (`analysis.overlap.report` on `h100-dgx`): step time,
  exposed communication, and MFU against the model's training FLOPs.

Writes peers.json and peers.md; `--rows` re-runs the named rows and keeps the others.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
MACHINE = "h100-dgx"
CAPACITY = 80e9  # what `axonn-jax compile` checks a step's peak against (targets.H100_CAPACITY_BYTES)


@dataclasses.dataclass(frozen=True)
class Row:
    """A model (axonn_jax preset, MaxText model_name), devices, global batch × sequence length,
    and the grids each side compiles: MaxText config keys, axonn_jax `compile` flags."""

    model: str
    maxtext_model: str
    devices: int
    batch: int
    seq: int
    maxtext: dict
    axonn: dict


RECIPE = "configs/gpu/a3/llama_2_7b/8vm.sh"
"""MaxText's own multi-node H100 (A3) recipe, inside its package: its XLA_FLAGS are what a
`recipe` grid compiles with (read from the installed file, less the dump directory)."""


def _mt(data: int, fsdp: int, tensor: int = 1, remat: str = "minimal_with_context",
        recipe: bool = False) -> dict:
    """MaxText mesh keys: data over nodes (DCN), fsdp (and tensor) within a node (ICI), fsdp
    spilling over nodes when it is larger than a node's 8 GPUs; `recipe`: with `RECIPE`'s
    XLA_FLAGS (else XLA's defaults)."""
    ici_fsdp = min(fsdp, 8 // tensor)
    return {"dcn_data_parallelism": data, "dcn_fsdp_parallelism": fsdp // ici_fsdp,
            "ici_fsdp_parallelism": ici_fsdp, "ici_tensor_parallelism": tensor,
            "remat_policy": remat, "_recipe_flags": recipe}


def recipe_flags() -> str:
    """The XLA_FLAGS of MaxText's `RECIPE`, without `--xla_dump_to`."""
    import re

    import maxtext

    text = (pathlib.Path(maxtext.__file__).parent / RECIPE).read_text()
    flags = re.search(r'XLA_FLAGS="([^"]*)"', text).group(1).split()
    return " ".join(f for f in flags if not f.startswith("--xla_dump_to"))


AXONN_COMMON = ("--dtype", "bfloat16", "--reduce-dtype", "bfloat16")

ROWS = {
    "llama3-8b/64": Row("llama3-8b", "llama3-8b", 64, 64, 4096, maxtext={
        "data 8 × fsdp 8, minimal_with_context": _mt(8, 8),
        "data 8 × fsdp 4 × tensor 2, minimal_with_context": _mt(8, 4, 2),
        "data 8 × fsdp 8, minimal_with_context, A3 recipe XLA flags": _mt(8, 8, recipe=True),
        "data 8 × fsdp 4 × tensor 2, minimal_with_context, A3 recipe XLA flags":
            _mt(8, 4, 2, recipe=True),
    }, axonn={
        "data 8 × depth 8, selective": ("--dp", "8", "--depth", "8", "--remat", "selective"),
        "data 8 × depth 8, selective, fp32 gradient exchange": (
            "--dp", "8", "--depth", "8", "--remat", "selective", "--reduce-dtype", "float32"),
        "plan's pick": ("--top", "1"),
    }),
    "llama3-70b/256": Row("llama3-70b", "llama3-70b", 256, 256, 4096, maxtext={
        "data 8 × fsdp 32, full": _mt(8, 32, remat="full"),
        "data 8 × fsdp 16 × tensor 2, full": _mt(8, 16, 2, remat="full"),
        "data 8 × fsdp 32, full, A3 recipe XLA flags": _mt(8, 32, remat="full", recipe=True),
        "data 8 × fsdp 16 × tensor 2, full, A3 recipe XLA flags":
            _mt(8, 16, 2, remat="full", recipe=True),
    }, axonn={
        "data 8 × depth 8 × row 4, selective": ("--dp", "8", "--depth", "8", "--row", "4",
                                                "--remat", "selective"),
        "data 8 × depth 8 × row 4, full": ("--dp", "8", "--depth", "8", "--row", "4",
                                           "--remat", "full"),
        "data 8 × depth 32, full": ("--dp", "8", "--depth", "32", "--remat", "full"),
        "plan's pick": ("--top", "1"),
    }),
}


# ---------------------------------------------------------------- MaxText (child process)

def maxtext_settings(row: Row, grid: dict) -> dict:
    """MaxText config overrides of one compile (on top of its base.yml)."""
    return {"model_name": row.maxtext_model, "hardware": "gpu", "run_name": "peers",
            "base_output_directory": "/tmp/peers-maxtext", "dataset_type": "synthetic",
            "enable_checkpointing": False, "skip_jax_distributed_system": True,
            "per_device_batch_size": row.batch / row.devices, "max_target_length": row.seq,
            "attention": "cudnn_flash_jax", "use_iota_embed": True,
            "dtype": "bfloat16", "weight_dtype": "float32", "opt_type": "adamw",
            "gradient_clipping_threshold": 1.0,
            "compile_topology": "a3", "compile_topology_num_slices": row.devices // 8,
            **{k: v for k, v in grid.items() if not k.startswith("_")}}


def compile_maxtext(row: Row, grid: dict) -> tuple[object, dict, str | None]:
    """(compiled MaxText train step, {axis: size} of its mesh, `node_order_problem`) for `row`'s
    abstract H100s, by MaxText's `train_compile` functions (on `hybrid_mesh`)."""
    import jax
    from flax.core.spmd import logical_axis_rules
    from jax.sharding import AxisType, Mesh
    import maxtext
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile as tc
    from maxtext.utils import maxtext_utils, sharding

    from axonn_jax.analysis import targets

    register_custom_partitioning()
    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    config = pyconfig.initialize([None, str(base)] + [f"{k}={v}" for k, v in
                                                      maxtext_settings(row, grid).items()])
    jax.config.update("jax_remove_size_one_mesh_axis_from_type",
                      config.remove_size_one_mesh_axis_from_type)
    devices = hybrid_mesh(config, targets.h100_devices(row.devices))
    mesh = Mesh(devices, config.mesh_axes, axis_types=(AxisType.Auto,) * len(config.mesh_axes))
    args, kwargs, state_shardings, _, model = tc.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings,
                                                               params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, in_state, model, config, params_shardings)
    compiled = tc.jit_and_compile(func, args, kwargs, mesh, in_shard, out_shard, static, donate,
                                  config, logical_axis_rules(config.logical_axis_rules))
    return compiled, dict(mesh.shape), node_order_problem(mesh.devices)


def register_custom_partitioning() -> None:
    """Register JAX's `custom_partitioning` callbacks (MaxText's cuDNN attention uses them) with the
    CUDA plugin. JAX hands them to the plugins it finds at start-up; the compile-only plugin is
    registered later (`analysis.targets.load_cuda_plugin`), so they are handed over here."""
    from jax._src import custom_partitioning, xla_bridge as xb

    from axonn_jax.analysis import targets

    targets.load_cuda_plugin()
    c_api = xb._backend_factories["cuda"].c_api
    for callback in xb._plugin_callbacks:
        if getattr(callback, "keywords", {}).get("name") == \
                custom_partitioning._CUSTOM_PARTITIONING_CALL_NAME:
            callback(c_api=c_api)


def hybrid_mesh(config, devices):
    """The device array of MaxText's multi-node mesh (`create_device_mesh`'s DCN × ICI layout) over
    compile-only devices. MaxText groups devices into nodes by `slice_index`, which is 0 on every
    compile-only device; `process_index` is the node there, as in a multi-process GPU job."""
    from jax.experimental import mesh_utils
    from maxtext.utils import max_utils

    nodes = len(devices) // 8
    ici = max_utils.fill_unspecified_mesh_axes(list(config.ici_parallelism), 8, "ICI")
    dcn = max_utils.fill_unspecified_mesh_axes(list(config.dcn_parallelism), nodes, "DCN")
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)


def node_order_problem(mesh_devices) -> str | None:
    """Why the replay's nodes (mesh positions // 8) are not the devices' nodes (ids // 8), if so."""
    ids = [d.id for d in mesh_devices.flat]
    bad = sum(i // 8 != pos // 8 for pos, i in enumerate(ids))
    return f"{bad} of {len(ids)} mesh positions lie in another node than the replay assumes" \
        if bad else None


def maxtext_child(name: str, label: str) -> dict:
    """Compile one MaxText grid and measure it (runs in its own process)."""
    from axonn_jax.analysis import comm_model, compiled as cc, hlo, overlap

    row = ROWS[name]
    flags = recipe_flags() if row.maxtext[label]["_recipe_flags"] else ""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    t0 = time.perf_counter()
    compiled, mesh_shape, node_problem = compile_maxtext(row, row.maxtext[label])
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    mem = cc.memory(compiled)
    kinds, axes = cc.communication(text, mesh_shape)
    schedule = overlap.report(text, mesh_shape, comm_model.MACHINES[MACHINE]).as_dict()
    return {"grid": {k: v for k, v in mesh_shape.items() if v > 1},
            "settings": maxtext_settings(row, row.maxtext[label]),
            "memory_per_device_bytes": mem["peak"], "memory_breakdown": mem["breakdown"],
            "comm_bytes_per_device": kinds, "comm_bytes_by_axes": axes,
            "flops_per_device": hlo.flops(text),
            "overlap": schedule, "node_order_problem": node_problem, "xla_flags": flags,
            "compile_s": compile_s}


# ---------------------------------------------------------------- both sides (parent process)

def _child(args: list[str], timeout: float) -> tuple[object | None, str | None, float]:
    """(JSON the child printed last, error line, wall seconds) of a child process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {timeout:.0f} s", time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if (got := _last_json(out.stdout)) is not None:  # `compile` exits 1 when a step won't fit
        return got, None, wall
    if out.returncode < 0:
        return None, f"killed by signal {-out.returncode} (out of memory?)", wall
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(("W", "I0"))]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return None, (errors or lines or ["?"])[-1][:400], wall


def _last_json(stdout: str):
    """The JSON document that ends `stdout` (MaxText prints its own lines before it)."""
    lines = stdout.rstrip().splitlines()
    for i in reversed(range(len(lines))):
        if lines[i].startswith(("[", "{")):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    return None


def run_maxtext(name: str, label: str, timeout: float) -> dict:
    """MaxText grid `label` of row `name`, compiled and measured in a child process."""
    got, error, wall = _child([sys.executable, __file__, "--child", name, label], timeout)
    return {"side": "maxtext", "label": label, "wall_s": wall, "error": error, **(got or {})}


def axonn_command(row: Row, flags: tuple) -> list[str]:
    """The `axonn-jax` arguments that compile `row` with grid `flags` and replay it."""
    return ["compile", "--target", "h100", "--model", row.model, "--devices", str(row.devices),
            "--batch-size", str(row.batch), "--seq-len", str(row.seq), *AXONN_COMMON, *flags,
            "--overlap-report", "--json"]


def run_axonn(name: str, label: str, timeout: float) -> dict:
    """axonn_jax grid `label` of row `name`: `axonn-jax compile --overlap-report --json` in a
    child process; its report's figures."""
    row = ROWS[name]
    cmd = axonn_command(row, row.axonn[label])
    got, error, wall = _child([sys.executable, "-m", "axonn_jax", *cmd], timeout)
    out = {"side": "axonn_jax", "label": label, "wall_s": wall, "error": error,
           "command": "axonn-jax " + " ".join(cmd)}
    if got:
        r = got[0]
        out.update({k: r[k] for k in ("memory_per_device_bytes", "memory_breakdown",
                                      "comm_bytes_per_device", "comm_bytes_by_axes",
                                      "flops_per_device", "model_flops_per_device", "overlap",
                                      "compile_s", "remat", "microbatches")})
        out["grid"] = {k: v for k, v in r["grid"].items() if v > 1}
    return out


def run_row(name: str, timeout: float) -> list[dict]:
    """Every grid of both sides of row `name`, each compiled in its own process."""
    results = []
    for side, labels, run in (("axonn_jax", ROWS[name].axonn, run_axonn),
                              ("maxtext", ROWS[name].maxtext, run_maxtext)):
        for label in labels:
            r = run(name, label, timeout)
            print(f"{name} {side} {label}: {r['error'] or 'compiled'} ({r['wall_s']:.0f} s)",
                  flush=True)
            results.append(r)
    model_flops = next((r["model_flops_per_device"] for r in results
                        if r.get("model_flops_per_device")), None)
    for r in results:
        r["model_flops_per_device"] = model_flops
    return results


# ---------------------------------------------------------------- report

def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _cells(r: dict, peak: float) -> list[str]:
    if r.get("error"):
        return [f"failed: {r['error'][:160]}"] + [""] * 6
    c, o = r["comm_bytes_per_device"], r["overlap"]
    fits = "" if r["memory_per_device_bytes"] <= CAPACITY else " (**over 80 GB**)"
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
    comm = " / ".join(_gb(c.get(k, 0.0)) for k in kinds)
    mfu = f"{r['model_flops_per_device'] / o['step_s'] / peak:.1%}" \
        if r.get("model_flops_per_device") else "–"
    flops = f"{r['flops_per_device'] / 1e12:.0f}"
    return [_gb(r["memory_per_device_bytes"]) + fits, comm, flops, f"{o['step_s']:.3f}",
            f"{o['exposed_comm_s']:.3f}", mfu, f"{r['wall_s']:.0f}"]


def markdown(results: dict, meta: dict) -> str:
    """peers.md from peers.json's `results` and `meta`."""
    from axonn_jax.analysis import comm_model

    peak = comm_model.MACHINES[MACHINE].peak_flops
    head = ["side", "grid", "peak memory GB", "AG / RS / AR / A2A / permute GB", "TFLOPs",
            "replayed step s", "exposed comm s", "MFU (replayed)", "compile wall s"]
    out = ["# MaxText vs axonn_jax: the same Llama-3 steps compiled for abstract H100s", "",
           f"{meta['date']}, jax/jaxlib {meta['jaxlib']} (both sides), MaxText {meta['maxtext']}. "
           "**No GPU was used**: each step is compiled for compile-only H100 SXM devices in nodes "
           "of 8 (`analysis.targets.h100_devices`, the CUDA plugin's deviceless topology) and its "
           f"schedule replayed on `{MACHINE}` (`analysis.overlap.report`). Per device, one step, "
           "GB = 1e9 bytes. Collectives: wire bytes per device by kind (this repo's HLO reader, "
           "loops × trip count). TFLOPs: the compiled module's (`analysis.hlo.flops`). MFU: the "
           "model's training FLOPs (6·N·tokens + attention, axonn_jax's count, the same for "
           "both sides) over the replayed step at the H100's dense bf16 peak.", "",
           f"Command: `{meta['command']}`", ""]
    for name, rows in results.items():
        row = ROWS[name]
        out += [f"## {name}: global batch {row.batch} × {row.seq} tokens on {row.devices} H100s "
                f"({row.devices // 8} nodes × 8)", "",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            out.append(f"| {r['side']} | {r['label']}{_grid_note(r)} | "
                       + " | ".join(_cells(r, peak)) + " |")
        out.append("")
    out += ["## Collectives by mesh axes (GB per device, replayed exposed seconds)", ""]
    for name, rows in results.items():
        out += [f"- **{name}**"] + [f"  - {r['side']}, {r['label']}: {_by_axes(r)}"
                                    for r in rows if not r.get("error")]
    out += ["", "## How the two sides were compiled", "", *NOTES, ""]
    return "\n".join(out)


def _by_axes(r: dict) -> str:
    cells = [f"{key} {_gb(v['bytes'])} ({v['exposed_s']:.3f} s)"
             for key, v in r["overlap"]["by_axes"].items() if v["bytes"] >= 1e7]
    return "; ".join(cells) or "none"


NOTES = [
    "- **MaxText** 0.2.5, called as a library: `pyconfig.initialize` over its `base.yml` with "
    "`model_name`, `per_device_batch_size` = batch / devices, `max_target_length`, "
    "`attention=cudnn_flash_jax` (cuDNN flash attention through JAX; the GPU recipes' "
    "`cudnn_flash_te` needs Transformer Engine, not installed), `dtype=bfloat16`, "
    "`weight_dtype=float32`, `opt_type=adamw`, `gradient_clipping_threshold=1.0`, "
    "`use_iota_embed=true` (as its GPU model configs), `dataset_type=synthetic`, "
    "`compile_topology=a3` with one slice per node of 8 (so that `num_slices` makes the "
    "data axis DCN, across nodes), and each grid's `dcn_*`/`ici_*` parallelism and "
    "`remat_policy` (peers.json `settings`). Then `train_compile.get_shaped_inputs`, "
    "`sharding.maybe_update_params_sharding_with_opt`, "
    "`maxtext_utils.get_functional_train_with_signature(train.train_step, ...)` and "
    "`train_compile.jit_and_compile`, as its `train_compile.main` does. Two things done "
    "here: the device mesh is `jax.experimental.mesh_utils.create_hybrid_device_mesh(..., "
    "process_is_granule=True)` with MaxText's ICI/DCN lists (compile-only devices have "
    "`slice_index` 0, `process_index` = node; every row checks that mesh positions // 8 are the "
    "devices' nodes, as the replay assumes: `node_order_problem` in peers.json), and JAX's "
    "`custom_partitioning` callbacks are handed to the compile-only CUDA plugin (registered "
    "after JAX's plugin discovery), without which cuDNN attention does not compile.",
    "- **XLA flags**: axonn_jax compiles with its own options (`step/xla_options.py`: "
    "pipelined all-gathers and all-reduces, per-weight reduce-scatters, a scheduler memory "
    "limit). MaxText rows compile with XLA's defaults, and the *A3 recipe* rows with the "
    f"XLA_FLAGS of MaxText's own multi-node H100 recipe (`maxtext/{RECIPE}`, read from the "
    "installed package, `--xla_dump_to` dropped).",
    "- **Gradient exchange over data**: both sides send bf16 gradients over data. MaxText: one "
    "bf16 all-reduce (XLA sums the bf16 gradients before they become the fp32 parameters' "
    "`grad_dtype`); axonn_jax's main rows: `--reduce-dtype bfloat16`, an all-to-all and an "
    "all-gather of bf16 pieces summed in fp32, the same wire bytes. The *fp32 gradient "
    "exchange* row is axonn_jax's default (`--reduce-dtype float32`): twice those bytes.",
    "- **Remat**: each side's own policies (axonn_jax `selective`/`full`, MaxText "
    "`minimal_with_context`/`full`); FLOPs differ by what each recomputes.",
    "- **Pipelines** (`plan`'s pick where it has `pipe`): the replay runs every `lax.cond`'s "
    "heavier branch on every tick, bubble included, so its step time is an upper bound "
    "(benchmarks/results/scale.md).",
    "- **Replay**: `analysis.overlap.report(hlo, {axis: size}, MACHINES['h100-dgx'])` on both "
    "sides' compiled HLO: one compute stream and a communication stream per kind of link "
    "(NVLink inside a node, the NICs across nodes: collectives in flight together on different "
    "links run at once, on the same links one after the other), the machine's published rates; "
    "a collective whose group spans nodes runs at the NIC rate. Not a measurement.",
]


def _grid_note(r: dict) -> str:
    """The compiled grid of a row whose label does not give it (`plan`'s pick)."""
    if not r.get("grid") or not r["label"].startswith("plan"):
        return ""
    micro = f", {r['microbatches']} microbatches" if r.get("microbatches", 1) > 1 else ""
    return " (" + " × ".join(f"{k} {v}" for k, v in r["grid"].items()) + \
        f", remat {r.get('remat')}{micro})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help=f"any of: {', '.join(ROWS)}")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per compile")
    p.add_argument("--md-only", action="store_true", help="rewrite peers.md from peers.json")
    p.add_argument("--child", nargs=2, metavar=("ROW", "GRID"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(maxtext_child(*args.child)))
        return 0
    path = pathlib.Path(args.out) / "peers.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    results, meta = saved.get("results", {}), saved.get("meta", {})
    if not args.md_only:
        import importlib.metadata as md
        import jaxlib
        meta.update(date=datetime.date.today().isoformat(), jaxlib=jaxlib.__version__,
                    maxtext=md.version("maxtext"),
                    command=".peers-venv/bin/python benchmarks/peers.py")
        for name in args.rows or ROWS:
            results[name] = run_row(name, args.timeout)
            path.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (path.parent / "peers.md").write_text(markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
