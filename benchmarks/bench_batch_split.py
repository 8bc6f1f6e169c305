"""The batch-split tensor-parallel layout against the replicated one (issue 15, item 1): per device,
the compiled train step's FLOPs (HLO with loop bodies times their trip counts) as a ratio to the
data=8 step of the same model and batch, its collective wire bytes and its temporary memory, on 8
simulated CPU devices. Compile only.

    XLA_FLAGS=--xla_backend_optimization_level=0 python benchmarks/bench_batch_split.py
    ... --model gpt-mini --seq-len 128

(the LLVM optimization level changes neither the HLO nor its buffers, only how long XLA:CPU takes
to compile.) `--replicated` measures AxoNN's replicated layout instead (every dense layer's
`split_batch` answers False), for the before/after table in docs/axes/row-col.md.
"""
import argparse
import sys

from axonn_jax.mesh import simulate_cpu_devices

GRIDS = ["data=2,row=2,col=2", "row=4,col=2", "row=2,col=2,depth=2", "data=2,depth=2,row=2"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--grid", action="append", default=None, help="default: " + "; ".join(GRIDS))
    p.add_argument("--replicated", action="store_true", help="the replicated layout instead")
    args = p.parse_args(argv)
    simulate_cpu_devices(8)
    import jax

    from axonn_jax import ParallelConfig
    from axonn_jax.analysis import hlo
    from axonn_jax.analysis.flops import compiled_flops
    from axonn_jax.tp import tensor
    from axonn_jax.train import TrainOptions, build_trainer

    if args.replicated:
        tensor.split_batch = lambda *a, **k: False

    def compiled(grid):
        options = TrainOptions(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                               parallel=grid)
        trainer = build_trainer(options, jax.devices()[:grid.num_devices])
        return trainer.step.lower(trainer.init_state(abstract=True),
                                  trainer.bound.abstract_batch()).compile()

    base = compiled_flops(compiled(ParallelConfig(data=8)))
    print("| grid | compiled FLOPs / data=8 | wire MB | temporary MB |\n|---|---|---|---|")
    for spec in args.grid or GRIDS:
        step = compiled(ParallelConfig.parse(spec))
        wire = sum(hlo.wire_bytes(step.as_text()).values())
        print(f"| {spec} | {compiled_flops(step) / base:.3f} | {wire / 1e6:.3f} | "
              f"{step.memory_analysis().temp_size_in_bytes / 1e6:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
