"""CGX's compressed exchange inside the backward (`step.layer_exchange` with the reducer's
`LayerExchange`): each layer's gradients quantized with their own residual and sent while the
layers below compute their backward, the same trajectory as the exchange after the backward."""
import jax
import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run.data import Corpus
from axonn_jax.train import TrainOptions, build_trainer

from conftest import (PARITY, assert_states_match, assert_steps_match, comparable_state,
                      field, lm_batches, run_steps)

OPTS = dict(steps=3, batch_size=16, seq_len=32, **PARITY)
GRIDS = [dict(data=2), dict(data=2, row=2)]


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(None, min_tokens=OPTS["seq_len"] + 2).train


def run(options, devices, corpus):
    """(records, final state, trainer) of `options.steps` train steps."""
    grid = options.parallel
    n = grid.data * grid.depth * grid.row * grid.col
    trainer = build_trainer(options, devices[:n])
    state, records = run_steps(trainer, trainer.init_state(), lm_batches(trainer, corpus),
                               options.run.steps)
    return records, state, trainer


def _pair(devices, corpus, grid, **kw):
    """The same run with CGX inside the backward and after it."""
    base = dict(**OPTS, parallel=ParallelConfig(**grid), compress_bits=4, **kw)
    return (run(TrainOptions(**base), devices, corpus),
            run(TrainOptions(**base, compress_in_backward=False), devices, corpus))


@pytest.mark.parametrize("grid", GRIDS, ids=["data2", "data2-row2"])
def test_error_feedback_in_backward_equals_after_backward(devices, corpus, grid):
    """Nearest rounding with error feedback quantizes every bucket the same way in both places:
    the losses, gradient norms, parameters, optimizer state and residuals agree within 1e-6
    (bitwise on XLA:CPU with JAX 0.12; another fusion of the same math may round differently)."""
    (got, g_state, g_tr), (want, w_state, w_tr) = _pair(devices, corpus, grid)
    assert g_tr.bound.engine.exchanges_layers and not w_tr.bound.engine.exchanges_layers
    assert_steps_match(got, want, 1e-6)
    assert_states_match(comparable_state(g_tr, g_state), comparable_state(w_tr, w_state),
                        rtol=1e-6, params_rtol=1e-6)
    for a, b in zip(jax.tree.leaves(field(g_state, "reducer")),
                    jax.tree.leaves(field(w_state, "reducer"))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert any(np.any(np.asarray(r)) for r in jax.tree.leaves(field(g_state, "reducer")))


def test_stochastic_rounding_in_backward_tracks_after_backward(devices, corpus):
    """Without error feedback (stochastic rounding, each layer's key the step's folded with its
    index): data=2 × row=2 at 4 bits, the in-backward run within the bounds the after-backward
    one keeps to the exact run (losses 2%, gradient norms 10%), and reproducible."""
    grid = dict(data=2, row=2)
    (got, g_state, g_tr), (want, _, _) = _pair(devices, corpus, grid, error_feedback=False)
    assert g_tr.bound.engine.exchanges_layers and field(g_state, "reducer", None) is None
    assert 0 < assert_steps_match(got, want, 2e-2, 1e-1)
    again, _, _ = run(TrainOptions(**OPTS, parallel=ParallelConfig(**grid), compress_bits=4,
                                   error_feedback=False), devices, corpus)
    assert [r["loss"] for r in again] == [r["loss"] for r in got]
