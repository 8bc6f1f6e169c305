"""The overlap table: how much of each collective's time the compiled H100 schedule hides.

    JAX_PLATFORMS=cpu python benchmarks/overlap.py [--variant NAME ...] [--out benchmarks/results]

Compiles the project's train step for 8 abstract H100s (no GPU: `analysis.targets`) for a 1.9B
Llama (`llama-1.9b`: hidden 4096, 8 layers; sequence 4096, global batch 16, bf16, cuDNN attention,
full recompute) on the grids of issue 25, and replays each schedule (`analysis.overlap`): per mesh
axis and collective kind, the wire bytes, the share of them with matmul compute scheduled between
start and done, and the share of the communication time hidden. Each variant is a set of step
`--xla-options` choice (`VARIANTS`); the table puts them side by side ("before → after").
Writes overlap.md and overlap.json (merged with the variants already there).

One row is `axonn-jax compile --target h100 --devices 8 --model llama-1.9b --seq-len 4096
--batch-size 16 --dtype bfloat16 --attention cudnn --remat full <grid> --xla-options <variant>
--overlap-report`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

SCALE = "llama3-70b/256 data=4,depth=16,row=2,col=2"
SCALE_DEEP = "llama3-70b/256 data=4,depth=32,row=2"
CASES = {  # name: compile flags of the grid (batch 16, seq 4096 unless the case says otherwise)
    "data=8": ["--dp", "8"],
    "data=2,pipe=2,row=2 1F1B": ["--dp", "2", "--pipe", "2", "--row", "2", "--microbatches", "4",
                                 "--schedule", "1f1b"],
    "data=2,pipe=2,row=2 ZB-H1": ["--dp", "2", "--pipe", "2", "--row", "2", "--microbatches", "4",
                                  "--schedule", "zb-h1"],
    "data=2,row=2,col=2": ["--dp", "2", "--row", "2", "--col", "2"],
    "depth=2,row=2,col=2": ["--dp", "1", "--depth", "2", "--row", "2", "--col", "2"],
    # At scale: Llama-3-70B on 256 H100s, the published run's batch (1,024 × 4,096), the grid
    # `plan` picked before its shares came from this case (`analysis.hidden_shares`).
    SCALE: ["--model", "llama3-70b", "--devices", "256", "--batch-size", "1024", "--dp", "4",
            "--depth", "16", "--row", "2", "--col", "2"],
    # The grid `plan` ranked first once the shares came from SCALE alone: its depth gathers,
    # twice SCALE's bytes, hide the same time, so less than half of theirs.
    SCALE_DEEP: ["--model", "llama3-70b", "--devices", "256", "--batch-size", "1024", "--dp", "4",
                 "--depth", "32", "--row", "2"],
}

VARIANTS = {  # name: `--xla-options` (step/xla_options.py)
    "xla": "xla",  # XLA's defaults: before
    "library": "library",  # the library's GPU options (measured at 4b862ac, before `after`)
    # The library's options and the step's data-parallel gradients summed layer by layer in the
    # backward (`SpmdEngine.layer_reduce`); only data=8 and data=2,row=2,col=2 change (the
    # pipeline engine and grids without a data axis do not reduce per layer).
    "after": "library",
    # `after` with the row gathers whole (`--collective-matmul off`): the shares `plan` takes for
    # a step without collective matmuls (mode `spmd-gathers`).
    "gathers": "library --collective-matmul off",
}

MODEL = ["--target", "h100", "--devices", "8", "--model", "llama-1.9b", "--batch-size", "16",
         "--seq-len", "4096", "--dtype", "bfloat16", "--attention", "cudnn", "--remat", "full"]
"""The 1.9B cases' flags; a case's own flags come after them and override them (the last of a
flag given twice wins)."""


def compile_case(name: str, variant: str) -> dict:
    """`axonn-jax compile ... --overlap-report --json` of one case and variant: its report."""
    import contextlib
    import io

    from axonn_jax.run.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["compile", *MODEL, *CASES[name], "--xla-options", *VARIANTS[variant].split(),
                         "--overlap-report", "--json"])
    if code:
        raise SystemExit(f"compile of {name} ({variant}) failed: exit code {code}")
    (report,) = json.loads(out.getvalue())
    return {"case": name, "variant": variant, "memory_gb": report["memory_per_device_bytes"] / 1e9,
            "compile_s": report["compile_s"], **report["overlap"]}


def markdown(results: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    by = {(r["case"], r["variant"]): r for r in results}
    lines = ["# Overlap in the compiled H100 schedule", "",
             "8 abstract H100 SXM (one DGX node), the project's train step for a 1.9B Llama "
             "(`llama-1.9b`: hidden 4096, 8 layers, sequence 4096, global batch 16, bf16, cuDNN "
             "attention, full recompute) and, in the last case, Llama-3-70B on 256 abstract "
             "H100s (batch 1,024 × 4,096), compiled without a GPU and its schedule replayed "
             "(`axonn_jax.analysis.overlap`: one compute stream at the H100's published rates, "
             "one communication stream at NVLink's). **with compute**: share of the collective "
             "bytes whose start…done window holds matmul compute; **hidden**: share of the "
             "communication time not waited for. Variants: " +
             "; ".join(f"`{v}` ({VARIANTS[v]})" for v in variants) + ".", "",
             "Reproduce: `JAX_PLATFORMS=cpu python benchmarks/overlap.py --variant "
             + " --variant ".join(variants) + "`. The XLA options measured one by one, the "
             "step's changes and `plan` before/after: `overlap_notes.md`.", ""]
    head = "| grid | collectives | GB | " + " | ".join(
        f"with compute ({v}) | hidden ({v})" for v in variants) + " |"
    lines += [head, "|" + "---|" * (3 + 2 * len(variants))]
    for case in CASES:
        rows = [by[(case, v)] for v in variants if (case, v) in by]
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r["by_axes"]))
        for key in [*keys, "all"]:
            cells = []
            gb = None
            for v in variants:
                r = by.get((case, v))
                row = None if r is None else (r["total"] if key == "all" else r["by_axes"].get(key))
                if row is None:
                    cells += ["-", "-"]
                    continue
                gb = gb or row["bytes"] / 1e9
                cells += [f"{row['with_compute']:.0%}", f"{row['hidden']:.0%}"]
            label = f"**{case}**" if key == "all" else case
            lines.append(f"| {label} | {key} | {gb or 0:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Step time of the replayed schedule (ms): matmul kernels / other kernels / "
              "waits for communication / total.", "",
              "| grid | " + " | ".join(variants) + " |", "|" + "---|" * (1 + len(variants))]
    for case in CASES:
        cells = []
        for v in variants:
            r = by.get((case, v))
            cells.append("-" if r is None else
                         f"{r['matmul_s'] * 1e3:.0f} / {r['other_s'] * 1e3:.0f} / "
                         f"{r['exposed_comm_s'] * 1e3:.1f} / {r['step_s'] * 1e3:.0f}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SHARE_CASES = {  # hidden_shares.SHARES: mode -> [(case, axes taken from it)]
    "spmd": [(SCALE, ("data", "depth", "row", "col")), (SCALE_DEEP, ("data", "depth", "row"))],
    "spmd-gathers": [(SCALE, ("data", "depth", "row", "col")),
                     (SCALE_DEEP, ("data", "depth", "row"))],
    "1f1b": [("data=2,pipe=2,row=2 1F1B", ("data", "pipe", "row"))],
    "zb-h1": [("data=2,pipe=2,row=2 ZB-H1", ("data", "pipe", "row"))],
}


MODE_VARIANTS = {"spmd-gathers": ("gathers",)}
"""The variant a mode's shares come from, where not the default (`after`, else `library`)."""


