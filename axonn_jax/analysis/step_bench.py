"""Whole train steps: axonn_jax grids against GSPMD ("pjit") baselines of the same model.

Every variant trains the same `StackedModel` with the same optimizer, clipping and batch on the
same devices; only the placement of parameters, optimizer state and batch, and so the collectives,
differ:

- axonn_jax: `make_train_step` on a `data × pipe × depth × row × col` grid (AxoNN's tensor-parallel
  layers, explicit data-parallel reduction, the pipeline engine);
- GSPMD baselines: one `jax.jit` of loss, gradients and the same update (`step.update`) with
  `NamedSharding`s on the parameters and the batch, GSPMD inserting every collective:
  - `dp`: parameters replicated, batch split;
  - `fsdp`: every parameter split on its largest dimension the devices divide (ZeRO-3), batch split;
  - `megatron tp`: each weight split as Megatron-LM splits it (column-parallel layers over their
    outputs, row-parallel ones over their inputs, vocabulary-parallel embeddings) — the layout of
    axonn's layers on a `row` grid, `row` renamed `tp` — batch replicated;
  - hybrids `dp × tp` and `fsdp × tp` on two-axis meshes.

Per variant: per-device wire bytes by collective kind (`analysis.hlo`), compiled FLOPs per device
(`flops.compiled_flops`, loops by trip count), compiled peak bytes per device
(`memory_analysis`), the loss of the first step (all variants must agree) and the median step
time, reported as a ratio to the fastest GSPMD baseline measured in the same run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import Axis, ParallelConfig
from ..mesh import make_mesh
from ..offload.activations import compiled_peak_bytes
from ..offload.optimizer import on_device
from ..offload.precision import loss_scaler
from ..step.model import StackedModel
from ..step.train_step import make_train_step
from ..step.update import initial_state, make_update, update_chain
from .flops import compiled_flops
from .hlo import KINDS, wire_bytes
from .targets import compile_options

GSPMD_LAYOUTS = {  # name: (mesh shape as a function of n devices, axis names)
    "gspmd dp": (lambda n: (n,), ("dp",)),
    "gspmd fsdp": (lambda n: (n,), ("fsdp",)),
    "gspmd megatron tp": (lambda n: (n,), ("tp",)),
    "gspmd dp=2 x tp": (lambda n: (2, n // 2), ("dp", "tp")),
    "gspmd fsdp=2 x tp": (lambda n: (2, n // 2), ("fsdp", "tp")),
}


def gspmd_layouts_for(n: int, batch_rows: int, check_grid=None,
                      layouts=GSPMD_LAYOUTS) -> tuple[tuple, dict]:
    """The GSPMD `layouts` that fit `n` devices and a batch of `batch_rows`, and why others do not.

    A layout fits where its mesh holds the `n` devices, its batch axes split the batch and
    `check_grid(ParallelConfig(row=tp))` (the model's) accepts its Megatron axis.

    Args:
      n: the devices.
      batch_rows: the global batch's rows.
      check_grid: the model's grid check (raises ValueError), or None.
      layouts: `{name: (mesh shape of n, axis names)}` (`GSPMD_LAYOUTS`).

    Returns:
      (names of the fitting layouts, `{name: why not}` for the others).
    """
    usable, dropped = [], {}
    for name, (shape_of, axes) in layouts.items():
        shape = shape_of(n)
        sizes = dict(zip(axes, shape))
        rows = math.prod(s for a, s in sizes.items() if a in ("dp", "fsdp"))
        if math.prod(shape) != n or min(shape) < 1:
            dropped[name] = f"mesh {shape} does not hold {n} devices"
        elif batch_rows % rows:
            dropped[name] = f"batch {batch_rows} does not split over {rows} devices"
        elif (why := _tp_problem(check_grid, sizes.get("tp", 1))):
            dropped[name] = why
        else:
            usable.append(name)
    return tuple(usable), dropped


def _tp_problem(check_grid, tp: int) -> str | None:
    try:
        check_grid and tp > 1 and check_grid(ParallelConfig(row=tp))
    except ValueError as e:
        return str(e)
    return None


def scaled_grids(texts, n: int, batch_rows: int, check=None) -> list[ParallelConfig]:
    """The grids `texts` with `data` scaled so that each holds `n` devices.

    Args:
      texts: grids as `ParallelConfig.parse` reads them (`data=..,row=..`).
      n: the devices.
      batch_rows: the global batch's rows.
      check: the model's grid check (raises ValueError), or None.

    Returns:
      The scaled grids whose batch shards split `batch_rows` and that `check(grid)` accepts.
    """
    out = []
    for text in texts:
        g = ParallelConfig.parse(text)
        rest = g.num_devices // g.data
        if n % rest:
            continue
        g = dataclasses.replace(g, data=n // rest)
        if batch_rows % (g.batch_shards * g.depth):
            continue
        try:
            check and check(g)
        except ValueError:
            continue
        out.append(g)
    return out


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def _megatron_specs(model: StackedModel, batch, tp: int, devices) -> Any:
    """Megatron-LM's weight layout over an axis `tp`: axonn's tensor-parallel specs on a
    `row = tp` grid (normal layers split over their outputs, transposed ones over their inputs,
    vocabulary-parallel tables), `row` renamed `tp` and the unit axes dropped."""
    mesh = make_mesh(ParallelConfig(row=tp), devices[:tp])
    specs = model.bind(batch, mesh).specs

    def rename(spec: P) -> P:
        def entry(e):
            names = e if isinstance(e, tuple) else (e,)
            return "tp" if Axis.ROW in names else None
        return P(*(entry(e) for e in spec))

    return jax.tree.map(rename, specs, is_leaf=lambda s: isinstance(s, P))


def _fsdp(spec: P, shape, axis: str, size: int) -> P:
    """`spec` with `axis` added on the largest dimension it leaves whole and `size` divides."""
    dims = list(spec) + [None] * (len(shape) - len(spec))
    free = [i for i, d in enumerate(dims) if d is None and shape[i] % size == 0]
    if free:
        dims[max(free, key=lambda i: shape[i])] = axis
    return P(*dims)


def _placed(shapes, shardings):
    """ShapeDtypeStructs of `shapes` with `shardings` (nothing allocated)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        shardings)


