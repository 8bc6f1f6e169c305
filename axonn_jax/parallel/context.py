"""Context parallelism: attention over a sequence split along a mesh axis (default `"context"`).

The layout. With `C` devices on the axis the sequence is cut into `2C` chunks of `c` tokens and
device `i` holds chunks `i` and `2C-1-i` (the zig-zag layout, `balance` / `unbalance`): under a
causal mask chunk `i` sees `i + 1` chunks and chunk `2C-1-i` sees `2C - i`, so every device owns
the same `2C + 1` chunk pairs of useful work. `positions(local_len)` gives a device its tokens'
true positions in that layout.

The kernels (`attention`), called inside a `shard_map` that is manual over the axis, with q `(rows,
2c, heads, head_dim)` and k, v `(rows, 2c, kv_heads, head_dim)` the device's two chunks:

- `ring`: key/value blocks travel around the axis (`ppermute` to the next device, each transfer
  issued before the current block's compute so the two overlap); `C` steps, online softmax in
  fp32. The backward pass rings the key/value blocks again and, beside them, the fp32 key/value
  gradient accumulators, which end at their owner after one more hop. Residuals: the output and
  its log-sum-exp, nothing of size seq².
- `allgather`: one all-gather of keys/values, the same block schedule over the gathered blocks;
  the backward pass gathers again and returns the key/value gradients with one reduce-scatter.

Both compute, per step, only the `c × c` blocks of chunk pairs that the causal mask does not hide
(`block_schedule`): 3 on the diagonal step, 2 on each of the `C - 1` others — `2C + 1` blocks on
every device, where attending every pair costs `4C`. Which 2 depends on the device (traced), so
they are chosen by dynamic indexing, not by branches: one program, the same FLOPs everywhere
(`flops`). A step's blocks run as one batch, each `query_tile` queries at a time, so memory
holds `query_tile × c` scores per block and head, never `seq²`.

Masks. A query attends to a key when the key is not later in the sequence, not later by
`positions` (when given) and in the same segment (`segment_ids`, when given: packed documents);
segment ids and positions travel with the keys. Only keys (`kv_heads`) move: grouped-query
attention rotates `kv_heads / heads` of the bytes of multi-head attention.

`collectives` states what the kernels send (the communication model); `block_schedule` /
`kernel_blocks` list the chunk pairs with work and those the kernels compute, per device. The
blocks themselves (flash attention forward and backward, the masks, one device's
`causal_mask`) are `parallel.attention_blocks`, which `parallel.ulysses` shares.

The schemes are `Scheme`s in the registry `SCHEMES` (`register`): `attention`, `collectives`,
`flops_share`, `ContextAttention` and the `--context-attention` choices read it, so a scheme
defined in another module (`parallel.ulysses`) needs only its `register` call, made when
`axonn_jax.parallel` is imported (its `__init__`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..config import Axis
from ..batch_axis import BatchAxis
from ..checks import check_choice
from ..collectives import Collective
from .attention_blocks import (NEG, block_mask, merge, side_inputs, tiled_backward,
                               tiled_forward)



# ----------------------------------------------------------------------------- the layout

def zigzag_order(size: int) -> np.ndarray:
    """The `2·size` chunk indices in the order the devices hold them: `[0, 2C-1, 1, 2C-2, ...]`.

    Args:
      size: `C`, the devices on the context axis.

    Returns:
      `(2·size,)` ints; device `i` holds entries `2i` and `2i+1`.
    """
    return np.stack([np.arange(size), 2 * size - 1 - np.arange(size)], axis=1).reshape(-1)


def check_sequence(seq_len: int, size: int) -> None:
    """Check that a sequence cuts into the `2·size` equal chunks of the load-balanced layout.

    Args:
      seq_len: the sequence's tokens.
      size: the devices on the context axis.

    Raises:
      ValueError: `seq_len` is not divisible by `2·size`.
    """
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2·context = {2 * size} "
                         "(the load-balanced layout cuts it into 2·context equal chunks)")


def _permute_chunks(x, size: int, dim: int, order: np.ndarray):
    check_sequence(x.shape[dim], size)
    chunks = x.reshape(x.shape[:dim] + (2 * size, x.shape[dim] // (2 * size)) + x.shape[dim + 1:])
    return jnp.take(chunks, order, axis=dim).reshape(x.shape)


def balance(x, size: int, dim: int = 1):
    """`x` with its sequence dimension `dim` permuted into the zig-zag layout.

    Split that dimension evenly over `size` devices afterwards and device `i` holds chunks `i`
    and `2·size-1-i`.

    Args:
      x: any array, e.g. `(rows, seq, ...)`, whole (not split over the context axis).
      size: the devices on the context axis.
      dim: the sequence dimension, of length divisible by `2·size`.

    Returns:
      `x` permuted, of the same shape.

    Raises:
      ValueError: the sequence does not divide into `2·size` chunks.
    """
    return _permute_chunks(x, size, dim, zigzag_order(size))


def unbalance(x, size: int, dim: int = 1):
    """The inverse of `balance`: dimension `dim` back in sequence order.

    Args:
      x: an array whose dimension `dim` is in the zig-zag layout.
      size: the devices on the context axis.
      dim: the sequence dimension.

    Returns:
      `x` permuted, of the same shape.
    """
    return _permute_chunks(x, size, dim, np.argsort(zigzag_order(size)))


def axis_size(axis: str = Axis.CONTEXT) -> int:
    """Devices on `axis` when the enclosing shard_map is manual over it, else 1.

    Args:
      axis: the mesh axis.

    Returns:
      Its size in the abstract mesh in context, or 1.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in getattr(mesh, "manual_axes", ()):
        return 1
    return mesh.shape[axis]


