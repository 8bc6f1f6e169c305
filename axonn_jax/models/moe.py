"""A mixture-of-experts feed-forward layer: a router picks `top_k` of `num_experts` SwiGLU experts
for every token; optional shared experts (DeepSeek) see every token.

    MoE(config)(x) -> (y, aux)       x, y: (..., d_model); aux: a dict of float32 arrays

`aux['loss']` is the weighted auxiliary loss (`aux_loss_weight`·balance + `z_loss_weight`·z),
a scalar to add to the training loss; the rest are metrics: `expert_load (num_experts,)`
(assignments each expert was asked to take, before drops), `load_imbalance` (its max over its
mean: 1 when balanced), `dropped_tokens` (assignments dropped for lack of capacity), and the
unweighted `balance_loss` and `z_loss`.

Router (in float32): logits `x @ router (d_model, E)`; scores `softmax(logits)` or
`sigmoid(logits)`; the top-k scores are the combine weights, divided by their sum with
`renormalize` (Mixtral's and DeepSeek-V3's `norm_topk_prob`).

Losses:
- balance (Switch's, in Mixtral's form, `transformers`' `load_balancing_loss_func` for one
  layer): `E · Σ_e f_e · P_e`, with `f_e` the fraction of the tokens whose top-k choices include
  `e` (Σ_e f_e = k; the loss is k when routing is uniform) and `P_e` the mean over tokens of
  `e`'s routing probability (the scores divided by their sum over experts: the softmax itself,
  or normalized sigmoid scores as in DeepSeek-V3).
- z (ST-MoE): the mean over tokens of `logsumexp(logits)²`.

Where the tokens are split over manual mesh axes (`batch_axes`: the train step's `data`, `expert`
and `context`), the expert counts `f_e` are summed over them first (an all-reduce of E + 2
numbers), so every shard's balance loss uses the whole batch's routing; `f_e` carries no gradient
and `P_e` is a mean over tokens, so the shards' losses average to the whole batch's loss and
their gradients sum to its gradient, as the train step reduces them. The metrics are the whole
batch's too.

Experts are computed by `axonn_jax.parallel.experts.routed_swiglu` (dropless with grouped
matmuls: `parallel.grouped_matmul`'s kernels on GPU, `ragged_dot` on CPU; or capacity-based),
split over the `expert` mesh axis when the layer runs inside a shard_map manual over it: its
expert weights are then the device's slice, and its parameter shapes say so.

Parameters: `router (d_model, E)` float32; `w_gate (E, d_model, d_ff)`, `w_up (E, d_model,
d_ff)`, `w_down (E, d_ff, d_model)`; with shared experts
`shared_gate`, `shared_up`, `shared_down` (`nn.Dense` kernels, hidden `num_shared_experts·d_ff`).
The expert weights' partitioning metadata is `('expert', 'col', 'row')` (the down projection
`('expert', 'row', 'col')`): on a mesh with tensor axes each expert's matmuls are split like an
AxoNN dense layer's, laid out by GSPMD (the tensor axes are automatic in the train step).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..config import Axis
from .._compat import psum, varying_axes
from ..checks import check_choice
from ..collectives import Collective, ParameterShard
from ..parallel import experts as experts_lib, grouped_matmul

SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of an MoE layer (see the module docstring).

    Attributes:
      d_ff: one expert's hidden width.
      capacity_factor: None for dropless, else slots per expert =
        `ceil(capacity_factor·tokens·top_k/num_experts)`.
      dispatch_factor: dropless over an expert axis of n devices, rows sent to each device =
        `ceil(dispatch_factor·tokens·top_k/n)` (None: every row could go to one device, nothing
        is dropped).
    """

    num_experts: int
    top_k: int
    d_ff: int
    score: str = "softmax"
    renormalize: bool = True
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0
    num_shared_experts: int = 0
    capacity_factor: float | None = None
    dispatch_factor: float | None = None

    def __post_init__(self):
        if self.num_experts < 1 or self.d_ff < 1:
            raise ValueError(f"num_experts = {self.num_experts} and d_ff = {self.d_ff} must be "
                             "positive")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k = {self.top_k} must be between 1 and num_experts = "
                             f"{self.num_experts}")
        check_choice("score", self.score, SCORES)
        for name in ("capacity_factor", "dispatch_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} = {value} must be > 0")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts = {self.num_shared_experts} must be ≥ 0")

    def check_expert_axis(self, expert: int) -> None:
        """Raise ValueError naming the numbers unless the experts split evenly over `expert`.

        Args:
          expert: devices on the `expert` mesh axis.

        Raises:
          ValueError: `num_experts` is not divisible by `expert`.
        """
        if self.num_experts % expert:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible by expert = "
                             f"{expert}")

    def num_params(self, d_model: int) -> int:
        """Parameters of one layer: router, experts, shared experts.

        Args:
          d_model: the layer's input (= output) features.

        Returns:
          The number of parameters of one MoE layer.
        """
        return d_model * self.num_experts + 3 * d_model * self.d_ff * (
            self.num_experts + self.num_shared_experts)

    def active_params(self, d_model: int) -> int:
        """Parameters one token multiplies by: router, top_k experts, shared experts.

        Args:
          d_model: the layer's input (= output) features.

        Returns:
          The number of parameters one token's forward pass uses.
        """
        return d_model * self.num_experts + 3 * d_model * self.d_ff * (
            self.top_k + self.num_shared_experts)


