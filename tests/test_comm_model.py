"""The communication model: its byte counts against the compiled HLO of the real train step, and
the planner's behaviour."""
import dataclasses
import json
import math
import pathlib

import pytest

from axonn_jax import ParallelConfig
from axonn_jax.mesh import AXES
from axonn_jax.run.cli import main as cli_main
from axonn_jax.models.gpt import get_config
from axonn_jax.analysis import comm_model as cm
from axonn_jax.analysis.hlo import bytes_by_axes as hlo_bytes_by_axes, collectives, wire_bytes
from axonn_jax.parallel.pipeline import make_schedule
from axonn_jax.train import TrainOptions, build_trainer




def compile_train_step(options, devices):
    trainer = build_trainer(options, devices)
    state = trainer.init_state(abstract=True)  # shapes and shardings suffice to compile
    return trainer.step.lower(state, trainer.bound.abstract_batch()).compile()


@pytest.fixture(scope="module")
def compiled_step(devices):
    """The compiled train step per option set, compiled once per module (compiling dominates)."""
    cache = {}

    def get(options):
        key = repr(options)
        if key not in cache:
            cache[key] = compile_train_step(options, devices[: options.parallel.num_devices])
        return cache[key]
    return get


@pytest.fixture(scope="module")
def compiled_hlo(compiled_step):
    """The compiled train step's HLO text per option set."""
    return lambda options: compiled_step(options).as_text()


def workload(options):
    from axonn_jax.run.plan import workload as of_config

    return of_config(options, "cpu")


P = ParallelConfig
# (model, grid, microbatches, schedule, compress_bits): data, tensor (2D, 3D, depth with data),
# pipeline (GPipe, 1F1B) and compressed data parallelism. data=4 alone and pipe=2 with 4
# microbatches also match (within 0.1%) but are left out to keep the compile time down.
GRIDS = [
    ("gpt-tiny", P(data=8), 1, "gpipe", 0),
    ("gpt-tiny", P(row=2, col=2, data=2), 1, "gpipe", 0),
    ("gpt-tiny", P(row=2, col=2, depth=2), 1, "gpipe", 0),
    ("gpt-tiny", P(row=4, col=2), 1, "gpipe", 0),
    ("gpt-tiny", P(depth=2, data=4), 1, "gpipe", 0),
    ("gpt-tiny-deep", P(pipe=2, data=4), 2, "gpipe", 0),
    ("gpt-tiny-deep", P(pipe=4, data=2), 4, "1f1b", 0),
    ("gpt-tiny", P(data=8), 1, "gpipe", 4),
    # Llama (RMSNorm, no biases): 2 key/value heads replicated over row = 4 (GSPMD's layout, with
    # depth); multi-query attention with tied embeddings. Key/value heads split over row (as the
    # GPT's) and the tied head in a pipeline (pipe=2, data=4) also match; left out for time.
    ("llama-tiny", P(row=4, depth=2), 1, "gpipe", 0),
    ("llama-tiny-mqa", P(row=2, col=2, data=2), 1, "gpipe", 0),
]


SCALAR_SLACK = 64
"""Bytes by which a group's scalar all-reduces may differ: XLA adds some gradient-norm partial
sums of one group of devices before reducing them, a compiler choice the model bounds from above
(`comm_model._scalar_collectives`)."""


@pytest.mark.parametrize("model, grid, microbatches, schedule, bits", GRIDS,
                         ids=lambda v: str(v) if not isinstance(v, P) else
                         ",".join(f"{k}={n}" for k, n in v.as_dict().items() if n > 1))
def test_model_bytes_match_compiled_hlo(model, grid, microbatches, schedule, bits, compiled_hlo):
    """Every collective, small ones included (norm statistics, loss and embedding terms, the
    scalars of the loss and gradient norm, members of grouped tuple all-reduces): wire bytes and
    full-buffer bytes per (kind, mesh axes) within 5% of the compiled step's (a key the model
    misses or invents fails, as its ratio is 0 or infinite), and so per kind. On the grid with
    key/value projections replicated over row and split over depth, GSPMD's layout moves some
    kernel slices over other axes than the model names: there per kind only."""
    options = TrainOptions(model=model, batch_size=16, seq_len=32, parallel=grid,
                           microbatches=microbatches, schedule=schedule, compress_bits=bits)
    assert_bytes_match(options, compiled_hlo)


@pytest.mark.parametrize("model, grid, microbatches", [
    ("gpt-tiny", P(row=2, col=2, data=2), 1),
    ("gpt-tiny-deep", P(pipe=2, data=4), 2),
], ids=["data2-row2-col2", "data4-pipe2"])
def test_bfloat16_exchange_bytes_match_compiled_hlo(model, grid, microbatches, compiled_hlo):
    """`--reduce-dtype bfloat16`: the exchange over data is an all-to-all and an all-gather of each
    device's blocks (per layer inside the backward, and of the other parameters), as the model
    counts them (XLA:CPU runs them in float32: 4 bytes an element here)."""
    options = TrainOptions(model=model, batch_size=16, seq_len=32, parallel=grid,
                           microbatches=microbatches, schedule="gpipe", reduce_dtype="bfloat16")
    assert workload(options).reduce_dtype == "bfloat16"
    assert_bytes_match(options, compiled_hlo)