# ----------------------------------------------------------------------------- the batch axis

def check_batch(batch, size: int) -> None:
    """Check that every batch leaf's sequence (dim 1) cuts into the `2·size` chunks of the layout.

    Args:
      batch: a batch pytree of arrays or ShapeDtypeStructs.
      size: the `context` axis's size.

    Raises:
      ValueError: (one line) unless every batch leaf has a sequence dimension that cuts into
        the `2·size` chunks.
    """
    for path, a in jax.tree_util.tree_leaves_with_path(batch):
        if len(a.shape) < 2:
            raise ValueError(f"context = {size} splits dim 1 of every batch leaf (the sequence), "
                             f"but batch{jax.tree_util.keystr(path)} has shape {tuple(a.shape)}")
        check_sequence(a.shape[1], size)


def balanced_share(batch, size: int):
    """This device's chunks of every sequence in the zig-zag layout, not its contiguous part.

    Inside a shard_map manual over `context` (the layout is `balance`'s). One all-gather of the
    batch over `context` (token ids: small beside the activations).

    Args:
      batch: a batch pytree, each leaf `(rows, seq / size, ...)`: this device's contiguous part.
      size: the `context` axis's size.

    Returns:
      The batch, each leaf of the same shape: chunks `i` and `2·size-1-i` of device `i`.
    """

    def mine(a):
        local = a.shape[1]
        whole = lax.all_gather(a, Axis.CONTEXT, axis=1, tiled=True)
        return lax.dynamic_slice_in_dim(balance(whole, size), lax.axis_index(Axis.CONTEXT) * local,
                                        local, 1)

    return jax.tree.map(mine, batch)


def _layout_collectives(step, declared) -> list[Collective]:
    """`balanced_share`'s all-gather: this device's rows (over data, expert, depth), whole
    sequences."""
    return [Collective("all-gather", (Axis.CONTEXT,),
                       step.rows * step.seq_len * declared.batch_token_bytes)]


AXIS = BatchAxis(Axis.CONTEXT, dim=1, layout=balanced_share, check=check_batch,
                 collectives=_layout_collectives,
                 splits=lambda model, seq_len: getattr(model, "kv_features", 0) > 0 and seq_len > 1)
"""Context parallelism as a batch axis: the sequence over `context`, in the zig-zag layout; for
decoders whose attention runs over it (`kv_features`: `ContextAttention`) and sequences of more
than one position."""


def _chunk(half, device, size):
    """The global chunk index of local half `half` (0 or 1) of `device`: `device` or
    `2·size-1-device`."""
    return jnp.where(half == 0, device, 2 * size - 1 - device)


def positions(local_len: int, axis: str = Axis.CONTEXT):
    """The true positions (indices in the whole sequence) of this device's tokens.

    Args:
      local_len: this device's sequence length (two chunks of the zig-zag layout).
      axis: the context axis.

    Returns:
      `(local_len,)` int32: the positions in the zig-zag layout, inside a shard_map manual over
      `axis`; `arange(local_len)` elsewhere (outside one, or an axis it does not split).

    Raises:
      ValueError: an odd `local_len` on a split axis.
    """
    size = axis_size(axis)
    if size == 1:
        return jnp.arange(local_len, dtype=jnp.int32)
    if local_len % 2:
        raise ValueError(f"local sequence length {local_len} is odd: it holds two chunks of the "
                         f"load-balanced layout (sequence {local_len * size} over context {size})")
    c, i = local_len // 2, lax.axis_index(axis)
    return (_chunk(jnp.arange(2)[:, None], i, size) * c
            + jnp.arange(c)[None]).reshape(-1).astype(jnp.int32)


def block_schedule(size: int, layout: str = "zigzag") -> list[list[tuple[int, int]]]:
    """Per device, the `(query chunk, key chunk)` pairs that a causal mask leaves work in.

    Args:
      size: the devices on the context axis; chunks are `seq / 2·size` tokens.
      layout: `zigzag` (device `i`: chunks `i, 2·size-1-i`) or `contiguous` (device `i`: chunks
        `2i, 2i+1`).

    Returns:
      One list of pairs per device. Zig-zag: `2·size + 1` pairs on every device; contiguous:
      `4i + 3` on device `i`.

    Raises:
      ValueError: another layout.
    """
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout must be zigzag or contiguous, got {layout!r}")
    held = zigzag_order(size) if layout == "zigzag" else np.arange(2 * size)
    out = []
    for i in range(size):
        mine = held[2 * i:2 * i + 2]
        out.append([(int(q), int(k)) for q in mine for k in range(2 * size) if k <= q])
    return out


