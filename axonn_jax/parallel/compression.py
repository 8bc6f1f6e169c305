"""CGX's compressed data-parallel gradients: bucketed max–min quantization and an all-reduce that
sends the packed bits through a scatter-reduce / all-gather, so every element is quantized exactly
twice whatever the axis size.

Quantization of a flat array of `n_buckets · bucket_size` values to `b` bits: each bucket keeps its
minimum (`offset`) and `scale = (max - min) / (2^b - 1)` in the input's dtype, and each value the
integer `q = round((x - offset) / scale)` in `[0, 2^b - 1]` (or stochastically rounded, unbiased),
packed `8/b` values per byte (`b` bytes per 8 values when `b` does not divide 8; the layout is
`quantizer`'s). Nearest rounding is off by at most `scale / 2` per element, stochastic rounding by
less than `scale`.

`compressed_psum` runs inside a shard_map that is manual over `axis_name`:

1. every shard adds its error-feedback residual to each gradient tensor, quantizes it and keeps
   the quantization error as the new residual, in one pass per tensor (`quantizer.quantize_rows`);
   the packed tensors form one buffer per bit width, dtype and set of other manual axes varied
   over (buckets never straddle two tensors);
2. `all_to_all` sends chunk `j` of the packed buffer (and its bucket scales/offsets) to shard `j`;
3. shard `j` dequantizes the `n` chunks it received, sums them in fp32 (divides by `n` for the mean)
   and quantizes that sum once more, in one pass (`quantizer.requantize_sum`);
4. `all_gather` of the re-quantized chunks gives every shard the whole reduced buffer, which each
   tensor's result dequantizes from directly.

Between nodes only (`node_size`, `Nodes`; CGX's hierarchical mode, `--compress-scope inter-node`):
each compressed tensor is first summed exactly inside its node and reduce-scattered there
(`psum_scatter` over the node's shards), steps 1–3 run on each shard's chunk among the shards at
its place in every node, and step 4 gathers the packed result across nodes and then inside each
node (`_by_place`), so the links between nodes carry only each place's share.

Which tensors are compressed, at which width: rules on the '/'-joined parameter path
(`parse_rule`: `PATTERN=BITS` or `PATTERN=exact`), else CGX's filter: 1-D tensors and those of
fewer than `min_size` elements (per layer for stacked layers) take an exact `psum`.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..config import Axis
from . import quantizer
from .exchange import spec_axes
from .._compat import (all_gather_invariant, current_mesh, gathered_invariant, psum,
                       psum_scatter, shard_map, to_varying, varying_axes)
from ..checks import check_choice

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
    """Raise ValueError unless 1 <= bits <= 8 and bucket_size is a positive multiple of 8.

    Args:
      bits: bits per quantized value.
      bucket_size: values per bucket (whole bytes of packed values at any bit width).

    Raises:
      ValueError: either is out of range or not an int.
    """
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"compression bits must be an integer in 1..8, got {bits!r}")
    if not isinstance(bucket_size, int) or bucket_size < 8 or bucket_size % 8:
        raise ValueError(f"compression bucket size must be a positive multiple of 8 (whole bytes of "
                         f"packed values at any bit width), got {bucket_size!r}")


def pack_bits(q: jax.Array, bits: int) -> jax.Array:
    """Pack values < 2^bits: uint8[..., m] -> uint8[..., m · bits / 8].

    The last axis is one bucket in `quantizer`'s segment layout (whole values per byte when
    `bits` divides 8, bit planes otherwise).

    Args:
      q: uint8[..., m] holding values < 2^bits; m must be a multiple of 8.
      bits: bits per value.

    Returns:
      uint8[..., m · bits / 8].
    """
    return quantizer.pack_rows(q, bits)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_bits`: uint8[..., k] -> uint8[..., k · 8 / bits].

    Args:
      packed: uint8[..., k].
      bits: bits per value.

    Returns:
      uint8[..., k · 8 / bits], the values.
    """
    return quantizer.unpack_rows(packed, bits).astype(jnp.uint8)


def quantize(x: jax.Array, bits: int, bucket_size: int = DEFAULT_BUCKET_SIZE, key=None,
             dtype=None, impl: str = "auto") -> Quantized:
    """Bucketed max–min quantization of `x` (any shape, size a multiple of `bucket_size`).

    Buckets are consecutive runs of `bucket_size` elements of `x.ravel()`. `key=None` rounds to
    nearest; a PRNG key rounds stochastically (unbiased: E[dequantize] = x). Scale and offset are
    stored in `dtype` (default `x.dtype`) and the integers are computed from the stored values, so
    the error bounds hold for what the receiver sees.

    Args:
      x: values of any shape and float dtype, size a multiple of `bucket_size`.
      bits: bits per value (1..8).
      bucket_size: values per bucket.
      key: None (round to nearest) or a PRNG key (stochastic rounding).
      dtype: the dtype of the scales and offsets; None: `x.dtype`.
      impl: one of `quantizer.IMPLS` (one fused pass either way; "auto": a Pallas kernel on
        GPUs).

    Returns:
      The `Quantized` buffer of `x.size / bucket_size` buckets.

    Raises:
      ValueError: bad `bits` or `bucket_size` (`check_args`), or a size that is not whole
        buckets.
    """
    qx, _ = _quantize_with_error(x, bits, bucket_size, key, dtype, impl=impl, with_error=False)
    return qx


def _quantize_with_error(x, bits, bucket_size, key, dtype, *, residual=None, impl="auto",
                         with_error=True):
    """`quantize(x + residual, ...)` and `x + residual - dequantize(...)` ([n_buckets,
    bucket_size], fp32, or None without `with_error`), in one pass."""
    check_args(bits, bucket_size)
    if x.size % bucket_size:
        raise ValueError(f"quantize: {x.size} elements is not a multiple of bucket_size {bucket_size}")
    rows = x.reshape(-1, bucket_size)
    noise = None if key is None else jax.random.uniform(key, rows.shape, jnp.float32)
    packed, scale, offset, error = quantizer.quantize_rows(
        rows, bits, dtype or x.dtype, residual=None if residual is None else
        residual.reshape(rows.shape), noise=noise, impl=impl, with_error=with_error)
    return Quantized(packed, scale, offset), error