def gspmd_step(name: str, model: StackedModel, optimizer, batch, devices, clip_norm,
               abstract: bool = False):
    """The jitted step, placed state and placed batch of GSPMD baseline `name`.

    Args:
      name: a key of `GSPMD_LAYOUTS`.
      model: the model.
      optimizer: an optax optimizer.
      batch: one global batch (a host pytree).
      devices: the devices of its mesh.
      clip_norm: the gradient-norm clip (None: none).
      abstract: state and batch as ShapeDtypeStructs with their shardings (compile only).

    Returns:
      (jitted step, placed state, placed batch).
    """
    shape_of, axes = GSPMD_LAYOUTS[name]
    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape_of(n)), axes)
    sizes = dict(zip(axes, shape_of(n)))
    fns = model.bind(_abstract(batch))
    params = jax.eval_shape(fns.init, jax.random.key(0))
    specs = _megatron_specs(model, _abstract(batch), sizes["tp"], devices) if "tp" in sizes \
        else jax.tree.map(lambda _: P(), params)
    if "fsdp" in sizes:
        specs = jax.tree.map(lambda s, p: _fsdp(s, p.shape, "fsdp", sizes["fsdp"]), specs, params,
                             is_leaf=lambda s: isinstance(s, P))
    named = lambda s: NamedSharding(mesh, s)  # noqa: E731
    p_shard = jax.tree.map(named, specs, is_leaf=lambda s: isinstance(s, P))
    scaler = loss_scaler("float32")
    params_update = on_device(update_chain(optimizer, clip_norm=clip_norm, skip_non_finite=False))
    make_state = lambda k: initial_state(fns.init(k), params_update=params_update,  # noqa: E731
                                         scaler=scaler, rng=jax.random.key_data(k))
    state_shapes = jax.eval_shape(make_state, jax.random.key(0))
    replicated = named(P())
    shardings = jax.tree.map(lambda _: replicated, state_shapes).replace(
        params=p_shard, opt_state=params_update.state_shardings(state_shapes.opt_state, p_shard))
    batch_axes = tuple(a for a in axes if a in ("dp", "fsdp"))
    b_shard = jax.tree.map(lambda _: named(P(batch_axes or None)), batch)
    update = make_update(params_update, scaler=scaler)

    def step(state, b):
        loss, grads = jax.value_and_grad(fns.loss)(state.params, b)
        new, metrics = update(state, grads)
        return new, {"loss": loss, **metrics}

    jitted = jax.jit(step, in_shardings=(shardings, b_shard), out_shardings=(shardings, replicated),
                     donate_argnums=0)
    if abstract:
        return jitted, _placed(state_shapes, shardings), _placed(_abstract(batch), b_shard)
    init = jax.jit(make_state, out_shardings=shardings)
    return jitted, init(jax.random.key(0)), jax.device_put(batch, b_shard)