def kernel_blocks(size: int) -> list[list[tuple[int, int]]]:
    """Per device, the `(query chunk, key chunk)` pairs the kernels compute, step by step.

    Read off the same slot rule the kernels run (`_slots`) with concrete device indices.

    Args:
      size: the devices on the context axis.

    Returns:
      One list of pairs per device, in the order of the steps.
    """
    out = []
    for i in range(size):
        pairs = []
        for step in range(size):
            j = (i - step) % size
            for a, b in _slots(i, j) + (_slots(i, j, True) if step == 0 else ()):
                pairs.append((int(_chunk(a, i, size)), int(_chunk(b, j, size))))
        out.append(pairs)
    return out


# ----------------------------------------------------------------------------- checks

def check_inputs(q, k, v, segment_ids=None, positions=None, size: int = 1) -> None:
    """Check the shapes and dtypes of `attention`'s inputs.

    Args:
      q: `(rows, t, heads, head_dim)`.
      k: `(rows, t, kv_heads, head_dim)`, kv_heads dividing heads.
      v: shaped as `k`.
      segment_ids: `(rows, t)` integers, or None.
      positions: `(rows, t)` integers, or None.
      size: the devices on the context axis; with `size > 1`, `t` must be even.

    Raises:
      ValueError: one line, naming the numbers, for the first input that breaks these.
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"attention needs q (rows, seq, heads, head_dim) and k, v of one shape "
                         f"(rows, seq, kv_heads, head_dim); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k/v {k.shape} differ in rows, sequence or head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not divisible by {k.shape[2]} "
                         "key/value heads")
    for name, side in (("segment_ids", segment_ids), ("positions", positions)):
        if side is not None and (side.shape != q.shape[:2]
                                 or not jnp.issubdtype(side.dtype, jnp.integer)):
            raise ValueError(f"{name} must be (rows, seq) = {q.shape[:2]} integers, got "
                             f"{side.shape} {side.dtype}")
    if size > 1:
        check_sequence(q.shape[1] * size, size)


def check_scheme(scheme: str) -> None:
    """Check that `scheme` names a registered context-parallel attention scheme (`SCHEMES`).

    Args:
      scheme: the scheme's name.

    Raises:
      ValueError: no such scheme.
    """
    check_choice("context attention scheme", scheme, SCHEMES)


def scheme_problems(scheme: str, num_stages: int, platform: str) -> list[str]:
    """Why `scheme` cannot run inside `num_stages` pipeline stages on `platform`, one line each.

    A stage's ring hops are one collective-permute of every device of the program, which
    XLA:CPU runs only when all of them reach it: stages idle in that tick never do.

    Args:
      scheme: a name in `SCHEMES` (an unknown one is `check_scheme`'s to refuse).
      num_stages: devices on `pipe`.
      platform: `cpu` or `gpu`.

    Returns:
      The problems (empty: none).
    """
    s = SCHEMES.get(scheme)
    if s is None or s.cpu_pipeline or num_stages == 1 or platform != "cpu":
        return []
    others = " or ".join(o.name for o in SCHEMES.values() if o.cpu_pipeline)
    return [f"--context-attention {scheme} inside pipeline stages deadlocks XLA:CPU (its "
            f"collective-permutes wait for every stage); use --context-attention {others} on "
            "simulated devices"]


# ----------------------------------------------------------------------------- the block schedule

def _slots(i, j, diagonal: bool = False):
    """The `(query half, key half)` blocks worth computing when device `i` holds the keys of
    device `j`: always the second query chunk over the first key chunk (chunk `2C-1-i` follows
    chunk `j`); then, for `j <= i`, the first query chunk over the first key chunk (causal on the
    diagonal), for `j > i`, the second over the second (the rest is masked). `diagonal`: the one
    block more of `j == i`, the second query chunk over the second key chunk (causal)."""
    if diagonal:
        return ((1, 1),)
    traced = isinstance(i, jax.Array) or isinstance(j, jax.Array)
    other = (j > i).astype(jnp.int32) if traced else int(j > i)
    return ((1, 0), (other, other))


def _half(tree, half):
    """Local half `half` (axis 1 of every leaf, length 2) of a pytree."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, half, axis=1, keepdims=False), tree)


def _put(x, half, value):
    return lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), half, axis=1)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a kernel call knows statically: the axis, its size, the scheme's forward and
    backward block loops (`_ring_forward`, ...) and the query tile."""

    axis: str
    size: int
    forward: object
    backward: object
    tile: int


def _blocks(plan, q, q_side, kv, i, j, slots):
    """The query and key halves of `slots` stacked on axis 1 (query half `a` of device `i`, key
    half `b` of device `j`, per slot) and their masks, `(rows|1, slots, c, c)`: a step's blocks
    computed as one batch."""
    c = q.shape[2]
    index = lambda half, dev: _chunk(half, dev, plan.size) * c + jnp.arange(c)  # noqa: E731
    stack = lambda tree, halves: jax.tree.map(  # noqa: E731
        lambda *xs: jnp.stack(xs, axis=1), *[_half(tree, h) for h in halves])
    qs, kvs = stack(q, [a for a, _ in slots]), stack(kv, [b for _, b in slots])
    masks = [block_mask(index(a, i), index(b, j), _half(q_side, a),
                         {n: _half(kv[n], b) for n in ("seg", "pos") if n in kv}) for a, b in slots]
    return qs, kvs["k"], kvs["v"], jnp.stack(masks, axis=1)


_BATCHED = dict(in_axes=1, out_axes=1)


def _forward_step(plan, state, q, q_side, kv, i, j, diagonal=False):
    """`state = (o, lse)` (halves on axis 1) updated with the blocks of keys `kv` from device `j`."""
    o, lse = state
    slots = _slots(i, j, diagonal)
    qs, ks, vs, masks = _blocks(plan, q, q_side, kv, i, j, slots)
    forward = functools.partial(tiled_forward, scale=q.shape[-1] ** -0.5, tile=plan.tile)
    o_blocks, lse_blocks = jax.vmap(forward, **_BATCHED)(qs, ks, vs, masks)
    for n, (a, _) in enumerate(slots):
        o_a, lse_a = merge(_half(o, a), _half(lse, a), o_blocks[:, n], lse_blocks[:, n])
        o, lse = _put(o, a, o_a), _put(lse, a, lse_a)
    return o, lse


def _backward_step(plan, dq, q, q_side, kv, lse, do, delta, i, j, diagonal=False):
    """`dq` plus this step's share, and (dk, dv) of the keys `kv` of device `j` (fp32)."""
    slots = _slots(i, j, diagonal)
    qs, ks, vs, masks = _blocks(plan, q, q_side, kv, i, j, slots)
    rows = lambda x: jnp.stack([_half(x, a) for a, _ in slots], axis=1)  # noqa: E731
    backward = functools.partial(tiled_backward, scale=q.shape[-1] ** -0.5, tile=plan.tile)
    dqs, dks, dvs = jax.vmap(backward, **_BATCHED)(qs, ks, vs, masks, rows(lse), rows(do),
                                                   rows(delta))
    dk = jnp.zeros_like(kv["k"], jnp.float32)
    dv = jnp.zeros_like(kv["v"], jnp.float32)
    for n, (a, b) in enumerate(slots):
        dq = _put(dq, a, _half(dq, a) + dqs[:, n])
        dk, dv = _put(dk, b, _half(dk, b) + dks[:, n]), _put(dv, b, _half(dv, b) + dvs[:, n])
    return dq, dk, dv


