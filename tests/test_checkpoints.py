"""Checkpoints that survive: restore on other grids and across modes, damaged steps fall back to
the newest step that restores, bad input is a one-line error, paths are checked before the first
step. Real orbax checkpoints, broken on disk."""
import glob
import json
import os
import random
import shutil

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from axonn_jax import ParallelConfig
from axonn_jax.run.checkpoint import Checkpointer, CheckpointMismatch
from axonn_jax.step.reducers import resplit_residual
from axonn_jax.run.cli import main as cli_main
from axonn_jax.run.trainer import build_trainer
from axonn_jax.train import TrainOptions, train

from conftest import adam_state, relative_difference

STEPS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read() * 2)
    return str(path)


def options(corpus, **kw):
    base = dict(steps=STEPS, batch_size=8, seq_len=16, eval_batches=1, eval_every=100,
                data_path=corpus)
    return TrainOptions(**{**base, **kw})


def losses(summary):
    return [r["loss"] for r in summary["history"]]


@pytest.fixture(scope="module")
def reference(corpus, devices, tmp_path_factory):
    """An uninterrupted data=8 run, checkpointed at steps 2 and 4."""
    directory = tmp_path_factory.mktemp("ref") / "ckpt"
    summary = train(options(corpus, parallel=ParallelConfig(data=8), checkpoint_dir=str(directory),
                            checkpoint_every=2), devices=devices)
    assert sorted(os.listdir(directory)) == ["2", "4"]
    return summary, directory


def copy_of(reference, tmp_path, drop_last=False):
    directory = tmp_path / "ckpt"
    shutil.copytree(reference[1], directory)
    if drop_last:
        shutil.rmtree(directory / "4")
    return directory


@pytest.mark.parametrize("grid,count", [(ParallelConfig(data=2, row=2, col=2), 8),
                                        (ParallelConfig(data=4), 4)])
def test_resume_on_another_grid_continues_the_run(reference, corpus, devices, tmp_path, grid,
                                                  count):
    """Resumed from step 2 on another grid: the uninterrupted run's losses; the metrics file of the
    crashed job (records up to step 3, the last one half-written) trimmed back to step 2; saved at
    the end without --checkpoint-every."""
    directory = copy_of(reference, tmp_path, drop_last=True)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
                       + '{"step": 4, "lo')
    resumed = train(options(corpus, parallel=grid, checkpoint_dir=str(directory), resume=True,
                            metrics_out=str(metrics)), devices=devices[:count])
    assert [r["step"] for r in resumed["history"]] == [3, 4]
    assert relative_difference(losses(resumed), losses(reference[0])[2:]) <= 1e-5
    records = [json.loads(line) for line in open(metrics)]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["loss"] != 1.0
    assert sorted(os.listdir(directory)) == ["2", "4"]


@pytest.mark.parametrize("gradients", [False, True], ids=["state", "state-and-gradients"])
def test_offload_checkpoint_restores_without_offload_and_back(reference, corpus, devices,
                                                              tmp_path, gradients):
    """Written without offload, resumed with it (the gradients in host memory too or not): the
    uninterrupted run's losses; its checkpoint restored without offload: its state."""
    directory = copy_of(reference, tmp_path, drop_last=True)
    # Written without offload, resumed with it (on 4 devices); it writes step 4 with offload.
    resumed = train(options(corpus, parallel=ParallelConfig(data=4), offload_optimizer=True,
                            offload_gradients=gradients, checkpoint_dir=str(directory),
                            resume=True), devices=devices[:4])
    assert relative_difference(losses(resumed), losses(reference[0])[2:]) <= 1e-5
    # That offload checkpoint restored without offload holds the uninterrupted run's state.
    trainer = build_trainer(options(corpus, parallel=ParallelConfig(data=2)), devices[:2])
    state = trainer.make_checkpointer(str(directory), 0).restore(trainer.init_state())
    assert int(state.step) == STEPS
    want = reference[0]["state"]
    # Per group, within 1e-4: the key bias's gradient is zero (softmax ignores it), so its moments
    # are rounding noise, which Adam's mu / sqrt(nu) turns into steps of about the learning rate.
    for group in (lambda s: s.params, lambda s: adam_state(s.opt_state).mu,
                  lambda s: adam_state(s.opt_state).nu):
        got, ref = (ravel_pytree(jax.tree.map(np.asarray, group(s)))[0] for s in (state, want))
        assert relative_difference(got, ref) <= 1e-4


def test_compressed_residuals_resplit_or_reset(corpus, devices, tmp_path):
    directory = tmp_path / "ckpt"
    train(options(corpus, steps=1, parallel=ParallelConfig(data=4), compress_bits=4,
                  checkpoint_dir=str(directory)), devices=devices[:4])
    notes = []
    saved = None
    for data, batch in ((4, 8), (2, 8), (3, 12)):
        trainer = build_trainer(options(corpus, batch_size=batch, compress_bits=4,
                                        parallel=ParallelConfig(data=data)), devices[:data])
        state = trainer.make_checkpointer(str(directory), 0, note=notes.append).restore(
            trainer.init_state())
        residual = np.asarray(state.reducer["blocks"]["mlp_up"]["kernel"])
        assert residual.shape[0] == data
        if data == 4:
            saved = residual
            assert np.abs(saved).max() > 0 and not notes
        elif data == 3:
            assert not residual.any()
            assert any("cannot be re-split into 3; reset to zero" in n for n in notes)
        else:
            np.testing.assert_allclose(residual, resplit_residual(saved, data), rtol=1e-6)
            assert f"re-split from 4 to {data}" in notes[-1]
    # The total correction the residuals still owe the mean is kept, merging or splitting shards.
    np.testing.assert_allclose(resplit_residual(saved, 2).sum(0) / 2, saved.sum(0) / 4, atol=1e-7)
    np.testing.assert_array_equal(resplit_residual(saved, 8), np.repeat(saved, 2, axis=0))


