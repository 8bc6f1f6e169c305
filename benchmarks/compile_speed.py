"""Deviceless H100 compile time with and without `targets.COMPILE_ONLY_OPTIONS` (no autotuning).

    python benchmarks/compile_speed.py [--repeats 3]

Each case is `axonn-jax compile --target h100 ... --json` in a fresh process; "XLA defaults"
runs the same command with `analysis.compiled.compile_options` replaced by one that passes no
options. The two alternate, `--repeats` times each; the table gives the medians of the
report's `compile_s` (XLA's compile, not lowering) and their ratio, and whether the two optimized
modules have the same instructions (`analysis.hlo_module.program_lines`). Writes
`results/compile_speed.md`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = {
    "gpt-tiny, 1 H100": ["--model", "gpt-tiny", "--devices", "1", "--batch-size", "8",
                         "--seq-len", "64", "--dtype", "bfloat16"],
    "gpt-tiny, data 2 × row 2, remat selective": [
        "--model", "gpt-tiny", "--devices", "4", "--dp", "2", "--row", "2", "--batch-size", "8",
        "--seq-len", "64", "--dtype", "bfloat16", "--remat", "selective"],
    "llama3-8b, 64 H100s, data 8 × depth 8, remat full": [
        "--model", "llama3-8b", "--devices", "64", "--dp", "8", "--depth", "8", "--batch-size",
        "64", "--seq-len", "4096", "--dtype", "bfloat16", "--remat", "full"],
}


def _child(without: bool, flags: list[str]) -> int:
    """Run the compile command in this process (`without`: no compile-only options)."""
    from axonn_jax.analysis import compiled
    from axonn_jax.run.cli import main

    if without:
        compiled.compile_options = lambda device: None
    return main(["compile", "--target", "h100", *flags, "--json"])


def _run(without: bool, flags: list[str], dump: str) -> float:
    """One fresh process's `compile_s`; its module goes to `dump`."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, __file__, "--child", *(["--without"] if without else []),
                          "--", *flags, "--dump-hlo", dump], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)[0]["compile_s"]


def measure(flags: list[str], repeats: int) -> dict:
    """Median compile seconds of both variants and whether their modules agree."""
    from axonn_jax.analysis.hlo_module import program_lines

    times = {"defaults": [], "compile-only": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for name, without in (("defaults", True), ("compile-only", False)):
                times[name].append(_run(without, flags, f"{tmp}/{name}"))
        texts = [next(pathlib.Path(f"{tmp}/{n}").glob("*.txt")).read_text() for n in times]
    same = program_lines(texts[0]) == program_lines(texts[1])
    return {k: statistics.median(v) for k, v in times.items()} | {"same_program": same}


def main() -> int:
    if "--child" in sys.argv:
        return _child("--without" in sys.argv, sys.argv[sys.argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the parent only reads the modules
    import jax

    lines = ["# Deviceless H100 compile time: XLA's defaults against no autotuning", "",
             f"`python benchmarks/compile_speed.py --repeats {args.repeats}` (jaxlib "
             f"{jax.__version__}, this 2-core CPU machine, no GPU). Median `compile_s` of "
             f"{args.repeats} alternating fresh processes each; same program: the optimized "
             "modules' instructions are equal (metadata and the fusions' empty backend configs "
             "aside).", "",
             "| case | XLA defaults s | no autotuning s | ratio | same program |",
             "|---|---|---|---|---|"]
    for name, flags in CASES.items():
        r = measure(flags, args.repeats)
        lines.append(f"| {name} | {r['defaults']:.1f} | {r['compile-only']:.1f} | "
                     f"{r['compile-only'] / r['defaults']:.2f}× | {'yes' if r['same_program'] else 'no'} |")
        print(lines[-1], flush=True)
    (REPO / "benchmarks" / "results" / "compile_speed.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