def axonn_step(grid: ParallelConfig, model: StackedModel, optimizer, batch, devices, clip_norm,
               microbatches: int = 1, abstract: bool = False):
    """The step, placed state and placed batch of axonn_jax's trainer on `grid`.

    Args:
      grid: the mesh's sizes.
      model: the model.
      optimizer: an optax optimizer.
      batch: one global batch (a host pytree).
      devices: the devices of its mesh.
      clip_norm: the gradient-norm clip (None: none).
      microbatches: microbatches per step.
      abstract: state and batch as ShapeDtypeStructs with their shardings, nothing allocated.

    Returns:
      (step, placed state, placed batch).
    """
    step = make_train_step(model, optimizer, make_mesh(grid, devices), clip_norm=clip_norm,
                           microbatches=microbatches)
    if abstract:
        bound = step.bind(_abstract(batch))
        return step, bound.abstract_state(), bound.abstract_batch()
    return step, step.init_state(jax.random.key(0), batch), step.place_batch(batch)


def one_device_modules(model: StackedModel, optimizer, batch, device,
                       clip_norm: float | None = 1.0) -> dict[str, str]:
    """The compiled modules of a plain `jax.jit` step and of axonn_jax's step on one device.

    The plain step is "gspmd dp" on one device (`jax.value_and_grad` of the loss and the same
    update); both compile for `device` from abstract state and batch (compile only, e.g. for an
    abstract H100 of `analysis.targets`).

    Args:
      model: the model.
      optimizer: an optax optimizer.
      batch: one global batch (a host pytree).
      device: the device.
      clip_norm: the gradient-norm clip (None: none).

    Returns:
      `{"plain jit": text, "axonn_jax": text}`.
    """
    builds = {"plain jit": lambda: gspmd_step("gspmd dp", model, optimizer, batch, [device],
                                              clip_norm, abstract=True),
              "axonn_jax": lambda: axonn_step(ParallelConfig(), model, optimizer, batch, [device],
                                              clip_norm, abstract=True)}
    texts = {}
    for name, build in builds.items():
        step, state, placed = build()
        texts[name] = step.lower(state, placed).compile(compile_options(device)).as_text()
    return texts


def measure(name: str, step, state, batch, repeats: int) -> dict:
    """Bytes, FLOPs and peak of the compiled step; the first step's loss and the median step time.

    Args:
      name: the variant's name.
      step: its step (jitted, or a `TrainStep`).
      state: its placed (or abstract) state.
      batch: its placed (or abstract) batch.
      repeats: timed steps after the first (0: compile only, from abstract state: no loss, no
        time).

    Returns:
      `{"name", "wire_bytes_by_kind", "wire_bytes", "flops_per_device", "peak_bytes", "loss",
      "step_time_s"}`.
    """
    compiled = step.lower(state, batch).compile()
    by_kind = wire_bytes(compiled.as_text())
    loss, times = None, []
    if repeats:
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return {"name": name, "wire_bytes_by_kind": by_kind, "wire_bytes": sum(by_kind.values()),
            "flops_per_device": compiled_flops(compiled),
            "peak_bytes": compiled_peak_bytes(compiled), "loss": loss,
            "step_time_s": statistics.median(times) if times else None}


