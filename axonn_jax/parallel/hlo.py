"""Bytes moved by the collectives of a compiled XLA program, read from its optimized HLO text.

This is how every communication claim in axonn_jax is measured: exact, and independent of the
machine. Collectives inside `while` loops (a `lax.scan` over layers or pipeline ticks) are counted
once per iteration, from the trip count XLA records on the loop; of a `conditional`'s branches the
heaviest is counted (the most loaded device runs it).

Per operation, with S the bytes of its buffer and g the devices in its group, one device sends under
the ring algorithm ("wire bytes"): all-reduce 2(g−1)/g·S; all-gather (g−1)/g·S (S the gathered
result); reduce-scatter (g−1)·S (S the scattered result, so (g−1)/g of the input); all-to-all
(g−1)/g·S; collective-permute S. `axonn_jax.parallel.comm_model` predicts the same quantities.
"""
from __future__ import annotations

import dataclasses
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w\[\]{},:]+)\s+(" + "|".join(KINDS) + r")(-start)?\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(map(re.escape, DTYPE_BYTES)) + r")\[([\d,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*?body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:call|fusion|async-start)\(.*?(?:calls|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(?:true|false)_computation=%([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


@dataclasses.dataclass
class Traffic:
    """Collectives of one kind: how many ran, their buffer bytes, and the wire bytes one device sent."""

    count: int = 0
    buffer_bytes: float = 0.0
    wire_bytes: float = 0.0

    def add(self, other: "Traffic", times: int = 1) -> None:
        self.count += other.count * times
        self.buffer_bytes += other.buffer_bytes * times
        self.wire_bytes += other.wire_bytes * times


def _array_bytes(shape_text: str) -> list[float]:
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
        return int(m.group(2))
    return num_devices  # `replica_groups={}`: every device


def _wire_factor(kind: str, g: int) -> float:
    if kind == "collective-permute":
        return 1.0
    if g <= 1:
        return 0.0
    return {"all-reduce": 2 * (g - 1) / g, "all-gather": (g - 1) / g, "all-to-all": (g - 1) / g,
            "reduce-scatter": g - 1}[kind]


def _op_traffic(line: str, num_devices: int) -> tuple[str, Traffic] | None:
    m = _OP.search(line)
    if not m:
        return None
    shape, kind, start, attrs = m.groups()
    sizes = _array_bytes(shape)
    if start and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
        # async start ops return (operands..., results..., [contexts]): keep the results
        arrays = len(sizes) - (2 if kind == "collective-permute" and len(sizes) >= 4 else 0)
        sizes = sizes[arrays // 2: arrays]
    size = float(sum(sizes))
    g = _group_size(attrs, num_devices)
    return kind, Traffic(1, size, size * _wire_factor(kind, g))


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line.strip())
            if m:
                current = m.group(1)
                computations[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            computations[current].append(line)
    return computations, entry


def collective_traffic(hlo_text: str, num_devices: int) -> dict[str, Traffic]:
    """Per collective kind, the traffic of one execution of the program on the busiest device.

    hlo_text: optimized HLO (`jax.jit(f).lower(...).compile().as_text()`); num_devices: the group
    size of a collective that lists no replica groups.
    """
    computations, entry = _split_computations(hlo_text)
    memo: dict[str, dict[str, Traffic]] = {}

    def total(name: str, stack: tuple[str, ...] = ()) -> dict[str, Traffic]:
        if name in memo:
            return memo[name]
        out = {k: Traffic() for k in KINDS}
        if name in stack or name not in computations:
            return out
        for line in computations[name]:
            op = _op_traffic(line, num_devices)
            if op:
                out[op[0]].add(op[1])
                continue
            if m := _WHILE.search(line):
                trip = _TRIP.search(line)
                times = int(trip.group(1)) if trip else 1
                for k, t in total(m.group(1), stack + (name,)).items():
                    out[k].add(t, times)
                continue
            branches = _TRUE_FALSE.findall(line)
            if m := _BRANCHES.search(line):
                branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
            if branches:
                heaviest = max((total(b, stack + (name,)) for b in branches),
                               key=lambda t: sum(x.wire_bytes for x in t.values()))
                for k, t in heaviest.items():
                    out[k].add(t)
                continue
            if m := _CALLS.search(line):
                for k, t in total(m.group(1), stack + (name,)).items():
                    out[k].add(t)
        memo[name] = out
        return out

    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return total(entry)


def collective_bytes(hlo_text: str, num_devices: int) -> dict[str, float]:
    """Wire bytes one device sends per execution, by collective kind (see the module docstring)."""
    return {k: t.wire_bytes for k, t in collective_traffic(hlo_text, num_devices).items()}


def compiled_collective_bytes(jitted, *args, num_devices: int | None = None) -> dict[str, float]:
    """`collective_bytes` of `jitted` compiled for `args` (`jitted` a `jax.jit` function)."""
    import jax

    text = jitted.lower(*args).compile().as_text()
    return collective_bytes(text, num_devices or jax.device_count())