# ----------------------------------------------------------------------------- transports

def _shift(plan, tree):
    """Every leaf to the next device on the axis (device d -> d + 1 mod size)."""
    perm = [(d, (d + 1) % plan.size) for d in range(plan.size)]
    return jax.tree.map(lambda x: lax.ppermute(x, plan.axis, perm), tree)


def _device(plan, q):
    """This device's index on the axis, made to depend on `q` (an integer zero read off its
    bits). The masks of every hop are functions of the device index alone; left so, JAX's
    loop-invariant residual hoisting (`lax.scan` partial evaluation) lifts their computation out
    of an enclosing layer scan and keeps every hop's masks at once (the memory they took: the
    Llama-3.1-8B row over context 16 of `benchmarks/results/scale.md`). The zero costs one
    integer op per call."""
    if plan.size == 1:
        return 0
    bits = lax.bitcast_convert_type(q.reshape(-1)[:1], jnp.dtype(f"uint{8 * q.dtype.itemsize}"))
    return lax.axis_index(plan.axis) + (bits[0] & 0).astype(jnp.int32)


def _ring_forward(plan, q, q_side, kv, state):
    size, i = plan.size, _device(plan, q)
    step = functools.partial(_forward_step, plan, q=q, q_side=q_side, i=i)
    state = step(state=state, kv=kv, j=i, diagonal=True)
    if size == 1:
        return step(state=state, kv=kv, j=i)

    def body(carry, s):
        state, cur = carry
        nxt = _shift(plan, cur)  # issued before this step's compute, which it overlaps
        return (step(state=state, kv=cur, j=lax.rem(i - s + size, size)), nxt), None
    (state, last), _ = lax.scan(body, (state, kv), jnp.arange(size - 1))
    return step(state=state, kv=last, j=lax.rem(i + 1, size))


def _ring_backward(plan, q, q_side, kv, lse, do, delta, dq):
    size, i = plan.size, _device(plan, q)
    step = functools.partial(_backward_step, plan, q=q, q_side=q_side, lse=lse, do=do,
                             delta=delta, i=i)
    dq, *diagonal = step(dq=dq, kv=kv, j=i, diagonal=True)

    def one(dq, acc, cur, s, first=False, last=False):
        # The keys for the next step and the gradients accumulated so far for the current keys
        # (from the previous device) travel while this device computes its share; on the first
        # step those are the diagonal's extra block's, here.
        nxt = None if last else _shift(plan, cur)
        incoming = diagonal if first else _shift(plan, acc)
        dq, dk, dv = step(dq=dq, kv=cur, j=lax.rem(i - s + size, size))
        return dq, (incoming[0] + dk, incoming[1] + dv), nxt

    if size == 1:
        dq, acc, _ = one(dq, None, kv, 0, first=True, last=True)
        return dq, acc[0], acc[1]
    carry = one(dq, None, kv, 0, first=True)
    carry, _ = lax.scan(lambda carry, s: (one(*carry, s), None), carry, jnp.arange(1, size - 1))
    dq, acc, _ = one(carry[0], carry[1], carry[2], size - 1, last=True)
    acc = _shift(plan, acc)  # home: device i holds the gradients of device i + 1's keys
    return dq, acc[0], acc[1]


