"""CGX's bucketed max–min quantizer, written so each stage is one pass over memory.

A bucket is a row of `bucket_size` values. Its packed form is laid out in *segments*: the row is
cut into `S` consecutive segments of `m = bucket_size / S` values, and

- when `bits` divides 8 (`S = 8 / bits`): byte `j` of the row holds value `j + i·m` of segment
  `i` at bits `[i·bits, (i+1)·bits)`, `m` bytes in all;
- otherwise (`S = 8`): `bits` bit planes of `m` bytes each; bit `i` of byte `j` of plane `p` is
  bit `p` of value `j + i·m`.

Packing and unpacking so need only static slices of a row and elementwise shifts, never a
reshape of its minor axis: the same code runs as XLA-fused jnp and inside a Pallas kernel, whose
blocks are whole buckets. The math of a stage is written once, on lists of segments
(`quantize_segments`, `dequantize_segments`), and used by both.

Stages (each one pass; `impl="pallas"` runs them as Pallas kernels: Triton on GPUs, the
interpreter elsewhere; `"xla"` as jnp that XLA fuses; `"auto"` picks Pallas where it compiles to a
GPU kernel):

- `quantize_rows`: rows (optionally plus an error-feedback residual, optionally with stochastic
  noise) -> packed rows, scales, offsets and the new residual, reading each input once;
- `requantize_sum`: `n` packed chunks -> their dequantized sum (or mean) quantized again;
- `dequantize_rows`: packed rows -> values (XLA fuses it into its consumer).
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from .._compat import platform_or_default, shape_dtype_like, triton_compiler_params
from ..checks import check_choice

Impl = Literal["auto", "xla", "pallas"]
IMPLS = ("auto", "xla", "pallas")
ROWS_PER_BLOCK = 8
"""Buckets per Pallas program: a block of 8 fp32 buckets of 1024 is 32 KiB per input."""


def segments(bits: int) -> int:
    """Segments of a bucket: values per byte when `bits` divides 8, else 8 (bit planes).

    Args:
      bits: bits per quantized value.

    Returns:
      `8 // bits` when `bits` divides 8, else 8.
    """
    return 8 // bits if 8 % bits == 0 else 8


def _split(row: jax.Array, parts: int) -> list[jax.Array]:
    m = row.shape[-1] // parts
    return [row[..., i * m:(i + 1) * m] for i in range(parts)]


def pack_segments(codes: list[jax.Array], bits: int) -> list[jax.Array]:
    """Pack code segments into the uint8 columns whose concatenation is the packed row.

    Args:
      codes: `segments(bits)` arrays of uint32 values < 2^bits, each `[..., m]`.
      bits: bits per value.

    Returns:
      uint8 columns, `[..., m]` each: one, or `bits` bit planes.
    """
    if 8 % bits == 0:
        word = codes[0]
        for i, q in enumerate(codes[1:], 1):
            word = word | (q << (i * bits))
        return [word.astype(jnp.uint8)]
    planes = []
    for p in range(bits):
        word = (codes[0] >> p) & 1
        for i, q in enumerate(codes[1:], 1):
            word = word | (((q >> p) & 1) << i)
        planes.append(word.astype(jnp.uint8))
    return planes


def unpack_segments(columns: list[jax.Array], bits: int) -> list[jax.Array]:
    """Inverse of `pack_segments`: uint8 columns -> `segments(bits)` uint32 code arrays.

    Args:
      columns: uint8 columns as `pack_segments` gives them, `[..., m]` each.
      bits: bits per value.

    Returns:
      `segments(bits)` uint32 code arrays, `[..., m]` each.
    """
    cols = [c.astype(jnp.uint32) for c in columns]
    if 8 % bits == 0:
        mask = (1 << bits) - 1
        return [(cols[0] >> (i * bits)) & mask for i in range(8 // bits)]
    codes = []
    for i in range(8):
        q = (cols[0] >> i) & 1
        for p in range(1, bits):
            q = q | (((cols[p] >> i) & 1) << p)
        codes.append(q)
    return codes


def pack_rows(q: jax.Array, bits: int) -> jax.Array:
    """`pack_segments` over the last axis of whole rows, as broadcasts and reductions.

    The reductions run over a middle axis: the segment layout is the row-major order of
    [segments, m], so XLA needs no slices or concatenations.

    Args:
      q: uint32 codes (or values castable to them), `[..., B]`.
      bits: bits per value.

    Returns:
      uint8 `[..., B · bits / 8]`.
    """
    parts = segments(bits)
    q = q.reshape(*q.shape[:-1], parts, -1).astype(jnp.uint32)  # [..., S, m]
    i = jnp.arange(parts, dtype=jnp.uint32)[:, None]
    if 8 % bits == 0:
        return jnp.sum(q << (i * bits), axis=-2, dtype=jnp.uint32).astype(jnp.uint8)
    p = jnp.arange(bits, dtype=jnp.uint32)[:, None, None]
    planes = jnp.sum(((q[..., None, :, :] >> p) & 1) << i, axis=-2, dtype=jnp.uint32)
    return planes.reshape(*planes.shape[:-2], -1).astype(jnp.uint8)  # [..., bits · m]


def unpack_rows(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack_rows`: uint8 [..., B · bits / 8] -> uint32 codes [..., B].

    Args:
      packed: uint8 `[..., B · bits / 8]`.
      bits: bits per value.

    Returns:
      uint32 codes `[..., B]`.
    """
    cols = packed.astype(jnp.uint32)
    if 8 % bits == 0:
        i = jnp.arange(8 // bits, dtype=jnp.uint32)[:, None]
        q = (cols[..., None, :] >> (i * bits)) & ((1 << bits) - 1)  # [..., S, m]
    else:
        planes = cols.reshape(*cols.shape[:-1], bits, -1)  # [..., bits, m]
        i = jnp.arange(8, dtype=jnp.uint32)[:, None, None]
        p = jnp.arange(bits, dtype=jnp.uint32)[:, None]
        q = jnp.sum(((planes[..., None, :, :] >> i) & 1) << p, axis=-2, dtype=jnp.uint32)
    return q.reshape(*q.shape[:-2], -1)


def _round_half_even(t: jax.Array) -> jax.Array:
    """`jnp.round` (ties to even) from floor and compares: Pallas' Triton lowering has no
    round; identical results on every backend."""
    r = jnp.floor(t)
    frac = t - r
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return r + jnp.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


def quantize_segments(segs: list[jax.Array], bits: int, dtype, noise=None, in_kernel=False):
    """Max–min quantization of rows given as segments.

    Scale and offset are rounded to `dtype` before the codes are computed, so the error bounds
    hold for what the receiver sees.

    Args:
      segs: float32 `[R, m]` each; a bucket may also be given whole, as one segment.
      bits: bits per value.
      dtype: the dtype of the scale and offset.
      noise: None (round to nearest) or segments of uniform [0, 1) noise like `segs`
        (stochastic rounding).
      in_kernel: round without `jnp.round`, which Pallas' Triton lowering lacks (identical
        results).

    Returns:
      `(codes, scale, offset)`: codes float32 like `segs`, scale `[R]` and offset `[R]` in
      `dtype`.
    """
    levels = (1 << bits) - 1
    lo = segs[0].min(axis=-1)
    hi = segs[0].max(axis=-1)
    for s in segs[1:]:
        lo, hi = jnp.minimum(lo, s.min(axis=-1)), jnp.maximum(hi, s.max(axis=-1))
    scale = ((hi - lo) / levels).astype(dtype)
    offset = lo.astype(dtype)
    s, o = scale.astype(jnp.float32)[:, None], offset.astype(jnp.float32)[:, None]
    safe = jnp.where(s > 0, s, 1.0)
    codes = []
    for k, x in enumerate(segs):
        t = jnp.where(s > 0, (x - o) / safe, 0.0)
        if noise is not None:
            t = jnp.floor(t + noise[k])
        else:
            t = _round_half_even(t) if in_kernel else jnp.round(t)
        codes.append(jnp.clip(t, 0.0, float(levels)))
    return codes, scale, offset


def _pack_codes(codes: list[jax.Array], bits: int) -> list[jax.Array]:
    """uint8 columns of float32 codes given as `segments(bits)` segments or one whole row."""
    if len(codes) == 1 and segments(bits) > 1:
        codes = _split(codes[0], segments(bits))
    return pack_segments([q.astype(jnp.uint32) for q in codes], bits)


def dequantize_segments(columns: list[jax.Array], scale, offset, bits: int) -> list[jax.Array]:
    """float32 segments `offset + q · scale` of packed rows.

    Args:
      columns: uint8 columns as `pack_segments` gives them, `[R, m]` each.
      scale: `[R]`, any float dtype.
      offset: `[R]`, any float dtype.
      bits: bits per value.

    Returns:
      `segments(bits)` float32 segments, `[R, m]` each.
    """
    s, o = scale.astype(jnp.float32)[:, None], offset.astype(jnp.float32)[:, None]
    return [o + q.astype(jnp.float32) * s for q in unpack_segments(columns, bits)]


def kernel_fits(bits: int, bucket_size: int) -> bool:
    """Whether a Pallas kernel takes buckets of this shape.

    Triton blocks need power-of-two dimensions, so segments of a power-of-two length of at
    least 16.

    Args:
      bits: bits per value.
      bucket_size: values per bucket.

    Returns:
      True when `bucket_size / segments(bits)` is a whole power of two ≥ 16.
    """
    m = bucket_size // segments(bits)
    return m >= 16 and m & (m - 1) == 0 and bucket_size % segments(bits) == 0


def use_kernel(impl: Impl, bits: int, bucket_size: int) -> bool:
    """Whether a stage runs as a Pallas kernel (True) or as jnp (False).

    Args:
      impl: "pallas" forces the kernel, "xla" the jnp, "auto" the kernel on GPUs where it fits.
      bits: bits per value.
      bucket_size: values per bucket.

    Returns:
      True for the Pallas kernel.

    Raises:
      ValueError: `impl` is not one of `IMPLS`, or is "pallas" where the bucket does not fit a
        kernel (`kernel_fits`).
    """
    check_choice("quantizer impl", impl, IMPLS)
    if impl == "pallas" and not kernel_fits(bits, bucket_size):
        raise ValueError(f"the Pallas quantizer needs {bucket_size} / {segments(bits)} values per "
                         f"segment to be a power of two >= 16 (bits {bits}, bucket {bucket_size})")
    if impl == "auto":
        return platform_or_default() == "gpu" and kernel_fits(bits, bucket_size)
    return impl == "pallas"


def _backend() -> dict:
    """pallas_call's keywords: Triton on GPUs, the interpreter elsewhere."""
    if platform_or_default() == "gpu":
        return {"compiler_params": triton_compiler_params()}
    return {"interpret": True}


def _row_spec(width: int):
    from jax.experimental import pallas as pl

    return pl.BlockSpec((ROWS_PER_BLOCK, width), lambda i: (i, 0))


def _vec_spec():
    from jax.experimental import pallas as pl

    return pl.BlockSpec((ROWS_PER_BLOCK,), lambda i: (i,))


def quantize_rows(x: jax.Array, bits: int, dtype, *, residual=None, noise=None,
                  impl: Impl = "auto", with_error: bool = True):
    """Quantize rows in one pass, returning the new error-feedback residual too.

    `v = x + residual` (in `x`'s dtype, then float32) is quantized, and `v - dequantized` is the
    new residual.

    Args:
      x: [n_buckets, bucket_size] values (any float dtype).
      bits: bits per value.
      dtype: the dtype of the scales and offsets.
      residual: None or like `x` (any float dtype), added before quantizing.
      noise: None (nearest) or float32 [n_buckets, bucket_size] uniform [0, 1) (stochastic).
      impl: "auto", "xla" or "pallas" (`use_kernel`).
      with_error: also return the residual.

    Returns:
      (packed uint8 [n_buckets, bucket_size · bits / 8], scale [n_buckets], offset [n_buckets]
      in `dtype`, error float32 like `x` or None).
    """
    n_rows, bucket = x.shape
    parts = segments(bits)

    def body(xs, rs, ns):
        if rs is not None:
            xs = [a + r.astype(a.dtype) for a, r in zip(xs, rs)]
        segs = [a.astype(jnp.float32) for a in xs]
        codes, scale, offset = quantize_segments(segs, bits, dtype, ns, in_kernel=True)
        s, o = scale.astype(jnp.float32)[:, None], offset.astype(jnp.float32)[:, None]
        errs = [v - (o + q * s) for v, q in zip(segs, codes)] if with_error else None
        return _pack_codes(codes, bits), scale, offset, errs

    if not use_kernel(impl, bits, bucket):
        # Whole rows: XLA fuses the elementwise math best over the full bucket; only the
        # packing slices it.
        v = x if residual is None else x + residual.astype(x.dtype)
        v = v.astype(jnp.float32)
        (q,), scale, offset = quantize_segments([v], bits, dtype,
                                                None if noise is None else [noise])
        error = v - (offset.astype(jnp.float32)[:, None] + q * scale.astype(jnp.float32)[:, None])
        return pack_rows(q, bits), scale, offset, (error if with_error else None)

    from jax.experimental import pallas as pl

    m = bucket // parts
    inputs = [a for a in (x, residual, noise) if a is not None]
    has_r, has_n = residual is not None, noise is not None

    def kernel(*refs):
        ins, outs = refs[:len(inputs)], refs[len(inputs):]
        load = lambda ref: [ref[:, i * m:(i + 1) * m] for i in range(parts)]  # noqa: E731
        xs = load(ins[0])
        rs = load(ins[1]) if has_r else None
        ns = load(ins[1 + has_r]) if has_n else None
        cols, scale, offset, errs = body(xs, rs, ns)
        packed_ref, scale_ref, offset_ref = outs[:3]
        width = cols[0].shape[-1]
        for c, col in enumerate(cols):
            packed_ref[:, c * width:(c + 1) * width] = col
        scale_ref[...] = scale
        offset_ref[...] = offset
        if with_error:
            for i, e in enumerate(errs):
                outs[3][:, i * m:(i + 1) * m] = e

    packed_width = bucket * bits // 8
    out_shape = [shape_dtype_like((n_rows, packed_width), jnp.uint8, x),
                 shape_dtype_like((n_rows,), dtype, x), shape_dtype_like((n_rows,), dtype, x)]
    out_specs = [_row_spec(packed_width), _vec_spec(), _vec_spec()]
    if with_error:
        out_shape.append(shape_dtype_like((n_rows, bucket), jnp.float32, x))
        out_specs.append(_row_spec(bucket))
    outs = pl.pallas_call(kernel, grid=(pl.cdiv(n_rows, ROWS_PER_BLOCK),),
                          in_specs=[_row_spec(bucket)] * len(inputs), out_specs=out_specs,
                          out_shape=out_shape, **_backend())(*inputs)
    return outs[0], outs[1], outs[2], (outs[3] if with_error else None)


def requantize_sum(packed, scale, offset, bits: int, dtype, *, mean: bool = False, noise=None,
                   impl: Impl = "auto"):
    """Dequantize `n` packed chunks, add them in float32 and quantize the sum again, in one pass.

    The kernel takes all `n` chunks of a block at once, so it needs `n` a power of two (Triton's
    block shapes); other `n` run as jnp, which XLA fuses into a pass over the chunks and one over
    the sum.

    Args:
      packed: uint8 [n, rows, bucket_size · bits / 8].
      scale: [n, rows].
      offset: [n, rows].
      bits: bits per value.
      dtype: the dtype of the new scales and offsets.
      mean: divide the sum by `n`.
      noise: None or float32 [rows, bucket_size] uniform [0, 1) (stochastic rounding).
      impl: "auto", "xla" or "pallas" (`use_kernel`).

    Returns:
      (packed uint8 [rows, ...], scale [rows], offset [rows]) in `dtype`.
    """
    n, n_rows, width = packed.shape
    bucket = width * 8 // bits
    parts = segments(bits)

    def body(chunks, ns):
        total = None
        for cols, s, o in chunks:
            vals = dequantize_segments(cols, s, o, bits)
            total = vals if total is None else [a + b for a, b in zip(total, vals)]
        if mean:
            total = [t / n for t in total]
        codes, scale, offset = quantize_segments(total, bits, dtype, ns, in_kernel=True)
        return _pack_codes(codes, bits), scale, offset

    if not use_kernel(impl, bits, bucket) or n & (n - 1):
        total = dequantize_rows(packed, scale, offset, bits).sum(axis=0)
        if mean:
            total = total / n
        (q,), s, o = quantize_segments([total], bits, dtype, None if noise is None else [noise])
        return pack_rows(q, bits), s, o

    from jax.experimental import pallas as pl

    n_cols = 1 if 8 % bits == 0 else bits
    col_w = width // n_cols
    m = bucket // parts

    def kernel(*refs):
        packed_ref, scale_ref, offset_ref = refs[:3]
        noise_ref = refs[3] if noise is not None else None
        out_packed, out_scale, out_offset = refs[-3:]
        chunks = [([packed_ref[c, :, k * col_w:(k + 1) * col_w] for k in range(n_cols)],
                   scale_ref[c, :], offset_ref[c, :]) for c in range(n)]
        ns = None if noise_ref is None else [noise_ref[:, i * m:(i + 1) * m] for i in range(parts)]
        cols, s, o = body(chunks, ns)
        for k, col in enumerate(cols):
            out_packed[:, k * col_w:(k + 1) * col_w] = col
        out_scale[...] = s
        out_offset[...] = o

    in_specs = [pl.BlockSpec((n, ROWS_PER_BLOCK, width), lambda i: (0, i, 0)),
                pl.BlockSpec((n, ROWS_PER_BLOCK), lambda i: (0, i)),
                pl.BlockSpec((n, ROWS_PER_BLOCK), lambda i: (0, i))]
    inputs = [packed, scale, offset]
    if noise is not None:
        in_specs.append(_row_spec(bucket))
        inputs.append(noise)
    out_shape = [shape_dtype_like((n_rows, width), jnp.uint8, packed),
                 shape_dtype_like((n_rows,), dtype, packed),
                 shape_dtype_like((n_rows,), dtype, packed)]
    return tuple(pl.pallas_call(kernel, grid=(pl.cdiv(n_rows, ROWS_PER_BLOCK),),
                                in_specs=in_specs,
                                out_specs=[_row_spec(width), _vec_spec(), _vec_spec()],
                                out_shape=out_shape, **_backend())(*inputs))


def dequantize_rows(packed, scale, offset, bits: int, dtype=jnp.float32) -> jax.Array:
    """The values `offset + q · scale` of packed rows.

    jnp: XLA fuses it into whatever reads the values, so it costs one read of the packed bytes.

    Args:
      packed: uint8 `[..., n_buckets, bucket_size · bits / 8]`.
      scale: `[..., n_buckets]`.
      offset: `[..., n_buckets]`.
      bits: bits per value.
      dtype: the values' dtype.

    Returns:
      `[..., n_buckets, bucket_size]` values in `dtype`.
    """
    q = unpack_rows(packed, bits).astype(jnp.float32)
    values = offset.astype(jnp.float32)[..., None] + q * scale.astype(jnp.float32)[..., None]
    return values.astype(dtype)


__all__ = ["IMPLS", "segments", "pack_segments", "unpack_segments", "quantize_segments",
           "dequantize_segments", "kernel_fits", "use_kernel", "quantize_rows",
           "requantize_sum", "dequantize_rows"]
