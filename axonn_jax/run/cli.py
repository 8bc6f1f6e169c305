"""`axonn-jax`: train, bench, plan and launch from the command line.

Arguments are parsed before JAX is imported, so `--devices N` can still make the CPU backend expose
N simulated devices.
"""
from __future__ import annotations

import argparse
import sys

from ..config import AXES, SCHEDULES


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from ..models import presets

    p.add_argument("--model", default="gpt-tiny", choices=sorted(presets()), help="model preset")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=-1, help="default: 5%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype; fp32 master weights (float16: dynamic loss scaling)")
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
    grid.add_argument("--auto-grid", action="store_true",
                      help="let the communication model's planner choose the grid (and microbatches)")
    modes = p.add_argument_group("modes")
    modes.add_argument("--microbatches", type=int, default=1)
    modes.add_argument("--schedule", default="gpipe", choices=list(SCHEDULES))
    modes.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                       help="interleaved-1f1b: layer chunks per pipeline stage")
    modes.add_argument("--offload-optimizer", action="store_true")
    modes.add_argument("--remat", default="none", choices=["none", "full", "offload", "auto"])
    modes.add_argument("--memory-budget", dest="memory_budget_gb", type=float, default=None,
                       metavar="GB")
    modes.add_argument("--compress-bits", type=int, default=0, help="0: exact all-reduce")
    modes.add_argument("--compress-bucket", type=int, default=1024)
    modes.add_argument("--no-error-feedback", dest="error_feedback", action="store_false")
    modes.add_argument("--transport", default="xla", choices=["xla", "mpi"])


def _parallel_config(args, num_devices: int):
    from ..config import ParallelConfig

    # Under --transport mpi the pipeline stages are MPI processes, not this process's devices.
    inner = (1 if args.transport == "mpi" else args.pipe) * args.depth * args.row * args.col
    data = args.data
    if data is None:
        if num_devices % inner:
            raise ValueError(f"pipe·depth·row·col = {inner} does not divide the {num_devices} devices")
        data = num_devices // inner
    return ParallelConfig(data=data, pipe=args.pipe, depth=args.depth, row=args.row, col=args.col)


def _auto_grid(args, num_devices: int):
    """The planner's fastest grid for these options on `num_devices` (the `cpu` machine preset
    for the CPU backend's simulated devices, else one H100 node per 8 devices), among the grids
    the trainer runs. Returns (grid, microbatches)."""
    import jax

    from ..analysis import comm_model as cm
    from ..models.gpt import get_config

    explicit = [f"--{a}" for a in AXES[1:] if getattr(args, a) != 1] + (["--data"] if args.data else [])
    if explicit:
        raise ValueError(f"--auto-grid chooses the grid itself; drop {', '.join(explicit)}")
    machine = cm.MACHINES["cpu" if jax.default_backend() == "cpu" else "h100-dgx"]
    nbytes = {"float32": 4}.get(args.dtype, 2)
    work = cm.Workload(get_config(args.model), args.batch_size, args.seq_len, compute_bytes=nbytes,
                       schedule=args.schedule, virtual_stages=args.virtual_stages,
                       compress_bits=args.compress_bits,
                       offload_optimizer=args.offload_optimizer)
    choices = [args.microbatches] if args.microbatches > 1 else None
    for p in cm.plan(work, num_devices, machine, microbatch_choices=choices):
        # A pipeline's stages run one program, so `--remat auto` (a per-layer plan) cannot use one.
        if not (p.grid.pipe > 1 and args.remat == "auto"):
            return p.grid, p.microbatches
    raise ValueError(f"--auto-grid: no grid of {num_devices} devices runs {args.model} with "
                     f"--batch-size {args.batch_size}")


def _train(args) -> int:
    import jax

    from ..train import TrainOptions, train

    if args.auto_grid:
        config, args.microbatches = _auto_grid(args, jax.device_count())
        grid = ",".join(f"{k}={v}" for k, v in config.as_dict().items())
        print(f"--auto-grid: {grid}, {args.microbatches} microbatch(es)", file=sys.stderr)
    else:
        config = _parallel_config(args, jax.device_count())
    train(TrainOptions(parallel=config, **_option_fields(args)))
    return 0


