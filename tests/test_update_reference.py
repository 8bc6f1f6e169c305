"""The trainer's update against an independent reference written here in NumPy (float64): AdamW as
optax applies it (b1 = 0.9, b2 = 0.95, eps = 1e-8, bias-corrected moments, decoupled weight decay
scaled by the learning rate), the linear warm-up and cosine decay of the learning rate, and
global-norm clipping. A few steps of a tiny model on one device: after every step the parameters,
both Adam moments and the logged gradient norm equal the reference's. The gradients come from
`jax.grad` of the step's own loss at the reference's parameters (the float16 case scales the loss
by the step's loss scale first, as the step does, and divides after)."""
import math

import jax
import numpy as np
import pytest

from axonn_jax.train import TrainOptions, build_trainer

import user_models as um
from conftest import (adam_state, assert_states_match, comparable_state, field,
                      relative_difference)

STEPS, WARMUP, LR, WEIGHT_DECAY = 5, 2, 1e-2, 0.1
B1, B2, EPS = 0.9, 0.95, 1e-8
CLIP = 0.05  # below every step's gradient norm here (asserted): clipping fires at every step


def learning_rate(step: int) -> float:
    """Linear warm-up from 0 over WARMUP steps, then a cosine from LR down to LR / 10 at STEPS."""
    if step < WARMUP:
        return LR * step / WARMUP
    decay = max(STEPS, WARMUP + 1) - WARMUP
    end = 0.1 * LR
    return end + (LR - end) * 0.5 * (1 + math.cos(math.pi * min(step - WARMUP, decay) / decay))


def reference_step(params, mu, nu, grads, step: int, clip_norm):
    """One AdamW step (step = 0, 1, ...) on float64 NumPy trees after clipping the gradients'
    global norm to `clip_norm` (None: no clipping). Returns (params, mu, nu, norm)."""
    leaves = jax.tree.leaves(grads)
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in leaves))
    factor = 1.0 if clip_norm is None or norm < clip_norm else clip_norm / norm
    t = step + 1
    lr = learning_rate(step)
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * factor * g, mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * (factor * g) ** 2, nu, grads)

    def update(p, m, v):
        adam = (m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS)
        return p - lr * (adam + WEIGHT_DECAY * p)

    return jax.tree.map(update, params, mu, nu), mu, nu, norm


# (options, resync, tolerance). fp32: the reference runs its own trajectory. float16: the same fp16
# gradients computed in another program differ by about one fp16 ulp (XLA places the fp16/fp32
# conversions differently; measured 6.4e-4 of a leaf's largest moment at step 1), and fp16
# differences grow from step to step (1e-2 in mu by step 4), so every step starts from the step's
# own state (`resync`) and each update is checked on its own, within 2e-3.
CASES = {
    "adamw": (dict(clip_norm=None), False, 1e-5),
    "adamw-clipped": (dict(clip_norm=CLIP), False, 1e-5),
    "offload-clipped": (dict(clip_norm=CLIP, offload_optimizer=True), False, 1e-5),
    "float16-offload": (dict(clip_norm=None, dtype="float16", offload_optimizer=True), True, 2e-3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_equals_numpy_reference(devices, case):
    options, resync, tolerance = CASES[case]
    data = um.sequence_batches(8)
    trainer = build_trainer(
        TrainOptions(steps=STEPS, batch_size=8, lr=LR, warmup_steps=WARMUP,
                     weight_decay=WEIGHT_DECAY, **options),
        devices[:1], model=um.regressor(), example_batch=data(0))
    assert [float(trainer.lr_schedule(s)) for s in range(STEPS)] == pytest.approx(
        [learning_rate(s) for s in range(STEPS)], rel=1e-6)
    assert learning_rate(0) == 0 and learning_rate(1) > 0  # the warm-up is part of the check
    state = trainer.init_state()
    as_float64 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float64), tree)  # noqa: E731
    params = as_float64(comparable_state(trainer, state)["params"])
    mu, nu = (jax.tree.map(np.zeros_like, params) for _ in range(2))
    loss_fn = trainer.bound.loss_fn  # the step's loss: parameters cast to the compute dtype
    grad = jax.jit(jax.grad(lambda p, b, scale: loss_fn(p, b) * scale))
    for step in range(STEPS):
        batch = data(step)
        precision = field(state, "precision", None)
        scale = float(precision["scale"]) if precision is not None else 1.0
        assert (scale > 1) == (options.get("dtype") == "float16")
        # At the parameters the forward computes with (the compute dtype), as the step does.
        at = jax.tree.map(lambda x: jax.numpy.asarray(x, trainer.bound.compute_dtype), params)
        grads = jax.tree.map(lambda g: np.asarray(g, np.float64) / scale,
                             grad(at, batch, np.float32(scale)))
        params, mu, nu, norm = reference_step(params, mu, nu, grads, step, options["clip_norm"])
        state, metrics = trainer.step(state, trainer.place(batch))
        assert relative_difference(float(metrics["grad_norm"]), norm) <= tolerance
        if options["clip_norm"]:
            assert norm > options["clip_norm"]
        got = comparable_state(trainer, state)
        adam = adam_state(field(got, "opt_state"))
        assert int(adam.count) == step + 1
        got = {"params": field(got, "params"), "mu": adam.mu, "nu": adam.nu}
        assert_states_match(got, {"params": params, "mu": mu, "nu": nu}, rtol=tolerance,
                            params_rtol=tolerance, zero_gradient=None)
        if resync:  # the next step from the step's own state: each update checked on its own
            params, mu, nu = (as_float64(got[k]) for k in ("params", "mu", "nu"))
    if precision is not None:
        assert int(field(state, "precision")["skipped_steps"]) == 0
