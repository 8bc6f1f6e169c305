"""CGX's compressed data-parallel gradients: bucketed max–min quantization and an all-reduce that
sends the packed bits through a scatter-reduce / all-gather, so every element is quantized exactly
twice whatever the axis size.

Quantization of a flat array of `n_buckets · bucket_size` values to `b` bits: each bucket keeps its
minimum (`offset`) and `scale = (max - min) / (2^b - 1)` in the input's dtype, and each value the
integer `q = round((x - offset) / scale)` in `[0, 2^b - 1]` (or stochastically rounded, unbiased),
packed `8/b` values per byte (`b` bytes per 8 values when `b` does not divide 8). Nearest rounding
is off by at most `scale / 2` per element, stochastic rounding by less than `scale`.

`compressed_psum` runs inside a shard_map that is manual over `axis_name`:

1. every shard adds its error-feedback residual, quantizes its gradients (one buffer per bit width,
   dtype and set of other manual axes varied over; buckets never straddle two tensors) and keeps
   the quantization error as the new residual;
2. `all_to_all` sends chunk `j` of the packed buffer (and its bucket scales/offsets) to shard `j`;
3. shard `j` dequantizes the `n` chunks it received, sums them in fp32 (divides by `n` for the mean)
   and quantizes that sum once more;
4. `all_gather` of the re-quantized chunks gives every shard the whole reduced buffer.

Small tensors (ndim <= 1 or fewer than `min_size` elements) take an exact `psum`.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._compat import (all_gather_invariant, current_mesh, psum, shard_map, to_varying,
                       varying_axes)

DEFAULT_BUCKET_SIZE = 1024
DEFAULT_MIN_SIZE = 1024


class Quantized(NamedTuple):
    """A quantized buffer of `n_buckets` buckets of `bucket_size` values at `bits` bits each.

    packed: uint8[n_buckets, bucket_size · bits / 8]; scale, offset: [n_buckets] in the dtype of
    the quantized values (a value is `offset + q · scale`).
    """

    packed: jax.Array
    scale: jax.Array
    offset: jax.Array


def check_args(bits: int, bucket_size: int) -> None:
    """Raise ValueError unless 1 <= bits <= 8 and bucket_size is a positive multiple of 8."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"compression bits must be an integer in 1..8, got {bits!r}")
    if not isinstance(bucket_size, int) or bucket_size < 8 or bucket_size % 8:
        raise ValueError(f"compression bucket size must be a positive multiple of 8 (whole bytes of "
                         f"packed values at any bit width), got {bucket_size!r}")


