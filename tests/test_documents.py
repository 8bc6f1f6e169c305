"""Training on documents (`data.sources`): a weighted JSONL + Parquet mixture trains from the
config with packed documents, validates on the held-out split, reports the loader's throughput,
resumes at exactly its data position from real orbax checkpoints (also on another number of
processes), reads per host under `axonn-jax launch`, and refuses bad input in one line; the loss of
a packed batch is the documents' losses computed separately."""
import dataclasses
import json
import os
import random
import shutil
import subprocess

import jax
import numpy as np
import optax
import pytest

from axonn_jax import ParallelConfig, make_mesh, make_train_step
from axonn_jax.models import gpt, llama
from axonn_jax.run import packing
from axonn_jax.run.checkpoint import CheckpointMismatch
from axonn_jax.run.sources import Tokens
from axonn_jax.train import TrainOptions, train

from conftest import relative_difference

STEPS, BATCH, SEQ = 4, 8, 32
WORDS = "the quick brown fox jumps over a lazy dog while packed documents stream from grain".split()


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Two sources, JSONL (weight 2) and Parquet (weight 1), of short word documents, some longer
    than a sequence (split over rows: `long_documents: split`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, rng = tmp_path_factory.mktemp("docs"), random.Random(0)
    doc = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))  # noqa: E731
    with open(root / "a.jsonl", "w") as f:
        for _ in range(120):
            f.write(json.dumps({"text": doc()}) + "\n")
    pq.write_table(pa.table({"body": [doc() for _ in range(120)]}), root / "b.parquet")
    return [{"path": str(root / "a.jsonl"), "weight": 2},
            {"path": str(root / "b.parquet"), "text_field": "body"}]


def options(sources, **kw):
    base = dict(model="gpt-tiny", data_sources=sources, steps=STEPS, batch_size=BATCH,
                seq_len=SEQ, val_fraction=0.1, eval_batches=1, eval_every=2, warmup_steps=0)
    return TrainOptions(**{**base, **kw})


def losses(summary, key="loss"):
    return [r[key] for r in summary["history"] if key in r]


@pytest.fixture(scope="module")
def unbroken(mixture, devices, tmp_path_factory):
    """An uninterrupted data=2 run on the mixture, checkpointed at steps 2 and 4."""
    directory = tmp_path_factory.mktemp("ref") / "ckpt"
    summary = train(options(mixture, parallel=ParallelConfig(data=2), checkpoint_dir=str(directory),
                            checkpoint_every=2), devices=devices[:2])
    assert sorted(os.listdir(directory)) == ["2", "4"]
    return summary, directory


def resumed_from_step_2(unbroken, sources, tmp_path, devices, **kw):
    """The unbroken run's checkpoint of step 2 resumed to step 4 (its step 4 removed)."""
    directory = tmp_path / "ckpt"
    shutil.copytree(unbroken[1], directory)
    shutil.rmtree(directory / "4")
    return train(options(sources, checkpoint_dir=str(directory), resume=True, **kw),
                 devices=devices)


def test_mixture_trains_and_resumes_at_its_data_position(unbroken, mixture, tmp_path, devices):
    """The run's records hold the loader's throughput and wait and validation losses from the
    held-out split; the loss falls; resumed from its step-2 checkpoint (the data position saved
    as the orbax item `data` while batches were prefetched), steps 3 and 4 read exactly the
    batches of the unbroken run: the same losses, bit for bit."""
    summary = unbroken[0]
    first = summary["history"][0]
    assert first["data_wait_s"] >= 0 and first["data_batches_per_s"] > 0
    assert first["data_documents"] > 0 and 0 <= first["data_padding"] < 1
    assert len(losses(summary, "val_loss")) >= 2 and losses(summary)[-1] < losses(summary)[0]
    resumed = resumed_from_step_2(unbroken, mixture, tmp_path, devices[:2],
                                  parallel=ParallelConfig(data=2))
    assert [r["step"] for r in resumed["history"]] == [3, 4]
    assert losses(resumed) == losses(summary)[2:]


def test_resume_on_another_grid_reads_the_same_batches(unbroken, mixture, tmp_path, devices):
    """The data position saved by a data=2 run restores on one device (other rows per device,
    the same global batches): the losses of steps 3 and 4 agree to float32 rounding."""
    resumed = resumed_from_step_2(unbroken, mixture, tmp_path, devices[:1])
    assert relative_difference(losses(resumed), losses(unbroken[0])[2:]) <= 1e-5


