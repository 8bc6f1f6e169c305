"""`axonn-jax`: train, plan, compile, bench, launch and report from the command line.

`train`, `plan` and `bench` read the same config tree (`run.options`): every option is a flag, a
YAML key of `--config FILE.yaml` and a `--set key=value` (`run.config`). Arguments are parsed
before JAX is imported, so `--devices N` can still make the CPU backend expose N simulated devices.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import traceback

from .config import add_config_args, add_tree_args
from ..config import AXES
from .options import ConfigError

JOB_KEYS = ("run.run_dir", "checkpoint.resume", "checkpoint.stop_at")
"""Fields of one job of a run, left out of its `config.yaml` (`--resume RUN_DIR` reads it)."""


def _train(args) -> int:
    import jax

    from . import options as opts
    from .loop import train
    from .plan import auto_grid
    from .stopping import exit_code

    config = _with_run_dir(args.run_config)
    num_devices = jax.device_count()
    platform = jax.devices()[0].platform
    opts.check(config, platform=platform)  # what needs no grid, before the planner runs
    if config.grid.auto:
        grid, microbatches, remat = auto_grid(config, num_devices)
        text = ",".join(f"{k}={v}" for k, v in grid.as_dict().items())
        print(f"--auto-grid: {text}, {microbatches} microbatch(es), --remat {remat}",
              file=sys.stderr)
        config = opts.with_grid(config, grid, microbatches, remat)
    else:
        config = opts.with_grid(config, opts.resolve_grid(config, num_devices))
    if config.run.transport == "xla":  # every problem before the run directory is made
        opts.check(config, config.parallel, num_devices=num_devices, platform=platform)
    summary = _train_logged(config) if _is_main(config) else train(config)
    return exit_code(summary["stopped"])


def _train_logged(config) -> dict:
    """`train(config)` on the main process: the effective config into the run directory first,
    and what the run prints into its `train.log` as well. Returns `train`'s summary."""
    from rich.console import Console

    from . import config as config_lib, rundir
    from .loop import train

    run_dir = pathlib.Path(config.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_lib.write(run_dir / rundir.CONFIG, config_lib.effective_config(config, exclude=JOB_KEYS))
    log = rundir.Tee(run_dir / rundir.LOG)
    console = Console(file=log, soft_wrap=True)  # whole lines in the log
    try:
        console.print(f"run directory: {run_dir}")
        summary = train(config, console=console)
        console.print(f"everything about this run is in {run_dir}; plots: axonn-jax report "
                      f"{run_dir}; curves: tensorboard --logdir {run_dir / rundir.TENSORBOARD}")
        return summary
    except BaseException:
        log.log_only(traceback.format_exc())
        raise
    finally:
        log.close()


def _with_run_dir(config):
    """The config with its run directory set (`--resume RUN_DIR`'s, `--run-dir`, or
    `runs/<model>-<time>` agreed by all processes) and `resume` a bool or 'auto'."""
    from . import rundir

    c, run_dir = config.checkpoint, config.run.run_dir
    resume = c.resume
    if resume == "auto":
        if not (run_dir or c.dir):
            raise ConfigError(["--resume auto needs the place to look for a checkpoint: "
                               "--run-dir (or --checkpoint-dir)"])
    elif isinstance(resume, str):
        if run_dir and pathlib.Path(run_dir).resolve() != pathlib.Path(resume).resolve():
            raise ConfigError([f"--resume {resume} and --run-dir {run_dir} name different run "
                               "directories"])
        if not pathlib.Path(resume).is_dir():
            raise FileNotFoundError(f"--resume: run directory {resume!r} does not exist")
        run_dir, resume = resume, True
    elif resume and not (run_dir or c.dir):
        raise ConfigError(["--resume takes the run directory to continue, e.g. --resume runs/NAME"])
    if not run_dir:
        run_dir = rundir.agree(str(rundir.default_run_dir(config.model.name)),
                               config.run.transport)
    return config.replace(**{"run.run_dir": run_dir, "checkpoint.resume": resume})


def _is_main(config) -> bool:
    """This process writes the run directory's config and log (rank 0 under --transport mpi)."""
    if config.run.transport == "mpi":
        from ..transport.mpi import world

        return world()[1] == 0
    import jax

    return jax.process_index() == 0


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from ..analysis.comm_model import MACHINES

    machine = p.add_argument_group("machine (plan)")
    machine.add_argument("--machine", default="h100-4", choices=sorted(MACHINES),
                         help="machine preset; the flags below override its fields")
    machine.add_argument("--devices-per-node", type=int)
    machine.add_argument("--intra-bw", type=float, metavar="GB/s", help="per device, one direction")
    machine.add_argument("--inter-bw", type=float, metavar="GB/s", help="per device, one direction")
    machine.add_argument("--device-memory", type=float, metavar="GB")
    machine.add_argument("--peak-tflops", type=float, metavar="T")
    machine.add_argument("--efficiency", type=float, help="fraction of peak the matmuls reach")
    machine.add_argument("--expert-imbalance", type=float, default=1.0, metavar="X",
                         help="mixtures of experts: tokens of the busiest expert shard over the "
                              "mean (the metrics' load_imbalance); multiplies the experts' time "
                              "and memory (default 1.0: balanced)")
    shown = p.add_argument_group("output (plan)")
    shown.add_argument("--grid", default=None,
                       help="only this grid, e.g. data=8,pipe=2,row=2,col=2 (or give the grid "
                            "flags: --pipe 2 --row 2)")
    shown.add_argument("--top", type=int, default=10, help="grids to list (0: all)")
    shown.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    shown.add_argument("--plot", default=None, metavar="FILE.png",
                       help="draw the listed grids: step time (compute, communication by axis, "
                            "bubble) and memory per device against capacity")
    shown.add_argument("--verify", type=int, default=0, metavar="K",
                       help="compile the K best grids for abstract H100s (`compile`), rank the "
                            "ones that fit first, and name every figure where the model and the "
                            "compiler differ by more than 10%%")


def _plan(args) -> int:
    import json

    from . import options as opts
    from .plan import machine_of, planned_grid, ranked

    config = args.run_config
    if config.grid.devices is None:
        raise ConfigError(["plan needs the number of devices to plan for: --devices N"])
    opts.check(config)
    machine = machine_of(args.machine, devices_per_node=args.devices_per_node,
                         efficiency=args.efficiency,
                         intra_bw=args.intra_bw and args.intra_bw * 1e9,
                         inter_bw=args.inter_bw and args.inter_bw * 1e9,
                         device_memory=args.device_memory and args.device_memory * 1e9,
                         peak_flops=args.peak_tflops and args.peak_tflops * 1e12)
    grid = planned_grid(config, args.grid)
    ranking = ranked(config, config.grid.devices, machine, grid, args.expert_imbalance,
                     search_state=True)
    if not ranking:
        raise ConfigError([f"no grid of {config.grid.devices} devices fits {config.model.name} in "
                           f"{machine.device_memory / 1e9:.0f} GB per device"])
    shown = ranking[: args.top] if args.top else ranking
    rows = f"{config.data.batch_size} images" if opts.preset_of(config).data == "images" else \
        f"{config.data.batch_size} × {config.data.seq_len}"
    title = (f"{config.model.name} on {config.grid.devices} devices ({machine.name}), batch {rows}, "
             f"{config.precision.dtype}")
    if args.plot:
        from .report import plot_plan

        path = plot_plan(shown, machine.device_memory, title, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    if args.verify:
        return _verify(config, shown, args, machine)
    if args.json:
        print(json.dumps([p.as_dict() for p in shown], indent=1))
        return 0
    _plan_table(shown, title)
    return 0


def _compile_reports(config, grids, target, predict=None, dump_hlo=None, machine=None):
    """`analysis.compiled` reports of the config's step on each `(grid, microbatches, remat)`
    (or `(grid, microbatches, remat, offload_optimizer, compress_bits, offload_gradients)`),
    compiled for `target` (`analysis.targets.Target`) with `predict(*choice)`'s figures;
    `machine`: replay each schedule on it (the reports' `overlap`)."""
    import jax

    from ..analysis import comm_model as cm, compiled as cc
    from . import options as opts
    from .plan import workload
    from .trainer import build_trainer

    devices = target.devices(config.grid.devices or jax.device_count())
    opts.check(config, platform=devices[0].platform)
    work = workload(config)

    def build(grid, microbatches, remat, *state):
        chosen = opts.with_grid(config, grid, microbatches, remat)
        if state:
            chosen = chosen.replace(**{"memory.offload_optimizer": state[0],
                                       "compression.bits": state[1],
                                       "memory.offload_gradients": state[2]})
        trainer = build_trainer(chosen, devices)
        return trainer.step, trainer.local_example()

    return cc.compile_grids(build, grids, capacity_bytes=target.capacity_bytes, predict=predict,
                            model_flops=work.flops() if cm.counts(work.model) else None,
                            dump_hlo=dump_hlo, machine=machine)


def _verify(config, shown, args, machine) -> int:
    """`plan --verify K`: the K best grids compiled for abstract H100s and their schedules replayed
    on `machine` (`analysis.overlap`; its agreement with a measured GPU step, and `plan`'s, are in
    `benchmarks/results/gpu_calibration.md`), re-ranked by what
    the compiler shows: those that fit first, then by replayed step time; each with the figures
    where model and compiler part by over 10%."""
    import json

    from ..analysis import compiled as cc, targets

    by_grid = {(p.grid, p.microbatches, p.remat, p.offload_optimizer, p.compress_bits,
                p.offload_gradients): p
               for p in shown[:args.verify]}
    reports = _compile_reports(config, list(by_grid), targets.target("h100"),
                               lambda *choice: by_grid[choice], machine=machine)
    order = sorted(range(len(reports)),
                   key=lambda i: (not reports[i].fits, reports[i].overlap["step_s"]))
    if args.json:
        print(json.dumps([{**shown[i].as_dict(), "compiled": reports[i].as_dict(),
                           "disagreements": cc.disagreements(reports[i])} for i in order],
                         indent=1))
        return 0
    for rank, i in enumerate(order, 1):
        r, step = reports[i], reports[i].overlap["step_s"]
        grid = "×".join(str(v) for v in r.grid.values())
        mfu = f" ({r.model_flops_per_device / step / machine.peak_flops:.1%} MFU)" \
            if r.model_flops_per_device else ""
        print(f"{rank}. {grid} (plan's #{i + 1}, {r.microbatches} microbatches, --remat "
              f"{r.remat}{_state_text(shown[i], ', ')}): compiled "
              f"{r.memory_per_device_bytes / 1e9:.1f} GB per device "
              f"({'fits' if r.fits else 'does NOT fit'}), plan "
              f"{r.predicted['memory_per_device_bytes'] / 1e9:.1f} GB; step replayed "
              f"{step:.4g} s{mfu}, plan {shown[i].step_time_s:.4g} s ({shown[i].mfu:.1%})")
        for line in cc.disagreements(r):
            print(f"   {line}")
    return 0


def _plan_table(shown, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from .plan import grid_text

    imbalance = any(p.expert_imbalance_s for p in shown)
    table = Table(title=title)
    for col in ("rank", "grid", "M", "remat", "state, wire", "step s", "MFU", "compute s",
                *(["imbalance s"] if imbalance else []),
                "exposed comm s", "bubble s", "memory GB", "comm GB/device"):
        table.add_column(col, justify="right")
    for i, p in enumerate(shown, 1):
        table.add_row(str(i), grid_text(p.grid), str(p.microbatches), p.remat,
                      _state_text(p) or "device, exact", f"{p.step_time_s:.3f}", f"{p.mfu:.1%}", f"{p.compute_s:.3f}",
                      *([f"{p.expert_imbalance_s:.3f}"] if imbalance else []),
                      f"{sum(p.exposed_comm_s.values()):.3f}", f"{p.bubble_s:.3f}",
                      f"{p.memory_per_device_bytes / 1e9:.1f}",
                      f"{sum(p.comm_bytes_per_device.values()) / 1e9:.2f}")
    Console(width=190 if imbalance else 170).print(table)


def _state_text(p, prefix: str = "") -> str:
    """Where a prediction's optimizer state lives and how its gradients cross `data`, as flags
    would say it; empty for the state on the device and the exact exchange."""
    if not (p.offload_optimizer or p.compress_bits):
        return ""
    parts = ["host+grads" if p.offload_gradients else
             "host" if p.offload_optimizer else "device",
             f"{p.compress_bits}-bit" if p.compress_bits else "exact"]
    return prefix + ", ".join(parts)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("benchmark")
    b.add_argument("--grid", dest="grids", action="append", default=None,
                   metavar="data=..,row=..",
                   help="an axonn grid to compare (repeatable; default: the planner's pick and "
                        "data=8, data=2,row=2,col=2, row=4,col=2, data=2,depth=2,row=2)")
    b.add_argument("--d-model", type=int, default=1024, help="without --model: GPT blocks of "
                   "this width (--layers, --heads) against GSPMD")
    b.add_argument("--layers", type=int, default=2,
                   help="scanned blocks (with 1, XLA unrolls the loop and reuses the forward all-gather)")
    b.add_argument("--heads", type=int, default=16)
    b.add_argument("--repeats", type=int, default=3,
                   help="timed steps per variant (median); 0: compile only (bytes, memory)")
    b.add_argument("--name", default=None,
                   help="file stem of the results (default: tp_vs_gspmd, or steps_MODEL)")
    b.add_argument("--out", default="benchmarks/results", metavar="DIR",
                   help="writes NAME.json, NAME.md and NAME.png here")


def _bench(args) -> int:
    config = args.run_config
    if "model.name" in config.given:  # whole train steps of a preset; else GPT blocks
        return _bench_steps(args)
    from ..analysis.gspmd import BlockShape, run, write

    w = BlockShape(d_model=args.d_model, layers=args.layers, heads=args.heads,
                   batch=config.data.batch_size, seq=config.data.seq_len)
    js, md = write(run(w, repeats=args.repeats), args.out, args.name or "tp_vs_gspmd")
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


BENCH_GRIDS = ("data=8", "data=2,row=2,col=2", "row=4,col=2", "data=2,depth=2,row=2")


def _bench_steps(args) -> int:
    """Whole train steps of a preset: the planner's grid and hand-picked ones against GSPMD."""
    import jax
    import numpy as np

    from ..analysis import step_bench
    from ..config import ParallelConfig
    from .options import preset_of
    from .plan import machine_for_backend, ranked

    config = args.run_config
    preset = preset_of(config)
    n = jax.device_count()
    b, t = config.data.batch_size, config.data.seq_len
    if args.grids:
        grids = [ParallelConfig.parse(g) for g in args.grids]
        for g in grids:
            g.validate(n)
            preset.check_grid(g)
    else:  # the planner's pick for these devices first, then BENCH_GRIDS scaled to them
        ranking = ranked(config.replace(**{"precision.dtype": "float32"}), n, machine_for_backend())
        grids = [ranking[0].grid] if ranking else []
        grids += [g for g in step_bench.scaled_grids(BENCH_GRIDS, n, b, preset.check_grid)
                  if g not in grids]
        if not grids:
            raise ConfigError([f"no grid of {n} devices runs {config.model.name} with "
                               f"--batch-size {b}: give --grid"])
    baselines, dropped = step_bench.gspmd_layouts_for(n, b, preset.check_grid)
    for name, why in dropped.items():
        print(f"axonn-jax bench: {name} left out: {why}", file=sys.stderr)
    if preset.data == "images":
        batch = preset.config.batches(0, b)(0)
        title = f"Whole train steps: {config.model.name}, batch {b} images"
    else:
        tokens = np.random.default_rng(0).integers(
            0, preset.config.vocab_size, (b, t + 1)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        title = f"Whole train steps: {config.model.name}, batch {b}×{t}"
    report = step_bench.run(preset.build(np.float32), batch, grids=grids, repeats=args.repeats,
                            microbatches=config.pipeline.microbatches, baselines=baselines)
    paths = step_bench.write(report, args.out, args.name or f"steps_{config.model.name}", title)
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _add_compile_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("compile")
    c.add_argument("--target", default="h100", choices=["h100", "cpu"],
                   help="compile for abstract H100s (no GPU needed) or simulated CPU devices")
    c.add_argument("--top", type=int, default=0, metavar="K",
                   help="compile the planner's K best grids instead of the config's")
    c.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    c.add_argument("--overlap-report", action="store_true",
                   help="replay the H100 schedule: for every asynchronous collective, the compute "
                        "between its start and its done; per mesh axis and kind, the share of "
                        "bytes with compute to hide behind and of time hidden (in --json: "
                        "`overlap`)")


def _compile(args) -> int:
    """`axonn-jax compile`: the train step of the config, compiled for a target from abstract
    state, beside `plan`'s prediction (`analysis.compiled`); exit status 1 when a grid does not
    fit."""
    import json

    import jax

    from ..analysis import comm_model as cm, compiled as cc, targets
    from . import options as opts
    from .plan import workload

    config = args.run_config
    target = targets.target(args.target)
    if args.overlap_report and args.target != "h100":
        raise ValueError("--overlap-report replays the GPU schedule: use --target h100")
    opts.check(config, platform="gpu" if args.target == "h100" else "cpu")
    n = config.grid.devices or jax.device_count()
    work = workload(config, "gpu" if args.target == "h100" else "cpu")
    machine = cm.MACHINES["h100-dgx"]
    modelled = cm.counts(work.model)
    if args.top:
        if not modelled:
            raise ConfigError([f"--top: the planner does not model {config.model.name}"])
        grids = [(p.grid, p.microbatches, p.remat) for p in cm.plan(work, n, machine)[:args.top]]
    else:
        grids = [(opts.resolve_grid(config, n), config.pipeline.microbatches, config.memory.remat)]

    def predict(grid, microbatches, remat):
        w = dataclasses.replace(work, microbatches=microbatches, remat=remat)
        return cm.predict(w, grid, machine)

    predict = predict if modelled else None
    reports = _compile_reports(config, grids, target, predict, config.run.dump_hlo,
                               machine if args.overlap_report else None)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=1))
    else:
        for row in cc.table(reports):
            print("  ".join(f"{c:>16}" for c in row))
        for r in reports if args.overlap_report else ():
            grid = ",".join(f"{k}={v}" for k, v in r.grid.items() if v > 1) or "one device"
            print(f"\noverlap of {grid} (schedule replayed on {machine.name}):")
            for row in cc.overlap_table(r):
                print(f"{row[0]:>34}" + "".join(f"{c:>14}" for c in row[1:]))
    verdicts = [v for r in reports if (v := r.verdict())]
    for v in verdicts:
        print(f"axonn-jax compile: {v}", file=sys.stderr)
    return 1 if verdicts else 0


def build_parser() -> argparse.ArgumentParser:
    """The `axonn-jax` argument parser, one subcommand per command.

    The commands are `train`, `plan`, `bench`, `compile`, `launch` and `report`; each sets
    `run`, the function that runs it, as a default.

    Returns:
      The parser.
    """
    parser = argparse.ArgumentParser(prog="axonn-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (a preset or a Hugging Face directory)")
    add_tree_args(train)
    add_config_args(train)
    train.set_defaults(run=_train)
    plan = sub.add_parser("plan", help="rank grids with the communication model")
    add_tree_args(plan)
    _add_plan_args(plan)
    add_config_args(plan)
    plan.set_defaults(run=_plan)
    bench = sub.add_parser("bench", help="benchmark tensor-parallel grids against GSPMD baselines")
    add_tree_args(bench, ("model", "grid", "pipeline", "precision", "data"))
    _add_bench_args(bench)
    add_config_args(bench)
    bench.set_defaults(run=_bench)
    comp = sub.add_parser("compile", help="compile a train step for abstract H100s or simulated "
                                          "CPU devices: memory, bytes, FLOPs against plan")
    add_tree_args(comp)
    _add_compile_args(comp)
    add_config_args(comp)
    comp.set_defaults(run=_compile)
    _add_launch_parser(sub)
    report = sub.add_parser("report", help="plots and a summary of one or several run directories")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default=None, metavar="DIR",
                        help="default: RUN_DIR/plots for one run, report-<time> beside the first "
                             "of several")
    report.set_defaults(run=_report)
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


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed arguments of `argv`.

    `train --resume RUN_DIR` without `--config` reads `RUN_DIR/config.yaml`.

    Args:
      argv: the command line, without the program's name.

    Returns:
      The arguments; commands that read the config tree get it as `args.run_config`
      (`run.config.load`).
    """
    from . import config as config_lib, rundir

    args = build_parser().parse_args(argv)
    if not hasattr(args, "config_file"):
        return args
    resume = getattr(args, "checkpoint.resume", None)
    if args.command == "train" and args.config_file is None and isinstance(resume, str) and \
            resume != "auto" and (pathlib.Path(resume) / rundir.CONFIG).is_file():
        args.config_file = str(pathlib.Path(resume) / rundir.CONFIG)
    args.run_config = config_lib.load(args)
    return args


def _launch_run_dir(command: list[str]) -> tuple[list[str], str]:
    """(command, log directory) of `axonn-jax launch`: a `train` command gets its run directory
    fixed here (`--run-dir`, so that every process writes the same one) and the logs go to its
    `logs/`; a script's to `runs/<script>-<time>/logs`."""
    from . import rundir

    if command[0] != "train":
        return command, str(rundir.default_run_dir(pathlib.Path(command[0]).stem) / rundir.LAUNCH_LOGS)
    config = parse(command).run_config
    resume = config.checkpoint.resume
    run_dir = resume if isinstance(resume, str) and resume != "auto" else config.run.run_dir
    if run_dir is None:
        run_dir = str(rundir.default_run_dir(config.model.name))
        command = [*command, "--run-dir", run_dir]
    return command, str(pathlib.Path(run_dir) / rundir.LAUNCH_LOGS)


def _error(command: str, e: BaseException) -> None:
    """One line per problem (a ConfigError holds several)."""
    for line in str(e).splitlines() or [type(e).__name__]:
        print(f"axonn-jax {command}: error: {line}", file=sys.stderr)


SIMULATES = ("train", "bench")
"""Commands whose `--devices` creates simulated CPU devices (plan's are the devices planned for,
compile's the target's: `analysis.targets` makes them)."""


def main(argv: list[str] | None = None) -> int:
    """Run the `axonn-jax` command line; errors are printed one line per problem.

    Args:
      argv: the command line, without the program's name (None: `sys.argv[1:]`).

    Returns:
      The exit code: the command's, 2 for bad input, `EXIT_DIVERGED` for a diverged run and
      `EXIT_INTERRUPTED` after Ctrl-C before the first step (or a second one).
    """
    from .launch import follow_launcher
    from .stopping import EXIT_DIVERGED, EXIT_INTERRUPTED, Diverged

    follow_launcher()  # a process of `axonn-jax launch` dies with its launcher
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
    except (ValueError, FileNotFoundError) as e:
        _error(argv[0] if argv else "", e)
        return 2
    try:
        config = getattr(args, "run_config", None)
        simulates = args.command in SIMULATES or getattr(args, "target", None) == "cpu"
        devices = config.grid.devices if config and simulates else None
        if args.command == "compile" or devices is not None or getattr(args, "verify", 0):
            from ..mesh import simulate_cpu_devices, use_cpu_platform

            use_cpu_platform()  # simulated or compile-only devices: JAX itself runs on the CPU
            if devices is not None:
                simulate_cpu_devices(devices)
        if args.command == "train" and config.run.transport == "xla":
            # Joins the job described by the environment (`axonn-jax launch`, srun, mpirun), if any.
            from .distributed import init_distributed

            init_distributed(local_device_count=devices)
        return args.run(args)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        _error(args.command, e)
        return 2
    except Diverged as e:
        _error(args.command, e)
        return EXIT_DIVERGED
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C
        print(f"axonn-jax {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout's reader left (`axonn-jax plan ... | head`): stop quietly
        # Python's flush of stdout at exit would fail again and print a second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
