"""Inter-layer (pipeline) parallelism: microbatches streamed through stages with `ppermute`.

The stack of layers is split into `P` stages over the `pipe` mesh axis. The batch is cut into `M`
microbatches. Time advances in clock ticks; in every tick each stage runs at most one forward (F),
one backward (B) and, for zero-bubble schedules, one weight-gradient operation (W), each of one
microbatch, chosen from a static table computed here in Python, and then every stage hands its
output activation to the next stage and its input cotangent to the previous one with two
`jax.lax.ppermute`s over `pipe`. The whole loop is one `lax.scan` over ticks inside a shard_map that
is manual over `pipe` (and over `data` when the caller's step is).

Because the stages run in lockstep, a tick lasts as long as the slowest stage's work in it. Letting
a tick hold one F *and* one B is what makes the bubble (P−1)/(M+P−1) whatever the F:B cost ratio:
warm-up ticks hold only forwards, steady-state ticks one forward and one backward on every stage,
drain ticks only backwards, so the step lasts (M+P−1)·(F+B) against M·(F+B) of work per stage.
(A tick holding either an F or a B, as in an asynchronous 1F1B, would run a forward on one stage
beside a 3× longer backward on its neighbour and waste most of the steady state.)

Schedules (per stage, in the order the stage runs its operations):
- `gpipe`: all M forwards, then all M backwards. A stage keeps the inputs of all M microbatches.
- `1f1b`:  `2(P−1−s)` warm-up forwards (a microbatch's forward and its cotangent need one tick per
  hop to the last stage and back), then one forward and one backward per tick, then the remaining
  backwards. A stage keeps at most `2P−3` microbatches' inputs (P ≥ 2), whatever M is.
- `interleaved-1f1b` (Narayanan et al., 2021): each device holds V chunks of L/(P·V) layers;
  chunk c of stage s is virtual stage `c·P + s`, so a microbatch visits the devices V times
  (the last stage hands chunk c's output to the first stage's chunk c+1). Forwards run in groups of
  P microbatches per chunk, `(V−1)·P + 2(P−1−s)` of them before the first backward, the backwards
  in the same groups with the chunks reversed (M must be a multiple of P). A tick's operations are
  a chunk's, V times shorter, and the bubble is V times smaller: (P−1)/(V·M+P−1). The price is
  more stashed chunk inputs (about (V−1)·P + 2P) and V times as many messages, each as large.
- `zb-h1` (Qi et al., 2023): 1F1B's forwards and backwards, with the backward split into B, the
  input gradient that the previous stage waits for, and W, the weight gradients, which wait to fill
  ticks where the stage would idle (`parallel.backward_split` cuts any backward in two). A W runs
  when it fits under the tick's slowest stage (counting operations), when its microbatch must leave
  to keep a stage's in-flight microbatches within 1F1B's peak (2P−1: forward run, W not), and at
  the end. For M ≥ 2P−2 the idle time per stage is (P−1)(F+B−W) against 1F1B's (P−1)(F+B+W), a
  third of it when the three cost the same, as in the paper (asserted on the tables in
  tests/test_pipeline.py). The deferred Ws keep their residuals (each layer's matmul inputs and
  output cotangents): far more than the stage inputs 1F1B keeps under this engine's recompute.

The backward is scheduled by hand, not by autodiff of the loop: the B operation of microbatch m on
stage s runs `jax.vjp` of the stage function at the stage input stashed by its forward, i.e. the
stage forward is recomputed inside the backward tick. Keeping `jax.vjp` residuals instead would
store every intermediate of `L/P` blocks (about 16·b·t·d floats plus the `b·h·t²` attention
probabilities per block) for each of up to M (GPipe) or 2P−3 (1F1B) microbatches; the stash of stage
inputs is one `b·t·d` activation per microbatch, for one extra stage forward per microbatch (B costs
about 3 forwards instead of 2). That is the trade AxoNN and GPipe make for large models.

The embedding runs only on the first virtual stage and the output head + loss only on the last (a
`lax.cond`, so the other stages skip the work). Their parameters are replicated over `pipe`; their
gradients are zero except on the stage that uses them and are summed over `pipe` at the end.
Block-parameter gradients stay on their stage (split over `pipe` like the parameters).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .._compat import (aval_varying_axes, current_mesh, ensure_varying, manual_axis_size,
                       mesh_platform, psum, shard_map, varying_axes)
from ..checks import NOT_YET, check_choice, collect
from ..collectives import Collective
from ..config import SCHEDULES, Axis
from .backward_split import split_backward

PIPE_AXIS = Axis.PIPE


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """What sets one pipeline schedule apart from the others.

    The rules its timetables (`make_schedule`) and the asynchronous pipeline
    (`transport.mpi_pipeline`) follow.

    Attributes:
      name: as `--schedule` takes it (`config.SCHEDULES`).
      flush: every forward runs before the first backward (GPipe).
      split_backward: a stage's backward runs as B (the input gradient) and W (the parameter
        gradients) apart, and a stage runs at most `pipe` forwards ahead of its Ws (zb-h1).
      virtual_stages: a stage may run several chunks of layers, microbatches in groups of
        `pipe` (interleaved 1F1B).
    """

    name: str
    flush: bool = False
    split_backward: bool = False
    virtual_stages: bool = False


SCHEDULE_KINDS: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", flush=True), ScheduleKind("1f1b"),
    ScheduleKind("interleaved-1f1b", virtual_stages=True),
    ScheduleKind("zb-h1", split_backward=True))}
"""Every schedule of `config.SCHEDULES` by name."""
assert tuple(SCHEDULE_KINDS) == SCHEDULES


def schedule_kind(name: str) -> ScheduleKind:
    """The rules of the schedule `name`.

    Args:
      name: a `--schedule` value.

    Returns:
      Its `ScheduleKind`.

    Raises:
      ValueError: an unknown schedule.
    """
    return SCHEDULE_KINDS[check_choice("--schedule", name, SCHEDULES)]


def _cond(pred, true_fn, false_fn, *operands):
    """`lax.cond`, but on CPU meshes both branches run and the cond only picks a result. Stages
    take different branches (stage 0 embeds, a stage idles in the bubble), and XLA:CPU's
    collective-permute waits for every device of the program: a permute that GSPMD places inside
    a stage's work (a re-layout between two tensor axes, e.g. of a user's einsum attention)
    deadlocks there ("Termination timeout ... rendezvous"). Values and types are lax.cond's; the
    CPU runs the skipped branch's work too."""
    if mesh_platform() != "cpu":
        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    taken, skipped = true_fn(*operands), false_fn(*operands)
    return jax.lax.cond(pred, lambda: taken, lambda: skipped)
