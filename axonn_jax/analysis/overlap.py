"""How much of a compiled step's communication its schedule hides, read from the scheduled module.

A compiled GPU module is scheduled (`is_scheduled=true`): each computation lists its instructions
in the order they run, and XLA's latency-hiding scheduler splits every collective it makes
asynchronous into a `*-start` and a `*-done` (or an `async-start` / `async-done` around it) and
moves compute in between. `report(text, mesh_shape, machine)` finds every such pair and measures,
per execution:

- the compute scheduled between start and done: its FLOPs, of which matmul FLOPs (dots, grouped
  dots, cuDNN fused attention), and its time at the machine's rates (`instruction_seconds`: the
  larger of the FLOPs at the matmul or vector rate and the bytes at HBM bandwidth; a GEMM at the
  rate of the dtype its dot reads, FP8's only when both operands are float8);
- the collective's own time on its links (`comm_model.link_time`: ring or tree over NVLink within
  a node, over the NICs across nodes, as its replica group lies on the devices);
- the time it leaves exposed, from a replay of the schedule (`_Replay`): one compute stream runs
  the instructions in order, two communication streams run the collectives in the order they
  start, and a `done` waits for its collective. The streams are the two kinds of links: NVLink,
  for a collective whose group lies inside one node, and the NICs, for one whose group spans
  nodes. A node's NVLink and its NICs are separate links, and XLA runs collectives that its
  schedule has in flight together on separate GPU streams (up to `xla_options.overlap_limit`);
  two collectives on the same links share them, which the replay counts as one after the other.
- the same for copies between host and device memory (`S(5)` buffers: offloaded optimizer state,
  swapped activations): an asynchronous copy or dynamic slice / update from or to host memory
  runs on the host link, one stream per direction at the machine's `host_bw`, and its `done`
  waits for it; a synchronous one holds the compute stream for its transfer. They are reported
  as `host-to-device` and `device-to-host` over `host`. Loop bodies replay twice (the first
  iteration, then the steady state, whose pipelined collectives (a start whose done is in the next
  iteration, through the loop's carried tuple) are matched by tuple index).

`summary(overlaps)` adds them up per (collective kind, mesh axes): bytes, the share of bytes whose
window holds matmul compute ("with compute"), and the share of the communication time the schedule
hides ("hidden"). Synchronous collectives have no window and are exposed whole. All figures are per
device and per step, with loop bodies counted once per iteration (`analysis.hlo`'s convention).

The estimate is as good as its rates (the machine's published figures, `comm_model.MACHINES`) and
its model of communication (a collective on either kind of link, at that link's rate, never
slowed by the compute beside it); what it cannot be wrong about is the schedule itself: what
XLA placed between a start and its done.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from . import hlo
from .comm_model import Machine, link_time
from .hlo_module import (DTYPE_BYTES, FLOAT_DTYPES, Instruction, arrays, branch_names, called,
                         loop, read_module, shape_bytes)

_ASYNC_KINDS = {f"{op}-start": k for op, k in hlo.OPCODES.items()}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "add-dependency", "opt-barrier", "partition-id", "replica-id", "copy-start", "copy-done",
         "send", "recv", "send-done", "recv-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "reduce-scatter-done", "all-to-all-done", "async-done",
         "ragged-all-to-all-done",
         "async-update"}
_HOST = ":S(5)}"  # the layout of an array in host memory (XLA's memory space 5)
HOST_KINDS = ("host-to-device", "device-to-host")
"""The kinds of the replay's host transfers (in `Overlap.kind`, over the axis `host`)."""
HOST_COMPUTE = "host-compute"
"""The kind of a computation the host's CPU runs (XLA's HostExecute), over the axis `host`."""


@dataclasses.dataclass(frozen=True)
class Overlap:
    """One asynchronous (or synchronous) collective of the module and what hides it, per execution.

    `executions`: how often it runs per step (loop trips multiplied).
    """

    kind: str
    name: str
    axes: tuple[str, ...]
    executions: int
    wire_bytes: float
    comm_s: float
    window_flops: float
    window_matmul_flops: float
    window_s: float
    exposed_s: float
    asynchronous: bool
    backward: bool
    link: str = ""
    """What it runs on: `intra-node` (NVLink), `inter-node` (the NICs), or `host`."""

    @property
    def with_compute(self) -> bool:
        """Matmul compute is scheduled between its start and its done."""
        return self.window_matmul_flops > 0

    def as_dict(self) -> dict:
        """Its fields as a dict (`dataclasses.asdict`).

        Returns:
          `{field: value}`.
        """
        return dataclasses.asdict(self)


