"""`axonn-jax`: train, bench, plan and launch from the command line.

Arguments are parsed before JAX is imported, so `--devices N` can still make the CPU backend expose
N simulated devices.
"""
from __future__ import annotations

import argparse
import sys

from .config import AXES


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from .models.gpt import PRESETS

    p.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=-1, help="default: 5%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype; parameters stay float32")
    p.add_argument("--data", dest="data_path", default=None, metavar="PATH",
                   help="text file, directory of text files, or .npy token array "
                        "(default: the Python standard library's sources)")
    p.add_argument("--eval-every", type=int, default=0, help="default: ten validations per run")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--stop-at", type=int, default=0, metavar="STEP",
                   help="stop after this step, e.g. before a job's time limit (resume later)")
    p.add_argument("--metrics-out", default=None, metavar="FILE.jsonl")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write the optimized HLO of the compiled train step")
    p.add_argument("--sample-tokens", type=int, default=0, help="generate a sample at the end")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate N CPU devices (set before JAX starts)")
    grid = p.add_argument_group("grid (sizes multiply to the device count; --data fills the rest)")
    grid.add_argument("--data-parallel", "--dp", dest="data", type=int, default=None,
                      help="data-parallel size (default: devices / (pipe·depth·row·col))")
    for axis in AXES[1:]:
        grid.add_argument(f"--{axis}", type=int, default=1)
    modes = p.add_argument_group("modes")
    modes.add_argument("--microbatches", type=int, default=1)
    modes.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    modes.add_argument("--offload-optimizer", action="store_true")
    modes.add_argument("--remat", default="none", choices=["none", "full", "offload", "auto"])
    modes.add_argument("--memory-budget", dest="memory_budget_gb", type=float, default=None,
                       metavar="GB")
    modes.add_argument("--compress-bits", type=int, default=0, help="0: exact all-reduce")
    modes.add_argument("--compress-bucket", type=int, default=1024)
    modes.add_argument("--no-error-feedback", dest="error_feedback", action="store_false")
    modes.add_argument("--transport", default="xla", choices=["xla", "mpi"])


def _parallel_config(args, num_devices: int):
    from .config import ParallelConfig

    inner = args.pipe * args.depth * args.row * args.col
    data = args.data
    if data is None:
        if num_devices % inner:
            raise ValueError(f"pipe·depth·row·col = {inner} does not divide the {num_devices} devices")
        data = num_devices // inner
    return ParallelConfig(data=data, pipe=args.pipe, depth=args.depth, row=args.row, col=args.col)


def _train(args) -> int:
    import jax

    from .train import TrainOptions, train

    config = _parallel_config(args, jax.device_count())
    fields = {k: v for k, v in vars(args).items()
              if k in TrainOptions.__dataclass_fields__ and k != "parallel"}
    train(TrainOptions(parallel=config, **fields))
    return 0


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2,
                   help="scanned blocks (with 1, XLA unrolls the loop and reuses the forward all-gather)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps per variant (median); 0: compile only (bytes, memory)")
    p.add_argument("--name", default="tp_vs_gspmd", help="file stem of the results")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="writes NAME.json, NAME.md and NAME.png here")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate N CPU devices (set before JAX starts); the benchmark needs 8")


def _bench(args) -> int:
    from .benchmark import Workload, run, write

    w = Workload(d_model=args.d_model, layers=args.layers, heads=args.heads, batch=args.batch_size,
                 seq=args.seq_len)
    js, md = write(run(w, repeats=args.repeats), args.out, args.name)
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


def _not_yet(name):
    def run(args) -> int:
        raise NotImplementedError(f"`axonn-jax {name}` is not implemented yet")
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonn-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT")
    _add_train_args(train)
    train.set_defaults(run=_train)
    bench = sub.add_parser("bench", help="benchmark tensor-parallel grids against GSPMD baselines")
    _add_bench_args(bench)
    bench.set_defaults(run=_bench)
    for name, help_ in (("plan", "rank grids with the communication model"),
                        ("launch", "start several local processes")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(run=_not_yet(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", None):
        from .mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices)
    try:
        return args.run(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"axonn-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
