"""Ulysses context attention (`parallel.ulysses`, `--context-attention ulysses`): equals one
device's attention (outputs and q/k/v gradients, fp32) on context 2, 4 and 8 with a data axis,
packed documents and grouped-query heads (key/value heads repeated when fewer than devices);
GPT and Llama train like one device on data × context and context × row grids; heads that do not
split over context get one line. `tests/test_context.py` runs its scheme-parametrized checks on
it too (compiled collective bytes against `context.collectives`, no hoisted masks), and
`tests/test_axes_model.py` the communication model of a whole step."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from axonn_jax import ParallelConfig
from axonn_jax.analysis import comm_model as cm
from axonn_jax.models import gpt, llama
from axonn_jax.parallel import context, ulysses
from axonn_jax.run.plan import workload
from axonn_jax.train import TrainOptions, train

from test_batch_axes import OPTS, assert_trains_like, one_device  # noqa: F401  (a fixture)
from test_context import (assert_attention_equals_one_device, documents, grid, qkvw,
                          test_models_train_on_data_by_context_as_on_one_device as train_steps)

CASES = [  # context, data, heads, kv_heads, documents, query tile
    (2, 1, 4, 4, None, 4), (2, 2, 4, 1, "ids+positions", 512), (4, 1, 8, 2, "ids", 2),
    (4, 2, 4, 4, "ids+positions", 512), (8, 1, 8, 8, "ids+positions", 512),
]


@pytest.mark.parametrize("size, data, heads, kv_heads, docs, tile", CASES,
                         ids=[f"context{c}-data{d}-heads{h}-kv{k}-{x or 'nodocs'}-tile{t}"
                              for c, d, h, k, x, t in CASES])
def test_ulysses_equals_one_device(size, data, heads, kv_heads, docs, tile):
    """Outputs and q/k/v gradients (sequence 32 over `size` devices in the zig-zag layout, rows
    over `data`, `tile` queries at a time) equal one device's, fp32, relative ≤ 1e-5."""
    rows, seq = 2 * data, 32
    q, k, v, w = qkvw(rows, seq, heads, kv_heads, seed=size)
    seg, pos = documents(rows, seq, seed=size) if docs else (None, None)
    pos = pos if docs == "ids+positions" else None
    assert_attention_equals_one_device("ulysses", size, data, tile, q, k, v, w, seg, pos)


def test_heads_that_do_not_split_over_context_get_one_line():
    run = lambda q, k, v: jax.jit(jax.shard_map(  # noqa: E731
        lambda q, k, v: context.attention(q, k, v, scheme="ulysses"), mesh=grid(1, 4),
        in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context")))(q, k, v)
    for heads, kv_heads in ((6, 2), (12, 6)):
        q, k, v, _ = qkvw(1, 16, heads, kv_heads)
        with pytest.raises(ValueError, match=f"ulysses attention splits heads over context 4: "
                                             f"{heads} query heads and {kv_heads} key/value "
                                             "heads must be multiples of 4"):
            run(q, k, v)


@pytest.mark.parametrize("family", [llama, gpt], ids=["llama", "gpt"])
def test_models_train_on_data_by_context_as_on_one_device(family):
    """`tests/test_context.py`'s two SGD steps of llama-tiny (4 query, 2 key/value heads: each
    repeated for context 4) or gpt-tiny on packed documents, data 2 × context 4."""
    train_steps(family, "ulysses")


@pytest.mark.parametrize("model, grid, options", [
    ("gpt-tiny", dict(data=2, context=2), {}), ("llama-tiny", dict(context=2, row=2), {}),
    ("gpt-tiny-deep", dict(pipe=2, context=2, data=2), dict(microbatches=2, schedule="1f1b")),
], ids=["data2-context2", "context2-row2", "pipe2-context2-data2"])
def test_trainer_grids_train_like_one_device(devices, one_device, model, grid,  # noqa: F811
                                             options):
    """Three Adam steps through `train` give one device's losses, norms, parameters and moments
    (`tests/test_batch_axes.py`); over row, llama-tiny's one key/value head per device is
    repeated for context 2; inside pipeline stages on XLA:CPU (no deadlock, unlike the ring)."""
    grid = ParallelConfig(**grid)
    got = train(TrainOptions(**OPTS, **options, context_attention="ulysses", model=model,
                             parallel=grid), devices=devices[:grid.num_devices])
    assert_trains_like(got, one_device(model))


def test_plan_counts_its_all_to_alls_and_flops():
    """`plan`'s model of a gpt-tiny step on data 2 × context 4: the all-to-all bytes over
    `context` equal `context.collectives` per layer (forward and backward), the all-gather of
    the segment ids none (the trainer passes none), and the executed FLOPs count every score at
    7/6 (`ulysses.flops_share`)."""
    options = TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32, context_attention="ulysses",
                           parallel=ParallelConfig(data=2, context=4))
    work = workload(options, "cpu")
    predicted = cm.bytes_by_axes(work, options.parallel, True)
    config = gpt.PRESETS["gpt-tiny"]
    head_dim = config.d_model // config.num_heads
    shape = (16 // 2, 32 // 4, config.num_heads, head_dim)
    per_layer = context.collectives("ulysses", shape, np.float32, 4, q_shape=shape)
    assert per_layer == [("all-to-all", "context", 2 * 4 * np.prod(shape) * 4)]
    assert predicted[("all-to-all", ("context",))] == config.num_layers * per_layer[0][2]
    assert ulysses.flops_share(4) == context.flops_share(4, "ulysses") == pytest.approx(7 / 6)
