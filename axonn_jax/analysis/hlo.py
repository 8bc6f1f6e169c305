"""Collective bytes per device, parsed from compiled (optimized, SPMD-partitioned) HLO text.

This is how every communication claim in axonn_jax is measured: exact, and independent of the
machine. `jax.jit(f).lower(...).compile().as_text()` is the per-device program, so every
collective's result shape is already the per-device buffer. Conventions, per device and per run:

- `bytes`: the size of the full buffer the collective works on: the result of an all-reduce,
  all-gather, all-to-all or collective-permute, the input of a reduce-scatter (its result × the
  group size). Collectives over groups of one device are skipped (they move nothing).
- `wire_bytes`: what a ring algorithm sends from each device: all-reduce 2(n−1)/n·bytes,
  all-gather / reduce-scatter / all-to-all (n−1)/n·bytes, collective-permute bytes.

Collectives inside `while` loops (`lax.scan` over layers or pipeline ticks) count once per
iteration, from XLA's `known_trip_count` (a loop without one raises ValueError); of a
`conditional`'s branches only the heaviest counts (the busiest device runs it); asynchronous pairs
(`all-gather-start` / `-done`) count once. A `ragged-all-to-all` counts as an all-to-all of
the rows it is expected to send (`_ragged_bytes`), not of its padded buffer.
`axonn_jax.analysis.comm_model` predicts the same quantities. Modules, instructions and shapes
are read by `analysis.hlo_module`; `flops` and `FlopCounter` count FLOPs from the same reading.
"""
from __future__ import annotations

import dataclasses
import math
import re

from .hlo_module import (Instruction, Module, array_bytes, arrays, branch_names, called, dims,
                         elements, loop, parse_instruction, read_module)
from .hlo_module import depends_on, instructions  # noqa: F401  (this module's names since before)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
OPCODES = {**{k: k for k in KINDS}, "ragged-all-to-all": "all-to-all"}
"""The kind of each collective opcode (a ragged all-to-all counts as an all-to-all of the rows
it is expected to send, `_ragged_bytes`)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program."""

    kind: str  # one of KINDS
    name: str  # HLO instruction name
    bytes: int  # full-buffer bytes per execution (see the module docstring)
    group_size: int  # devices taking part together (2 for a permute's pair)
    executions: int  # times it runs per program run (loop trip counts multiplied)
    group: tuple[int, ...] = ()  # one group's device ids (a permute: a source and its target)

    @property
    def total_bytes(self) -> int:
        """Full-buffer bytes of all its executions: `bytes × executions`."""
        return self.bytes * self.executions

    @property
    def wire_bytes(self) -> float:
        """Bytes a ring algorithm sends per device over all its executions."""
        n = self.group_size
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(self.kind, (n - 1) / n)
        return factor * self.total_bytes


def _leading_tuple_arrays(shape_text: str) -> int:
    """Arrays in the first element of a tuple shape `((a, b), (a, b), ...)` when that element is
    itself a tuple, else 0."""
    if not shape_text.startswith("(("):
        return 0
    end = shape_text.index(")", 1)
    return len(array_bytes(shape_text[1:end + 1]))


def _iota(spec: str) -> list[int]:
    """The device ids of an iota list `[d0,d1,...]T(p0,p1,...)` (the transpose optional), flat."""
    m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", spec.strip())
    shape = [int(d) for d in m.group(1).split(",")]
    perm = [int(p) for p in m.group(2).split(",")] if m.group(2) else list(range(len(shape)))
    ids = list(range(math.prod(shape)))
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    out = []
    for flat in ids:  # index in the transposed array -> id in the original
        coords, rest = [], flat
        for size in reversed([shape[p] for p in perm]):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        out.append(sum(c * strides[p] for c, p in zip(coords, perm)))
    return out


