"""The modes of the tensor-parallel kernels (`tp.tensor.tp_dense` and the layers built on it), passed
explicitly: a frozen, hashable `KernelOptions` that the layers hold as an attribute (Flax's way
of passing other matmul arithmetic, like `dot_general_cls`) and `parallelize` hands to the kernels
it runs. Being part of the layers' static configuration, the modes are part of what `jax.jit`
caches on: the same function traced with other options compiles another program."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the tensor-parallel dense layers compute; the defaults are the plain layer.

    Attributes:
      fp8: run the GEMMs in FP8 (e4m3 forward, e5m2 gradients, per-tensor current scaling:
        `tp.fp8`); the train step's `--fp8`.
      collective_matmuls: in the batch-split layout, gather the rows of each matmul's input (x
        over the output axis in the forward, dy over the input axis in the backward) in a ring
        (`tp.tensor.ring_gather`): one matmul per row block, each block's `ppermute` to the next
        device in flight beside the previous block's matmul, so that the gather hides behind the
        layer's own compute (Wang et al., ASPLOS'23, "collective matmul"). Same bytes as the
        all-gather (float8 rows with `fp8`), the same results up to the order of the weight
        gradient's sums; the cost: each block's product is copied into place in the gathered
        result. Reduce-scatters stay as they are (a ring of them measured slower:
        `benchmarks/results/overlap_notes.md`). The train step's `--collective-matmul`
        (`tp.tensor.collective_matmuls_on`).
      replicated_rows: keep the replicated layout (activations whole over the axis that does not
        split their features) even where the batch divides: for a block whose other layers GSPMD
        lays out and which expects activations so (a Llama's `ReplicatedDense` key/value
        projections). A per-block mode: a linen module whose `tp_replicated_rows` is True gives it
        to the layers `parallelize` runs inside it (`models.llama.Block`).
    """

    fp8: bool = False
    collective_matmuls: bool = False
    replicated_rows: bool = False

    def replace(self, **changes) -> "KernelOptions":
        """A copy with `changes` (`dataclasses.replace`).

        Args:
          **changes: new values of fields, by name.

        Returns:
          The new `KernelOptions`.
        """
        return dataclasses.replace(self, **changes)


DEFAULT = KernelOptions()
"""The plain layer: the options of a kernel called without any."""