SLOT_TABLES = ("act_store", "act_forward", "act_backward", "cot_store", "cot_backward",
               "weight_store", "weight_read")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline timetable.

    forward[t, s] / backward[t, s] / weight[t, s]: the microbatch whose F / B / W stage `s` runs in
    tick `t`, or -1 (in that order within a tick); `*_chunk[t, s]`: which of the stage's
    `virtual_stages` chunks it runs. `weight` is all -1 unless `split_backward` (then B computes
    only the input gradient and W the parameter gradients; otherwise B computes both).
    slots[name][t, s] (names in SLOT_TABLES): where stage s stores the activation / cotangent that
    arrives at the start of tick t (`*_store`), which stash slot its F and B read their input and
    output cotangent from, where B leaves W's residuals and which slot W reads (-1: none; the first
    virtual stage embeds its tokens again instead of stashing, the last takes its loss's gradient).
    stash_slots / cotangent_slots / weight_slots: slots of each stash (the most any stage holds at
    once); in_flight: the most microbatches any stage holds between its F and its last backward
    operation (B, or W when split).
    """

    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    weight: np.ndarray
    weight_chunk: np.ndarray
    slots: dict
    stash_slots: int
    cotangent_slots: int
    weight_slots: int
    in_flight: int

    @property
    def num_ticks(self) -> int:
        """Ticks of the timetable (rows of its tables)."""
        return self.forward.shape[0]

    @property
    def split_backward(self) -> bool:
        """Whether a stage's backward runs as B and W apart (`ScheduleKind.split_backward`)."""
        return schedule_kind(self.name).split_backward

    @property
    def message_ticks(self) -> int:
        """Ticks that end with messages: up to the last forward or backward.

        zb-h1's trailing ticks run only Ws, which send nothing.
        """
        busy = np.flatnonzero(((self.forward >= 0) | (self.backward >= 0)).any(axis=1))
        return int(busy[-1]) + 1 if busy.size else 0

    def busy_ticks(self) -> np.ndarray:
        """Operations each stage runs: forwards, backwards, weight gradients.

        Returns:
          `(num_stages, 3)` int counts.
        """
        return np.stack([(t >= 0).sum(0) for t in (self.forward, self.backward, self.weight)], 1)

    def step_time(self, forward_cost, backward_cost, weight_cost=0.0) -> float:
        """Duration of the timetable when every tick waits for its slowest stage.

        Costs are seconds of one operation (of one chunk when `virtual_stages > 1`; B is the whole
        backward unless `split_backward`, then W is `weight_cost`), each a number or a
        `(num_stages,)` array (stages differ: the first embeds, the last runs the head and loss).

        Args:
          forward_cost: seconds of one forward operation.
          backward_cost: seconds of one backward (B) operation.
          weight_cost: seconds of one weight-gradient (W) operation.

        Returns:
          The sum over ticks of the slowest stage's work in that tick, in seconds.
        """
        costs = [np.broadcast_to(np.asarray(c, float), (self.num_stages,))
                 for c in (forward_cost, backward_cost, weight_cost)]
        per_tick = sum((table >= 0) * c for table, c in
                       zip((self.forward, self.backward, self.weight), costs))
        return float(per_tick.max(axis=1).sum())

    def predicted_bubble(self, forward_cost=1.0, input_cost=1.0, weight_cost=1.0) -> float:
        """The published idle fraction of a stage when all stages cost the same.

        Costs are one whole stage's forward, input-gradient and weight-gradient work per
        microbatch (only their sum matters unless the backward is split). Idle time per stage:
        (P−1)(F+B+W) for gpipe and 1f1b, divided by V for interleaved-1f1b, (P−1)(F+B−W) for
        zb-h1; the bubble is idle / (M(F+B+W) + idle).

        Args:
          forward_cost: F, one stage's forward per microbatch.
          input_cost: B, its input-gradient work.
          weight_cost: W, its weight-gradient work.

        Returns:
          The idle fraction, in [0, 1).
        """
        p, m, v = self.num_stages, self.num_microbatches, self.virtual_stages
        f, b, w = forward_cost, input_cost, weight_cost
        idle = (p - 1) * ((f + b - w) if self.split_backward else (f + b + w) / v)
        return idle / (m * (f + b + w) + idle)


def pipeline_collectives(schedule: Schedule, message_bytes: float,
                         replicated_bytes: float) -> list[Collective]:
    """The collectives the pipeline adds to a step on one stage device.

    Every tick up to the last forward or backward, one activation forward and one cotangent
    backward of `message_bytes` each (a chunk's, as large, with interleaved stages: V times as
    many ticks); at the end, the sum over `pipe` of the gradients of the parameters every stage
    holds.

    Args:
      schedule: the pipeline's timetable.
      message_bytes: bytes of one activation (= cotangent) message.
      replicated_bytes: bytes of the parameters every stage holds (embedding, final norm and
        head, of which only the first and last stage's gradients are not zero).

    Returns:
      An all-reduce over `pipe` of `replicated_bytes` and `2 · message_ticks` collective-permutes
      of `message_bytes`.
    """
    return [Collective("all-reduce", (PIPE_AXIS,), replicated_bytes),
            Collective("collective-permute", (PIPE_AXIS,), message_bytes,
                       2 * schedule.message_ticks)]


def stage_repeats(found: list[Collective], microbatches: int, forwards: int = 2,
                  hoisted: bool = True) -> list[Collective]:
    """A step's collectives, counted once per step, recounted as the engines run them.

    Args:
      found: the step's collectives, each counted once per step.
      microbatches: microbatches per step.
      forwards: times a stage's forward runs per microbatch (2 in a pipeline, whose backward
        tick recomputes it; one more with `--remat full`).
      hoisted: whether the loop-invariant ones leave the microbatch loop (`loop_invariant`);
        not inside a GPU pipeline's ticks, where the embedding and head run in `lax.cond`
        branches.

    Returns:
      `found` with each `stage_forward` count times `forwards` and each `per_microbatch` count
      times `microbatches` (parameter-sized collectives run once per microbatch's operation,
      pipelined or accumulated by `SpmdEngine`); hoisted loop-invariant ones unchanged.
    """
    def repeats(c: Collective) -> int:
        if c.loop_invariant and hoisted:
            return 1
        return (forwards if c.stage_forward else 1) * (microbatches if c.per_microbatch else 1)

    return [c if (n := repeats(c)) == 1 else dataclasses.replace(c, count=c.count * n)
            for c in found]