# ----------------------------------------------------------------------------- router and losses

def route(logits: jax.Array, config: MoEConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top-k combine weights and experts of each token, and its routing probabilities.

    Args:
      logits: router logits, shape `(T, E)` (computed in float32).
      config: the layer's routing (`score`, `top_k`, `renormalize`).

    Returns:
      `(weights (T, k) float32, experts (T, k) int32, probs (T, E) float32)`: the top-k scores
      and their experts (best first), and the routing probabilities the balance loss reads (see
      the module docstring).
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, -1) if config.score == "softmax" else jax.nn.sigmoid(logits)
    weights, chosen = jax.lax.top_k(scores, config.top_k)
    if config.renormalize:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    probs = scores if config.score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    return weights, chosen.astype(jnp.int32), probs


def balance_loss(probs: jax.Array, expert_load: jax.Array, num_tokens) -> jax.Array:
    """The balance loss `E · Σ_e (expert_load_e / num_tokens) · mean_t probs[t, e]`.

    Args:
      probs: routing probabilities of the local tokens, shape `(T, E)`.
      expert_load: assignments per expert of the `num_tokens` tokens they count (the whole
        batch's), shape `(E,)`; no gradient flows through them.
      num_tokens: the tokens `expert_load` counts.

    Returns:
      The loss, a float32 scalar (k when routing is uniform).
    """
    fraction = jax.lax.stop_gradient(expert_load / num_tokens)
    return probs.shape[-1] * jnp.sum(fraction * jnp.mean(probs, 0))


def z_loss(logits: jax.Array) -> jax.Array:
    """The router z-loss: the mean over tokens of `logsumexp(logits)²`.

    Args:
      logits: router logits, shape `(T, E)` (computed in float32).

    Returns:
      The loss, a float32 scalar.
    """
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1) ** 2)


# ----------------------------------------------------------------------------- the layer

