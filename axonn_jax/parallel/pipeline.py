"""Inter-layer (pipeline) parallelism: microbatches streamed through stages with `ppermute`.

The stack of layers is split into `P` stages over the `pipe` mesh axis (stage `s` holds layers
`s·L/P … (s+1)·L/P − 1`). The batch is cut into `M` microbatches. Time advances in clock ticks; in
every tick each stage runs at most one forward (F) and then at most one backward (B), each of one
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

The backward is scheduled by hand, not by autodiff of the loop: the B operation of microbatch m on
stage s runs `jax.vjp` of the stage function at the stage input stashed by its forward, i.e. the
stage forward is recomputed inside the backward tick. Keeping `jax.vjp` residuals instead would
store every intermediate of `L/P` blocks (about 16·b·t·d floats plus the `b·h·t²` attention
probabilities per block) for each of up to M (GPipe) or 2P−3 (1F1B) microbatches; the stash of stage
inputs is one `b·t·d` activation per microbatch, for one extra stage forward per microbatch (B costs
about 3 forwards instead of 2). That is the trade AxoNN and GPipe make for large models.

The embedding runs only on the first stage and the output head + loss only on the last (a
`lax.cond` on the stage index, so the other stages skip the work). Their parameters are replicated
over `pipe`; their gradients are zero except on the stage that uses them and are summed over `pipe`
at the end. Block-parameter gradients stay on their stage (split over `pipe` like the parameters).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import psum, varying_axes

SCHEDULES = ("gpipe", "1f1b")
PIPE_AXIS = "pipe"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline timetable.

    forward[t, s] / backward[t, s]: the microbatch stage `s` runs forward / backward in tick `t`,
    or -1 (both may be set: the forward runs first). stash_slots: the most microbatch inputs any
    stage that receives activations holds at once (arrived, not yet backwarded; the first stage
    embeds its tokens again instead); cotangent_slots: likewise for cotangents that arrived before
    their backward could run.
    """

    name: str
    num_stages: int
    num_microbatches: int
    forward: np.ndarray
    backward: np.ndarray
    stash_slots: int
    cotangent_slots: int

    @property
    def num_ticks(self) -> int:
        return self.forward.shape[0]

    def busy_ticks(self) -> np.ndarray:
        """Ticks in which each stage runs a forward and a backward: `(num_stages, 2)`."""
        return np.stack([(self.forward >= 0).sum(0), (self.backward >= 0).sum(0)], axis=1)

    def step_time(self, forward_cost, backward_cost) -> float:
        """Duration of the timetable when every tick waits for its slowest stage.

        forward_cost / backward_cost: seconds of one operation, a number or a `(num_stages,)`
        array (stages differ: the first embeds, the last runs the head and the loss).
        """
        f = np.broadcast_to(np.asarray(forward_cost, float), (self.num_stages,))
        b = np.broadcast_to(np.asarray(backward_cost, float), (self.num_stages,))
        per_tick = (self.forward >= 0) * f + (self.backward >= 0) * b
        return float(per_tick.max(axis=1).sum())

    def predicted_bubble(self) -> float:
        """(P−1)/(M+P−1): the idle fraction of a stage when all stages cost the same."""
        p, m = self.num_stages, self.num_microbatches
        return (p - 1) / (m + p - 1)