def stage_order(name: str, num_stages: int, num_microbatches: int, stage: int,
                lockstep: bool = True, virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """The forwards and backwards stage `stage` runs, in order.

    A split backward's Ws are placed by `make_schedule`.

    1F1B warms up with as many forwards as fit before its first backward can start: in the
    lockstep engine a microbatch needs one tick per hop to the last stage and back, so
    `2(P−1−s)`; in an asynchronous pipeline (`lockstep=False`, the MPI transport), where a stage
    starts its next operation as soon as the last one ends, `P−1−s`. Interleaved 1F1B adds the
    `(V−1)·P` forwards of the other chunks of the first microbatches.

    Args:
      name: the schedule (`gpipe`, `1f1b`, `interleaved-1f1b`, `zb-h1`).
      num_stages: P, the devices on `pipe`.
      num_microbatches: M.
      stage: s, the stage.
      lockstep: the lockstep engine (True) or an asynchronous pipeline (False).
      virtual_stages: V, chunks per stage.

    Returns:
      `[("F" | "B", microbatch, chunk), ...]`.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule_kind(name).flush:
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    # Microbatches in groups of P, each group through chunk 0, 1, …, V−1 (backwards: V−1, …, 0).
    group = lambda k: (k // (p * v)) * p + k % p  # noqa: E731
    forwards = [(group(k), (k // p) % v) for k in range(m * v)]
    backwards = [(group(k), v - 1 - (k // p) % v) for k in range(m * v)]
    hops = p - 1 - stage
    warmup = min((v - 1) * p + (2 * hops if lockstep else hops), m * v)
    ops = [("F", *forwards[i]) for i in range(warmup)]
    for i in range(m * v - warmup):
        ops += [("F", *forwards[warmup + i]), ("B", *backwards[i])]
    return ops + [("B", *backwards[i]) for i in range(m * v - warmup, m * v)]


def check_schedule(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1):
    """Raise a clear error (naming the flag and the numbers) unless the schedule applies.

    Args:
      name: the schedule, one of `SCHEDULES`.
      num_stages: devices on `pipe`.
      num_microbatches: microbatches per step.
      virtual_stages: chunks per stage (more than 1 only with `interleaved-1f1b`).

    Raises:
      ValueError: an unknown schedule, no stage or microbatch, fewer than one virtual stage,
        virtual stages without `interleaved-1f1b`, or microbatches that are not a multiple of
        the stages with `interleaved-1f1b`.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    kind = schedule_kind(name)
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one microbatch, got pipe={p}, microbatches={m}")
    if v < 1:
        raise ValueError(f"--virtual-stages must be at least 1, got {v}")
    if v > 1 and not kind.virtual_stages:
        chunked = " or ".join(k.name for k in SCHEDULE_KINDS.values() if k.virtual_stages)
        raise ValueError(f"--virtual-stages {v} needs --schedule {chunked}, got {name!r}")
    if kind.virtual_stages and m % p:
        raise ValueError(f"--schedule {name} runs microbatches in groups of pipe = {p}: "
                         f"--microbatches {m} is not a multiple of {p}")


@functools.lru_cache(maxsize=256)
def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  virtual_stages: int = 1) -> Schedule:
    """The timetable of a schedule: each stage's operations as early as their inputs allow.

    At most one F and one B per tick: F(m, j) one tick after F(m, j−1) (j: the virtual stage),
    B(m, j) one tick after B(m, j+1) (the last virtual stage: in the tick of its own F(m) or
    later); for `zb-h1` the Ws are placed (see the module docstring); then every stashed value
    gets a slot.

    Args:
      name: the schedule, one of `SCHEDULES`.
      num_stages: devices on `pipe`.
      num_microbatches: microbatches per step.
      virtual_stages: chunks per stage.

    Returns:
      The `Schedule`.

    Raises:
      ValueError: from `check_schedule`.
    """
    check_schedule(name, num_stages, num_microbatches, virtual_stages)
    p, m, v = num_stages, num_microbatches, virtual_stages
    orders = [stage_order(name, p, m, s, virtual_stages=v) for s in range(p)]
    tables, done = _run_orders(orders, p, m, v)
    split = schedule_kind(name).split_backward
    if split:
        tables = _place_weights(tables, done, p, m, cap=2 * p - 1)
    else:
        tables["W"] = np.full_like(tables["F"][0], -1), np.zeros_like(tables["F"][0])
    slots, counts, in_flight = _assign_slots(tables, done, p, m, v, split=split)
    (f, fc), (b, bc), (w, wc) = tables["F"], tables["B"], tables["W"]
    return Schedule(name, p, m, v, f, fc, b, bc, w, wc, slots, *counts, in_flight)


def _run_orders(orders, p: int, m: int, v: int):
    """The F and B tables of `orders` run as early as allowed. Returns ({"F": (mb, chunk) tables,
    "B": ...}, done[(kind, mb, virtual stage)] = tick)."""
    last = p * v - 1
    done: dict[tuple[str, int, int], int] = {}
    position = [0] * p
    rows = []
    tick = 0

    def ready(kind, mb, j):
        if kind == "F":
            return j == 0 or done.get(("F", mb, j - 1), tick) < tick
        if j == last:
            return ("F", mb, j) in done  # this tick's forward runs before its backward
        return done.get(("B", mb, j + 1), tick) < tick

    while any(position[s] < len(orders[s]) for s in range(p)):
        row = {"F": [(-1, 0)] * p, "B": [(-1, 0)] * p}
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, mb, chunk = orders[s][position[s]]
                if row[kind][s][0] >= 0 or not ready(kind, mb, chunk * p + s):
                    break
                row[kind][s] = (mb, chunk)
                done[(kind, mb, chunk * p + s)] = tick
                position[s] += 1
        rows.append(row)
        tick += 1
        if tick > 4 * (m * v + p) + 4:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError(f"pipeline orders with P={p}, M={m}, V={v} do not terminate")
    tables = {k: (np.asarray([[r[k][s][0] for s in range(p)] for r in rows], np.int32),
                  np.asarray([[r[k][s][1] for s in range(p)] for r in rows], np.int32))
              for k in ("F", "B")}
    return tables, done


