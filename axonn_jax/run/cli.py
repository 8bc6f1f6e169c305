"""`axonn-jax`: train, bench, plan and launch from the command line.

Arguments are parsed before JAX is imported, so `--devices N` can still make the CPU backend expose
N simulated devices.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import traceback

from ..config import AXES, SCHEDULES
from .config import add_config_args


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
    p.add_argument("--checkpoint-dir", default=None, help="default: RUN_DIR/checkpoints")
    p.add_argument("--keep", type=int, default=3, metavar="N", help="keep the newest N checkpoints")
    p.add_argument("--keep-every", type=int, default=0, metavar="K",
                   help="and every checkpoint whose step is a multiple of K, forever")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (with its config.yaml) from its latest "
                        "checkpoint; `--resume auto`: continue when the checkpoint directory "
                        "holds a checkpoint, else start (a job script that resumes by itself)")
    p.add_argument("--stop-at", type=int, default=0, metavar="STEP",
                   help="stop after this step and save a checkpoint, e.g. before a job's time "
                        "limit (resume later). SIGTERM/SIGUSR1 stop at the next step (exit code "
                        "75), Ctrl-C too (130)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where the run's config, metrics, log, checkpoints, HLO, TensorBoard "
                        "events, profile and plots go (default: runs/<model>-<time>)")
    p.add_argument("--metrics-out", default=None, metavar="FILE.jsonl",
                   help="default: RUN_DIR/metrics.jsonl")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write the optimized HLO of the compiled train step (default: RUN_DIR/hlo)")
    p.add_argument("--profile-steps", type=_step_range, default=None, metavar="A:B",
                   help="write a jax.profiler trace of steps A to B into RUN_DIR/profile")
    p.add_argument("--sample-tokens", type=int, default=0, help="generate a sample at the end")
    p.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="fine-tune a Hugging Face Llama or GPT-2 directory (config.json + "
                        "safetensors; its tokenizer.json tokenizes --data); replaces --model")
    p.add_argument("--export-to", default=None, metavar="DIR",
                   help="write the trained model there as a Hugging Face directory")
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
    modes.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"],
                       help="attention core of built-in models: cuDNN flash attention (a CUDA "
                            "GPU, bf16/fp16), XLA's, or auto (cuDNN where it runs)")
    modes.add_argument("--memory-budget", dest="memory_budget_gb", type=float, default=None,
                       metavar="GB")
    modes.add_argument("--compress-bits", type=int, default=0, help="0: exact all-reduce")
    modes.add_argument("--compress-bucket", type=int, default=1024)
    modes.add_argument("--no-error-feedback", dest="error_feedback", action="store_false")
    modes.add_argument("--transport", default="xla", choices=["xla", "mpi"])
    add_config_args(p)


def _step_range(text: str) -> str:
    """`--profile-steps A:B`, checked (argparse shows the error)."""
    from .hooks import parse_step_range

    try:
        parse_step_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--profile-steps ")) from None
    return text


def _parallel_config(args, num_devices: int):
    from ..config import ParallelConfig

    for axis, flag in (("data", "--data-parallel"), *((a, f"--{a}") for a in AXES[1:])):
        if getattr(args, axis) is not None and getattr(args, axis) < 1:
            raise ValueError(f"{flag} must be positive, got {getattr(args, axis)}")
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
    from ..models import get, pretrained

    explicit = [f"--{a}" for a in AXES[1:] if getattr(args, a) != 1] + (["--data"] if args.data else [])
    if explicit:
        raise ValueError(f"--auto-grid chooses the grid itself; drop {', '.join(explicit)}")
    machine = cm.MACHINES["cpu" if jax.default_backend() == "cpu" else "h100-dgx"]
    work = _workload(args)
    choices = [args.microbatches] if args.microbatches > 1 else None
    for p in cm.plan(work, num_devices, machine, microbatch_choices=choices):
        # A pipeline's stages run one program, so `--remat auto` (a per-layer plan) cannot use one.
        if not (p.grid.pipe > 1 and args.remat == "auto"):
            return p.grid, p.microbatches
    raise ValueError(f"--auto-grid: no grid of {num_devices} devices runs {args.model} with "
                     f"--batch-size {args.batch_size}")


def _workload(args):
    """The planner's `Workload` of the `train` arguments (model, batch, dtype and modes)."""
    from ..analysis import comm_model as cm
    from ..models import get, pretrained

    model = (pretrained(args.init_from) if args.init_from else get(args.model)).config
    return cm.Workload(model, args.batch_size, args.seq_len,
                       compute_bytes={"float32": 4}.get(args.dtype, 2), schedule=args.schedule,
                       virtual_stages=args.virtual_stages, compress_bits=args.compress_bits,
                       offload_optimizer=args.offload_optimizer, microbatches=args.microbatches)