@pytest.mark.parametrize("remat, microbatches", [("full", 2), ("selective", 1)])
def test_accumulation_and_remat_bytes_match_compiled_hlo(remat, microbatches, compiled_hlo):
    """Without a pipeline, gradient accumulation repeats the blocks' weight gathers and
    weight-gradient sums per microbatch, `--remat` the batch-split input gathers: per kind exact
    but for `full`'s reduce-scatters, 6.5% above the model (`comm_model.collectives` says why)."""
    options = TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32, remat=remat,
                           microbatches=microbatches, parallel=P(data=2, depth=2, row=2))
    work, by_kind = workload(options), wire_bytes(compiled_hlo(options))
    assert work.remat == remat
    for kind, want in cm.bytes_by_kind(work, options.parallel).items():
        slack = 0.01
        assert by_kind[kind] == pytest.approx(want, rel=slack, abs=512), kind


def test_collective_matmul_bytes_match_compiled_hlo(compiled_hlo):
    """`--collective-matmul on`: each layer's row gathers are n − 1 collective-permutes of one
    device's block (`DenseLayer`, `tp.tensor.ring_gather`), per (kind, axes) as compiled."""
    options = TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32, collective_matmul="on",
                           parallel=P(row=4, col=2))
    assert workload(options).step(options.parallel).rings
    assert_bytes_match(options, compiled_hlo)


def assert_bytes_match(options, compiled_hlo):
    """`test_model_bytes_match_compiled_hlo`'s comparison of the step of `options`."""
    grid, text, work = options.parallel, compiled_hlo(options), workload(options)
    per_axes = not (cm.shape_of(work.model, grid).replicated and grid.depth > 1)
    for buffers in (False, True):
        measured = hlo_bytes_by_axes(text, grid.as_dict(), buffers)
        predicted = cm.bytes_by_axes(work, grid, buffers)
        assert any(measured.values())
        if not per_axes:
            measured, predicted = ({k: sum(v for (kind, _), v in t.items() if kind == k)
                                    for k in cm.KINDS} for t in (measured, predicted))
        for key in set(measured) | set(predicted):
            got, want = measured.get(key, 0.0), predicted.get(key, 0.0)
            assert abs(got - want) <= max(0.05 * got, SCALAR_SLACK), (key, got, want)
    by_kind = wire_bytes(text)
    for kind, want in cm.bytes_by_kind(work, grid).items():
        assert by_kind[kind] == pytest.approx(want, rel=0.05, abs=SCALAR_SLACK), kind


# Compiled FLOPs per device / the model's FLOPs per device (gpt-tiny, batch 16 × 32), measured:
# the excess over 1 is the work outside the model's matmuls (norms, softmax, GELU, loss, AdamW:
# 11% at this tiny width, less at real widths). Tensor-parallel grids repeat none of it (the batch
# stays split between the dense layers, `tp.tensor`), and split AdamW's update over more devices
# than data=8 does, so they run less than data=8 (before the split layout: 1.17-1.24).
FLOPS_RATIOS = {P(data=8): 1.110, P(depth=2, data=4): 1.077, P(row=2, col=2, data=2): 1.062,
                P(row=2, col=2, depth=2): 1.054, P(row=4, col=2): 1.055, P(row=2, col=4): 1.055,
                P(data=2, depth=2, row=2): 1.062}


def test_compiled_flops_against_model_flops(compiled_step):
    """`flops_per_device_compiled / model_flops_per_device` as `--metrics-out` reports them, on
    data-parallel, depth and 2D/3D tensor-parallel grids (see FLOPS_RATIOS); XLA's own cost
    analysis counts the scanned layers' loop body once and reports less than the model.
    No repeated work (issue 15): every grid runs at most 1.02× the compiled FLOPs per device of
    the data-parallel step of the same model and batch (which repeats nothing by construction;
    the bar 1.02× the model's FLOPs cannot hold at this width, where even data=8 runs 1.11×)."""
    from axonn_jax.analysis.flops import compiled_flops, model_flops_per_device

    config = get_config("gpt-tiny")
    found = {}
    for grid, ratio in FLOPS_RATIOS.items():
        compiled = compiled_step(TrainOptions(model="gpt-tiny", batch_size=16, seq_len=32,
                                              parallel=grid))
        model = model_flops_per_device(config, 16 * 32, 32, grid.num_devices)
        found[grid] = compiled_flops(compiled)
        # Within 2%: XLA versions fuse the elementwise work differently (jaxlib 0.12: data=8 1.116).
        assert found[grid] / model == pytest.approx(ratio, rel=0.02), grid
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        assert cost["flops"] < 0.98 * found[grid]  # the layer loops' bodies counted once
    for grid, flops in found.items():
        assert flops <= 1.02 * found[P(data=8)], grid


@pytest.mark.parametrize("grid", [P(data=2, pipe=2, row=2), P(data=2, pipe=2, depth=2)],
                         ids=["data2,pipe2,row2", "data2,pipe2,depth2"])
