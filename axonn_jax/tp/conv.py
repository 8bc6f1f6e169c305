"""Flax's convolution layers (linen `nn.Conv` / `nn.ConvTranspose`, NNX `nnx.Conv` /
`nnx.ConvTranspose`, which share their attribute names) run with `tensor.tp_conv`: the arithmetic
of Flax's `__call__` (batch dims flattened, the padding modes, the mask) around the
tensor-parallel convolution. Options the parallel kernel does not take raise NotImplementedError
naming the layer."""
from __future__ import annotations

import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding

from .tensor import ConvSpec, tp_conv


def _tuple(v, n: int) -> tuple:
    v = 1 if v is None else v
    return (v,) * n if isinstance(v, int) else tuple(v)


def check_conv_options(path: str, m, transposed: bool):
    """Raise NotImplementedError naming the layer `path` if its options have no parallel form.

    Args:
      path: the layer's name in the model, for the message.
      m: the Flax convolution layer (linen or NNX).
      transposed: a transposed convolution.

    Raises:
      NotImplementedError: grouped convolutions, `precision` or `preferred_element_type` set,
        or a transposed convolution with `padding='CIRCULAR'`.
    """
    kind = type(m).__name__
    if getattr(m, "feature_group_count", 1) != 1:
        raise NotImplementedError(f"parallelize: layer '{path}' ({kind}) has feature_group_count = "
                                  f"{m.feature_group_count}; grouped convolutions do not run "
                                  "tensor-parallel")
    if getattr(m, "preferred_element_type", None) is not None or m.precision is not None:
        raise NotImplementedError(f"parallelize: layer '{path}' ({kind}) sets precision or "
                                  "preferred_element_type, which the tensor-parallel convolution "
                                  "does not take")
    if transposed and m.padding == "CIRCULAR":
        raise NotImplementedError(f"parallelize: layer '{path}' ({kind}) with padding='CIRCULAR' "
                                  "does not run tensor-parallel")


def conv_apply(m, x, kernel, bias, mesh, transpose: bool, transposed: bool, *,
               replicated_rows: bool = False):
    """Flax's convolution `m` (its attributes) of `x` with `kernel` and `bias`, as `tp_conv`.

    Args:
      m: the Flax convolution layer whose attributes (kernel size, strides, padding, dilations,
        mask) give the arithmetic.
      x: `(*batch, *spatial, in)`, channels over `col` (`row` when `transpose`).
      kernel: `(*window, in, out)` (`(*window, out, in)` with `transpose_kernel`), split as
        `conv_kernel_spec`, promoted to the compute dtype.
      bias: `(out,)` or None, promoted to the compute dtype.
      mesh: the device mesh (None: the mesh in context).
      transpose: swap `row` and `col`.
      transposed: a transposed convolution (`ConvTranspose`).
      replicated_rows: the replicated layout even where the images divide (`tp_conv`).

    Returns:
      `(*batch, *spatial', out)`, channels over `row` (`col` when `transpose`).

    Raises:
      ValueError: causal padding of a convolution that is not 1-D.
    """
    ksize = _tuple(m.kernel_size, 1 if isinstance(m.kernel_size, int) else len(m.kernel_size))
    n = len(ksize)
    batch_shape = x.shape[:x.ndim - n - 1]
    x = x.reshape(-1, *x.shape[x.ndim - n - 1:])
    strides, rhs_dil = _tuple(m.strides, n), _tuple(m.kernel_dilation, n)
    lhs_dil = _tuple(getattr(m, "input_dilation", 1), n)
    padding = canonicalize_padding(m.padding, n)
    if not transposed and padding in ("CIRCULAR", "REFLECT"):
        dilated = [(k - 1) * d + 1 for k, d in zip(ksize, rhs_dil)]
        pads = [(0, 0), *[((k - 1) // 2, k // 2) for k in dilated], (0, 0)]
        x = jnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
        padding = "VALID"
    elif not transposed and padding == "CAUSAL":
        if n != 1:
            raise ValueError("Causal padding is only implemented for 1D convolutions.")
        x = jnp.pad(x, [(0, 0), (rhs_dil[0] * (ksize[0] - 1), 0), (0, 0)])
        padding = "VALID"
    if m.mask is not None:
        kernel = kernel * m.mask
    spec = ConvSpec(transposed, strides, padding, lhs_dil, rhs_dil,
                    bool(getattr(m, "transpose_kernel", False)))
    y = tp_conv(x, kernel, bias, spec, mesh, transpose, replicated_rows=replicated_rows)
    return y.reshape(*batch_shape, *y.shape[1:])
