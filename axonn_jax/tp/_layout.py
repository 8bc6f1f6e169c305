"""Layout bookkeeping shared by the linen and NNX forms of `axonn_jax.parallelize`.

While a model's forward is traced, `Layout` follows which mesh axis splits the features of each
activation, and from it chooses `transpose` for each dense layer: a layer whose input is split over
`col` (a norm, an embedding or a transposed layer produced it) is normal; one whose input is split
over `row` is transposed. When the input came through other code (attention, an activation
function), it is taken to carry the layout of the most recent dense layer's output. In a transformer
block this gives query/key/value and mlp_up normal, attn_out and mlp_down transposed, and the
residual stream stays split over `col` with no re-layout.
"""
from __future__ import annotations

from typing import Any, Mapping


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
        return self._last_dense_out or "col"

    def dense(self, path: str, x) -> bool:
        """`transpose` for the dense layer `path` applied to `x`."""
        # Record the input's layout so that sibling layers on one input (query/key/value on a norm
        # output that `checkpoint_name` re-wrapped) agree instead of alternating.
        axis = self.axis_of(x)
        self.mark(x, axis)
        transpose = self.overrides.get(path, axis == "row")
        self.decisions[path] = transpose
        return transpose

    def dense_output(self, y, transpose: bool):
        """Record the output `y` of a dense layer; returns `y`."""
        self._last_dense_out = "col" if transpose else "row"
        return self.mark(y, self._last_dense_out)

    def norm(self, path: str, x) -> str:
        """The axis splitting the features of the norm layer `path`'s input `x` (and output)."""
        axis = self.axis_of(x)
        self.norm_axes[path] = axis
        return axis