def stage_order(name: str, num_stages: int, num_microbatches: int, stage: int,
                lockstep: bool = True) -> list[tuple[str, int]]:
    """The operations `[("F", mb) | ("B", mb), ...]` stage `stage` runs, in order.

    1F1B warms up with as many forwards as fit before its first backward can start: in the
    lockstep engine a microbatch needs one tick per hop to the last stage and back, so
    `2(P−1−s)`; in an asynchronous pipeline (`lockstep=False`, the MPI transport), where a stage
    starts its next operation as soon as the last one ends, `P−1−s`.
    """
    m = num_microbatches
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    hops = num_stages - 1 - stage
    warmup = min(2 * hops if lockstep else hops, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


@functools.lru_cache(maxsize=256)
def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Run each stage's operation list as early as its inputs allow, at most one F and one B per
    tick: F(m, s) one tick after F(m, s−1), B(m, s) one tick after B(m, s+1) (the last stage: in
    the tick of its own F(m) or later)."""
    if name not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {name!r}")
    p, m = num_stages, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need at least one stage and one microbatch, got pipe={p}, microbatches={m}")
    orders = [stage_order(name, p, m, s) for s in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (op, microbatch, stage) -> tick
    position = [0] * p
    forward_rows, backward_rows = [], []
    tick = 0

    def ready(op, mb, s):
        if op == "F":
            return s == 0 or done.get(("F", mb, s - 1), tick) < tick
        if s == p - 1:
            return ("F", mb, s) in done  # this tick's forward runs before its backward
        return done.get(("B", mb, s + 1), tick) < tick

    while any(position[s] < len(orders[s]) for s in range(p)):
        rows = {"F": [-1] * p, "B": [-1] * p}
        for s in range(p):
            while position[s] < len(orders[s]):
                op, mb = orders[s][position[s]]
                if rows[op][s] >= 0 or not ready(op, mb, s):
                    break
                rows[op][s] = mb
                done[(op, mb, s)] = tick
                position[s] += 1
        forward_rows.append(rows["F"])
        backward_rows.append(rows["B"])
        tick += 1
        if tick > 4 * (m + p) + 4:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError(f"schedule {name} with P={p}, M={m} does not terminate")
    forward, backward = np.asarray(forward_rows, np.int32), np.asarray(backward_rows, np.int32)
    receivers = range(1, p) if p > 1 else range(p)
    stash = _max_live(lambda mb, s: done[("F", mb, s - 1)] + 1 if s else done[("F", mb, s)],
                      lambda mb, s: done[("B", mb, s)], receivers, m)
    cot = _max_live(lambda mb, s: done[("B", mb, s + 1)] + 1 if s < p - 1 else done[("B", mb, s)],
                    lambda mb, s: done[("B", mb, s)], range(p), m)
    return Schedule(name, p, m, forward, backward, stash, cot)


def _max_live(arrive: Callable, leave: Callable, stages, m: int) -> int:
    """Most microbatches any of `stages` holds in [arrive, leave]. Microbatches arrive and leave
    every stage in order (FIFO), so slot `mb % slots` never holds two live microbatches."""
    most = 1
    for s in stages:
        spans = [(arrive(mb, s), leave(mb, s)) for mb in range(m)]
        assert all(a <= b for a, b in spans) and spans == sorted(spans), (s, spans)
        for t in {a for a, _ in spans}:
            most = max(most, sum(a <= t <= b for a, b in spans))
    return most


def check_layers(num_layers: int, num_stages: int) -> int:
    """Layers per stage; a clear error when the stack does not split evenly."""
    if num_layers % num_stages:
        raise ValueError(f"num_layers = {num_layers} is not divisible by pipe = {num_stages}: "
                         f"every pipeline stage must hold the same number of layers")
    return num_layers // num_stages


def _zeros_like_varying(x, axes: frozenset[str]):
    zeros = jnp.zeros(x.shape, x.dtype)
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def pipeline_loss_and_grads(
    embed_fn: Callable[[Any, jax.Array], jax.Array],
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    head_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: tuple[Any, Any, Any],
    batch: Any,
    schedule: Schedule,
    axis: str = PIPE_AXIS,
) -> tuple[jax.Array, tuple[Any, Any, Any]]:
    """Loss and parameter gradients of a pipelined model; call inside a shard_map manual over `axis`.

    params = (embed_params, stage_params, head_params). embed/head params: replicated over `axis`;
    stage_params: this stage's slice of the layer stack (split over `axis`). All of them must already
    be varying over every manual axis (so gradients stay per-device until reduced by the caller).
    batch: a pytree of `(b, ...)` arrays, this device's rows (replicated over `axis`), cut into
    `schedule.num_microbatches` microbatches of `b/M` rows.
    embed_fn(embed_params, batch_mb) -> x `(b/M, ...)`; stage_fn(stage_params, x) -> x (same shape);
    head_fn(head_params, x, batch_mb) -> mean loss of the microbatch (float32 scalar).

    Returns the mean loss over the microbatches (equal on every stage) and the gradients:
    embed/head summed over `axis` (so replicated), stage gradients local to the stage.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % m:
        raise ValueError(f"the local batch of {rows} rows is not divisible by microbatches = {m}")
    batch = jax.tree.map(lambda a: a.reshape(m, rows // m, *a.shape[1:]), batch)
    microbatch = lambda i: jax.tree.map(lambda a: a[i], batch)  # noqa: E731
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == p - 1
    embed_params, _, head_params = params
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(params)))
    act = jax.eval_shape(embed_fn, embed_params, microbatch(0))

    def stage_forward(prm, x_in, mb_batch):
        emb, blocks, _ = prm
        x = jax.lax.cond(first, lambda: embed_fn(emb, mb_batch).astype(act.dtype), lambda: x_in)
        return stage_fn(blocks, x)

    def stage_apply(prm, x_in, mb_batch):
        y = stage_forward(prm, x_in, mb_batch)
        loss = jax.lax.cond(last, lambda: head_fn(prm[2], y, mb_batch).astype(jnp.float32),
                            lambda: _zeros_like_varying(jnp.zeros((), jnp.float32), axes))
        return y, loss

    forward_table, backward_table = jnp.asarray(schedule.forward), jnp.asarray(schedule.backward)
    k_act, k_cot = schedule.stash_slots, schedule.cotangent_slots
    zero_act = _zeros_like_varying(jnp.zeros(act.shape, act.dtype), axes)

    def tick(carry, t):
        stash, cots, act_in, cot_in, grads, loss = carry
        # Store what arrived at the end of the previous tick, tagged by the sender's table entry.
        prev = jnp.maximum(t - 1, 0)
        got_act = jnp.where((t > 0) & ~first, forward_table[prev, jnp.maximum(stage - 1, 0)], -1)
        got_cot = jnp.where((t > 0) & ~last, backward_table[prev, jnp.minimum(stage + 1, p - 1)], -1)
        slot = got_act % k_act
        stash = stash.at[slot].set(jnp.where(got_act >= 0, act_in, stash[slot]))
        slot = got_cot % k_cot
        cots = cots.at[slot].set(jnp.where(got_cot >= 0, cot_in, cots[slot]))

        f_mb, b_mb = forward_table[t, stage], backward_table[t, stage]
        f_slot, b_slot = jnp.maximum(f_mb, 0), jnp.maximum(b_mb, 0)

        def forward(_):
            return stage_forward(params, stash[f_slot % k_act], microbatch(f_slot))

        def backward(_):
            mb_batch = microbatch(b_slot)
            (y, mb_loss), vjp = jax.vjp(lambda prm, x: stage_apply(prm, x, mb_batch),
                                        params, stash[b_slot % k_act])
            g_y = jnp.where(last, jnp.zeros_like(y), cots[b_slot % k_cot])
            g_loss = jnp.where(last, 1.0 / m, 0.0).astype(jnp.float32)
            g_params, g_x = vjp((g_y, _zeros_like_varying(g_loss, axes) + g_loss))
            return g_params, g_x, mb_loss

        def idle_backward(_):
            return (jax.tree.map(lambda x: _zeros_like_varying(x, axes), params), zero_act,
                    _zeros_like_varying(jnp.zeros((), jnp.float32), axes))

        # The last stage's forward output goes nowhere (its backward recomputes it): skip it.
        y = jax.lax.cond((f_mb >= 0) & ~last, forward, lambda _: zero_act, None)
        g_params, g_x, mb_loss = jax.lax.cond(b_mb >= 0, backward, idle_backward, None)
        grads = jax.tree.map(jnp.add, grads, g_params)
        loss = loss + mb_loss / m
        act_out = jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(p - 1)])
        cot_out = jax.lax.ppermute(g_x, axis, [(i + 1, i) for i in range(p - 1)])
        return (stash, cots, act_out, cot_out, grads, loss), None

    carry = (
        _zeros_like_varying(jnp.zeros((k_act, *act.shape), act.dtype), axes),
        _zeros_like_varying(jnp.zeros((k_cot, *act.shape), act.dtype), axes),
        zero_act,
        zero_act,
        jax.tree.map(lambda x: _zeros_like_varying(x, axes), params),
        _zeros_like_varying(jnp.zeros((), jnp.float32), axes),
    )
    (_, _, _, _, grads, loss), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
    g_embed, g_stage, g_head = grads
    # Only the first (last) stage has nonzero embedding (head) gradients; only the last has the loss.
    g_embed, g_head, loss = psum((g_embed, g_head, loss), axis)  # CPU-safe for 16-bit
    return loss, (g_embed, g_stage, g_head)