def pack_bits(q: jax.Array, bits: int) -> jax.Array:
    """uint8[..., m] holding values < 2^bits -> uint8[..., m · bits / 8]; m must be a multiple of 8.

    Value i occupies bits [i·b, (i+1)·b) of the little-endian bit stream.
    """
    q = q.astype(jnp.uint8)
    if 8 % bits == 0:  # whole values per byte: shift and OR (the bits are disjoint, so sum is OR)
        per_byte = 8 // bits
        shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)
        grouped = q.reshape(*q.shape[:-1], -1, per_byte)
        return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint8)
    stream = (q[..., None] >> jnp.arange(bits, dtype=jnp.uint8)) & 1  # [..., m, bits]
    stream = stream.reshape(*q.shape[:-1], -1, 8)
    return jnp.sum(stream << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_bits`: uint8[..., k] -> uint8[..., k · 8 / bits]."""
    mask = jnp.uint8((1 << bits) - 1)
    if 8 % bits == 0:
        shifts = jnp.arange(8 // bits, dtype=jnp.uint8) * bits
        return ((packed[..., None] >> shifts) & mask).reshape(*packed.shape[:-1], -1)
    stream = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1  # [..., k, 8]
    stream = stream.reshape(*packed.shape[:-1], -1, bits)
    return jnp.sum(stream << jnp.arange(bits, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def quantize(x: jax.Array, bits: int, bucket_size: int = DEFAULT_BUCKET_SIZE, key=None,
             dtype=None) -> Quantized:
    """Bucketed max–min quantization of `x` (any shape, size a multiple of `bucket_size`).

    Buckets are consecutive runs of `bucket_size` elements of `x.ravel()`. `key=None` rounds to
    nearest; a PRNG key rounds stochastically (unbiased: E[dequantize] = x). Scale and offset are
    stored in `dtype` (default `x.dtype`) and the integers are computed from the stored values, so
    the error bounds hold for what the receiver sees.
    """
    qx, _ = _quantize_with_error(x, bits, bucket_size, key, dtype)
    return qx


def _quantize_with_error(x, bits, bucket_size, key, dtype):
    """`quantize(...)` and `x - dequantize(...)` ([n_buckets, bucket_size], fp32), without
    unpacking the bits again."""
    check_args(bits, bucket_size)
    if x.size % bucket_size:
        raise ValueError(f"quantize: {x.size} elements is not a multiple of bucket_size {bucket_size}")
    dtype = dtype or x.dtype
    levels = (1 << bits) - 1
    xb = x.reshape(-1, bucket_size).astype(jnp.float32)
    lo, hi = xb.min(axis=1), xb.max(axis=1)
    scale = ((hi - lo) / levels).astype(dtype)
    offset = lo.astype(dtype)
    s, o = scale.astype(jnp.float32)[:, None], offset.astype(jnp.float32)[:, None]
    t = jnp.where(s > 0, (xb - o) / jnp.where(s > 0, s, 1.0), 0.0)
    if key is None:
        t = jnp.round(t)
    else:
        t = jnp.floor(t + jax.random.uniform(key, t.shape, jnp.float32))
    q = jnp.clip(t, 0, levels)
    error = xb - (o + q * s)
    return Quantized(pack_bits(q.astype(jnp.uint8), bits), scale, offset), error


def dequantize(qx: Quantized, bits: int, dtype=jnp.float32) -> jax.Array:
    """[n_buckets, bucket_size] values `offset + q · scale` in `dtype`."""
    q = unpack_bits(qx.packed, bits).astype(jnp.float32)
    values = qx.offset.astype(jnp.float32)[:, None] + q * qx.scale.astype(jnp.float32)[:, None]
    return values.astype(dtype)


def bits_for_leaf(path: str, leaf, bits: int, min_size: int,
                  overrides: Mapping[str, int] | None = None) -> int:
    """Bit width for one gradient tensor; 0 means exact (uncompressed).

    `overrides` maps regular expressions to bit widths; the first one found (`re.search`) in the
    '/'-joined parameter path wins over `bits` and the size rule (0 forces exact).
    """
    for pattern, override in (overrides or {}).items():
        if re.search(pattern, path):
            return override
    return 0 if leaf.ndim <= 1 or leaf.size < min_size else bits


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class Collectives(NamedTuple):
    """What the compressed all-reduce needs from a group of `size` members (shards of a mesh axis,
    or processes): this member's `index`, and three collectives over the group.

    psum: list of arrays -> their sums; all_to_all: [size, ...] -> [size, ...], row j sent to member
    j, row i of the result received from member i; all_gather: [...] -> [size, ...].
    """

    size: int
    index: Any  # int, or a traced int32 (axis_index)
    psum: Callable
    all_to_all: Callable
    all_gather: Callable


def axis_collectives(axis_name: str) -> Collectives:
    """The collectives over the manual mesh axis `axis_name` (call inside its shard_map)."""
    return Collectives(jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name),
                       lambda xs: psum(xs, axis_name),
                       lambda a: jax.lax.all_to_all(a, axis_name, 0, 0),
                       lambda a: all_gather_invariant(a, axis_name))


def _key_for(key, group: int, stage: int, index):
    """Independent rounding noise per buffer, per quantization stage and per shard."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, group), stage), index)


def _reduce_group(xs: list[jax.Array], comm: Collectives, bits: int, bucket_size: int,
                  keys: tuple, mean: bool):
    """Compressed all-reduce of the tensors `xs` (one dtype) packed into one buffer.

    Returns (reduced tensors, local quantization errors), both shaped like `xs`.
    """
    dtype, n = xs[0].dtype, comm.size
    # Each tensor is padded to whole buckets with its last value, which leaves the bucket's range
    # (and so its error bound) unchanged.
    sizes = [x.size for x in xs]
    flat = jnp.concatenate([
        jnp.pad(x.ravel(), (0, -x.size % bucket_size), mode="edge") for x in xs])
    n_buckets = flat.size // bucket_size
    # Whole buckets of zeros so every shard owns the same number of buckets.
    flat = jnp.pad(flat, (0, (-n_buckets % n) * bucket_size))
    per_shard = flat.size // bucket_size // n

    q1, error = _quantize_with_error(flat, bits, bucket_size, keys[0], dtype)
    error = error.astype(dtype).ravel()

    def exchange(qx: Quantized, collective) -> Quantized:
        packed = collective(qx.packed.reshape(-1, per_shard, qx.packed.shape[-1]))
        meta = collective(jnp.stack([qx.scale, qx.offset], axis=-1).reshape(-1, per_shard, 2))
        return Quantized(packed.reshape(-1, packed.shape[-1]), meta[..., 0].ravel(),
                         meta[..., 1].ravel())

    # received[j]: shard j's quantized copy of the chunk this shard owns.
    received = exchange(q1, comm.all_to_all)
    owned = dequantize(received, bits).reshape(n, per_shard * bucket_size).sum(axis=0)
    if mean:
        owned = owned / n
    q2 = quantize(owned, bits, bucket_size, keys[1], dtype=dtype)
    gathered = exchange(q2, comm.all_gather)
    reduced = dequantize(gathered, bits, dtype).ravel()

    outs, errs, start = [], [], 0
    for x, size in zip(xs, sizes):
        outs.append(reduced[start:start + size].reshape(x.shape))
        errs.append(error[start:start + size].reshape(x.shape))
        start += size + (-size % bucket_size)
    return outs, errs


def compressed_psum(tree, axis_name: str | Collectives, bits: int = 4,
                    bucket_size: int = DEFAULT_BUCKET_SIZE, min_size: int = DEFAULT_MIN_SIZE,
                    key=None, residual=None, overrides: Mapping[str, int] | None = None,
                    mean: bool = False):
    """Sum (or mean) `tree` over the manual mesh axis `axis_name` with CGX compression.

    Call inside a shard_map manual over `axis_name`, or give `Collectives` for another transport
    (`parallel.mpi` passes MPI's, between processes). tree: pytree of float arrays, this shard's
    values (e.g. its local gradients). residual: None (no error feedback) or a pytree like `tree`
    with this shard's error-feedback residual, added before quantization.
    key: None for nearest rounding, or a PRNG key (the same on every shard; each shard and stage
    folds in its own index) for stochastic rounding.
    overrides: {regex on the '/'-joined path: bits}; 0 means exact.

    Returns (reduced, new_residual): `reduced` like `tree`, typed invariant over `axis_name` (the
    same on every shard); `new_residual` like `tree`, varying over `axis_name` (what this shard's
    first quantization lost; zeros for exact tensors), or None when `residual` is None.
    Each compressed element is quantized twice (once locally, once after the sum), so it is off by
    at most sum_i scale_i / 2 + scale_sum / 2 with nearest rounding.
    """
    check_args(bits, bucket_size)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    widths = [bits_for_leaf(_path_str(p), x, bits, min_size, overrides) for p, x in paths_leaves]
    for (p, _), w in zip(paths_leaves, widths):
        if not isinstance(w, int) or not 0 <= w <= 8:
            raise ValueError(f"bit width for {_path_str(p)!r} must be an integer in 0..8 "
                             f"(0: exact), got {w!r}")
    leaves = [leaf for _, leaf in paths_leaves]
    res = treedef.flatten_up_to(residual) if residual is not None else [None] * len(leaves)
    leaves = [x if r is None else x + r.astype(x.dtype) for x, r in zip(leaves, res)]
    if isinstance(axis_name, Collectives):
        comm, axis_name = axis_name, None
    else:
        comm = axis_collectives(axis_name)
        leaves = [x if axis_name in varying_axes(x) else to_varying(x, (axis_name,))
                  for x in leaves]
    n = comm.size

    out: list[Any] = [None] * len(leaves)
    new_res: list[Any] = [None] * len(leaves)
    exact = [i for i, w in enumerate(widths) if w == 0]
    if exact:
        for i, y in zip(exact, comm.psum([leaves[i] for i in exact])):
            out[i], new_res[i] = (y / n if mean else y), jnp.zeros_like(leaves[i])
    # One buffer per bit width, dtype and set of other manual axes the tensors vary over: a buffer
    # mixing tensors that vary over `pipe` (a stage's blocks) with ones that do not (embeddings
    # replicated over `pipe`) would make every result typed varying over `pipe`.
    groups: dict[tuple, list[int]] = {}
    for i, w in enumerate(widths):
        if w:
            others = tuple(sorted(varying_axes(leaves[i]) - {axis_name}))
            groups.setdefault((w, str(jnp.dtype(leaves[i].dtype)), others), []).append(i)
    for g, ((w, _, _), idx) in enumerate(sorted(groups.items())):
        keys = (_key_for(key, g, 0, comm.index), _key_for(key, g, 1, comm.index))
        ys, errs = _reduce_group([leaves[i] for i in idx], comm, w, bucket_size, keys, mean)
        for i, y, e in zip(idx, ys, errs):
            out[i], new_res[i] = y, e
    reduced = treedef.unflatten(out)
    return reduced, (treedef.unflatten(new_res) if residual is not None else None)


def compressed_pmean(tree, axis_name: str, **kwargs):
    """`compressed_psum(..., mean=True)`: the mean over `axis_name` (pmean semantics)."""
    return compressed_psum(tree, axis_name, mean=True, **kwargs)


def _without_axes(spec: P, axes) -> P:
    """`spec` with the mesh axes `axes` removed from every dimension."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a is not None and a not in axes)
        return kept if len(kept) > 1 else (kept[0] if kept else None)

    return P(*(keep(e) for e in spec))


def sharded_compressed_psum(tree, specs, mesh, axis_name: str = "data", residual=None, **kwargs):
    """`compressed_psum` over `axis_name` of arrays that other mesh axes split (tensor or pipeline
    parallelism): each device quantizes and exchanges only its own shards, nothing is gathered.

    Call inside a shard_map manual over `axis_name` (and possibly more axes, e.g. `pipe`); the
    other axes are automatic there. tree: pytree of float arrays, this `axis_name` shard's values
    as global arrays over the automatic axes. specs: PartitionSpecs like `tree` (a prefix tree
    works), how each array is split over the mesh; axes already manual here are ignored (the
    arrays are local over them). residual: None or a pytree like `tree`, split the same way (error
    feedback is per device: each device keeps what its own shards' quantization lost).

    A shard_map manual over the remaining axes runs `compressed_psum(local shards, axis_name,
    residual=local residual, **kwargs)` on every device, so each shard of the result is bitwise
    `compressed_psum` of that shard alone: buckets are cut from the local shards, and the size
    rule (`min_size`, ndim) applies to a device's shard. Copies of an array replicated over an axis
    (a bias over `col`) hold equal inputs and run the same deterministic reduction (rounding noise
    depends on the `axis_name` index only), so they stay equal. Nothing is compressed over the
    other axes: sums over `depth` stay whatever exact collective produced `tree`.

    Returns (reduced, new_residual) as `compressed_psum` does, split like `specs`.
    """
    context = current_mesh(mesh)
    manual = frozenset(getattr(context, "manual_axes", ()))
    if axis_name not in manual:
        raise ValueError(f"sharded_compressed_psum: call it inside a shard_map manual over "
                         f"{axis_name!r} (manual here: {sorted(manual)})")
    free = tuple(a for a in context.axis_names if a not in manual)
    if all(context.shape[a] == 1 for a in free):  # nothing splits the arrays further
        return compressed_psum(tree, axis_name, residual=residual, **kwargs)
    specs = jax.tree.map(lambda s: _without_axes(s, manual), specs,
                         is_leaf=lambda x: isinstance(x, P))
    reduce = lambda t, r: compressed_psum(t, axis_name, residual=r, **kwargs)  # noqa: E731
    if residual is None:
        reduce_tree = shard_map(lambda t: reduce(t, None)[0], mesh=context, in_specs=(specs,),
                                out_specs=specs, axis_names=set(free))
        return reduce_tree(tree), None
    return shard_map(reduce, mesh=context, in_specs=(specs, specs), out_specs=(specs, specs),
                     axis_names=set(free))(tree, residual)


def sharded_compressed_pmean(tree, specs, mesh, axis_name: str = "data", **kwargs):
    """`sharded_compressed_psum(..., mean=True)`: the mean over `axis_name`."""
    return sharded_compressed_psum(tree, specs, mesh, axis_name, mean=True, **kwargs)


def init_residual(params, num_shards: int):
    """Zero error-feedback residuals for `num_shards` data shards: each leaf `[num_shards, *shape]`,
    meant to be split over `data` on its leading axis and like its parameter on the others (one
    residual per device; see `sharded_compressed_psum`)."""
    return jax.tree.map(lambda p: jnp.zeros((num_shards, *p.shape), p.dtype), params)


def bucket_bytes(bits: int, bucket_size: int, itemsize: int = 4) -> float:
    """Bytes of one packed bucket: `bucket_size` values at `bits` bits, its scale and offset of
    `itemsize` bytes each."""
    return bucket_size * bits / 8 + 2 * itemsize


def wire_bytes_per_element(bits: int, bucket_size: int, itemsize: int = 4) -> float:
    """Bytes one shard sends per gradient element through the compressed exchange, for large
    buffers and many shards (`(n-1)/n -> 1`): packed buckets (`bucket_bytes`), twice."""
    return 2 * bucket_bytes(bits, bucket_size, itemsize) / bucket_size


__all__ = ["Quantized", "Collectives", "axis_collectives", "check_args", "pack_bits",
           "unpack_bits", "quantize", "dequantize", "bits_for_leaf", "compressed_psum",
           "compressed_pmean", "sharded_compressed_psum", "sharded_compressed_pmean",
           "init_residual", "bucket_bytes", "wire_bytes_per_element"]
