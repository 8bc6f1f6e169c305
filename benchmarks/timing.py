"""Timing shared by the benchmark scripts: medians of repeated, synchronized calls."""
from __future__ import annotations

import statistics
import time


def median_step_time(step, state, batch, repeats: int):
    """Median seconds of `state, metrics = step(state, batch)` over `repeats` calls, after one
    warm-up call (which compiles a jitted `step`). Returns (seconds, final state)."""
    import jax

    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state
