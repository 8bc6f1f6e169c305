"""AxoNN's tensor-parallel grids against GSPMD baselines on a stack of GPT blocks.

BlockShape: `layers` scanned GPT blocks (`axonn_jax.models.gpt.Block`, hidden `d_model`, MLP 4×) on
a `(batch, seq, d_model)` input; one step = loss `mean(y²)` and the gradients of every parameter,
returned sharded like the parameters. Every variant computes the same function; only placement and
collectives differ.

- axonn_jax: `parallelize` on a `(row, col, depth)` grid, with or without `data`.
- GSPMD baselines, `jax.jit` + `NamedSharding` only: 1D Megatron TP, FSDP (ZeRO-3), FSDP × TP,
  DP × TP, DP.

Measured per variant: per-device collective bytes per step by kind from the compiled HLO
(`axonn_jax.analysis.hlo`), peak memory from `memory_analysis()`, median step time. For axonn_jax
grids also the analytic byte count of AxoNN's algorithm (`analytic_bytes`).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._compat import shard_map, to_varying
from ..collectives import FP32, KINDS, Collective, StepShape
from ..config import Axis, ParallelConfig
from ..mesh import make_mesh
from ..models import gpt
from ..step.reducers import exchange_collectives
from ..tp.layers import Norms
from ..tp.parallelize import parallelize
from ..tp.tensor import split_batch
from .flops import compiled_flops
from .hlo import collective_bytes, wire_bytes

AXONN_GRIDS = [(8, 1, 1), (1, 8, 1), (4, 2, 1), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 2, 4), (1, 1, 8),
               (4, 1, 1, 2), (2, 2, 1, 2), (2, 1, 2, 2), (2, 1, 1, 4), (1, 1, 2, 4)]
"""(row, col, depth[, data]) grids of 8 devices."""


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The stack of GPT blocks every variant runs: its sizes and the input's."""

    d_model: int = 1024
    layers: int = 2
    heads: int = 16
    batch: int = 8
    seq: int = 16

    @property
    def config(self) -> gpt.GPTConfig:
        """The `GPTConfig` of `layers` blocks of width `d_model` (`max_seq_len` at least 8)."""
        return gpt.GPTConfig(num_layers=self.layers, d_model=self.d_model, num_heads=self.heads,
                             max_seq_len=max(self.seq, 8))


class Blocks(nn.Module):
    """`layers` scanned GPT blocks: `(batch, seq, d_model)` -> same."""

    config: gpt.GPTConfig

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(gpt.ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.config.num_layers, metadata_params={nn.PARTITION_NAME: None})
        return blocks(self.config, name="blocks")(x, None)[0]


def _loss(model):
    return lambda params, x: jnp.mean(jnp.square(model.apply({"params": params}, x)))


def analytic_bytes(w: BlockShape, row: int, col: int, depth: int, data: int = 1,
                   platform: str = "cpu") -> dict[str, int]:
    """Per-device collective bytes per step of AxoNN's algorithm, as the blocks' parts declare them.

    HLO byte convention of `axonn_jax.analysis.hlo` (full buffers, fp32). The parts are the
    dense layers (`GPTConfig.shape`, `tp.tensor.DenseLayer`) and the two LayerNorms
    (`tp.layers.Norms`), in the layout `tp.tensor.split_batch` picks for the batch. With data > 1
    the batch is split `data` ways more and each device's gradient shards are all-reduced over
    `data` (`step.reducers.exchange_collectives`), and the loss averaged. No embedding, head or
    gradient norm: the step is the blocks' alone.

    Args:
      w: the blocks' shape.
      row: devices of `row`.
      col: devices of `col`.
      depth: devices of `depth`.
      data: devices of `data`.
      platform: the backend that compiles the step (`collectives.StepShape.platform`).

    Returns:
      `{kind: bytes}` for every kind of `KINDS`.
    """
    grid = ParallelConfig(data=data, depth=depth, row=row, col=col)
    step = StepShape(grid, w.batch, w.seq, compute_bytes=4, param_bytes=4, platform=platform)
    step = dataclasses.replace(step, split=split_batch((step.layer_rows,), grid.as_dict()))
    parts = [*(layer for layer in w.config.shape(grid).layers if layer.layers),
             Norms(w.d_model, count=2, layers=w.layers)]
    found = [c for p in parts for c in p.collectives(step)]
    if data > 1:
        found += exchange_collectives([s for p in parts for s in p.parameters(step)], data)
        found.append(Collective("all-reduce", (Axis.DATA,), FP32))  # the loss
    out = dict.fromkeys(KINDS, 0.0)
    for c in found:
        if c.group(grid) > 1:
            out[c.kind] += c.size * c.count
    return {k: int(round(v)) for k, v in out.items()}


