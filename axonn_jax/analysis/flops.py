"""FLOPs of a train step: what the compiled program does, what the model needs, the peak.

The peak is what MFU divides by.

- `compiled_flops(compiled)`: the floating-point operations one device runs per call of a
  compiled (per-device, SPMD-partitioned) program, matmuls, elementwise ops, reductions and the
  optimizer's update included, counted from its HLO (`hlo.flops`) with XLA's cost-analysis
  conventions but loops multiplied by their trip counts: `compiled.cost_analysis()` counts a
  `while` body once, so for a step that scans its layers it reports about one layer's worth.
- `model_flops_per_device(config, tokens, seq_len, devices)`: the model's training FLOPs (forward
  + backward, `flops_per_token`: the matmuls and attention scores) of `tokens` tokens, split
  evenly over `devices`: what an ideal step runs on each device.
- `nominal_peak_flops(device, dtype)`: the dense peak of a known GPU in a 16-bit dtype, or None
  (no peak is assumed for a CPU, an unknown device or float32, whose matmul precision varies).

Their ratio `compiled / model` shows the work repeated across devices and the work outside the
matmuls; MFU = model FLOPs per device / step time / peak.
"""
from __future__ import annotations

from .hlo import flops

NOMINAL_BF16_PEAK = {"h100": 989e12, "h200": 989e12, "a100": 312e12}
"""Dense bf16/fp16 tensor-core FLOP/s by device kind (SXM parts)."""


def compiled_flops(compiled) -> float:
    """FLOPs one device runs per call of `compiled`, loops by trip count.

    Args:
      compiled: a `jax.stages.Compiled`.

    Returns:
      `hlo.flops` of its optimized HLO.
    """
    return flops(compiled.as_text())


def model_flops_per_device(config, tokens: int, seq_len: int, devices: int) -> float:
    """Training FLOPs of `tokens` tokens of `config` per device of `devices`.

    Args:
      config: a model config with `flops_per_token`.
      tokens: the tokens of the step.
      seq_len: positions per sequence.
      devices: the devices that share the work evenly.

    Returns:
      FLOPs per device.
    """
    return config.flops_per_token(seq_len) * tokens / devices


def nominal_peak_flops(device, dtype) -> float | None:
    """The nominal dense peak FLOP/s of `device` computing in `dtype`, or None when not known.

    Args:
      device: a `jax.Device`.
      dtype: the compute dtype.

    Returns:
      The peak of `NOMINAL_BF16_PEAK` for a GPU of a known kind in bfloat16 or float16; None
      otherwise.
    """
    import jax.numpy as jnp

    if device.platform != "gpu" or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16),
                                                             jnp.dtype(jnp.float16)):
        return None
    kind = device.device_kind.lower()
    return next((peak for name, peak in NOMINAL_BF16_PEAK.items() if name in kind), None)