def dequantize(qx: Quantized, bits: int, dtype=jnp.float32) -> jax.Array:
    """The values `offset + q · scale` of a quantized buffer.

    Args:
      qx: the quantized buffer.
      bits: its bits per value.
      dtype: the values' dtype.

    Returns:
      `[n_buckets, bucket_size]` values in `dtype`.
    """
    return quantizer.dequantize_rows(qx.packed, qx.scale, qx.offset, bits, dtype)


ROUNDINGS = ("auto", "nearest", "stochastic")
"""How values are rounded to their levels: to nearest, stochastically (unbiased, noise from the
step's key), or `auto`: nearest with error feedback, stochastic without."""


def bits_for_leaf(path: str, leaf, bits: int, min_size: int,
                  overrides: Mapping[str, int] | None = None, stacked: bool = False) -> int:
    """Bit width for one gradient tensor; 0 means exact (uncompressed).

    `overrides` maps regular expressions to bit widths; the first one found (`re.search`) in the
    '/'-joined parameter path wins over `bits` and the size rule (0 forces exact). Without one,
    CGX's filter: 1-D tensors (biases, norm scales) and tensors of fewer than `min_size` elements
    stay exact, whose exchange costs little and whose quantization error costs accuracy.

    Args:
      path: the '/'-joined parameter path (`leaf_path`).
      leaf: the gradient tensor (or anything with `ndim`, `size`, `shape`).
      bits: the default bit width.
      min_size: tensors of fewer elements stay exact.
      overrides: `{regular expression: bits}`, see above.
      stacked: `leaf` stacks layers on its leading axis (a `StackedModel`'s blocks), and the
        filter looks at one layer (a stack of biases is a stack of 1-D tensors).

    Returns:
      The bit width, 0 for exact.
    """
    for pattern, override in (overrides or {}).items():
        if re.search(pattern, path):
            return override
    ndim, size = leaf.ndim, leaf.size
    if stacked and ndim:
        ndim, size = ndim - 1, size // max(leaf.shape[0], 1)
    return 0 if ndim <= 1 or size < min_size else bits


def parse_rule(text: str) -> tuple[str, int]:
    """Parse a compression rule `PATTERN=BITS` (BITS 1..8, or `exact`).

    The last `=` splits, so a pattern may hold one.

    Args:
      text: the rule.

    Returns:
      `(PATTERN, bits)`, bits 0 for exact.

    Raises:
      ValueError: (one line) anything else, or a PATTERN that is no regular expression.
    """
    pattern, sep, value = str(text).rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"compression rule {text!r} must be PATTERN=BITS (BITS 1..8 or exact)")
    value = value.strip()
    if value == "exact":
        bits = 0
    elif value.isdigit() and 1 <= int(value) <= 8:
        bits = int(value)
    else:
        raise ValueError(f"compression rule {text!r}: bits must be 1..8 or exact, got {value!r}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"compression rule {text!r}: {pattern!r} is no regular expression "
                         f"({e})") from None
    return pattern, bits


def parse_rules(rules) -> dict[str, int]:
    """`{pattern: bits}` (in order; `bits_for_leaf`'s overrides) of `PATTERN=BITS` rules.

    Args:
      rules: an iterable of rule strings, or None.

    Returns:
      `{pattern: bits}` in the rules' order (0: exact).

    Raises:
      ValueError: a rule that does not parse (`parse_rule`).
    """
    return dict(parse_rule(r) for r in rules or ())


def check_rounding(rounding: str) -> None:
    """Raise a one-line ValueError unless `rounding` is one of `ROUNDINGS`.

    Args:
      rounding: the requested rounding.

    Raises:
      ValueError: `rounding` is not one of `ROUNDINGS`.
    """
    check_choice("compression rounding", rounding, ROUNDINGS)


def stochastic(rounding: str, error_feedback: bool) -> bool:
    """Whether `rounding` rounds stochastically, given whether error feedback is on.

    Args:
      rounding: one of `ROUNDINGS`.
      error_feedback: whether the exchange keeps error-feedback residuals.

    Returns:
      True for `stochastic`, and for `auto` without error feedback.

    Raises:
      ValueError: `rounding` is not one of `ROUNDINGS`.
    """
    check_rounding(rounding)
    return rounding == "stochastic" or (rounding == "auto" and not error_feedback)