def _option_fields(args) -> dict:
    """The `TrainOptions` fields among the parsed `train` arguments (all but the grid)."""
    from ..train import TrainOptions

    return {k: v for k, v in vars(args).items()
            if k in TrainOptions.__dataclass_fields__ and k != "parallel"}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from ..models.gpt import PRESETS
    from ..analysis.comm_model import MACHINES

    p.add_argument("--model", default="gpt-20b", choices=sorted(PRESETS))
    p.add_argument("--devices", dest="num_devices", type=int, required=True,
                   help="devices to plan for")
    p.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--machine", default="h100-4", choices=sorted(MACHINES),
                   help="machine preset; the flags below override its fields")
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--intra-bw", type=float, metavar="GB/s", help="per device, one direction")
    p.add_argument("--inter-bw", type=float, metavar="GB/s", help="per device, one direction")
    p.add_argument("--device-memory", type=float, metavar="GB")
    p.add_argument("--peak-tflops", type=float, metavar="T")
    p.add_argument("--efficiency", type=float, help="fraction of peak the matmuls reach")
    p.add_argument("--grid", default=None, help="only this grid, e.g. data=8,pipe=2,row=2,col=2")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    p.add_argument("--virtual-stages", type=int, default=1, metavar="V")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--compress-bits", type=int, default=0)
    p.add_argument("--top", type=int, default=10, help="grids to list (0: all)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _plan(args) -> int:
    import dataclasses
    import json

    from ..config import ParallelConfig
    from ..models.gpt import get_config
    from ..analysis import comm_model as cm

    machine = cm.MACHINES[args.machine]
    overrides = {"devices_per_node": args.devices_per_node, "efficiency": args.efficiency,
                 "intra_bw": args.intra_bw and args.intra_bw * 1e9,
                 "inter_bw": args.inter_bw and args.inter_bw * 1e9,
                 "device_memory": args.device_memory and args.device_memory * 1e9,
                 "peak_flops": args.peak_tflops and args.peak_tflops * 1e12}
    machine = dataclasses.replace(machine, **{k: v for k, v in overrides.items() if v})
    work = cm.Workload(get_config(args.model), args.batch, args.seq_len, schedule=args.schedule,
                       virtual_stages=args.virtual_stages,
                       offload_optimizer=args.offload_optimizer, compress_bits=args.compress_bits)
    grid = ParallelConfig.parse(args.grid) if args.grid else None
    if grid:
        grid.validate(args.num_devices)
        if reason := cm.infeasible_reason(work, grid):
            raise ValueError(f"grid {args.grid} cannot run {args.model}: {reason}")
    ranked = cm.plan(work, args.num_devices, machine, grid)
    if not ranked:
        raise ValueError(f"no grid of {args.num_devices} devices fits {args.model} in "
                         f"{machine.device_memory / 1e9:.0f} GB per device")
    shown = ranked[: args.top] if args.top else ranked
    if args.json:
        print(json.dumps([p.as_dict() for p in shown], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.model} on {args.num_devices} devices ({machine.name}), batch "
                        f"{args.batch} × {args.seq_len}")
    for col in ("rank", "data×pipe×depth×row×col", "M", "step s", "MFU", "compute s",
                "exposed comm s", "bubble s", "memory GB", "comm GB/device"):
        table.add_column(col, justify="right")
    for i, p in enumerate(shown, 1):
        table.add_row(str(i), "×".join(map(str, p.grid.shape)), str(p.microbatches),
                      f"{p.step_time_s:.3f}", f"{p.mfu:.1%}", f"{p.compute_s:.3f}",
                      f"{sum(p.exposed_comm_s.values()):.3f}", f"{p.bubble_s:.3f}",
                      f"{p.memory_per_device_bytes / 1e9:.1f}",
                      f"{sum(p.comm_bytes_per_device.values()) / 1e9:.2f}")
    Console(width=150).print(table)
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
    from ..analysis.gspmd import BlockShape, run, write

    w = BlockShape(d_model=args.d_model, layers=args.layers, heads=args.heads, batch=args.batch_size,
                 seq=args.seq_len)
    js, md = write(run(w, repeats=args.repeats), args.out, args.name)
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonn-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT")
    _add_train_args(train)
    train.set_defaults(run=_train)
    plan = sub.add_parser("plan", help="rank grids with the communication model")
    _add_plan_args(plan)
    plan.set_defaults(run=_plan)
    bench = sub.add_parser("bench", help="benchmark tensor-parallel grids against GSPMD baselines")
    _add_bench_args(bench)
    bench.set_defaults(run=_bench)
    _add_launch_parser(sub)
    return parser


def _add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="run several processes of one job on this machine",
                       usage="axonn-jax launch --nprocs P [--devices-per-proc K] [--port N] "
                             "[--log-dir DIR] -- train ...")
    p.add_argument("--nprocs", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-proc", type=int, default=None,
                   help="devices per process: simulated CPU devices, or its share of the GPUs")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--log-dir", default="axonn-launch-logs",
                   help="where proc<i>.log of every process is written")
    p.add_argument("command", nargs=argparse.REMAINDER, help="`-- train ...`")

    def run(args) -> int:
        from .launch import main as launch_main

        return launch_main(args)

    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    from .launch import follow_launcher

    follow_launcher()  # a process of `axonn-jax launch` dies with its launcher
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", None):
        from ..mesh import simulate_cpu_devices

        simulate_cpu_devices(args.devices)
    try:
        if args.command == "train" and args.transport == "xla":
            # Joins the job described by the environment (`axonn-jax launch`, srun, mpirun), if any.
            from .distributed import init_distributed

            init_distributed(local_device_count=args.devices)
        return args.run(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"axonn-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