class _Costs:
    """FLOPs, matmul FLOPs, HBM bytes and seconds of instructions (`Machine` rates)."""

    def __init__(self, text: str, machine: Machine):
        self.module = read_module(text)  # read once, for both counters and the replay
        self.counter = hlo.FlopCounter(self.module)
        self.matmuls = hlo.FlopCounter(self.module, matmuls_only=True)
        self.comps = self.module.computations
        self.machine = machine
        self._opcodes: dict[str, set[str]] = {}
        self._wire: dict[str, float] = {}

    def wire_bytes(self, comp: str, num_devices: int) -> float:
        """Wire bytes of the collectives of `comp` and what it calls (loops per trip)."""
        if comp not in self._wire:
            self._wire[comp] = 0.0
            total = 0.0
            for i in self.comps.get(comp, ()):
                c = hlo.collective(i, num_devices)
                if c:
                    total += c.wire_bytes
                elif i.opcode == "while":
                    body, trips = loop(i, "collectives")
                    total += trips * self.wire_bytes(body, num_devices)
                elif i.opcode == "conditional":
                    total += max((self.wire_bytes(b, num_devices)
                                  for b in branch_names(i.rest)), default=0.0)
                elif i.opcode in ("call", "async-start"):
                    total += sum(self.wire_bytes(c, num_devices) for c in called(i.rest))
            self._wire[comp] = total
        return self._wire[comp]

    def heaviest(self, branches: list[str], num_devices: int) -> str | None:
        """The branch `analysis.hlo` counts (the most wire bytes; then the most FLOPs)."""
        return max(branches, default=None, key=lambda b: (self.wire_bytes(b, num_devices),
                                                          self.counter.computation(b)))

    def opcodes(self, comp: str) -> set[str]:
        if comp not in self._opcodes:
            self._opcodes[comp] = {i.opcode for i in self.comps.get(comp, ())}
        return self._opcodes[comp]

    def memory_bytes(self, instr: Instruction, shapes: dict[str, str]) -> float:
        """HBM bytes a kernel reads and writes: its operands and result; a fused dynamic slice
        reads only its slice, a fused dynamic-update-slice writes only its update (in place),
        synchronous or not (`fusion-start`)."""
        operands = [shape_bytes(shapes.get(o, "")) for o in instr.operands]
        callees = called(instr.rest) if instr.opcode in ("fusion", "fusion-start") else []
        # An asynchronous fusion's (`fusion-start`, XLA:GPU in jaxlib 0.11) shape is a tuple of
        # its operands, its result and a context: it writes only its computation's result.
        result = shape_bytes(self.comps[callees[0]][-1].shape if instr.opcode == "fusion-start"
                        and callees and self.comps.get(callees[0]) else instr.shape)
        inner = set().union(*(self.opcodes(c) for c in callees)) if callees else {instr.opcode}
        if len(callees) == 1 and self._root(callees[0]) == "dynamic-slice":
            return result + self._sliced_reads(callees[0], operands, result)
        if len(callees) == 1 and inner & {"dynamic-update-slice", "dynamic-slice", "slice"}:
            return self._touched(callees[0], operands)
        return sum(operands) + result

    def _touched(self, comp: str, operands: list[float]) -> float:
        """Bytes a fusion with slices (static or dynamic) or in-place updates reads and writes: an
        operand it only slices, the slices; a buffer one of its outputs updates in place (a
        dynamic-update-slice), nothing (it writes the update); every other operand and output
        whole."""
        instrs = self.comps[comp]
        by_name = {i.name: i for i in instrs}
        users: dict[str, list[Instruction]] = {}
        for i in instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)

        def through_views(name: str) -> str:
            while by_name.get(name) is not None and by_name[name].opcode in ("bitcast", "copy") \
                    and by_name[name].operands:
                name = by_name[name].operands[0]
            return name

        root = instrs[-1]
        outputs = root.operands if root.opcode == "tuple" else (root.name,)
        in_place, written = set(), 0.0
        for name in outputs:  # each output: an update in place, or written whole
            out = by_name.get(through_views(name))
            if out is not None and out.opcode == "dynamic-update-slice" and \
                    len(out.operands) > 1 and out.operands[1] in by_name:
                in_place.add(through_views(out.operands[0]))
                written += shape_bytes(by_name[out.operands[1]].shape)
            else:
                written += shape_bytes(by_name[name].shape) if name in by_name else 0.0
        reads = 0.0
        for i in instrs:
            if i.opcode != "parameter" or i.name in in_place:
                continue
            k = int(re.match(r"\s*(\d+)", i.rest).group(1))
            size = operands[k] if k < len(operands) else 0.0
            uses = list(self._uses_through_views(i.name, users))
            if uses and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == view
                            for u, view in uses):
                size = min(size, sum(shape_bytes(u.shape) for u, _ in uses))
            reads += size
        return reads + written

    def host_transfer(self, instr: Instruction, shapes: dict[str, str]) -> tuple[str, float] | None:
        """(`host-to-device` or `device-to-host`, bytes) of a copy, fusion or slice that reads
        or writes host memory (`S(5)`), as one transfer over the host link; None for others.
        A copy moves its operand; a kernel writing host memory moves what it reads from the
        device (a dynamic-update-slice: its update); one reading host memory, what it writes."""
        operands = [shapes.get(o, "") for o in instr.operands]
        from_host = any(_HOST in shape for shape in operands)
        if instr.opcode in ("copy", "copy-start"):
            to_host = _HOST in instr.shape and not from_host
            if not (to_host or from_host):
                return None
            return ("device-to-host" if to_host else "host-to-device"), shape_bytes(operands[0])
        callees = called(instr.rest) if instr.opcode.startswith("fusion") else []
        result = (self.comps[callees[0]][-1].shape if instr.opcode == "fusion-start" and callees
                  and self.comps.get(callees[0]) else instr.shape)
        if _HOST in result:
            return "device-to-host", sum(shape_bytes(shape) for shape in operands  # not indices
                                         if _HOST not in shape and "[]" not in shape)
        return ("host-to-device", shape_bytes(result)) if from_host else None

    @staticmethod
    def _uses_through_views(name: str, users: dict[str, list[Instruction]]):
        """(instruction, the name it reads) for every use of `name`, bitcasts and copies of it
        followed to their own uses."""
        for user in users.get(name, []):
            if user.opcode in ("bitcast", "copy"):
                yield from _Costs._uses_through_views(user.name, users)
            else:
                yield user, name

    def _root(self, comp: str) -> str | None:
        """The opcode of `comp`'s result, through copies and bitcasts."""
        instrs = {i.name: i for i in self.comps.get(comp, ())}
        root = self.comps[comp][-1] if self.comps.get(comp) else None
        while root is not None and root.opcode in ("copy", "bitcast") and root.operands:
            root = instrs.get(root.operands[0])
        return root.opcode if root is not None else None

    def _sliced_reads(self, comp: str, operands: list[float], result: float) -> float:
        """Bytes a fusion whose result is a dynamic slice reads of its `operands`: each only
        within the slice's window (at most `result` bytes), and of the updates of one chain of
        dynamic-update-slices (a block placed into a buffer, as a ring of collective matmuls
        does) only the one that holds each element: the chain's window, not every update."""
        instrs = self.comps[comp]
        params = {i.name: int(re.match(r"\s*(\d+)", i.rest).group(1))
                  for i in instrs if i.opcode == "parameter"}
        by_name = {i.name: i for i in instrs}
        chains: dict[str, list[int]] = {}
        for i in instrs:
            if i.opcode == "dynamic-update-slice" and len(i.operands) > 1:
                first, update = i, by_name.get(i.operands[1])  # the chain's first placement
                while by_name.get(first.operands[0], first).opcode == "dynamic-update-slice":
                    first = by_name[first.operands[0]]
                while update is not None and update.opcode == "bitcast" and update.operands:
                    update = by_name.get(update.operands[0])
                if update is not None and update.name in params:
                    chains.setdefault(first.name, []).append(params[update.name])
        placed = {k for ks in chains.values() for k in ks}
        plain = sum(min(b, result) for k, b in enumerate(operands) if k not in placed)
        return plain + sum(min(sum(operands[k] for k in ks if k < len(operands)), result)
                           for ks in chains.values())

    def seconds(self, instr: Instruction, shapes: dict[str, str]) -> tuple[float, float, float]:
        """(FLOPs, matmul FLOPs, seconds) of one kernel (not a loop, call or collective)."""
        if instr.opcode in _FREE:
            return 0.0, 0.0, 0.0
        flops = self.counter.instruction(shapes, instr)
        matmul = self.matmuls.instruction(shapes, instr)
        dtype = self.matmul_dtype(instr, shapes) if matmul else None
        return flops, matmul, instruction_seconds(
            flops, matmul, self.memory_bytes(instr, shapes),
            dtype or _operand_dtype([shapes.get(o, "") for o in instr.operands]), self.machine)

    def matmul_dtype(self, instr: Instruction, shapes: dict[str, str]) -> str | None:
        """The dtype a kernel's matmuls run in, from the operands of the dots themselves: a dot
        reading two float8 operands runs at the FP8 rate, one reading a float8 and a bf16 operand
        (the float8 upcast inside the fusion) at bf16's, a fusion's quantizing prologue feeding
        float8 to its dot at the FP8 rate. The widest such dtype over the kernel's dots (a fused
        GEMM's `dot`, a cuBLAS call's first two operands); None when it holds no dot.

        Args:
          instr: a fusion or custom call.
          shapes: the shapes of the instructions of its computation, by name.

        Returns:
          An HLO dtype such as `f8e4m3fn` or `bf16`, or None.
        """
        if instr.opcode == "custom-call" and hlo.is_cublas_gemm(instr):
            return _widest([shapes.get(o, "") for o in instr.operands[:2]])
        found = [self._dot_dtype(c) for c in called(instr.rest)
                 if instr.opcode in ("fusion", "fusion-start")]
        return max((d for d in found if d), key=DTYPE_BYTES.__getitem__, default=None)

    def _dot_dtype(self, comp: str) -> str | None:
        """The widest operand dtype of the dots in fused computation `comp` (and those it calls)."""
        body = self.comps.get(comp, ())
        types = {i.name: i.shape for i in body}
        found = [_widest([types.get(o, "") for o in i.operands[:2]])
                 for i in body if i.opcode == "dot"]
        found += [self._dot_dtype(c) for i in body if i.opcode == "fusion" for c in called(i.rest)]
        return max((d for d in found if d), key=DTYPE_BYTES.__getitem__, default=None)