def leaf_path(path) -> str:
    """The '/'-joined parameter path of a pytree key path, what `bits_for_leaf`'s patterns match.

    Args:
      path: a pytree key path (dict keys, attribute names or sequence indices).

    Returns:
      The path as text, e.g. `blocks/attn/qkv/kernel`.
    """
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def leaf_widths(tree, bits: int, min_size: int, overrides=None,
                stacked: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """(path, bit width) of every leaf of `tree` (arrays or shapes), in `tree_leaves` order.

    Args:
      tree: a pytree of arrays or ShapeDtypeStructs.
      bits: the default bit width.
      min_size: tensors of fewer elements stay exact.
      overrides: `{regular expression: bits}` (`bits_for_leaf`).
      stacked: top-level keys whose leaves stack layers on their leading axis
        (`bits_for_leaf`).

    Returns:
      `[(path, bits)]`, bits 0 for exact.
    """
    out = []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = leaf_path(p)
        out.append((path, bits_for_leaf(path, x, bits, min_size, overrides,
                                        stacked=path.split("/")[0] in stacked)))
    return out


class Collectives(NamedTuple):
    """What the compressed all-reduce needs from a group of `size` members.

    The members are shards of a mesh axis, or processes: this member's `index`, and three
    collectives over the group.

    Attributes:
      size: members of the group.
      index: this member's index (an int, or a traced int32 `axis_index`).
      psum: list of arrays -> their sums.
      all_to_all: [size, ...] -> [size, ...], row j sent to member j, row i of the result
        received from member i.
      all_gather: [...] -> [size, ...].
    """

    size: int
    index: Any  # int, or a traced int32 (axis_index)
    psum: Callable
    all_to_all: Callable
    all_gather: Callable


def axis_collectives(axis_name: str) -> Collectives:
    """The collectives over the manual mesh axis `axis_name` (call inside its shard_map).

    Args:
      axis_name: a manual mesh axis.

    Returns:
      Its `Collectives`: size and index on the axis, `psum`, `all_to_all` and an all-gather
      typed invariant over the axis.
    """
    return Collectives(jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name),
                       lambda xs: psum(xs, axis_name),
                       lambda a: jax.lax.all_to_all(a, axis_name, 0, 0),
                       lambda a: all_gather_invariant(a, axis_name))


def _key_for(key, group: int, stage: int, index):
    """Independent rounding noise per buffer, per quantization stage and per shard."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, group), stage), index)


def _leaf_rows(x: jax.Array, bucket_size: int) -> jax.Array:
    """`x` as [buckets, bucket_size]: a bitcast when its size is whole buckets, else padded with
    its last value, which leaves the last bucket's range (and so its error bound) unchanged."""
    flat = x.ravel()
    if x.size % bucket_size:
        flat = jnp.pad(flat, (0, -x.size % bucket_size), mode="edge")
    return flat.reshape(-1, bucket_size)