def _first_group(attrs: str, num_devices: int) -> tuple[int, ...]:
    """The device ids (logical, in the mesh's order) of the collective's group holding the
    first device of the list: a permute's first source-target pair between two devices, else one
    replica group in any of HLO's three spellings (explicit, iota `[groups,size]<=[...]`, or over
    named axes of a mesh). All devices when no groups are given."""
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=(\[[0-9,]+\](?:T\([0-9,]+\))?)", attrs)
    if m:
        size = int(m.group(1).split(",")[-1])
        return tuple(_iota(m.group(2))[:size])
    # Mesh form: `mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}`: the ids laid
    # out on that mesh; a group spans the axes in braces.
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?[^{]*\{([^}]*)\}",
                  attrs)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        sizes = [int(n) for _, n in axes]
        ids = _iota(m.group(2)) if m.group(2) else list(range(math.prod(sizes)))
        spanned = set(re.findall(r"'(\w+)'", m.group(3)))
        group = []
        for flat, dev in enumerate(ids):
            coords, rest = [], flat
            for size in reversed(sizes):
                coords.append(rest % size)
                rest //= size
            coords.reverse()
            if all(c == 0 for (a, _), c in zip(axes, coords) if a not in spanned):
                group.append(dev)
        return tuple(group)
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})", attrs)
    if m:
        first = m.group(1).strip("{}")
        return tuple(int(i) for i in first.split(",")) if first else tuple(range(num_devices))
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if pairs:  # the first pair that moves data (a device may "send" to itself)
        moving = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))
                  if a != b]
        return moving[0] if moving else (0, 0)
    return tuple(range(num_devices))


def group_axes(group: tuple[int, ...], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) along which the devices of `group` differ.

    Args:
      group: device ids of one group.
      mesh_shape: `{axis: size}`, outermost first, of a mesh whose devices are numbered in its
        order.

    Returns:
      The axis names.
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())

    def coords(i):
        out = []
        for size in reversed(sizes):
            out.append(i % size)
            i //= size
        return out[::-1]

    first = coords(group[0])
    varying = set()
    for dev in group[1:]:
        varying |= {a for a, c, f in zip(names, coords(dev), first) if c != f}
    return tuple(a for a in names if a in varying)


_ROUTED_ROWS = re.compile(r'\baxonn_routed_rows="(\d+)"')


