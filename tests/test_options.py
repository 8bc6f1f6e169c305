"""The config tree: one default per option, the same tree behind every command, old spellings, and
every problem of a config reported at once."""
import argparse
import dataclasses

import pytest

from axonn_jax import ParallelConfig
from axonn_jax.run import config as config_lib, options as opts
from axonn_jax.run.cli import build_parser, main as cli_main, parse
from axonn_jax.run.plan import workload
from axonn_jax.train import TrainOptions


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_default_is_written_once():
    """No flag of a command that reads the tree carries a default of its own: what is not given
    comes from the tree (argparse leaves it out), so train, plan and bench cannot disagree."""
    paths = {leaf.path for leaf in opts.leaves()}
    for name in ("train", "plan", "bench"):
        for action in _subparsers()[name]._actions:
            if action.dest in paths:
                assert action.default is argparse.SUPPRESS, (name, action.dest)
    assert parse(["train"]).run_config == parse(["plan"]).run_config == opts.RunConfig()


def test_plan_and_train_read_the_same_config(tmp_path):
    """One YAML file: plan's workload has the trainer's dtype, schedule, microbatches,
    compression and offload (the planner once assumed bfloat16 and GPipe where train ran float32
    and 1F1B)."""
    path = config_lib.write(tmp_path / "job.yaml", {
        "model": {"name": "gpt-tiny-deep"}, "grid": {"pipe": 2, "devices": 8},
        "pipeline": {"microbatches": 4, "schedule": "zb-h1"}, "precision": {"dtype": "bfloat16"},
        "compression": {"bits": 4}, "data": {"batch_size": 16, "seq_len": 32}})
    train = parse(["train", "--config", str(path)]).run_config
    plan = parse(["plan", "--config", str(path)]).run_config
    assert train == plan
    work = workload(plan)
    step = opts.step_options(train)
    assert (work.compute_bytes, work.schedule, work.microbatches, work.compress_bits,
            work.offload_optimizer) == (2, step["schedule"], step["microbatches"],
                                        step["compress_bits"], step["offload_optimizer"])
    assert step["dtype"] == "bfloat16"


def test_old_spellings_and_new_paths_name_the_same_fields(tmp_path):
    flat = parse(["train", "--data-parallel", "2", "--row", "2", "--batch-size", "4",
                  "--schedule", "zb-h1", "--memory-budget", "3", "--no-error-feedback"]).run_config
    dotted = parse(["train", "--set", "grid.data=2", "grid.row=2", "data.batch_size=4",
                    "pipeline.schedule=zb-h1", "memory.budget_gb=3",
                    "compression.error_feedback=false"]).run_config
    nested = config_lib.load_file(config_lib.write(tmp_path / "c.yaml", {
        "grid": {"data": 2, "row": 2}, "data": {"batch_size": 4},
        "pipeline": {"schedule": "zb-h1"}, "memory": {"budget_gb": 3},
        "compression": {"error_feedback": False}}))
    old_keys = config_lib.load_file(config_lib.write(tmp_path / "old.yaml", {
        "dp": 2, "row": 2, "batch_size": 4, "schedule": "zb-h1", "memory_budget": 3,
        "no_error_feedback": True}))
    python = TrainOptions(parallel=ParallelConfig(data=2, row=2), batch_size=4, schedule="zb-h1",
                          memory_budget_gb=3, error_feedback=False)
    assert flat == dotted == nested == old_keys == python
    assert parse(["train", "--dp", "2"]).run_config.grid.data == 2


def test_written_config_reads_back(tmp_path):
    config = TrainOptions(model="llama-tiny", steps=7, parallel=ParallelConfig(data=2, pipe=2),
                          microbatches=4, dtype="bfloat16", clip_norm=None, resume="auto")
    path = config_lib.write(tmp_path / "c.yaml", config_lib.effective_config(config))
    assert config_lib.load_file(path) == config


def test_every_problem_is_reported_at_once(capsys):
    assert cli_main(["train", "--steps", "0", "--compress-bucket", "512", "--eval-batches", "0",
                     "--schedule", "gpipe"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "axonn-jax train: error: --steps must be positive, got 0",
        "axonn-jax train: error: --eval-batches must be positive, got 0",
        "axonn-jax train: error: --schedule gpipe needs a pipeline (--pipe > 1)",
        "axonn-jax train: error: --compress-bucket needs gradient compression (--compress-bits)"]
    grid = ParallelConfig(data=3, pipe=2)
    found = opts.problems(TrainOptions(model="gpt-tiny", batch_size=10, microbatches=3,
                                       virtual_stages=2, remat="auto"), grid, num_devices=8)
    assert any("has 6 devices but 8 are available" in f for f in found)
    assert any("not divisible by pipe = 2" in f or "virtual" in f for f in found)
    assert any("remat='auto' with pipe > 1" in f for f in found)
    assert len(found) >= 4, found


def test_sections_are_frozen_and_replace_by_path():
    config = opts.RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.run.steps = 3
    changed = config.replace(**{"run.steps": 3, "schedule": "gpipe"})
    assert (changed.run.steps, changed.pipeline.schedule) == (3, "gpipe")
    assert config.run.steps == 100
    with pytest.raises(TypeError, match="unknown option 'stepz'"):
        TrainOptions(stepz=3)