def _train(args) -> int:
    import jax

    from .loop import train
    from .options import TrainOptions
    from .stopping import exit_code

    if args.auto_grid:
        config, args.microbatches = _auto_grid(args, jax.device_count())
        grid = ",".join(f"{k}={v}" for k, v in config.as_dict().items())
        print(f"--auto-grid: {grid}, {args.microbatches} microbatch(es)", file=sys.stderr)
        if config.pipe == 1:
            args.schedule = "gpipe"  # the planner weighed it; without a pipeline it means nothing
    else:
        config = _parallel_config(args, jax.device_count())
    _resolve_run_dir(args)
    # The effective config names the grid that ran (and no longer asks for --auto-grid).
    args.data, args.auto_grid = config.data, False
    for axis in AXES[1:]:
        setattr(args, axis, getattr(config, axis))
    _refuse_ignored(args, config)
    options = TrainOptions(parallel=config, **_option_fields(args))
    summary = _train_logged(args, options) if _is_main(args) else train(options)
    return exit_code(summary["stopped"])


def _refuse_ignored(args, config) -> None:
    """Flags that would have no effect on this grid and modes are refused, not ignored."""
    if args.schedule != "gpipe" and config.pipe == 1:
        raise ValueError(f"--schedule {args.schedule} needs a pipeline (--pipe > 1)")
    if not args.compress_bits:
        if args.compress_bucket != 1024:
            raise ValueError("--compress-bucket needs gradient compression (--compress-bits)")
        if not args.error_feedback:
            raise ValueError("--no-error-feedback needs gradient compression (--compress-bits)")