def shares(results: list[dict], variants=("after", "library")) -> dict[str, dict[str, float]]:
    """`axonn_jax.analysis.hidden_shares.SHARES` from the first of `variants` measured per case;
    an axis several cases of a mode measure takes the smallest share (`plan` must not promise
    more than any measured grid hides)."""
    from axonn_jax.analysis.hidden_shares import axis_shares

    by = {(r["case"], r["variant"]): r for r in results}
    out: dict[str, dict[str, float]] = {}
    for mode, picks in SHARE_CASES.items():
        for case, axes in picks:
            variant = next((v for v in MODE_VARIANTS.get(mode, variants) if (case, v) in by), None)
            if variant is not None:
                measured = axis_shares(by[(case, variant)]["by_axes"])
                got = out.setdefault(mode, {})
                got.update({a: min(measured[a], got.get(a, 1.0)) for a in axes if a in measured})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    p.add_argument("--case", action="append", choices=sorted(CASES))
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from axonn_jax.mesh import use_cpu_platform

    use_cpu_platform()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "overlap.json"
    results = json.loads(path.read_text()) if path.exists() else []
    for variant in args.variant or list(VARIANTS):
        for case in args.case or list(CASES):
            t0 = time.perf_counter()
            r = compile_case(case, variant)
            print(f"{variant:>10} {case:>28}: hidden {r['total']['hidden']:.0%}, with compute "
                  f"{r['total']['with_compute']:.0%} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
            results = [x for x in results if (x["case"], x["variant"]) != (case, variant)]
            results.append(r)
            path.write_text(json.dumps(results, indent=1))
    (out / "overlap.md").write_text(markdown(results))
    print(f"hidden_shares.SHARES = {shares(results)}")
    print(f"wrote {path} and {out / 'overlap.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
