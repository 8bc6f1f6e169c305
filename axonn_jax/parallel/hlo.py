"""Collective bytes per device, parsed from compiled (optimized, SPMD-partitioned) HLO text.

`jax.jit(f).lower(...).compile().as_text()` is the per-device program, so every collective's result
shape is already the per-device buffer. Conventions, per device and per run of the program:

- `bytes`: the size of the full buffer the collective works on: the result of an all-reduce,
  all-gather, all-to-all or collective-permute, the input of a reduce-scatter (its result × the
  group size). Collectives over groups of one device are skipped (they move nothing).
- `wire_bytes`: what a ring algorithm sends from each device: all-reduce 2(n-1)/n·bytes,
  all-gather / reduce-scatter / all-to-all (n-1)/n·bytes, collective-permute bytes.

Collectives inside `while` loops (e.g. `nn.scan` / `lax.scan` over layers) are counted once per
iteration, using XLA's `known_trip_count`; a loop without one raises ValueError. Asynchronous pairs
(`all-gather-start` / `-done`) are counted once, at the start.
"""
from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e\d+m\d+(?:fn)?)?)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|to_apply|calls|branch_computations)=\{?([^,}]+(?:,\s*%[\w.\-]+)*)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program."""

    kind: str          # one of KINDS
    name: str          # HLO instruction name
    bytes: int         # full-buffer bytes per execution (see module docstring)
    group_size: int    # devices taking part together (2 for a permute's pair)
    executions: int    # times it runs per program run (loop trip counts multiplied)

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions

    @property
    def wire_bytes(self) -> float:
        n = self.group_size
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)
        return factor * self.total_bytes


def _array_bytes(shape_text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(n * _DTYPE_BYTES[dtype]))
    return out


def _group_size(attrs: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)  # iota form [groups, size]<=[...]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})", attrs)
    if m:
        first = m.group(1).strip("{}")
        return len(first.split(",")) if first else num_devices
    if "source_target_pairs" in attrs:
        return 2
    return num_devices


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMP_HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module with its per-device bytes and execution count."""
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(m.group(1)) if m else 1
    comps, entry = _computations(hlo_text)
    runs = {entry: 1}
    order = [entry]
    found: list[Collective] = []
    while order:
        comp = order.pop()
        for line in comps.get(comp, ()):
            instr = _INSTR.match(line)
            if not instr:
                continue
            name, shape, opcode, rest = instr.group(2), instr.group(3), instr.group(4), instr.group(5)
            times = runs[comp]
            if opcode == "while":
                trip = _TRIP.search(rest)
                if not trip:
                    raise ValueError(f"while loop {name} has no known_trip_count; cannot count "
                                     "the collectives inside it")
                times *= int(trip.group(1))
            for key, callees in _CALLEE.findall(rest):
                if key == "to_apply" and opcode != "call":
                    continue  # reduction bodies of all-reduce, reduce, ...
                for callee in re.findall(r"%?([\w.\-]+)", callees):
                    if callee in comps and callee not in runs:
                        runs[callee] = times if key != "condition" else times + 1
                        order.append(callee)
            kind = opcode.removesuffix("-start")
            if kind not in KINDS or opcode.endswith("-done"):
                continue
            group = _group_size(rest, num_devices)
            sizes = _array_bytes(shape)
            if opcode.endswith("-start") and kind != "all-reduce":
                # (operands..., results..., [contexts]): keep the results
                sizes = sizes[len(sizes) // 2: len(sizes)] if kind == "all-gather" else sizes[1:2]
            nbytes = sum(sizes) * (group if kind == "reduce-scatter" else 1)
            if group > 1 and nbytes:
                found.append(Collective(kind, name, nbytes, group, times))
    return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """`{kind: full-buffer bytes per device per program run}` for every kind in KINDS (0 if absent)."""
    out = dict.fromkeys(KINDS, 0)
    for c in collectives(hlo_text):
        out[c.kind] += c.total_bytes
    return out


def wire_bytes(hlo_text: str) -> dict[str, float]:
    """`{kind: bytes a ring algorithm sends per device per program run}`."""
    out = dict.fromkeys(KINDS, 0.0)
    for c in collectives(hlo_text):
        out[c.kind] += c.wire_bytes
    return out