def _train_logged(args, options) -> dict:
    """`train(options)` on the main process: the effective config into the run directory first,
    and what the run prints into its `train.log` as well. Returns `train`'s summary."""
    from rich.console import Console

    from . import config as config_lib, rundir
    from .loop import train

    run_dir = pathlib.Path(options.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_lib.write(run_dir / rundir.CONFIG,
                     config_lib.effective_config(args.parser, args, exclude=JOB_KEYS))
    log = rundir.Tee(run_dir / rundir.LOG)
    console = Console(file=log, soft_wrap=True)  # whole lines in the log
    try:
        console.print(f"run directory: {run_dir}")
        summary = train(options, console=console)
        console.print(f"everything about this run is in {run_dir}; plots: axonn-jax report "
                      f"{run_dir}; curves: tensorboard --logdir {run_dir / rundir.TENSORBOARD}")
        return summary
    except BaseException:
        log.log_only(traceback.format_exc())
        raise
    finally:
        log.close()


JOB_KEYS = ("run_dir", "resume", "stop_at")
"""Keys of one job of a run, left out of its `config.yaml` (`--resume RUN_DIR` reads it)."""


def _resolve_run_dir(args) -> None:
    """Sets `args.run_dir` (`--resume RUN_DIR`'s, `--run-dir`, or `runs/<model>-<time>` agreed
    by all processes) and makes `args.resume` a bool."""
    from . import rundir

    if args.resume == "auto":
        if not (args.run_dir or args.checkpoint_dir):
            raise ValueError("--resume auto needs the place to look for a checkpoint: --run-dir "
                             "(or --checkpoint-dir)")
    elif isinstance(args.resume, str):
        if args.run_dir and pathlib.Path(args.run_dir).resolve() != pathlib.Path(args.resume).resolve():
            raise ValueError(f"--resume {args.resume} and --run-dir {args.run_dir} name different "
                             "run directories")
        if not pathlib.Path(args.resume).is_dir():
            raise FileNotFoundError(f"--resume: run directory {args.resume!r} does not exist")
        args.run_dir, args.resume = args.resume, True
    elif args.resume and not (args.run_dir or args.checkpoint_dir):
        raise ValueError("--resume takes the run directory to continue, e.g. --resume runs/NAME")
    if not args.run_dir:
        args.run_dir = rundir.agree(str(rundir.default_run_dir(args.model)), args.transport)


def _is_main(args) -> bool:
    """This process writes the run directory's config and log (rank 0 under --transport mpi)."""
    if args.transport == "mpi":
        from ..transport.mpi import world

        return world()[1] == 0
    import jax

    return jax.process_index() == 0


def _option_fields(args) -> dict:
    """The `TrainOptions` fields among the parsed `train` arguments (all but the grid)."""
    from .options import TrainOptions

    return {k: v for k, v in vars(args).items()
            if k in TrainOptions.__dataclass_fields__ and k != "parallel"}


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from ..analysis.comm_model import MACHINES
    from ..models import presets

    p.add_argument("--model", default="gpt-20b", choices=sorted(presets()))
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
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype of the run planned (activation bytes; as train --dtype)")
    p.add_argument("--top", type=int, default=10, help="grids to list (0: all)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the listed grids: step time (compute, communication by axis, "
                        "bubble) and memory per device against capacity")
    add_config_args(p)


def _plan(args) -> int:
    import dataclasses
    import json

    from ..analysis import comm_model as cm
    from ..config import ParallelConfig
    from ..models import get

    machine = cm.MACHINES[args.machine]
    overrides = {"devices_per_node": args.devices_per_node, "efficiency": args.efficiency,
                 "intra_bw": args.intra_bw and args.intra_bw * 1e9,
                 "inter_bw": args.inter_bw and args.inter_bw * 1e9,
                 "device_memory": args.device_memory and args.device_memory * 1e9,
                 "peak_flops": args.peak_tflops and args.peak_tflops * 1e12}
    machine = dataclasses.replace(machine, **{k: v for k, v in overrides.items() if v})
    work = cm.Workload(get(args.model).config, args.batch, args.seq_len, schedule=args.schedule,
                       compute_bytes=4 if args.dtype == "float32" else 2,
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
    rows = f"{args.batch} images" if get(args.model).data == "images" else \
        f"{args.batch} × {args.seq_len}"
    title = f"{args.model} on {args.num_devices} devices ({machine.name}), batch {rows}"
    if args.plot:
        from .report import plot_plan

        path = plot_plan(shown, machine.device_memory, title, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps([p.as_dict() for p in shown], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
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
    from ..models import presets

    p.add_argument("--model", default=None, choices=sorted(presets()),
                   help="compare whole train steps of this model with GSPMD baselines (without it: "
                        "tensor-parallel GPT blocks, --d-model/--layers/--heads)")
    p.add_argument("--grid", action="append", default=None, metavar="data=..,row=..",
                   help="an axonn grid to compare (repeatable; default: the planner's pick and "
                        "data=8, data=2,row=2,col=2, row=4,col=2, data=2,depth=2,row=2)")
    p.add_argument("--microbatches", type=int, default=2, help="for grids with pipe > 1")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2,
                   help="scanned blocks (with 1, XLA unrolls the loop and reuses the forward all-gather)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed steps per variant (median); 0: compile only (bytes, memory)")
    p.add_argument("--name", default=None,
                   help="file stem of the results (default: tp_vs_gspmd, or steps_MODEL)")
    p.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="writes NAME.json, NAME.md and NAME.png here")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate N CPU devices (set before JAX starts); the benchmark needs 8")


def _bench(args) -> int:
    if args.model:
        return _bench_steps(args)
    from ..analysis.gspmd import BlockShape, run, write

    w = BlockShape(d_model=args.d_model, layers=args.layers, heads=args.heads, batch=args.batch_size,
                   seq=args.seq_len)
    js, md = write(run(w, repeats=args.repeats), args.out, args.name or "tp_vs_gspmd")
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


BENCH_GRIDS = ("data=8", "data=2,row=2,col=2", "row=4,col=2", "data=2,depth=2,row=2")


def _bench_steps(args) -> int:
    """Whole train steps of a preset: the planner's grid and hand-picked ones against GSPMD."""
    import jax
    import numpy as np

    from .. import models
    from ..analysis import comm_model as cm, step_bench
    from ..config import ParallelConfig

    preset = models.get(args.model)
    n = jax.device_count()
    grids = [ParallelConfig.parse(g) for g in (args.grid or BENCH_GRIDS)]
    for g in grids:
        g.validate(n)
        preset.check_grid(g)
    if args.grid is None:  # the planner's pick for these devices comes first
        machine = cm.MACHINES["cpu" if jax.default_backend() == "cpu" else "h100-dgx"]
        work = cm.Workload(preset.config, args.batch_size, args.seq_len, compute_bytes=4)
        best = cm.plan(work, n, machine)[0].grid
        grids = [best] + [g for g in grids if g != best]
    if preset.data == "images":
        batch = preset.config.batches(0, args.batch_size)(0)
        title = f"Whole train steps: {args.model}, batch {args.batch_size} images"
    else:
        tokens = np.random.default_rng(0).integers(
            0, preset.config.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        title = f"Whole train steps: {args.model}, batch {args.batch_size}×{args.seq_len}"
    report = step_bench.run(preset.build(np.float32), batch, grids=grids, repeats=args.repeats,
                            microbatches=args.microbatches)
    paths = step_bench.write(report, args.out, args.name or f"steps_{args.model}", title)
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, paths)))
    return 0



