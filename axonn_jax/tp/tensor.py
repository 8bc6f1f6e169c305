"""AxoNN's 2D/3D tensor-parallel matmul and vocabulary-parallel embedding, on global arrays.

Each function opens its own `shard_map`, manual over the tensor-parallel axes `('depth','row','col')`
and automatic over the rest, so it works at top level and nested inside the trainer's data-manual
step. Gradients come from a `jax.custom_vjp` whose backward opens its own shard_map with explicit
collectives (plain autodiff of a nested partial-manual shard_map does not lower in JAX 0.10).

Layout (Flax's `(in, out)` kernel layout; `transpose=True` swaps `row` and `col`):

    x       (batch, ..., in)   batch over (`depth`, `row`), `in` over `col`
    kernel  (in, out)          `in` over (`col`, `depth`), `out` over `row`
    bias    (out,)             over `row`, replicated over `col` and `depth`
    y       (batch, ..., out)  batch over (`depth`, `col`), `out` over `row`

The batch stays split over the axis that does not split an activation's features (Megatron's
sequence parallelism in AxoNN's 2D layout), so the work between two layers (activations, norms,
the attention core, residual adds) runs on each device's own rows only, and a normal layer's output
is exactly the input layout of a transposed one (and back). When the leading dim of `x` does not
divide over `depth` × `row` and `depth` × `col`, the layer falls back (at trace time, from the
shapes) to the replicated layout: x and y batch over `depth` only, replicated over the other axis.

A kernel stored `(out, in)` (`out_in=True`: an embedding table used as an output head, torch-style
weights) is split the same way with `depth` on its first dim: `out` over (`row`, `depth`), `in`
over `col`. Kernels with several input or output feature dims (attention's heads × head_dim) run
as the 2-D layer on the flattened features (`tp_dense_general`), the mesh axes on their leading dims.

Forward: all-gather the kernel over `depth` and x's rows over `row`, local matmul, reduce-scatter
the partial sums over `col` onto the rows (replicated layout: all-reduce over `col`).
Backward: all-gather the kernel over `depth` again (it is not kept) and dy's rows over `col`; the
weight gradient reads x's gathered rows kept from the forward (what the replicated layout keeps:
x whole over `row`); input gradient reduce-scattered (all-reduced) over `row`, kernel gradient
reduce-scattered over `depth`, bias gradient all-reduced over the axes whose devices hold different
rows (`depth`, and `col` when split). In ring terms the bytes of an all-reduce are those of its
reduce-scatter plus the next layer's all-gather, so the split layout moves what the replicated one
moved, keeps what it kept, and runs the work between the layers on each device's own rows.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from ..config import TENSOR_AXES, Axis
from .._compat import current_mesh, psum, psum_scatter, shard_map, varying_axes
from ..checks import check_choice
from ..collectives import Collective, ParameterShard, StepShape
from . import fp8
from .options import DEFAULT, KernelOptions

TP_DENSE_NAME = "tp_dense"
"""The `checkpoint_name` of every `tp_dense` output: what a remat policy may keep or offload."""
LAYER_CACHE = 256
"""Layer functions kept per process (`_dense_fn`, `_embed_fn`, `_conv_fn`): one per mesh and
layout traced, each holding its jitted function and executables. A model needs a few dozen per
mesh; the bound keeps a process that builds many meshes (tests, the planner's compiles) from
holding every one it ever traced."""


def feature_axes(transpose: bool) -> tuple[str, str]:
    """The mesh axes splitting a layer's input and output features.

    Args:
      transpose: a transposed layer (`row` and `col` swapped).

    Returns:
      `(axis splitting the input features, axis splitting the output features)`: `("col", "row")`,
      or `("row", "col")` when `transpose`.
    """
    return (Axis.ROW, Axis.COL) if transpose else (Axis.COL, Axis.ROW)


def kernel_spec(transpose: bool = False, out_in: bool = False) -> P:
    """PartitionSpec of a 2-D dense kernel.

    Args:
      transpose: a transposed layer (`feature_axes`).
      out_in: the kernel is stored `(out, in)` rather than `(in, out)`.

    Returns:
      For an `(in, out)` kernel: `in` over (in-axis, `depth`), `out` over out-axis; for an
      `(out, in)` kernel (`out_in`): `out` over (out-axis, `depth`), `in` over in-axis.
    """
    fin, fout = feature_axes(transpose)
    return P((fout, Axis.DEPTH), fin) if out_in else P((fin, Axis.DEPTH), fout)


def split_dims(dims, axes, sizes) -> tuple | None:
    """PartitionSpec entries splitting a multi-dim feature axis over mesh axes in flattened order.

    Each device holds one contiguous block of the flattened features, in the order the 2-D layer
    splits them: the axes fill the leading dims, moving to the next dim only once one is split
    down to size 1. Axes of size 1 stay on the current dim.

    Args:
      dims: the feature dims, e.g. `(heads, head_dim)`.
      axes: the mesh axes to split them over, outermost first.
      sizes: `{mesh axis: size}`.

    Returns:
      One PartitionSpec entry per dim (None, an axis, or a tuple of axes); None when `dims` is
      empty or no such split exists (e.g. 2 heads over `row` = 4).
    """
    if not dims:
        return None
    entries, left, i = [[] for _ in dims], list(dims), 0
    for axis in axes:
        n = sizes[axis]
        if n > 1:
            while i < len(dims) - 1 and left[i] == 1:
                i += 1
            if left[i] % n:
                return None
            left[i] //= n
        entries[i].append(axis)
    return tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries)


def dense_specs(in_dims, out_dims, sizes, transpose: bool = False, out_in: bool = False):
    """PartitionSpecs of a dense layer's kernel and bias with several feature dims.

    The kernel is split as `kernel_spec` over the flattened features (see `split_dims`), the bias
    like the layer's outputs.

    Args:
      in_dims: the input feature dims (a tuple).
      out_dims: the output feature dims (a tuple).
      sizes: `{mesh axis: size}`.
      transpose: a transposed layer (`feature_axes`).
      out_in: the kernel is `(*out_dims, *in_dims)` rather than `(*in_dims, *out_dims)`.

    Returns:
      `(kernel spec, bias spec)`, or None when the dims cannot be split so.
    """
    fin, fout = feature_axes(transpose)
    kin = split_dims(in_dims, (fin,) if out_in else (fin, Axis.DEPTH), sizes)
    kout = split_dims(out_dims, (fout, Axis.DEPTH) if out_in else (fout,), sizes)
    bias = split_dims(out_dims, (fout,), sizes)
    if kin is None or kout is None or bias is None:
        return None
    return P(*kout, *kin) if out_in else P(*kin, *kout), P(*bias)


def bias_spec(transpose: bool = False) -> P:
    """PartitionSpec of a `(out,)` bias: split like the layer's outputs.

    Args:
      transpose: a transposed layer (`feature_axes`).

    Returns:
      `P(out-axis)`: `row`, or `col` when `transpose`.
    """
    return P(feature_axes(transpose)[1])


def activation_spec(ndim: int, features: str | None, batch: bool = True) -> P:
    """PartitionSpec of a `(batch, ..., features)` activation with its batch over `depth`.

    Args:
      ndim: the activation's number of dims.
      features: the mesh axis splitting the last dim (None: replicated).
      batch: whether the leading dim is a batch split over `depth` (else replicated).

    Returns:
      The PartitionSpec: batch over `depth`, features over `features`.
    """
    return P(Axis.DEPTH if batch else None, *([None] * (ndim - 2)), features)


def _sm(f, mesh, in_specs, out_specs):
    return shard_map(f, mesh=current_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                     axis_names=set(TENSOR_AXES), check_vma=False)


def _varying_like(y, *like):
    """`y` marked varying over the enclosing manual axes (e.g. the trainer's `data`) that any of
    `like` varies over. The inner shard_maps run with check_vma=False, so their results lose that
    type, and a custom_vjp cotangent must carry exactly its primal's."""
    missing = tuple(sorted(frozenset().union(*map(varying_axes, like)) - varying_axes(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def _layer(mesh, local_forward, local_backward, specs, has_bias: bool):
    """A jitted `layer(x, w, b) -> y` with a custom VJP, both directions in their own shard_map
    over the tensor axes, on one device's blocks: `local_forward(x, w[, b]) -> (y, kept)`, where
    `kept` is what the backward needs of `x` (x itself, or its rows gathered for the matmul, so
    that the backward need not gather them again; a tuple whose first entry is those rows), and
    `local_backward(kept, w, dy) -> (dx, dw[, db])`. `specs`: the PartitionSpecs of (x, w, b, y,
    kept). Without a bias, `b` is a placeholder
    that gets no gradient."""
    x_spec, w_spec, b_spec, y_spec, kept_spec = specs

    def forward(x, w, b):
        args, in_specs = ((x, w, b), (x_spec, w_spec, b_spec)) if has_bias else \
            ((x, w), (x_spec, w_spec))
        y, kept = _sm(local_forward, mesh, in_specs, (y_spec, kept_spec))(*args)
        return _varying_like(y, *args), (jax.tree.map(lambda k: _varying_like(k, x), kept), w, b)

    def backward(res, dy):
        kept, w, b = res
        out_specs = (x_spec, w_spec, b_spec) if has_bias else (x_spec, w_spec)
        grads = _sm(local_backward, mesh, (kept_spec, w_spec, y_spec), out_specs)(kept, w, dy)
        like_x = jax.tree.leaves(kept)[0]  # kept may be x's quantized rows and their scales
        grads = tuple(_varying_like(g, p) for g, p in zip(grads, (like_x, w, b)))
        return grads if has_bias else (*grads, None)

    layer = jax.custom_vjp(lambda x, w, b: forward(x, w, b)[0])
    layer.defvjp(forward, backward)
    return jax.jit(layer)  # eager partial-manual shard_map is unsupported; under jit it inlines


def _untyped(a):
    """`a` (values unchanged) without the varying-axes type of the enclosing manual axes (the
    trainer's `data`). Inside an unchecked shard_map ops drop that type, so the primal of a VJP
    taken there and its transposes disagree with inputs that carry it; an op (a multiplication by
    one) on every input makes them agree."""
    return a * jnp.ones((), a.dtype)


def _gather_depth(w_shard):
    """The `(in/in-axis, out/out-axis)` block of the kernel from its `depth` shards."""
    return jax.lax.all_gather(w_shard, Axis.DEPTH, axis=0, tiled=True)


def _check_splits(layer: str, checks):
    """Raise a one-line ValueError for the first `(what, size, parts, axes)` of `checks` whose size
    does not divide into `parts` (the product of the mesh `axes`)."""
    for what, n, parts, axes in checks:
        if n % parts:
            raise ValueError(f"{layer}: {what} = {n} is not divisible by {axes} = {parts}")


def _check_dense(x, kernel, bias, mesh, transpose, out_in=False):
    fin, fout = feature_axes(transpose)
    sizes = dict(current_mesh(mesh).shape)
    layout = "(out, in)" if out_in else "(in, out)"
    n_in, n_out = (kernel.shape[::-1] if out_in else kernel.shape) if kernel.ndim == 2 else (None, None)
    if n_in is None or x.shape[-1] != n_in:
        raise ValueError(f"tp_dense: x {x.shape} does not match kernel {kernel.shape} {layout}")
    if x.ndim < 2:
        raise ValueError(f"tp_dense: x must be (batch, ..., features), got shape {x.shape}")
    depth = sizes[Axis.DEPTH]
    in_parts, out_parts = ((sizes[fin], f"{fin}"), (sizes[fout] * depth, f"{fout}×depth")) \
        if out_in else ((sizes[fin] * depth, f"{fin}×depth"), (sizes[fout], fout))
    checks = [("kernel in-features", n_in, *in_parts), ("kernel out-features", n_out, *out_parts),
              ("batch (leading dim of x)", x.shape[0], sizes[Axis.DEPTH], Axis.DEPTH)]
    _check_splits("tp_dense", checks)
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"tp_dense: bias {bias.shape} does not match kernel {kernel.shape} {layout}")


COLLECTIVE_MATMUL_CHOICES = ("auto", "on", "off")


def collective_matmuls_on(choice: str, platform: str, fp8: bool = False) -> bool:
    """Whether a step gathers rows in rings (`KernelOptions.collective_matmuls`).

    `auto` is on when the step compiles for GPUs without FP8: XLA:CPU runs collectives
    synchronously, so there the rings would only add the copies; with FP8 GEMMs there is less
    matmul to hide the permutes behind than the copies cost (`benchmarks/results/overlap_notes.md`).

    Args:
      choice: `on`, `off` or `auto`.
      platform: the platform the step compiles for (`gpu`, `cpu`, ...).
      fp8: whether the step runs FP8 GEMMs.

    Returns:
      Whether the rings are on.

    Raises:
      ValueError: `choice` is not one of `COLLECTIVE_MATMUL_CHOICES`.
    """
    check_choice("collective_matmul", choice, COLLECTIVE_MATMUL_CHOICES)
    return choice == "on" or (choice == "auto" and platform == "gpu" and not fp8)


def ring_gather(a, axis: str, n: int, block_fn):
    """`block_fn` over each row block of `a` gathered over `axis`, the blocks passed round a ring.

    Instead of gathering first, step s works on device (i + s) % n's block while the next block
    is in flight. Runs inside a shard_map manual over `axis`.

    Args:
      a: `(b, ...)`: this device's rows.
      axis: the manual mesh axis to gather over.
      n: the size of `axis`.
      block_fn: `block_fn(block, k) -> (rows, total)`: `rows` (a tuple of arrays with the
        block's leading dim) are placed at block k of the results, `total` (an array or None) is
        summed over the blocks.

    Returns:
      `(rows, total)`: the rows of all n blocks in the order of `axis`, each `(n·b, ...)`, and
      the sum of the totals.
    """
    i, b = jax.lax.axis_index(axis), a.shape[0]
    to_previous = [(j, (j - 1) % n) for j in range(n)]  # so device i next holds i + 1's block
    rows, total, block = None, None, a
    for step in range(n):
        nxt = jax.lax.ppermute(block, axis, to_previous) if step < n - 1 else None
        k = (i + step) % n
        part, t = block_fn(block, k)
        if rows is None:
            rows = tuple(jnp.zeros((n * b, *r.shape[1:]), r.dtype) for r in part)
        rows = tuple(jax.lax.dynamic_update_slice_in_dim(acc, r, k * b, axis=0)
                     for acc, r in zip(rows, part))
        total = t if total is None else total + t
        block = nxt
    return rows, total


def split_batch(x_shape, mesh, transpose: bool = False, replicated_rows: bool = False) -> bool:
    """Whether `tp_dense` keeps the batch split over the replicated axes.

    That is the sequence-parallel layout of the module docstring: the leading dim of `x` divides
    over `depth` times each of the layer's two feature axes, and not `replicated_rows`.
    Otherwise the layer falls back to the replicated layout.

    Args:
      x_shape: the shape of the layer's input `(batch, ..., in)`.
      mesh: a Mesh, None (the mesh in context), or `{axis: size}` (e.g.
        `ParallelConfig.as_dict()`: the communication model's count, without devices).
      transpose: a transposed layer (`feature_axes`).
      replicated_rows: `KernelOptions.replicated_rows`: force the replicated layout.

    Returns:
      True for the batch-split layout.
    """
    if replicated_rows:
        return False
    sizes = mesh if isinstance(mesh, Mapping) else dict(current_mesh(mesh).shape)
    return all(x_shape[0] % (sizes[Axis.DEPTH] * sizes[a]) == 0 for a in feature_axes(transpose))


def batch_spec(ndim: int, batch_axis: str | None, features: str | None) -> P:
    """PartitionSpec of a `(batch, ..., features)` activation with its batch split over two axes.

    Args:
      ndim: the activation's number of dims.
      batch_axis: the axis splitting the batch besides `depth` (None: `depth` only).
      features: the mesh axis splitting the last dim (None: replicated).

    Returns:
      The PartitionSpec: batch over (`depth`, `batch_axis`), features over `features`.
    """
    rows = (Axis.DEPTH, batch_axis) if batch_axis else Axis.DEPTH
    return P(rows, *([None] * (ndim - 2)), features)


@functools.lru_cache(maxsize=LAYER_CACHE)
def _dense_fn(mesh, transpose: bool, ndim: int, has_bias: bool, out_in: bool = False,
              split: bool = False, fp8_axes: tuple[str, ...] | None = None, rings: bool = False):
    gemm = _Fp8Gemm((*TENSOR_AXES, *fp8_axes)) if fp8_axes is not None else _PLAIN
    layer = _DenseLayer(dict(mesh.shape), transpose, ndim, has_bias, out_in, split, gemm, rings)
    return _layer(mesh, layer.forward, layer.backward, layer.specs(), has_bias)


class _DenseLayer:
    """The per-device forward and backward of one dense layer's configuration (`_dense_fn`'s
    arguments), for `_layer`'s shard_map and custom VJP.

    With `split`, x's batch is also over the output axis and y's over the input axis; otherwise
    both are replicated over the axis that does not split their features.
    """

    def __init__(self, sizes, transpose, ndim, has_bias, out_in, split, gemm, rings):
        self.fin, self.fout = feature_axes(transpose)
        self.transpose, self.sizes, self.ndim = transpose, sizes, ndim
        self.has_bias, self.out_in = has_bias, out_in
        self.split, self.gemm = split, gemm
        w_in, w_out = (1, 0) if out_in else (0, 1)  # the kernel dims holding in / out features
        self.rows = tuple(range(ndim - 1))
        self.dims = {"forward": (((ndim - 1,), (w_in,)), ((), ())),
                     "dx": (((ndim - 1,), (w_out,)), ((), ())),
                     "dw": ((self.rows, self.rows), ((), ()))}  # (dy_rows, x) when out_in
        # collective matmuls: a matmul whose rows are gathered over an axis of more than one device
        self.ring_over = {a for a in (self.fin, self.fout) if rings and split and sizes[a] > 1}

    def specs(self):
        """(x, kernel, bias, y, kept) PartitionSpecs; kept: x's gathered rows (batch over
        `depth` only when split) and, under FP8, the scales."""
        fin, fout, ndim = self.fin, self.fout, self.ndim
        x_spec = batch_spec(ndim, fout if self.split else None, fin)
        y_spec = batch_spec(ndim, fin if self.split else None, fout)
        kept_spec = self.gemm.keep(batch_spec(ndim, None, fin) if self.split else x_spec, P(), P())
        return (x_spec, kernel_spec(self.transpose, self.out_in), bias_spec(self.transpose), y_spec,
                kept_spec)

    def sum_rows(self, a, axis):
        """The partial sums over `axis`: scattered over the batch when split."""
        if self.split:
            return psum_scatter(a, axis, scatter_dimension=0, tiled=True)
        return psum(a, axis)

    def gather_matmul_scatter(self, a, matmul, gather_axis, scatter_axis):
        """(sum_rows(matmul(a's rows gathered over gather_axis)), those rows), the gather in a
        ring: one matmul per row block."""
        if gather_axis in self.ring_over:
            (y, a), _ = ring_gather(a, gather_axis, self.sizes[gather_axis],
                                    lambda blk, k: ((matmul(blk), blk), None))
        else:
            a = jax.lax.all_gather(a, gather_axis, axis=0, tiled=True) if self.split else a
            y = matmul(a)
        return self.sum_rows(y, scatter_axis), a

    def forward(self, x, w, *b):
        """y of this device's blocks, and what the backward keeps (x's gathered rows as the GEMM
        reads them)."""
        gemm = self.gemm
        # Either layout keeps `depth` on the kernel's first dim: one all-gather serves both.
        (qx, sx), (qw, sw) = gemm.operand(x, "x"), gemm.operand(w, "w")
        w_full = (_gather_depth(qw), sw)
        y, rows = self.gather_matmul_scatter(
            qx, lambda a: gemm.dot((a, sx), w_full, self.dims["forward"], x.dtype), self.fout,
            self.fin)
        return (y + b[0] if b else y), gemm.keep(rows, sx, sw)

    def weight_grad(self, dy_rows, x_rows, dtype):
        """dw of these rows (operands `(array, scale)`), as `dtype`."""
        operands = (dy_rows, x_rows) if self.out_in else (x_rows, dy_rows)
        return self.gemm.dot(*operands, self.dims["dw"], dtype)

    def scatter_grads(self, dw, dy):
        """dw summed and scattered over `depth`; db from dy (without a bias: dw alone)."""
        dw = psum_scatter(dw, Axis.DEPTH, scatter_dimension=0, tiled=True)
        if not self.has_bias:
            return (dw,)
        # devices of `depth` (and of `fin` when split) hold different rows of the batch
        over = (Axis.DEPTH, self.fin) if self.split else Axis.DEPTH
        return dw, psum(jnp.sum(dy, axis=self.rows), over)

    def backward(self, kept, w, dy):
        """(dx, dw[, db]) of this device's blocks from the forward's `kept`."""
        x_rows, sx, sw = self.gemm.unkeep(kept)
        qdy, sdy = self.gemm.operand(dy, "dy")
        w_full = (_gather_depth(self.gemm.operand(w, "w", sw)[0]), sw)
        dx_of = lambda a: self.gemm.dot((a, sdy), w_full, self.dims["dx"], dy.dtype)  # noqa: E731
        if self.fin in self.ring_over:
            dx, dw = self._ring_backward(qdy, sdy, x_rows, sx, dx_of)
            dw = dw.astype(w.dtype)
        else:
            dx, dy_rows = self.gather_matmul_scatter(qdy, dx_of, self.fin, self.fout)
            dw = self.weight_grad((dy_rows, sdy), (x_rows, sx), w.dtype)
        return dx, *self.scatter_grads(dw, dy)

    def _ring_backward(self, qdy, sdy, x_rows, sx, dx_of):
        """(dx, float32 dw): dy's blocks go round the ring over the input axis, each block's
        share of dw computed on its way."""
        b = qdy.shape[0]
        (dx,), dw = ring_gather(qdy, self.fin, self.sizes[self.fin], lambda blk, k: (
            (dx_of(blk),), self.weight_grad(
                (blk, sdy), (jax.lax.dynamic_slice_in_dim(x_rows, k * b, b, axis=0), sx),
                jnp.float32)))
        return self.sum_rows(dx, self.fout), dw


class _PlainGemm:
    """The dense layer's GEMMs in the operands' own dtype: an operand is `(array, None)`."""

    @staticmethod
    def operand(a, role: str, scale=None):
        return a, None

    @staticmethod
    def dot(a, b, dimension_numbers, dtype):
        # an f32 `dtype` (a ring's weight-gradient blocks) accumulates and returns f32
        return jax.lax.dot_general(a[0], b[0], dimension_numbers,
                                   preferred_element_type=dtype if dtype == jnp.float32 else None)

    @staticmethod
    def keep(rows, sx, sw):
        return rows

    @staticmethod
    def unkeep(kept):
        return kept, None, None


_PLAIN = _PlainGemm()


class _Fp8Gemm:
    """The dense layer's GEMMs in FP8 (`tp.fp8`): x and the kernel quantized to e4m3, dy to
    e5m2, each with its global current scale (amax over `axes`); an operand is `(float8 array,
    scale)`, so the quantized rows and kernel shards are what the all-gathers and rings move, and
    each GEMM reads float8 operands (`fp8.dot`). The forward keeps x's quantized rows (float8)
    with the two scales for the backward. The bias gradient sums dy as it came."""

    def __init__(self, axes: tuple[str, ...]):
        self.axes = axes

    def operand(self, a, role: str, scale=None):
        dtype = fp8.BACKWARD if role == "dy" else fp8.FORWARD
        s = fp8.scale(a, dtype, self.axes) if scale is None else scale
        return fp8.quantize(a, dtype, s), s

    @staticmethod
    def dot(a, b, dimension_numbers, dtype):
        return fp8.dot(a, b, dimension_numbers, dtype)

    @staticmethod
    def keep(rows, sx, sw):
        return rows, sx, sw

    @staticmethod
    def unkeep(kept):
        return kept


def tp_dense(x, kernel, bias=None, mesh=None, transpose: bool = False, out_in: bool = False, *,
             options: KernelOptions = DEFAULT):
    """`x @ kernel + bias` with AxoNN's 2D/3D tensor-parallel algorithm (see the module docstring).

    All arrays are global, placed by the shard_map's in_specs (GSPMD re-lays them out if they
    arrive otherwise).

    Args:
      x: `(batch, ..., in)`: batch over (`depth`, `row`), `in` over `col` (`row` and `col`
        swapped when `transpose`; batch over `depth` only in the replicated layout).
      kernel: `(in, out)`, or `(out, in)` when `out_in` (computing `x @ kernel.T`); split as
        `kernel_spec`.
      bias: `(out,)` over the output axis, or None.
      mesh: a mesh with axes `depth, row, col` (None: the mesh in context; inside an enclosing
        shard_map its context mesh is used).
      transpose: swap `row` and `col`.
      out_in: the kernel is stored `(out, in)`.
      options: the kernel's modes (FP8 GEMMs, gathers in rings, the replicated layout), static:
        each choice traces its own program.

    Returns:
      `(batch, ..., out)`: features over `row` (`col` when `transpose`), batch over (`depth`,
      `col`) (`row`), or over `depth` only when `split_batch` is False.

    Raises:
      ValueError: the shapes do not match or do not divide over the mesh axes.
    """
    _check_dense(x, kernel, bias, mesh, transpose, out_in)
    # Keyed by the mesh in context: a jitted function traced at top level must not be reused inside
    # the data-manual step (its shard_maps must name the enclosing abstract mesh).
    fp8_axes = fp8.amax_axes(x, kernel) if options.fp8 else None
    fn = _dense_fn(current_mesh(mesh), bool(transpose), x.ndim, bias is not None, bool(out_in),
                   split_batch(x.shape, mesh, transpose, options.replicated_rows), fp8_axes,
                   options.collective_matmuls)
    # custom_vjp needs array arguments; an unused bias slot gets a zero-size placeholder.
    y = fn(x, kernel, jnp.zeros((0,), x.dtype) if bias is None else bias)
    return checkpoint_name(y, TP_DENSE_NAME)


def tp_dense_general(x, kernel, bias=None, mesh=None, transpose: bool = False, n_in: int = 1,
                     out_in: bool = False, *, options: KernelOptions = DEFAULT):
    """`tp_dense` contracting the last `n_in` dims of `x` with a kernel of several feature dims.

    The features are flattened to run the 2-D layer and the output reshaped; a kernel placed by
    `dense_specs` (mesh axes on the leading feature dims) flattens to the 2-D layout without
    communication. E.g. attention's query projection, kernel `(d_model, heads, head_dim)`: heads
    over `row`, output `(batch, seq, heads, head_dim)` with heads over `row`.

    Args:
      x: `(batch, ..., *in_dims)`, laid out as `tp_dense`'s `x` over the flattened features.
      kernel: `(*in_dims, *out_dims)`, or `(*out_dims, *in_dims)` when `out_in`.
      bias: `out_dims`, or None.
      mesh: as `tp_dense`'s.
      transpose: swap `row` and `col`.
      n_in: how many trailing dims of `x` are input features.
      out_in: the kernel's output dims come first.
      options: as `tp_dense`'s.

    Returns:
      `(*x.shape[:-n_in], *out_dims)`, laid out as `tp_dense`'s output over the flattened
      features.

    Raises:
      ValueError: the kernel's input dims do not match `x`'s last `n_in` dims (and `tp_dense`'s
        checks).
    """
    in_dims = x.shape[x.ndim - n_in:]
    n_out = kernel.ndim - n_in
    out_dims = kernel.shape[:n_out] if out_in else kernel.shape[n_in:]
    if (kernel.shape[n_out:] if out_in else kernel.shape[:n_in]) != in_dims:
        raise ValueError(f"tp_dense: x {x.shape} does not match kernel {kernel.shape} "
                         f"({'out..., in...' if out_in else 'in..., out...'}, {n_in} input dims)")
    n, m = math.prod(in_dims), math.prod(out_dims)
    y = tp_dense(x.reshape(*x.shape[:x.ndim - n_in], n), kernel.reshape((m, n) if out_in else (n, m)),
                 None if bias is None else bias.reshape(-1), mesh, transpose, out_in,
                 options=options)
    return y.reshape(*y.shape[:-1], *out_dims)


def _row_gathers(axis: str, n: int, rows_bytes: float, placed_bytes: float, count: int,
                 rings: bool, **flags):
    """The gathers of `count` matmuls' input rows (`rows_bytes` gathered) over `axis` (`n`
    devices): an all-gather each, or with `rings` n − 1 permutes of one device's block, each
    block's product and rows (`placed_bytes` in all per ring) read and written into place."""
    if rings and n > 1:
        return [Collective("collective-permute", (axis,), rows_bytes / n, count * (n - 1),
                           copied=2 * placed_bytes / (n - 1), **flags)]
    return [Collective("all-gather", (axis,), rows_bytes, count, **flags)]


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """The collectives and parameter shards of `tp_dense` layers, as a model declares them.

    A `collectives.Part`: `count` layers of `fan_in` → `fan_out` features in each of the `layers`
    blocks one device holds.

    Attributes:
      layers: blocks one device holds; 0: a layer outside the stack, run once per step on the
        last stage (the output head).
      gathers: per block, the input gathers of the batch-split layout (layers reading one input,
        a GPT's query, key and value projections, share one); None: one per layer.
      table: the kernel is the vocabulary-parallel token table (a tied head, `tp_attend`'s matmul
        laid out by GSPMD: no parameters of its own, gradient all-reduced over depth).
    """

    name: str
    fan_in: int
    fan_out: int
    transpose: bool
    count: int = 1
    layers: int = 0
    bias: bool = True
    gathers: int | None = None
    table: bool = False
    reused: bool = False
    """The block's backward reads this layer's output (it enters attention, an activation
    function, or a norm of the residual stream within the block): `--remat full` recomputes it,
    its output reduce-scatter included. XLA drops the recomputation of an output the backward
    does not read (the block's last projection, whose sum leaves the block as its output)."""

    def collectives(self, step: StepShape) -> list[Collective]:
        """The collectives of AxoNN's 3D dense layer (module docstring).

        Kernels split over (in, out) axes and over depth, activations' features over one axis
        and (`step.split`) their rows over the other.
        """
        g, cb = step.grid, step.compute_bytes
        wb = step.gathered_bytes
        stacked = self.layers > 0
        count = self.count * self.layers if stacked else self.count
        fin, fout = feature_axes(self.transpose)
        nin, nout = getattr(g, fin), getattr(g, fout)
        block = self.fan_in * self.fan_out / (nin * nout)  # kernel block after the depth gather
        mm_flops = 2 * step.tokens * block  # one of the three matmuls of this layer on one device
        x_bytes = step.tokens * self.fan_in / nin * cb
        y_bytes = step.tokens * self.fan_out / nout * cb
        gathers = count if self.gathers is None or not stacked else self.gathers * self.layers
        # layers reading one input share its gather (split); XLA:GPU adds the partial input
        # gradients of the layers that read one input before reducing them (its
        # reassociation), so one input-gradient sum per input gather there
        input_sums = gathers if step.platform == "gpu" else count
        if step.split:
            out = [
                # forward: x's rows gathered over the output axis (once per input), partial sums
                # reduce-scattered onto the rows over the input axis
                # (a ring places the product's partial sums and the gathered rows)
                *_row_gathers(fout, nout, x_bytes, x_bytes + y_bytes, gathers, step.rings,
                              stage_forward=stacked, rematerialized=stacked),
                Collective("reduce-scatter", (fin,), y_bytes, count, stage_forward=stacked,
                           recomputed_in_full=stacked and self.reused),
                # backward: dy's rows gathered over the input axis, the input gradient
                # reduce-scattered over the output axis (the weight gradient reads x's rows kept
                # from the forward; a ring places the input gradient's partial sums)
                *_row_gathers(fin, nin, y_bytes, x_bytes, count, step.rings),
                Collective("reduce-scatter", (fout,), x_bytes, input_sums, overlappable=mm_flops),
            ]
        else:
            out = [
                # forward: partial sums over the input axis (the head runs only in the last
                # stage's backward tick, so it is not recomputed; `--remat full` recomputes those
                # the backward reads); backward: input gradient over the output axis (hidden
                # behind the weight-gradient matmul)
                Collective("all-reduce", (fin,), y_bytes, count, stage_forward=stacked,
                           recomputed_in_full=stacked and self.reused),
                Collective("all-reduce", (fout,), x_bytes, input_sums, overlappable=mm_flops),
            ]
        out += [
            # the kernel gathered over depth; its gradient reduce-scattered over depth (a tied
            # head's, laid out by GSPMD, all-reduced)
            Collective("all-gather", (Axis.DEPTH,), block * wb, count, stage_forward=stacked,
                       per_microbatch=True, loop_invariant=not stacked),
            Collective("all-reduce" if self.table else "reduce-scatter", (Axis.DEPTH,), block * wb,
                       count, per_microbatch=True),
        ]
        if stacked:
            # The blocks' backward runs in its own scan loop, which gathers the kernel again; the
            # head's forward and backward share one computation, where XLA reuses the gather.
            out.append(Collective("all-gather", (Axis.DEPTH,), block * wb, count,
                                  per_microbatch=True))
        if self.bias:
            # the bias is replicated over depth (and, split, the input axis), whose devices saw
            # different tokens; its gradient is summed in the compute dtype on XLA:GPU
            out.append(Collective("all-reduce", (Axis.DEPTH, fin) if step.split else (Axis.DEPTH,),
                                  self.fan_out / nout * wb, count, per_microbatch=True))
        return out

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The kernel and bias shards of the layers.

        The kernel `(in, out)`: in over in-axis·depth, out over out-axis (stacked over the
        stage's blocks); the bias split like the outputs, whole over depth.
        """
        g = step.grid
        fin, fout = feature_axes(self.transpose)
        kernel = ((fin, Axis.DEPTH), (fout,))
        tp = g.depth * g.row * g.col
        if not self.layers:  # outside the stack: every pipeline stage holds it
            out = [] if self.table else \
                [ParameterShard(self.fan_in * self.fan_out / tp, 2, kernel, True)]
            if self.bias:
                out.append(ParameterShard(self.fan_out / getattr(g, fout), 1, ((fout,),), True))
            return out
        n = self.layers
        out = [ParameterShard(n * self.fan_in * self.fan_out / tp, 3, kernel)] * self.count
        if self.bias:
            out += [ParameterShard(n * self.fan_out / getattr(g, fout), 2, ((fout,),))] * self.count
        return out


def embed_spec() -> P:
    """PartitionSpec of a `(vocab, features)` table.

    Returns:
      `P(("row", "depth"), "col")`: vocab over (`row`, `depth`), features over `col`.
    """
    return P((Axis.ROW, Axis.DEPTH), Axis.COL)


def _check_table(table, sizes, name):
    vocab, features = table.shape
    checks = [("vocabulary", vocab, sizes[Axis.ROW] * sizes[Axis.DEPTH], "row×depth"),
              ("features", features, sizes[Axis.COL], Axis.COL)]
    for what, n, parts, axes in checks:
        if n % parts:
            raise ValueError(f"{name}: {what} = {n} is not divisible by {axes} = {parts}")


def table_divides(shape, mesh) -> bool:
    """Whether a `(vocab, features)` table can be split as `embed_spec` on `mesh`.

    Args:
      shape: the table's shape.
      mesh: a mesh with axes `depth, row, col`.

    Returns:
      True when the shape is 2-D, vocab divides over `row` × `depth` and features over `col`.
    """
    sizes = dict(mesh.shape)
    return len(shape) == 2 and shape[0] % (sizes[Axis.ROW] * sizes[Axis.DEPTH]) == 0 \
        and shape[1] % sizes[Axis.COL] == 0


def _vocab_slice(tokens, offset, size):
    """Where `tokens` fall in the vocabulary slice `[offset, offset + size)`: (indices into the
    slice, clipped; whether each token is in it)."""
    local = tokens - offset
    hit = (local >= 0) & (local < size)
    return jnp.clip(local, 0, size - 1), hit


def _lookup(table, idx, hit):
    """`table[idx]`, zero where not `hit`."""
    return jnp.where(hit[..., None], table[idx], 0)


def _scatter_rows(idx, hit, dy, rows: int):
    """The `(rows, features)` gradient of a lookup: `dy` added at `idx`, where `hit`."""
    dy = jnp.where(hit[..., None], dy, 0).reshape(-1, dy.shape[-1])
    return jnp.zeros((rows, dy.shape[-1]), dy.dtype).at[idx.reshape(-1)].add(dy)


def looks_up_rows(vocab: int, tokens: int, sizes: Mapping[str, int]) -> bool:
    """Whether `tp_embed` exchanges looked-up rows over `depth` rather than the table.

    It does when the `depth` group's tokens are fewer than the table rows one `row` device would
    gather (`vocab / row`). Both kinds of exchange carry `features / col` values per row.

    Args:
      vocab: the table's rows.
      tokens: the tokens one device looks up.
      sizes: `{mesh axis: size}`, with `depth` and `row`.

    Returns:
      True when `depth` > 1 and `depth · tokens < vocab // row`.
    """
    return sizes[Axis.DEPTH] > 1 and sizes[Axis.DEPTH] * tokens < vocab // sizes[Axis.ROW]


def _table_exchange(batched: bool):
    """`tp_embed`'s per-device parts when the table is gathered over `depth`: (forward, backward)."""
    def forward(tokens, table):
        table = _gather_depth(table)
        start = jax.lax.axis_index(Axis.ROW) * table.shape[0]
        idx, hit = _vocab_slice(tokens, start, table.shape[0])
        return psum(_lookup(table, idx, hit), Axis.ROW)

    def backward(tokens, dy, table_shard):
        vocab_local = table_shard.shape[0] * jax.lax.axis_size(Axis.DEPTH)
        idx, hit = _vocab_slice(tokens, jax.lax.axis_index(Axis.ROW) * vocab_local, vocab_local)
        dt = _scatter_rows(idx, hit, dy, vocab_local)
        if batched:  # depth devices saw different rows of the batch
            return psum_scatter(dt, Axis.DEPTH, scatter_dimension=0, tiled=True)
        n = table_shard.shape[0]  # every depth device saw all tokens: keep its own block
        return jax.lax.dynamic_slice_in_dim(dt, jax.lax.axis_index(Axis.DEPTH) * n, n, axis=0)

    return forward, backward


def _row_exchange():
    """`tp_embed`'s per-device parts when looked-up rows cross `depth` instead of the table
    (`looks_up_rows`): every device looks up the `depth` group's tokens in its own table shard
    and a reduce-scatter over `depth` returns each device its rows; the backward all-gathers the
    group's output gradients and adds the rows each shard owns. (forward, backward)."""
    def own_slice(tokens, table_shard):
        n = table_shard.shape[0]
        shard = jax.lax.axis_index(Axis.ROW) * jax.lax.axis_size(Axis.DEPTH) \
            + jax.lax.axis_index(Axis.DEPTH)
        group = jax.lax.all_gather(tokens, Axis.DEPTH, axis=0, tiled=True)
        return _vocab_slice(group, shard * n, n)

    def forward(tokens, table_shard):
        idx, hit = own_slice(tokens, table_shard)
        rows = psum_scatter(_lookup(table_shard, idx, hit), Axis.DEPTH, scatter_dimension=0,
                            tiled=True)
        return psum(rows, Axis.ROW)

    def backward(tokens, dy, table_shard):
        idx, hit = own_slice(tokens, table_shard)
        group_dy = jax.lax.all_gather(dy, Axis.DEPTH, axis=0, tiled=True)
        return _scatter_rows(idx, hit, group_dy, table_shard.shape[0])

    return forward, backward


@functools.lru_cache(maxsize=LAYER_CACHE)
def _embed_fn(mesh, ndim: int, batched: bool, rows_cross: bool = False):
    t_spec = P(Axis.DEPTH if batched else None, *([None] * (ndim - 1)))
    y_spec = activation_spec(ndim + 1, Axis.COL, batch=batched)
    local_forward, local_backward = _row_exchange() if rows_cross else _table_exchange(batched)

    @jax.custom_vjp
    def embed(tokens, table):
        y = _sm(local_forward, mesh, (t_spec, embed_spec()), y_spec)(tokens, table)
        return _varying_like(y, tokens, table)

    def fwd(tokens, table):
        return embed(tokens, table), (tokens, table)

    def bwd(res, dy):
        tokens, table = res
        dt = _sm(local_backward, mesh, (t_spec, y_spec, embed_spec()), embed_spec())(tokens, dy, table)
        return None, _varying_like(dt.astype(table.dtype), table)

    embed.defvjp(fwd, bwd)
    return jax.jit(embed)


def tp_embed(tokens, table, mesh=None):
    """Vocabulary-parallel lookup `table[tokens]`.

    Each `row` device looks up the tokens of its vocabulary slice and an all-reduce over `row`
    combines them. Over `depth`, whichever is smaller crosses the links (`looks_up_rows`): the
    table's `depth` shards (gathered for the lookup, the gradient reduce-scattered back), or the
    looked-up rows of the `depth` group's tokens (reduce-scattered to their devices, their
    gradients all-gathered), as for a vocabulary larger than the group's tokens.

    Args:
      tokens: int `(batch, ...)`, batch over `depth`; a 1-D `(n,)` array (e.g. positions) is
        taken as unbatched and replicated.
      table: `(vocab, features)`, vocab over (`row`, `depth`), features over `col`.
      mesh: the mesh (default: the current one).

    Returns:
      `(*tokens.shape, features)`: batch over `depth`, features over `col`.
    """
    sizes = dict(current_mesh(mesh).shape)
    batched = tokens.ndim >= 2
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tp_embed: tokens must be integers, got {tokens.dtype}")
    _check_table(table, sizes, "tp_embed")
    if batched and tokens.shape[0] % sizes[Axis.DEPTH]:
        raise ValueError(f"tp_embed: batch (leading dim of tokens) = {tokens.shape[0]} is not "
                         f"divisible by depth = {sizes[Axis.DEPTH]}")
    rows_cross = batched and looks_up_rows(table.shape[0], tokens.size // sizes[Axis.DEPTH], sizes)
    return _embed_fn(current_mesh(mesh), tokens.ndim, batched, rows_cross)(tokens, table)


def tp_attend(x, table, mesh=None, *, options: KernelOptions = DEFAULT):
    """`x @ table.T`: the logits of a tied output head against a vocabulary-parallel table.

    This is `tp_dense` with the table as an `(out, in)` kernel: no copy or re-layout of the
    table. The table's gradient is reduce-scattered over `depth`.

    Args:
      x: `(batch, ..., features)`, features over `col`, batch over `depth`.
      table: `(vocab, features)` placed as `embed_spec` (vocab over (`row`, `depth`), features
        over `col`).
      mesh: the mesh (default: the current one).
      options: `tp_dense`'s.

    Returns:
      `(batch, ..., vocab)`, vocab over `row`.

    Raises:
      ValueError: the table does not divide over the mesh (and `tp_dense`'s checks).
    """
    _check_table(table, dict(current_mesh(mesh).shape), "tp_attend")
    return tp_dense(x, table, None, mesh, transpose=False, out_in=True, options=options)


@dataclasses.dataclass(frozen=True)
class Table:
    """The collectives and parameter shard of a vocabulary-parallel table (`tp_embed`).

    A `collectives.Part` of `rows` × `features`: rows over row·depth, features over col,
    gathered over depth for the lookup like a dense kernel.

    Attributes:
      batched: looks up the step's tokens; else the `seq_len` positions (a learned position
        table), broadcast over the batch.
    """

    rows: int
    features: int
    batched: bool = True

    def collectives(self, step: StepShape) -> list[Collective]:
        """The lookup's sums over `row`, its exchange over `depth` and the gradient's sums."""
        g, cb = step.grid, step.compute_bytes
        shard = self.rows * self.features / (g.row * g.col) * step.gathered_bytes
        if self.batched:
            lookups = step.tokens * self.features / g.col * cb
            out = [
                # each row shard looks up the ids it owns (zeros elsewhere); the sum over row
                # completes the embeddings (XLA:GPU makes the sum of rows that the batch-split
                # layout then splits over row a reduce-scatter; measured on H100)
                Collective("reduce-scatter" if step.split and step.platform == "gpu"
                           else "all-reduce", (Axis.ROW,), lookups, stage_forward=True),
                *self._depth_exchange(step, shard, lookups),
            ]
            if step.split:  # the lookup's output is replicated over row: GSPMD gathers its
                out.append(Collective("all-gather", (Axis.ROW,), lookups))  # gradient's rows
            return out
        return [
            Collective("all-gather", (Axis.DEPTH,), shard, stage_forward=True, per_microbatch=True,
                       loop_invariant=True),
            # the lookup sum, once per position; the gradient is first summed over the batch,
            # which depth splits
            Collective("all-reduce", (Axis.ROW,), step.seq_len * self.features / g.col * cb,
                       stage_forward=True, per_microbatch=True, loop_invariant=True),
            Collective("all-reduce", (Axis.DEPTH, Axis.ROW) if step.split else (Axis.DEPTH,),
                       step.seq_len * self.features / g.col * step.gathered_bytes,
                       per_microbatch=True),
        ]

    def _depth_exchange(self, step: StepShape, shard: float, lookups: float) -> list[Collective]:
        """What crosses `depth` for a batched lookup (`looks_up_rows`): the table's shards
        gathered and its gradient reduce-scattered, or the depth group's ids gathered, its
        looked-up rows reduce-scattered and their gradients gathered."""
        g = step.grid
        tokens = step.tokens / step.microbatches  # one lookup's, per device
        if looks_up_rows(self.rows, tokens, {Axis.DEPTH: g.depth, Axis.ROW: g.row}):
            group = g.depth * lookups  # the depth group's rows, per step
            return [Collective("all-gather", (Axis.DEPTH,), g.depth * step.tokens * 4,
                               stage_forward=True),
                    Collective("reduce-scatter", (Axis.DEPTH,), group, stage_forward=True),
                    Collective("all-gather", (Axis.DEPTH,), group)]
        return [Collective("all-gather", (Axis.DEPTH,), shard, stage_forward=True,
                           per_microbatch=True, loop_invariant=True),
                # the table's gradient scattered back over depth
                Collective("reduce-scatter", (Axis.DEPTH,), shard, per_microbatch=True)]

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The table's shard: rows over (`row`, `depth`), features over `col`."""
        g = step.grid
        return [ParameterShard(self.rows * self.features / (g.depth * g.row * g.col), 2,
                               ((Axis.ROW, Axis.DEPTH), (Axis.COL,)), True)]


class ConvSpec(tuple):
    """A channels-last convolution's window arithmetic, hashable (it keys the compiled function).

    Attributes:
      transposed: `lax.conv_transpose` rather than `lax.conv_general_dilated`.
      strides: the window strides.
      padding: a lax padding string or a tuple of `(low, high)` pairs.
      lhs_dilation: input dilation, normal convolutions only.
      rhs_dilation: kernel dilation.
      transpose_kernel: a transposed convolution's kernel stored `(*window, out, in)`, as
        `lax.conv_transpose` takes it.
    """

    def __new__(cls, transposed: bool, strides, padding, lhs_dilation, rhs_dilation,
                transpose_kernel: bool = False):
        padding = padding if isinstance(padding, str) else tuple(tuple(map(int, p)) for p in padding)
        return super().__new__(cls, (bool(transposed), tuple(strides), padding, tuple(lhs_dilation),
                                     tuple(rhs_dilation), bool(transpose_kernel)))

    transposed = property(lambda s: s[0])
    strides = property(lambda s: s[1])
    padding = property(lambda s: s[2])
    lhs_dilation = property(lambda s: s[3])
    rhs_dilation = property(lambda s: s[4])
    transpose_kernel = property(lambda s: s[5])

    def apply(self, x, w):
        """The convolution of `x` with `w` on one device.

        Args:
          x: `(batch, *spatial, in)`.
          w: `(*window, in, out)`, or `(*window, out, in)` when `transpose_kernel`.

        Returns:
          `(batch, *spatial', out)`.
        """
        if self.transposed:
            return jax.lax.conv_transpose(x, w, self.strides, self.padding,
                                          rhs_dilation=self.rhs_dilation,
                                          transpose_kernel=self.transpose_kernel)
        n = x.ndim
        numbers = jax.lax.ConvDimensionNumbers((0, n - 1, *range(1, n - 1)),
                                               (n - 1, n - 2, *range(n - 2)), (0, n - 1, *range(1, n - 1)))
        return jax.lax.conv_general_dilated(x, w, self.strides, self.padding, self.lhs_dilation,
                                            self.rhs_dilation, numbers)


def conv_kernel_spec(ndim: int, transpose: bool = False, transpose_kernel: bool = False) -> P:
    """PartitionSpec of a `(*window, in, out)` convolution kernel, split as `kernel_spec`.

    Args:
      ndim: the kernel's number of dims.
      transpose: a transposed layer (`feature_axes`).
      transpose_kernel: the kernel is `(*window, out, in)`; `depth` stays on its second-to-last
        dim.

    Returns:
      The window unsplit, `in` over (in-axis, `depth`), `out` over out-axis.
    """
    fin, fout = feature_axes(transpose)
    a, b = (fout, fin) if transpose_kernel else (fin, fout)
    return P(*([None] * (ndim - 2)), (a, Axis.DEPTH), b)


def _check_conv(x, kernel, bias, mesh, transpose, spec: ConvSpec):
    fin, fout = feature_axes(transpose)
    sizes = dict(current_mesh(mesh).shape)
    if kernel.ndim != x.ndim or kernel.ndim < 3:
        raise ValueError(f"tp_conv: x {x.shape} must be (batch, *spatial, in) and kernel "
                         f"{kernel.shape} (*window, in, out) with as many spatial dims")
    n_in, n_out = kernel.shape[-2:][::-1] if spec.transpose_kernel else kernel.shape[-2:]
    if x.shape[-1] != n_in:
        raise ValueError(f"tp_conv: x {x.shape} does not match kernel {kernel.shape}")
    a, b = (n_out, n_in) if spec.transpose_kernel else (n_in, n_out)
    na, nb = ((fout, fin) if spec.transpose_kernel else (fin, fout))
    checks = [("kernel dim -2", a, sizes[na] * sizes[Axis.DEPTH], f"{na}×depth"),
              ("kernel dim -1", b, sizes[nb], nb), ("input channels", n_in, sizes[fin], fin),
              ("batch (leading dim of x)", x.shape[0], sizes[Axis.DEPTH], Axis.DEPTH)]
    _check_splits("tp_conv", checks)
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"tp_conv: bias {bias.shape} does not match kernel {kernel.shape}")


@functools.lru_cache(maxsize=LAYER_CACHE)
def _conv_fn(mesh, transpose: bool, ndim: int, has_bias: bool, spec: ConvSpec, split: bool):
    fin, fout = feature_axes(transpose)
    x_spec = batch_spec(ndim, fout if split else None, fin)
    y_spec = batch_spec(ndim, fin if split else None, fout)
    kept_spec = activation_spec(ndim, fin)
    w_spec, b_spec = conv_kernel_spec(ndim, transpose, spec.transpose_kernel), bias_spec(transpose)

    def gather(w):  # the kernel's `depth` shards sit on its second-to-last dim
        return jax.lax.all_gather(w, Axis.DEPTH, axis=ndim - 2, tiled=True)

    def gather_rows(a, axis):
        return jax.lax.all_gather(a, axis, axis=0, tiled=True) if split else a

    def sum_rows(a, axis):
        return psum_scatter(a, axis, scatter_dimension=0, tiled=True) if split else psum(a, axis)

    def local_forward(x, w, *b):
        x = gather_rows(x, fout)
        y = sum_rows(spec.apply(x, gather(w)), fin)
        return (y + b[0] if b else y), x

    def local_backward(x, w, dy):
        # The convolution is linear in each argument: its transposes are the local backward.
        _, vjp = jax.vjp(spec.apply, _untyped(x), _untyped(gather(w)))
        dx, dw = vjp(_untyped(gather_rows(dy, fin)))
        dx = sum_rows(dx, fout)
        dw = psum_scatter(dw, Axis.DEPTH, scatter_dimension=ndim - 2, tiled=True)
        if not has_bias:
            return dx, dw
        # devices of `depth` (and of `fin` when split) hold different images of the batch
        over = (Axis.DEPTH, fin) if split else Axis.DEPTH
        return dx, dw, psum(jnp.sum(dy, axis=tuple(range(ndim - 1))), over)

    return _layer(mesh, local_forward, local_backward, (x_spec, w_spec, b_spec, y_spec, kept_spec),
                  has_bias)


def tp_conv(x, kernel, bias, spec: ConvSpec, mesh=None, transpose: bool = False, *,
            replicated_rows: bool = False):
    """A channels-last convolution with AxoNN's 2D/3D algorithm, the spatial dims untouched.

    It is `tp_dense` over the channels of every window of `x`, with the images as its rows, in
    the same two layouts (`split_batch`). Forward: the kernel all-gathered over `depth`, the
    local convolution, an all-reduce over `col`; backward: the input gradient all-reduced over
    `row`, the kernel's reduce-scattered over `depth`. In the batch-split layout each all-reduce
    is the all-gather of the images before the convolution and the reduce-scatter after it, so
    a convolution and a dense layer take and give the same layouts and a model mixing them
    needs no re-layout between them.

    Args:
      x: `(batch, *spatial, in)`, channels over `col`, batch over (`depth`, `row`) (`row` and
        `col` swapped when `transpose`; batch over `depth` only in the replicated layout).
      kernel: `(*window, in, out)` (`(*window, out, in)` for a `transpose_kernel` transposed
        convolution), split as `conv_kernel_spec`.
      bias: `(out,)` over `row` (`col`), or None.
      spec: the window arithmetic (`ConvSpec`).
      mesh: the mesh (default: the current one).
      transpose: swap `row` and `col`.
      replicated_rows: keep the replicated layout where the images divide
        (`tp.options.KernelOptions.replicated_rows`).

    Returns:
      `(batch, *spatial', out)`: channels over `row` (`col` when `transpose`), batch over
      (`depth`, `col`) (`row`), or over `depth` only when `split_batch` is False.

    Raises:
      ValueError: the shapes do not match or do not divide over the mesh axes.
    """
    _check_conv(x, kernel, bias, mesh, transpose, spec)
    fn = _conv_fn(current_mesh(mesh), bool(transpose), x.ndim, bias is not None, spec,
                  split_batch(x.shape, mesh, transpose, replicated_rows))
    y = fn(x, kernel, jnp.zeros((0,), x.dtype) if bias is None else bias)
    return checkpoint_name(y, TP_DENSE_NAME)


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """The collectives and parameter shards of a `tp_conv` layer, as a model declares it.

    A `collectives.Part` (a dense layer is one with a window of 1). The images of a microbatch
    stay split over the feature axes where they divide (`split_batch`, as `tp_conv` decides),
    else they take the replicated layout: batch over depth only.

    Attributes:
      window: kernel positions.
      cin: input channels.
      cout: output channels.
      pixels: output positions per row (image).
      in_pixels: input positions per row (image).
      layers: copies on one device (a stage's blocks, or 1).
      runs: runs of each copy per step.
      stacked: a block of the stack (its forward recomputed in a pipeline stage's backward, its
        backward a scan loop that gathers the kernel again); else every stage holds it.
    """

    window: int
    cin: int
    cout: int
    pixels: int
    in_pixels: int
    transpose: bool = False
    layers: int = 1
    runs: int = 1
    stacked: bool = False

    def collectives(self, step: StepShape) -> list[Collective]:
        """The collectives of AxoNN's dense layer over the channels of every window (`tp_conv`).

        `window · cin` input features and one row per output pixel; the input gradient sized by
        the input pixels.
        """
        g, cb, pb = step.grid, step.compute_bytes, step.param_bytes
        n = self.layers * self.runs
        fin, fout = feature_axes(self.transpose)
        nin, nout = getattr(g, fin), getattr(g, fout)
        block = self.window * self.cin * self.cout / (nin * nout)
        y_bytes = step.rows * self.pixels * self.cout / nout * cb
        x_bytes = step.rows * self.in_pixels * self.cin / nin * cb
        wb = step.gathered_bytes
        mm_flops = 2 * step.rows * self.pixels * block  # the weight gradient's, per device
        split = self.split(step)
        if split:  # each all-reduce is a gather of the images before and a scatter after
            rows = [Collective("all-gather", (fout,), x_bytes, n, stage_forward=self.stacked),
                    Collective("reduce-scatter", (fin,), y_bytes, n, stage_forward=self.stacked),
                    Collective("all-gather", (fin,), y_bytes, n),
                    Collective("reduce-scatter", (fout,), x_bytes, n, overlappable=mm_flops)]
        else:
            rows = [Collective("all-reduce", (fin,), y_bytes, n, stage_forward=self.stacked),
                    Collective("all-reduce", (fout,), x_bytes, n, overlappable=mm_flops)]
        return [
            Collective("all-gather", (Axis.DEPTH,), block * wb, n * (2 if self.stacked else 1),
                       per_microbatch=True),
            *rows,
            Collective("reduce-scatter", (Axis.DEPTH,), block * wb, n, per_microbatch=True),
            Collective("all-reduce", (Axis.DEPTH, fin) if split else (Axis.DEPTH,),
                       self.cout / nout * pb, n, per_microbatch=True),
        ]

    def split(self, step: StepShape) -> bool:
        """Whether a microbatch's images split over both feature axes, as `tp_conv` decides.

        Args:
          step: the train step's shape.

        Returns:
          True for the batch-split layout (`split_batch`).
        """
        return split_batch((step.layer_rows,), step.grid.as_dict(), self.transpose)

    def kept_bytes(self, step: StepShape) -> float:
        """Bytes one device keeps of one run of the layer for the backward.

        The replicated layout: about three arrays of its output's size (the output, a
        GroupNorm's input; the GroupNorm and SiLU after it; the next layer's input). The
        batch-split layout: the next layer's input rows gathered for its GEMM, and about three
        arrays' worth also split over the input axis (the output, the GroupNorm's input in
        float32): the count that puts `plan`'s memory within 10% of the compiled peaks of
        `unet-28b` on three grids of 256 and 1,024 H100s (`benchmarks/results/scale.md`).

        Args:
          step: the train step's shape.

        Returns:
          Bytes per device.
        """
        nin, nout = (getattr(step.grid, a) for a in feature_axes(self.transpose))
        out = step.rows / step.microbatches * self.pixels * self.cout / nout * step.compute_bytes
        return out * (1 + 3 / nin if self.split(step) else 3)

    def parameters(self, step: StepShape) -> list[ParameterShard]:
        """The kernel `(window, in, out)` split as `conv_kernel_spec`, the bias like the outputs."""
        g = step.grid
        fin, fout = feature_axes(self.transpose)
        n, outside = self.layers, not self.stacked
        kernel = self.window * self.cin * self.cout / (g.depth * g.row * g.col)
        return [ParameterShard(n * kernel, 3 + self.stacked, ((fin, Axis.DEPTH), (fout,)),
                               outside),
                ParameterShard(n * self.cout / getattr(g, fout), 1 + self.stacked, ((fout,),),
                               outside)]