def _scatter_group(xs: list[jax.Array], residuals: list, comm: Collectives, bits: int,
                   bucket_size: int, key, impl: str = "auto", errors: bool = False):
    """The first half of `_reduce_group`: each tensor quantized (its residual added), the packed
    bytes concatenated into one buffer and cut into one chunk per member, the all-to-all.

    Returns (received, counts, errors): `received[j]`, member j's quantized copy of the chunk
    this member owns (a `Quantized` of `n · per_shard` buckets); each tensor's bucket count
    (static); each tensor's local quantization error, or None where it has no residual (and
    `errors` is off).
    """
    dtype, n = xs[0].dtype, comm.size
    parts = []
    for k, (x, r) in enumerate(zip(xs, residuals)):
        k_key = None if key is None else jax.random.fold_in(key, k)
        rows = _leaf_rows(x, bucket_size)
        q, err = _quantize_with_error(rows, bits, bucket_size, k_key, dtype, impl=impl,
                                      residual=None if r is None else _leaf_rows(r, bucket_size),
                                      with_error=errors or r is not None)
        parts.append((q, err))
    counts = [q.scale.shape[0] for q, _ in parts]
    # Whole buckets of zeros (what quantizing zeros gives) so every shard owns as many buckets.
    fill = -sum(counts) % n
    cat = lambda arrays, pad: jnp.concatenate(  # noqa: E731
        arrays + ([jnp.zeros((fill, *pad.shape[1:]), pad.dtype)] if fill else []))
    q1 = Quantized(*(cat([getattr(q, f) for q, _ in parts], getattr(parts[0][0], f))
                     for f in Quantized._fields))
    errors = [None if err is None else err.astype(dtype).ravel()[:x.size].reshape(x.shape)
              for x, (_, err) in zip(xs, parts)]
    return _exchange(q1, comm.all_to_all, q1.scale.shape[0] // n), counts, errors


def _exchange(qx: Quantized, collective, per_shard: int) -> Quantized:
    """`collective` (all-to-all or all-gather) of a buffer in chunks of `per_shard` whole
    buckets: its packed bytes, and its scales and offsets (one collective each)."""
    packed = collective(qx.packed.reshape(-1, per_shard, qx.packed.shape[-1]))
    meta = collective(jnp.stack([qx.scale, qx.offset], axis=-1).reshape(-1, per_shard, 2))
    return Quantized(packed.reshape(-1, packed.shape[-1]), meta[..., 0].ravel(),
                     meta[..., 1].ravel())


def _requantized(received: Quantized, n: int, dtype, bits: int, bucket_size: int, key,
                 mean: bool, impl: str) -> tuple[Quantized, int]:
    """The owned chunk's `n` received copies dequantized, summed (`mean`: averaged) and quantized
    again in one pass (`quantizer.requantize_sum`; `key`: stochastic rounding's, or None), and
    the buckets per copy."""
    per_shard = received.scale.shape[0] // n
    width = received.packed.shape[-1]
    noise = None if key is None else \
        jax.random.uniform(key, (per_shard, bucket_size), jnp.float32)
    return Quantized(*quantizer.requantize_sum(
        received.packed.reshape(n, per_shard, width), received.scale.reshape(n, per_shard),
        received.offset.reshape(n, per_shard), bits, dtype, mean=mean, noise=noise,
        impl=impl)), per_shard


def _gather_group(received: Quantized, like: list, counts: list[int], comm: Collectives,
                  bits: int, bucket_size: int, key, mean: bool, impl: str = "auto") -> list:
    """The second half of `_reduce_group`: the owned chunk's `n` copies dequantized, summed and
    quantized again in one pass (`quantizer.requantize_sum`), the all-gather, and each tensor
    (shapes and dtype of `like`, with `counts` buckets) dequantized from the gathered bytes."""
    dtype = like[0].dtype
    q2, per_shard = _requantized(received, comm.size, dtype, bits, bucket_size, key, mean, impl)
    gathered = _exchange(q2, comm.all_gather, per_shard)
    outs, start = [], 0
    for x, count in zip(like, counts):
        rows = Quantized(*(a[start:start + count] for a in gathered))
        outs.append(dequantize(rows, bits, dtype).ravel()[:x.size].reshape(x.shape))
        start += count
    return outs


def _reduce_group(xs: list[jax.Array], residuals: list, comm: Collectives, bits: int,
                  bucket_size: int, keys: tuple, mean: bool, impl: str = "auto"):
    """Compressed all-reduce of the tensors `xs` (one dtype) packed into one buffer.

    Each tensor (plus its residual) is quantized in one pass of its own (`quantizer.
    quantize_rows`: no concatenated copy of the gradients); only the packed bytes are
    concatenated. The owned chunk is dequantized, summed and quantized again in one pass
    (`quantizer.requantize_sum`), and each result is dequantized straight from the gathered bytes.

    Returns (reduced tensors, local quantization errors or None per tensor), shaped like `xs`.
    """
    received, counts, errors = _scatter_group(xs, residuals, comm, bits, bucket_size, keys[0],
                                              impl)
    return _gather_group(received, xs, counts, comm, bits, bucket_size, keys[1], mean,
                         impl), errors


SCOPES = ("all", "inter-node")
"""Where the exchange compresses: over every shard of the axis (`all`), or only between nodes
(`inter-node`: exact inside each node, compressed across; `Nodes`)."""


def check_scope(scope: str) -> None:
    """Raise a one-line ValueError unless `scope` is one of `SCOPES`.

    Args:
      scope: the requested compression scope.

    Raises:
      ValueError: `scope` is not one of `SCOPES`.
    """
    check_choice("compression scope", scope, SCOPES)


class Nodes(NamedTuple):
    """A mesh axis of `count · size` shards seen as `count` nodes of `size` consecutive shards.

    Shard `d` is in node `d // size`, at place `d % size` there.
    """

    axis: str
    size: int
    count: int

    def inside(self) -> list[list[int]]:
        """The shards of each node (`axis_index_groups`).

        Returns:
          `count` lists of `size` shard indices.
        """
        return [[m * self.size + k for k in range(self.size)] for m in range(self.count)]

    def across(self) -> list[list[int]]:
        """The shards at one place in every node (`axis_index_groups`).

        Returns:
          `size` lists of `count` shard indices.
        """
        return [[m * self.size + k for m in range(self.count)] for k in range(self.size)]


def nodes_of(axis_name: str, node_size: int | None) -> Nodes | None:
    """`Nodes` of the manual axis `axis_name` in nodes of `node_size` shards, or None.

    Args:
      axis_name: a manual mesh axis.
      node_size: shards per node; None or 1: one level.

    Returns:
      The `Nodes`, or None where that is one level (no node size, or nodes of one shard).

    Raises:
      ValueError: (one line) the node size does not divide the axis into two or more nodes.
    """
    if not node_size or node_size == 1:
        return None
    size = jax.lax.axis_size(axis_name)
    if node_size < 1 or size % node_size or size == node_size:
        raise ValueError(f"compression scope inter-node: {size} shards of {axis_name!r} do not "
                         f"split into 2 or more nodes of {node_size}")
    return Nodes(axis_name, node_size, size // node_size)


def node_collectives(nodes: Nodes) -> Collectives:
    """The collectives between the shards at this shard's place in every node.

    No `psum`: JAX has none over groups of an axis inside shard_map, and the exact tensors take
    the whole axis's.

    Args:
      nodes: the axis's nodes.

    Returns:
      `Collectives` of size `nodes.count`, whose `index` is the shard's index on the whole axis
      (its rounding noise differs from every other shard's) and whose `psum` is None.
    """
    groups = nodes.across()
    return Collectives(nodes.count, jax.lax.axis_index(nodes.axis), None,
                       lambda a: jax.lax.all_to_all(a, nodes.axis, 0, 0,
                                                    axis_index_groups=groups),
                       lambda a: jax.lax.all_gather(a, nodes.axis, axis_index_groups=groups))


def _node_chunk(x: jax.Array, r, nodes: Nodes) -> jax.Array:
    """This shard's `1 / nodes.size` of the exact sum of `x + r` over its node: flat, padded
    with its last value to whole chunks (`psum_scatter` over the node)."""
    flat = (x if r is None else x + r.astype(x.dtype)).ravel()
    flat = jnp.pad(flat, (0, -flat.size % nodes.size), mode="edge")
    return psum_scatter(flat, nodes.axis, scatter_dimension=0, axis_index_groups=nodes.inside(),
                        tiled=True)


def _node_spread(error: jax.Array, like, nodes: Nodes) -> jax.Array:
    """The quantization error of this shard's chunk (`_node_chunk`) as a residual shaped like
    `like`: the error at the chunk's elements, zeros elsewhere (summed over the node before the
    next quantization, the residuals give each chunk its own error back)."""
    place = jax.lax.axis_index(nodes.axis) % nodes.size
    rows = jnp.zeros((nodes.size, error.size), error.dtype)
    rows = jax.lax.dynamic_update_index_in_dim(rows, error, place, 0)
    return rows.ravel()[:like.size].reshape(like.shape)


def _node_scatter_group(xs: list[jax.Array], residuals: list, nodes: Nodes, bits: int,
                        bucket_size: int, key, impl: str = "auto"):
    """`_scatter_group` between nodes: each tensor (its residual added) summed exactly over the
    node and split (`_node_chunk`), each shard's chunks quantized and exchanged with the shards
    at its place in the other nodes.

    Returns (received, counts, errors) as `_scatter_group` does, for the chunks; the errors
    shaped like `xs` (`_node_spread`), or None without residuals.
    """
    with_error = any(r is not None for r in residuals)
    chunks = [_node_chunk(x, r, nodes) for x, r in zip(xs, residuals)]
    received, counts, errors = _scatter_group(chunks, [None] * len(xs), node_collectives(nodes),
                                              bits, bucket_size, key, impl, errors=with_error)
    return received, counts, [None if not with_error else _node_spread(e, x, nodes)
                              for x, e in zip(xs, errors)]


def _by_place(a: jax.Array, nodes: Nodes) -> jax.Array:
    """Every shard's `a` (`[1, ...]`), typed invariant over the axis: `[nodes.size, nodes.count,
    ...]`, shard (node m, place k) at `[k, m]`.

    Gathered across nodes, then inside each node (`_compat.gathered_invariant`), so the NICs carry
    `1 / nodes.size` of what one gather over the whole axis sends across them; where no shard_map
    can nest (every mesh axis manual), that one gather, reordered.
    """
    def across_then_inside(a):
        a = jax.lax.all_gather(a, nodes.axis, axis_index_groups=nodes.across(), tiled=True)
        return jax.lax.all_gather(a, nodes.axis, axis_index_groups=nodes.inside())

    out = gathered_invariant(across_then_inside, a, nodes.axis)
    if out is None:
        whole = all_gather_invariant(a, nodes.axis)
        out = whole.reshape(nodes.count, nodes.size, *a.shape).swapaxes(0, 1)
    return out


def _node_gather_group(received: Quantized, like: list, counts: list[int], nodes: Nodes,
                       bits: int, bucket_size: int, key, mean: bool, impl: str = "auto") -> list:
    """`_gather_group` between nodes: the owned part of this shard's chunks summed over nodes
    and quantized again, every shard's packed part gathered across nodes and then inside each
    (`_by_place`), and each tensor put together from its chunks."""
    n, dtype = nodes.count, like[0].dtype
    q2, per_shard = _requantized(received, n, dtype, bits, bucket_size, key, mean, impl)
    gathered = _exchange(q2, lambda a: _by_place(a, nodes), per_shard)
    # Shard (node m, place k) holds part m of chunk k: chunk k is parts 0..n-1 of place k.
    by_place = Quantized(*(a.reshape(nodes.size, n * per_shard, *a.shape[1:]) for a in gathered))
    outs, start = [], 0
    for x, count in zip(like, counts):
        chunk = -(-x.size // nodes.size)
        rows = Quantized(*(a[:, start:start + count].reshape(-1, *a.shape[2:])
                           for a in by_place))
        values = dequantize(rows, bits, dtype).reshape(nodes.size, -1)[:, :chunk]
        value = values.ravel()[:x.size].reshape(x.shape)
        outs.append(value / nodes.size if mean else value)
        start += count
    return outs


class _Plan(NamedTuple):
    """What the second stage of a compressed exchange needs to know of the first's tensors
    (static): their treedef, shapes and dtypes, the exact ones' indices, each compressed
    buffer's width and members with their bucket counts, and the collectives' group."""

    treedef: Any
    like: list
    exact: list
    groups: list  # (bits, member indices, bucket counts) per buffer
    comm: Collectives
    nodes: Nodes | None = None  # exact inside nodes, compressed between them


def compressed_scatter(tree, axis_name: str | Collectives, bits: int = 4,
                       bucket_size: int = DEFAULT_BUCKET_SIZE, min_size: int = DEFAULT_MIN_SIZE,
                       key=None, residual=None, overrides: Mapping[str, int] | None = None,
                       mean: bool = False, impl: str = "auto", stacked: tuple[str, ...] = (),
                       node_size: int | None = None):
    """The first stage of `compressed_psum`: quantize with residuals, all-to-all, exact `psum`.

    Every tensor is quantized with its residual and the packed chunks cross in the all-to-all;
    the exact tensors are summed by `psum`.

    Args:
      tree: as `compressed_psum`'s.
      axis_name: as `compressed_psum`'s.
      bits: as `compressed_psum`'s.
      bucket_size: as `compressed_psum`'s.
      min_size: as `compressed_psum`'s.
      key: as `compressed_psum`'s.
      residual: as `compressed_psum`'s.
      overrides: as `compressed_psum`'s.
      mean: as `compressed_psum`'s.
      impl: as `compressed_psum`'s.
      stacked: as `compressed_psum`'s.
      node_size: as `compressed_psum`'s (only over a mesh axis).

    Returns:
      `(value, new_residual, plan)`: `value`, a pytree of arrays (what crosses to the second
      stage: received chunks, exact sums, the second rounding's key data); `new_residual` as
      `compressed_psum` returns it (known after this stage); `plan`, static
      (`compressed_gather` reads it).

    Raises:
      ValueError: bad `bits` or `bucket_size`, a bit width outside 0..8, `node_size` with
        `Collectives`, or a node size that does not split the axis.
    """
    check_args(bits, bucket_size)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = leaf_widths(tree, bits, min_size, overrides, stacked)
    for path, w in named:
        if not isinstance(w, int) or not 0 <= w <= 8:
            raise ValueError(f"bit width for {path!r} must be an integer in 0..8 "
                             f"(0: exact), got {w!r}")
    widths = [w for _, w in named]
    leaves = [leaf for _, leaf in paths_leaves]
    res = treedef.flatten_up_to(residual) if residual is not None else [None] * len(leaves)
    if isinstance(axis_name, Collectives):
        if node_size and node_size > 1:
            raise ValueError("compression scope inter-node runs over a mesh axis, not between "
                             "processes")
        comm, axis_name, nodes = axis_name, None, None
    else:
        nodes = nodes_of(axis_name, node_size)
        comm = axis_collectives(axis_name)
        vary = lambda x: x if x is None or axis_name in varying_axes(x) else \
            to_varying(x, (axis_name,))  # noqa: E731
        leaves, res = [vary(x) for x in leaves], [vary(r) for r in res]
    n = comm.size

    exact = [i for i, w in enumerate(widths) if w == 0]
    sent = [leaves[i] if res[i] is None else leaves[i] + res[i].astype(leaves[i].dtype)
            for i in exact]
    value = {"exact": [y / n if mean else y for y in comm.psum(sent)] if exact else [],
             "groups": []}
    new_res: list[Any] = [None] * len(leaves)
    for i, x in zip(exact, sent):
        new_res[i] = jnp.zeros_like(x)
    # One buffer per bit width, dtype and set of other manual axes the tensors vary over: a buffer
    # mixing tensors that vary over `pipe` (a stage's blocks) with ones that do not (embeddings
    # replicated over `pipe`) would make every result typed varying over `pipe`.
    buffers: dict[tuple, list[int]] = {}
    for i, w in enumerate(widths):
        if w:
            others = tuple(sorted(varying_axes(leaves[i]) - {axis_name}))
            buffers.setdefault((w, str(jnp.dtype(leaves[i].dtype)), others), []).append(i)
    groups = []
    for g, ((w, _, _), idx) in enumerate(sorted(buffers.items())):
        first, second = (_key_for(key, g, stage, comm.index) for stage in (0, 1))
        xs, rs = [leaves[i] for i in idx], [res[i] for i in idx]
        if nodes is None:
            received, counts, errors = _scatter_group(xs, rs, comm, w, bucket_size, first, impl)
        else:
            received, counts, errors = _node_scatter_group(xs, rs, nodes, w, bucket_size, first,
                                                           impl)
        value["groups"].append({
            "received": received, "key": None if second is None else jax.random.key_data(second)})
        groups.append((w, idx, counts))
        for i, e in zip(idx, errors):
            new_res[i] = e
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    return (value, treedef.unflatten(new_res) if residual is not None else None,
            _Plan(treedef, like, exact, groups, comm, nodes))


def compressed_gather(value, plan: _Plan, bucket_size: int = DEFAULT_BUCKET_SIZE,
                      mean: bool = False, impl: str = "auto", **_):
    """The second stage of `compressed_psum`: sum, quantize again, all-gather, dequantize.

    Each owned chunk's copies are summed and quantized again, then all-gathered, and every
    tensor is dequantized.

    Args:
      value: `compressed_scatter`'s value.
      plan: `compressed_scatter`'s plan.
      bucket_size: as `compressed_psum`'s.
      mean: as `compressed_psum`'s.
      impl: as `compressed_psum`'s.
      **_: `compressed_psum`'s other options, ignored.

    Returns:
      `reduced` as `compressed_psum` returns it.
    """
    out: list[Any] = [None] * len(plan.like)
    for k, i in enumerate(plan.exact):
        out[i] = value["exact"][k]
    for (w, idx, counts), part in zip(plan.groups, value["groups"]):
        key = None if part["key"] is None else jax.random.wrap_key_data(part["key"])
        like = [plan.like[i] for i in idx]
        if plan.nodes is None:
            ys = _gather_group(part["received"], like, counts, plan.comm, w, bucket_size, key,
                               mean, impl)
        else:
            ys = _node_gather_group(part["received"], like, counts, plan.nodes, w, bucket_size,
                                    key, mean, impl)
        for i, y in zip(idx, ys):
            out[i] = y
    return plan.treedef.unflatten(out)


def compressed_psum(tree, axis_name: str | Collectives, bits: int = 4,
                    bucket_size: int = DEFAULT_BUCKET_SIZE, min_size: int = DEFAULT_MIN_SIZE,
                    key=None, residual=None, overrides: Mapping[str, int] | None = None,
                    mean: bool = False, impl: str = "auto", stacked: tuple[str, ...] = (),
                    node_size: int | None = None):
    """Sum (or mean) `tree` over the manual mesh axis `axis_name` with CGX compression.

    Call inside a shard_map manual over `axis_name`, or give `Collectives` for another transport
    (`parallel.mpi` passes MPI's, between processes). Each compressed element is quantized
    twice (once locally, once after the sum), so it is off by at most
    sum_i scale_i / 2 + scale_sum / 2 with nearest rounding. The two stages
    (`compressed_scatter`, `compressed_gather`) can run apart, each beside other compute.

    Args:
      tree: pytree of float arrays, this shard's values (e.g. its local gradients).
      axis_name: the manual mesh axis, or the `Collectives` of another transport.
      bits: the default bit width (1..8).
      bucket_size: values per bucket.
      min_size: tensors of fewer elements (per layer for `stacked`) stay exact.
      key: None for nearest rounding, or a PRNG key (the same on every shard; each shard and
        stage folds in its own index) for stochastic rounding.
      residual: None (no error feedback) or a pytree like `tree` with this shard's
        error-feedback residual, added before quantization.
      overrides: {regex on the '/'-joined path: bits}; 0 means exact.
      mean: divide the sum by the group's size.
      impl: how the quantizer runs (`quantizer.IMPLS`: "auto" a Pallas kernel on GPUs, jnp that
        XLA fuses elsewhere); each gradient and residual is read once.
      stacked: top-level keys of `tree` whose leaves stack layers on their leading axis: the
        size filter looks at one layer (`bits_for_leaf`).
      node_size: None (compress over the whole axis), or the shards of each node (consecutive
        along the axis; `Nodes`): compressed tensors (their residual added) are summed exactly
        and reduce-scattered inside each node, each shard's chunk compressed across nodes with
        the shards at its place in the others, and the packed result all-gathered over the
        whole axis; a residual keeps the tensor's shape, nonzero only on the chunk this shard
        quantizes.

    Returns:
      `(reduced, new_residual)`: `reduced` like `tree`, typed invariant over `axis_name` (the
      same on every shard); `new_residual` like `tree`, varying over `axis_name` (what this
      shard's first quantization lost; zeros for exact tensors), or None when `residual` is
      None.

    Raises:
      ValueError: as `compressed_scatter`.
    """
    value, new_residual, plan = compressed_scatter(tree, axis_name, bits, bucket_size, min_size,
                                                   key, residual, overrides, mean, impl, stacked,
                                                   node_size)
    return compressed_gather(value, plan, bucket_size, mean, impl), new_residual


def compressed_pmean(tree, axis_name: str, **kwargs):
    """`compressed_psum(..., mean=True)`: the mean over `axis_name` (pmean semantics).

    Args:
      tree: as `compressed_psum`'s.
      axis_name: as `compressed_psum`'s.
      **kwargs: `compressed_psum`'s other options.

    Returns:
      `(reduced, new_residual)` as `compressed_psum` returns them, `reduced` the mean.
    """
    return compressed_psum(tree, axis_name, mean=True, **kwargs)


def _without_axes(spec: P, axes) -> P:
    """`spec` with the mesh axes `axes` removed from every dimension."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a is not None and a not in axes)
        return kept if len(kept) > 1 else (kept[0] if kept else None)

    return P(*(keep(e) for e in spec))


def sharded_compressed_psum(tree, specs, mesh, axis_name: str = Axis.DATA, residual=None,
                            **kwargs):
    """`compressed_psum` over `axis_name` of arrays that other mesh axes split.

    For tensor or pipeline parallelism: each device quantizes and exchanges only its own shards,
    nothing is gathered. Call inside a shard_map manual over `axis_name` (and possibly more
    axes, e.g. `pipe`); the other axes are automatic there.

    A shard_map manual over the remaining axes runs `compressed_psum(local shards, axis_name,
    residual=local residual, **kwargs)` on every device, so each shard of the result is bitwise
    `compressed_psum` of that shard alone: buckets are cut from the local shards, and the size
    rule (`min_size`, ndim) applies to a device's shard. Copies of an array replicated over an axis
    (a bias over `col`) hold equal inputs and run the same deterministic reduction (rounding noise
    depends on the `axis_name` index only), so they stay equal. Nothing is compressed over the
    other axes: sums over `depth` stay whatever exact collective produced `tree`.

    Args:
      tree: pytree of float arrays, this `axis_name` shard's values as global arrays over the
        automatic axes.
      specs: PartitionSpecs like `tree` (a prefix tree works), how each array is split over the
        mesh; axes already manual here are ignored (the arrays are local over them).
      mesh: the mesh (None: the one in context).
      axis_name: the manual axis the sum runs over.
      residual: None or a pytree like `tree`, split the same way (error feedback is per device:
        each device keeps what its own shards' quantization lost).
      **kwargs: `compressed_psum`'s other options.

    Returns:
      `(reduced, new_residual)` as `compressed_psum` returns them, split like `specs`.

    Raises:
      ValueError: called outside a shard_map manual over `axis_name`.
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
    # The rounding key enters the inner shard_map as an argument: one closed over would keep the
    # outer context's mesh type, which JAX refuses to mix with the inner one's.
    key = kwargs.pop("key", None)
    reduce = lambda t, r, k: compressed_psum(t, axis_name, residual=r, key=k,  # noqa: E731
                                             **kwargs)
    key_spec = None if key is None else P()
    if residual is None:
        reduce_tree = shard_map(lambda t, k: reduce(t, None, k)[0], mesh=context,
                                in_specs=(specs, key_spec), out_specs=specs,
                                axis_names=set(free))
        return reduce_tree(tree, key), None
    return shard_map(reduce, mesh=context, in_specs=(specs, specs, key_spec),
                     out_specs=(specs, specs), axis_names=set(free))(tree, residual, key)


def sharded_compressed_pmean(tree, specs, mesh, axis_name: str = Axis.DATA, **kwargs):
    """`sharded_compressed_psum(..., mean=True)`: the mean over `axis_name`.

    Args:
      tree: as `sharded_compressed_psum`'s.
      specs: as `sharded_compressed_psum`'s.
      mesh: as `sharded_compressed_psum`'s.
      axis_name: as `sharded_compressed_psum`'s.
      **kwargs: `compressed_psum`'s other options (`residual` included).

    Returns:
      `(reduced, new_residual)` as `sharded_compressed_psum` returns them, `reduced` the mean.
    """
    return sharded_compressed_psum(tree, specs, mesh, axis_name, mean=True, **kwargs)


def sharded_compressed_stages(specs, mesh=None, axis_name: str = Axis.DATA, **kwargs) -> tuple:
    """`sharded_compressed_psum` as two stages that can run apart.

    `step.layer_exchange` runs each beside another layer's backward.

    Args:
      specs: PartitionSpecs like the trees the stages take, how the mesh splits each array; axes
        already manual are ignored.
      mesh: the mesh (None: the one in context).
      axis_name: the manual axis the sum runs over.
      **kwargs: `compressed_psum`'s options (bits, bucket_size, min_size, overrides, mean, impl,
        stacked).

    Returns:
      (scatter, gather): `scatter(tree, residual=None, key=None) -> (value, new_residual)`
      quantizes and sends (`compressed_scatter`; the new residual is known there);
      `gather(value) -> reduced` sums, re-quantizes, gathers and dequantizes
      (`compressed_gather`). Each device compresses its own blocks; the tensors are cut into one
      part per set of tensor axes that split them, each part run in a shard_map manual over
      exactly those axes (so every result is typed like its spec), and `value` holds each part's
      arrays stacked over its axes. The gather takes the value of a tree of the same structure
      and shapes as the last scatter's.
    """
    stages = _ShardedStages(specs, mesh, axis_name, kwargs)
    return stages.scatter, stages.gather


class _ShardedStages:
    """`sharded_compressed_stages`' scatter and gather; the gather reads the parts and plans of
    the last scatter (static: they come from shapes and specs)."""

    def __init__(self, specs, mesh, axis_name: str, options: dict):
        self.specs, self.mesh, self.axis_name, self.options = specs, mesh, axis_name, options
        self.layout = None

    def _parts(self, tree):
        """(context mesh, treedef, leaf paths, leaf specs without the manual axes, parts): each
        part `(axes splitting its leaves, in the mesh's order; the leaves' indices)`."""
        context = current_mesh(self.mesh)
        manual = frozenset(getattr(context, "manual_axes", ()))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        spec_leaves = treedef.flatten_up_to(jax.tree.map(
            lambda s: _without_axes(s, manual), self.specs, is_leaf=lambda x: isinstance(x, P)))
        parts: dict[tuple, list[int]] = {}
        for i, spec in enumerate(spec_leaves):
            split = spec_axes(spec)
            parts.setdefault(tuple(a for a in context.axis_names if a in split), []).append(i)
        return context, treedef, [leaf_path(p) for p, _ in leaves], spec_leaves, list(parts.items())

    def scatter(self, tree, residual=None, key=None):
        """Quantize and send each part; returns `(values, new_residual)`."""
        context, treedef, paths, spec_leaves, parts = self._parts(tree)
        leaves = treedef.flatten_up_to(tree)
        res = None if residual is None else treedef.flatten_up_to(residual)
        new_res = [None] * len(leaves)
        values, plans = [], []
        for s, (split, idx) in enumerate(parts):
            args = ([leaves[i] for i in idx], [] if res is None else [res[i] for i in idx],
                    None if key is None else jax.random.fold_in(key, s))
            value, r, plan = self._scatter_part(
                context, split, {paths[i]: spec_leaves[i] for i in idx}, args, res is not None)
            for i in idx:
                new_res[i] = r.get(paths[i])
            values.append(value)
            plans.append((split, idx, plan))
        self.layout = (context, treedef, paths, spec_leaves, plans)
        return values, None if residual is None else treedef.unflatten(new_res)

    def _scatter_part(self, context, split, named, args, with_residual: bool):
        """`(value, residuals by leaf path, plan)` of one part's `compressed_scatter`, in a
        shard_map manual over `split` when the part is split (its value stacked over them)."""
        names, plans = list(named), []

        def part(ls, rs, k):
            value, r, plan = compressed_scatter(
                dict(zip(names, ls)), self.axis_name, key=k,
                residual=dict(zip(names, rs)) if rs else None, **self.options)
            plans.append(plan)
            return value, r or {}

        def stacked(ls, rs, k):
            value, r = part(ls, rs, k)
            return jax.tree.map(lambda a: a[None], value), r

        if not split:
            value, r = part(*args)
        else:
            local = list(named.values())
            # The key enters as an argument: one closed over would keep the outer mesh type.
            value, r = shard_map(
                stacked, mesh=context,
                in_specs=(local, local if with_residual else [], None if args[2] is None else P()),
                out_specs=(P(split), named if with_residual else {}),
                axis_names=set(split))(*args)
        return value, r, plans[0]

    def gather(self, values):
        """Sum, re-quantize, gather and dequantize the values of the last scatter."""
        context, treedef, paths, spec_leaves, plans = self.layout
        out = [None] * treedef.num_leaves
        for value, (split, idx, plan) in zip(values, plans):
            run = lambda v, plan=plan: compressed_gather(v, plan, **self.options)  # noqa: E731
            if split:
                reduced = shard_map(lambda v, run=run: run(jax.tree.map(lambda a: a[0], v)),
                                    mesh=context, in_specs=(P(split),),
                                    out_specs={paths[i]: spec_leaves[i] for i in idx},
                                    axis_names=set(split))(value)
            else:
                reduced = run(value)
            for i in idx:
                out[i] = reduced[paths[i]]
        return treedef.unflatten(out)


def init_residual(params, num_shards: int):
    """Zero error-feedback residuals for `num_shards` data shards.

    Args:
      params: the parameter tree.
      num_shards: devices on `data`.

    Returns:
      A tree like `params`, each leaf zeros `[num_shards, *shape]` in its dtype, meant to be
      split over `data` on its leading axis and like its parameter on the others (one residual
      per device; see `sharded_compressed_psum`).
    """
    return jax.tree.map(lambda p: jnp.zeros((num_shards, *p.shape), p.dtype), params)


def bucket_bytes(bits: int, bucket_size: int, itemsize: int = 4) -> float:
    """Bytes of one packed bucket: its values, scale and offset.

    Args:
      bits: bits per value.
      bucket_size: values per bucket.
      itemsize: bytes of the scale (and of the offset).

    Returns:
      `bucket_size · bits / 8 + 2 · itemsize`.
    """
    return bucket_size * bits / 8 + 2 * itemsize


def wire_bytes_per_element(bits: int, bucket_size: int, itemsize: int = 4) -> float:
    """Bytes one shard sends per gradient element through the compressed exchange.

    For large buffers and many shards (`(n-1)/n -> 1`): packed buckets (`bucket_bytes`), twice.

    Args:
      bits: bits per value.
      bucket_size: values per bucket.
      itemsize: bytes of a bucket's scale (and offset).

    Returns:
      `2 · bucket_bytes(...) / bucket_size`.
    """
    return 2 * bucket_bytes(bits, bucket_size, itemsize) / bucket_size


__all__ = ["Quantized", "Collectives", "axis_collectives", "check_args", "pack_bits",
           "unpack_bits", "quantize", "dequantize", "bits_for_leaf", "parse_rule", "parse_rules",
           "ROUNDINGS", "check_rounding", "stochastic", "leaf_path", "leaf_widths",
           "SCOPES", "check_scope", "Nodes", "nodes_of", "node_collectives",
           "compressed_psum",
           "compressed_pmean", "sharded_compressed_psum", "sharded_compressed_pmean",
           "compressed_scatter", "compressed_gather", "sharded_compressed_stages",
           "init_residual", "bucket_bytes", "wire_bytes_per_element"]
