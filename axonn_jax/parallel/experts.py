"""Routed experts and expert parallelism: tokens to the experts a router chose, through each
expert's SwiGLU, and back in order.

`routed_swiglu(x, expert_ids, weights, w_gate, w_up, w_down, ...)` runs anywhere: on one device,
or inside a `shard_map` that is manual over the `expert` axis (name given by `axis`), where the
expert weights are the local slice of the experts (split over the axis on their leading dim)
and the tokens are the device's own. The same code serves both: every (token, choice) pair, an
*assignment*, gets a slot in a send buffer laid out by destination, the buffer crosses the axis
with one all-to-all (none on one device), the receiving device runs its experts, and a second
all-to-all brings the rows back to the slots they left from.

Two ways to lay out the send buffer:

- **dropless** (`capacity_factor=None`): one chunk of slots per destination device; the
  receiver sorts its rows by expert and runs one grouped matmul per projection
  (`expert_matmul`): on a GPU mesh the kernels of `parallel.grouped_matmul`, which compute the
  routed rows only; on CPU `jax.lax.ragged_dot`, which jaxlib computes densely, every row of the
  buffer against every local expert (`benchmarks/results/moe.md`, `moe_grouped.md`). On one
  device the chunk holds every assignment.
  With `expert > 1` a chunk holds every assignment of the device (`T·k` rows, nothing is ever
  dropped) unless `dispatch_factor` sets it to `ceil(dispatch_factor·T·k/expert)`, when
  assignments past a full chunk are dropped and counted. On a GPU mesh the chunks cross the axis
  by `jax.lax.ragged_all_to_all` (`parallel.ragged`): the counts first (a small all-gather of
  every device's rows per expert), then only the rows used, packed on both sides (the receive
  buffer keeps the padded size), and the receiver regroups them by expert from the counts
  instead of sorting. XLA:CPU cannot run it ("HLO opcode `ragged-all-to-all` is not supported by
  XLA:CPU"), so there the exchange is a padded all-to-all of every chunk whole; both give the
  same result. On a GPU mesh the exchanges, the kernels and the combine run in one shard_map
  manual over the tensor axes (`_over_tensor_axes`; without an expert axis the same block
  without exchanges), so that the experts' partial sums over `row` are added once per token,
  not once per row of the receive buffer.
- **capacity-based** (`capacity_factor=c`): one chunk of `C = ceil(c·T·k/E)` slots per expert;
  assignments past an expert's capacity are dropped (counted), top-1 choices before top-2 (GShard's
  priority), earlier tokens first; each expert runs one dense matmul on its `expert·C` rows.
  With `expert > 1` every device fills its own `C` slots of each expert from its own tokens, so
  which assignments drop depends on how the batch is split; a capacity that drops nothing gives
  the single device's result on every grid.

Slots are given by a stable sort of the assignments by group, in choice-major order (all first
choices, then all second ones), so both layouts keep that priority.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..config import Axis
from .._compat import (automatic_axes, ensure_varying, manual_axis_size, nested_shard_map,
                      psum)
from ..batch_axis import BatchAxis
from . import grouped_matmul, ragged as ragged_lib

AXIS = BatchAxis(Axis.EXPERT, dim=0,
                 splits=lambda model, seq_len: getattr(model, "num_experts", 1) > 1)
"""Expert parallelism as a batch axis: the rows over `expert`; the experts' weights split over it
and the rest of the model is data-parallel over it (the step sums those gradients); for mixtures
of experts (a model with `num_experts`)."""


def local_experts(num_experts: int, axis: str) -> int:
    """Experts each device of the manual mesh axis `axis` holds.

    Args:
      num_experts: experts of the layer.
      axis: the mesh axis that splits them.

    Returns:
      `num_experts / axis size` inside a shard_map manual over `axis`; all of them outside one.

    Raises:
      ValueError: `num_experts` does not divide over the axis (the message names the numbers).
    """
    n = manual_axis_size(axis)
    if num_experts % n:
        raise ValueError(f"num_experts = {num_experts} is not divisible by the {axis} axis ({n})")
    return num_experts // n


def capacity(rows: int, factor: float, groups: int) -> int:
    """Slots per group for `rows` assignments over `groups` groups.

    Args:
      rows: assignments to place.
      factor: the capacity (or dispatch) factor.
      groups: the groups (experts, or devices).

    Returns:
      `ceil(factor·rows/groups)`, at least 1 and at most `rows` (more could never fill).
    """
    return max(1, min(rows, math.ceil(factor * rows / groups)))


def layout(num_tokens: int, top_k: int, num_experts: int, devices: int,
           capacity_factor: float | None = None,
           dispatch_factor: float | None = None) -> tuple[int, int]:
    """(groups, slots per group) of the send buffer for `num_tokens` local tokens.

    See the module docstring.

    Args:
      num_tokens: this device's tokens.
      top_k: experts each token is routed to.
      num_experts: experts of the layer.
      devices: devices on the expert axis.
      capacity_factor: None for dropless, else the capacity per expert (`capacity`).
      dispatch_factor: dropless over several devices: the rows sent to each device
        (`capacity`); None: every assignment fits.

    Returns:
      `(num_experts, capacity)` with a capacity factor, else `(devices, rows per device)`.
    """
    rows = num_tokens * top_k
    if capacity_factor is not None:
        return num_experts, capacity(rows, capacity_factor, num_experts)
    if devices == 1 or dispatch_factor is None:
        return devices, rows
    return devices, capacity(rows, dispatch_factor, devices)


def assign_slots(expert_ids: jax.Array, num_experts: int, groups: int, slots: int) -> jax.Array:
    """The send-buffer slot of each assignment, or `groups·slots` for a dropped one.

    Group `g` holds experts `[g·E/groups, (g+1)·E/groups)`; within a group slots go by priority
    (a full group drops its last assignments, whichever their experts).

    Args:
      expert_ids: `(A,)` the expert of each assignment, in priority order.
      num_experts: experts of the layer (`E`).
      groups: the send buffer's groups.
      slots: slots per group.

    Returns:
      `(A,)` int32 in `[0, groups·slots)`, or `groups·slots` for an assignment dropped because
      its group is full.
    """
    group = expert_ids // (num_experts // groups)
    order = jnp.argsort(group, stable=True)
    counts = jnp.bincount(group, length=groups)
    starts = jnp.cumsum(counts) - counts  # first sorted position of each group
    group = group[order]
    position = jnp.arange(expert_ids.shape[0]) - starts[group]
    slot = jnp.where(position < slots, group * slots + position, groups * slots)
    return jnp.zeros_like(slot).at[order].set(slot)


def exchange(buffer: jax.Array, axis: str, devices: int) -> jax.Array:
    """Chunk `j` of `buffer`'s leading dim to device `j` of `axis` (an all-to-all).

    Args:
      buffer: `(devices·chunk, ...)`, chunk `j` for device `j`.
      axis: a manual mesh axis of the enclosing shard_map.
      devices: devices on `axis` (1: nothing is sent).

    Returns:
      The same shape; chunk `i` from device `i` (`buffer` itself on one device).
    """
    if devices == 1:
        return buffer
    return jax.lax.all_to_all(buffer, axis, 0, 0, tiled=True)


def _swiglu(dot, rows, w_gate, w_up, w_down):
    return dot(jax.nn.silu(dot(rows, w_gate)) * dot(rows, w_up), w_down)


def grouped_swiglu(rows: jax.Array, ids: jax.Array, w_gate, w_up, w_down, *,
                   routed_rows: int | None = None) -> jax.Array:
    """Each row through its expert's SwiGLU, by grouped matmuls.

    The rows are sorted by expert for one grouped matmul per projection, the gate and up
    projections in one (`expert_matmul`).

    Args:
      rows: `(R, d)`.
      ids: `(R,)` int32 the expert of each row; a row with id ≥ the number of experts (an empty
        slot) comes out zero.
      w_gate: `(E, d, ff)`.
      w_up: `(E, d, ff)`.
      w_down: `(E, ff, d)`.
      routed_rows: the rows routed on average (the kernels' declared FLOPs).

    Returns:
      `(R, d)`, row `r` through expert `ids[r]`'s SwiGLU.
    """
    experts = w_gate.shape[0]
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=experts).astype(jnp.int32)  # empty slots sort last, uncounted
    out = sorted_swiglu(rows[order], sizes, w_gate, w_up, w_down, routed_rows=routed_rows)
    return jnp.zeros_like(out).at[order].set(out)


def sorted_swiglu(rows: jax.Array, sizes: jax.Array, w_gate, w_up, w_down, *,
                  routed_rows: int | None = None) -> jax.Array:
    """Rows sorted by expert through their experts' SwiGLU, by grouped matmuls.

    The gate and up projections run in one grouped matmul (`expert_matmul`), the down
    projection in another.

    Args:
      rows: `(R, d)`, expert 0's first, then expert 1's, ...
      sizes: `(E,)` int32 rows per expert; the rows past `Σ sizes` come out zero.
      w_gate: `(E, d, ff)`.
      w_up: `(E, d, ff)`.
      w_down: `(E, ff, d)`.
      routed_rows: the rows routed on average (the kernels' declared FLOPs).

    Returns:
      `(R, d)`.
    """
    gate, up = expert_matmul(rows, (w_gate, w_up), sizes, axes=(Axis.COL, Axis.ROW),
                             routed_rows=routed_rows)
    (out,) = expert_matmul(jax.nn.silu(gate) * up, (w_down,), sizes, axes=(Axis.ROW, Axis.COL),
                           routed_rows=routed_rows)
    return out


def expert_matmul(rows: jax.Array, weights: tuple[jax.Array, ...], sizes: jax.Array, *,
                  axes: tuple[str, str], routed_rows: int | None = None) -> tuple[jax.Array, ...]:
    """Projections of the same sorted rows: `jax.lax.ragged_dot(rows, w, sizes)` for each `w`.

    On CPU: `ragged_dot` (GSPMD partitions it). On GPU: the grouped-matmul kernels, which GSPMD
    cannot partition (it would gather the weights and repeat the work on every device), so they
    run in a shard_map manual over the automatic axes, laid out as AxoNN splits a dense layer:
    each device multiplies its `K` slice by its `(K, N)` blocks, all weights in one kernel (one
    input gradient, hence one all-reduce of it), and the partial sums over `axes[0]` are added
    there in the compute dtype (an all-reduce).

    Args:
      rows: `(R, K)` sorted by expert.
      weights: `(E, K, N)` each, `K` split over `axes[0]` and `N` over `axes[1]` (the experts'
        partitioning metadata, `models.moe.MoE`) where those mesh axes are automatic.
      sizes: `(E,)` int32 rows per expert.
      axes: the mesh axes splitting (contracted, output) features.
      routed_rows: rows routed on average (`parallel.grouped_matmul`'s declared FLOPs).

    Returns:
      One `(R, N)` array in `rows.dtype` per weight, laid out by GSPMD (from the kernel path `N`
      over `axes[1]`).
    """
    if not grouped_matmul.use_kernel():
        return tuple(jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes) for w in weights)
    count = len(weights)
    mesh = jax.sharding.get_abstract_mesh()
    auto = automatic_axes()
    k_axis, n_axis = (a if a in auto else None for a in axes)

    def local(r, s, *ws):  # (R, count, N_local), summed over the contracted features' axis
        # In the compute dtype, an all-reduce (GSPMD adds partial sums handed out of the
        # shard_map in float32, or by collective permutes where told to add in 16 bits).
        return _local_matmul(r, ws, s, summed_over=k_axis, routed_rows=routed_rows,
                             platform="gpu")

    if auto:
        P = jax.sharding.PartitionSpec
        local = nested_shard_map(
            local, mesh=mesh, in_specs=(P(None, k_axis), P(), *[P(None, k_axis, n_axis)] * count),
            out_specs=P(None, None, n_axis), axis_names=auto)
    y = local(rows, sizes, *weights)
    return tuple(y[:, i] for i in range(count))


def _local_matmul(rows, weights, sizes, *, summed_over: str | None, routed_rows: int | None,
                  platform: str) -> jax.Array:
    """`(R, len(weights), N)`: this device's blocks of `expert_matmul`'s projections, the
    partial sums over the manual mesh axis `summed_over` (None: none) added by an all-reduce.

    On GPU all weights go through one grouped matmul (`parallel.grouped_matmul`), so their
    input gradients meet in one all-reduce; elsewhere each is a `ragged_dot` of its own."""
    if platform != "gpu":
        y = jnp.stack([grouped_matmul.grouped_matmul(rows, w, sizes, platform=platform)
                       for w in weights], axis=1)
    else:
        w = jnp.concatenate([w.astype(rows.dtype) for w in weights], axis=-1)
        y = grouped_matmul.grouped_matmul(rows, w, sizes, routed_rows=routed_rows,
                                          platform=platform)
        y = y.reshape(y.shape[0], len(weights), -1)
    return psum(y, summed_over) if summed_over else y


def batched_swiglu(rows: jax.Array, w_gate, w_up, w_down) -> jax.Array:
    """Expert `e`'s rows through its SwiGLU, for every expert at once (batched einsums).

    Args:
      rows: `(E, R, d)`, expert `e`'s rows at index `e`.
      w_gate: `(E, d, ff)`.
      w_up: `(E, d, ff)`.
      w_down: `(E, ff, d)`.

    Returns:
      `(E, R, d)`.
    """
    dot = lambda a, w: jnp.einsum("erd,edf->erf", a, w.astype(a.dtype))  # noqa: E731
    return _swiglu(dot, rows, w_gate, w_up, w_down)


def routed_swiglu(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate, w_up, w_down, *,
                  num_experts: int, axis: str = Axis.EXPERT, capacity_factor: float | None = None,
                  dispatch_factor: float | None = None,
                  ragged: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Each token through the experts its router chose, summed with the combine weights.

    Expert weights hold all `num_experts` outside a shard_map manual over `axis`, inside one the
    `E_l = num_experts / axis size` experts of this device (split over `axis` on dim 0).
    Layouts: see the module docstring.

    Args:
      x: `(T, d)` this device's tokens.
      expert_ids: `(T, k)` int32 in `[0, num_experts)`.
      weights: `(T, k)` combine weights.
      w_gate: `(E_l, d, ff)`.
      w_up: `(E_l, d, ff)`.
      w_down: `(E_l, ff, d)`.
      num_experts: experts of the layer.
      axis: the expert mesh axis.
      capacity_factor: None for dropless, else the capacity per expert.
      dispatch_factor: dropless over several devices: the rows sent to each device; None: every
        assignment fits.
      ragged: whether a dropless layer sends only the routed rows over `axis`
        (`parallel.ragged`) and runs manual over the tensor axes, its sums over `row` per token
        (`_over_tensor_axes`; None: on a GPU mesh); on CPU, forced, it runs `ragged.reference`.

    Returns:
      `(y, dropped)`: `y (T, d)` = Σ_j weights[t, j]·SwiGLU_{expert_ids[t, j]}(x[t]) over the
      choices that were not dropped, and `dropped`, the number of dropped assignments (int32
      scalar, this device's).

    Raises:
      ValueError: `num_experts` does not divide over `axis`.
    """
    t, d = x.shape
    k = expert_ids.shape[1]
    n = manual_axis_size(axis)
    local = local_experts(num_experts, axis)
    groups, slots = layout(t, k, num_experts, n, capacity_factor, dispatch_factor)
    ids = expert_ids.T.reshape(-1)  # choice-major: every first choice before any second one
    token = jnp.tile(jnp.arange(t), k)
    slot = assign_slots(ids, num_experts, groups, slots)
    size = groups * slots
    if ragged is None:
        ragged = ragged_lib.use_ragged()
    if capacity_factor is None and n > 1 and ragged:
        return _ragged_dropless(x, token, slot, ids, weights, w_gate, w_up, w_down, axis=axis,
                                slots=slots, local=local, routed_rows=min(size, t * k))
    if capacity_factor is None and n == 1 and ragged:
        return _local_dropless(x, token, ids, weights, w_gate, w_up, w_down)
    buffer = jnp.zeros((size, d), x.dtype).at[slot].set(x[token], mode="drop")
    received = exchange(buffer, axis, n)
    if capacity_factor is not None:  # (source, expert, slot) -> (expert, source·slot)
        per_expert = received.reshape(n, local, slots, d).transpose(1, 0, 2, 3)
        out = batched_swiglu(per_expert.reshape(local, n * slots, d), w_gate, w_up, w_down)
        out = out.reshape(local, n, slots, d).transpose(1, 0, 2, 3).reshape(size, d)
    else:
        local_ids = jnp.full((size,), local, jnp.int32).at[slot].set(ids % local, mode="drop")
        # Rows a device receives on average: the assignments it sends (the kernels' FLOPs).
        out = grouped_swiglu(received, exchange(local_ids, axis, n), w_gate, w_up, w_down,
                             routed_rows=min(size, t * k))
    rows = exchange(out, axis, n).at[slot].get(mode="fill", fill_value=0)
    return _combine(rows, weights), jnp.sum(slot == size, dtype=jnp.int32)


def _combine(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """`(T, d)`: each token's returned rows `rows (k·T, d)` (choice-major) summed with its
    combine weights `weights (T, k)`."""
    t, k = weights.shape
    return (rows * weights.T.reshape(-1, 1).astype(rows.dtype)).reshape(k, t, -1).sum(0)


def _ragged_dropless(x, token, slot, ids, weights, w_gate, w_up, w_down, *, axis: str, slots: int,
                     local: int, routed_rows: int) -> tuple[jax.Array, jax.Array]:
    """The dropless layer over `axis` with ragged exchanges (`routed_swiglu`'s result).

    Both sides keep the rows packed (`ragged.chunk_plan`): the send buffer holds the routed rows
    only (`T·k`, by destination), the receive buffer (`n·slots` rows, the most a dropless layer
    can receive) what arrived from its first row on. With one expert per device the rows go
    through the grouped kernels as they lie; with several, the sender orders its rows by expert
    and the receiver regroups them by expert from every device's counts (`_regroup`: two
    gathers, no sort, no expert ids exchanged). The exchanges and the experts run in
    `_routed_block`, manual over the tensor axes.

    Args:
      x: `(T, d)` this device's tokens.
      token: `(k·T,)` int32 each assignment's token (its row of `x`).
      slot: `(k·T,)` int32 each assignment's row of the padded layout, `n·slots` rows in chunks
        of `slots` per destination (`n·slots`: dropped).
      ids: `(k·T,)` int32 each assignment's expert.
      weights: `(T, k)` combine weights. Expert weights: as `routed_swiglu`'s, local slices.
      axis, slots, local: the manual mesh axis, rows per chunk, experts per device.
      routed_rows: rows one device sends on average (its assignments, the chunk capacity
        allowing): `analysis.hlo` charges them, not the padded buffer.

    Returns:
      `(y (T, d), dropped)` as `routed_swiglu`.
    """
    assignments = slot.shape[0]
    n = manual_axis_size(axis)
    size = n * slots
    chunk = slot // slots  # n: dropped
    if local == 1:
        plan = ragged_lib.chunk_plan(jnp.bincount(chunk, length=n + 1)[:n], slots, axis)
        # Each assignment's row of the packed send buffer; a dropped one (chunk n, slot n·slots)
        # lands on `assignments`, past the buffer.
        starts = jnp.concatenate([plan.input_offsets, jnp.array([assignments], jnp.int32)])
        packed = starts[chunk] + slot % slots  # (k·T,)
        # The received rows are one expert's, from the first row on: no sort.
        routing = dict(sizes=jnp.sum(plan.recv_sizes, keepdims=True))
    else:
        packed, plan, from_each = _send_by_expert(ids, chunk, n, local, axis)
        to_sorted, to_received, sizes = _regroup(from_each, plan.recv_offsets, size)
        routing = dict(sizes=sizes, to_sorted=to_sorted, to_received=to_received)
    routing.update(packed=packed, plan=plan,
                   rows=jnp.zeros_like(token).at[packed].set(token, mode="drop"))
    block = functools.partial(_routed_block, axis=axis, size=size, routed_rows=routed_rows)
    return _over_tensor_axes(block, x, routing, weights, w_gate, w_up, w_down), \
        jnp.sum(slot == size, dtype=jnp.int32)


def _local_dropless(x, token, ids, weights, w_gate, w_up, w_down) -> tuple[jax.Array, jax.Array]:
    """The dropless layer without an expert axis to cross (`routed_swiglu`'s result): the
    assignments sorted by expert through the grouped kernels, in `_routed_block` without its
    exchanges, manual over the tensor axes.

    Args:
      x: `(T, d)` the tokens.
      token: `(k·T,)` int32 each assignment's token.
      ids: `(k·T,)` int32 each assignment's expert.
      weights: `(T, k)` combine weights. Expert weights: as `routed_swiglu`'s.

    Returns:
      `(y (T, d), 0)`: nothing is dropped.
    """
    order = jnp.argsort(ids, stable=True)
    routing = dict(sizes=jnp.bincount(ids, length=w_gate.shape[0]).astype(jnp.int32),
                   rows=token[order], packed=jnp.zeros_like(order).at[order].set(
                       jnp.arange(order.shape[0], dtype=order.dtype)))
    block = functools.partial(_routed_block, axis=None, size=ids.shape[0],
                              routed_rows=ids.shape[0])
    return _over_tensor_axes(block, x, routing, weights, w_gate, w_up, w_down), \
        jnp.zeros((), jnp.int32)


def _over_tensor_axes(block, x, routing, weights, w_gate, w_up, w_down) -> jax.Array:
    """`block(keep, x, routing, weights, w_gate, w_up, w_down, row=, col=)` in a shard_map
    manual over the automatic mesh axes (`compat.nested_shard_map`), the experts' features split
    over (`col`, `row`) as their partitioning metadata says; called as it is without such axes.

    The experts' partial sums over `row` go back through the return exchange and the combine
    unreduced and are added once per token (`(T, d)`, where GSPMD's layout adds them per
    received row, `n·slots ≥ k·T` of them); the tokens' gradient likewise. The backward reads
    the two exchanges' results kept from the forward instead of exchanging again.

    Args:
      block: `_routed_block` with its static arguments bound but the platform.
      x: `(T, d)` this device's tokens.
      routing: `_routed_block`'s (integer arrays, whole on every device of the tensor axes).
      weights: `(T, k)` combine weights.
      w_gate, w_up, w_down: the local experts' weights, laid out as `routed_swiglu`'s.

    Returns:
      `(T, d)`, features over `col`.
    """
    block = functools.partial(block, platform="gpu" if grouped_matmul.use_kernel() else "cpu")
    auto = automatic_axes()
    if not auto:
        return block(lambda v: v, x, routing, weights, w_gate, w_up, w_down, row=None, col=None)
    row, col = (a if a in auto else None for a in (Axis.ROW, Axis.COL))
    P = jax.sharding.PartitionSpec
    local = nested_shard_map(
        functools.partial(block, row=row, col=col), mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(None, col), P(), P(), P(None, col, row), P(None, col, row), P(None, row, col)),
        out_specs=P(None, col), axis_names=auto, kept_specs=(P(None, col), P(row, col)))
    return local(x, routing, weights, w_gate, w_up, w_down)


def _routed_block(keep, x, routing, weights, w_gate, w_up, w_down, *, row: str | None,
                  col: str | None, axis: str, size: int, routed_rows: int,
                  platform: str) -> jax.Array:
    """One device's blocks of `_ragged_dropless`'s exchanges, experts and combine.

    Args:
      keep: `nested_shard_map`'s: the two exchanges' results go through it.
      x: `(T, d/col)`.
      routing: `packed`, `rows`, `sizes`, with an exchange its `plan` (`ragged.ChunkPlan`), with
        several local experts `to_sorted` and `to_received` (`_ragged_dropless`).
      weights: `(T, k)` combine weights.
      w_gate, w_up: `(E_l, d/col, ff/row)`; w_down: `(E_l, ff/row, d/col)`.
      row, col: the manual tensor axes splitting the experts' (hidden, model) features, or None.
      axis, size, routed_rows, platform: the expert axis (None: no exchange), rows of the
        receive buffer, rows routed on average, and the kernels' platform.

    Returns:
      `(T, d/col)`, summed over `row`.
    """
    plan = routing.get("plan")

    def exchange(rows, out_rows, plan):  # over `axis` (none without one)
        if plan is None:
            return rows
        # Fill arrays made `_like` the routed data vary over the same mesh axes (autodiff
        # needs it).
        with ragged_lib.routed_rows(routed_rows):
            return ragged_lib.ragged_all_to_all(
                rows, jnp.zeros_like(rows, shape=(out_rows, rows.shape[1])), plan, axis)

    # Varying over row from here, so that the tokens' and the combine weights' gradients are
    # added over row once, on the tokens, not on the received rows (the weights' over col too:
    # they meet rows whose features are split over it).
    x, weights = _summed_back(x, row), _summed_back(weights, row, col)
    received = keep(exchange(x[routing["rows"]], size, plan))
    if "to_sorted" in routing:
        received = received[routing["to_sorted"]]
    gate, up = jnp.unstack(_local_matmul(received, (w_gate, w_up), routing["sizes"],
                                         summed_over=col, routed_rows=routed_rows,
                                         platform=platform), axis=1)
    hidden = _summed_back(jax.nn.silu(gate) * up, col)
    (out,) = jnp.unstack(_local_matmul(hidden, (w_down,), routing["sizes"], summed_over=None,
                                       routed_rows=routed_rows, platform=platform), axis=1)
    if "to_received" in routing:
        out = out[routing["to_received"]]
    packed = routing["packed"]
    back = keep(exchange(out, packed.shape[0], None if plan is None else plan.reverse()))
    y = _combine(back.at[packed].get(mode="fill", fill_value=0), weights)
    return psum(y, row) if row else y


def _summed_back(tree, *axes: str | None):
    """`tree` cast to vary over the manual mesh `axes` (None among them: left out), its
    cotangent added over them by `compat.psum` (16-bit floats in float32 on CPU, where XLA
    aborts on them). `tree` must be invariant over `axes` (a sum over an axis it already varies
    over would add the devices' distinct values)."""
    axes = tuple(a for a in axes if a)
    return _vary(tree, axes) if axes else tree


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _vary(tree, axes):
    return ensure_varying(tree, axes)


_vary.defvjp(lambda tree, axes: (_vary(tree, axes), None),
             lambda axes, _, ct: (psum(ct, axes),))


def _send_by_expert(ids, chunk, n: int, local: int, axis: str):
    """With several experts per device: the packed send buffer ordered by expert.

    Args:
      ids: `(k·T,)` int32 each assignment's expert.
      chunk: `(k·T,)` int32 each assignment's destination device, `n` for a dropped one.
      n: devices on `axis`.
      local: experts per device.
      axis: the manual mesh axis.

    Returns:
      `(packed, plan, from_each)`: each assignment's row of the packed send buffer (by expert,
      so by destination; `k·T`, past the buffer, for a dropped one), the exchange's
      `ragged.ChunkPlan`, and `(n, local)` int32 the rows each device sends to each of this
      device's experts, from one all-gather of every device's rows per expert.
    """
    experts = n * local
    key = jnp.where(chunk < n, ids, experts)  # dropped assignments last
    order = jnp.argsort(key, stable=True)
    packed = jnp.zeros_like(key).at[order].set(jnp.arange(key.shape[0], dtype=key.dtype))
    packed = jnp.where(chunk < n, packed, key.shape[0])
    per_expert = jnp.bincount(key, length=experts + 1)[:experts].astype(jnp.int32)
    gathered = jax.lax.all_gather(per_expert, axis)  # (n, experts)
    plan = ragged_lib.plan_of(gathered.reshape(n, n, local).sum(-1), axis)
    mine = jax.lax.dynamic_slice_in_dim(gathered, jax.lax.axis_index(axis) * local, local, 1)
    return packed, plan, mine


def _regroup(from_each, recv_offsets, size: int):
    """Index maps between the received rows (by source, then expert) and the rows by expert.

    Args:
      from_each: `(n, local)` int32 rows from device `i` for local expert `l`.
      recv_offsets: `(n,)` int32 where device `i`'s rows start in the received buffer.
      size: rows of the received buffer.

    Returns:
      `(to_sorted, to_received, sizes)`: `(size,)` int32 the received row that each row of the
      by-expert layout reads, `(size,)` int32 the by-expert row that each received row reads
      back, and `(local,)` int32 the rows per expert. Rows past the received ones map anywhere
      in range (the grouped kernels leave them out, the way back does not send them).
    """
    sizes = jnp.sum(from_each, axis=0)
    received = recv_offsets[:, None] + jnp.cumsum(from_each, axis=1) - from_each
    by_expert = (jnp.cumsum(sizes) - sizes)[None, :] + jnp.cumsum(from_each, axis=0) - from_each
    row = jnp.arange(size, dtype=jnp.int32)

    def follow(starts_from, starts_to):  # row of the `from` layout -> its row in the `to` one
        # Its block: the last to start at or before it (`n·local` blocks: one fused compare).
        block = jnp.sum(starts_from[None, :] <= row[:, None], axis=1, dtype=jnp.int32) - 1
        return jnp.clip(starts_to[block] + row - starts_from[block], 0, size - 1)

    to_sorted = follow(by_expert.T.reshape(-1), received.T.reshape(-1))
    return to_sorted, follow(received.reshape(-1), by_expert.reshape(-1)), sizes


def collectives(num_tokens: int, d_model: int, num_experts: int, top_k: int, expert: int, *,
                capacity_factor: float | None = None, dispatch_factor: float | None = None,
                dtype_bytes: int = 4, batch_axes: tuple[str, ...] | None = None,
                backward: bool = True, ragged: bool = False, imbalance: float = 1.0,
                calls: int = 1) -> list[tuple[str, tuple[str, ...], int]]:
    """The collectives one MoE layer (`models.moe.MoE`) issues per device.

    Forward: the rows out and back (two all-to-alls of the send buffer, `groups·slots·d_model`
    elements, see `layout`), dropless also the rows' expert ids (int32), and one all-reduce of the
    routing statistics (`num_experts + 2` float32: tokens per expert, tokens, dropped) over
    `batch_axes`, the mesh axes of more than one device that split the tokens (default: `expert`
    when it has more than one device). Backward (`backward`): the two all-to-alls again, carrying
    the rows' gradients. (XLA:CPU widens 16-bit all-to-alls to float32; GPUs send them as they
    are.)

    `ragged` (dropless on a GPU mesh, `parallel.ragged`): each exchange sends the routed rows
    only, `routed_rows(...)` of them, expected values (the bytes depend on the routing);
    `imbalance` (the busiest expert shard's load over the mean, `--expert-imbalance`) scales
    them to the busiest device's, which receives and returns that many more. Beside them the
    devices gather every device's rows per expert before the forward exchange
    (`expert·num_experts` int32), from which the receiver regroups its rows by expert (the rows'
    expert ids stay home), and each backward exchange's transpose rule sends its send and
    receive offsets (one all-to-all each, `expert` int32) first.

    Args:
      num_tokens: this device's tokens.
      d_model: features per token a device sends.
      num_experts: experts of the layer.
      top_k: experts each token is routed to.
      expert: devices on the expert axis.
      capacity_factor: as `routed_swiglu`'s.
      dispatch_factor: as `routed_swiglu`'s.
      dtype_bytes: bytes of one float of the rows.
      batch_axes: the mesh axes that split the tokens (None: `expert` when it has more than one
        device).
      backward: include the backward's exchanges.
      ragged: the dropless exchange sends the routed rows only.
      imbalance: the busiest expert shard's load over the mean.
      calls: the layer calls `num_tokens` are split into (microbatches accumulated one after
        the other): the messages whose size does not depend on the tokens run once per call.

    Returns:
      `[(kind, axes, bytes)]`, bytes as `analysis.hlo` counts them.
    """
    if batch_axes is None:
        batch_axes = (Axis.EXPERT,) if expert > 1 else ()
    out = []
    if expert > 1:
        groups, slots = layout(num_tokens, top_k, num_experts, expert, capacity_factor,
                               dispatch_factor)
        rows = groups * slots
        if ragged and capacity_factor is None:
            rows = routed_rows(num_tokens, top_k, groups * slots, imbalance)
            # Every device's rows per expert (per destination device where each holds one).
            out.append(("all-gather", (Axis.EXPERT,), calls * expert * num_experts * 4))
        row_bytes = rows * d_model * dtype_bytes
        out += [("all-to-all", (Axis.EXPERT,), row_bytes)] * 2
        if capacity_factor is None and not ragged:
            out.append(("all-to-all", (Axis.EXPERT,), rows * 4))  # the rows' experts
        if backward:
            out += [("all-to-all", (Axis.EXPERT,), row_bytes)] * 2
            if ragged and capacity_factor is None:
                # The two transposes' offsets: the packed send side makes all four distinct.
                out += [("all-to-all", (Axis.EXPERT,), calls * expert * 4)] * 4
    if batch_axes:
        out.append(("all-reduce", tuple(batch_axes), calls * (num_experts + 2) * 4))
    return out


def routed_rows(num_tokens: int, top_k: int, buffer_rows: int, imbalance: float = 1.0) -> float:
    """Rows one dropless ragged exchange moves on a device, on average.

    Args:
      num_tokens: this device's tokens.
      top_k: experts each token is routed to.
      buffer_rows: rows of the send buffer (the cap: a receiver's chunks fill at most that).
      imbalance: the busiest device's load over the mean.

    Returns:
      `min(buffer_rows, num_tokens·top_k·imbalance)`.
    """
    return min(buffer_rows, num_tokens * top_k * imbalance)
