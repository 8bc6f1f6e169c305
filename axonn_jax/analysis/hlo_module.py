"""Reading HLO text: computations, instructions and the bytes of their shapes.

The one reader under `analysis.hlo` (collective bytes, FLOPs) and `analysis.overlap` (the replay of
a schedule): a module's text is split into computations once (`read_module`), each line into an
`Instruction` (`parse_instruction`), and every shape is sized with one dtype table (`DTYPE_BYTES`,
`arrays`, `shape_bytes`). Works on compiled modules (`Compiled.as_text()`) and on the HLO of a
lowered one (`Lowered.as_text(dialect="hlo")`).
"""
from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f4e2m1fn": 0.5, "f8e3m4": 1, "f8e4m3": 1,
    "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
"""Bytes per element of each HLO element type (sub-byte types as fractions; `token` has none)."""
FLOAT_DTYPES = frozenset(d for d in DTYPE_BYTES if d.startswith(("f", "bf")))
"""The real floating-point element types."""

# An array in a shape: `bf16[8,128]`, optionally with its layout `{1,0:T(8,128)S(5)}`.
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:b\d+)?[a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")
# A computation's first line: `%name (params) -> shape {` when compiled, `name {` in the HLO of a
# lowered, not yet compiled program.
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLEE = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO shape."""

    dtype: str  # HLO element type: `bf16`, `f32`, `s32`, ...
    dims: tuple[int, ...]
    text: str  # as written, with its layout when it has one

    @property
    def elements(self) -> int:
        """Its number of elements: the product of `dims`."""
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Its size; 0 for an element type without one (`token`, unknown types)."""
        return int(self.elements * DTYPE_BYTES.get(self.dtype, 0))

    @property
    def has_layout(self) -> bool:
        """Whether its text carries a layout (`{1,0}`)."""
        return self.text.endswith("}")


def arrays(shape_text: str) -> list[Array]:
    """The arrays of an HLO shape (one, or a tuple's, flattened, in order).

    Args:
      shape_text: a shape as HLO prints it: `f32[4,8]{1,0}`, `(bf16[2], (s32[], f32[3]))`, ...

    Returns:
      Every array in the text, left to right.
    """
    return [Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d), m.group(0))
            for m in _ARRAY.finditer(shape_text)]


def array_bytes(shape_text: str) -> list[int]:
    """The bytes of each array of a shape whose element type has a size, in order.

    Args:
      shape_text: a shape as HLO prints it.

    Returns:
      One size per array with a sized element type (`token`s and unknown types left out).
    """
    return [a.bytes for a in arrays(shape_text) if a.dtype in DTYPE_BYTES]


def shape_bytes(shape_text: str) -> float:
    """The bytes of a whole shape (a tuple's arrays added up).

    Args:
      shape_text: a shape as HLO prints it.

    Returns:
      The sum of `array_bytes`.
    """
    return float(sum(array_bytes(shape_text)))


def dims(shape_text: str) -> list[int]:
    """The dimensions of the (first) array of a shape.

    Args:
      shape_text: a shape as HLO prints it.

    Returns:
      Its dimensions; [] when it has no array.
    """
    found = _ARRAY.search(shape_text)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def elements(shape_text: str) -> int:
    """The elements of the (first) array of a shape.

    Args:
      shape_text: a shape as HLO prints it.

    Returns:
      The product of its dimensions; 0 when it has no array.
    """
    return math.prod(dims(shape_text)) if _ARRAY.search(shape_text) else 0


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of an HLO computation."""

    name: str
    shape: str  # its result's shape, as written
    opcode: str
    rest: str  # the text after `opcode(`: operands, attributes, metadata
    operands: tuple[str, ...]  # the instructions it reads, by name
    text: str  # the whole line


def parse_instruction(line: str) -> Instruction | None:
    """The instruction on one line of a computation's body.

    Args:
      line: one line of HLO text.

    Returns:
      Its `Instruction` (operands: the `%name`s of its operand list); None for any other line.
    """
    m = _INSTR.match(line)
    if not m:
        return None
    # Operands are the `%name`s before the closing parenthesis of the operand list.
    operands = tuple(re.findall(r"%([\w.\-]+)", m.group(5).split("),", 1)[0]))
    return Instruction(m.group(2), m.group(3), m.group(4), m.group(5), operands, line)


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module, read: its computations' instructions in program order, and its entry."""

    computations: dict[str, list[Instruction]]
    entry: str
    num_devices: int  # `num_partitions` of the module (1 when unset)


def read_module(hlo_text: str) -> Module:
    """Read one HLO module's text into its computations and instructions.

    A `while` without a `known_trip_count` whose count can be read from its condition gets one
    (see `_with_derived_trip`), so that `loop` can count its body.

    Args:
      hlo_text: one module, compiled (`Compiled.as_text()`) or lowered to HLO.

    Returns:
      The `Module`. Raises ValueError when the text has no ENTRY computation.
    """
    lines, entry = _computation_lines(hlo_text)
    m = re.search(r"num_partitions=(\d+)", hlo_text)
    return Module({name: [i for i in map(parse_instruction, body) if i is not None]
                   for name, body in lines.items()}, entry, int(m.group(1)) if m else 1)