def _init_placed(model, mesh, specs_fn, w: BlockShape):
    x = jnp.zeros((w.batch, w.seq, w.d_model), jnp.float32)
    init = lambda key: model.init(key, x)["params"]
    abstract = jax.eval_shape(init, jax.random.key(0))
    specs = specs_fn(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.jit(lambda k: nn.unbox(init(k)), out_shardings=shardings)(jax.random.key(0))
    return params, shardings


def axonn_variant(w: BlockShape, grid: tuple[int, ...], devices):
    """A variant for AxoNN on grid (row, col, depth[, data]).

    With data > 1 the step is the trainer's: manual over `data`, gradients all-reduced explicitly.

    Args:
      w: the blocks' shape.
      grid: `(row, col, depth)` or `(row, col, depth, data)`.
      devices: the 8 devices.

    Returns:
      (name, jitted step, params, x): `x` of shape `(batch, seq, d_model)`, batch split over
      `data` and `depth`, features over `col`.
    """
    row, col, depth, data = (*grid, 1)[:4]
    mesh = make_mesh(ParallelConfig(data=data, row=row, col=col, depth=depth), devices)
    model = parallelize(Blocks(w.config), mesh)
    params, shardings = _init_placed(model, mesh, nn.get_partition_spec, w)
    x_sharding = NamedSharding(mesh, P((Axis.DATA, Axis.DEPTH), None, Axis.COL))
    local_grads = loss_and_grads = jax.value_and_grad(_loss(model))
    if data > 1:
        def local(params, x):
            loss, grads = local_grads(to_varying(params, (Axis.DATA,)), x)
            return jax.lax.pmean(loss, Axis.DATA), jax.lax.pmean(grads, Axis.DATA)

        loss_and_grads = shard_map(local, mesh=mesh, in_specs=(P(), P(Axis.DATA)),
                                   out_specs=(P(), P()),
                                   axis_names={Axis.DATA})
    step = jax.jit(loss_and_grads, in_shardings=(shardings, x_sharding),
                   out_shardings=(NamedSharding(mesh, P()), shardings))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (w.batch, w.seq, w.d_model)), x_sharding)
    name = f"axonn row={row} col={col} depth={depth}" + (f" data={data}" if data > 1 else "")
    return name, step, params, x


# Megatron layout per dense layer: column-parallel (out split) or row-parallel (in split).
_COLUMN = ("query", "key", "value", "mlp_up")


def _gspmd_specs(abstract, tp: str | None, fsdp: str | None):
    """PartitionSpecs (leading layer axis first) for Megatron TP over `tp` and/or ZeRO-3 over
    `fsdp` (the dimension TP leaves whole, or the first one)."""
    def spec(path, leaf):
        keys = [k.key for k in path]
        layer, name = keys[-2], keys[-1]
        dims = [None] * (leaf.ndim - 1)
        if tp and layer in _COLUMN:
            dims[-1] = tp  # kernel (in, out) or bias (out,): out split
        elif tp and name == "kernel" and layer in ("attn_out", "mlp_down"):
            dims[0] = tp
        if fsdp:
            free = [i for i, d in enumerate(dims) if d is None]
            if free:
                dims[free[0]] = fsdp
        return P(None, *dims)
    return jax.tree_util.tree_map_with_path(spec, abstract)


