"""What the compiled H100 schedule hides of each mesh axis's communication, with its source.

The shares are measured.

`plan`'s time model (`comm_model.exposed_communication`) takes the exposed share of each
collective from here for the steps its parameter-free law (`comm_model.stream_utilisation`) does
not describe: pipelines, and steps whose layers gather their rows whole (`spmd-gathers`). The
`spmd` row is what a pipeline mode takes for an axis its case does not cross. A share is the
share of a collective's time that the train step's schedule, compiled for abstract H100s with the
library's XLA options (`step.xla_options`), hides behind compute — the replay of
`analysis.overlap` ("hidden"), summed over the collectives that cross one mesh axis.
Source: `benchmarks/overlap.py` (`--variant after`, else `library`: `shares`); the table with its
per-kind rows is `benchmarks/results/overlap.md`. Re-measure (and paste `shares`'s output here)
when the step or the XLA options change.

Per mode: `spmd` (no pipeline) from Llama-3-70B on 256 H100s (batch 1,024 × 4,096, bf16, full
recompute, collective matmuls), on data 4 × depth 16 × row 2 × col 2 and data 4 × depth 32 × row
2: an axis both measure takes the smaller share (depth hides less of its time on the second,
whose gathers move twice the bytes and hide the same time; so does row), so that `plan` promises
no grid more than a measured one hides. Measured at the scale `plan` is asked
about: the 1.9B-on-8 shares (overlap.md) over-promised 70B's step. Each pipeline schedule
(`1f1b`, `zb-h1`) from the 1.9B Llama on `data=2,pipe=2,row=2`, 4 microbatches. An axis a mode's
case does not cross takes the `spmd` figure; a collective over several axes takes the smallest of
theirs; an axis never measured (`expert`, `context`) hides nothing. `spmd-gathers`: the same two
steps without collective matmuls (`--collective-matmul off`), for a step whose layers gather their
rows whole; a pipeline mode takes its collective-matmul figures either way.
"""
from __future__ import annotations

from ..config import Axis

SOURCE = ("benchmarks/results/overlap.md: the step's schedule compiled for abstract H100s "
          "(spmd: llama3-70b on 256, two grids; pipelines: llama-1.9b on 8; seq 4096, bf16, "
          "--xla-options library, collective matmuls), replayed by analysis.overlap")

SHARES: dict[str, dict[str, float]] = {
    "spmd": {Axis.DATA: 0.966, Axis.DEPTH: 0.534, Axis.ROW: 0.43, Axis.COL: 0.789},
    "spmd-gathers": {Axis.DATA: 0.717, Axis.DEPTH: 0.445, Axis.ROW: 0.209, Axis.COL: 0.511},
    "1f1b": {Axis.DATA: 0.145, Axis.PIPE: 0.99, Axis.ROW: 0.8},
    "zb-h1": {Axis.DATA: 0.145, Axis.PIPE: 0.99, Axis.ROW: 0.782},
}
"""`{mode: {axis: hidden share of its communication time}}` (`axis_shares` of the measurement)."""


def hidden_share(axes: tuple[str, ...], mode: str = "spmd") -> float:
    """The share of a collective's time over `axes` the compiled schedule hides in `mode`.

    Args:
      axes: the mesh axes the collective crosses.
      mode: `spmd`, `spmd-gathers` or a pipeline schedule; one not measured falls back to `spmd`.

    Returns:
      The smallest share of `axes` (0 for an axis never measured, or no axes).
    """
    if not axes:
        return 0.0
    measured = {**SHARES.get("spmd", {}), **SHARES.get(mode, {})}
    return min(measured.get(a, 0.0) for a in axes)


def axis_shares(by_axes: dict[str, dict]) -> dict[str, float]:
    """`{axis: hidden share}` of one overlap report's `by_axes` rows.

    Args:
      by_axes: `{"kind over axes": row}` (`analysis.overlap.summary`), each row with `comm_s`
        and `exposed_s`.

    Returns:
      Per single mesh axis, 1 − exposed / communication time over its collectives, rounded to
      3 places.
    """
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    for key, row in by_axes.items():
        axes = key.split(" over ")[1].split("+")
        if len(axes) == 1 and axes[0] != "none":
            comm[axes[0]] = comm.get(axes[0], 0.0) + row["comm_s"]
            exposed[axes[0]] = exposed.get(axes[0], 0.0) + row["exposed_s"]
    return {a: round(max(0.0, 1 - exposed[a] / comm[a]), 3) for a in comm if comm[a] > 0}