def _truncate(step_dir):
    for f in glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"):
        os.truncate(f, os.path.getsize(f) // 2)


def _delete(step_dir):
    for f in glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"):
        os.remove(f)


def _garbage_manifest(step_dir):
    for f in glob.glob(f"{step_dir}/state/**/manifest.ocdbt", recursive=True):
        with open(f, "wb") as out:
            out.write(os.urandom(300))


def _random_bytes(step_dir):
    rng = random.Random(0)
    for f in glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"):
        data = bytearray(open(f, "rb").read())
        for i in range(len(data) // 4, len(data) - 8):
            data[i] = rng.randrange(256)
        open(f, "wb").write(bytes(data))


def _wrong_checksum(step_dir):
    path = f"{step_dir}/meta/metadata"
    meta = json.load(open(path))
    key = next(k for k in meta["checksums"] if "mu" in k)
    meta["checksums"][key] += 1  # what a flipped bit in the data looks like
    json.dump(meta, open(path, "w"))


def _half_written(step_dir):
    shutil.rmtree(f"{step_dir}/state")  # a job killed while the step was being written


@pytest.fixture(scope="module")
def template(corpus, devices):
    trainer = build_trainer(options(corpus, parallel=ParallelConfig(data=8)), devices)
    return trainer, trainer.init_state()


@pytest.mark.parametrize("damage", [_truncate, _delete, _garbage_manifest, _random_bytes,
                                    _wrong_checksum, _half_written])
def test_damaged_newest_step_falls_back(reference, template, tmp_path, damage, capfd):
    directory = copy_of(reference, tmp_path)
    damage(directory / "4")
    trainer, fresh = template
    notes = []
    state = trainer.make_checkpointer(str(directory), 2, note=notes.append).restore(fresh)
    assert int(state.step) == 2 and len(notes) == 1
    assert notes[0].startswith(f"checkpoint step 4 in {directory} is damaged (")
    assert notes[0].endswith("skipped, trying step 2") and "\n" not in notes[0]
    assert sorted(os.listdir(directory)) == ["2", "4.damaged"]  # set aside, not deleted
    err = capfd.readouterr().err
    assert "Traceback" not in err and "TensorStore" not in err
    # The next save of step 4 goes where the damaged one was.
    checkpointer = trainer.make_checkpointer(str(directory), 2)
    assert checkpointer.maybe_save(4, reference[0]["state"])
    checkpointer.close()
    assert checkpointer.restore(fresh).step == 4


def test_bad_checkpoints_are_one_line_errors(reference, template, corpus, devices, tmp_path):
    trainer, fresh = template
    directory = copy_of(reference, tmp_path)
    for step in ("2", "4"):
        _truncate(directory / step)
    with pytest.raises(ValueError, match=r"no step of .* restores: step 4: a data file .*; step 2"):
        trainer.make_checkpointer(str(directory), 0, note=lambda _: None).restore(fresh)
    other = build_trainer(options(corpus, model="gpt-mini", parallel=ParallelConfig(data=8)),
                          devices)
    with pytest.raises(CheckpointMismatch, match=r"holds another model's checkpoint: parameter "):
        other.make_checkpointer(str(reference[1]), 0).restore(other.init_state(abstract=True))
    # A step a killed job was still writing stays in orbax's temporary directory: never read.
    (directory / "2").rename(directory / "6.orbax-checkpoint-tmp-1700000000")
    shutil.rmtree(directory / "4")
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        trainer.make_checkpointer(str(directory), 0).restore(fresh)
    junk = tmp_path / "junk"
    (junk / "7").mkdir(parents=True)
    (junk / "7" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"no step of .* restores: step 7: "):
        trainer.make_checkpointer(str(junk), 0).restore(fresh)
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        trainer.make_checkpointer(str(tmp_path / "empty"), 0).restore(fresh)


def test_keep_newest_and_every_kth_and_never_save_non_finite(tmp_path, devices):
    state = {"step": jax.numpy.int32(0), "w": jax.numpy.ones((4, 4))}
    notes = []
    checkpointer = Checkpointer(tmp_path / "c", every=1, keep=2, keep_every=4, note=notes.append)
    for step in range(1, 11):
        assert checkpointer.maybe_save(step, {**state, "step": jax.numpy.int32(step)})
    assert not checkpointer.maybe_save(11, {**state, "w": state["w"].at[0, 0].set(np.nan)})
    assert notes == ["checkpoint: not saving step 11: non-finite values in ['w']"]
    checkpointer.close()
    assert sorted(int(p) for p in os.listdir(tmp_path / "c")) == [4, 8, 9, 10]
    # The seed (with the step: the data position and every random choice) is saved alongside.
    meta = json.load(open(tmp_path / "c" / "10" / "meta" / "metadata"))
    assert meta["step"] == 10 and set(meta["checksums"]) == {"['step']", "['w']"}


def test_paths_and_steps_checked_before_training(reference, corpus, tmp_path, capsys):
    common = ["train", "--steps", "2", "--batch-size", "8", "--seq-len", "16", "--eval-batches",
              "1", "--data", corpus, "--devices", "8", "--run-dir", str(tmp_path / "run")]
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli_main([*common, "--checkpoint-dir", str(afile)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("is a file, not a directory") and "\n" not in err
    # --resume from step 4 with --steps 2: nothing to do.
    directory = copy_of(reference, tmp_path)
    assert cli_main([*common, "--checkpoint-dir", str(directory), "--resume"]) == 0
    assert "the run is already complete" in capsys.readouterr().out