def test_damaged_data_position_falls_back_to_the_previous_step(unbroken, mixture, tmp_path,
                                                               devices):
    """A step whose data item is missing is damaged like any other: the restore falls back to
    the previous step (with a note) and the run still reads the unbroken run's batches. A data
    position of other data is an error that leaves the steps as they are."""
    directory = tmp_path / "ckpt"
    shutil.copytree(unbroken[1], directory)
    shutil.rmtree(directory / "4" / "data")
    resumed = train(options(mixture, parallel=ParallelConfig(data=2), checkpoint_dir=str(directory),
                            resume=True), devices=devices[:2])
    assert os.path.isdir(directory / "4.damaged")
    assert [r["step"] for r in resumed["history"]] == [3, 4]
    assert losses(resumed) == losses(unbroken[0])[2:]
    # A data position of other data (here: another seed's shuffles) is an error, not damage.
    with pytest.raises(CheckpointMismatch, match="data position is of other data"):
        train(options(mixture, parallel=ParallelConfig(data=2), checkpoint_dir=str(directory),
                      resume=True, seed=1), devices=devices[:2])
    assert sorted(os.listdir(directory)) == ["2", "4", "4.damaged"]


# ----------------------------------------------------------------------------- packed loss

EOS = 0


def random_documents(count, seed):
    """Documents of random token ids (1..255) of 2 to 24 tokens, each ending with EOS."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, 256, rng.integers(2, 25)), EOS).astype(np.int32)
            for _ in range(count)]


def packed_rows(docs, rows):
    """(`rows` rows of SEQ + 1 packed tokens, segment ids and positions, the documents each row
    holds)."""
    doc_at = lambda j: Tokens(docs[j], f"document {j}") if j < len(docs) else None  # noqa: E731
    out, position, held = [], (0, 0), []
    for _ in range(rows):
        row, after = packing.pack_row(doc_at, position, SEQ + 1, split_long=False)
        held.append(list(range(position[0], after[0])))
        out.append(row)
        position = after
    return [np.stack(x) for x in zip(*out)], held


FAMILIES = {"gpt": (gpt, "gpt-tiny"), "llama": (llama, "llama-tiny")}


@pytest.mark.parametrize("family, grid", [("gpt", None), ("gpt", "data2-context2"),
                                          ("llama", "data2-context2")])
def test_packed_loss_is_the_documents_losses(family, grid, devices):
    """Documents packed into rows (segment ids, positions, ignored targets between documents) give
    the losses of the documents computed alone, each in a row of its own: the library's
    cross-entropy is the mean over all `rows x seq_len` positions, an ignored target's term 0, so
    with as many rows on both sides (empty rows pad them) the two losses are equal. Without the
    segment mask (attention across documents) and the restarted positions it differs by far more
    than the tolerance. With `grid`, the same batch on a data=2 x context=2 grid (the context-parallel
    attention's segment mask) gives the same loss."""
    module, name = FAMILIES[family]
    model = module.stacked(dataclasses.replace(module.PRESETS[name], attention="xla"))
    docs = random_documents(15, seed=4)
    rows, held = packed_rows(docs, 4)
    used = [j for h in held for j in h]
    # The packed rows and the documents alone, a row each, padded with empty rows to one even
    # number of rows (the data axis splits it): the two means have one denominator.
    size = len(used) + len(used) % 2
    pad = lambda xs: packing.lm_batch(*(np.pad(x, ((0, size - len(x)), (0, 0))) for x in xs))  # noqa: E731
    batch = pad(rows)
    alone = pad([np.concatenate(x) for x in zip(*(packed_rows([docs[j]], 1)[0] for j in used))])
    assert max(len(h) for h in held) >= 2 and (batch["targets"][:4] < 0).mean() > 0.05
    params = jax.jit(model.init)(jax.random.key(0), batch)
    loss = jax.jit(model.loss)
    want = float(loss(params, alone))
    assert relative_difference(float(loss(params, batch)), want) <= 1e-5
    # Without the segment mask and restarted positions the documents see each other.
    unmasked = {**batch, "segment_ids": np.ones_like(batch["segment_ids"]),
                "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), batch["inputs"].shape)}
    assert relative_difference(float(loss(params, unmasked)), want) > 1e-3
    if grid is None:
        return
    mesh = make_mesh(ParallelConfig(data=2, context=2), devices[:4])
    step = make_train_step(model, optax.sgd(0.1), mesh)
    state = step.init_state(jax.random.key(0), batch, params)
    assert relative_difference(float(step.eval_loss(state.params, step.place_batch(batch))),
                               want) <= 1e-5


# ----------------------------------------------------------------------------- several processes

def test_launch_reads_per_host_and_resumes_on_one_process(unbroken, mixture, tmp_path, devices):
    """`axonn-jax launch` with 2 processes of one device each trains from the config's YAML (as
    the run directory writes it): each process reads and tokenizes only its half of the rows
    (process 0's documents are about half of the one-process run's), the global batches are the
    same (the losses equal the in-process data=2 run's), and the job's step-2 checkpoint (the
    data position gathered from both processes) resumes on one process with the same batches."""
    from axonn_jax.run import config as config_lib
    from test_distributed import cli, run

    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ckpt"
    config_lib.write(tmp_path / "run.yaml", config_lib.effective_config(options(
        mixture, checkpoint_dir=str(directory), checkpoint_every=2, metrics_out=str(metrics))))
    run(cli("launch", "--nprocs", "2", "--devices-per-proc", "1", "--log-dir",
            str(tmp_path / "logs"), "--", "train", "--config", str(tmp_path / "run.yaml")))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    reference = unbroken[0]["history"]
    assert relative_difference([r["loss"] for r in records], losses(unbroken[0])) <= 1e-5
    read = sum(r["data_documents"] for r in records)
    assert 0 < read < 0.75 * sum(r["data_documents"] for r in reference)
    assert "reading rows 0-3" in (tmp_path / "logs" / "proc0.log").read_text()
    shutil.rmtree(directory / "4")
    resumed = train(options(mixture, checkpoint_dir=str(directory), resume=True),
                    devices=devices[:1])
    assert relative_difference(losses(resumed), losses(unbroken[0])[2:]) <= 1e-5


# ----------------------------------------------------------------------------- bad input

BAD = {"malformed.jsonl": '{"text": "a b c\n' * 12, "nofield.jsonl": '{"body": "a b c"}\n' * 12,
       "long.jsonl": (json.dumps({"text": "word " * 40}) + "\n") * 12}
SMALL_RUN = ["train", "--model", "gpt-tiny", "--steps", "1", "--batch-size", "8", "--seq-len",
             "16", "--eval-batches", "1"]


def test_cli_bad_sources_are_one_line_errors(mixture, tmp_path):
    """Through the command line (a subprocess): a missing source and a weight <= 0 are reported
    together, one line each, exit status 2, no traceback, before any work."""
    from test_distributed import child_env, cli

    result = subprocess.run(
        cli(*SMALL_RUN, "--run-dir", str(tmp_path / "run"), "--data-source",
            str(tmp_path / "missing.jsonl"), "--data-source", mixture[0]["path"] + ":0"),
        env=child_env(), capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 2 and "missing.jsonl' does not exist" in lines[0]
    assert "weight must be a number > 0, got 0.0" in lines[1]


@pytest.mark.parametrize("name, extra, message", [
    ("malformed.jsonl", [], "malformed.jsonl:1: malformed JSON"),
    ("nofield.jsonl", [], "no field 'text' (its fields: 'body')"),
    ("long.jsonl", ["--long-documents", "refuse"], "longer than a row of seq_len + 1 = 17"),
])
def test_bad_documents_are_one_line_errors_before_compiling(name, extra, message, tmp_path,
                                                            capsys):
    """A malformed record, a field that does not exist and a document longer than a row under
    `long_documents: refuse`: one line naming the file and record, exit status 2, before the step
    compiles (the first batch is read first)."""
    from axonn_jax.run.cli import main as cli_main

    path = tmp_path / name
    path.write_text(BAD[name])
    assert cli_main([*SMALL_RUN, "--run-dir", str(tmp_path / "run"), "--data-source", str(path),
                     *extra]) == 2
    out = capsys.readouterr()
    assert message in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert "compiled peak" not in out.out