def _computation_lines(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """`{computation: its body's lines}` and the entry's name (trip counts derived)."""
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
    for body in comps.values():
        for i, line in enumerate(body):
            if " while(" in line and not _TRIP.search(line):
                body[i] = _with_derived_trip(line, body, comps)
    return comps, entry


def _with_derived_trip(line: str, lines: list[str], comps: dict[str, list[str]]) -> str:
    """The `while` instruction `line` with the trip count XLA did not record (a loop its passes
    rewrote, e.g. sunk into a fusion) added as `known_trip_count`, when its condition compares
    the induction variable (`known_induction_variable`) with a constant, starting from a constant
    in the loop's initial tuple; `line` unchanged otherwise (then `loop` refuses to count)."""
    index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', line)
    cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
    init = re.search(r"\bwhile\(%?([\w.\-]+)\)", line)
    if not (index and cond and init):
        return line
    text = "\n".join(comps.get(cond.group(1), []))
    for callee in re.findall(r"\bcalls=%?([\w.\-]+)", text):
        text += "\n" + "\n".join(comps.get(callee, []))
    bounds = re.findall(r"\bconstant\((-?\d+)\)", text)
    direction = re.findall(r"\bdirection=(LT|LE)\b", text)
    tuple_line = next((ln for ln in lines if re.match(rf"\s*%?{re.escape(init.group(1))} = ", ln)),
                      "")
    operands = re.search(r"\btuple\(([^)]*)\)", tuple_line)
    if len(bounds) != 1 or len(direction) != 1 or not operands:
        return line
    name = operands.group(1).split(",")[int(index.group(1))].strip().lstrip("%")
    for _ in range(4):  # through the copies XLA puts in front of a loop's initial value
        start_line = next((ln for ln in lines if re.match(rf"\s*%?{re.escape(name)} = ", ln)), "")
        copied = re.search(r"\bcopy\(%?([\w.\-]+)\)", start_line)
        if not copied:
            break
        name = copied.group(1)
    start = re.search(r"\bconstant\((-?\d+)\)", start_line)
    if not start:
        return line
    trips = int(bounds[0]) - int(start.group(1)) + (direction[0] == "LE")
    return line + f' /*derived*/ "known_trip_count":{{"n":"{trips}"}}'


def loop(instr: Instruction, what: str) -> tuple[str, int]:
    """The body computation and trip count of a `while` instruction.

    Args:
      instr: the `while`.
      what: what the caller counts, for the error ("collectives", "FLOPs", ...).

    Returns:
      (body, trips). Raises ValueError when XLA recorded no trip count and none could be derived.
    """
    trip = _TRIP.search(instr.rest)
    if not trip:
        raise ValueError(f"while loop {instr.name} has no known_trip_count; cannot count the "
                         f"{what} inside it")
    return re.search(r"\bbody=%?([\w.\-]+)", instr.rest).group(1), int(trip.group(1))


def branch_names(rest: str) -> list[str]:
    """The branch computations of a `conditional`.

    Args:
      rest: its text after the opcode.

    Returns:
      The names of `branch_computations=` (or of its `*_computation=` callees), in order.
    """
    m = _BRANCHES.search(rest)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else \
        [c for k, c in _CALLEE.findall(rest) if k.endswith("_computation")]


def called(rest: str) -> list[str]:
    """The computations a `call`, `fusion` or `async-start` runs.

    Args:
      rest: its text after the opcode.

    Returns:
      The names its `calls=` and `to_apply=` attributes give.
    """
    return [callee for key, callee in _CALLEE.findall(rest) if key in ("calls", "to_apply")]


def instructions(hlo_text: str, computation: str | None = None) -> dict[str, Instruction]:
    """The instructions of one computation of a module, in program order.

    Args:
      hlo_text: the module's text.
      computation: the computation's name (None: the entry).

    Returns:
      `{name: Instruction}`.
    """
    module = read_module(hlo_text)
    return {i.name: i for i in module.computations[computation or module.entry]}


_METADATA = re.compile(r", metadata=\{[^}]*\}")
_DEFAULT_BACKEND_CONFIG = re.compile(
    r', backend_config=\{"operation_queue_id":"0","force_earliest_schedule":false,'
    r'"reification_cost":\[\],"device_type":"DEVICE_TYPE_INVALID","native_emitter_backend_config"'
    r':\{"type":"NATIVE_EMITTER_TYPE_INVALID","unroll_factor":0\}\}')


def program_lines(hlo_text: str) -> list[str]:
    """The module's lines as two compiles of one program share them.

    Left out: the module's header (its fingerprint), source metadata, and the empty backend
    configs XLA's autotuning passes write on fusions.

    Args:
      hlo_text: the module's text.

    Returns:
      Its other lines, in order.
    """
    return [_DEFAULT_BACKEND_CONFIG.sub("", _METADATA.sub("", line))
            for line in hlo_text.splitlines() if not line.startswith("HloModule")]


def depends_on(program: dict[str, Instruction], later: str, earlier: str) -> bool:
    """Whether instruction `later` reads the result of `earlier`, directly or through others.

    Two instructions where neither depends on the other may run concurrently: this is what lets a
    scheduler overlap a collective with a matmul.

    Args:
      program: `{name: Instruction}` of one computation (`instructions`).
      later: the reading instruction's name.
      earlier: the read instruction's name.

    Returns:
      True where a chain of operands leads from `later` to `earlier`.
    """
    seen, todo = set(), [later]
    while todo:
        name = todo.pop()
        for op in program[name].operands if name in program else ():
            if op == earlier:
                return True
            if op not in seen:
                seen.add(op)
                todo.append(op)
    return False