def _gather(plan, kv):
    return jax.tree.map(lambda x: lax.all_gather(x, plan.axis, axis=0, tiled=False), kv)


def _keys_of(every, j):
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, j, 0, keepdims=False), every)


def _allgather_forward(plan, q, q_side, kv, state):
    size, i = plan.size, _device(plan, q)
    step = functools.partial(_forward_step, plan, q=q, q_side=q_side, i=i)
    state = step(state=state, kv=kv, j=i, diagonal=True)
    if size == 1:
        return step(state=state, kv=kv, j=i)
    every = _gather(plan, kv)

    def body(state, s):
        j = lax.rem(i - s + size, size)
        return step(state=state, kv=_keys_of(every, j), j=j), None
    return lax.scan(body, state, jnp.arange(size))[0]


def _allgather_backward(plan, q, q_side, kv, lse, do, delta, dq):
    size, i = plan.size, _device(plan, q)
    step = functools.partial(_backward_step, plan, q=q, q_side=q_side, lse=lse, do=do,
                             delta=delta, i=i)
    dq, dk, dv = step(dq=dq, kv=kv, j=i, diagonal=True)
    if size == 1:
        dq, dk1, dv1 = step(dq=dq, kv=kv, j=i)
        return dq, dk + dk1, dv + dv1
    every = _gather(plan, kv)

    def body(dq, j):
        dq, dk, dv = step(dq=dq, kv=_keys_of(every, j), j=j)
        return dq, (dk, dv)
    # One step per device's keys, in device order: row j holds the gradients of device j's keys;
    # every device sums its own row over the axis (one reduce-scatter each for dk and dv).
    dq, (dks, dvs) = lax.scan(body, dq, jnp.arange(size))
    own = jax.nn.one_hot(i, size, dtype=jnp.float32)
    back = lambda d, extra: lax.psum_scatter(  # noqa: E731
        d + own.reshape((size,) + (1,) * extra.ndim) * extra[None], plan.axis,
        scatter_dimension=0, tiled=False)
    return dq, back(dks, dk), back(dvs, dv)


# ----------------------------------------------------------------------------- the kernel