def _place_weights(tables, done, p: int, m: int, cap: int):
    """ZB-H1's W of each microbatch, in order, per stage: in a tick where the stage runs fewer
    operations than the busiest stage (it would wait anyway), in every tick where some stage must
    run one to keep its forward-run, W-not-run microbatches within `cap` after the next tick's
    forward, and one per tick after the last backward. Adds the "W" tables (and the ticks at the
    end) and records each W's tick in `done`."""
    forward, backward = tables["F"][0] >= 0, tables["B"][0] >= 0
    ticks = forward.shape[0]
    f_done, b_done, w_done = (np.zeros(p, int) for _ in range(3))
    rows = []
    t = 0
    while (w_done < m).any():
        f = forward[t] if t < ticks else np.zeros(p, bool)
        b = backward[t] if t < ticks else np.zeros(p, bool)
        f_done, b_done = f_done + f, b_done + b
        pending = b_done - w_done
        ops = f.astype(int) + b
        level = ops.max()
        next_forwards = f_done + (forward[t + 1] if t + 1 < ticks else 0)
        if t >= ticks or ((next_forwards - w_done > cap) & (pending > 0)).any():
            level = max(level, (ops + (pending > 0)).max())
        run = (pending > 0) & (ops + 1 <= level)
        rows.append(np.where(run, w_done, -1))
        for s in np.flatnonzero(run):
            done[("W", int(w_done[s]), int(s))] = t
        w_done = w_done + run
        t += 1
    weight = np.asarray(rows, np.int32)
    pad = lambda a: np.concatenate([a, np.full((len(rows) - ticks, p), -1, np.int32)])  # noqa: E731
    out = {k: (pad(mb), pad(chunk).clip(0)) for k, (mb, chunk) in tables.items()}
    out["W"] = weight, np.zeros_like(weight)
    return out


def _assign_slots(tables, done, p: int, m: int, v: int, split: bool):
    """Slot tables (see `Schedule.slots`), the slots each stash needs, and the in-flight peak. A
    value occupies its slot from the tick it arrives to the tick its last reader runs; a slot is
    free again from the next tick."""
    ticks = tables["F"][0].shape[0]
    slots = {name: np.full((ticks, p), -1, np.int32) for name in SLOT_TABLES}
    counts = {"act": 1, "cot": 1, "weight": 1}
    last = p * v - 1
    in_flight = 0
    for s in range(p):
        items = {"act": [], "cot": [], "weight": []}
        for mb in range(m):
            for c in range(v):
                j = c * p + s
                f, b = done[("F", mb, j)], done[("B", mb, j)]
                if j > 0:  # the first virtual stage embeds again instead of stashing
                    items["act"].append((done[("F", mb, j - 1)] + 1, b, [
                        ("act_store", done[("F", mb, j - 1)] + 1), ("act_forward", f),
                        ("act_backward", b)]))
                if j < last:  # the last virtual stage differentiates its own loss
                    arrive = done[("B", mb, j + 1)] + 1
                    items["cot"].append((arrive, b, [("cot_store", arrive), ("cot_backward", b)]))
                if split:
                    w = done[("W", mb, s)]
                    items["weight"].append((b, w, [("weight_store", b), ("weight_read", w)]))
        for kind, entries in items.items():
            counts[kind] = max(counts[kind], _allocate(entries, slots, s))
        ends = [done[("W" if split else "B", mb, c * p + s) if not split else ("W", mb, s)]
                for mb in range(m) for c in range(v)]
        starts = [done[("F", mb, c * p + s)] for mb in range(m) for c in range(v)]
        for t in set(starts):
            in_flight = max(in_flight, sum(a <= t <= e for a, e in zip(starts, ends)))
    return slots, (counts["act"], counts["cot"], counts["weight"]), in_flight


def _allocate(entries, slots: dict, stage: int) -> int:
    """Give each `(arrive, leave, [(table, tick), ...])` the lowest slot free since before
    `arrive`; write the slot into the tables. Returns the number of slots used."""
    busy_until: list[int] = []
    for arrive, leave, marks in sorted(entries, key=lambda e: e[0]):
        assert arrive <= leave, (arrive, leave)
        slot = next((i for i, until in enumerate(busy_until) if until < arrive), len(busy_until))
        if slot == len(busy_until):
            busy_until.append(leave)
        busy_until[slot] = leave
        for table, tick in marks:
            assert slots[table][tick, stage] < 0, (table, tick, stage)
            slots[table][tick, stage] = slot
    return max(1, len(busy_until))


def check_layers(num_layers: int, num_stages: int, virtual_stages: int = 1) -> int:
    """Layers per chunk (per stage when `virtual_stages` is 1).

    Args:
      num_layers: layers of the stack.
      num_stages: devices on `pipe`.
      virtual_stages: chunks per stage.

    Returns:
      `num_layers / (num_stages · virtual_stages)`.

    Raises:
      ValueError: the stack does not split evenly.
    """
    chunks = num_stages * virtual_stages
    if num_layers % chunks:
        what = f"pipe = {num_stages}" if virtual_stages == 1 else \
            f"pipe × virtual stages = {num_stages} × {virtual_stages}"
        raise ValueError(f"num_layers = {num_layers} is not divisible by {what}: every pipeline "
                         f"stage must hold the same number of layers")
    return num_layers // chunks


def option_problems(num_stages: int, *, schedule: str, microbatches: int, virtual_stages: int,
                    num_layers: int | None = None, per_layer_plan: bool = False) -> list[str]:
    """Why a step of `num_stages` pipeline stages cannot run these options, one line each.

    Without a pipeline (one stage) only the virtual stages are checked: they need one.

    Args:
      num_stages: devices on `pipe`.
      schedule: the timetable's name (`SCHEDULES`).
      microbatches: microbatches per step.
      virtual_stages: chunks per stage.
      num_layers: the stack's layers (None: not checked).
      per_layer_plan: whether the blocks run a per-layer activation plan (`--remat auto`),
        which a stage's one program cannot.

    Returns:
      The problems (empty: none); those not built yet end with `checks.NOT_YET`.
    """
    found: list[str] = []
    if num_stages == 1:
        if virtual_stages > 1:
            found.append(f"--virtual-stages {virtual_stages} needs --pipe > 1")
        return found
    collect(found, check_schedule, schedule, num_stages, microbatches, virtual_stages)
    if num_layers is not None:
        collect(found, check_layers, num_layers, num_stages, virtual_stages)
    if per_layer_plan:
        found.append(f"remat='auto' with pipe > 1 {NOT_YET}")
    return found


