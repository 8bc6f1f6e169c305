"""Bytes moved by the collectives of a compiled XLA program, read from its HLO text.

A stopgap for the compression work until the shared HLO module lands. For each collective it counts
the result bytes (shape × dtype) and the bytes one device sends under the usual ring/bus model for a
group of g devices: all-reduce 2(g-1)/g × size, all-gather and all-to-all (g-1)/g × result,
reduce-scatter (g-1) × result, collective-permute 1 × result.
"""
from __future__ import annotations

import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(\(.*?\)|[\w\[\]{},:]+)\s+(" + "|".join(OPS) + r")(-start)?\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")


def _array_bytes(shape_text: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n * DTYPE_BYTES[dtype])
    return sizes


def _group_size(attrs: str, num_devices: int) -> int:
    if m := _GROUPS_LIST.search(attrs):
        return len(m.group(1).split(","))
    if m := _GROUPS_IOTA.search(attrs):
        return int(m.group(1))
    return num_devices  # empty replica_groups: all devices


def collective_bytes(hlo_text: str, num_devices: int) -> dict[str, dict[str, float]]:
    """{op: {'count', 'result_bytes', 'wire_bytes'}} for each collective kind, plus 'total'.

    `num_devices` is the group size assumed when an op lists no replica groups. Async `-start`
    ops are counted once (their `-done` halves are not collectives of their own); for all-gather
    and collective-permute starts, whose result tuple also holds the operand, only the output is
    counted.
    """
    out = {op: {"count": 0, "result_bytes": 0.0, "wire_bytes": 0.0} for op in (*OPS, "total")}
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        shape, op, start, attrs = m.groups()
        sizes = _array_bytes(shape)
        if start and op in ("all-gather", "collective-permute") and len(sizes) > 1:
            sizes = [sizes[1]]
        size = float(sum(sizes))
        g = _group_size(attrs, num_devices)
        factor = {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g,
                  "all-to-all": (g - 1) / g, "reduce-scatter": g - 1,
                  "collective-permute": 1.0}[op]
        for key in (op, "total"):
            out[key]["count"] += 1
            out[key]["result_bytes"] += size
            out[key]["wire_bytes"] += size * factor
    return out
