"""Per-block activation handling (KARMA): keep, offload to `pinned_host`, or recompute.

Decisions, per block of a model's stack:
- `keep`: no rematerialization; the backward reads every residual autodiff saved.
- `offload`: the block's named intermediates (a `StackedModel`'s `offload_names`; by default the
  outputs of its matmuls without batch dimensions and of its tensor-parallel dense layers) are moved
  to `pinned_host` in the forward and fetched back for the backward; what they leave out
  (softmax, GELU, sums, norm statistics) is recomputed from them.
- `selective`: the same named intermediates stay on the device (MaxText's hand-written remat
  policies, chosen here per block): the backward reads the matmul outputs and recomputes only what
  is cheap from them (norms, activation functions, softmax and the attention scores).
- `recompute`: only the block input stays (on the device); the block's forward runs again in the
  backward (`nothing_saveable`).

`remat='auto'` is the planner: it measures one block — device and host residual bytes per decision
(`saved_residuals`), forward matmul FLOPs and the extra backward matmul FLOPs each decision costs
(counted on the jaxprs) — and takes the device FLOP rate and host-link bandwidth from a named
device spec (GPUs) or a short calibration (CPU). All blocks of the stack are identical, so a plan
is how many blocks take each decision; offloaded blocks come first (their activations are needed
last in the backward, so fetching them back has the most time to overlap), then recomputed,
selective and kept ones. It picks the counts with the least predicted extra step time whose
predicted peak fits the budget:

    predicted_peak(plan) = compiled_peak(all recompute)
                           + sum_blocks(device_bytes[d] - device_bytes[recompute])

calibrated by compiling the train step with every block recomputed and with every block kept (the
latter sets a kept block's bytes, so both ends are exact) through a `measure_peak(plan)` callback
that the step builder provides. On CPU, host and device memory are one pool, so the compiled peak of
a plan with offloaded blocks also counts their host residuals.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import check_choice
from ..tp.tensor import TP_DENSE_NAME

DECISIONS = ("keep", "selective", "offload", "recompute")
REMAT_MODES = ("none", "selective", "offload", "full", "auto")
"""The `--remat` modes: one decision for every block, or `auto` (KARMA's planner, per block)."""
UNIFORM_REMAT = REMAT_MODES[:-1]
"""The modes that take one decision for every block."""
_UNIFORM = {"full": "recompute", "selective": "selective", "offload": "offload"}
"""The decision every block takes under a uniform `--remat` mode."""


def policy(decision: str, offload_names: tuple[str, ...] | None = None):
    """The `jax.checkpoint` policy of a decision (None for `keep`: no checkpoint at all).

    Args:
      decision: one of `DECISIONS`.
      offload_names: what `offload` moves to the host and `selective` keeps (see the module
        docstring); None: the tensor-parallel dense layers' outputs and matmuls without batch
        dimensions.

    Returns:
      The policy, or None for `keep`.

    Raises:
      ValueError: an unknown decision.
    """
    cp = jax.checkpoint_policies
    if decision == "keep":
        return None
    if decision == "recompute":
        return cp.nothing_saveable
    check_choice("activation decision", decision, DECISIONS)
    names = list(offload_names or (TP_DENSE_NAME,))
    if decision == "selective":
        named, dots = cp.save_only_these_names(*names), cp.dots_with_no_batch_dims_saveable
    else:
        named = cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], offload_src="device", offload_dst="pinned_host",
            names_which_can_be_offloaded=names)
        dots = cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    if offload_names is not None:
        return named
    recompute = named(None)  # what a policy answers for an operation it does not keep

    def names_or_dots(prim, *args, **params):
        decided = named(prim, *args, **params)
        return dots(prim, *args, **params) if decided is recompute else decided

    return names_or_dots


