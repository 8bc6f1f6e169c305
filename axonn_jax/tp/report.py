"""What `axonn_jax.parallelize` did with each parameter: `SplitReport`, the one-line notes about
weights left whole, and the `max_replicated` check.

Nothing stays replicated silently: a table too small for the grid is named in a note; weights that
no parallel layer used (a module `parallelize` does not know, computing with `dot_general` itself)
are named together in one note suggesting a rule; `max_replicated` turns any whole weight above a
size into an error; `report=True` prints the whole table and `report=callable` receives it.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
from jax.sharding import PartitionSpec as P
from ..config import TENSOR_AXES, Axis

logger = logging.getLogger("axonn_jax.parallelize")

RULE_NOTE = "kept whole by a Replicated rule"


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """One parameter of a `SplitReport` and how it is placed.

    Attributes:
      path: the parameter's `/`-joined path.
      shape: its global shape.
      dtype: its dtype's name.
      spec: its placement over the mesh.
      parts: the number of devices it is split over (1: whole on every device).
      note: why it stays whole.
    """

    path: str
    shape: tuple
    dtype: str
    spec: P
    parts: int
    note: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) parameter."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def device_nbytes(self) -> int:
        """Bytes of this parameter on each device."""
        return self.nbytes // self.parts

    @property
    def size(self) -> int:
        """Elements of the whole (global) parameter."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class SplitReport:
    """Every parameter of a parallelized model and how it is split (`str()` gives a table)."""

    params: tuple[ParamSplit, ...]
    tensor_devices: int = 0
    """depth × row × col of the mesh (1: nothing can be split; 0: not known)."""

    @property
    def replicated(self) -> tuple[ParamSplit, ...]:
        """The parameters whole on every device."""
        return tuple(p for p in self.params if p.parts == 1)

    @property
    def replicated_bytes(self) -> int:
        """Bytes every device holds in whole parameters."""
        return sum(p.nbytes for p in self.replicated)

    @property
    def device_bytes(self) -> int:
        """Parameter bytes on each device."""
        return sum(p.device_nbytes for p in self.params)

    @property
    def total_bytes(self) -> int:
        """Bytes of all the parameters, whole."""
        return sum(p.nbytes for p in self.params)

    def __getitem__(self, path: str) -> ParamSplit:
        for p in self.params:
            if p.path == path:
                return p
        raise KeyError(path)

    def __str__(self) -> str:
        width = max([len(p.path) for p in self.params] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':<16} {'split':<32} {'per device':>12}  note"]
        for p in self.params:
            spec = ", ".join(str(e) for e in p.spec) or "whole"
            lines.append(f"{p.path:<{width}}  {str(p.shape):<16} {spec:<32} "
                         f"{_size(p.device_nbytes):>12}  {p.note}")
        lines.append(f"{len(self.params)} parameters, {_size(self.total_bytes)}: "
                     f"{_size(self.device_bytes)} per device, of which "
                     f"{_size(self.replicated_bytes)} in {len(self.replicated)} whole parameters")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parts_of(spec: P, sizes) -> int:
    """The number of devices a parameter placed by `spec` is split over.

    Args:
      spec: the parameter's PartitionSpec.
      sizes: `{mesh axis: size}`.

    Returns:
      The product of the sizes of the axes named in `spec` (1: whole on every device).
    """
    axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    return math.prod(sizes[a] for a in axes)


def build(entries, sizes) -> SplitReport:
    """A report from `(path, shape, dtype, spec, note)` tuples.

    Args:
      entries: `(path, shape, dtype, spec, note)` of each parameter.
      sizes: `{mesh axis: size}`.

    Returns:
      The `SplitReport`, with `tensor_devices` = depth × row × col of `sizes`.
    """
    return SplitReport(tuple(ParamSplit(path, tuple(shape), str(np.dtype(dtype)), spec,
                                        parts_of(spec, sizes), note)
                             for path, shape, dtype, spec, note in entries),
                       int(np.prod([sizes.get(a, 1) for a in TENSOR_AXES])))


def act(report: SplitReport, report_to, max_replicated: int | None, what: str = "parallelize"):
    """Log the notes about whole weights, enforce `max_replicated` and hand the report on.

    Args:
      report: the parallelized model's `SplitReport`.
      report_to: True: print the report; a callable: call it with the report; False/None:
        nothing.
      max_replicated: the most elements a weight left whole may have (weights kept whole by a
        `Replicated` rule excepted); None: no limit.
      what: the caller's name, for the messages.

    Raises:
      ValueError: a whole weight holds more than `max_replicated` elements.
    """
    if max_replicated is not None:
        big = [p for p in report.replicated if p.size > max_replicated and p.note != RULE_NOTE]
        if big:
            raise ValueError(
                f"{what}: {len(big)} parameter(s) above max_replicated = {max_replicated} elements "
                "would stay whole on every device: " + ", ".join(
                    f"'{p.path}' {p.shape} ({p.note or 'no tensor-parallel layer used it'})"
                    for p in big))
    # a one-device tensor grid (fp8 runs the tensor-parallel kernels there) splits nothing: no notes
    whole = report.replicated if report.tensor_devices != 1 else ()
    for p in whole:
        if p.note and p.note != RULE_NOTE:
            logger.warning("%s: '%s' %s stays whole on every device: %s", what, p.path, p.shape, p.note)
    unknown = [p for p in whole if not p.note and len(p.shape) >= 2]
    if unknown:
        logger.warning(
            "%s: %d weight(s) that no tensor-parallel layer used stay whole on every device "
            "(%s): %s. A module parallelize does not know computes with them: register it with "
            "rules={ModuleClass: AsDense(...)}, or mark it rules={path: Replicated()}",
            what, len(unknown), _size(sum(p.nbytes for p in unknown)),
            ", ".join(f"{p.path} {p.shape}" for p in unknown))
    if report_to is True:
        print(report)
    elif callable(report_to):
        report_to(report)
