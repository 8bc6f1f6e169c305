"""What the compiler says of a train step that never runs: memory, bytes and FLOPs per device.

`compile_step(step, batch)` compiles any `TrainStep` (`make_train_step`, or a trainer's) for its
mesh's devices — abstract H100s or simulated CPU devices (`analysis.targets`) — with abstract
parameters, optimizer state and batch (`BoundStep.abstract_state` / `abstract_batch`: nothing is
allocated), and reads the compiled program:

- memory per device from `compiled.memory_analysis()`: arguments, outputs, temporaries (peak:
  `offload.activations.compiled_peak_bytes`), and the host-memory side (`pinned_host` state,
  offloaded activations; on CPU targets host and device are one pool and it is all device);
- collective wire bytes per device by kind and by the mesh axes each collective spans
  (`analysis.hlo`: loop bodies counted per iteration), the convention of `comm_model`;
- FLOPs per device (`hlo.flops`, cuDNN's fused attention included), beside the model's ideal;
- compile time, and `fits`: the peak against the device's memory.

`CompileReport.predicted` holds `plan`'s figures under the same names (`comm_model.Prediction`),
so `axonn-jax compile --json` shows them side by side and `disagreements` names where they part.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable, Iterable

from ..mesh import config_of
from ..offload.activations import compiled_peak_bytes
from . import hlo, overlap as overlap_lib
from .targets import compile_options

FIELDS = ("memory_per_device_bytes", "host_memory_per_device_bytes", "comm_bytes_per_device",
          "flops_per_device", "fits")
"""The figures both a compile report and `plan`'s prediction give, under these names."""


@dataclasses.dataclass
class CompileReport:
    """One compiled step's figures: bytes and FLOPs per device per step.

    `comm_bytes_per_device`: `{kind: wire bytes}`; `comm_bytes_by_axes`:
    `{"kind over axis+axis": wire bytes}`.
    """

    target: str
    devices: int
    grid: dict
    microbatches: int
    memory_per_device_bytes: int
    host_memory_per_device_bytes: int
    memory_breakdown: dict
    capacity_bytes: float
    comm_bytes_per_device: dict
    comm_bytes_by_axes: dict
    flops_per_device: float
    compile_s: float
    lower_s: float
    model_flops_per_device: float | None = None
    predicted: dict | None = None
    overlap: dict | None = None
    """The schedule replayed (`analysis.overlap.Schedule.as_dict`): what hides each collective."""
    remat: str = "none"

    @property
    def fits(self) -> bool:
        """Whether the device peak fits `capacity_bytes`."""
        return self.memory_per_device_bytes <= self.capacity_bytes

    def as_dict(self) -> dict:
        """The report's fields and `fits`, as `axonn-jax compile --json` writes them.

        Returns:
          A JSON-ready dict.
        """
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        return out

    def verdict(self) -> str | None:
        """One line when the step does not fit (None when it does).

        Returns:
          The grid, its peak and its parts against the target's memory, or None.
        """
        if self.fits:
            return None
        grid = ",".join(f"{k}={v}" for k, v in self.grid.items() if v > 1) or "one device"
        return (f"grid {grid} does not fit: {self.memory_per_device_bytes / 1e9:.1f} GB per device "
                f"(arguments {self.memory_breakdown['arguments'] / 1e9:.1f}, temporaries "
                f"{self.memory_breakdown['temporaries'] / 1e9:.1f}) > "
                f"{self.capacity_bytes / 1e9:.0f} GB on {self.target}")


def memory(compiled) -> dict:
    """Bytes per device of a compiled program: device peak, host total and their parts.

    Args:
      compiled: a `jax.stages.Compiled`.

    Returns:
      `{"peak": bytes, "host": bytes, "breakdown": {part: bytes}}` from its
      `memory_analysis()` (peak: `offload.activations.compiled_peak_bytes`).
    """
    m = compiled.memory_analysis()
    host = (m.host_argument_size_in_bytes + m.host_output_size_in_bytes
            - m.host_alias_size_in_bytes + m.host_temp_size_in_bytes)
    return {"peak": compiled_peak_bytes(compiled), "host": int(host), "breakdown": {
        "arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
        "code": m.generated_code_size_in_bytes,
        "host_arguments": m.host_argument_size_in_bytes,
        "host_outputs": m.host_output_size_in_bytes, "host_aliased": m.host_alias_size_in_bytes,
        "host_temporaries": m.host_temp_size_in_bytes}}


