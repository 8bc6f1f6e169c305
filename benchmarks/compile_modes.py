"""Every mode of the train step compiled for 16 abstract H100s, on tiny models (`axonn-jax
compile`, one process per configuration so that a compiler abort stays one row):

    python benchmarks/compile_modes.py [--devices 16] [--out benchmarks/results]

writes compile_modes.json and compile_modes.md: per configuration, whether it compiled, the
memory and host memory per device, collective bytes, the cuDNN attention calls and host (`S(5)`)
buffers found in the compiled module, and the compile time. A user's `StackedModel` (the
ViT of tests/user_models.py, whose head picks labels with `take_along_axis`) is compiled through
the library API (`analysis.compiled.compile_step`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

TOKENS = ["--batch-size", "16", "--seq-len", "64"]
CONFIGS = {
    # name: (modes, arguments)
    "gpt data": ("data, fp32", ["--model", "gpt-tiny", *TOKENS]),
    "gpt 3D fp16 remat offload": (
        "data, depth, row, col; fp16; remat offload",
        ["--model", "gpt-tiny", *TOKENS, "--dp", "2", "--depth", "2", "--row", "2", "--col", "2",
         "--dtype", "float16", "--remat", "offload"]),
    "gpt interleaved remat full": (
        "pipe (interleaved-1f1b, V=2), row; bf16; remat full",
        ["--model", "gpt-tiny-deep", *TOKENS, "--dp", "2", "--pipe", "4", "--row", "2",
         "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "4",
         "--dtype", "bfloat16", "--remat", "full"]),
    "gpt remat auto": ("data; bf16; remat auto (KARMA planner, H100 spec)",
                       ["--model", "gpt-tiny", *TOKENS, "--dtype", "bfloat16", "--remat", "auto",
                        "--memory-budget", "0.01"]),
    "llama gpipe CGX": ("data, pipe (gpipe), col; fp32; CGX 4 bits",
                        ["--model", "llama-tiny", *TOKENS, "--dp", "4", "--pipe", "2", "--col",
                         "2", "--schedule", "gpipe", "--microbatches", "2",
                         "--compress-bits", "4"]),
    "llama 1f1b cuDNN offload": (
        "data, pipe (1f1b), row, col; bf16; cuDNN (GQA); optimizer offload; CGX 8 bits",
        ["--model", "llama-tiny", *TOKENS, "--dp", "2", "--pipe", "2", "--row", "2", "--col",
         "2", "--schedule", "1f1b", "--microbatches", "2", "--dtype", "bfloat16", "--attention",
         "cudnn", "--offload-optimizer", "--compress-bits", "8"]),
    "llama zb-h1 depth cuDNN": (
        "data, pipe (zb-h1), depth, row; bf16; cuDNN (GQA)",
        ["--model", "llama-tiny", *TOKENS, "--dp", "2", "--pipe", "2", "--depth", "2", "--row",
         "2", "--schedule", "zb-h1", "--microbatches", "2", "--dtype", "bfloat16", "--attention",
         "cudnn"]),
    "llama MQA cuDNN 3D": ("data, depth, row, col; bf16; cuDNN (one key/value head)",
                           ["--model", "llama-tiny-mqa", *TOKENS, "--dp", "2", "--depth", "2",
                            "--row", "2", "--col", "2", "--dtype", "bfloat16", "--attention",
                            "cudnn"]),
    "llama selective accumulation": (
        "data, depth, row, col; bf16; cuDNN; remat selective; 2 accumulated microbatches",
        ["--model", "llama-tiny", *TOKENS, "--dp", "2", "--depth", "2", "--row", "2", "--col",
         "2", "--dtype", "bfloat16", "--attention", "cudnn", "--remat", "selective",
         "--microbatches", "2"]),
    "unet": ("data, row, col; bf16", ["--model", "unet-tiny", "--batch-size", "16", "--dp", "4",
                                      "--row", "2", "--col", "2", "--dtype", "bfloat16"]),
    "resnet": ("data, pipe (1f1b); fp32", ["--model", "resnet-tiny", "--batch-size", "16",
                                           "--dp", "8", "--pipe", "2", "--schedule", "1f1b",
                                           "--microbatches", "2"]),
}

USER_MODEL = """
import json, sys, time
sys.path.insert(0, {tests!r})
from axonn_jax.mesh import use_cpu_platform
use_cpu_platform()
import optax, jax, jax.numpy as jnp
import user_models as um
from axonn_jax import ParallelConfig, make_mesh, make_train_step
from axonn_jax.analysis import compiled, targets
grid = ParallelConfig(data=2, pipe=2, depth=2, row=2)
mesh = make_mesh(grid, targets.h100_devices({devices}))
step = make_train_step(um.vit(take=True), optax.adamw(1e-3), mesh, microbatches=2,
                       schedule="gpipe", dtype="bfloat16", offload_optimizer=True)
batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), um.image_batches(16)(0))
report, exe = compiled.compile_step(step, batch, capacity_bytes=targets.H100_CAPACITY_BYTES,
                                    dump_hlo={hlo!r})
print(json.dumps([report.as_dict()]))
"""


def run(args: list[str], hlo: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        lines = [l for l in out.stderr.splitlines() if "error" in l.lower() or "Check failed" in l]
        return {"compiled": False, "error": (lines or out.stderr.splitlines() or ["?"])[-1][:300]}
    report = json.loads(out.stdout[out.stdout.index("["):])[0]
    text = "".join(p.read_text() for p in hlo.glob("*.txt"))
    return {"compiled": True, "cudnn_calls": text.count('custom_call_target="__cudnn$fmha'),
            "host_buffers": text.count("S(5)"), **report}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (modes, flags) in CONFIGS.items():
            hlo = pathlib.Path(tmp) / name.replace(" ", "_")
            cmd = [sys.executable, "-m", "axonn_jax", "compile", "--target", "h100", "--devices",
                   str(args.devices), *flags, "--json", "--dump-hlo", str(hlo)]
            results[name] = {"modes": modes, "command": "axonn-jax " + " ".join(cmd[3:-3]),
                             **run(cmd, hlo)}
            print(name, results[name].get("compiled"), results[name].get("error", ""), flush=True)
        hlo = pathlib.Path(tmp) / "user"
        code = USER_MODEL.format(tests=str(REPO / "tests"), devices=args.devices, hlo=str(hlo))
        results["user ViT (take_along_axis head)"] = {
            "modes": "data, pipe (gpipe), depth, row; bf16; optimizer offload; a user's "
                     "StackedModel", "command": "library API (see the script)",
            **run([sys.executable, "-c", code], hlo)}
    out = pathlib.Path(args.out)
    (out / "compile_modes.json").write_text(json.dumps(results, indent=1))
    rows = ["| configuration | modes | compiled | memory MB/device | host MB/device | "
            "collective MB/device | cuDNN calls | S(5) layouts | compile s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not r["compiled"]:
            rows.append(f"| {name} | {r['modes']} | no: {r['error']} | | | | | | |")
            continue
        comm = sum(r["comm_bytes_per_device"].values())
        rows.append(f"| {name} | {r['modes']} | yes | {r['memory_per_device_bytes'] / 1e6:.2f} | "
                    f"{r['host_memory_per_device_bytes'] / 1e6:.2f} | {comm / 1e6:.3f} | "
                    f"{r['cudnn_calls']} | {r['host_buffers']} | {r['compile_s']:.1f} |")
    text = (f"# Every mode compiled for {args.devices} abstract H100s\n\n"
            "`python benchmarks/compile_modes.py` (deviceless: `analysis.targets`; tiny models, "
            "batch 16 × 64 tokens or 16 images). Commands:\n\n"
            + "\n".join(f"- {n}: `{r['command']}`" for n, r in results.items()) + "\n\n"
            + "\n".join(rows) + "\n")
    (out / "compile_modes.md").write_text(text)
    print(text)
    return 0 if all(r["compiled"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
