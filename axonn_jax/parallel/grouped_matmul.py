"""Grouped matmul for dropless experts: each row of `x` meets its group's matrix, and only the
rows some group holds are computed.

    grouped_matmul(x, w, sizes, routed_rows=None)  ==  jax.lax.ragged_dot(x, w, sizes)

`x (M, K)` rows sorted by group, `w (G, K, N)`, `sizes (G,)` int32: group `g` holds rows
`[Σ_{h<g} sizes[h], Σ_{h≤g} sizes[h])`; rows past `Σ sizes` come out zero.

jaxlib's `ragged_dot` computes every row against every group, masked, on CPU and GPU (on GPU it
is expanded to a dense Triton GEMM; `xla_gpu_experimental_use_ragged_dot_fusion` leaves it so
on jaxlib 0.12 and crashes XLA on 0.10). On a GPU mesh `grouped_matmul` runs Pallas (Triton)
kernels instead, forward, input gradient and weight gradient, whose work is one row tile per
(row block, group) pair that holds rows: the routed rows plus at most one tile of padding per
group, whatever `M` is: the programs of the empty slots at the end of a padded buffer return at
once. Elsewhere it is `ragged_dot`; `interpret=True` runs the kernels on CPU.

Why Triton: JAX's Mosaic GPU grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`)
lowers for sm_90, but compiling it without a GPU needs its host runtime library loaded into the
process, and it computes every row tile of `M` (padding included) and leaves rows past the
groups unwritten. The Pallas Triton backend, which these kernels use, compiles for the abstract
H100s of `analysis.targets` on jaxlib 0.10 and 0.12; jax 0.12 deprecates it (a warning when a
GPU program lowers).

XLA cannot see the work of a custom call, so each kernel declares the FLOPs it runs in its
name (`..._flops_<n>`, `analysis.hlo` reads it): `2·K·N·rows`, `rows` being `routed_rows` (the
rows the caller routes on average, e.g. the assignments one device sends over an expert axis,
which the devices receive on average) plus one tile per group, at most `M`. The kernels' grids are sized
for the worst case (every row routed) and skip the tiles no group holds.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._compat import kernel_operands, mesh_platform

KERNEL_NAME = "axonn_grouped_matmul"
"""Prefix of the kernels' names in the compiled HLO, followed by `_<kind>_flops_<n>`."""

TILE_M, TILE_N, TILE_K = 64, 128, 64
"""Rows, output and contracted features of one program's tile (Triton blocks: powers of two)."""


# ----------------------------------------------------------------------------- the switch

def use_kernel(platform: str | None = None) -> bool:
    """Whether `grouped_matmul` runs the Pallas kernels: on a GPU mesh.

    Args:
      platform: the platform to decide for; None: the mesh in context's, else JAX's default
        backend.

    Returns:
      True on `gpu` / `cuda`.
    """
    platform = platform or mesh_platform() or jax.default_backend()
    return platform in ("gpu", "cuda")


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, *, routed_rows: int | None = None,
                   platform: str | None = None, interpret: bool = False) -> jax.Array:
    """`jax.lax.ragged_dot(x, w, sizes)`, computed only for the rows the groups hold.

    Args:
      x: `(M, K)` rows sorted by group.
      w: `(G, K, N)` one matrix per group (cast to `x.dtype`).
      sizes: `(G,)` int32 rows per group; `Σ sizes ≤ M`.
      routed_rows: rows routed on average, for the declared FLOPs only (None: `M`).
      platform: `gpu` or `cpu` to override the mesh's platform (`use_kernel`).
      interpret: run the Pallas kernels in interpret mode (any platform; for tests).

    Returns:
      `(M, N)` in `x.dtype`; rows past `Σ sizes` are zero. Differentiable in `x` and `w`.
      (The kernels take `K` and `N` padded with zeros to whole tiles.)
    """
    w = w.astype(x.dtype)
    if not (interpret or use_kernel(platform)):
        return jax.lax.ragged_dot(x, w, sizes)
    rows = x.shape[0] if routed_rows is None else routed_rows
    # Features padded with zeros to whole tiles (outside the custom VJP: JAX slices the
    # gradients back).
    k, n = w.shape[1:]
    k_pad, n_pad = _padded(k, TILE_K), _padded(n, TILE_N)
    x = jnp.pad(x, ((0, 0), (0, k_pad - k))) if k_pad > k else x
    w = jnp.pad(w, ((0, 0), (0, k_pad - k), (0, n_pad - n))) if (k_pad, n_pad) != (k, n) else w
    # Inside a shard_map the operands are cast to vary alike before the custom VJP, so JAX
    # transposes the casts (sums a cotangent over the axes its operand was invariant over).
    (x, w, sizes), _ = kernel_operands(x, w, sizes.astype(jnp.int32))
    y = _kernel_matmul(x, w, sizes, rows, interpret)
    return y[:, :n] if n_pad > n else y