def communication(text: str, mesh_shape: dict[str, int]) -> tuple[dict, dict]:
    """Wire bytes per device of a compiled module, by kind and by kind and mesh axes.

    Args:
      text: the compiled module's HLO text.
      mesh_shape: `{axis: size}` of its mesh.

    Returns:
      (`{kind: wire bytes}`, `{"kind over axes": wire bytes}`).
    """
    by_axes = {f"{kind} over {'+'.join(axes) or 'none'}": b
               for (kind, axes), b in sorted(hlo.bytes_by_axes(text, mesh_shape).items())}
    return hlo.wire_bytes(text), by_axes


def compile_step(step, batch, *, capacity_bytes: float, dump_hlo: str | None = None,
                 name: str = "train_step", machine=None) -> tuple[CompileReport, Any]:
    """Compile `step` for batches like `batch` on its mesh, from abstract state.

    Args:
      step: a `TrainStep`.
      batch: this process's share of a batch: arrays or ShapeDtypeStructs.
      capacity_bytes: the target device's memory (what `fits` compares to).
      dump_hlo: a directory for the compiled module's text (`NAME.txt`), or None.
      name: the module's file name without `.txt`.
      machine: replay the schedule on it (`analysis.overlap`, the report's `overlap`), or None.

    Returns:
      (report, compiled program).
    """
    bound = step.bind(batch)
    state, abstract = bound.abstract_state(), bound.abstract_batch()
    t0 = time.perf_counter()
    lowered = bound.lower(state, abstract)
    t1 = time.perf_counter()
    compiled = lowered.compile(compile_options(step.mesh.devices.flat[0]))
    t2 = time.perf_counter()
    text = compiled.as_text()
    if dump_hlo:
        path = pathlib.Path(dump_hlo)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.txt").write_text(text)
    grid = config_of(step.mesh)
    mem = memory(compiled)
    kinds, axes = communication(text, grid.as_dict())
    device = step.mesh.devices.flat[0]
    target = "h100" if device.platform == "gpu" else device.platform
    report = CompileReport(target, grid.num_devices, grid.as_dict(), step.options.microbatches,
                           mem["peak"], mem["host"], mem["breakdown"], capacity_bytes, kinds, axes,
                           hlo.flops(text), t2 - t1, t1 - t0,
                           remat=remat if isinstance(remat := step.options.remat, str) else "plan")
    if machine is not None:
        report.overlap = overlap_lib.report(text, grid.as_dict(), machine).as_dict()
    return report, compiled


def predicted(prediction) -> dict:
    """The `FIELDS` of a `comm_model.Prediction` (and its breakdown), as `plan --json` gives them.

    Args:
      prediction: a `comm_model.Prediction`.

    Returns:
      `FIELDS`, `memory_breakdown`, `step_time_s` and `mfu` of its `as_dict`.
    """
    out = prediction.as_dict()
    return {k: out[k] for k in (*FIELDS, "memory_breakdown", "step_time_s", "mfu")}


def disagreements(report: CompileReport, tolerance: float = 0.10) -> list[str]:
    """Each figure where `plan`'s prediction and the compiler differ by more than `tolerance`.

    Args:
      report: a compile report with its `predicted` figures.
      tolerance: the largest relative difference (to the compiled figure) let pass.

    Returns:
      One line each: memory, host memory, FLOPs, and the bytes of every collective kind either
      side has; none without a prediction.
    """
    p = report.predicted
    if p is None:
        return []
    pairs = [("memory per device", report.memory_per_device_bytes, p["memory_per_device_bytes"]),
             ("host memory per device", report.host_memory_per_device_bytes,
              p["host_memory_per_device_bytes"]),
             ("FLOPs per device", report.flops_per_device, p["flops_per_device"])]
    kinds = sorted(set(report.comm_bytes_per_device) | set(p["comm_bytes_per_device"]))
    pairs += [(f"{k} bytes", report.comm_bytes_per_device.get(k, 0.0),
               p["comm_bytes_per_device"].get(k, 0.0)) for k in kinds]
    out = []
    for what, got, want in pairs:
        if abs(got - want) > tolerance * max(abs(got), 1.0):
            ratio = f"{want / got:.2f}×" if got else "compiled 0"
            out.append(f"{what}: plan {want:.4g}, compiled {got:.4g} ({ratio})")
    return out


