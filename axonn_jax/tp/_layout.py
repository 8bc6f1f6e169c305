"""Layout bookkeeping shared by the linen and NNX forms of `axonn_jax.parallelize`.

While a model's forward is traced, `Layout` follows which mesh axis splits the features of each
activation, and from it chooses `transpose` for each dense layer: a layer whose input is split over
`col` (a norm, an embedding or a transposed layer produced it) is normal; one whose input is split
over `row` is transposed. When the input came through other code (attention, an activation
function), it is taken to carry the layout of the most recent dense layer's output. In a transformer
block this gives query/key/value and mlp_up normal, attn_out and mlp_down transposed, and the
residual stream stays split over `col` with no re-layout.

The placement helpers below are shared too: `stacked_spec` (a layer's spec on a parameter stacked
by `nn.scan` / `nnx.vmap`, the layer axes unsplit), `dense_placement` and `check_divisible` (specs
of a dense layer's kernel and bias, or a ValueError naming the layer and the dim that does not
divide).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from jax.sharding import PartitionSpec as P

from ..config import Axis
from .tensor import dense_specs, feature_axes


class Layout:
    """One trace's layout of activations and the choices made from it.

    overrides: `{dense layer path: transpose}` taking precedence over the automatic choice.
    After the trace, `decisions` holds `{dense layer path: transpose}` and `norm_axes`
    `{norm layer path: axis splitting its features}`.
    """

    def __init__(self, overrides: Mapping[str, bool] | None = None):
        self.overrides = dict(overrides or {})
        self.decisions: dict[str, bool] = {}
        self.norm_axes: dict[str, str] = {}
        self._axis: dict[int, tuple[str, Any]] = {}  # id(array) -> (axis, array kept alive)
        self._last_dense_out: str | None = None

    def mark(self, y, axis: str):
        """Record that `y`'s features are split over `axis`; returns `y`."""
        self._axis[id(y)] = (axis, y)
        return y

    def axis_of(self, x) -> str:
        if id(x) in self._axis:
            return self._axis[id(x)][0]
        return self._last_dense_out or Axis.COL

    def dense(self, path: str, x) -> bool:
        """`transpose` for the dense layer `path` applied to `x`."""
        # Record the input's layout so that sibling layers on one input (query/key/value on a norm
        # output that `checkpoint_name` re-wrapped) agree instead of alternating.
        axis = self.axis_of(x)
        self.mark(x, axis)
        transpose = self.overrides.get(path, axis == Axis.ROW)
        self.decisions[path] = transpose
        return transpose

    def dense_output(self, y, transpose: bool):
        """Record the output `y` of a dense layer; returns `y`."""
        self._last_dense_out = Axis.COL if transpose else Axis.ROW
        return self.mark(y, self._last_dense_out)

    def norm(self, path: str, x) -> str:
        """The axis splitting the features of the norm layer `path`'s input `x` (and output)."""
        axis = self.axis_of(x)
        self.norm_axes[path] = axis
        return axis


def stacked_spec(spec: P, layer_shape, shape) -> P:
    """`spec` of one layer's parameter (shape `layer_shape`) extended to the same parameter stacked
    by `nn.scan` / `nn.vmap` / `nnx.vmap` (shape `shape`, with extra layer axes): the stacked axes
    are left unsplit (None), never given a feature axis's placement.

    Where a stacked axis could sit in more than one place (a layer axis of the size of a
    neighbouring feature dim), it is taken to be the leading one, as the transforms place it by
    default. Raises ValueError when `shape` is not `layer_shape` with axes inserted.
    """
    layer_shape, shape = tuple(layer_shape), tuple(shape)
    entries = list(spec) + [None] * (len(layer_shape) - len(spec))
    out, j = [None] * len(shape), len(layer_shape) - 1
    for i in range(len(shape) - 1, -1, -1):  # match from the right: extra axes end up leading
        if j >= 0 and shape[i] == layer_shape[j]:
            out[i], j = entries[j], j - 1
    if j >= 0:
        raise ValueError(f"a parameter of shape {shape} is not a stack of layers' {layer_shape}")
    return P(*out)


def check_divisible(path: str, kind: str, name: str, shape, spec: P, mesh):
    """ValueError naming the layer `path` if a dim of its variable `name` is not divisible by the
    mesh axes that `spec` splits it over."""
    sizes = dict(mesh.shape)
    for dim, (n, axes) in enumerate(zip(shape, spec)):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        parts = math.prod(sizes[a] for a in axes)
        if n % parts:
            raise ValueError(f"parallelize: layer '{path}' ({kind}): {name} {tuple(shape)} dim {dim} "
                             f"= {n} is not divisible by {'×'.join(axes)} = {parts}")


def dense_placement(path, kind, in_dims, out_dims, flip, out_in, mesh):
    """`{'kernel': (layer shape, spec), 'bias': (layer shape, spec)}` of the dense layer `path`
    (`tensor.dense_specs`), or a ValueError naming it and the first dim the grid does not divide."""
    kernel_shape = (*out_dims, *in_dims) if out_in else (*in_dims, *out_dims)
    specs = dense_specs(in_dims, out_dims, dict(mesh.shape), flip, out_in)
    if specs is None:  # name the first dim that does not divide, else the contiguity
        fin, fout = feature_axes(flip)
        lead = lambda dims, axes: [axes] + [None] * (len(dims) - 1)  # noqa: E731
        naive = P(*lead(out_dims, (fout, Axis.DEPTH)), *lead(in_dims, fin)) if out_in \
            else P(*lead(in_dims, (fin, Axis.DEPTH)), *lead(out_dims, fout))
        check_divisible(path, kind, "kernel", kernel_shape, naive, mesh)
        raise ValueError(f"parallelize: layer '{path}' ({kind}): kernel {kernel_shape} cannot be "
                         "split in contiguous blocks of its features (the leading feature dim must "
                         f"be divisible by the mesh axes splitting it: {dict(mesh.shape)})")
    return {"kernel": (kernel_shape, specs[0]), "bias": (tuple(out_dims), specs[1])}


def check_groups(path: str, kind: str, channels: int, groups: int, axis: str, parts: int):
    """ValueError naming the GroupNorm `path` unless its `groups` divide over `axis` (`parts`
    devices), so that each device holds whole groups of its channels."""
    if groups % parts or channels % parts:
        raise ValueError(f"parallelize: layer '{path}' ({kind}): num_groups = {groups} "
                         f"(channels {channels}) is not divisible by {axis} = {parts}")