def unused_schedule(schedule: str, num_stages: int) -> str | None:
    """Why a timetable asked for by name has nothing to order, or None.

    A schedule orders a pipeline's microbatches over its stages; one stage has none to order.

    Args:
      schedule: the timetable's name (`SCHEDULES`).
      num_stages: devices on `pipe`.

    Returns:
      The refusal, naming the flags, with one stage; None with more.
    """
    return f"--schedule {schedule} needs a pipeline (--pipe > 1)" if num_stages == 1 else None


def stage_specs(specs: dict, num_stages: int) -> dict:
    """A model's parameter specs, the blocks' layer axis split over `pipe` with stages.

    Args:
      specs: PartitionSpecs of `{'blocks': ..., ...}` (the blocks' with a leading layer axis).
      num_stages: devices on `pipe`.

    Returns:
      `specs`, the blocks' first entry `pipe` when `num_stages` > 1.
    """
    if num_stages == 1:
        return specs
    return {**specs, "blocks": jax.tree.map(lambda s: P(PIPE_AXIS, *s[1:]), specs["blocks"],
                                            is_leaf=lambda s: isinstance(s, P))}


def interleave_order(num_layers: int, num_stages: int, virtual_stages: int) -> np.ndarray:
    """Which layer each position of the stored layer stack holds with interleaved stages.

    The stack stays split over `pipe` in contiguous blocks (stage s holds positions
    `s·L/P … (s+1)·L/P − 1`), and inside its block chunk c (virtual stage `c·P + s`) is positions
    `c·n … (c+1)·n − 1` (n = L/(P·V)): so position `s·V·n + c·n + i` holds layer
    `(c·P + s)·n + i`. Identity when `virtual_stages` is 1. `stored = layers[order]`,
    `layers = stored[np.argsort(order)]`.

    Args:
      num_layers: L, layers of the stack.
      num_stages: P, devices on `pipe`.
      virtual_stages: V, chunks per stage.

    Returns:
      `order`, `(L,)` int: the layer each stored position holds.

    Raises:
      ValueError: the stack does not split evenly (`check_layers`).
    """
    p, v = num_stages, virtual_stages
    n = check_layers(num_layers, p, v)
    s, c, i = np.meshgrid(np.arange(p), np.arange(v), np.arange(n), indexing="ij")
    return ((c * p + s) * n + i).reshape(-1)


def _zeros_like_varying(x, axes: frozenset[str]):
    zeros = jnp.zeros(x.shape, x.dtype)
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def _zeros_of(aval, lead: tuple[int, ...] = ()):
    """Zeros shaped `lead + aval.shape`, varying over the manual axes `aval` varies over."""
    zeros = jnp.zeros((*lead, *aval.shape), aval.dtype)
    axes = tuple(sorted(aval_varying_axes(aval)))
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def stage_operations(embed_fn, stage_fn, head_fn, num_microbatches: int, act_dtype,
                     axes: frozenset[str] = frozenset(), scale=1.0):
    """A virtual stage's forward and backward operations, as the engine runs them.

    forward(prm, x_in, mb_batch, first) -> y: the chunk's layers on x_in, or on the embedded batch
    when `first` (a traced bool: the first virtual stage). backward(prm, x_in, mb_batch, first,
    last, cot) -> (input cotangent, microbatch loss, metrics, parameter gradients): the forward
    recomputed and differentiated, from the output cotangent `cot` and the loss: the head's
    when `last`, plus the chunk's auxiliary loss, weighted `scale`/M (scale: the loss scale).
    The loss returned is unscaled, the chunk's metrics are the stage function's. prm = (embed,
    chunk, head) parameters.

    Args:
      embed_fn: `embed_fn(embed_params, batch_mb) -> x`.
      stage_fn: `stage_fn(chunk_params, x, batch_mb) -> (x, aux loss, metrics)`.
      head_fn: `head_fn(head_params, x, batch_mb) -> mean loss`.
      num_microbatches: M.
      act_dtype: the dtype of the activations between stages.
      axes: the manual axes every value varies over.
      scale: the loss scale.

    Returns:
      `(forward, backward)`.
    """
    m = num_microbatches

    def embedded(prm, x_in, mb_batch, first):
        return _cond(first, lambda: embed_fn(prm[0], mb_batch).astype(act_dtype),
                            lambda: x_in)

    def forward(prm, x_in, mb_batch, first):
        return stage_fn(prm[1], embedded(prm, x_in, mb_batch, first), mb_batch)[0]

    def backward(prm, x_in, mb_batch, first, last, cot):
        def apply(prm, x):
            y, extra_loss, metrics = stage_fn(prm[1], embedded(prm, x, mb_batch, first), mb_batch)
            loss = _cond(last, lambda: head_fn(prm[2], y, mb_batch).astype(jnp.float32),
                                lambda: _zeros_like_varying(jnp.zeros((), jnp.float32), axes))
            return (y, loss + extra_loss), metrics

        (y, loss), vjp, metrics = jax.vjp(apply, prm, x_in, has_aux=True)
        g_y = jnp.where(last, jnp.zeros_like(y), cot)
        g_loss = _zeros_like_varying(jnp.zeros((), jnp.float32), axes) + jnp.float32(scale / m)
        g_prm, g_x = vjp((g_y, g_loss))
        return g_x, loss, metrics, g_prm

    return forward, backward


def split_stage_backward(backward, example_args):
    """`parallel.backward_split` of a `stage_operations` backward.

    Args:
      backward: the `stage_operations` backward.
      example_args: example arguments of the backward.

    Returns:
      The `BackwardSplit`: B returns (input cotangent, loss, metrics), W the parameter
      gradients; W reads the parameters itself, everything else from B's residuals.
    """
    return split_backward(backward, example_args, w_free=(True,) + (False,) * 5, num_b_outputs=3)


def _read(stash, slot):
    """The values at `slot` of each buffer of `stash` (slot -1: any, unused)."""
    return [a[jnp.maximum(slot, 0)] for a in stash]


def _store(stash, slot, values):
    """`stash` with `values` written at `slot` of each buffer, unchanged where slot is -1."""
    safe = jnp.maximum(slot, 0)
    return [a.at[safe].set(jnp.where(slot >= 0, x, a[safe])) for a, x in zip(stash, values)]