def pipelined_stack(stage_fn: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array,
                    *, mesh, num_microbatches: int, axis: str = PIPE_AXIS) -> jax.Array:
    """`y = stage_{P−1}(… stage_0(x))`, the stages run as a GPipe pipeline over `axis`; differentiable.

    params: a layer stack with a leading axis of length `P · layers_per_stage`, split over `axis`
    (stage s gets its slice); stage_fn(stage_params, x_mb) -> same shape as x_mb.
    x: `(b, ...)` replicated over `axis`, cut into `num_microbatches` microbatches; y likewise.
    The forward streams microbatches through the stages; the backward (a `jax.custom_vjp`) recomputes
    the stage inputs by a second forward pass and then streams cotangents back, one `jax.vjp` per
    stage and microbatch. For 1F1B the loss must sit inside the pipeline: see
    `pipeline_loss_and_grads`.
    """
    from jax.sharding import PartitionSpec as Spec

    from .._compat import current_mesh, shard_map

    p, m = int(mesh.shape[axis]), num_microbatches
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} rows is not divisible by microbatches = {m}")
    perm_up = [(i, i + 1) for i in range(p - 1)]
    perm_down = [(i + 1, i) for i in range(p - 1)]

    def forward_ticks(prm, xs, keep_inputs):
        """Stage s runs microbatch t − s in tick t. Returns the last stage's outputs `(m, ...)`
        (zeros elsewhere) and, if asked, this stage's inputs `(m, ...)`."""
        s = jax.lax.axis_index(axis)
        axes = varying_axes(jax.tree.leaves(prm)[0])
        zero = _zeros_like_varying(xs[0], axes)

        def tick(carry, t):
            recv, outs, ins = carry
            mb = t - s
            valid = (mb >= 0) & (mb < m)
            slot = jnp.clip(mb, 0, m - 1)
            inp = jnp.where(s == 0, xs[slot], recv)
            y = jax.lax.cond(valid, lambda: stage_fn(prm, inp), lambda: zero)
            outs = outs.at[slot].set(jnp.where(valid & (s == p - 1), y, outs[slot]))
            if keep_inputs:
                ins = ins.at[slot].set(jnp.where(valid, inp, ins[slot]))
            return (jax.lax.ppermute(y, axis, perm_up), outs, ins), None

        stack = _zeros_like_varying(xs, axes)
        init = (zero, stack, stack if keep_inputs else jnp.zeros((0,), xs.dtype))
        (_, outs, ins), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
        return outs, ins

    def split(a):
        return a.reshape(m, a.shape[0] // m, *a.shape[1:])

    def local_forward(prm, xb):
        outs, _ = forward_ticks(prm, split(xb), keep_inputs=False)
        return psum(outs, axis).reshape(xb.shape)

    def local_backward(prm, xb, gb):
        _, ins = forward_ticks(prm, split(xb), keep_inputs=True)
        gs, s = split(gb), jax.lax.axis_index(axis)
        axes = varying_axes(jax.tree.leaves(prm)[0])
        zero = _zeros_like_varying(ins[0], axes)

        def tick(carry, t):  # stage s runs the backward of microbatch t − (P−1−s) in tick t
            recv, g_prm, g_xs = carry
            mb = t - (p - 1 - s)
            valid = (mb >= 0) & (mb < m)
            slot = jnp.clip(mb, 0, m - 1)
            g_out = jnp.where(s == p - 1, gs[slot], recv)

            def backward():
                _, vjp = jax.vjp(stage_fn, prm, ins[slot])
                return vjp(g_out)

            gp, gx = jax.lax.cond(valid, backward, lambda: (
                jax.tree.map(lambda a: _zeros_like_varying(a, axes), prm), zero))
            g_prm = jax.tree.map(jnp.add, g_prm, gp)
            g_xs = g_xs.at[slot].set(jnp.where(valid & (s == 0), gx, g_xs[slot]))
            return (jax.lax.ppermute(gx, axis, perm_down), g_prm, g_xs), None

        init = (zero, jax.tree.map(lambda a: _zeros_like_varying(a, axes), prm),
                _zeros_like_varying(ins, axes))
        (_, g_prm, g_xs), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
        return g_prm, psum(g_xs, axis).reshape(xb.shape)

    def sharded(fn, n_in, out_specs):
        in_specs = (Spec(axis),) + (Spec(),) * (n_in - 1)
        return shard_map(fn, mesh=current_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names={axis})

    def ensure(prm):
        from .._compat import ensure_varying
        return ensure_varying(prm, (axis,))

    @jax.custom_vjp
    def run(prm, xb):
        return sharded(lambda a, b: local_forward(ensure(a), b), 2, Spec())(prm, xb)

    def run_fwd(prm, xb):
        return run(prm, xb), (prm, xb)

    def run_bwd(res, g):
        prm, xb = res
        return sharded(lambda a, b, c: local_backward(ensure(a), b, c), 3,
                       (Spec(axis), Spec()))(prm, xb, g)

    run.defvjp(run_fwd, run_bwd)
    return run(params, x)
