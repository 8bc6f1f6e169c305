"""Plots: `axonn-jax report RUN_DIR [RUN_DIR ...]` (curves of one or several runs, overlaid, and a
markdown summary) and `axonn-jax plan ... --plot FILE.png` (the planner's ranked grids).

A run's figures are FIGSIZE inches at DPI dots per inch (800 × 450 pixels); the plan's is 1200
pixels wide and 160 + 35 per grid high. Drawn with matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import statistics
from typing import Any

from ..config import AXES, Axis
from . import rundir

FIGSIZE = (8, 4.5)
DPI = 100
MiB = 2**20


def pyplot():
    """`matplotlib.pyplot` on the Agg backend.

    Returns:
      The `matplotlib.pyplot` module.

    Raises:
      ValueError: (one line) matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclasses.dataclass
class Run:
    """One run directory: its name, `config.yaml` (None when absent) and `metrics.jsonl` records."""

    name: str
    path: pathlib.Path
    config: Any  # run.options.RunConfig | None
    records: list[dict]

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Run":
        """The run in a run directory; a cut-off last line of `metrics.jsonl` is skipped.

        Args:
          path: the run directory.

        Returns:
          The `Run`, named by the directory.

        Raises:
          FileNotFoundError: the directory has no `metrics.jsonl`.
          ValueError: a line other than the last is not JSON, or it holds no steps yet.
        """
        from . import config as config_lib

        path = pathlib.Path(path)
        metrics = path / rundir.METRICS
        if not metrics.is_file():
            raise FileNotFoundError(f"{str(path)!r} is not a run directory: it has no {rundir.METRICS}")
        lines, records = metrics.read_text().splitlines(), []
        for i, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines):  # the last line of a running job may be cut off
                    raise ValueError(f"{metrics}:{i} is not a JSON object") from None
        if not records:
            raise ValueError(f"{metrics} holds no steps yet")
        config = config_lib.load_file(path / rundir.CONFIG) if (path / rundir.CONFIG).is_file() \
            else None
        return cls(path.resolve().name, path, config, records)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that hold `key`.

        Args:
          key: a metric's name in `metrics.jsonl`.

        Returns:
          `(steps, values)`, two lists of the records where `key` is not None.
        """
        rows = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in rows], [v for _, v in rows]

    @property
    def unit(self) -> str:
        """"tokens" for language models, else "examples"."""
        return "tokens" if any("tokens_per_s" in r for r in self.records) else "examples"

    def per_step(self) -> float:
        """Tokens (or examples) per step: throughput × step time of the first record.

        Returns:
          The count, rounded.
        """
        r = self.records[0]
        return round(r[f"{self.unit}_per_s"] * r["step_time_s"])


def _figure(plt, title: str, xlabel: str, ylabel: str):
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(plt, fig, ax, path: pathlib.Path) -> pathlib.Path:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _loss(plt, runs: list[Run], path: pathlib.Path, by_data: bool) -> pathlib.Path:
    unit = runs[0].unit
    fig, ax = _figure(plt, "loss", f"{unit} seen" if by_data else "step", "loss")
    for i, run in enumerate(runs):
        scale = run.per_step() if by_data else 1
        for key, style in (("loss", "-"), ("val_loss", "o--")):
            steps, values = run.series(key)
            if steps:
                ax.plot([s * scale for s in steps], values, style, color=f"C{i}", markersize=3,
                        label=f"{run.name} {'validation' if key == 'val_loss' else 'train'}")
    return _save(plt, fig, ax, path)


def _curves(plt, runs: list[Run], path: pathlib.Path, title: str, ylabel: str,
            keys: list[tuple[str, str]], scale: float = 1.0) -> pathlib.Path | None:
    """One curve per (run, key) against the step; None when no run has any of `keys`."""
    fig, ax = _figure(plt, title, "step", ylabel)
    drawn = False
    for i, run in enumerate(runs):
        for j, (key, label) in enumerate(keys):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, [v / scale for v in values], ["-", "--", ":", "-."][j % 4],
                        color=f"C{i}", label=f"{run.name} {label}" if label else run.name)
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_ylim(bottom=0)
    return _save(plt, fig, ax, path)


def plot_runs(runs: list[Run], out: pathlib.Path) -> list[pathlib.Path]:
    """Draw the PNGs of `runs`, overlaid, in `out`.

    Args:
      runs: the runs (the first one's unit, tokens or examples, labels the axes).
      out: the directory (created).

    Returns:
      The files written: loss against steps and against data seen, throughput, memory and
      gradient norm (those the records hold).
    """
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    unit = runs[0].unit
    files = [_loss(plt, runs, out / "loss.png", by_data=False),
             _loss(plt, runs, out / f"loss_vs_{unit}.png", by_data=True),
             _curves(plt, runs, out / "throughput.png", "throughput", f"{unit}/s",
                     [(f"{unit}_per_s", "")]),
             _curves(plt, runs, out / "memory.png", "memory per device", "MiB",
                     [("memory_peak_bytes", "peak in use"), ("memory_bytes_in_use", "in use"),
                      ("peak_bytes_compiled", "compiled peak"),
                      ("state_bytes_device", "train state")], scale=MiB),
             _curves(plt, runs, out / "grad_norm.png", "gradient norm (before clipping)",
                     "global norm", [("grad_norm", "")])]
    return [f for f in files if f is not None]


def _grid(config) -> str:
    if config is None:
        return "–"
    return "×".join("?" if s is None else str(s) for s in config.grid.sizes().values())


def summary(runs: list[Run], images: list[pathlib.Path]) -> str:
    """A markdown table of the runs and the images.

    Args:
      runs: the runs.
      images: the PNGs to show below the table (named relative to the markdown file).

    Returns:
      The markdown: a row per run (model, grid, last losses, median throughput and step time,
      peak memory, parameters), then the images.
    """
    lines = ["# Runs", "", f"| run | model | grid ({'×'.join(AXES)}) | steps | loss | val_loss | "
             f"median {runs[0].unit}/s | median step ms | peak MiB/device | parameters |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        last = run.records[-1]
        val = run.series("val_loss")[1]
        rate = run.series(f"{run.unit}_per_s")[1]
        peak = max(run.series("memory_peak_bytes")[1] or run.series("peak_bytes_compiled")[1]
                   or [0])
        lines.append(
            f"| {run.name} | {run.config.model.name if run.config else '–'} | {_grid(run.config)} "
            f"| {last['step']} "
            f"| {last['loss']:.4f} | {f'{val[-1]:.4f}' if val else '–'} | "
            f"{statistics.median(rate):,.0f} | "
            f"{statistics.median(run.series('step_time_s')[1]) * 1e3:.1f} | {peak / MiB:,.1f} | "
            f"{last.get('num_params', 0):,} |")
    lines += ["", *(f"![{image.stem}]({image.name})" for image in images), ""]
    return "\n".join(lines)


def report(run_dirs: list[str], out: str | None = None) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """Write the plots and `report.md` of the runs.

    Args:
      run_dirs: the run directories.
      out: where they go (default: `RUN_DIR/plots` for one run; for several, `report-<time>`
        beside the first).

    Returns:
      `(markdown file, PNGs)`.
    """
    runs = [Run.load(d) for d in run_dirs]
    if out is None:
        first = pathlib.Path(run_dirs[0])
        out = first / rundir.PLOTS if len(runs) == 1 else \
            first.parent / f"report-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out = pathlib.Path(out)
    images = plot_runs(runs, out)
    md = out / "report.md"
    md.write_text(summary(runs, images))
    return md, images


_LEGEND_ABOVE = dict(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=7, fontsize=7, frameon=False,
                     handlelength=1.2, columnspacing=0.8)


_AXIS_COLORS = {Axis.DATA: "tab:orange", Axis.PIPE: "tab:green", Axis.DEPTH: "tab:red",
                Axis.ROW: "tab:purple", Axis.COL: "tab:brown"}
_MEMORY_COLORS = {"params": "#66c2a5", "grads": "#fc8d62", "optimizer": "#8da0cb",
                  "compression": "#a6d854", "activations": "#e78ac3"}


def _stacked_bars(ax, y, parts) -> None:
    """Horizontal bars at `y`, stacked from `parts` [(label, color, widths)]; all-zero parts are
    left out of the bars and the legend."""
    left = [0.0] * len(y)
    for label, color, widths in parts:
        if any(widths):
            ax.barh(y, widths, left=left, label=label, color=color)
            left = [a + b for a, b in zip(left, widths)]


def plot_plan(predictions, device_memory: float, title: str, path: str | pathlib.Path,
              ) -> pathlib.Path:
    """Draw the planner's ranked grids as a PNG.

    One bar chart shows the predicted step time split into compute, exposed communication by
    mesh axis and pipeline bubble; the other, memory per device by component against the
    device's capacity.

    Args:
      predictions: `analysis.comm_model.Prediction`s, best first.
      device_memory: the device's capacity in bytes.
      title: the figure's title.
      path: the PNG (its directory is created).

    Returns:
      The PNG's path.
    """
    plt = pyplot()
    n = len(predictions)
    labels = [f"{i}. {'×'.join(map(str, p.grid.shape))}" + (f" M={p.microbatches}" if
              p.microbatches > 1 else "") for i, p in enumerate(predictions, 1)]
    axes_seen = sorted({a for p in predictions for a in p.exposed_comm_by_axis},
                       key=lambda a: [AXES.index(x) for x in a.split("+")])
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.35 * n), sharey=True,
                                          gridspec_kw={"width_ratios": [3, 2]},
                                          layout="constrained")
    y = list(range(n))
    # Fixed colors: a part (or an axis) keeps its color whichever grids are shown.
    parts = [("compute", "tab:blue", [p.compute_s for p in predictions])]
    parts += [(f"comm {a}", _AXIS_COLORS.get(a, "tab:olive"),
               [p.exposed_comm_by_axis.get(a, 0.0) for p in predictions]) for a in axes_seen]
    parts += [("bubble", "tab:gray", [p.bubble_s for p in predictions])]
    _stacked_bars(time_ax, y, parts)
    time_ax.set_yticks(y, labels, fontsize=8)
    time_ax.set_ylabel(f"grid ({'×'.join(AXES)})", fontsize=8)
    time_ax.invert_yaxis()
    time_ax.set_xlabel("predicted step time (s)")
    time_ax.legend(**_LEGEND_ABOVE)
    _stacked_bars(mem_ax, y, [(c, color, [p.memory_breakdown.get(c, 0.0) / 1e9 for p in predictions])
                              for c, color in _MEMORY_COLORS.items()])
    mem_ax.axvline(device_memory / 1e9, color="red", linestyle="--", label="device capacity")
    mem_ax.set_xlabel("memory per device (GB)")
    mem_ax.legend(**_LEGEND_ABOVE)
    fig.suptitle(title, fontsize=10)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