def _when(pred, fn):
    """`fn()` where `pred`, zeros of its shapes (varying like them) elsewhere, as one `lax.cond`."""
    shapes = jax.eval_shape(lambda _: fn(), None)
    return _cond(pred, lambda _: fn(), lambda _: jax.tree.map(_zeros_of, shapes), None)


class _Carry(NamedTuple):
    """What the tick loop hands from one tick to the next, on one stage."""
    stash: list  # [(stash_slots, *act)]: stage inputs kept for their backward
    cots: list  # [(cotangent_slots, *act)]: output cotangents kept for their backward
    wstash: list  # [(weight_slots, *residual)]: the split backward's residuals kept for their W
    act_in: jax.Array  # the activation received this tick
    cot_in: jax.Array  # the cotangent received this tick
    grads: Any  # like params: summed over the microbatches
    loss: jax.Array  # float32 scalar: the mean loss so far
    metrics: Any  # per layer of the stage, (V·n, ...): the mean metrics so far


class _StageTicks:
    """One stage's share of the timetable: what its tick runs, read from traced tables.

    Built inside the pipeline's shard_map; `tick` is the body of the loop over ticks.
    """

    def __init__(self, embed_fn, stage_fn, head_fn, params, batch, schedule: Schedule,
                 axis: str, scale):
        self.schedule, self.axis, self.params = schedule, axis, params
        self.m, self.v = schedule.num_microbatches, schedule.virtual_stages
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % self.m:
            raise ValueError(f"the local batch of {rows} rows is not divisible by "
                             f"microbatches = {self.m}")
        layers = jax.tree.leaves(params[1])[0].shape[0]
        if layers % self.v:
            raise ValueError(f"this stage's {layers} layers do not split into {self.v} virtual "
                             "stages")
        self.n = layers // self.v
        self.batch = jax.tree.map(lambda a: a.reshape(self.m, rows // self.m, *a.shape[1:]), batch)
        self.stage = jax.lax.axis_index(axis)
        self.axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(params)))
        self.tables = {k: jnp.asarray(a) for k, a in (
            ("forward", schedule.forward), ("forward_chunk", schedule.forward_chunk),
            ("backward", schedule.backward), ("backward_chunk", schedule.backward_chunk),
            ("weight", schedule.weight), ("weight_chunk", schedule.weight_chunk),
            *schedule.slots.items())}
        self.act = jax.eval_shape(embed_fn, params[0], self.microbatch(0))
        self.zero_act = _zeros_like_varying(jnp.zeros(self.act.shape, self.act.dtype), self.axes)
        self.n_embed, self.n_blocks = (len(jax.tree.leaves(x)) for x in params[:2])
        self.forward_op, self.backward_op = stage_operations(
            embed_fn, stage_fn, head_fn, self.m, self.act.dtype, self.axes, scale)
        # Example arguments made like the tick's: their varying axes fix the backward's jaxpr.
        example = self.backward_args(0)
        self.split = (split_stage_backward(self.backward_op, example)
                      if schedule.split_backward else None)
        self.metric_avals = jax.eval_shape(self.backward_op, *example)[2]  # per chunk: (n, ...)

    def at(self, name: str, t):
        """Entry `name` of the timetable at tick t for this stage."""
        return self.tables[name][t, self.stage]

    def microbatch(self, i):
        """Microbatch i of this device's batch (any i where the table holds -1)."""
        return jax.tree.map(lambda a: a[jnp.maximum(i, 0)], self.batch)

    def chunk_params(self, c):
        """(embed, chunk c's layers, head)."""
        blocks = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * self.n, self.n),
                              self.params[1])
        return self.params[0], blocks, self.params[2]

    def ends(self, c):
        """Whether chunk c of this stage is the first / the last virtual stage."""
        p = self.schedule.num_stages
        return (self.stage == 0) & (c == 0), (self.stage == p - 1) & (c == self.v - 1)

    def backward_args(self, t, carry: _Carry | None = None):
        """The arguments of tick t's backward (zeros for the stashed values without a carry)."""
        c = self.at("backward_chunk", t)
        x, cot = ((_read(carry.stash, self.at("act_backward", t))[0],
                   _read(carry.cots, self.at("cot_backward", t))[0]) if carry is not None else
                  (self.zero_act, self.zero_act))
        return (self.chunk_params(c), x, self.microbatch(self.at("backward", t)), *self.ends(c),
                cot)

    def accumulate(self, grads, updates: dict, c):
        """grads + updates {flat leaf index of (embed, chunk, head): gradient}; chunk c's
        gradients go to its rows of the stage's layer stack."""
        flat, tree = jax.tree.flatten(grads)
        for i, g in updates.items():
            if self.n_embed <= i < self.n_embed + self.n_blocks:
                old = jax.lax.dynamic_slice_in_dim(flat[i], c * self.n, self.n)
                flat[i] = jax.lax.dynamic_update_slice_in_dim(flat[i], old + g, c * self.n, 0)
            else:
                flat[i] = flat[i] + g
        return jax.tree.unflatten(tree, flat)

    def add_metrics(self, total, metrics, c, valid):
        """total + metrics/M at chunk c's rows of the stage's layers, where `valid`."""
        def one(acc, x):
            old = jax.lax.dynamic_slice_in_dim(acc, c * self.n, self.n)
            new = old + jnp.where(valid, x.astype(acc.dtype) / self.m, jnp.zeros_like(old))
            return jax.lax.dynamic_update_slice_in_dim(acc, new, c * self.n, 0)
        return jax.tree.map(one, total, metrics)

    def initial_carry(self, accumulate_in) -> _Carry:
        """The carry before the first tick: empty stashes, zero gradients, loss and metrics."""
        def zeros(shape, dtype):
            return _zeros_like_varying(jax.ShapeDtypeStruct(shape, dtype), self.axes)

        s, act = self.schedule, self.act
        dtypes = accumulate_in or jax.tree.map(lambda x: x.dtype, self.params)
        return _Carry(
            stash=[zeros((s.stash_slots, *act.shape), act.dtype)],
            cots=[zeros((s.cotangent_slots, *act.shape), act.dtype)],
            # varying over every manual axis: a residual the split traced as the same on every
            # stage (a batch slice) is stored per stage
            wstash=[zeros((s.weight_slots, *a.shape), a.dtype)
                    for a in (self.split.residual_avals if self.split else [])],
            act_in=self.zero_act, cot_in=self.zero_act,
            grads=jax.tree.map(lambda x, d: zeros(x.shape, d), self.params, dtypes),
            loss=zeros((), jnp.float32),
            metrics=jax.tree.map(lambda a: zeros((self.v * self.n, *a.shape[1:]), jnp.float32),
                                 self.metric_avals))

    def forward(self, carry: _Carry, t):
        """Tick t's forward: the activation to send (zeros on the last virtual stage, whose
        backward recomputes its output, and where the tick holds no forward)."""
        mb, c = self.at("forward", t), self.at("forward_chunk", t)
        first, last = self.ends(c)

        def run():
            x = _read(carry.stash, self.at("act_forward", t))[0]
            return self.forward_op(self.chunk_params(c), x, self.microbatch(mb), first)

        return _when((mb >= 0) & ~last, run)

    def backward(self, carry: _Carry, t):
        """Tick t's backward (B, and W for a split backward): (the input cotangent to send, the
        microbatch's loss and metrics, the carry's gradients and weight stash updated)."""
        args = self.backward_args(t, carry)
        mb, c = self.at("backward", t), self.at("backward_chunk", t)
        if self.split is None:
            def whole():
                g_x, loss, metrics, g_prm = self.backward_op(*args)
                return g_x, loss, metrics, jax.tree.leaves(g_prm)

            g_x, loss, metrics, g_flat = _when(mb >= 0, whole)
            return g_x, loss, metrics, self.accumulate(carry.grads, dict(enumerate(g_flat)), c), \
                carry.wstash
        (g_x, loss, metrics), early, res = _when(mb >= 0, lambda: self.split.b(*args))
        grads = self.accumulate(carry.grads, dict(zip(self.split.early_index, early)), c)
        wstash = _store(carry.wstash, self.at("weight_store", t), res)
        w_c = self.at("weight_chunk", t)
        late = _when(self.at("weight", t) >= 0, lambda: self.split.w(
            (self.chunk_params(w_c),), _read(wstash, self.at("weight_read", t))))
        return g_x, loss, metrics, self.accumulate(grads, dict(zip(self.split.late_index, late)),
                                                   w_c), wstash

    def tick(self, carry: _Carry, t, communicate: bool = True):
        """One tick: store what arrived, run its F, B and W, send the activation and cotangent."""
        carry = carry._replace(stash=_store(carry.stash, self.at("act_store", t), [carry.act_in]),
                               cots=_store(carry.cots, self.at("cot_store", t), [carry.cot_in]))
        y = self.forward(carry, t)
        g_x, mb_loss, mb_metrics, grads, wstash = self.backward(carry, t)
        b_mb, b_c = self.at("backward", t), self.at("backward_chunk", t)
        carry = carry._replace(
            grads=grads, wstash=wstash, loss=carry.loss + mb_loss / self.m,
            metrics=self.add_metrics(carry.metrics, mb_metrics, b_c, b_mb >= 0))
        if communicate:
            p, wrap = self.schedule.num_stages, self.v > 1
            carry = carry._replace(act_in=jax.lax.ppermute(y, self.axis, _ring(p, +1, wrap)),
                                   cot_in=jax.lax.ppermute(g_x, self.axis, _ring(p, -1, wrap)))
        return carry, None