GSPMD_BASELINES = {  # name: (mesh shape, axis names, tp axis, fsdp axis, batch axis)
    "gspmd megatron tp=8": ((8,), ("tp",), "tp", None, None),
    "gspmd fsdp=8": ((8,), ("fsdp",), None, "fsdp", "fsdp"),
    "gspmd fsdp=2 x tp=4": ((2, 4), ("fsdp", "tp"), "tp", "fsdp", "fsdp"),
    "gspmd fsdp=4 x tp=2": ((4, 2), ("fsdp", "tp"), "tp", "fsdp", "fsdp"),
    "gspmd dp=2 x tp=4": ((2, 4), ("dp", "tp"), "tp", None, "dp"),
    "gspmd dp=4 x tp=2": ((4, 2), ("dp", "tp"), "tp", None, "dp"),
    "gspmd dp=8": ((8,), ("dp",), None, None, "dp"),
}


def gspmd_variant(w: BlockShape, name: str, devices):
    """A GSPMD baseline variant: `jax.jit` and `NamedSharding` only.

    Args:
      w: the blocks' shape.
      name: a key of `GSPMD_BASELINES`.
      devices: the 8 devices.

    Returns:
      (name, jitted step, params, x): `x` of shape `(batch, seq, d_model)`, batch split over the
      baseline's batch axis.
    """
    shape, axes, tp, fsdp, batch = GSPMD_BASELINES[name]
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), axes)
    model = Blocks(w.config)
    params, shardings = _init_placed(model, mesh, lambda a: _gspmd_specs(a, tp, fsdp), w)
    x_sharding = NamedSharding(mesh, P(batch))
    step = jax.jit(jax.value_and_grad(_loss(model)), in_shardings=(shardings, x_sharding),
                   out_shardings=(NamedSharding(mesh, P()), shardings))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (w.batch, w.seq, w.d_model)), x_sharding)
    return name, step, params, x


def measure(name, step, params, x, repeats: int) -> dict:
    """Compile a variant's step and measure its collective bytes, peak memory and step time.

    Args:
      name: the variant's name.
      step: its jitted step.
      params: its placed parameters.
      x: its placed input.
      repeats: timed runs after one warm-up (0: bytes and memory only, nothing runs).

    Returns:
      `{"name", "collective_bytes", "total_bytes", "wire_bytes", "peak_bytes",
      "flops_per_device", "step_time_s", "loss"}` (the median step time; None without runs).
    """
    compiled = step.lower(params, x).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0) or (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes)
    loss, times = None, []
    if repeats:  # repeats = 0: bytes and memory only, nothing runs
        loss = float(jax.block_until_ready(compiled(params, x))[0])  # warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - t0)
    by_kind = collective_bytes(text)
    return {"name": name, "collective_bytes": by_kind, "total_bytes": sum(by_kind.values()),
            "wire_bytes": sum(wire_bytes(text).values()), "peak_bytes": int(peak),
            "flops_per_device": compiled_flops(compiled),
            "step_time_s": statistics.median(times) if times else None, "loss": loss}


def run(w: BlockShape, devices=None, repeats: int = 3, grids=None, baselines=None, log=print) -> dict:
    """Measure every variant.

    Args:
      w: the blocks' shape.
      devices: 8 devices (None: `jax.devices()`).
      repeats: timed runs per variant (`measure`).
      grids: AxoNN's grids (None: `AXONN_GRIDS`).
      baselines: names of `GSPMD_BASELINES` (None: all).
      log: prints one line per variant.

    Returns:
      The JSON-able results: device, workload, repeats and one row per variant.

    Raises:
      ValueError: not 8 devices.
      RuntimeError: the variants disagree on the loss.
    """
    devices = list(devices or jax.devices())
    if len(devices) != 8:
        raise ValueError(f"the benchmark compares layouts on 8 devices, got {len(devices)}")
    rows = []
    for grid in grids or AXONN_GRIDS:
        r = measure(*axonn_variant(w, grid, devices), repeats)
        r["analytic_bytes"] = analytic_bytes(w, *grid,
                                             platform="cpu" if devices[0].platform == "cpu" else "gpu")
        r["analytic_total"] = sum(r["analytic_bytes"].values())
        r["measured_over_analytic"] = r["total_bytes"] / r["analytic_total"]
        rows.append(r)
        log(f"{r['name']}: {r['total_bytes'] / 2**20:.2f} MiB (analytic {r['analytic_total'] / 2**20:.2f})")
    for name in baselines or GSPMD_BASELINES:
        r = measure(*gspmd_variant(w, name, devices), repeats)
        rows.append(r)
        log(f"{r['name']}: {r['total_bytes'] / 2**20:.2f} MiB")
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    if losses and max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise RuntimeError(f"variants disagree on the loss: {sorted(losses)}")
    device = f"{len(devices)} simulated CPU devices" if devices[0].platform == "cpu" \
        else f"{len(devices)} × {devices[0].device_kind}"
    return {"device": device, "workload": dataclasses.asdict(w), "repeats": repeats, "results": rows}


