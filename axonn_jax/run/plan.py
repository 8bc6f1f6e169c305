"""What the communication model (`analysis.comm_model`) is asked about a config: its workload, the
machine, the grids it ranks, and the planner's pick for `--auto-grid`."""
from __future__ import annotations

import dataclasses

from ..analysis import comm_model as cm
from ..config import AXES, ParallelConfig
from ..parallel.pipeline import option_problems
from .options import ConfigError, RunConfig, preset_of, resolve_grid


def workload(config: RunConfig, platform: str = "gpu") -> cm.Workload:
    """The step the config trains, as the planner counts it.

    Args:
      config: the run's config (a built-in model).
      platform: the platform it is compiled for, `gpu` or `cpu` (`cm.Workload.platform`).

    Returns:
      The `cm.Workload` of the config's model, batch, precision, pipeline, compression, memory
      and grid options.
    """
    model = preset_of(config).config
    if hasattr(model, "attention"):  # which attention core runs decides what it keeps
        model = dataclasses.replace(model, attention=config.model.attention)
    return cm.Workload(model, config.data.batch_size, config.data.seq_len,
                       compute_bytes=4 if config.precision.dtype == "float32" else 2,
                       microbatches=config.pipeline.microbatches,
                       schedule=config.pipeline.schedule,
                       virtual_stages=config.pipeline.virtual_stages,
                       compress_bits=config.compression.bits,
                       compress_scope=config.compression.scope,
                       compress_node_size=config.compression.node_size,
                       compress_in_backward=config.compression.in_backward,
                       error_feedback=config.compression.error_feedback,
                       reduce_dtype=config.precision.reduce_dtype,
                       offload_optimizer=config.memory.offload_optimizer,
                       offload_gradients=config.memory.offload_gradients,
                       context_attention=config.model.context_attention,
                       remat=_modelled_remat(config.memory.remat), platform=platform,
                       collective_matmul=config.grid.collective_matmul, fp8=config.precision.fp8)


def _modelled_remat(remat: str) -> str:
    """The remat mode the planner counts for `--remat`: `auto` (a per-block plan within a budget,
    made when the step is built) as `none`, an upper bound of its memory."""
    return remat if remat in cm.REMAT_POLICIES else "none"


def machine_for_backend() -> cm.Machine:
    """The machine preset of the running backend: simulated CPU devices, or H100 nodes of 8.

    Returns:
      `cm.MACHINES["cpu"]` on the CPU backend, else `cm.MACHINES["h100-dgx"]`.
    """
    import jax

    return cm.MACHINES["cpu" if jax.default_backend() == "cpu" else "h100-dgx"]


def given_grid(config: RunConfig) -> bool:
    """The config names a grid (any axis given), as opposed to asking the planner for one.

    Args:
      config: the run's config.

    Returns:
      True when any `grid.<axis>` option was given.
    """
    return any(f"grid.{a}" in config.given for a in AXES)


PLANNED_COMPRESS_BITS = 8
"""CGX's bits that `plan` weighs against the exact exchange when the config sets none: with
error feedback their trajectories stay within 1e-3 of exact (tests/test_distributed.py); fewer
bits are the user's choice."""
LOSSY_MARGIN = 0.10
"""How much faster `plan` must predict a compressed exchange it chooses itself than the exact one
(`comm_model.plan`'s `lossy_margin`): it changes the numerics, and `plan` agrees with the replayed
H100 steps to about 10% (benchmarks/results/plan_vs_replay.md)."""


def ranked(config: RunConfig, num_devices: int, machine: cm.Machine,
           grid: ParallelConfig | None = None, expert_imbalance: float = 1.0,
           search_state: bool = False) -> list[cm.Prediction]:
    """The planner's predictions of the grids of `num_devices` devices that fit, fastest first.

    Microbatches and the remat mode: the config's when it sets them (a mode the planner models),
    else the planner's choice for each grid; with `search_state` also where the optimizer state
    lives and whether the gradients cross `data` compressed (`PLANNED_COMPRESS_BITS`, only when
    `LOSSY_MARGIN` faster), each where the config does not set it. CGX's `--compress-scope inter-node` counts nodes of the
    machine's devices unless `--compress-node-size` says otherwise.

    Args:
      config: the run's config (a built-in model).
      num_devices: the devices the grids span.
      machine: the machine the planner models.
      grid: predict only this grid (None: every grid that fits).
      expert_imbalance: `cm.Workload.expert_imbalance`, at least 1.
      search_state: weigh `--offload-optimizer` and `--compress-bits` too (the `plan` command;
        the trainer's `--auto-grid` keeps the config's own).

    Returns:
      A list of `cm.Prediction`, fastest first.

    Raises:
      ConfigError: `expert_imbalance` is below 1.
    """
    if not expert_imbalance >= 1:
        raise ConfigError([f"--expert-imbalance {expert_imbalance} must be ≥ 1 (the busiest "
                           "expert shard's tokens over the mean)"])
    work = dataclasses.replace(workload(config, machine.platform),
                               expert_imbalance=expert_imbalance,
                               compress_node_size=config.compression.node_size
                               or machine.devices_per_node)
    choices = [config.pipeline.microbatches] if "pipeline.microbatches" in config.given else None
    remat = config.memory.remat
    remats = [remat] if "memory.remat" in config.given and remat in cm.REMAT_POLICIES else None
    # The margin only weighs compressed choices against exact ones of the same grid: with the
    # config's own bits every choice is compressed alike, and it changes nothing.
    return cm.plan(work, num_devices, machine, grid, microbatch_choices=choices,
                   remat_choices=remats, state_choices=_state_choices(config) if search_state
                   else None, lossy_margin=LOSSY_MARGIN)


