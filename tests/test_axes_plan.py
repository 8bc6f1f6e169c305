"""The planner over the context and expert axes (issues 26, 27): which grids it enumerates, the
memory that makes long sequences need `context`, the experts' shards and FLOPs, and the cost of
expert imbalance. Pure Python: nothing compiles (the byte counts against compiled programs are
tests/test_axes_model.py)."""
import dataclasses

import pytest

from axonn_jax import ParallelConfig as P
from axonn_jax.analysis import comm_model as cm
from axonn_jax.models import llama, mixtral
from axonn_jax.models.moe import DENSE_RAGGED_DOT

H100 = cm.MACHINES["h100-dgx"]


def test_long_sequences_plan_a_context_grid():
    """Llama-3.1-8B, one 131,072-token sequence on 16 H100s: with XLA's attention a grid without
    `context` keeps every head's seq² probabilities and fits nowhere; with cuDNN's fused kernel
    (the default in bf16) such grids fit, and the planner's pick keeps the sequence whole: the
    context axis runs XLA's attention core on each block pair, whose scores cross the HBM
    (`comm_model.memory_bound_bytes`' `softmax`; two thirds of the replayed step of the scale
    table's context row), where cuDNN's kernel keeps them on chip; every pick fits 80 GB, its
    activations about 1/context of the same grid's without the split."""
    work = cm.Workload(llama.PRESETS["llama3.1-8b"], 1, 131072)
    ranked = cm.plan(work, 16, H100)
    assert ranked and ranked[0].grid.context == 1
    assert any(p.grid.context > 1 for p in ranked)
    unfused = dataclasses.replace(work, model=dataclasses.replace(work.model, attention="xla"))
    assert all(p.grid.context > 1 for p in cm.plan(unfused, 16, H100))
    assert all(p.memory_per_device_bytes <= H100.device_memory for p in ranked)
    assert "context" in cm.searched_axes(work) and "expert" not in cm.searched_axes(work)
    split, whole = (cm.memory_per_device(unfused, P(context=c, row=4, col=16 // (4 * c)))
                    for c in (4, 1))
    # The 16 activations of a block over 4× fewer tokens (probabilities gone besides).
    assert split["activations"] < whole["activations"] / 4
    odd = dataclasses.replace(work, seq_len=131072 + 8)
    assert "not divisible by 2·context" in cm.infeasible_reason(odd, P(context=16))
    assert not cm.plan(odd, 16, H100, P(context=16))


def test_experts_split_over_the_expert_axis_and_imbalance_costs_time():
    """Mixtral-8x7B: expert grids are enumerated (dividing the 8 experts); the expert axis
    divides the experts' parameters; FLOPs executed are what the GPU's grouped kernels run (the
    routed rows), on CPU what jaxlib's dense ragged_dot runs; a stated imbalance adds exactly
    the experts' share of compute times (imbalance − 1)."""
    work = cm.Workload(mixtral.PRESETS["mixtral-8x7b"], 64, 4096)
    assert "expert" in cm.searched_axes(work)
    grids = cm.candidate_grids(work, 16)
    assert any(g.expert == 8 for g in grids)
    assert cm.infeasible_reason(work, P(expert=16)) is not None  # 8 experts over 16 devices
    one, eight = (cm.parameters_per_device(work, P(expert=e, row=2)) for e in (1, 8))
    experts = 32 * 8 * 3 * 4096 * 14336 / 2  # routed expert weights per device at expert=1
    assert one - eight == pytest.approx(experts * 7 / 8, rel=1e-9)
    d = cm.declared(work, P(expert=8, pipe=8))
    ideal = 3 * 2 * 3 * 4096 * 14336 * 2 * 64 * 4096 * 32  # top-2 of 3 projections, 32 layers
    assert d.flops - d.executed_flops == pytest.approx(ideal - d.expert_flops, rel=1e-9)
    # On GPU the grouped kernels run the routed rows (plus a tile of rows per local expert and
    # call); on CPU, if DENSE_RAGGED_DOT, every row meets each local expert: 8× at expert=1.
    assert cm.declared(work, P(row=8)).expert_flops == pytest.approx(ideal, rel=2e-3)
    if DENSE_RAGGED_DOT:
        on_cpu = dataclasses.replace(work, platform="cpu")
        assert cm.declared(on_cpu, P(row=8)).expert_flops == pytest.approx(8 * ideal, rel=1e-9)
    grid = P(expert=8, pipe=8)
    base, skewed = (cm.predict(dataclasses.replace(work, microbatches=8, expert_imbalance=x),
                               grid, H100) for x in (1.0, 1.5))
    assert base.expert_imbalance_s == 0 and skewed.expert_imbalance_s > 0
    assert skewed.compute_s - base.compute_s == pytest.approx(skewed.expert_imbalance_s)
    assert skewed.memory_per_device_bytes > base.memory_per_device_bytes
    # A device holding every expert takes every token's choices: no cost.
    whole = cm.predict(dataclasses.replace(work, microbatches=8, expert_imbalance=1.5),
                       P(pipe=8, row=8), H100)
    assert whole.expert_imbalance_s == 0
