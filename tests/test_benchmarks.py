"""The benchmarks that must never be broken when a GPU comes: the GPU suite (tiny sizes on the CPU)
and the whole-step comparison with GSPMD baselines for any `StackedModel`."""
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from axonn_jax import ParallelConfig
from axonn_jax.analysis import step_bench

import user_models as um

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_suite_runs_tiny(tmp_path, devices):
    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "benchmarks" / "gpu_suite.py")
    suite = sys.modules["gpu_suite"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    assert suite.main(["--tiny", "--out", str(tmp_path)]) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("gpu_*.json")]
    assert result["matmul"]["bf16_flops_per_s"] > 0
    assert {r["variant"] for r in result["mfu"]} == {"axonn_jax", "plain jax.jit"}
    assert all(0 < r["mfu"] for r in result["mfu"])
    assert [r["mode"] for r in result["largest_model"]][1] == "--offload-optimizer"
    assert all(r["layers"] >= 1 for r in result["largest_model"])
    assert result["cgx"]["quantize_dequantize_gb_s"] > 0
    assert all(t > 0 for t in result["cgx"]["chained_copy"]["seconds"])
    ran = {v["variant"] for v in result["variants"] if "step_time_s" in v}
    losses = [v["loss"] for v in result["variants"] if "step_time_s" in v]
    assert max(losses) - min(losses) < 1e-2 * losses[0]  # same parameters and batch
    assert {"xla attention, remat none", "auto attention, remat full",
            "auto attention, remat none, fp8"} <= ran and all(
        "cuDNN" in v["error"] or "cudnn" in v["error"] for v in result["variants"]
        if v["variant"] not in ran)  # on a CPU the cuDNN variants say why they did not run
    md = next(tmp_path.glob("gpu_*.md")).read_text()
    assert "(a) bf16 matmul" in md and "(d) CGX" in md and "(f) step variants" in md


def test_whole_step_comparison_of_a_users_model(devices):
    """A user's ViT: axonn's 2D grid against Megatron-style and FSDP GSPMD steps; every variant
    computes the same first loss, and the Megatron layout splits the weights as axonn's does."""
    batch = um.image_batches(8)(0)
    report = step_bench.run(um.vit(2), batch, grids=[ParallelConfig(data=2, row=2, col=2)],
                            devices=devices, repeats=1,
                            baselines=("gspmd megatron tp", "gspmd fsdp"), log=lambda *_: None)
    names = [r["name"] for r in report["rows"]]
    assert names == ["axonn data=2 row=2 col=2", "gspmd megatron tp", "gspmd fsdp"]
    losses = [r["loss"] for r in report["rows"]]
    assert np.ptp(losses) <= 1e-5 * abs(losses[0])
    assert all(r["wire_bytes"] > 0 and r["flops_per_device"] > 0 for r in report["rows"])
    md = step_bench.markdown(report, "ViT")
    assert md.count("\n| ") == 4  # header and three variants


def test_bench_microbatches_accumulate_without_a_pipeline(devices):
    """`bench --microbatches M` on a grid without a pipeline accumulates gradients over M
    microbatches, as `train` does: two compile, and eight, which do not split the batch, are
    refused instead of being ignored."""
    batch, vit, grid = um.image_batches(8)(0), um.vit(2), ParallelConfig(data=2)

    def bench(microbatches):
        return step_bench.run(vit, batch, grids=[grid], devices=devices[:2], repeats=0,
                              microbatches=microbatches, baselines=(), log=lambda *_: None)

    (row,) = bench(2)["rows"]
    assert row["name"] == "axonn data=2" and row["flops_per_device"] > 0
    with pytest.raises(ValueError, match="not divisible by data × microbatches = 2 × 8"):
        bench(8)


def test_compile_only_allocates_nothing(devices, monkeypatch):
    """`repeats=0` (`bench --repeats 0`): every variant compiled from abstract state and batch,
    nothing placed on a device (a 28B U-Net on 256 simulated devices no longer needs its state in
    memory)."""
    import jax

    from axonn_jax.step.train_step import TrainStep

    def refuse(*args, **kwargs):
        raise AssertionError("compile only must not allocate")

    monkeypatch.setattr(jax, "device_put", refuse)
    monkeypatch.setattr(TrainStep, "init_state", refuse)
    report = step_bench.run(um.vit(2), um.image_batches(8)(0),
                            grids=[ParallelConfig(data=2, row=2, col=2)], devices=devices,
                            repeats=0, baselines=("gspmd fsdp",), log=lambda *_: None)
    assert [r["loss"] for r in report["rows"]] == [None, None]
    assert all(r["peak_bytes"] > 0 and r["wire_bytes"] > 0 for r in report["rows"])


def test_bench_defaults_scale_to_any_device_count():
    """`bench --model M --devices 256`: the 8-device default grids scaled by `data` to the devices
    (dropped when the batch does not split over them), and only the GSPMD layouts whose batch
    axes split the batch (a 16-row batch cannot go over 256 data-parallel devices)."""
    grids = step_bench.scaled_grids(("data=8", "data=2,row=2,col=2", "row=4,col=2"), 256, 256)
    assert grids == [ParallelConfig(data=256), ParallelConfig(data=64, row=2, col=2),
                     ParallelConfig(data=32, row=4, col=2)]
    assert step_bench.scaled_grids(("data=8", "row=4,col=2"), 256, 16) == []
    usable, dropped = step_bench.gspmd_layouts_for(256, 16)
    assert set(dropped) == {"gspmd dp", "gspmd fsdp"} and "256 devices" in dropped["gspmd dp"]
    assert set(usable) == set(step_bench.GSPMD_LAYOUTS) - set(dropped)

    def check(grid):  # a model whose 1600 features split 2 ways but not 256
        if 1600 % grid.row:
            raise ValueError(f"1600 is not divisible by row = {grid.row}")

    usable, dropped = step_bench.gspmd_layouts_for(256, 256, check)
    assert usable == ("gspmd dp", "gspmd fsdp")  # tp = 256 and 128 do not split 1600
    assert "row = 256" in dropped["gspmd megatron tp"] and "row = 128" in dropped["gspmd dp=2 x tp"]


def test_every_mutation_still_finds_its_code():
    """`benchmarks/mutations.py` (not run in the suite) refuses to start when a refactor moved the
    code one of its bugs is written into; each snippet must stay in its file exactly once."""
    spec = importlib.util.spec_from_file_location("mutations", REPO / "benchmarks" / "mutations.py")
    mutations = sys.modules["mutations"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutations)
    mutations.check_snippets(mutations.MUTATIONS)
    for node in (node for m in mutations.MUTATIONS for node in m.tests):  # and its tests exist
        path, _, name = node.partition("::")
        assert f"def {name.split('[')[0]}(" in (REPO / path).read_text(), node