def _state_choices(config: RunConfig) -> list[tuple[bool, int]]:
    """`(offload_optimizer, compress_bits)` pairs `plan` weighs: the config's where it sets them."""
    offloads = [config.memory.offload_optimizer] \
        if "memory.offload_optimizer" in config.given else [False, True]
    # A wire dtype the config names is a choice of the exact exchange: the search keeps it.
    chosen = {"compression.bits", "precision.reduce_dtype"} & set(config.given)
    bits = [config.compression.bits] if chosen else [0, PLANNED_COMPRESS_BITS]
    return [(o, b) for o in offloads for b in bits]


def auto_grid(config: RunConfig, num_devices: int) -> tuple[ParallelConfig, int, str]:
    """The planner's fastest grid for the config on `num_devices` devices of this backend.

    Only the grids the trainer runs count: with `--remat auto` (a per-layer plan) no pipeline.

    Args:
      config: the run's config (a built-in model).
      num_devices: the devices the grid spans.

    Returns:
      `(grid, microbatches, remat mode)`; the config's `--remat auto` stays (it plans per block
      once the grid is known).

    Raises:
      ConfigError: no grid of `num_devices` devices runs the model with the batch size.
    """
    auto, pipeline = config.memory.remat == "auto", config.pipeline
    for p in ranked(config, num_devices, machine_for_backend()):
        # A pipeline's stages run one program, so `--remat auto` (a per-layer plan) cannot use one.
        if not option_problems(p.grid.pipe, schedule=pipeline.schedule,
                               microbatches=p.microbatches,
                               virtual_stages=pipeline.virtual_stages, per_layer_plan=auto):
            return p.grid, p.microbatches, "auto" if auto else p.remat
    raise ConfigError([f"--auto-grid: no grid of {num_devices} devices runs "
                       f"{config.model.name} with --batch-size {config.data.batch_size}"])


def planned_grid(config: RunConfig, text: str | None = None) -> ParallelConfig | None:
    """The one grid `plan` is asked about, or None to rank them all.

    Args:
      config: the run's config; `grid.devices` is the device count.
      text: `--grid data=..,row=..`; None or empty: the grid flags of the config (data filling
        the devices), when it gives any and not `--auto-grid`.

    Returns:
      The grid, validated against the devices, or None when neither names one.

    Raises:
      ValueError: the grid does not fit the devices.
      ConfigError: the grid cannot run the model.
    """
    devices = config.grid.devices
    if text:
        grid = ParallelConfig.parse(text)
    elif given_grid(config) and not config.grid.auto:
        grid = resolve_grid(config, devices)
    else:
        return None
    grid.validate(devices)
    if reason := cm.infeasible_reason(workload(config), grid):
        raise ConfigError([f"grid {_grid_text(grid)} cannot run {config.model.name}: {reason}"])
    return grid


def grid_text(grid: ParallelConfig) -> str:
    """`data=2,context=4,row=4`: the axes of more than one device.

    Args:
      grid: a grid.

    Returns:
      `axis=size` of each axis of more than one device, joined by commas (`data=1` for none).
    """
    return _grid_text(grid)


def _grid_text(grid: ParallelConfig) -> str:
    return ",".join(f"{k}={v}" for k, v in grid.as_dict().items() if v != 1) or "data=1"


def machine_of(name: str, **overrides) -> cm.Machine:
    """The machine preset `name` with the fields given.

    Args:
      name: a key of `cm.MACHINES`.
      **overrides: `cm.Machine` fields; None (or another false value) keeps the preset's.

    Returns:
      The `cm.Machine`.
    """
    return dataclasses.replace(cm.MACHINES[name], **{k: v for k, v in overrides.items() if v})