def _add_compile_args(p: argparse.ArgumentParser) -> None:
    _add_train_args(p)
    p.add_argument("--target", default="h100", choices=["h100", "cpu"],
                   help="compile for abstract H100s (no GPU needed) or simulated CPU devices")
    p.add_argument("--top", type=int, default=0, metavar="K",
                   help="compile the planner's K best grids instead of the given one")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(steps=1)


def _compile(args) -> int:
    """`axonn-jax compile`: the train step of the `train` arguments, compiled for a target from
    abstract state, beside `plan`'s prediction (`analysis.compiled`); exit status 1 when a grid
    does not fit."""
    import dataclasses
    import json

    import jax

    from ..analysis import comm_model as cm, compiled as cc, targets
    from .options import TrainOptions
    from .trainer import build_trainer

    target = targets.target(args.target)
    n = args.devices or jax.device_count()
    devices = target.devices(n)
    options = TrainOptions(**_option_fields(args))
    work, machine = _workload(args), cm.MACHINES["h100-dgx"]
    modelled = isinstance(work.model, cm.PLANNED_MODELS)
    if args.top:
        if not modelled:
            raise ValueError(f"--top: the planner does not model {args.model}")
        grids = [(p.grid, p.microbatches) for p in cm.plan(work, n, machine)[:args.top]]
    else:
        grids = [(_parallel_config(args, n), args.microbatches)]

    def build(grid, microbatches):
        trainer = build_trainer(dataclasses.replace(options, parallel=grid,
                                                    microbatches=microbatches), devices)
        return trainer.step, trainer.local_example()

    predict = (lambda g, m: cm.predict(dataclasses.replace(work, microbatches=m), g, machine)) \
        if modelled else None
    reports = cc.compile_grids(build, grids, capacity_bytes=target.capacity_bytes,
                               predict=predict, model_flops=work.flops() if modelled else None,
                               dump_hlo=args.dump_hlo)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=1))
    else:
        for row in cc.table(reports):
            print("  ".join(f"{c:>16}" for c in row))
    verdicts = [v for r in reports if (v := r.verdict())]
    for v in verdicts:
        print(f"axonn-jax compile: {v}", file=sys.stderr)
    return 1 if verdicts else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="axonn-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (a preset or a Hugging Face directory)")
    _add_train_args(train)
    train.set_defaults(run=_train)
    plan = sub.add_parser("plan", help="rank grids with the communication model")
    _add_plan_args(plan)
    plan.set_defaults(run=_plan)
    bench = sub.add_parser("bench", help="benchmark tensor-parallel grids against GSPMD baselines")
    _add_bench_args(bench)
    bench.set_defaults(run=_bench)
    comp = sub.add_parser("compile", help="compile a train step for abstract H100s or simulated "
                                            "CPU devices: memory, bytes, FLOPs against plan")
    _add_compile_args(comp)
    comp.set_defaults(run=_compile)
    _add_launch_parser(sub)
    report = sub.add_parser("report", help="plots and a summary of one or several run directories")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default=None, metavar="DIR",
                        help="default: RUN_DIR/plots for one run, report-<time> beside the first "
                             "of several")
    report.set_defaults(run=_report)
    train.set_defaults(parser=train)
    return parser