def test_tensor_parallel_stage_bytes_match_compiled_hlo(grid, compiled_hlo):
    """Tensor-parallel collectives inside pipeline stages. The model counts what runs: M
    microbatches' forwards and backwards, each forward twice (the backward tick recomputes it) and
    each weight gather or gradient reduction once per microbatch. The compiled loop has a
    conditional forward and backward in each of its T ticks (on simulated CPU devices both
    branches run, `pipeline._cond`), which the HLO count takes as always taken: it equals the
    model's bytes × T / M. Collectives that read only parameters outside the blocks (the tables'
    and the head's depth gathers, the position table's lookup sum) XLA hoists out of the loop:
    the model counts them once per step (`Collective.loop_invariant`) and they are not in the
    loop. (Before they were counted per microbatch, the loop held 16-18% fewer bytes than the
    model: exactly those.)"""
    options = TrainOptions(model="gpt-tiny-deep", batch_size=16, seq_len=32, parallel=grid,
                           microbatches=2, schedule="1f1b")
    ticks = make_schedule("1f1b", grid.pipe, 2).num_ticks
    measured = {k: 0.0 for k in cm.KINDS}
    for c in collectives(compiled_hlo(options)):
        if c.executions % ticks == 0 and c.kind != "collective-permute":  # inside the tick loop
            measured[c.kind] += c.wire_bytes
    predicted = {k: 0.0 for k in cm.KINDS}
    for c in cm.collectives(workload(options), grid):
        if not set(c.axes) & {"data", "pipe"} and not c.loop_invariant:
            predicted[c.kind] += c.wire_bytes(grid) * ticks / 2
    assert any(predicted.values())
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        assert measured[kind] == pytest.approx(predicted[kind], rel=0.05), kind
    # A small re-layout the model leaves out.
    assert measured["all-to-all"] <= 0.01 * sum(measured.values())


def test_planner_ranks_feasible_grids_and_respects_memory():
    work = cm.Workload(get_config("gpt-20b"), batch=1024, seq_len=2048)
    machine = cm.MACHINES["h100-4"]
    ranked = cm.plan(work, 64, machine)
    assert ranked and all(p.grid.num_devices == 64 for p in ranked)
    assert [p.step_time_s for p in ranked] == sorted(p.step_time_s for p in ranked)
    assert all(p.memory_per_device_bytes <= machine.device_memory for p in ranked)
    assert all(cm.infeasible_reason(dataclasses.replace(work, microbatches=p.microbatches), p.grid)
               is None for p in ranked)
    # 20B parameters with fp32 Adam state cannot live on one 80 GB device without sharding.
    assert not cm.plan(work, 64, machine, ParallelConfig(data=64))


def test_more_bandwidth_never_slower_and_compression_cuts_data_bytes():
    work = cm.Workload(get_config("gpt-1.3b"), batch=64, seq_len=1024)
    grid = ParallelConfig(data=8, row=2, col=2)
    slow = cm.MACHINES["consumer-pcie"]
    fast = dataclasses.replace(slow, inter_bw=slow.inter_bw * 10, intra_bw=slow.intra_bw * 10)
    assert cm.predict(work, grid, fast).step_time_s < cm.predict(work, grid, slow).step_time_s
    exact = cm.bytes_by_kind(work, grid)
    packed = cm.bytes_by_kind(dataclasses.replace(work, compress_bits=4), grid)
    assert packed["all-reduce"] < exact["all-reduce"]
    assert packed["all-to-all"] + packed["all-gather"] - exact["all-gather"] < exact["all-reduce"] / 6


LLAMA_ON_A_GRID = ["plan", "--model", "llama2-70b", "--devices", "64", "--batch", "512",
                   "--seq-len", "4096", "--json", "--grid", "data=2,pipe=16,row=2"]
"""`plan` pricing one given grid of llama2-70b (no search: quick)."""