def pipeline_loss_and_grads(
    embed_fn: Callable[[Any, jax.Array], jax.Array],
    stage_fn: Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array, dict]],
    head_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: tuple[Any, Any, Any],
    batch: Any,
    schedule: Schedule,
    axis: str = PIPE_AXIS,
    scale=1.0,
    accumulate_in: Any = None,
) -> tuple[jax.Array, tuple[Any, Any, Any], dict]:
    """Loss and parameter gradients of a pipelined model; call inside a shard_map manual over `axis`.

    Args:
      embed_fn: `embed_fn(embed_params, batch_mb) -> x (b/M, ...)`.
      stage_fn: `stage_fn(chunk_params, x, batch_mb) -> (x (same shape), the chunk's auxiliary
        loss (float32 scalar: 0 for plain layers), metrics (a dict of per-layer arrays
        `(n, ...)`; {} for plain layers))`.
      head_fn: `head_fn(head_params, x, batch_mb) -> mean loss of the microbatch` (float32
        scalar).
      params: `(embed_params, stage_params, head_params)`. embed/head params: replicated over
        `axis`; stage_params: this stage's slice of the layer stack (split over `axis`), a
        leading layer axis of `V·n` layers holding the stage's `V = schedule.virtual_stages`
        chunks of n layers in order (chunk c: rows `c·n … (c+1)·n − 1`, virtual stage
        `c·P + s`; see `interleave_order`). All of them must already be varying over every
        manual axis (so gradients stay per-device until reduced by the caller).
      batch: a pytree of `(b, ...)` arrays, this device's rows (replicated over `axis`), cut
        into `schedule.num_microbatches` microbatches of `b/M` rows.
      schedule: the timetable (`make_schedule`).
      axis: the pipeline's mesh axis.
      scale: the loss scale the gradients are multiplied by.
      accumulate_in: a pytree like `params` of the dtypes the gradients are summed in over the
        microbatches (default: the parameters'): the caller may pass parameters already cast to
        the compute dtype once, outside the tick loop, and keep fp32 sums.

    Returns:
      `(loss, grads, metrics)`: the mean loss over the microbatches (equal on every stage,
      auxiliary losses included), the gradients (embed/head summed over `axis`, so replicated;
      stage gradients local to the stage) and the metrics averaged over the microbatches: per
      layer of this stage, `(V·n, ...)` in the order of its layer stack (split over `axis` like
      the blocks).

    Raises:
      ValueError: the local batch does not divide into the microbatches, or the stage's layers
        into the virtual stages.
    """
    ticks = _StageTicks(embed_fn, stage_fn, head_fn, params, batch, schedule, axis, scale)
    carry = ticks.initial_carry(accumulate_in)
    sends = schedule.message_ticks
    carry, _ = jax.lax.scan(ticks.tick, carry, jnp.arange(sends))
    if sends < schedule.num_ticks:  # the last Ws: nothing to send
        carry, _ = jax.lax.scan(functools.partial(ticks.tick, communicate=False), carry,
                                jnp.arange(sends, schedule.num_ticks))
    g_embed, g_stage, g_head = carry.grads
    # Only the first (last) stage has nonzero embedding (head) gradients; the head's loss is the
    # last stage's, every stage adds its layers' auxiliary losses.
    g_embed, g_head, loss = psum((g_embed, g_head, carry.loss), axis)  # CPU-safe for 16-bit
    return loss, (g_embed, g_stage, g_head), carry.metrics