def _halves(x, groups: int | None = None):
    """`(rows, 2c, ...)` -> `(rows, 2, c, ...)`; with `groups`, heads `(.., h, d)` ->
    `(.., h / groups, groups, d)` (query heads grouped by their key/value head)."""
    b, t = x.shape[:2]
    x = x.reshape((b, 2, t // 2) + x.shape[2:])
    if groups is not None:
        x = x.reshape(x.shape[:3] + (x.shape[3] // groups, groups, x.shape[4]))
    return x


def _forward(plan, q, k, v, side):
    groups = q.shape[2] // k.shape[2]
    qh = _halves(q, groups)
    kv = {"k": _halves(k), "v": _halves(v), **{n: _halves(x) for n, x in side.items()}}
    q_side = {n: _halves(x) for n, x in side.items()}
    state = (jnp.zeros_like(qh, jnp.float32), jnp.full_like(qh[..., 0], NEG, jnp.float32))
    o, lse = plan.forward(plan, qh, q_side, kv, state)
    return o.astype(q.dtype).reshape(q.shape), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, side):
    return _forward(plan, q, k, v, side)[0]


def _attend_fwd(plan, q, k, v, side):
    out, lse = _forward(plan, q, k, v, side)
    return out, (q, k, v, side, out, lse)


def _attend_bwd(plan, residuals, d_out):
    q, k, v, side, out, lse = residuals
    groups = q.shape[2] // k.shape[2]
    qh, do = _halves(q, groups), _halves(d_out, groups)
    delta = jnp.sum(do.astype(jnp.float32) * _halves(out, groups).astype(jnp.float32), axis=-1)
    kv = {"k": _halves(k), "v": _halves(v), **{n: _halves(x) for n, x in side.items()}}
    q_side = {n: _halves(x) for n, x in side.items()}
    dq, dk, dv = plan.backward(plan, qh, q_side, kv, lse, do, delta,
                                jnp.zeros_like(qh, jnp.float32))
    return (dq.astype(q.dtype).reshape(q.shape), dk.astype(k.dtype).reshape(k.shape),
            dv.astype(v.dtype).reshape(v.shape), jax.tree.map(lambda _: None, side))


_attend.defvjp(_attend_fwd, _attend_bwd)


def _block_attention(forward, backward, q, k, v, segment_ids, positions, *, axis, size, tile):
    """A `Scheme.attend` of the block schedule: `forward` / `backward` loop over the key/value
    blocks (`_ring_forward`, `_allgather_forward`, ...) under one custom backward."""
    return _attend(_Plan(axis, size, forward, backward, tile), q, k, v,
                   side_inputs(segment_ids, positions))


def attention(q, k, v, *, axis: str = Axis.CONTEXT, scheme: str = "ring", segment_ids=None,
              positions=None, query_tile: int = 512):
    """Causal softmax attention of the whole sequence, split over `axis` in the zig-zag layout.

    Scaled by `head_dim ** -0.5`. Call it inside a shard_map manual over `axis` (elsewhere it
    attends the local sequence as one device would, through the same blocks).

    Args:
      q: `(rows, 2c, heads, head_dim)`: this device's chunks `i` and `2C-1-i` of the sequence
        (dim 1 split over `axis`; any other dimension may be split over other axes).
      k: `(rows, 2c, kv_heads, head_dim)`, laid out as `q`.
      v: shaped and laid out as `k`.
      axis: the context axis.
      scheme: a name in `SCHEMES` (`ring`, `allgather`: module docstring).
      segment_ids: `(rows, 2c)` integers in the same layout, or None (no document boundaries).
      positions: `(rows, 2c)` integers in the same layout, or None (positions from the layout).
      query_tile: each `c × c` block runs this many queries at a time (it must divide `c` when
        smaller), so the scores in memory are `rows·heads·query_tile·c` floats per block.

    Returns:
      `(rows, 2c, heads, head_dim)` in q's dtype, laid out as `q`.

    Raises:
      ValueError: an unknown scheme, inputs `check_inputs` refuses, an odd local sequence, or a
        `query_tile` that does not divide `c`.
    """
    check_scheme(scheme)
    size = axis_size(axis)
    check_inputs(q, k, v, segment_ids, positions, size)
    if q.shape[1] % 2:
        raise ValueError(f"sequence length {q.shape[1]} must be even (two chunks per device)")
    c = q.shape[1] // 2
    tile = min(query_tile, c)
    if c % tile:
        raise ValueError(f"query_tile {query_tile} does not divide the chunk length {c} "
                         f"(local sequence {q.shape[1]} / 2)")
    return SCHEMES[scheme].attend(q, k, v, segment_ids, positions, axis=axis, size=size, tile=tile)


# ----------------------------------------------------------------------------- communication model

def collectives(scheme: str, kv_shape: tuple[int, ...], dtype, size: int, *,
                q_shape: tuple[int, ...] | None = None, axis: str = Axis.CONTEXT,
                segment_ids: bool = False, positions: bool = False, backward: bool = True,
                home_dtype=None) -> list[tuple[str, str, int]]:
    """What one `attention` call sends per device, forward and (with `backward`) backward.

    ring: the keys, values (and side inputs) hop `size - 1` times forward and again backward,
    the fp32 key/value gradients `size` times (the last hop brings them home; `home_dtype`: the
    dtype that last hop carries when not fp32: XLA:GPU moves the gradients' cast to the keys'
    dtype ahead of it, measured on H100). allgather: one all-gather of the same forward, one
    backward, and a reduce-scatter of the fp32 gradients. Other schemes: their module.

    Forward and backward in separate loops (a train step's layer scan, rematerialized or not:
    `--remat` runs the forward hops once more, `ContextAttention`) send exactly this. In one
    computation (a lone call differentiated) XLA merges the backward's first hop (ring) or its
    all-gather with the forward's; and side inputs that are the same in every layer may have
    some hops hoisted out of the layer loop: their count here is an upper bound (they are 4
    bytes a token each, beside `4·kv_heads·head_dim` of bf16 keys and values).

    Args:
      scheme: a name in `SCHEMES`.
      kv_shape: the per-device key (= value) shape `(rows, 2c, kv_heads, head_dim)`.
      dtype: the keys' and values' dtype.
      size: the devices on the context axis.
      q_shape: the per-device query shape `(rows, 2c, heads, head_dim)` (default `kv_shape`;
        the schemes that move queries read it).
      axis: the context axis, as named in the result.
      segment_ids: whether segment ids travel (int32).
      positions: whether positions travel (int32).
      backward: count the backward pass too.
      home_dtype: the dtype of the ring's last gradient hop when not fp32.

    Returns:
      `[(kind, axis, bytes)]` in the convention of `axonn_jax.analysis.hlo` (full-buffer bytes:
      a collective-permute's buffer, an all-gather's result, a reduce-scatter's input); empty
      when `size` is 1.

    Raises:
      ValueError: an unknown scheme.
    """
    check_scheme(scheme)
    if size == 1:
        return []
    return SCHEMES[scheme].collectives(q_shape or kv_shape, kv_shape, dtype, size, axis=axis,
                                       segment_ids=segment_ids, positions=positions,
                                       backward=backward, home_dtype=home_dtype)


def _keys_bytes(kv_shape, dtype, side: int) -> int:
    """Bytes of one device's keys and values in `dtype` and `side` int32 side inputs."""
    rows, t = kv_shape[:2]
    return 2 * math.prod(kv_shape) * jnp.dtype(dtype).itemsize + side * rows * t * 4


def _ring_collectives(q_shape, kv_shape, dtype, size, *, axis, segment_ids, positions, backward,
                      home_dtype):
    keys = _keys_bytes(kv_shape, dtype, int(segment_ids) + int(positions))
    grads = 2 * math.prod(kv_shape) * 4
    home = 2 * math.prod(kv_shape) * jnp.dtype(home_dtype or jnp.float32).itemsize
    out = [("collective-permute", axis, (2 if backward else 1) * (size - 1) * keys)]
    return out + ([("collective-permute", axis, (size - 1) * grads + home)] if backward else [])


def _allgather_collectives(q_shape, kv_shape, dtype, size, *, axis, segment_ids, positions,
                           backward, home_dtype):
    keys = _keys_bytes(kv_shape, dtype, int(segment_ids) + int(positions))
    grads = 2 * math.prod(kv_shape) * 4
    out = [("all-gather", axis, (2 if backward else 1) * size * keys)]
    return out + ([("reduce-scatter", axis, size * grads)] if backward else [])


def flops(q_shape: tuple[int, ...], size: int, *, backward: bool = True) -> int:
    """Matmul FLOPs of one `attention` call per device under the block schedule.

    The schedule of `ring` and `allgather`: `2·size + 1` blocks of `c × c` scores (c = half the
    local sequence) per query head, each 2 matmuls forward (scores, values) and 5 backward
    (scores again, and the gradients of the values, the probabilities, the queries and the keys)
    of `2·c·c·head_dim`.

    Args:
      q_shape: the per-device `(rows, 2c, heads, head_dim)`.
      size: the devices on the context axis.
      backward: count the backward pass too.

    Returns:
      The FLOPs.
    """
    rows, t, heads, head_dim = q_shape
    block = 2 * (t // 2) ** 2 * head_dim * rows * heads
    return (2 * size + 1) * block * (2 + (5 if backward else 0))


def flops_share(size: int, scheme: str = "ring") -> float:
    """The training matmul FLOPs of `scheme` over those of an attention computing every score.

    The every-score attention: forward 2 matmuls, backward 4 (the `6·seq` per query feature that
    the models' `flops_per_token` count) at the same shapes. The block schedule (`ring`,
    `allgather`, `flops`): `2·size + 1` of the `4·size` blocks of `c × c`, at 7 matmuls instead
    of 6 (the backward computes the scores again), `7(2C + 1) / 24C`; 0.60 at C = 16.

    Args:
      size: the devices on the context axis.
      scheme: a name in `SCHEMES`.

    Returns:
      The ratio.

    Raises:
      ValueError: an unknown scheme.
    """
    check_scheme(scheme)
    return SCHEMES[scheme].flops_share(size)


def _block_flops_share(size: int) -> float:
    return 7 * (2 * size + 1) / (24 * size)


def _block_scores_bytes(q_shape, query_tile) -> float:
    """The fp32 scores and probabilities of one step's 3 blocks: `query_tile` queries × a chunk
    of `c` keys per query head and row."""
    rows, t, heads = q_shape[:3]
    c = t / 2
    return 2 * 3 * rows * heads * min(query_tile, c) * c * 4


def _ring_working_bytes(q_shape, kv_shape, size, query_tile, compute_bytes) -> float:
    # the key/value block in flight beside the one held and, backward, their fp32 gradients
    return _block_scores_bytes(q_shape, query_tile) \
        + 2 * 2 * math.prod(kv_shape) * (compute_bytes + 4)


def _allgather_working_bytes(q_shape, kv_shape, size, query_tile, compute_bytes) -> float:
    # every device's keys and values and, backward, their fp32 gradients
    return _block_scores_bytes(q_shape, query_tile) \
        + size * 2 * math.prod(kv_shape) * (compute_bytes + 4)


@dataclasses.dataclass(frozen=True)
class ContextAttention:
    """`attention`'s collectives over the `context` axis, as a model declares them.

    A `collectives.Part`: the collectives in each of the `layers` blocks one device holds.
    Forward hops or gathers are a stage's forward (a pipeline recomputes them) and
    rematerialized: every `--remat` mode runs the kernel's forward again in the backward, its
    hops included (no policy keeps the attention's inner values, as the compiled H100 step's
    permutes show); the scheme is the step's `context_attention`. No parameters.

    Attributes:
      kv_features: key (= value) features per device (the key/value heads one device of the
        tensor axes holds, times `head_dim`).
      rows_over: the mesh axis that splits the attention's rows besides depth in the batch-split
        layout (`col`, a normal layer's input axis; None when the rows stay whole).
      heads: query heads per device; the schemes that move queries or count heads read it
        (`working_bytes`, `collectives`).
      head_dim: the heads' width (0: `kv_features`, one key/value head).
    """

    kv_features: float
    layers: int
    rows_over: str | None = Axis.COL
    heads: float = 1.0
    query_tile: int = 512
    head_dim: float = 0.0

    def _rows(self, step) -> float:
        g = step.grid
        return step.rows / (getattr(g, self.rows_over) if step.split and self.rows_over else 1)

    def _shapes(self, step):
        """The per-device query and key shapes `(rows, seq / C, heads, head_dim)` (floats)."""
        rows, t = self._rows(step), step.seq_len / step.grid.context
        head_dim = self.head_dim or self.kv_features
        return ((rows, t, self.heads, head_dim),
                (rows, t, self.kv_features / head_dim, head_dim))

    def working_bytes(self, step) -> float:
        """Temporary bytes one call holds on one device, the scheme's `Scheme.working_bytes`.

        One layer runs at a time; nothing of size seq² is kept for the backward, only the output
        and its log-sum-exp. ring: the fp32 scores and probabilities of one step's 3 blocks
        (`query_tile` queries × a chunk of `c` keys per query head and row), the key/value
        block in flight beside the one held and, backward, their fp32 gradient accumulators;
        allgather: the same scores, every device's keys and values and, backward, their fp32
        gradients.

        Args:
          step: the step's `StepShape`.

        Returns:
          The bytes (0 without context parallelism).
        """
        g = step.grid
        if g.context == 1:
            return 0.0
        q_shape, kv_shape = self._shapes(step)
        return SCHEMES[step.context_attention].working_bytes(
            q_shape, kv_shape, g.context, self.query_tile, step.compute_bytes)

    def collectives(self, step) -> list[Collective]:
        """The forward's hops or gathers (recomputed) and the backward's, over `context`."""
        g = step.grid
        if g.context == 1:
            return []
        q_shape, kv_shape = self._shapes(step)  # only products and rows·seq matter
        # XLA:CPU runs 16-bit collectives in f32 (`StepShape.gathered_bytes`); XLA:GPU sends the
        # ring's last gradient hop in the keys' dtype (`collectives`)
        dtype = jnp.float32 if step.gathered_bytes == 4 else jnp.bfloat16
        home = dtype if step.platform == "gpu" else None
        forward = dict((k, b) for k, _, b in collectives(step.context_attention, kv_shape, dtype,
                                                          g.context, q_shape=q_shape,
                                                          backward=False))
        out = [Collective(k, (Axis.CONTEXT,), b, self.layers, stage_forward=True,
                          rematerialized=True) for k, b in forward.items()]
        for kind, _, b in collectives(step.context_attention, kv_shape, dtype, g.context,
                                      q_shape=q_shape, home_dtype=home):
            if b - forward.get(kind, 0):
                out.append(Collective(kind, (Axis.CONTEXT,), b - forward.get(kind, 0),
                                      self.layers))
                forward.pop(kind, None)
        return out

    def executed_flops(self, step, scores: float) -> float:
        """Training FLOPs of the attention core where the model counts `scores`.

        Args:
          step: the step's `StepShape`.
          scores: the FLOPs of computing every score, as XLA's attention does.

        Returns:
          The scheme's share (`flops_share`) of `scores` over context, `scores` without it.
        """
        g = step.grid
        return scores * (flops_share(g.context, step.context_attention) if g.context > 1
                         else 1.0)

    def parameters(self, step) -> list:
        """None: the attention core holds no parameters."""
        return []


# ----------------------------------------------------------------------------- the registry

@dataclasses.dataclass(frozen=True)
class Scheme:
    """One context-parallel attention scheme.

    What `attention`, `collectives`, `flops_share`, `ContextAttention` and the
    `--context-attention` option ask of it.

    Attributes:
      name: its `--context-attention` choice (`StepShape.context_attention`).
      attend: `attend(q, k, v, segment_ids, positions, *, axis, size, tile)`, differentiable:
        this device's q `(rows, 2c, heads, head_dim)` and k, v `(rows, 2c, kv_heads, head_dim)`
        in the zig-zag layout over `axis` (`size` devices, the enclosing shard_map manual over
        it when `size > 1`), `segment_ids` / `positions` `(rows, 2c)` integers or None, `tile`
        queries at a time (it divides `c`); returns causal attention over the whole sequence,
        `(rows, 2c, heads, head_dim)` in q's dtype. Inputs already checked (`check_inputs`).
      collectives: `collectives(q_shape, kv_shape, dtype, size, *, axis, segment_ids,
        positions, backward, home_dtype)`: what one call sends per device with `size > 1`,
        `[(kind, axis, bytes)]` (the module function `collectives`).
      flops_share: `flops_share(size)`: its training matmul FLOPs over every score's
        (`flops_share`).
      working_bytes: `working_bytes(q_shape, kv_shape, size, query_tile, compute_bytes)`:
        temporary bytes of one call per device with `size > 1` (the planner's memory model).
      cpu_pipeline: whether it runs inside pipeline stages on XLA:CPU (collective-permutes wait
        for every device of the program, and stages idle in a tick never reach them).
    """

    name: str
    attend: object
    collectives: object
    flops_share: object
    working_bytes: object
    cpu_pipeline: bool = True


SCHEMES: dict[str, Scheme] = {}
"""The registered schemes by name, in registration order (`register`)."""


def register(scheme: Scheme) -> Scheme:
    """Add `scheme` to `SCHEMES` and return it.

    Args:
      scheme: the `Scheme`.

    Returns:
      `scheme`.

    Raises:
      ValueError: its name is taken.
    """
    if scheme.name in SCHEMES:
        raise ValueError(f"context attention scheme {scheme.name!r} is already registered")
    SCHEMES[scheme.name] = scheme
    return scheme


RING = register(Scheme("ring", functools.partial(_block_attention, _ring_forward, _ring_backward),
                       _ring_collectives, _block_flops_share, _ring_working_bytes,
                       cpu_pipeline=False))
ALLGATHER = register(Scheme("allgather", functools.partial(_block_attention, _allgather_forward,
                                                           _allgather_backward),
                            _allgather_collectives, _block_flops_share,
                            _allgather_working_bytes))