def compile_grids(build: Callable, grids: Iterable[tuple], *, capacity_bytes: float,
                  predict: Callable | None = None, model_flops: float | None = None,
                  dump_hlo: str | None = None, machine=None) -> list[CompileReport]:
    """Compile the step of each choice `(grid, microbatches, remat mode)` of `grids`.

    Args:
      build: `build(*choice) -> (TrainStep, batch)` builds it on the target's devices.
      grids: the choices, each `(ParallelConfig, microbatches, remat mode)`.
      capacity_bytes: the target device's memory.
      predict: `predict(*choice)`: `plan`'s `Prediction` for it (None: no prediction).
      model_flops: the model's ideal FLOPs of the whole step (divided by the devices), or None.
      dump_hlo: a directory for one module per grid, named by the grid, or None.
      machine: replay each schedule on it (`compile_step`), or None.

    Returns:
      One `CompileReport` per choice, in order.
    """
    reports = []
    for choice in grids:
        grid = choice[0]
        step, batch = build(*choice)
        name = "train_step_" + "_".join(f"{k}{v}" for k, v in grid.as_dict().items())
        report, _ = compile_step(step, batch, capacity_bytes=capacity_bytes, dump_hlo=dump_hlo,
                                 name=name, machine=machine)
        if model_flops is not None:
            report.model_flops_per_device = model_flops / grid.num_devices
        if predict is not None:
            report.predicted = predicted(predict(*choice))
        reports.append(report)
    return reports


def table(reports: list[CompileReport]) -> list[list[str]]:
    """Rows (header first) of a text table of compiled figures beside `plan`'s (in brackets).

    Args:
      reports: compile reports.

    Returns:
      The rows, one per report after the header.
    """
    def gb(x):
        return f"{x / 1e9:.2f}"

    rows = [["grid", "M", "remat", "memory GB", "host GB", "comm GB", "TFLOPs", "× ideal", "compile s",
             "fits"]]
    for r in reports:
        p = r.predicted or {}
        pair = lambda got, key, fmt=gb: fmt(got) + (f" [{fmt(p[key])}]" if key in p else "")  # noqa: E731
        comm = sum(r.comm_bytes_per_device.values())
        comm_text = gb(comm) + (f" [{gb(sum(p['comm_bytes_per_device'].values()))}]" if p else "")
        ideal = f"{r.flops_per_device / r.model_flops_per_device:.2f}" \
            if r.model_flops_per_device else "-"
        rows.append(["×".join(str(v) for v in r.grid.values()), str(r.microbatches), r.remat,
                     pair(r.memory_per_device_bytes, "memory_per_device_bytes"),
                     pair(r.host_memory_per_device_bytes, "host_memory_per_device_bytes"),
                     comm_text, pair(r.flops_per_device, "flops_per_device",
                                     lambda x: f"{x / 1e12:.2f}"),
                     ideal, f"{r.compile_s:.1f}", "yes" if r.fits else "NO"])
    return rows


def overlap_table(report: CompileReport) -> list[list[str]]:
    """Rows (header first) of a compiled step's overlap (`report.overlap`).

    Args:
      report: a compile report whose schedule was replayed (`overlap` set).

    Returns:
      Per collective kind, mesh axes and link (inside a node, across nodes, the host's), the
      wire bytes, the share of them with matmul compute scheduled between start and done, the
      communication time and the share of it the schedule hides; then the whole step.
    """
    o = report.overlap
    rows = [["collectives", "link", "GB", "with compute", "comm ms", "exposed ms", "hidden"]]
    links = o.get("by_link") or {f"{k} on -": r for k, r in o["by_axes"].items()}
    for key, r in [*links.items(), ("all on -", o["total"])]:
        name, _, link = key.rpartition(" on ")
        rows.append([name, link, f"{r['bytes'] / 1e9:.2f}", f"{r['with_compute']:.0%}",
                     f"{r['comm_s'] * 1e3:.2f}", f"{r['exposed_s'] * 1e3:.2f}",
                     f"{r['hidden']:.0%}"])
    return rows