def _report(args) -> int:
    from .report import report

    md, images = report(args.run_dirs, args.out)
    print(md.read_text())
    print(f"wrote {md} and {', '.join(i.name for i in images)}")
    return 0


def _add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="run several processes of one job on this machine",
                       usage="axonn-jax launch --nprocs P [--devices-per-proc K] [--port N] "
                             "[--max-restarts N] [--log-dir DIR] -- train ... | SCRIPT.py ...")
    p.add_argument("--nprocs", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-proc", type=int, default=None,
                   help="devices per process: simulated CPU devices, or its share of the GPUs")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a process dies, restart the whole job up to N times from its newest "
                        "checkpoint (`train` gets --resume auto)")
    p.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                   help="declare a process that stopped answering dead after this long "
                        "(default: JAX's, 100 s)")
    p.add_argument("--log-dir", default=None,
                   help="where proc<i>.log of every process is written (default: the run "
                        "directory's logs/; for a script, runs/<script>-<time>/logs)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="`-- train ...`, or `-- script.py ...` (a script calling init_distributed)")

    def run(args) -> int:
        from .launch import main as launch_main

        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if command and args.log_dir is None:
            args.command, args.log_dir = _launch_run_dir(command)
        return launch_main(args)

    p.set_defaults(run=run)


def parse(argv: list[str]):
    """The arguments of `argv` with configs applied (`run.config`); `train --resume RUN_DIR`
    without `--config` reads `RUN_DIR/config.yaml`."""
    from . import config as config_lib, rundir

    if argv[:1] == ["train"] and not any(a.split("=")[0] == "--config" for a in argv):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--resume", nargs="?", const=True)
        resume = pre.parse_known_args(argv[1:])[0].resume
        if isinstance(resume, str) and resume != "auto" and \
                (pathlib.Path(resume) / rundir.CONFIG).is_file():
            argv = [argv[0], "--config", str(pathlib.Path(resume) / rundir.CONFIG), *argv[1:]]
    return config_lib.parse_args(build_parser(), argv)


def _launch_run_dir(command: list[str]) -> tuple[list[str], str]:
    """(command, log directory) of `axonn-jax launch`: a `train` command gets its run directory
    fixed here (`--run-dir`, so that every process writes the same one) and the logs go to its
    `logs/`; a script's to `runs/<script>-<time>/logs`."""
    from . import rundir

    if command[0] != "train":
        return command, str(rundir.default_run_dir(pathlib.Path(command[0]).stem) / rundir.LAUNCH_LOGS)
    args = parse(command)
    run_dir = args.resume if isinstance(args.resume, str) and args.resume != "auto" else args.run_dir
    if run_dir is None:
        run_dir = str(rundir.default_run_dir(args.model))
        command = [*command, "--run-dir", run_dir]
    return command, str(pathlib.Path(run_dir) / rundir.LAUNCH_LOGS)


def main(argv: list[str] | None = None) -> int:
    from .launch import follow_launcher
    from .stopping import EXIT_DIVERGED, EXIT_INTERRUPTED, Diverged

    follow_launcher()  # a process of `axonn-jax launch` dies with its launcher
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"axonn-jax {argv[0] if argv else ''}: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "compile" or getattr(args, "devices", None) is not None:
            from ..mesh import simulate_cpu_devices, use_cpu_platform

            use_cpu_platform()  # simulated or compile-only devices: JAX itself runs on the CPU
            if getattr(args, "devices", None) is not None and getattr(args, "target", "cpu") == "cpu":
                simulate_cpu_devices(args.devices)
        if args.command == "train" and args.transport == "xla":
            # Joins the job described by the environment (`axonn-jax launch`, srun, mpirun), if any.
            from .distributed import init_distributed

            init_distributed(local_device_count=args.devices)
        return args.run(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"axonn-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"axonn-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C
        print(f"axonn-jax {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