def _expert_init(scale_axis: int):
    """Lecun-normal per expert (fan-in of one expert's matrix, not of the stack)."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=scale_axis,
                                            out_axis=-1, batch_axis=(0,))


class MoE(nn.Module):
    """The MoE feed-forward layer: `x (..., d_model) -> (y (..., d_model), aux)`.

    See the module docstring.

    Attributes:
      expert_axis: the mesh axis experts split over when it is manual in the enclosing
        shard_map.
      batch_axes: the axes that may split the tokens (the routing statistics are summed over
        those of them the tokens vary over there).
    """

    config: MoEConfig
    dtype: Any = jnp.float32
    expert_axis: str = Axis.EXPERT
    batch_axes: tuple[str, ...] = (Axis.DATA, Axis.EXPERT, Axis.CONTEXT)

    @nn.compact
    def __call__(self, x):
        c = self.config
        shape, d = x.shape, x.shape[-1]
        tokens = x.reshape(-1, d)
        local = experts_lib.local_experts(c.num_experts, self.expert_axis)
        # Experts split over the expert axis, each expert's (in, out) features over (col, row) as
        # AxoNN splits a dense layer (the down projection transposed): GSPMD lays out their
        # matmuls over the tensor axes, which the train step keeps automatic.
        param = lambda name, s, names: self.param(  # noqa: E731
            name, nn.with_partitioning(_expert_init(-2), (self.expert_axis, *names)), s,
            jnp.float32)
        w_gate = param("w_gate", (local, d, c.d_ff), (Axis.COL, Axis.ROW))
        w_up = param("w_up", (local, d, c.d_ff), (Axis.COL, Axis.ROW))
        w_down = param("w_down", (local, c.d_ff, d), (Axis.ROW, Axis.COL))
        router = self.param("router", nn.initializers.lecun_normal(), (d, c.num_experts),
                            jnp.float32)

        logits = tokens.astype(jnp.float32) @ router
        weights, chosen, probs = route(logits, c)
        y, dropped = experts_lib.routed_swiglu(
            tokens.astype(self.dtype), chosen, weights, w_gate, w_up, w_down,
            num_experts=c.num_experts, axis=self.expert_axis, capacity_factor=c.capacity_factor,
            dispatch_factor=c.dispatch_factor)
        if c.num_shared_experts:
            y = y + self._shared(tokens)
        aux = self._aux(logits, probs, chosen, dropped)
        return y.reshape(shape).astype(self.dtype), aux

    def _shared(self, tokens):
        hidden = self.config.num_shared_experts * self.config.d_ff
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        h = nn.silu(dense(hidden, "shared_gate")(tokens)) * dense(hidden, "shared_up")(tokens)
        return dense(tokens.shape[-1], "shared_down")(h)

    def _aux(self, logits, probs, chosen, dropped) -> dict:
        c = self.config
        load = jnp.bincount(chosen.reshape(-1), length=c.num_experts).astype(jnp.float32)
        stats = jnp.concatenate([load, jnp.array([chosen.shape[0], dropped], jnp.float32)])
        axes = tuple(a for a in self.batch_axes if a in varying_axes(stats))
        if axes:
            stats = psum(stats, axes)
        load, num_tokens, dropped = stats[:-2], stats[-2], stats[-1]
        balance = balance_loss(probs, load, num_tokens)
        z = z_loss(logits)
        imbalance = jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
        return {"loss": c.aux_loss_weight * balance + c.z_loss_weight * z, "balance_loss": balance,
                "z_loss": z, "expert_load": load, "load_imbalance": imbalance,
                "dropped_tokens": dropped}


# ----------------------------------------------------------------------------- communication model

DISPATCH_PASSES = (9, 6)
"""(forward, backward) passes over one layer call's receive buffer (`MoELayers._rows` rows of
`d_model`) of the dispatch's memory-bound kernels: read off the compiled H100 step of
mixtral-8x7b on expert 8 × row 8 (`benchmarks/plan_vs_replay.py`: its replayed other kernels
over the buffer's bytes, the forward's loop body and the rest; the send side packed)."""
DENSE_RAGGED_DOT = True
"""jaxlib computes `jax.lax.ragged_dot` densely on CPU and GPU (every row against every local
expert, masked: `benchmarks/results/moe.md`), so a dropless layer that uses it runs
`num_experts ×` the routed experts' FLOPs on one device. On GPU the dropless layer runs the
grouped-matmul kernels instead (`parallel.grouped_matmul`: the routed rows only), on CPU
`ragged_dot`; `MoELayers.executed_flops` counts what the compiled program runs."""


@dataclasses.dataclass(frozen=True)
class MoELayers:
    """The MoE layers of one device's `layers` blocks as a model declares them.

    A `collectives.Part`: the token all-to-alls over `expert` (ragged on a GPU, dropless: the
    routed rows only) and the routing statistics' sum (`parallel.experts.collectives`), and the
    parameter shards: the router whole, the experts split over `expert` and, as their
    partitioning metadata says, each expert's (in, out) features over (`col`, `row`) (the down
    projection transposed). Shared experts are tensor-parallel dense layers
    (`tp.tensor.DenseLayer`) the model declares beside this part.
    """

    config: MoEConfig
    d_model: int
    layers: int

    def _tokens(self, step) -> float:
        """Tokens one layer call routes on one device (a microbatch's under a pipeline)."""
        return step.tokens * step.grid.depth / step.layer_calls

    def collectives(self, step) -> list[Collective]:
        """The token exchanges, routing-statistics sums and the experts' tensor-axis sums."""
        c, g = self.config, step.grid
        calls = self.layers * step.layer_calls
        batch_axes = tuple(a for a in (Axis.DATA, Axis.EXPERT, Axis.CONTEXT) if getattr(g, a) > 1)
        shape = dict(capacity_factor=c.capacity_factor, dispatch_factor=c.dispatch_factor,
                     dtype_bytes=step.compute_bytes, batch_axes=batch_axes,
                     ragged=self._grouped(step), imbalance=step.expert_imbalance,
                     calls=step.accumulated)
        # The ragged exchange runs inside the experts' manual tensor axes: each device sends
        # its tokens' features over col.
        features = self.d_model // g.col if self._grouped(step) else self.d_model
        args = (self._tokens(step), features, c.num_experts, c.top_k, g.expert)
        forward = experts_lib.collectives(*args, **shape, backward=False)
        # No remat policy keeps the layer's outputs: `--remat` runs its forward exchange again.
        out = [Collective(k, axes, b, calls, stage_forward=True, rematerialized=True)
               for k, axes, b in forward]
        backward = experts_lib.collectives(*args, **shape)
        for item in forward:  # what the backward pass adds
            backward.remove(item)
        out += [Collective(k, axes, b, calls) for k, axes, b in backward]
        return out + self._tensor_collectives(step, calls)

    def _tensor_collectives(self, step, calls: int) -> list[Collective]:
        """The experts' matmuls split over (`col`, `row`) on the rows a device received
        (`parallel.experts.layout`), like AxoNN's dense layers in the replicated layout: the
        gate and up projections' partial sums over `col` forward, the down projection's input
        gradient over `col` backward; the down projection's partial sums over `row` forward and
        the gate and up projections' input gradients over `row` backward. `--remat` runs the
        forward sums again (the combine weights' gradient reads the experts' outputs; no policy
        keeps them).

        Where the layer runs the grouped kernels (`_grouped`), the sums over `row` are added per
        token after the return exchange (`parallel.experts._over_tensor_axes`: `(T, d)`, and the
        combine weights' gradient, `(T, top_k)` float32, over `col` too), elsewhere GSPMD adds
        them per received row (XLA:CPU the two input gradients apart). With the kernels the
        backward computes the gate and up projections again from the kept received rows (their sum
        over `col` once more; XLA merges `--remat`'s recomputed forward into it), and `--remat`
        runs no forward sum over `row` again: it recomputes what the backward keeps, the
        exchanges' results, not the layer's output, which only the block's residual sum reads.
        (With `col > 1` the tokens reach the layer split over `row` and XLA turns the sums over
        `row` into reduce-scatters, which this count does not follow.) Checked against the
        compiled H100 steps of mixtral-8x7b on expert 8 × row 8 and of a small Mixtral on expert 4
        × row 2, and on XLA:CPU mixtral-tiny on expert=2, data=2, row=2, where jaxlib 0.10's dense
        `ragged_dot` adds gathers (tests/test_axes_model.py)."""
        c, g, cb = self.config, step.grid, step.compute_bytes
        if g.row * g.col == 1:
            return []
        h = self._rows(step) * c.d_ff / g.row * cb  # the received rows' hidden features over row
        # Each sum is read at once by the next projection or the return exchange: the replayed
        # H100 schedule hides none of them.
        gate_up = Collective("all-reduce", (Axis.COL,), h, 2 * calls, stage_forward=True,
                             rematerialized=not self._grouped(step), waited=True)
        down_input = Collective("all-reduce", (Axis.COL,), h, calls, waited=True)
        if not self._grouped(step):
            x = self._rows(step) * self.d_model / g.col * cb  # the received rows' features
            merged = 1 if step.platform == "gpu" else 2
            return [gate_up, Collective("all-reduce", (Axis.ROW,), x, calls, stage_forward=True,
                                        rematerialized=True, waited=True),
                    Collective("all-reduce", (Axis.ROW,), x, merged * calls, waited=True),
                    down_input]
        tokens = self._tokens(step)
        x = tokens * self.d_model / g.col * cb  # the tokens' features over col
        return [gate_up, Collective("all-reduce", (Axis.COL,), h, 2 * calls, waited=True),
                Collective("all-reduce", (Axis.ROW,), x, calls, stage_forward=True, waited=True),
                Collective("all-reduce", (Axis.ROW,), x, calls, waited=True),
                Collective("all-reduce", tuple(a for a in (Axis.ROW, Axis.COL)
                                               if getattr(g, a) > 1),
                           tokens * c.top_k * 4, calls, waited=True),
                down_input]

    def parameters(self, step) -> list[ParameterShard]:
        """The router (whole) and the three expert weights (over `expert`, `col`, `row`)."""
        c, g, d = self.config, step.grid, self.d_model
        experts = self.layers * c.num_experts / g.expert * d * c.d_ff / (g.row * g.col)
        return [ParameterShard(self.layers * d * c.num_experts, 3, ()),
                ParameterShard(experts, 4, ((Axis.EXPERT,), (Axis.COL,), (Axis.ROW,))),
                ParameterShard(experts, 4, ((Axis.EXPERT,), (Axis.COL,), (Axis.ROW,))),
                ParameterShard(experts, 4, ((Axis.EXPERT,), (Axis.ROW,), (Axis.COL,)))]

    def activations(self, step) -> float:
        """Bytes one device keeps for the backward of its layers' expert computation.

        For one (micro)batch: the send buffer, the rows received and the rows returned
        (`groups·slots` rows of `d_model`, `parallel.experts.layout`; the ragged exchange's send
        and return buffers: the routed rows only), and of the rows received
        the experts' outputs and their gate, up and gated hidden activations (`d_ff` each), once
        per local expert under `DENSE_RAGGED_DOT` (the compiled program holds
        `(local, rows, d_model)` and `(rows, local, d_ff)` arrays). All the step's tokens: the
        planner divides by the microbatches (and, under `--remat`, by the layers: one block is
        recomputed at a time).

        Args:
          step: the step's shape (`collectives.StepShape`).

        Returns:
          The kept bytes on one device.
        """
        g = step.grid
        calls = step.layer_calls
        rows = self._rows(step) * calls
        # The ragged exchange's send and return buffers hold the routed rows only.
        sent = self._tokens(step) * self.config.top_k * calls if self._grouped(step) else rows
        per_row = self.d_model / g.col
        kept = rows * (per_row + self._expert_features(step)) + 2 * sent * per_row
        return self.layers * kept * step.compute_bytes

    def traffic(self, step) -> tuple[float, float]:
        """HBM bytes (one forward, the backward) per step of one device's dispatch kernels.

        Those are the scatters, gathers, selects and copies that place each routed row into the
        send buffer, bring the received rows to their experts and the results back, and their
        index and mask arrays, `DISPATCH_PASSES` over the buffer (`_rows` of `d_model` features
        over col, in the compute dtype) per layer and call.

        Args:
          step: the step's shape (`collectives.StepShape`).

        Returns:
          (forward bytes, backward bytes).
        """
        g = step.grid
        # `_rows`: one call's rows under a pipeline, every microbatch's together without one
        rows = self._rows(step) * step.layer_calls
        buffer = rows * self.d_model / g.col * step.compute_bytes
        return tuple(self.layers * buffer * p for p in DISPATCH_PASSES)

    def working_bytes(self, step) -> float:
        """Temporary bytes one layer's backward holds on one device beside what `activations` keeps.

        For one microbatch: the cotangents of the experts' outputs and hidden activations (one
        per local expert, as the residuals). (`plan`'s memory with this term is checked against
        the compiled H100 peaks of mixtral-8x7b on expert 8 × row 8 and of a small Mixtral on
        expert × row grids: tests/test_axes_model.py.)

        Args:
          step: the step's shape (`collectives.StepShape`).

        Returns:
          The temporary bytes on one device.
        """
        rows = self._rows(step) / step.accumulated
        return rows * self._expert_features(step) * step.compute_bytes

    def _expert_features(self, step) -> float:
        """Features per received row of the experts' outputs and gate, up and gated hidden
        activations, per local expert the row goes through (`_local`), split as GSPMD splits
        the matmuls: d_model over col, d_ff over row."""
        c, g = self.config, step.grid
        return self._local(step) * (self.d_model / g.col + 3 * c.d_ff / g.row)

    def _local(self, step) -> int:
        """Experts each received row goes through in the compiled program: every local expert
        under `DENSE_RAGGED_DOT` (dropless on CPU), its own (capacity, or the GPU's grouped
        kernels)."""
        c = self.config
        return c.num_experts // step.grid.expert if c.capacity_factor is None \
            and DENSE_RAGGED_DOT and not self._grouped(step) else 1

    def _grouped(self, step) -> bool:
        """Whether the layer runs the grouped-matmul kernels and exchanges its rows by ragged
        all-to-alls (dropless, on a GPU)."""
        return self.config.capacity_factor is None and step.platform == "gpu"

    def metrics(self) -> int:
        """Float32 elements of these layers' aux outputs beside the loss.

        Per layer: balance and z losses, expert load (num_experts), its imbalance, dropped
        tokens.

        Returns:
          `layers · (num_experts + 4)`.
        """
        return self.layers * (self.config.num_experts + 4)

    def _rows(self, step) -> int:
        """Rows of the send (= receive) buffer of one layer call on one device
        (`parallel.experts.layout`: padding included)."""
        c = self.config
        groups, slots = experts_lib.layout(int(self._tokens(step)), c.top_k, c.num_experts,
                                           step.grid.expert, c.capacity_factor, c.dispatch_factor)
        return groups * slots

    def ideal_flops(self, tokens: float) -> float:
        """Training FLOPs (forward + backward) of these layers' routed experts for `tokens` tokens.

        Each token goes through its top_k experts' three projections.

        Args:
          tokens: the tokens routed (all devices').

        Returns:
          The ideal training FLOPs (no padding, no dense `ragged_dot`).
        """
        c = self.config
        return 3 * 2 * 3 * self.d_model * c.d_ff * c.top_k * tokens * self.layers

    def executed_flops(self, step) -> float:
        """Training FLOPs one device's routed experts run per step in the compiled program.

        Every received row of the padded buffer (`_rows`), through each of the device's local
        experts under `DENSE_RAGGED_DOT` (dropless on CPU), through its expert's slots
        (capacity); under the GPU's grouped kernels the rows a device receives on average (the
        assignments it sends) plus one tile of rows per local expert (`parallel.grouped_matmul`,
        what its kernels declare); the matmuls split over the tensor axes.

        Args:
          step: the step's shape (`collectives.StepShape`).

        Returns:
          The FLOPs one device runs in its routed experts per step.
        """
        c, g = self.config, step.grid
        calls = step.layer_calls
        per_row = 3 * 2 * 3 * self.d_model * c.d_ff / (g.row * g.col)
        rows = self._rows(step)
        if self._grouped(step):
            # `_tokens` holds every microbatch's tokens unless a pipeline calls once for each.
            tiles = c.num_experts // g.expert * step.accumulated
            rows = min(rows, self._tokens(step) * c.top_k + tiles * grouped_matmul.TILE_M)
        return self.layers * calls * rows * self._local(step) * per_row