def _ragged_bytes(shape: str, rest: str) -> int:
    """Bytes one device sends by a `ragged-all-to-all` (or its `-start`): the rows the frontend
    attribute `axonn_routed_rows` declares (`parallel.ragged.routed_rows`: the expected rows,
    as a balanced router sends them), each of the result's row size; without the attribute the
    whole result (the most it can send). The operand and result are padded buffers sized for
    the worst case; what crosses the wire depends on the data, so the count is an expectation."""
    result = arrays(shape)[-1]  # a start's shape is ((operands), result)
    total = result.bytes
    rows = _ROUTED_ROWS.search(rest)
    return total if not rows or not result.dims else min(total, int(rows.group(1)) * total // result.dims[0])


def collective(instr: Instruction, num_devices: int) -> Collective | None:
    """The collective an instruction runs, sized as the module docstring says.

    Args:
      instr: an instruction of a compiled module.
      num_devices: the module's devices (the group of a collective that names none).

    Returns:
      Its `Collective` (one execution), or None for any other instruction, a `*-done`, and a
      collective that moves nothing (a group of one device, an empty buffer).
    """
    if instr.opcode in ("ragged-all-to-all", "ragged-all-to-all-start"):
        members = _first_group(instr.rest, num_devices)
        nbytes = _ragged_bytes(instr.shape, instr.rest)
        return Collective("all-to-all", instr.name, nbytes, len(members), 1, members) \
            if len(members) > 1 and nbytes else None
    kind = instr.opcode.removesuffix("-start")
    if kind not in KINDS or instr.opcode.endswith("-done"):
        return None
    members = _first_group(instr.rest, num_devices)
    group = len(members)
    sizes = array_bytes(instr.shape)
    if instr.opcode.endswith("-start"):
        # (operands..., results..., [contexts]): keep the results; XLA:GPU's combined starts
        # hold tuples, `((operands), (results), ...)`. An all-reduce-start's shape is its result
        # alone up to jaxlib 0.10, `((operands), results)` in jaxlib 0.12.
        operands = _leading_tuple_arrays(instr.shape)
        if operands:
            sizes = sizes[operands:2 * operands]
        elif kind != "all-reduce":
            sizes = sizes[len(sizes) // 2:] if kind == "all-gather" else sizes[1:2]
    nbytes = sum(sizes) * (group if kind == "reduce-scatter" else 1)
    return Collective(kind, instr.name, nbytes, group, 1, members) if group > 1 and nbytes else None


def collectives(hlo_text: str | Module) -> list[Collective]:
    """Every collective of a compiled HLO module with its per-device bytes and execution count.

    Args:
      hlo_text: the module's text, or the module already read (`hlo_module.read_module`).

    Returns:
      The `Collective`s reached from the entry computation, those in loop bodies with their
      executions multiplied by the trip counts.
    """
    module = read_module(hlo_text) if isinstance(hlo_text, str) else hlo_text
    memo: dict[str, list[Collective]] = {}

    def scaled(found: list[Collective], times: int) -> list[Collective]:
        return [dataclasses.replace(c, executions=c.executions * times) for c in found]

    def walk(comp: str, stack: tuple[str, ...] = ()) -> list[Collective]:
        if comp in memo:
            return memo[comp]
        if comp in stack or comp not in module.computations:
            return []
        found: list[Collective] = []
        for instr in module.computations[comp]:
            if c := collective(instr, module.num_devices):
                found.append(c)
                continue
            inner = stack + (comp,)
            if instr.opcode == "while":
                body, trips = loop(instr, "collectives")
                found += scaled(walk(body, inner), trips)
            elif instr.opcode == "conditional":
                branches = [walk(b, inner) for b in branch_names(instr.rest)]
                found += max(branches, key=lambda b: sum(c.wire_bytes for c in b), default=[])
            elif instr.opcode in ("call", "fusion", "async-start"):
                for callee in called(instr.rest):
                    found += walk(callee, inner)
        memo[comp] = found
        return found

    return walk(module.entry)


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Full-buffer bytes per device per program run, by collective kind.

    Args:
      hlo_text: a compiled module's text.

    Returns:
      `{kind: bytes}` for every kind in KINDS (0 if absent).
    """
    out = dict.fromkeys(KINDS, 0)
    for c in collectives(hlo_text):
        out[c.kind] += c.total_bytes
    return out


def bytes_by_axes(hlo_text: str, mesh_shape: dict[str, int],
                  buffers: bool = False) -> dict[tuple[str, tuple[str, ...]], float]:
    """Bytes per device per program run, split by kind and the mesh axes each collective spans.

    `comm_model.bytes_by_axes` predicts the same table.

    Args:
      hlo_text: a compiled module's text.
      mesh_shape: `{axis: size}` in mesh order, e.g. `ParallelConfig.as_dict()`.
      buffers: count the full-buffer bytes of `collective_bytes` instead of `wire_bytes`.

    Returns:
      `{(kind, axes): bytes}`, axes as `group_axes` gives them.
    """
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in collectives(hlo_text):
        key = (c.kind, group_axes(c.group, mesh_shape))
        out[key] = out.get(key, 0.0) + (c.total_bytes if buffers else c.wire_bytes)
    return out


def wire_bytes(hlo_text: str) -> dict[str, float]:
    """Bytes a ring algorithm sends per device per program run, by collective kind.

    Args:
      hlo_text: a compiled module's text.

    Returns:
      `{kind: bytes}` for every kind in KINDS (0 if absent).
    """
    out = dict.fromkeys(KINDS, 0.0)
    for c in collectives(hlo_text):
        out[c.kind] += c.wire_bytes
    return out


_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate",
                "abs", "sign", "compare", "select", "clamp", "and", "or", "xor", "not", "floor",
                "ceil", "round-nearest-even", "round-nearest-afz", "convert"}


def _ragged_dot_flops(rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of a `ragged-dot` (a grouped matmul: each row of the ragged dimension meets one
    group's matrix): 2·|lhs|·|rhs| over the contracted, batch and rhs group sizes, i.e. 2·m·k·n for
    `(m, k) × (groups, k, n)` whatever the group sizes, and for its transposes."""
    lhs, rhs = re.match(r"\s*%?([\w.\-]+),\s*%?([\w.\-]+)", rest).groups()
    sizes = {name: dims(shapes[name]) for name in (lhs, rhs)}

    def size(key: str, of: str) -> int:
        m = re.search(key + r"=\{([0-9,]*)\}", rest)
        return math.prod(sizes[of][int(i)] for i in m.group(1).split(",") if i) if m else 1

    divisor = (size("lhs_contracting_dims", lhs) * size("lhs_batch_dims", lhs)
               * size("rhs_group_dims", rhs))
    return 2.0 * math.prod(sizes[lhs]) * math.prod(sizes[rhs]) / divisor


def flops(hlo_text: str) -> float:
    """Floating-point operations one device runs per call of a compiled HLO module.

    With the convention of XLA's cost analysis (a dot 2·M·N·K, a grouped `ragged-dot` 2·M·N·K, an
    arithmetic elementwise op one per output element, a reduction one per input element not in
    the output; transcendental functions are not FLOPs there; cuDNN's fused attention as its
    matmuls, `_fused_attention_flops`; a convolution, XLA's or cuDNN's, as its forward,
    `_convolution_flops`; the grouped-matmul kernels of `parallel.grouped_matmul` as they
    declare, `_DECLARED_FLOPS`), but collectives' own sums left out, and instructions inside
    `while` loops counted once per iteration (from `known_trip_count`; XLA's `cost_analysis()`
    counts a loop body once, so a step that scans its layers shows the FLOPs of one layer). Of a
    `conditional`'s branches the heaviest counts. Several modules in one text (a step of several
    programs) add up.

    Args:
      hlo_text: the compiled module's text (or several modules').

    Returns:
      FLOPs per device per call.
    """
    modules = [m for m in re.split(r"(?m)^(?=HloModule )", hlo_text) if m.strip()]
    if len(modules) > 1:
        return sum(flops(m) for m in modules)
    counter = FlopCounter(hlo_text)
    return counter.computation(counter.entry)


class FlopCounter:
    """`flops`' count per computation and per instruction of one compiled module.

    `computation(name)`: loops and calls included, memoized; `instruction(shapes, instr)`: one
    instruction (`shapes`: `{name: shape text}` of the instructions before it in its
    computation). `matmuls_only`: count only matmuls (dots, grouped dots, cuBLAS calls, cuDNN's
    fused attention, convolutions, the declared grouped-matmul kernels), the FLOPs that run on
    tensor cores.

    Args:
      hlo_text: the module's text, or the module already read (`hlo_module.read_module`).
      matmuls_only: as above.
    """

    def __init__(self, hlo_text: str | Module, matmuls_only: bool = False):
        self.module = read_module(hlo_text) if isinstance(hlo_text, str) else hlo_text
        self.comps, self.entry = self.module.computations, self.module.entry
        self.matmuls_only = matmuls_only
        self._memo: dict[str, float] = {}
        self._stack: set[str] = set()

    def computation(self, comp: str) -> float:
        """FLOPs of one run of computation `comp`, loops and calls included, memoized.

        Args:
          comp: the computation's name.

        Returns:
          Its FLOPs (0 for an unknown or recursive one).
        """
        if comp in self._memo:
            return self._memo[comp]
        if comp in self._stack or comp not in self.comps:
            return 0.0
        self._stack.add(comp)
        shapes: dict[str, str] = {}
        total = 0.0
        for instr in self.comps[comp]:
            shapes[instr.name] = instr.shape
            total += self.instruction(shapes, instr)
        self._stack.discard(comp)
        self._memo[comp] = total
        return total

    def instruction(self, shapes: dict[str, str], instr: Instruction) -> float:
        """FLOPs of one run of `instr`, the computations it runs included.

        Args:
          shapes: `{name: shape text}` of the instructions before it in its computation.
          instr: the instruction.

        Returns:
          Its FLOPs.
        """
        opcode, shape, rest = instr.opcode, instr.shape, instr.rest
        if opcode == "dot":
            return _gemm_flops(rest, shape, shapes, r"lhs_contracting_dims=\{([0-9,]*)\}")
        if opcode == "ragged-dot":
            return _ragged_dot_flops(rest, shapes)
        if opcode in _ELEMENTWISE and not self.matmuls_only:
            return float(elements(shape))
        if opcode == "reduce" and not self.matmuls_only:
            operand = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
            return float(elements(shapes.get(operand, "")) - elements(shape))
        if opcode == "custom-call" and (declared := _DECLARED_FLOPS.search(rest)):
            return float(declared.group(1))
        if opcode == "custom-call" and "__cudnn$fmha" in rest:
            return _fused_attention_flops(rest)
        if opcode == "custom-call" and _CUBLAS.search(rest):
            return _gemm_flops(rest, shape, shapes, r'"lhs_contracting_dimensions":\[([^\]]*)\]')
        if opcode == "convolution" or (opcode == "custom-call" and _CUDNN_CONV.search(rest)):
            return _convolution_flops(rest, shape, shapes)
        if opcode == "while":
            body, trips = loop(instr, "FLOPs")
            return self.computation(body) * trips
        if opcode == "conditional":
            return max((self.computation(b) for b in branch_names(rest)), default=0.0)
        if opcode in ("call", "fusion", "fusion-start", "async-start"):
            return sum(self.computation(c) for c in called(rest))
        return 0.0


_DECLARED_FLOPS = re.compile(r"axonn_grouped_matmul_\w+?_flops_(\d+)")
"""A library kernel that declares its FLOPs in its name (`parallel.grouped_matmul`: a Pallas
custom call, whose work XLA cannot see), as the call's `op_name` metadata carries it."""


def _fused_attention_flops(rest: str) -> float:
    """FLOPs of a cuDNN fused-attention call (`__cudnn$fmha*`), from its query and key shapes
    `(batch, seq, heads, head_dim)` in `operand_layout_constraints`, as XLA's dots would count
    them (causal masking not discounted): the forward's two matmuls, `4·b·h·t·s·d`; the backward's
    five (the scores again, then the value, probability, query and key gradients)."""
    if "operand_layout_constraints={" not in rest:
        return 0.0
    constraints = rest.split("operand_layout_constraints={", 1)[1].split("}}", 1)[0]
    shapes = [a.dims for a in arrays(constraints)]
    (b, t, h, d), s = shapes[0], shapes[1][1]
    return (10.0 if "Backward" in rest.split("custom_call_target=", 1)[1].split(",", 1)[0]
            else 4.0) * b * h * t * s * d


def _gemm_flops(rest: str, shape: str, shapes: dict[str, str], contracting: str) -> float:
    """FLOPs of a matmul: 2 × its result's elements (the first array: a cuBLAS call's tuple holds
    a workspace too) × the contracted size of its left operand, whose dimensions `contracting`
    (a pattern) finds in `rest`: a `dot`'s `lhs_contracting_dims={..}`, or a cuBLAS GEMM call's
    (`__cublas$gemm`, `__cublas$lt$matmul*`: what XLA:GPU's autotuner picks on a real GPU instead
    of a Triton fusion of the dot) `"lhs_contracting_dimensions":[..]` in its backend config."""
    lhs = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
    found, lhs_dims = re.search(contracting, rest), dims(shapes.get(lhs, ""))
    k = 1
    if found and lhs_dims:
        k = math.prod(lhs_dims[int(i.strip('" '))] for i in found.group(1).split(",") if i)
    return 2.0 * elements(shape) * k


_CUDNN_CONV = re.compile(r'custom_call_target="__cudnn\$conv(\w*)"')


def _convolution_flops(rest: str, shape: str, shapes: dict[str, str]) -> float:
    """FLOPs of a convolution as XLA's cost analysis counts them: 2 × the forward output's
    batch and features × the input features per group × the (output, window) position pairs
    that fall inside the input (padding not counted), per spatial dimension. An XLA
    `convolution` is a forward (operands input, kernel; its gradients are convolutions too);
    cuDNN's calls keep the forward's `dim_labels` (`input_kernel->output`) and window and read
    or write: `convForward`, `convBiasActivationForward` (input, kernel) -> output,
    `convBackwardInput` (output gradient, kernel) -> input gradient, `convBackwardFilter`
    (input, output gradient) -> kernel gradient: each the forward's FLOPs."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    window = re.search(r"window=\{([^}]*)\}", rest)
    if not labels or not window:
        return 0.0
    names = re.findall(r"%?([\w.\-]+)", rest.split(")", 1)[0])[:2]
    operands = [dims(shapes.get(n, "")) for n in names] + [[], []]
    cudnn = _CUDNN_CONV.search(rest)
    kind = cudnn.group(1) if cudnn else "Forward"
    roles = {"BackwardInput": (dims(shape), operands[1], operands[0]),
             "BackwardFilter": (operands[0], dims(shape), operands[1])}
    inputs, kernel, output = roles.get(kind, (operands[0], operands[1], dims(shape)))
    lhs, rhs, out = labels.groups()
    if [len(inputs), len(kernel), len(output)] != [len(lhs), len(rhs), len(out)]:
        return 0.0
    groups = re.search(r"feature_group_count=(\d+)", rest)
    features = inputs[lhs.index("f")] // (int(groups.group(1)) if groups else 1)
    spatial = sorted(c for c in out if c.isdigit())
    pairs = math.prod(_valid_pairs(inputs[lhs.index(d)], output[out.index(d)],
                                   kernel[rhs.index(d)], i, window.group(1))
                      for i, d in enumerate(spatial))
    rest_of_output = math.prod(n for n, c in zip(output, out) if not c.isdigit())
    return 2.0 * rest_of_output * features * pairs


def _valid_pairs(size: int, out: int, k: int, dim: int, window: str) -> int:
    """(output position, window position) pairs of one spatial dimension (`dim`: its index in the
    window's `AxB` fields) that read the input (of `size`, dilated by `lhs_dilate`) inside it."""
    def field(name: str, default: int) -> int:  # of a padding `low_high`, the low side
        m = re.search(name + r"=([0-9_x\-]+)", window)
        return int(m.group(1).split("x")[dim].split("_")[0]) if m else default
    stride, pad = field("stride", 1), field("pad", 0)
    rhs_dilate, lhs_dilate = field("rhs_dilate", 1), field("lhs_dilate", 1)
    extent = (size - 1) * lhs_dilate + 1
    return sum(1 for o in range(out) for j in range(k)
               if 0 <= (p := o * stride + j * rhs_dilate - pad) < extent and p % lhs_dilate == 0)


_GEMM_FUSION = re.compile(r"(gemm_fusion|triton_gemm)\S*_computation$")
_CUBLAS = re.compile(r'custom_call_target="__cublas\$(gemm|lt\$matmul[$\w]*)"')


def is_cublas_gemm(instr) -> bool:
    """Whether `instr` is a cuBLAS GEMM call (`__cublas$gemm`, `__cublas$lt$matmul$f8`, ...).

    Its first two operands are the matrices.

    Args:
      instr: an `Instruction`.

    Returns:
      True for a custom call to a cuBLAS GEMM target.
    """
    return instr.opcode == "custom-call" and bool(_CUBLAS.search(instr.rest))


def gemm_operand_dtypes(hlo_text: str) -> list[tuple[str, str]]:
    """The element types of the two matrix operands of every GEMM of a compiled GPU module.

    Each fusion XLA made of a dot counts once (a loop body's once): the operands of the `dot`
    inside each Triton GEMM fusion (jaxlib 0.12 fuses the FP8 scales and casts into it, so its
    parameters need not be the dot's), and the first two operands of each cuBLAS call
    (`__cublas$gemm`, `__cublas$lt$matmul$f8`, ...: what a module compiled with autotuning on a
    real GPU may choose instead).

    Args:
      hlo_text: a compiled module's text.

    Returns:
      One pair per GEMM, e.g. `('f8e4m3fn', 'f8e4m3fn')`: an FP8 GEMM; `('f8e5m2', 'bf16')`: one
      operand left in bf16.
    """
    module = read_module(hlo_text)
    found = []
    for name, body in module.computations.items():
        types = {i.name: (arrays(i.shape) or [None])[0] for i in body}
        gemm = _GEMM_FUSION.search(name)
        for instr in body:
            if (gemm and instr.opcode == "dot") or is_cublas_gemm(instr):
                found.append(tuple(types[o].dtype if types.get(o) else ""
                                   for o in instr.operands[:2]))
    return found