def run(model: StackedModel, batch, optimizer=None, *, grids=(), devices=None, repeats: int = 3,
        clip_norm: float | None = 1.0, baselines=tuple(GSPMD_LAYOUTS), microbatches: int = 1,
        log=print, loss_rtol: float = 1e-4) -> dict:
    """Compare axonn_jax on `grids` with the GSPMD `baselines` for one global `batch`.

    Args:
      model: the model.
      batch: one global batch (a host pytree).
      optimizer: an optax optimizer (None: `optax.adamw(1e-3)`).
      grids: axonn_jax's grids (`ParallelConfig`s).
      devices: the devices (None: `jax.devices()`).
      repeats: timed steps per variant (0: compile only).
      clip_norm: the gradient-norm clip (None: none).
      baselines: names of `GSPMD_LAYOUTS`.
      microbatches: microbatches per step, as `train` runs them (`--microbatches`: a
        pipeline's, or gradient accumulation without one).
      log: prints one line per variant.
      loss_rtol: the largest relative spread of the first losses (a 16-bit model on a GPU, whose
        kernels sum in other orders per program, needs about 1e-2).

    Returns:
      JSON-able results: device, repeats and one row per variant (`measure`'s, with
      `time_vs_best_gspmd`).

    Raises:
      RuntimeError: the variants disagree on the first loss by more than `loss_rtol`.
    """
    devices = list(devices or jax.devices())
    optimizer = optimizer or optax.adamw(1e-3)
    rows = []
    for grid in grids:
        name = "axonn " + " ".join(f"{k}={v}" for k, v in grid.as_dict().items() if v > 1)
        rows.append(measure(name, *axonn_step(grid, model, optimizer, batch, devices, clip_norm,
                                              microbatches, abstract=not repeats), repeats))
        log(_line(rows[-1]))
    for name in baselines:
        rows.append(measure(name, *gspmd_step(name, model, optimizer, batch, devices, clip_norm,
                                              abstract=not repeats), repeats))
        log(_line(rows[-1]))
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    if losses and max(losses) - min(losses) > loss_rtol * abs(losses[0]):
        raise RuntimeError(f"variants disagree on the first loss: {losses}")
    timed = [r["step_time_s"] for r in rows if r["name"].startswith("gspmd") and r["step_time_s"]]
    for r in rows:
        r["time_vs_best_gspmd"] = r["step_time_s"] / min(timed) if timed and r["step_time_s"] else None
    device = f"{len(devices)} simulated CPU devices" if devices[0].platform == "cpu" \
        else f"{len(devices)} × {devices[0].device_kind}"
    return {"device": device, "repeats": repeats, "rows": rows}


def _line(r: dict) -> str:
    t = f", {r['step_time_s'] * 1e3:.1f} ms" if r["step_time_s"] else ""
    return (f"{r['name']}: {r['wire_bytes'] / 2**20:.2f} MiB on the wire, "
            f"{r['flops_per_device'] / 1e9:.3f} GFLOP, peak {r['peak_bytes'] / 2**20:.1f} MiB{t}")


def markdown(report: dict, title: str) -> str:
    """The results page of a `run` report: one table row per variant.

    Args:
      report: what `run` returns.
      title: the page's title (the device is appended).

    Returns:
      The page's markdown.
    """
    lines = [f"# {title} ({report['device']})", "",
             "Per device, one train step (loss, gradients, clipping, AdamW). Time: median of "
             f"{report['repeats']} steps, as a ratio to the fastest GSPMD baseline in the same run.",
             "", "| variant | " + " | ".join(KINDS) + " | wire MiB | GFLOP | peak MiB | time ratio |",
             "|---|" + "---|" * (len(KINDS) + 4)]
    for r in report["rows"]:
        kinds = " | ".join(f"{r['wire_bytes_by_kind'][k] / 2**20:.2f}" for k in KINDS)
        ratio = f"{r['time_vs_best_gspmd']:.2f}" if r["time_vs_best_gspmd"] else "—"
        lines.append(f"| {r['name']} | {kinds} | {r['wire_bytes'] / 2**20:.2f} | "
                     f"{r['flops_per_device'] / 1e9:.3f} | {r['peak_bytes'] / 2**20:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path, title: str) -> None:
    """Bars of wire bytes, FLOPs and peak memory per device for every variant.

    Args:
      report: what `run` returns.
      path: the image file to write.
      title: the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * len(rows) + 1.5), sharey=True)
    for ax, key, label, scale in ((axes[0], "wire_bytes", "wire MiB / device", 2**20),
                                  (axes[1], "flops_per_device", "GFLOP / device", 1e9),
                                  (axes[2], "peak_bytes", "peak MiB / device", 2**20)):
        colors = ["tab:blue" if n.startswith("axonn") else "tab:gray" for n in names]
        ax.barh(names, [r[key] / scale for r in rows], color=colors)
        ax.set_xlabel(label)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict, out_dir: str, stem: str, title: str) -> list[pathlib.Path]:
    """Write `stem.json`, `stem.md` and `stem.png` under `out_dir`.

    Args:
      report: what `run` returns.
      out_dir: the directory (created if missing).
      stem: the files' name without extension.
      title: the page's and the figure's title.

    Returns:
      The three paths.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(report, indent=1))
    paths[1].write_text(markdown(report, title))
    plot(report, paths[2], title)
    return paths


__all__ = ["GSPMD_LAYOUTS", "axonn_step", "gspmd_layouts_for", "gspmd_step", "scaled_grids", "markdown", "measure", "plot", "run", "write"]
