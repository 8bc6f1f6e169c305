"""One U-Net train step on 8 simulated CPU devices: an axonn_jax tensor-parallel grid against GSPMD
baselines (`jax.jit` + `NamedSharding`: Megatron-style channel split, FSDP) of the same model,
optimizer and batch (`axonn_jax.analysis.step_bench`): per-device collective bytes from the
compiled HLO, compiled FLOPs and peak memory. Compile only (no timing: the shared CPU is no clock).

    XLA_FLAGS=--xla_backend_optimization_level=0 python benchmarks/bench_unet.py --model unet-tiny

(the LLVM optimization level changes neither the HLO nor its buffers, only how long XLA:CPU takes
to compile; `axonn-jax bench --model unet-tiny` runs every baseline and grid, timed.)
"""
import argparse
import sys

from axonn_jax.mesh import simulate_cpu_devices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="unet-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grid", action="append", default=None, help="default: data=2,row=2,col=2")
    p.add_argument("--baseline", action="append", default=None,
                   help="default: gspmd megatron tp, gspmd fsdp")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    simulate_cpu_devices(8)
    import numpy as np

    from axonn_jax import ParallelConfig, models
    from axonn_jax.analysis import step_bench

    preset = models.get(args.model)
    grids = [ParallelConfig.parse(g) for g in args.grid or ["data=2,row=2,col=2"]]
    batch = preset.config.batches(0, args.batch_size)(0)
    report = step_bench.run(preset.build(np.float32), batch, grids=grids, repeats=0,
                            baselines=tuple(args.baseline or ("gspmd megatron tp", "gspmd fsdp")))
    title = f"One train step: {args.model}, batch {args.batch_size} images"
    paths = step_bench.write(report, args.out, f"steps_{args.model}", title)
    print(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