def markdown(report: dict) -> str:
    """The results page of a `run` report: one table row per variant, bytes in MiB.

    Args:
      report: what `run` returns.

    Returns:
      The page's markdown.
    """
    w = report["workload"]
    lines = [f"# Tensor parallelism: axonn_jax vs GSPMD ({report['device']})", "",
             f"{w['layers']} GPT block(s), d_model={w['d_model']}, heads={w['heads']}, batch={w['batch']}, "
             f"seq={w['seq']}, fp32; one step = loss and all parameter gradients. Bytes: per device "
             "per step, full buffers, from the compiled HLO; analytic: AxoNN's algorithm "
             "(`axonn_jax.analysis.gspmd.analytic_bytes`).", "",
             "| variant | all-reduce MiB | all-gather MiB | reduce-scatter MiB | all-to-all MiB | "
             "permute MiB | total MiB | analytic MiB | measured/analytic | ring wire MiB | "
             "peak MiB | GFLOP/device | step ms |",
             "|---|" + "---:|" * 12]
    mib = lambda b: f"{b / 2**20:.2f}"
    for r in report["results"]:
        c = r["collective_bytes"]
        lines.append(
            f"| {r['name']} | " + " | ".join(mib(c[k]) for k in KINDS) + f" | {mib(r['total_bytes'])} | "
            + (f"{mib(r['analytic_total'])} | {r['measured_over_analytic']:.3f}" if "analytic_total" in r
               else "– | –")
            + f" | {mib(r['wire_bytes'])} | {mib(r['peak_bytes'])} | {r['flops_per_device'] / 1e9:.2f}"
            + (f" | {r['step_time_s'] * 1e3:.0f} |" if r["step_time_s"] is not None else " | not run |"))
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    """Bar chart of per-device collective bytes (full buffers and ring wire bytes) per variant.

    Args:
      report: what `run` returns.
      path: the image file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["name"].replace("axonn ", "axonn\n").replace("gspmd ", "gspmd\n") for r in rows]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    ax.barh(y - 0.2, [r["total_bytes"] / 2**20 for r in rows], 0.4, label="collective buffers")
    ax.barh(y + 0.2, [r["wire_bytes"] / 2**20 for r in rows], 0.4, label="ring wire bytes")
    ax.set_yticks(y, names, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("MiB per device per step")
    ax.invert_yaxis()
    ax.legend()
    ax.set_title(f"d_model={report['workload']['d_model']}, {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict, out_dir: str, stem: str = "tp_vs_gspmd") -> tuple[pathlib.Path, pathlib.Path]:
    """Write `stem.json`, `stem.md` and (when matplotlib is installed) `stem.png` under out_dir.

    Args:
      report: what `run` returns.
      out_dir: the directory (created if missing).
      stem: the files' name without extension.

    Returns:
      The paths of the JSON and markdown files.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(report, indent=1) + "\n")
    md.write_text(markdown(report))
    try:
        plot(report, out / f"{stem}.png")
    except ImportError:  # matplotlib is the optional `bench` extra
        pass
    return js, md