def wrapper(decision: str, offload_names: tuple[str, ...] | None = None):
    """`f(params, x) -> x` wrapper of a layer function for a decision (None for `keep`).

    Args:
      decision: one of `DECISIONS`.
      offload_names: as `policy` takes them.

    Returns:
      A function that wraps a layer function in `jax.checkpoint` with the decision's policy, or
      None for `keep`.
    """
    pol = policy(decision, offload_names)
    return None if pol is None else (lambda f: jax.checkpoint(f, policy=pol))


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Device FLOP rate (FLOP/s) and host-link bandwidth (bytes/s, each direction)."""

    name: str
    flops_per_s: float
    host_bytes_per_s: float


SPECS = {
    # Dense bf16 peak and PCIe Gen5 x16 (~55 GB/s achievable per direction, the rate public
    # reports give: `analysis.comm_model.H100_HOST_LINK`).
    "h100": DeviceSpec("h100", 989e12, 55e9),
    "h200": DeviceSpec("h200", 989e12, 55e9),
}


def calibrate(size: int = 512, repeats: int = 4) -> DeviceSpec:
    """Measure the default device: a `size`² f32 matmul's FLOP rate, a `pinned_host` round trip.

    Args:
      size: the matmul's side.
      repeats: timed runs of each.

    Returns:
      A `DeviceSpec` of the measured FLOP rate and host-copy bandwidth (a 16 MiB array).
    """
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), dev)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a = mm(a) * 1e-3
    a.block_until_ready()
    flops = 2 * size**3 * repeats / (time.perf_counter() - t0)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    big = jax.device_put(jnp.ones((16 * 2**20 // 4,), jnp.float32), dev)
    jax.device_put(big, host).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.device_put(big, host).block_until_ready()
    bandwidth = big.nbytes * repeats / (time.perf_counter() - t0)
    return DeviceSpec(f"calibrated {dev.platform}", flops, bandwidth)


def device_spec(device=None) -> DeviceSpec:
    """The named spec of `device`'s kind, else a calibration of the default device.

    The default device must then be of the same platform (a program compiled for abstract GPUs is
    never calibrated on this host's CPU).

    Args:
      device: a `jax.Device` (None: the default device; the step passes its mesh's first device).

    Returns:
      The `DeviceSpec` of `SPECS` whose name is in its kind, or `calibrate()`.

    Raises:
      ValueError: no spec for its kind and another platform than this process's default.
    """
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    for name, spec in SPECS.items():
        if name in kind:
            return spec
    if device.platform != jax.devices()[0].platform:
        raise ValueError(f"--remat auto: no device spec for {device.device_kind!r} and it cannot "
                         f"be calibrated from this {jax.devices()[0].platform} process; known: "
                         f"{', '.join(SPECS)}")
    return calibrate()


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block's measured costs per decision, and its forward FLOPs.

    Per decision: device and host residual bytes, extra backward FLOPs over `keep`. Bytes are per
    device (the local batch).
    """

    device_bytes: dict
    host_bytes: dict
    extra_flops: dict
    forward_flops: float


def _saved_residuals(f, *args):
    # The helper behind the public `jax.ad_checkpoint.print_saved_residuals`.
    from jax._src.ad_checkpoint import saved_residuals

    return saved_residuals(f, *args)


def matmul_flops(jaxpr) -> float:
    """FLOPs of the `dot_general`s of a jaxpr, sub-jaxprs (jit, scan, remat, custom rules) included.

    Counted on the jaxpr rather than the compiled program because XLA's CSE may merge a recomputed
    forward with the original one in a small test program, hiding the cost of recomputation.

    Args:
      jaxpr: a `jax.core.Jaxpr` (a closed jaxpr's `.jaxpr`).

    Returns:
      2 × output elements × contracted size, summed; a scan's body times its length.
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            total += 2.0 * np.prod(out.shape) * np.prod([lhs.shape[i] for i in contract])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += matmul_flops(inner) * (eqn.params.get("length", 1)
                                                    if eqn.primitive.name == "scan" else 1)
    return total


def block_cost(block: Callable, params, x, offload_names: tuple[str, ...] | None = None) -> BlockCost:
    """Measure one block's residual bytes and FLOPs under every decision.

    Args:
      block: `block(params, x) -> x`.
      params: its parameters, abstract.
      x: its input, abstract: this device's share of the activations, in the dtypes the step
        computes in.
      offload_names: as `policy` takes them.

    Returns:
      The block's `BlockCost`.
    """
    dev, host, extra = {}, {}, {}
    grad_flops = {}
    for d in DECISIONS:
        w = wrapper(d, offload_names)
        f = block if w is None else w(block)
        dev[d] = host[d] = 0
        for aval, where in _saved_residuals(f, params, x):
            if where.startswith("from the argument p"):  # parameters are state, not activations
                continue
            nbytes = int(np.prod(aval.shape)) * aval.dtype.itemsize
            if "Host" in str(getattr(aval, "memory_space", "")):
                host[d] += nbytes
            else:
                dev[d] += nbytes
        train = lambda p, h, ct, f=f: jax.vjp(f, p, h)[1](ct)
        # The cotangent of the block's output, whose dtype may differ from x's (the step casts
        # the output back to x's dtype after the block).
        ct = jax.eval_shape(f, params, x)
        grad_flops[d] = matmul_flops(jax.make_jaxpr(train)(params, x, ct).jaxpr)
    for d in DECISIONS:
        extra[d] = max(0.0, grad_flops[d] - grad_flops["keep"])
    return BlockCost(dev, host, extra, matmul_flops(jax.make_jaxpr(block)(params, x).jaxpr))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-layer decisions, first layer first; predictions in bytes per device and seconds."""

    decisions: tuple[str, ...]
    predicted_peak: int | None = None
    predicted_extra_s: float | None = None
    budget: int | None = None

    def groups(self) -> tuple[tuple[int, str], ...]:
        """Runs of equal decisions, first layer first.

        Returns:
          `((count, decision), ...)`.
        """
        out: list[list] = []
        for d in self.decisions:
            if out and out[-1][1] == d:
                out[-1][0] += 1
            else:
                out.append([1, d])
        return tuple((n, d) for n, d in out)

    def layer_groups(self, offload_names: tuple[str, ...] | None = None):
        """The runs of `groups` with each decision's layer wrapper, for `step.model.scan_layers`.

        Args:
          offload_names: as `policy` takes them.

        Returns:
          `((count, wrap), ...)`, `wrap` as `wrapper` gives it.
        """
        return tuple((n, wrapper(d, offload_names)) for n, d in self.groups())

    def describe(self, compiled_peak: int | None = None) -> str:
        """One line of the plan's groups, its predictions and budget.

        Args:
          compiled_peak: the compiled step's peak bytes per device, shown beside (None: not).

        Returns:
          The line, bytes in MiB and time in ms.
        """
        text = "activation plan: " + ", ".join(f"{n}×{d}" for n, d in self.groups())
        if self.predicted_peak is not None:
            text += (f"; predicted peak {self.predicted_peak / 2**20:.1f} MiB"
                     f", predicted extra time {self.predicted_extra_s * 1e3:.2f} ms/step")
        if self.budget is not None:
            text += f" (budget {self.budget / 2**20:.1f} MiB)"
        if compiled_peak is not None:
            text += f"; compiled peak {compiled_peak / 2**20:.1f} MiB"
        return text


def extra_time(cost: BlockCost, decision: str, spec: DeviceSpec) -> float:
    """Predicted extra step time of one block taking `decision`.

    Its extra FLOPs, plus the part of its host transfers (out in the forward, back in the
    backward) that the block's own forward (resp. twice as long backward) compute does not hide.

    Args:
      cost: the block's costs.
      decision: one of `DECISIONS`.
      spec: the device's rates.

    Returns:
      Seconds per step.
    """
    t = cost.extra_flops[decision] / spec.flops_per_s
    move = cost.host_bytes[decision] / spec.host_bytes_per_s
    compute = cost.forward_flops / spec.flops_per_s
    return t + max(0.0, move - compute) + max(0.0, move - 2 * compute)


PLAN_ORDER = ("offload", "recompute", "selective", "keep")
"""The order of a plan's blocks, first layer first (see the module docstring)."""


def _compositions(total: int, parts: int) -> np.ndarray:
    """Every row of `parts` non-negative integers summing to `total`: `(rows, parts)` int64."""
    grids = np.meshgrid(*[np.arange(total + 1)] * (parts - 1), indexing="ij")
    rows = np.stack([g.ravel() for g in grids], axis=1)
    rows = rows[rows.sum(axis=1) <= total]
    return np.concatenate([rows, total - rows.sum(axis=1, keepdims=True)], axis=1)


def plan(cost: BlockCost, num_layers: int, budget: int, base_peak: int, spec: DeviceSpec) -> Plan:
    """The fastest plan whose predicted peak fits `budget` bytes.

    Args:
      cost: one block's costs.
      num_layers: the blocks of the stack.
      budget: bytes per device.
      base_peak: compiled peak with every block recomputed.
      spec: the device's rates.

    Returns:
      The plan of the least predicted time (then the least peak), blocks in `PLAN_ORDER`.

    Raises:
      ValueError: naming the smallest feasible budget when none fits.
    """
    per = {d: cost.device_bytes[d] - cost.device_bytes["recompute"] for d in DECISIONS}
    counts = _compositions(num_layers, len(PLAN_ORDER))
    peaks = base_peak + counts @ np.array([per[d] for d in PLAN_ORDER], np.float64)
    times = counts @ np.array([extra_time(cost, d, spec) for d in PLAN_ORDER])
    fits = np.flatnonzero(peaks <= budget)
    if not fits.size:
        smallest = base_peak + num_layers * min(per.values())
        raise ValueError(
            f"--memory-budget {budget / 1e9:.4g} GB is infeasible: the smallest feasible budget for "
            f"this model, batch and grid is {smallest / 1e9:.4g} GB ({smallest:,} bytes per device, "
            f"every block {min(per, key=per.get)})")
    best = fits[np.lexsort((peaks[fits], times[fits]))[0]]  # the least time, then the least peak
    decisions = sum(((d,) * int(n) for n, d in zip(counts[best], PLAN_ORDER)), ())
    return Plan(decisions, int(peaks[best]), float(times[best]), budget)


def uniform_plan(remat, num_layers: int) -> Plan | None:
    """The plan of a uniform `--remat` mode, or a given `Plan`.

    Args:
      remat: `none`, `full`, `selective`, `offload`, or a `Plan`.
      num_layers: the blocks of the stack.

    Returns:
      None for `none`; the `Plan` as it is; else every block taking the mode's decision.

    Raises:
      ValueError: a `Plan` of another number of layers.
    """
    if isinstance(remat, Plan):
        if len(remat.decisions) != num_layers:
            raise ValueError(f"activation plan of {len(remat.decisions)} layers for a model of "
                             f"{num_layers}")
        return remat
    if remat == "none":
        return None
    return Plan((_UNIFORM[remat],) * num_layers)


def check_options(remat, memory_budget_gb: float | None) -> None:
    """Reject flag combinations that would be silently ignored.

    Args:
      remat: a `--remat` mode (`REMAT_MODES`) or a `Plan`.
      memory_budget_gb: `--memory-budget` in GB, or None.

    Raises:
      ValueError: an unknown mode, a budget without `auto`, or `auto` without a positive budget.
    """
    if isinstance(remat, Plan):
        return
    check_choice("--remat", remat, REMAT_MODES)
    if memory_budget_gb is not None and remat != "auto":
        raise ValueError(f"--memory-budget is used by --remat auto only (got --remat {remat})")
    if remat == "auto" and (memory_budget_gb is None or memory_budget_gb <= 0):
        raise ValueError(f"--remat auto needs a positive --memory-budget GB, got {memory_budget_gb}")


def make_plan(num_layers: int, budget: int, cost: BlockCost, measure_peak: Callable[[Plan], int],
              spec: DeviceSpec) -> Plan:
    """KARMA's plan for `budget` bytes per device.

    Args:
      num_layers: the blocks of the stack.
      budget: bytes per device.
      cost: one block's costs (`block_cost`).
      measure_peak: compiles the train step with a plan and returns its peak bytes per device;
        it calibrates both ends (all recompute, all keep).
      spec: the device's rates.

    Returns:
      The `plan` for `budget`.

    Raises:
      ValueError: no plan fits `budget`.
    """
    base_peak = measure_peak(Plan(("recompute",) * num_layers))
    keep_peak = measure_peak(Plan(("keep",) * num_layers))
    # What a kept block adds in the whole program (XLA's buffers, not only autodiff's residuals),
    # so that the prediction is exact for all-keep and all-recompute.
    keep = cost.device_bytes["recompute"] + max(0, keep_peak - base_peak) // num_layers
    cost = dataclasses.replace(cost, device_bytes={**cost.device_bytes, "keep": keep})
    return plan(cost, num_layers, budget, base_peak, spec)


def compiled_peak_bytes(compiled) -> int:
    """Peak bytes per device of a compiled program, from its memory analysis.

    The live-bytes bound arguments + outputs - aliased + temporaries is used where XLA's
    `peak_memory_in_bytes` falls outside it: the CPU backend's leaves out the temporaries (it can be
    smaller than the temp allocation), and XLA:GPU's counts buffers in host memory too once
    activations are offloaded (it then reports the device bound plus the host temporaries).

    Args:
      compiled: a `jax.stages.Compiled`.

    Returns:
      Bytes per device.
    """
    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0)
    bound = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return int(peak if mem.temp_size_in_bytes <= peak <= bound else bound)