def _floating(shapes: list[str]) -> list[str]:
    """The floating dtypes of the arrays in `shapes`."""
    return [a.dtype for s in shapes for a in arrays(s) if a.dtype in FLOAT_DTYPES]


def _widest(shapes: list[str]) -> str | None:
    """The widest floating dtype among a matmul's operands (None when none is floating)."""
    return max(_floating(shapes), key=DTYPE_BYTES.__getitem__, default=None)


def _operand_dtype(shapes: list[str]) -> str:
    """The narrowest floating dtype among a kernel's operands: what a matmul without a visible
    dot (cuDNN attention, a grouped GEMM) runs in (a bf16 matmul accumulating into an f32
    result runs at the bf16 rate)."""
    return min(_floating(shapes), key=DTYPE_BYTES.__getitem__, default="f32")


def instruction_seconds(flops: float, matmul_flops: float, memory_bytes: float, dtype: str,
                        machine: Machine) -> float:
    """A kernel's time on `machine`, by a roofline.

    Its matmul FLOPs at the matmul rate of its result's `dtype` (`Machine.matmul_rate`) plus its
    other FLOPs at the vector rate, or its HBM traffic at the memory bandwidth, whichever is
    longer.

    Args:
      flops: all its FLOPs.
      matmul_flops: of them, the matmuls'.
      memory_bytes: the HBM bytes it reads and writes.
      dtype: its result's HLO dtype (`bf16`, `f32`, ...).
      machine: the device's rates.

    Returns:
      Seconds.
    """
    compute = matmul_flops / machine.matmul_rate(dtype) + \
        max(flops - matmul_flops, 0.0) / machine.vector_flops
    return max(compute, memory_bytes / machine.hbm_bw)