def test_plan_cli_json(capsys):
    rc = cli_main(["plan", "--model", "gpt-20b", "--devices", "16", "--devices-per-node", "4",
                   "--batch", "256", "--seq-len", "2048", "--json", "--top", "3"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    for row in rows:
        assert set(row["grid"]) == set(AXES)
        assert {"step_time_s", "memory_per_device_bytes", "comm_bytes_per_device"} <= set(row)
        assert set(row["comm_bytes_per_device"]) == set(cm.KINDS)
    rc = cli_main(["plan", "--devices", "8", "--batch", "8", "--grid", "data=3"])
    assert rc == 2 and "has 3 devices but 8" in capsys.readouterr().err
    rc = cli_main([*LLAMA_ON_A_GRID, "--top", "1"])
    assert rc == 0 and json.loads(capsys.readouterr().out)[0]["mfu"] > 0


def test_plan_piped_into_head_stops_without_a_traceback():
    """`axonn-jax plan ... | head -c 1`: the reader leaves early; plan stops without an error."""
    import subprocess
    import sys

    plan = [sys.executable, "-m", "axonn_jax", *LLAMA_ON_A_GRID]
    with subprocess.Popen(plan, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        first = proc.stdout.read(1)
        proc.stdout.close()  # what `head -c 1` does once it has its byte
        err = proc.stderr.read().decode()
    assert first == b"[" and err == "", err[-2000:]


def test_auto_grid_trains_on_the_planners_pick(capsys, tmp_path):
    from axonn_jax.run.cli import parse
    from axonn_jax.run.plan import auto_grid

    _auto_grid = lambda argv, n: auto_grid(parse(argv).run_config, n)  # noqa: E731
    argv = ["train", "--batch-size", "16", "--seq-len", "32"]
    work = cm.Workload(get_config("gpt-tiny"), 16, 32, compute_bytes=4, schedule="1f1b",
                       platform="cpu")
    best = cm.plan(work, 8, cm.MACHINES["cpu"])[0]
    assert _auto_grid(argv, 8) == (best.grid, best.microbatches, best.remat)
    # 1.3B parameters need their state split 8 ways on the cpu preset's 8 GB devices; the planner
    # prefers tensor parallelism, which the trainer runs with compression too.
    big = ["train", "--model", "gpt-1.3b", "--batch-size", "16", "--seq-len", "32"]
    big_work = cm.Workload(get_config("gpt-1.3b"), 16, 32, compute_bytes=4, compress_bits=4,
                           platform="cpu")
    best_big = cm.plan(big_work, 8, cm.MACHINES["cpu"])[0]
    assert best_big.grid.tensor_parallel_size > 1
    assert _auto_grid(big + ["--compress-bits", "4"], 8) == (best_big.grid, best_big.microbatches,
                                                             best_big.remat)
    assert _auto_grid(big, 8)[0].tensor_parallel_size > 1
    metrics = tmp_path / "m.jsonl"
    rc = cli_main(argv + ["--auto-grid", "--steps", "1", "--eval-batches", "1",
                          "--metrics-out", str(metrics)])
    grid = ",".join(f"{k}={v}" for k, v in best.grid.as_dict().items())
    assert rc == 0 and f"--auto-grid: {grid}" in capsys.readouterr().err
    assert metrics.read_text()
    assert cli_main(["train", "--auto-grid", "--row", "2", "--steps", "1"]) == 2
    assert "drop --row" in capsys.readouterr().err


def test_compressed_exchange_counts_the_reducers_bytes():
    """The planner's CGX exchange (`reducers.exchange_collectives`) and the reducer's own count
    (`compressed_wire_bytes`, what `--metrics-out` reports) share the size rule and the bytes of a
    packed bucket: on shards of whole buckets over 64 devices the ring's wire bytes are the
    reducer's times (g−1)/g; the small and the 1-D shard go exact in both."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.collectives import ParameterShard
    from axonn_jax.step.reducers import compressed_wire_bytes, exchange_collectives

    shapes = [(1024, 64), (16, 32), (2048,)]  # 64 buckets; below the size rule's 1024; 1-D
    shards = [ParameterShard(math.prod(s), len(s), ()) for s in shapes]
    grid = ParallelConfig(data=64)
    sent = exchange_collectives(shards, grid.data, bits=4, param_bytes=4)
    assert {c.kind for c in sent} == {"all-to-all", "all-gather", "all-reduce"}
    counted = compressed_wire_bytes(4, 1024)([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    assert sum(c.wire_bytes(grid) for c in sent) == pytest.approx(counted * 63 / 64, rel=1e-12)


def test_unet_convolutions_move_what_the_model_counts(compiled_hlo):
    """unet-tiny on data 2 × row 2 × col 2: its convolutions keep the images split like its dense
    layers (`tp.tensor.tp_conv`), so the compiled step gathers the images over row and col before
    each convolution and scatters the sums after it, as `ConvLayer.split` counts them (within
    30%: the model leaves out the skips' re-layouts and the GroupNorms), and the all-reduces over
    row or col carry only the GroupNorms' statistics (under 5% of those bytes). Before, convolutions all-reduced (0.62 MiB) and GSPMD
    re-laid out between them and the dense layers."""
    grid = P(data=2, row=2, col=2)
    options = TrainOptions(model="unet-tiny", batch_size=16, seq_len=32, parallel=grid)
    measured = hlo_bytes_by_axes(compiled_hlo(options), grid.as_dict())
    predicted = cm.bytes_by_axes(workload(options), grid)
    for kind in ("all-gather", "reduce-scatter"):
        for axis in ("row", "col"):
            got, want = measured[(kind, (axis,))], predicted[(kind, (axis,))]
            assert want == pytest.approx(got, rel=0.3), (kind, axis)
    assert sum(measured.get(("all-reduce", (a,)), 0.0) for a in ("row", "col")) < 0.05 * sum(
        measured[(k, (a,))] for k in ("all-gather", "reduce-scatter") for a in ("row", "col"))


def test_unet_pipeline_runs_at_its_busiest_stage():
    """`plan`'s FLOPs per device on `unet-28b`'s pipeline (the scale table's data 4 × pipe 2 ×
    row 4 × col 2, 16 microbatches) are its last stage's: its blocks, the up path and the head's
    recomputed down path (`ModelCommunication.busiest_stage`, 1.32× the mean stage), within 10%
    of the compiled step's (`benchmarks/results/scale.json`). Before, `plan` took every stage as
    the mean (0.71× the compiled figure). Without a pipeline the stages do not matter."""
    from axonn_jax.models import get

    record = json.loads((RESULTS / "scale.json").read_text())["unet-28b/64"]["compiled"]
    work = cm.Workload(get("unet-28b").config, 2048, 1, microbatches=record["microbatches"])
    grid = ParallelConfig(**record["grid"])
    assert grid.pipe == 2
    predicted = cm.predict(work, grid, cm.MACHINES["h100-dgx"]).flops_per_device
    assert predicted == pytest.approx(record["flops_per_device"], rel=0.10)
    assert cm.declared(work, grid).busiest_stage == pytest.approx(1.32, abs=0.01)
    assert cm.declared(work, dataclasses.replace(grid, pipe=1, data=8)).busiest_stage == 1.0


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny-mqa", "unet-tiny", "resnet-tiny"])
def test_declared_parameters_are_the_models(name):
    """Each model's declared parts (`config.communication`) hold, on one device, exactly the
    parameters its StackedModel initializes (what the gradient exchange, the gradient-norm sums
    and the memory model count), and on a tensor-parallel grid a device holds less."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.models import get as preset

    config = preset(name).config
    batch = config.example_batch(2) if hasattr(config, "example_batch") else \
        {k: jax.ShapeDtypeStruct((2, 8), jnp.int32) for k in ("inputs", "targets")}
    params = jax.eval_shape(preset(name).build(jnp.float32).init, jax.random.key(0), batch)
    work = cm.Workload(config, 8, 8)
    assert cm.parameters_per_device(work, P()) == sum(x.size for x in jax.tree.leaves(params))
    assert cm.parameters_per_device(work, P(row=2, col=2)) < cm.parameters_per_device(work, P())


def test_memory_counts_the_compute_copies_and_the_logits():
    """What the compiled H100 step showed `plan` leaving out (docs/compile.md): with
    fp32 parameters computed in bf16, a cast copy and a bf16 gradient of every parameter (none
    with the optimizer offloaded, whose device parameters are bf16 already), and the head's
    logits and their gradient."""
    from axonn_jax.models import get

    grid = ParallelConfig(data=8, pipe=16, row=2)
    work = cm.Workload(get("llama3-70b").config, 1024, 4096, compute_bytes=2, microbatches=128)
    n = sum(p.elements for p in cm.declared(work, grid).parameters)
    tokens = 1024 * 4096 / 8 / 128
    logits = 2 * tokens * 128256 / 2 * 4
    bf16 = cm.memory_per_device(work, grid)["activations"]
    offload = cm.memory_per_device(dataclasses.replace(work, offload_optimizer=True), grid)
    assert bf16 - offload["activations"] == pytest.approx(2 * n * 2)
    # in fp32 no copies, the logits the same (fp32 in a pipeline's ticks), the layers' residuals
    # its own (unfused attention), the rest (the stashed stage inputs) twice as large
    fp32 = dataclasses.replace(work, compute_bytes=4)
    residuals = 5 * cm.block_residual_bytes(fp32, grid, tokens)  # 5 layers a stage
    assert cm.memory_per_device(fp32, grid)["activations"] - residuals - logits == pytest.approx(
        2 * (bf16 - 5 * cm.block_residual_bytes(work, grid, tokens) - 4 * n - logits))
    # the compiled step held 83.4 GB: the planner no longer takes it for one that fits in 80
    assert cm.memory_per_device(work, grid)["total"] > 80e9


def test_offloaded_update_waits_for_the_new_parameters_gather():
    """With the state in host memory and split over `data`, each copy updates its share and the
    step then gathers the new parameters over `data`: nothing is left to hide that gather, so
    `plan` exposes all of it; with the gradients in host memory too, the backward waits for
    their writes (the compiled H100 step's replay does both: `offload_claim.md`)."""
    from axonn_jax.models import get

    grid = ParallelConfig(data=32, depth=8)
    work = cm.Workload(get("gpt-20b").config, 1536, 2048, compute_bytes=2, remat="selective",
                       offload_optimizer=True)
    machine = cm.MACHINES["h100-dgx"]
    gather, = [c for c in cm.collectives(work, grid) if c.kind == "all-gather" and c.waited]
    assert gather.axes == ("data",)
    assert gather.size == cm.parameters_per_device(work, grid) * 2
    on_device = cm.predict(dataclasses.replace(work, offload_optimizer=False), grid, machine)
    offloaded = cm.predict(work, grid, machine)
    gather_s = cm._collective_time(gather, grid, machine)
    assert offloaded.exposed_comm_by_axis["data"] >= gather_s > 0
    assert offloaded.exposed_comm_by_axis["data"] - on_device.exposed_comm_by_axis.get(
        "data", 0.0) > gather_s / 2
    gradients = dataclasses.replace(work, offload_gradients=True)
    written = cm.host_gradient_bytes(gradients, grid)
    assert written >= cm.parameters_per_device(work, grid) * 2 * 0.9  # depth splits the blocks
    assert cm.predict(gradients, grid, machine).compute_s - offloaded.compute_s >= \
        written / machine.host_bw


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_saved_features_are_what_selective_remat_keeps(name):
    """The planner's `selective` bytes per block (`decoder.saved_features`) equal what
    `--remat selective` keeps beyond the block's input, traced on the model's own block."""
    import jax
    import jax.numpy as jnp

    from axonn_jax.models import decoder, get
    from axonn_jax.offload import activations

    model = get(name)
    config, stacked = model.config, model.build(jnp.float32)
    x = jax.ShapeDtypeStruct((2, 16, config.d_model), jnp.float32)
    params = jax.eval_shape(stacked.block.init, jax.random.key(0), x)["params"]
    cost = activations.block_cost(lambda p, h: stacked.block.apply({"params": p}, h), params, x,
                                  stacked.offload_names)
    kept = cost.device_bytes["selective"] - cost.device_bytes["recompute"]
    assert kept == decoder.saved_features(config.shape(P())) * 2 * 16 * 4

# Compiled peaks per device (GB) of plan's grids at published sizes on abstract H100s (bf16,
# cuDNN attention; benchmarks/results/scale.md): (model, batch, seq, grid, microbatches, peak).
COMPILED_PEAKS = [
    ("llama3-8b", 1024, 4096, ParallelConfig(data=8, pipe=8), 64, 64.3),
    ("llama3-405b", 1024, 4096, ParallelConfig(pipe=2, depth=16, row=8), 64, 179.7),
    ("llama3-405b", 1024, 4096, ParallelConfig(pipe=2, depth=2, row=8, col=8), 64, 121.0),
    ("gpt-20b", 1536, 2048, ParallelConfig(data=32, pipe=2, row=4), 16, 94.1),
    # one microbatch, `--remat full` (scale.md's rows): `plan` 1.15x and 1.08x the peak before,
    # which counted the logits and one recomputed block as live together
    ("gpt-20b", 1536, 2048, ParallelConfig(data=32, depth=8), 1, 60.8),
    ("llama3-405b", 1024, 4096, ParallelConfig(data=4, depth=32, row=4, col=2), 1, 55.5),
]


@pytest.mark.parametrize("model,batch,seq,grid,microbatches,peak", COMPILED_PEAKS)
def test_memory_within_ten_percent_of_the_compiled_peak(model, batch, seq, grid, microbatches,
                                                        peak):
    """`plan`'s memory per device against the compiled H100 peak of the same step (plan had
    405B at 70.4 and 72.4 GB, fitting, before): the residual stream whole over row, the MLP's
    hidden width over row, the fp32 norms, no probabilities under cuDNN, the pipeline's fp32
    sum of the embedding and head gradients, the logits or one recomputed block."""
    from axonn_jax.models import get

    remat = "full" if microbatches == 1 else "none"
    work = cm.Workload(get(model).config, batch, seq, compute_bytes=2, microbatches=microbatches,
                       remat=remat)
    assert cm.memory_per_device(work, grid)["total"] / 1e9 == pytest.approx(peak, rel=0.10)


def test_memory_counts_cgx_residuals():
    """With CGX's error feedback every device keeps a residual like its parameters, in the
    dtype of its gradients (`compression.init_residual`): mixtral-8x7b on data 4 × expert 8 × row 2, 8 bits,
    `--remat full`, compiled for 64 abstract H100s, peaks at 84.9 GB (arguments 58.0: fp32
    parameters, Adam's two moments and the residuals); `plan` said 75.3 GB without the
    residuals, fitting. Without error feedback, or without `data`, there are none."""
    from axonn_jax.models import get

    work = cm.Workload(get("mixtral-8x7b").config, 64, 4096, remat="full", compress_bits=8)
    grid = ParallelConfig(data=4, expert=8, row=2)
    memory = cm.memory_per_device(work, grid)
    assert memory["compression"] == memory["params"]
    assert memory["total"] / 1e9 == pytest.approx(84.92, rel=0.10)
    for work_, grid_ in ((dataclasses.replace(work, error_feedback=False), grid),
                         (work, ParallelConfig(expert=8, row=8))):
        assert cm.memory_per_device(work_, grid_)["compression"] == 0.0
    # With the state in host memory the residuals follow the gradients into the compute dtype:
    # half of the fp32 residuals (the compiled step of data 8 × expert 2 × row 4 holds 12.1 GB of
    # bf16 residuals among 24.2 GB of arguments, all aliased to its outputs).
    hosted = cm.memory_per_device(dataclasses.replace(work, offload_optimizer=True),
                                  ParallelConfig(data=8, expert=2, row=4))
    assert hosted["compression"] == hosted["params"]
    assert hosted["compression"] / 1e9 == pytest.approx(12.08, rel=0.01)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_memory_counts_cgx_residuals_beside_a_pipeline(schedule):
    """On a pipeline the residuals add one copy of the parameters and nothing else: zb-h1's
    deferred weight-gradient buffers stay activations (they once took the residuals' place,
    counted twice, and the residuals went uncounted)."""
    from axonn_jax.models import get

    work = cm.Workload(get("llama3-8b").config, 64, 4096, remat="full", schedule=schedule,
                       microbatches=8, compress_bits=8)
    grid = ParallelConfig(data=4, pipe=4, row=4)
    with_residuals = cm.memory_per_device(work, grid)
    exact = cm.memory_per_device(dataclasses.replace(work, compress_bits=0), grid)
    assert with_residuals["compression"] == with_residuals["params"] > 0
    assert exact["compression"] == 0.0
    assert with_residuals["total"] - exact["total"] == pytest.approx(with_residuals["params"])
    assert with_residuals["activations"] == exact["activations"]



def test_gpu_pipeline_gathers_the_tables_over_depth_every_microbatch():
    """The compiled H100 step of Llama-3-8B on data 4 × pipe 2 × depth 8 (16 microbatches,
    scale.md) all-gathers 371.3 GB over depth, counting all 18 ticks' conditionals as run: 330 GB
    for the 16 microbatches that run. Inside a GPU pipeline's `lax.cond` branches the head
    gathers its kernel every microbatch (the embedding, at 8,192 tokens a lookup, exchanges its
    looked-up rows instead: `tp.tensor.looks_up_rows`); `plan` had counted the tables once
    (hoisted out of the loop, as on the CPU)."""
    from axonn_jax.models import get

    work = cm.Workload(get("llama3-8b").config, 1024, 4096, compute_bytes=2, microbatches=16)
    grid = ParallelConfig(data=4, pipe=2, depth=8)
    ticks = make_schedule("1f1b", 2, 16).num_ticks
    assert ticks == 18
    assert cm.bytes_by_kind(work, grid)["all-gather"] / 1e9 == pytest.approx(
        371.3 * 16 / ticks, rel=0.05)


@pytest.mark.parametrize("attention, remat, measured", [
    ("cudnn", "none", 35.07), ("cudnn", "selective", 26.25), ("cudnn", "full", 23.08),
    ("xla", "none", 71.19)])
def test_one_device_memory_matches_the_h200s_peak(attention, remat, measured):
    """`plan`'s memory against the peak an NVIDIA H200 allocated for Llama-3.2-1B, 2 × 2048,
    bf16 (`benchmarks/results/gpu_calibration.md`), within 10%. Before it counted a bf16 copy of
    every parameter and gradient, which XLA fuses into the matmuls without depth gathers or a
    microbatch loop (1.15×, 1.26× and 1.30× with cuDNN's attention), and XLA's attention's
    scores and probabilities in bf16 (0.71×)."""
    from axonn_jax.models import get

    config = dataclasses.replace(get("llama3.2-1b").config, attention=attention)
    work = cm.Workload(config, 2, 2048, compute_bytes=2, remat=remat)
    assert cm.memory_per_device(work, ParallelConfig())["total"] / 1e9 == pytest.approx(
        measured, rel=0.10)


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
REPLAY_EXCEPTIONS = {"unet-28b/256": (0.90, 1.20), "unet-28b/1024": (0.70, 1.10)}
"""Rows whose replayed step `plan` is not within 10% of, with the bounds it is held to and why
(`benchmarks/results/plan_vs_replay.md`): the U-Nets' bytes agree with `plan`'s but for GSPMD's
re-layouts of the skips (all-to-alls and permutes, left out), and their matmuls and
memory-bound kernels agree; the stream law exposes more of depth's weight gathers than the
schedule does on 256 and less of the communication-bound step on 1024."""


def _recorded_workload(args):
    from axonn_jax.run import cli, options as opts
    from axonn_jax.run.plan import workload

    config = cli.parse(["plan", *args]).run_config
    return workload(config, "gpu"), opts.resolve_grid(config, config.grid.devices)


@pytest.mark.parametrize("row", sorted(json.loads(
    (RESULTS / "plan_vs_replay.json").read_text())["rows"]))
def test_plan_within_ten_percent_of_the_replayed_step(row):
    """`plan`'s step time against the replayed schedule of the compiled H100 step
    (`analysis.overlap`) of each scale-table row without a pipeline, as recorded by
    `benchmarks/plan_vs_replay.py --compile` (no compile here): within 10%, matmuls,
    memory-bound kernels (`comm_model.memory_bound_bytes`), launches and exposed communication
    together. Before the memory-bound kernels were counted it was 0.94–1.26×."""
    record = json.loads((RESULTS / "plan_vs_replay.json").read_text())["rows"][row]
    work, grid = _recorded_workload(record["args"])
    assert (grid.as_dict(), work.remat) == (record["grid"], record["remat"])
    ratio = cm.predict(work, grid, cm.MACHINES["h100-dgx"]).step_time_s \
        / record["replay"]["step_s"]
    low, high = REPLAY_EXCEPTIONS.get(row, (0.90, 1.10))
    assert low <= ratio <= high, ratio


@pytest.mark.parametrize("attention, remat, fp8, measured", [
    ("xla", "none", False, 0.2012), ("cudnn", "none", False, 0.0860),
    ("cudnn", "none", True, 0.0905), ("cudnn", "selective", False, 0.0815),
    ("cudnn", "full", False, 0.0886)])
def test_one_device_step_matches_the_h200s_time(attention, remat, fp8, measured):
    """`plan`'s step time against the step an NVIDIA H200 measured for Llama-3.2-1B, 2 × 2048,
    bf16 (`benchmarks/results/gpu_calibration.md`), within 10%: the memory-bound kernels
    (norms, SwiGLU, rotary, XLA's softmax, the kept activations' stacking, the loss) at the
    copy rate measured there. Before it counted matmuls and the update only (0.27–0.77×)."""
    from axonn_jax.models import get

    config = dataclasses.replace(get("llama3.2-1b").config, attention=attention)
    work = cm.Workload(config, 2, 2048, compute_bytes=2, remat=remat, fp8=fp8)
    step = cm.predict(work, ParallelConfig(), cm.MACHINES["h200-dgx"]).step_time_s
    assert step == pytest.approx(measured, rel=0.10)


def test_memory_bound_kernels_follow_their_bytes():
    """The memory-bound kernels' bytes: XLA's attention adds the scores' passes that cuDNN's
    fused kernel keeps on chip; `--remat full` repeats the forward's kernels; twice the tokens,
    twice the bytes; a mixture of experts adds its dispatch."""
    from axonn_jax.models import get

    llama = get("llama3.2-1b").config
    work = cm.Workload(llama, 2, 2048, compute_bytes=2)
    fused = cm.memory_bound_bytes(work, ParallelConfig())
    xla = cm.memory_bound_bytes(cm.Workload(dataclasses.replace(llama, attention="xla"), 2, 2048,
                                            compute_bytes=2), ParallelConfig())
    assert fused["softmax"] == 0 and xla["softmax"] > sum(fused.values())
    full = cm.memory_bound_bytes(dataclasses.replace(work, remat="full"), ParallelConfig())
    assert full["activation"] == pytest.approx(fused["activation"] * 13 / 10)
    double = cm.memory_bound_bytes(dataclasses.replace(work, batch=4), ParallelConfig())
    assert double["norms"] == pytest.approx(2 * fused["norms"])
    moe = cm.memory_bound_bytes(cm.Workload(get("mixtral-8x7b").config, 8, 4096,
                                            compute_bytes=2), ParallelConfig(expert=8))
    assert moe["parts"] > 0 and fused["parts"] == 0


def test_a_backward_exchange_is_exposed_only_where_its_link_is_full():
    """A gradient exchange issued layer by layer in the backward: nothing waits for it before
    the update, so only its last layer's share follows the backward while its link has room in
    the backward (2/3 of the compute, less the link's other collectives); past that, the rest."""
    share = cm._backward_exchange_share
    assert share(0.1, 0.0, 1.0, layers=10) == pytest.approx(0.1)
    assert share(1.0, 0.0, 1.0, layers=10) == pytest.approx(1 - (2 / 3) / 1.0)
    assert share(0.3, 0.7, 1.0, layers=10) == pytest.approx(1 - 0.2 / 0.3)
    assert share(0.5, 2.0, 1.0, layers=10) == 1.0
    data = cm.Collective("all-reduce", ("data",), 1.0)
    depth = cm.Collective("all-gather", ("depth",), 1.0)
    timed = [(data, 0.1), (depth, 0.4)]
    law = [t for _, t in cm.exposed_communication(timed, 1.0, 1.0, "spmd", [False, False])]
    layered = [t for _, t in cm.exposed_communication(timed, 1.0, 1.0, "spmd", [False, False],
                                                      layers=10)]
    assert law == pytest.approx([0.1 * 0.5, 0.4 * 0.5])  # the stream law: busy half the step
    assert layered == pytest.approx([0.01, 0.4 * 0.5])
    # A layer that sends its tokens to experts starts the exchange after its last token
    # exchange: the stream law stays (`moe_grouped.md`).
    assert cm._exchanges_tokens([cm.Collective("all-to-all", ("expert",), 1.0)])
    assert not cm._exchanges_tokens([cm.Collective("all-to-all", ("context",), 1.0), data])


def test_plan_weighs_offload_and_compression_where_the_config_leaves_them(capsys):
    """`plan` picks CGX's 8-bit exchange where the link between nodes is slow and exact where
    the quantizer's passes cost more than the wire saves; it offloads the optimizer state where
    nothing else fits; a config that sets either keeps it."""
    from axonn_jax.run import cli
    from axonn_jax.run.plan import ranked

    def ranking(*flags, machine="consumer-pcie", search_state=True):
        config = cli.parse(["plan", *flags]).run_config
        return ranked(config, config.grid.devices, cm.MACHINES[machine],
                      search_state=search_state)

    slow = ["--model", "gpt-small", "--devices", "16", "--batch-size", "64", "--seq-len", "1024"]
    assert ranking(*slow)[0].compress_bits == 8 and ranking(*slow)[0].grid.data > 1
    assert {p.compress_bits for p in ranking(*slow, "--compress-bits", "0")} == {0}
    fast = ["--model", "llama3-8b", "--devices", "64", "--batch-size", "512", "--seq-len", "8192",
            "--dtype", "bfloat16"]
    top = ranking(*fast, machine="h100-dgx")[0]
    assert (top.compress_bits, top.grid) == (0, ParallelConfig(data=8, depth=8))
    # Compiled and replayed (`benchmarks/results/plan_vs_replay.md`): 8 bits 0.382 s, exact
    # 0.390 s, not the 10% a lossy exchange must gain; a wire dtype the config names is kept.
    peers = ["--model", "llama3-8b", "--devices", "64", "--batch-size", "64", "--seq-len", "4096",
             "--dtype", "bfloat16"]
    assert ranking(*peers, machine="h100-dgx")[0].compress_bits == 0
    assert {p.compress_bits for p in ranking(*peers, "--reduce-dtype", "float32",
                                             machine="h100-dgx")} == {0}
    big = ["--model", "gpt-13b", "--devices", "1", "--batch-size", "4", "--seq-len", "2048",
           "--dtype", "bfloat16", "--remat", "full"]
    assert ranking(*big, machine="h100-dgx")[0].offload_optimizer
    assert not ranking(*big, machine="h100-dgx", search_state=False)  # on the device: none fits
    # 20B fits one H100 only with the blocks' gradients in host memory too (compiled: 53.0 GB,
    # `benchmarks/results/offload_notes.md`); 13B does not need them there.
    assert not ranking(*big, machine="h100-dgx")[0].offload_gradients
    huge = ranking(*[("gpt-20b" if f == "gpt-13b" else f) for f in big], machine="h100-dgx")
    assert huge[0].offload_gradients and huge[0].fits
    assert cli_main(["plan", *slow, "--machine", "consumer-pcie", "--top", "1"]) == 0
    assert "device, 8-bit" in capsys.readouterr().out