def _tile(dim: int, tile: int) -> int:
    """The tile along a dimension of size `dim`: `tile`, or the smallest power of two ≥ `dim`
    (at least 16, Triton's smallest matmul block)."""
    return min(tile, max(16, 1 << (dim - 1).bit_length()))


def _padded(dim: int, tile: int) -> int:
    """`dim` rounded up to whole tiles of `_tile(dim, tile)`."""
    t = _tile(dim, tile)
    return -(-dim // t) * t


def declared_flops(m: int, k: int, n: int, groups: int, routed_rows: int) -> int:
    """FLOPs a grouped matmul of `(m, k)` rows by `(groups, k, n)` declares.

    Args:
      m: rows of the input.
      k: contracted features (padded to whole tiles, as the kernels run them).
      n: output features (padded likewise).
      groups: the groups (matrices).
      routed_rows: rows routed on average.

    Returns:
      `2·k·n` per routed row, one tile of rows of padding per group, at most every row.
    """
    return 2 * k * n * min(m, routed_rows + groups * TILE_M)


# ----------------------------------------------------------------------------- the VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_matmul(x, w, sizes, routed_rows, interpret):
    return _forward(x, w, sizes, routed_rows, interpret, transpose_w=False)


def _kernel_fwd(x, w, sizes, routed_rows, interpret):
    return _kernel_matmul(x, w, sizes, routed_rows, interpret), (x, w, sizes)


def _kernel_bwd(routed_rows, interpret, residuals, dy):
    x, w, sizes = residuals
    dx = _forward(dy, w, sizes, routed_rows, interpret, transpose_w=True)
    dw = _weight_grad(x, dy, sizes, routed_rows, interpret)
    return dx, dw, None


_kernel_matmul.defvjp(_kernel_fwd, _kernel_bwd)


# ----------------------------------------------------------------------------- tile tables

def _row_tiles(sizes: jax.Array, m: int, tile: int) -> jax.Array:
    """`(T, 4)` int32, one line per program along the rows: `(group, row block, first row, end
    row)`, the rows of `group` in row block `block` (of `tile` rows), for the `T = m/tile + G − 1`
    programs the worst case needs; lines past the groups' tiles have group `G` (skipped)."""
    groups = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    count = jnp.where(sizes > 0, (ends - 1) // tile - first + 1, 0)
    tile_ends = jnp.cumsum(count)
    t = jnp.arange(m // tile + groups - 1, dtype=jnp.int32)
    # The first group whose tiles end past t (a comparison count: jnp.searchsorted does not
    # trace inside a shard_map with varying manual axes on jax 0.12).
    group = jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32)
    g = jnp.minimum(group, groups - 1)
    block = first[g] + t - (tile_ends[g] - count[g])
    return jnp.stack([group, block, starts[g], ends[g]], axis=1).astype(jnp.int32)


def _pad_rows(x: jax.Array, tile: int) -> jax.Array:
    """`x` with zero rows appended up to a multiple of `tile` rows."""
    extra = -x.shape[0] % tile
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


def _mask_rows(y: jax.Array, sizes: jax.Array) -> jax.Array:
    """`y` with the rows past `Σ sizes` set to zero (no program writes them)."""
    rows = jnp.arange(y.shape[0])[:, None]
    return jnp.where(rows < jnp.sum(sizes), y, jnp.zeros((), y.dtype))


# ----------------------------------------------------------------------------- kernels

def _pallas():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl, plgpu


def _dot(a, b, *, trans_a=False, trans_b=False):
    """A tile product accumulated in float32 (full precision for float32 tiles)."""
    _, plgpu = _pallas()
    exact = a.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=not exact).astype(
        jnp.float32)


def _forward(x, w, sizes, routed_rows, interpret, *, transpose_w):
    """`(M, N)`: row `r` of group `g` times `w[g]` (`(K, N)`; with `transpose_w`, `w[g]ᵀ` of a
    `(G, N, K)` stack), zero past the groups."""
    pl, plgpu = _pallas()
    m, k = x.shape
    groups = w.shape[0]
    n = w.shape[1] if transpose_w else w.shape[2]
    bm, bn, bk = TILE_M, _tile(n, TILE_N), _tile(k, TILE_K)
    xp = _pad_rows(x, bm)
    table = _row_tiles(sizes, xp.shape[0], bm)

    def kernel(table_ref, x_ref, w_ref, o_ref):
        t, j = pl.program_id(0), pl.program_id(1)
        group = table_ref[t, 0]

        @pl.when(group < groups)
        def _():
            row0 = table_ref[t, 1] * bm
            rows = row0 + jnp.arange(bm)
            mask = ((rows >= table_ref[t, 2]) & (rows < table_ref[t, 3]))[:, None]
            cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

            def step(i, acc):
                inner = pl.ds(pl.multiple_of(i * bk, bk), bk)
                a = plgpu.load(x_ref.at[pl.ds(row0, bm), inner], mask=mask, other=0)
                if transpose_w:
                    return acc + _dot(a, w_ref[group, cols, inner], trans_b=True)
                return acc + _dot(a, w_ref[group, inner, cols])

            acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((bm, bn), jnp.float32))
            plgpu.store(o_ref.at[pl.ds(row0, bm), cols], acc.astype(o_ref.dtype), mask=mask)

    flops = declared_flops(m, k, n, groups, routed_rows)
    kind = "dx" if transpose_w else "fwd"
    (table, xp, w), out_struct = kernel_operands(table, xp, w)
    out = pl.pallas_call(
        kernel, out_shape=out_struct((xp.shape[0], n), x.dtype),
        grid=(table.shape[0], n // bn), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        name=f"{KERNEL_NAME}_{kind}_flops_{flops}")(table, xp, w)
    return _mask_rows(out[:m], sizes)


def _weight_grad(x, dy, sizes, routed_rows, interpret):
    """`(G, K, N)`: `Σ_{r in group g} x[r]ᵀ dy[r]`, zero for an empty group."""
    pl, plgpu = _pallas()
    m, k = x.shape
    n = dy.shape[1]
    groups = sizes.shape[0]
    bm, bn, bk = TILE_M, _tile(n, TILE_N), _tile(k, TILE_K)
    xp, dyp = _pad_rows(x, bm), _pad_rows(dy, bm)
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    bounds = jnp.stack([ends - sizes, ends], axis=1).astype(jnp.int32)

    def kernel(bounds_ref, x_ref, dy_ref, o_ref):
        g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        start, end = bounds_ref[g, 0], bounds_ref[g, 1]
        first = start // bm
        blocks = jnp.where(end > start, (end - 1) // bm - first + 1, 0)
        inner = pl.ds(pl.multiple_of(i * bk, bk), bk)
        cols = pl.ds(pl.multiple_of(j * bn, bn), bn)

        def step(b, acc):
            row0 = (first + b) * bm
            rows = row0 + jnp.arange(bm)
            mask = ((rows >= start) & (rows < end))[:, None]
            a = plgpu.load(x_ref.at[pl.ds(row0, bm), inner], mask=mask, other=0)
            d = plgpu.load(dy_ref.at[pl.ds(row0, bm), cols], mask=mask, other=0)
            return acc + _dot(a, d, trans_a=True)

        acc = jax.lax.fori_loop(0, blocks, step, jnp.zeros((bk, bn), jnp.float32))
        o_ref[g, inner, cols] = acc.astype(o_ref.dtype)

    flops = declared_flops(m, k, n, groups, routed_rows)
    (bounds, xp, dyp), out_struct = kernel_operands(bounds, xp, dyp)
    return pl.pallas_call(
        kernel, out_shape=out_struct((groups, k, n), x.dtype),
        grid=(groups, k // bk, n // bn), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        name=f"{KERNEL_NAME}_dw_flops_{flops}")(bounds, xp, dyp)