@dataclasses.dataclass
class _Flight:
    """A collective in flight: its record's key and when it ends; the compute since its start."""

    key: str
    end: float
    flops: float = 0.0
    matmul: float = 0.0
    compute_s: float = 0.0


class _Replay:
    """Replays a scheduled module on one compute stream and a communication stream per kind of
    link (inside a node, across nodes)."""

    def __init__(self, text: str, mesh_shape: dict[str, int], machine: Machine):
        self.costs = _Costs(text, machine)
        self.num_devices = self.costs.module.num_devices
        self.mesh_shape, self.machine = mesh_shape, machine
        self.entry = self.costs.module.entry
        self.found: dict[str, dict] = {}  # key -> accumulated record
        self.free = {"intra-node": 0.0, "inter-node": 0.0, HOST_COMPUTE: 0.0,  # when each stream is
                     **{kind: 0.0 for kind in HOST_KINDS}}
        self.seconds = {"matmul": 0.0, "other": 0.0}  # compute time by kind of kernel
        self.kernels: dict[str, float] = {}  # "computation/instruction" -> its seconds per step

    # ------------------------------------------------------------------ collectives

    def _collective(self, comp: str, instr: Instruction) -> hlo.Collective | None:
        if instr.opcode == "async-start":
            for callee in called(instr.rest):
                for inner in self.costs.comps.get(callee, ()):
                    c = hlo.collective(inner, self.num_devices)
                    if c:
                        return c
            return None
        return hlo.collective(instr, self.num_devices)

    def _record(self, comp: str, instr: Instruction, c: hlo.Collective, asynchronous: bool) -> str:
        key = f"{comp}/{instr.name}"
        if key not in self.found:
            nodes = {d // self.machine.devices_per_node for d in c.group}
            per_node = self.machine.devices_per_node
            inter = len(nodes) > 1 and self.num_devices > per_node
            self.found[key] = dict(
                kind=c.kind, name=instr.name,
                axes=hlo.group_axes(c.group, self.mesh_shape), wire_bytes=c.wire_bytes,
                comm_s=link_time(c.kind, c.bytes, c.group_size, inter, self.machine),
                asynchronous=asynchronous, backward="transpose(" in instr.rest,
                link="inter-node" if inter else "intra-node",
                weight=0.0, flops=0.0, matmul=0.0, window_s=0.0, exposed=0.0)
        return key

    def _start(self, key: str, t: float) -> _Flight:
        kind = self.found[key]["kind"]
        stream = kind if kind in HOST_KINDS or kind == HOST_COMPUTE else self.found[key]["link"]
        begin = max(t, self.free[stream])
        self.free[stream] = begin + self.found[key]["comm_s"]
        return _Flight(key, self.free[stream])

    def _host_record(self, comp: str, instr: Instruction, shapes: dict[str, str],
                     asynchronous: bool) -> str | None:
        """The record of `instr` when it moves data between host and device memory."""
        transfer = self.costs.host_transfer(instr, shapes)
        if transfer is None:
            return None
        kind, size = transfer
        key = f"{comp}/{instr.name}"
        if key not in self.found:
            self.found[key] = dict(
                kind=kind, name=instr.name, axes=("host",), wire_bytes=size,
                comm_s=size / self.machine.host_bw, asynchronous=asynchronous,
                backward="transpose(" in instr.rest, weight=0.0, flops=0.0, matmul=0.0,
                window_s=0.0, exposed=0.0)
        return key

    def _host_compute_record(self, comp: str, instr: Instruction) -> str | None:
        """The record of an asynchronous computation on the host's CPU (a HostExecute start):
        the host memory it reads and writes at `Machine.host_compute_bw`, then the results it
        leaves in device memory over the host link; None for other instructions."""
        if instr.opcode != "custom-call-start" or 'custom_call_target="HostExecute"' not in \
                instr.rest:
            return None
        key = f"{comp}/{instr.name}"
        if key not in self.found:
            # shape: ((operands), (results), context); arrays without S(5) are device memory.
            laid_out = [a for a in arrays(instr.shape) if a.has_layout]
            to_device = sum(a.bytes for a in laid_out[len(laid_out) // 2:] if _HOST not in a.text)
            size = shape_bytes(instr.shape)
            self.found[key] = dict(
                kind=HOST_COMPUTE, name=instr.name, axes=("host",), wire_bytes=size,
                comm_s=size / self.machine.host_compute_bw + to_device / self.machine.host_bw,
                asynchronous=True, backward=False, weight=0.0, flops=0.0, matmul=0.0,
                window_s=0.0, exposed=0.0)
        return key

    def _finish(self, flight: _Flight, t: float, weight: float) -> float:
        rec = self.found[flight.key]
        rec["weight"] += weight
        rec["flops"] += weight * flight.flops
        rec["matmul"] += weight * flight.matmul
        rec["window_s"] += weight * flight.compute_s
        rec["exposed"] += weight * max(0.0, flight.end - t)
        return max(t, flight.end)

    # ------------------------------------------------------------------ replay

    def run(self, comp: str, t: float, weight: float, carried: dict | None = None,
            carry_out: dict | None = None) -> float:
        """Replay computation `comp` from time `t`; returns its end. `weight`: how many times
        this replay stands for (loop trips); `carried`: collectives in flight from the previous
        iteration by the index of the loop tuple that carries them; `carry_out`: filled with this
        iteration's collectives still in flight at the end, by that index."""
        instrs = self.costs.comps.get(comp, [])
        shapes: dict[str, str] = {}
        flights: dict[str, _Flight] = {}
        tuple_index: dict[str, int] = {}  # get-tuple-element of the loop parameter -> index
        param = next((i.name for i in instrs if i.opcode == "parameter"), None)
        for instr in instrs:
            shapes[instr.name] = instr.shape
            op = instr.opcode
            if op == "get-tuple-element" and instr.operands[:1] == (param,):
                tuple_index[instr.name] = int(re.search(r"index=(\d+)", instr.rest).group(1))
            if op in _ASYNC_KINDS or op == "async-start":
                c = self._collective(comp, instr)
                if c is not None:
                    flights[instr.name] = self._start(self._record(comp, instr, c, True), t)
                continue
            if (key := self._host_compute_record(comp, instr)) is not None:
                flights[instr.name] = self._start(key, t)
                continue
            if op in ("copy-start", "fusion-start") and \
                    (key := self._host_record(comp, instr, shapes, True)) is not None:
                flights[instr.name] = self._start(key, t)
                continue
            if op.endswith("-done") and instr.operands:
                source = instr.operands[0]
                flight = flights.pop(source, None)
                if flight is None and carried and source in tuple_index:
                    flight = carried.pop(tuple_index[source], None)
                if flight is not None:
                    t = self._finish(flight, t, weight)
                continue
            if op in hlo.OPCODES:  # synchronous: the compute stream waits for it whole
                c = self._collective(comp, instr)
                if c is not None:
                    t = self._finish(self._start(self._record(comp, instr, c, False), t), t,
                                     weight)
                continue
            if op in ("copy", "fusion", "dynamic-slice", "dynamic-update-slice") and \
                    (key := self._host_record(comp, instr, shapes, False)) is not None:
                t = self._finish(self._start(key, t), t, weight)
                continue
            t0 = t
            t, flops, matmul = self._compute(comp, instr, shapes, t, weight)
            for flight in (*flights.values(), *(carried or {}).values()):  # in flight beside it
                flight.flops += flops
                flight.matmul += matmul
                flight.compute_s += t - t0
        self._settle(instrs, flights, carried, carry_out, t, weight)
        return t

    def _compute(self, comp: str, instr, shapes: dict, t: float,
                 weight: float) -> tuple[float, float, float]:
        """A compute instruction from time `t`: a loop, a conditional's heaviest branch, a call,
        or one kernel. Returns `(its end, its FLOPs, its matmul FLOPs)`."""
        op = instr.opcode
        if op == "call":
            for callee in called(instr.rest):
                t = self.run(callee, t, weight)
            return t, 0.0, 0.0
        if op == "while":
            t = self._loop(*loop(instr, "time"), t, weight)
        elif op == "conditional":
            branch = self.costs.heaviest(branch_names(instr.rest), self.num_devices)
            t = self.run(branch, t, weight) if branch else t
        else:  # one kernel
            flops, matmul, seconds = self.costs.seconds(instr, shapes)
            self.seconds["matmul" if matmul else "other"] += weight * seconds
            if seconds:
                key = f"{comp}/{instr.name}"
                self.kernels[key] = self.kernels.get(key, 0.0) + weight * seconds
            return t + seconds, flops, matmul
        return (t, self.costs.counter.instruction(shapes, instr),
                self.costs.matmuls.instruction(shapes, instr))

    def _settle(self, instrs: list, flights: dict, carried: dict | None,
                carry_out: dict | None, t: float, weight: float) -> None:
        """At the end of a computation: hand the next loop iteration the collectives the root
        tuple carries (into `carry_out`), and count every other one still in flight as done at
        `t` (its done is outside, or it was never waited for)."""
        if carry_out is not None:
            root = next((i for i in reversed(instrs) if i.opcode == "tuple"), None)
            if root is not None:
                for k, operand in enumerate(root.operands):
                    if operand in flights:
                        carry_out[k] = flights.pop(operand)
        for flight in (*flights.values(), *(carried or {}).values()):
            self._finish(flight, t, weight)

    def _loop(self, body: str, trips: int, t: float, weight: float) -> float:
        """A while loop: the first iteration, then the steady state for the other trips."""
        carry: dict = {}
        t = self.run(body, t, weight, None, carry)
        if trips > 1:
            nxt: dict = {}
            t_steady = self.run(body, t, weight * (trips - 1), carry, nxt)
            per_trip = t_steady - t
            for stream, free in self.free.items():  # as the last iteration leaves them
                if free > t:
                    self.free[stream] = free + per_trip * (trips - 2)
            t += per_trip * (trips - 1)
            for flight in nxt.values():  # the last iteration's, issued (trips − 2) trips later
                flight.end += per_trip * (trips - 2)
                self._finish(flight, t, weight)
        else:
            for flight in carry.values():
                self._finish(flight, t, weight)
        return t


@dataclasses.dataclass
class Schedule:
    """A compiled step's schedule replayed: each collective, what hides it, and the step's time.

    The step's time per device (seconds) in its parts: kernels with matmuls, the other kernels
    (memory-bound: norms, softmax, elementwise, copies), and the waits for communication.
    """

    overlaps: list[Overlap]
    step_s: float
    matmul_s: float
    other_s: float
    kernels: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each kernel's compute seconds per step, by `"computation/instruction"` (loop bodies
    counted once per iteration)."""

    @property
    def exposed_s(self) -> float:
        """Seconds per step the step waits for communication, every execution counted."""
        return sum(o.exposed_s * o.executions for o in self.overlaps)

    def as_dict(self) -> dict:
        """The JSON of `axonn-jax compile --overlap-report`.

        Returns:
          The step's parts and `summary`, per kind and axes (`by_axes`) and per kind, axes and
          link (`by_link`), and `totals` (`total`).
        """
        return {"step_s": self.step_s, "matmul_s": self.matmul_s, "other_s": self.other_s,
                "exposed_comm_s": self.exposed_s, "total": totals(self.overlaps),
                "by_axes": summary(self.overlaps),
                "by_link": summary(self.overlaps, by_link=True)}


def report(text: str, mesh_shape: dict[str, int], machine: Machine) -> Schedule:
    """The schedule of the compiled module `text` replayed on `machine`.

    Args:
      text: the compiled module's HLO text.
      mesh_shape: `{axis: size}` in mesh order (`ParallelConfig.as_dict()`).
      machine: the cluster's rates and links.

    Returns:
      The `Schedule`.
    """
    replay = _Replay(text, mesh_shape, machine)
    seconds = replay.run(replay.entry, 0.0, 1.0)
    out = []
    for rec in replay.found.values():
        n = rec["weight"] or 1.0
        out.append(Overlap(rec["kind"], rec["name"], rec["axes"], round(rec["weight"]),
                           rec["wire_bytes"], rec["comm_s"], rec["flops"] / n, rec["matmul"] / n,
                           rec["window_s"] / n, rec["exposed"] / n, rec["asynchronous"],
                           rec["backward"], rec.get("link", "host")))
    return Schedule(out, seconds, replay.seconds["matmul"], replay.seconds["other"],
                    replay.kernels)


def summary(overlaps: list[Overlap], by_link: bool = False) -> dict[str, dict]:
    """The collectives' figures per step, by kind and mesh axes.

    Args:
      overlaps: a schedule's collectives.
      by_link: key by `"kind over axes on link"`: the collectives of one kind and axes that run
        inside nodes apart from those across.

    Returns:
      `{"kind over axes": figures}`, sorted by key: `bytes` (wire), `with_compute` (share of the
      bytes whose window holds matmul compute), `comm_s`, `exposed_s`, `hidden` (share of the
      communication time the schedule hides), `collectives` (executions).
    """
    out: dict[str, dict] = {}
    for o in overlaps:
        key = f"{o.kind} over {'+'.join(o.axes) or 'none'}" + (f" on {o.link}" if by_link else "")
        row = out.setdefault(key, dict(bytes=0.0, bytes_with_compute=0.0, comm_s=0.0,
                                       exposed_s=0.0, collectives=0))
        row["bytes"] += o.wire_bytes * o.executions
        row["bytes_with_compute"] += o.wire_bytes * o.executions * o.with_compute
        row["comm_s"] += o.comm_s * o.executions
        row["exposed_s"] += o.exposed_s * o.executions
        row["collectives"] += o.executions
    for row in out.values():
        row["with_compute"] = row.pop("bytes_with_compute") / row["bytes"] if row["bytes"] else 0.0
        row["hidden"] = _hidden(row["exposed_s"], row["comm_s"])
    return dict(sorted(out.items()))


def totals(overlaps: list[Overlap]) -> dict:
    """The whole step's figures of `summary` (one row).

    Args:
      overlaps: a schedule's collectives.

    Returns:
      `{"bytes", "with_compute", "comm_s", "exposed_s", "hidden"}`.
    """
    rows = summary(overlaps).values()
    b = sum(r["bytes"] for r in rows)
    comm = sum(r["comm_s"] for r in rows)
    exposed = sum(r["exposed_s"] for r in rows)
    return {"bytes": b, "with_compute": sum(r["bytes"] * r["with_compute"] for r in rows) / b
            if b else 0.0, "comm_s": comm, "exposed_s": exposed,
            "hidden": _hidden(exposed, comm)}


def _hidden(exposed: float, comm: float) -> float:
    """The share of `comm` seconds not waited for (0 when the waits, queueing behind other
    collectives included, add up to more)."""
    return max(0.0, 1.0 - exposed / comm) if comm else 1.0


def _per_call(costs: _Costs, of: Callable[[Instruction, dict], float]) -> float:
    """The sum of `of(instruction, shapes so far)` over the kernels and collectives one call of
    `costs`' module runs: loop bodies once per trip, the costliest branch of a conditional,
    called computations inlined; parameters, tuples and the like (`_FREE`) and the `-done` of
    asynchronous ops not counted."""
    def walk(comp: str) -> float:
        total, shapes = 0.0, {}
        for instr in costs.comps.get(comp, []):
            shapes[instr.name] = instr.shape
            if instr.opcode == "while":
                body, trips = loop(instr, "time")
                total += trips * walk(body)
            elif instr.opcode == "conditional":
                total += max((walk(b) for b in branch_names(instr.rest)), default=0.0)
            elif instr.opcode == "call":
                total += sum(walk(c) for c in called(instr.rest))
            elif instr.opcode not in _FREE and not instr.opcode.endswith("-done"):
                total += of(instr, shapes)  # an asynchronous op's `-done` waits: its start works
        return total

    return walk(costs.module.entry)


def hbm_bytes(text: str) -> float:
    """HBM bytes one device reads and writes per call of the compiled module `text`.

    Every kernel's operands and result (`_Costs.memory_bytes`: slices and in-place updates counted
    as what they touch), each collective's input and output, loop bodies once per trip. What
    `compiled.cost_analysis()['bytes accessed']` reports where XLA gives one, and also for
    compile-only devices (whose cost analysis is empty).

    Args:
      text: the compiled module's HLO text.

    Returns:
      Bytes per call.
    """
    costs = _Costs(text, None)  # no rates needed: bytes only

    def of(instr: Instruction, shapes: dict) -> float:
        if instr.opcode in _ASYNC_KINDS or instr.opcode == "async-start":  # ((operands), results)
            return shape_bytes(instr.shape)
        if instr.opcode in hlo.OPCODES:
            return sum(shape_bytes(shapes.get(o, "")) for o in instr.operands) + \
                shape_bytes(instr.shape)
        return costs.memory_bytes(instr, shapes)

    return _per_call(costs, of)


def kernel_count(text: str) -> float:
    """How many kernels and collectives one device launches per call of the compiled module.

    A fusion, a library call, a collective's start: one each; loop bodies once per trip.

    Args:
      text: the compiled module's HLO text.

    Returns:
      The launches per call.
    """
    return _per_call(_Costs(text, None), lambda instr, shapes: 1.0)
