"""`TrainState`: everything a train step carries from one step to the next, as one typed pytree."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


class TrainState(struct.PyTreeNode):
    """The state of a run between steps (global arrays).

    Attributes:
      step: int32 scalar, steps done.
      params: the parameters the model computes with, split over the tensor axes by their layers
        and, with `pipe > 1`, the blocks over `pipe` on their layer axis (with host-offloaded
        optimizer state: in the compute dtype; the fp32 masters are in `opt_state`).
      opt_state: the update's state (`step.update.ParamUpdate.init`: the optax chain's state
        placed like its parameters, or in `pinned_host` with `offload_optimizer`).
      rng: uint32[2] key data of the run's random stream (stochastic rounding draws from
        `fold_in(rng, step)`).
      reducer: the gradient reducer's state (CGX error-feedback residuals) or None.
      precision: the loss scaler's state (mixed precision) or None.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    reducer: Any = None
    precision: Any = None

    @property
    def loss_scale(self) -> jax.Array:
        """The loss scale (1.0 without mixed-precision state)."""
        return jnp.float32(1.0) if self.precision is None else self.precision["scale"]

    def step_key(self) -> jax.Array:
        """The random key of this step: `rng` folded with `step`.

        Returns:
          A typed JAX random key (`jax.random.wrap_key_data(rng)` folded with `step`).
        """
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

    def as_dict(self) -> dict[str, Any]:
        """`{field: value}` of the fields that hold something (the checkpoint's layout).

        Returns:
          The fields of `FIELDS` that are not None, by name.
        """
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainState":
        """The state of a `{field: value}` dict, as `as_dict` writes it.

        Args:
          values: the fields by name; a missing field is None.

        Returns:
          The `TrainState`.
        """
        return cls(**{name: values.get(name) for name in FIELDS})


FIELDS = ("step", "params", "opt_state", "rng", "reducer", "precision")