def _ring(p: int, step: int, wrap: bool) -> list[tuple[int, int]]:
    """ppermute pairs sending each stage's value to stage s + step (around the ring if `wrap`)."""
    pairs = [(i, i + step) for i in range(p) if 0 <= i + step < p]
    return [(i, (i + step) % p) for i in range(p)] if wrap else pairs


def _gpipe_forward(stage_fn, prm, xs, *, axis: str, keep_inputs: bool):
    """GPipe's forward ticks on this stage: stage s runs microbatch t − s in tick t.

    Args:
      stage_fn: `stage_fn(stage_params, x_mb) -> same shape`.
      prm: this stage's parameters, varying over `axis`.
      xs: the microbatches `(M, b/M, ...)`, replicated over `axis`.
      axis: the pipeline's manual mesh axis.
      keep_inputs: also return this stage's inputs.

    Returns:
      The last stage's outputs `(M, ...)` (zeros on the other stages), and this stage's inputs
      `(M, ...)` if `keep_inputs` (else an empty array).
    """
    p, m, s = manual_axis_size(axis), xs.shape[0], jax.lax.axis_index(axis)
    axes = varying_axes(jax.tree.leaves(prm)[0])
    zero = _zeros_like_varying(xs[0], axes)

    def tick(carry, t):
        recv, outs, ins = carry
        mb = t - s
        valid = (mb >= 0) & (mb < m)
        slot = jnp.clip(mb, 0, m - 1)
        inp = jnp.where(s == 0, xs[slot], recv)
        y = _cond(valid, lambda: stage_fn(prm, inp), lambda: zero)
        outs = outs.at[slot].set(jnp.where(valid & (s == p - 1), y, outs[slot]))
        if keep_inputs:
            ins = ins.at[slot].set(jnp.where(valid, inp, ins[slot]))
        return (jax.lax.ppermute(y, axis, _ring(p, +1, False)), outs, ins), None

    stack = _zeros_like_varying(xs, axes)
    init = (zero, stack, stack if keep_inputs else jnp.zeros((0,), xs.dtype))
    (_, outs, ins), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return outs, ins


def _gpipe_backward(stage_fn, prm, ins, gs, *, axis: str):
    """GPipe's backward ticks on this stage: stage s runs microbatch t − (P−1−s) in tick t.

    Args:
      stage_fn: as `_gpipe_forward`'s.
      prm: this stage's parameters, varying over `axis`.
      ins: this stage's inputs `(M, ...)` (`_gpipe_forward`'s, kept).
      gs: the output cotangents `(M, ...)`, replicated over `axis`.
      axis: the pipeline's manual mesh axis.

    Returns:
      `(parameter gradients, input cotangents (M, ...))`: the inputs' on the first stage, zeros
      elsewhere.
    """
    p, m, s = manual_axis_size(axis), ins.shape[0], jax.lax.axis_index(axis)
    axes = varying_axes(jax.tree.leaves(prm)[0])
    zero = _zeros_like_varying(ins[0], axes)
    zero_prm = jax.tree.map(lambda a: _zeros_like_varying(a, axes), prm)

    def tick(carry, t):
        recv, g_prm, g_xs = carry
        mb = t - (p - 1 - s)
        valid = (mb >= 0) & (mb < m)
        slot = jnp.clip(mb, 0, m - 1)
        g_out = jnp.where(s == p - 1, gs[slot], recv)

        def backward():
            _, vjp = jax.vjp(stage_fn, prm, ins[slot])
            return vjp(g_out)

        gp, gx = _cond(valid, backward, lambda: (zero_prm, zero))
        g_prm = jax.tree.map(jnp.add, g_prm, gp)
        g_xs = g_xs.at[slot].set(jnp.where(valid & (s == 0), gx, g_xs[slot]))
        return (jax.lax.ppermute(gx, axis, _ring(p, -1, False)), g_prm, g_xs), None

    init = (zero, zero_prm, _zeros_like_varying(ins, axes))
    (_, g_prm, g_xs), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return g_prm, g_xs


def pipelined_stack(stage_fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
                    *, mesh, num_microbatches: int, axis: str = PIPE_AXIS) -> jax.Array:
    """`y = stage_{P−1}(… stage_0(x))`, the stages run as a GPipe pipeline over `axis`; differentiable.

    The forward streams microbatches through the stages; the backward (a `jax.custom_vjp`)
    recomputes the stage inputs by a second forward pass and then streams cotangents back, one
    `jax.vjp` per stage and microbatch. For 1F1B the loss must sit inside the pipeline: see
    `pipeline_loss_and_grads`.

    Args:
      stage_fn: `stage_fn(stage_params, x_mb) -> same shape as x_mb`.
      params: a layer stack with a leading axis of length `P · layers_per_stage`, split over
        `axis` (stage s gets its slice).
      x: `(b, ...)` replicated over `axis`, cut into `num_microbatches` microbatches.
      mesh: the mesh holding `axis`.
      num_microbatches: M.
      axis: the pipeline's mesh axis.

    Returns:
      y, shaped like `x` and replicated over `axis`.

    Raises:
      ValueError: the batch does not divide into the microbatches.
    """
    m = num_microbatches
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} rows is not divisible by microbatches = {m}")
    split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])  # noqa: E731

    def local_forward(prm, xb):
        outs, _ = _gpipe_forward(stage_fn, ensure_varying(prm, (axis,)), split(xb), axis=axis,
                                 keep_inputs=False)
        return psum(outs, axis).reshape(xb.shape)

    def local_backward(prm, xb, gb):
        prm = ensure_varying(prm, (axis,))
        _, ins = _gpipe_forward(stage_fn, prm, split(xb), axis=axis, keep_inputs=True)
        g_prm, g_xs = _gpipe_backward(stage_fn, prm, ins, split(gb), axis=axis)
        return g_prm, psum(g_xs, axis).reshape(xb.shape)

    def sharded(fn, n_in, out_specs):
        return shard_map(fn, mesh=current_mesh(mesh), in_specs=(P(axis),) + (P(),) * (n_in - 1),
                         out_specs=out_specs, axis_names={axis})

    @jax.custom_vjp
    def run(prm, xb):
        return sharded(local_forward, 2, P())(prm, xb)

    def run_fwd(prm, xb):
        return run(prm, xb), (prm, xb)

    def run_bwd(res, g):
        return sharded(local_backward, 3, (P(axis), P()))(*res, g)

    run.defvjp(run_fwd, run_bwd)
    return run(params, x)
