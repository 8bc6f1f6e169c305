"""Ragged all-to-all exchanges over one mesh axis: only the rows used cross the wire.

A dropless MoE layer (`parallel.experts`) sends one chunk per destination device, each chunk
able to hold every assignment of the sender (`slots` rows). A padded all-to-all sends every chunk
whole; `jax.lax.ragged_all_to_all` sends the filled part only, once both sides know the counts,
and both sides keep the rows packed (`chunk_plan`): the sender's buffer holds its routed rows
only, the receiver's the rows it received from its first row on.

- `chunk_plan`: the offsets and sizes of that exchange (one small all-gather of the counts);
  `plan_of` where the counts are gathered already.
- `ragged_all_to_all`: `jax.lax.ragged_all_to_all` where the backend runs it (XLA:GPU), else
  `reference`: the same interface and result, built from a padded `all_to_all` and masks, for
  XLA:CPU, which has no `ragged-all-to-all` ("not supported by XLA:CPU"). Tests compare the two
  paths of the MoE layer on CPU through `reference`.
- `use_ragged`: whether the mesh's platform runs the ragged exchange (the padded one elsewhere).

Both differentiate to the ragged all-to-all of the cotangent with the roles of the send and
receive offsets and sizes swapped: `jax.lax.ragged_all_to_all` by JAX's own transpose rule (the
same in JAX 0.11.2 and 0.12, so no `_compat` shim), `reference` by a `custom_vjp` that mirrors it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

from .._compat import mesh_platform

ROUTED_ROWS_ATTRIBUTE = "axonn_routed_rows"
"""The frontend attribute on each ragged exchange that holds the rows one device sends on average
(`routed_rows`; `analysis.hlo` reads it: the bytes a ragged all-to-all sends depend on the data,
its operand is the whole padded buffer)."""


def routed_rows(rows: int):
    """Context in which the collectives traced carry `rows` as `ROUTED_ROWS_ATTRIBUTE`.

    XLA keeps frontend attributes on the compiled instructions; it drops their name-scope
    metadata.

    Args:
      rows: the rows one device sends on average.

    Returns:
      A context manager (`set_xla_metadata`) that sets the frontend attribute.
    """
    return set_xla_metadata(**{ROUTED_ROWS_ATTRIBUTE: str(int(rows))})


def use_ragged(platform: str | None = None) -> bool:
    """Whether the expert exchange is a ragged all-to-all: on a GPU mesh.

    XLA:GPU runs `ragged-all-to-all`; the other backends do not.

    Args:
      platform: the platform to decide for; None: the mesh in context's, else JAX's default
        backend.

    Returns:
      True on `gpu` / `cuda`.
    """
    platform = platform or mesh_platform() or jax.default_backend()
    return platform in ("gpu", "cuda")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The offsets and sizes of one ragged exchange over an axis of `n` devices.

    Each is `(n,)` int32, in `jax.lax.ragged_all_to_all`'s terms (from this device's view): the
    rows `[input_offsets[j], input_offsets[j] + send_sizes[j])` go to device `j`, where they land
    at `output_offsets[j]`; `recv_sizes[i]` rows come from device `i`, landing here at
    `recv_offsets[i]`, where device `i` took them from its rows at `peer_input_offsets[i]`. The
    last two make the way back (`reverse`). A pytree of its six arrays.
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    peer_input_offsets: jax.Array

    def reverse(self) -> ChunkPlan:
        """The plan of the way back: each device returns what it received to where it came from.

        Returns:
          The `ChunkPlan` with the roles of the sent and the received rows swapped.
        """
        return ChunkPlan(self.recv_offsets, self.recv_sizes, self.peer_input_offsets,
                         self.send_sizes, self.input_offsets, self.output_offsets)


def chunk_plan(counts: jax.Array, slots: int, axis: str) -> ChunkPlan:
    """The plan of a packed exchange of chunks of at most `slots` rows, chunk `j` to device `j`.

    The sender's chunk `j` starts right after chunk `j - 1`'s used rows; the receiver stacks
    what it receives in the order of the senders from its first row on (the rows from device `i`
    right after those from device `i - 1`), so only the rows sent are touched on either side.

    Args:
      counts: `(n,)` int32, rows used in each chunk (clipped to `slots`); `n` = the size of the
        manual mesh axis `axis`.
      slots: rows per chunk.
      axis: the mesh axis (manual in the enclosing shard_map).

    Returns:
      The `ChunkPlan`, from one small all-gather of every device's counts over `axis`.
    """
    send = jnp.minimum(counts, slots).astype(jnp.int32)
    return plan_of(jax.lax.all_gather(send, axis), axis)


def plan_of(sent: jax.Array, axis: str) -> ChunkPlan:
    """The plan of a packed exchange whose every device's counts are known (`chunk_plan`'s).

    Args:
      sent: `(n, n)` int32, the rows device `i` sends to device `j`, the same on every device
        of the manual mesh axis `axis` (gathered over it).
      axis: the mesh axis.

    Returns:
      This device's `ChunkPlan`.
    """
    me = jax.lax.axis_index(axis)
    before_in_row = jnp.cumsum(sent, axis=1) - sent  # sender i's start of its chunk j
    before_in_col = jnp.cumsum(sent, axis=0) - sent  # receiver j's start of sender i's rows
    return ChunkPlan(before_in_row[me], sent[me], before_in_col[me], sent[:, me],
                     before_in_col[:, me], before_in_row[:, me])


def ragged_all_to_all(operand: jax.Array, output: jax.Array, plan: ChunkPlan, axis: str, *,
                      platform: str | None = None) -> jax.Array:
    """`jax.lax.ragged_all_to_all` over `axis` on a GPU mesh, its `reference` elsewhere.

    That is `jax.lax.ragged_all_to_all(operand, output, *plan, axis_name=axis)` where
    `use_ragged` says so (`platform` overrides).

    Args:
      operand: `(N, ...)` this device's rows to send (`plan.input_offsets`, `plan.send_sizes`).
      output: `(M, ...)` the result where nothing is received.
      plan: the offsets and sizes, `(n,)` each, `n` = the size of `axis`.
      axis: a manual mesh axis of the enclosing shard_map.
      platform: `gpu` or `cpu` to override the mesh's platform (`use_ragged`).

    Returns:
      `(M, ...)`: `output` with the received rows written in.
    """
    args = (operand, output, plan.input_offsets, plan.send_sizes, plan.output_offsets,
            plan.recv_sizes)
    if use_ragged(platform):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis)
    return reference(*args, axis=axis)


def _emulate(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all`'s result from a padded all-to-all: each destination's slice
    copied to the head of a chunk of `N` rows (the most it can hold), the chunks exchanged, the
    received heads written at the offsets their senders chose (one slice per device)."""
    n, rows = send_sizes.shape[0], operand.shape[0]
    r = jnp.arange(rows)
    index = jnp.minimum(input_offsets[:, None] + r, rows - 1)  # (n, N) source rows
    keep = (r < send_sizes[:, None]).reshape(n, rows, *[1] * (operand.ndim - 1))
    chunks = jnp.where(keep, operand[index], jnp.zeros((), operand.dtype))
    received = jax.lax.all_to_all(chunks.reshape(n * rows, *operand.shape[1:]), axis, 0, 0,
                                  tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)  # where my rows from i go
    target = jnp.where(r < recv_sizes[:, None], at[:, None] + r, output.shape[0])
    return output.at[target.reshape(-1)].set(received, mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """`jax.lax.ragged_all_to_all` (one slice per device of `axis`) from a padded all-to-all.

    Built from masks: the same interface and result, for backends without `ragged-all-to-all`
    (XLA:CPU), where it tests the offsets and sizes of the GPU path. It sends `n·N` rows, not
    fewer.

    Args:
      operand: `(N, ...)` this device's rows to send.
      output: `(M, ...)` the result where nothing is received.
      input_offsets: `(n,)` int, `n` the size of the manual mesh axis `axis`.
      send_sizes: `(n,)` int.
      output_offsets: `(n,)` int.
      recv_sizes: `(n,)` int.
      axis: a manual mesh axis of the enclosing shard_map.

    Returns:
      `(M, ...)`: `output` with the received rows written in.

    Its gradient mirrors JAX's transpose rule: the operand's is the exchange of the cotangent
    with the send and receive roles swapped; the output's, the cotangent where nothing was
    received."""
    return _emulate(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)


def _reference_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    out = _emulate(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis)
    # Residuals are arrays: an empty `(N, 0)` one carries the operand's rows and dtype.
    return out, (jnp.zeros((operand.shape[0], 0), operand.dtype), input_offsets, send_sizes,
                 output_offsets, recv_sizes)


def _reference_bwd(axis, res, ct):
    like, input_offsets, send_sizes, output_offsets, recv_sizes = res
    # The cotangent rows go back from where they landed here to where they left from there.
    landed = jax.lax.all_to_all(output_offsets, axis, 0, 0, tiled=True)
    left = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
    operand_ct = _emulate(ct, jnp.zeros((like.shape[0], *ct.shape[1:]), like.dtype),
                         landed, recv_sizes, left, send_sizes, axis)
    rows = jnp.arange(ct.shape[0])
    written = jnp.any((rows >= landed[:, None]) & (rows < (landed + recv_sizes)[:, None]), axis=0)
    output_ct = jnp.where(written.reshape(-1, *[1] * (ct.ndim - 1)), jnp.zeros((), ct.dtype), ct)
    return operand_ct, output_ct, None, None, None, None


reference.defvjp(_reference_fwd, _reference_bwd)
