"""What a run leaves behind and how it is configured: run directories, YAML configs, TensorBoard
events, profiles, `axonn-jax report` and `plan --plot` images, memory-mapped token files."""
import gzip
import json
import pathlib
import shutil
import struct

import numpy as np
import pytest

from axonn_jax.run import config as config_lib, data as data_lib, rundir
from axonn_jax.run.cli import JOB_KEYS, _launch_run_dir, main as cli_main, parse

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
STEPS = 3
TRAIN = ["train", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "16",
         "--eval-batches", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, devices):
    """A 3-step CLI run on 8 devices, stopped after step 2 (checkpointed, profiled) and resumed
    from its run directory alone."""
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.txt"
    corpus.write_text(pathlib.Path(data_lib.__file__).read_text() * 4)
    path = root / "run"
    assert cli_main([*TRAIN, "--data", str(corpus), "--run-dir", str(path), "--stop-at", "2",
                     "--checkpoint-every", "2", "--profile-steps", "1:2"]) == 0
    assert cli_main(["train", "--resume", str(path)]) == 0  # the rest of the config from config.yaml
    return path


def read_events(path: pathlib.Path) -> list:
    """The events of a TensorBoard event file: TFRecords (length, masked CRC of the length, an
    `Event` proto, masked CRC of the proto), checked and parsed with tensorboardX's own code."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    raw, events, at = path.read_bytes(), [], 0
    while at < len(raw):
        header = raw[at:at + 8]
        (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8:at + 12])
        body = raw[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        assert length_crc == masked_crc32c(header) and body_crc == masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        at += 16 + length
    return events


def test_run_directory_holds_everything(run_dir):
    metrics = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # the resumed job appended step 3
    assert (run_dir / rundir.CHECKPOINTS / "2").is_dir()
    assert "all-reduce" in (run_dir / rundir.HLO / "train_step.hlo.txt").read_text()
    log = (run_dir / rundir.LOG).read_text()
    assert "resumed from step 2" in log and "profile of steps 1-2 written to" in log
    assert "\x1b[" not in log  # plain text
    trace, = (run_dir / rundir.PROFILE).glob("plugins/profile/*/perfetto_trace.json.gz")
    assert json.loads(gzip.decompress(trace.read_bytes()))  # a Perfetto (Chrome JSON) trace
    config = config_lib.read_file(run_dir / rundir.CONFIG)
    assert config["data"]["batch_size"] == 8 and config["grid"]["data"] == 8 and \
        "stop_at" not in config["checkpoint"]


def test_tensorboard_events_hold_every_metric(run_dir):
    files = sorted((run_dir / rundir.TENSORBOARD).glob("events.out.tfevents.*"))
    assert len(files) == 2  # one per job
    scalars = {}
    for f in files:
        for event in read_events(f):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    metrics = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]
    for name in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "examples_per_s",
                 "step_time_s"):
        assert set(scalars[name]) == {m["step"] for m in metrics if name in m}, name
        for m in metrics:
            if name in m:
                assert scalars[name][m["step"]] == pytest.approx(m[name], rel=1e-6)
    for name in ("peak_bytes_compiled", "state_bytes_device", "num_params"):
        assert scalars[f"run/{name}"][0] == pytest.approx(metrics[0][name], rel=1e-6)


def test_tensorboard_writer_leaves_torch_unimported():
    """tensorboardX imports PyTorch where it is installed (the test extra installs it); the run's
    writer comes without it (start-up time), and torch still imports afterwards."""
    import subprocess
    import sys

    code = ("import sys; from axonn_jax.run.hooks import _summary_writer; _summary_writer(); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import torch; print(torch.ones(2).sum())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "tensor(2.)", out.stderr[-2000:]


def test_config_round_trips(run_dir, tmp_path):
    written = config_lib.read_file(run_dir / rundir.CONFIG)
    again = parse(["train", "--config", str(run_dir / rundir.CONFIG)]).run_config
    assert config_lib.effective_config(again, exclude=JOB_KEYS) == written
    path = config_lib.write(tmp_path / "c.yaml", {"steps": 5, "batch-size": 4, "lr": "1e-3",
                                                  "no_error_feedback": True, "dp": 2})
    c = parse(["train", "--config", str(path), "--set", "steps=6", "profile_steps=2:3",
               "--steps", "7"]).run_config
    # The file, then --set, then flags on the command line.
    assert (c.run.steps, c.data.batch_size, c.optimizer.lr, c.compression.error_feedback,
            c.grid.data, c.run.profile_steps) == (7, 4, 1e-3, False, 2, "2:3")
    # Nested sections and paths name the same fields as the flat keys.
    nested = config_lib.write(tmp_path / "n.yaml", {"pipeline": {"schedule": "zb-h1"},
                                                    "grid": {"pipe": 2}, "data": {"seq_len": 8}})
    c = parse(["train", "--config", str(nested), "--set", "optimizer.lr=0.5"]).run_config
    assert (c.pipeline.schedule, c.grid.pipe, c.data.seq_len, c.optimizer.lr) == \
        ("zb-h1", 2, 8, 0.5)
    plan = parse(["plan", "--config", str(config_lib.write(tmp_path / "p.yaml",
                                                           {"devices": 8, "batch": 16}))])
    assert (plan.run_config.grid.devices, plan.run_config.data.batch_size) == (8, 16)


@pytest.mark.parametrize("argv, message", [
    (["--set", "stepz=3"], "unknown config key 'stepz' (did you mean 'steps'?)"),
    (["--set", "steps=ten"], "config key 'steps' must be an integer, got 'ten'"),
    (["--set", "steps=2.5"], "config key 'steps' must be an integer"),
    (["--set", "lr=fast"], "config key 'lr' must be a number"),
    (["--set", "dtype=float64"], "config key 'dtype' must be one of"),
    (["--set", "offload_optimizer=3"], "config key 'offload_optimizer' must be true or false"),
    (["--set", "profile_steps=5:2"], "--profile-steps takes A:B with 1 <= A <= B"),
    (["--set", "steps"], "--set takes key=value"),
    (["--config", "/no/such.yaml"], "config file '/no/such.yaml' does not exist"),
    (["--config", "BAD"], "cannot parse"),
    (["--config", "LIST"], "must hold a mapping"),
    (["--config", "MODEL"], "config key 'model' must be a string"),
])
def test_config_errors_are_one_line(argv, message, tmp_path, capsys):
    files = {"BAD": "steps: [1\n", "LIST": "- steps\n", "MODEL": "model: 3\n"}
    if argv[-1] in files:
        (tmp_path / "c.yaml").write_text(files[argv[-1]])
        argv = [argv[0], str(tmp_path / "c.yaml")]
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_report_overlays_runs(run_dir, tmp_path, capsys):
    from PIL import Image

    other = shutil.copytree(run_dir, tmp_path / "other")
    assert cli_main(["report", str(run_dir), str(other), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.count("| gpt-tiny | 8×1×1×1×1×1×1 | 3 |") == 2
    names = {"loss.png", "loss_vs_tokens.png", "throughput.png", "memory.png", "grad_norm.png"}
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == names
    for name in names:
        assert f"]({name})" in md
        with Image.open(tmp_path / "out" / name) as image:
            assert image.format == "PNG" and image.size == (800, 450)
            assert len(image.getcolors(1 << 16)) > 10  # drawn, not blank
    assert cli_main(["report", str(tmp_path / "out")]) == 2
    assert "is not a run directory: it has no metrics.jsonl" in capsys.readouterr().err


def test_plan_plot(tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "plan.png"
    assert cli_main(["plan", "--devices", "64", "--batch", "512", "--top", "4", "--json",
                     "--plot", str(out)]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert all(sum(p["exposed_comm_by_axis"].values()) ==
               pytest.approx(sum(p["exposed_comm_s"].values())) for p in ranked)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (1200, 160 + 35 * 4)


def test_launch_logs_go_to_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(rundir.ENV_ROOT, str(tmp_path))
    command, logs = _launch_run_dir(["train", "--steps", "1"])
    run = command[command.index("--run-dir") + 1]  # every process writes this one
    assert run.startswith(str(tmp_path / "gpt-tiny-")) and logs == str(pathlib.Path(run) / "logs")
    command, logs = _launch_run_dir(["train", "--resume", str(tmp_path / "r")])
    assert "--run-dir" not in command and logs == str(tmp_path / "r" / "logs")
    assert _launch_run_dir(["my_script.py"])[1].startswith(str(tmp_path / "my_script-"))


def test_token_files_are_memory_mapped_with_the_same_batches(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 5000)
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.astype(np.uint16).tofile(tmp_path / "t.uint16.bin")
    tokens.astype(np.uint32).tofile(tmp_path / "t.uint32.bin")
    for name in ("t.npy", "t.uint16.bin", "t.uint32.bin"):
        mapped = data_lib.load_tokens(tmp_path / name)
        assert isinstance(mapped, np.memmap) and np.array_equal(mapped, tokens)
        train = data_lib.Corpus.load(tmp_path / name).train
        assert isinstance(train, np.memmap)
        # Batches are the same pure function of (seed, step) as from the array in memory.
        batch, expected = (data_lib.lm_batch(t, 3, 7, 4, 16) for t in (train, tokens[:len(train)]))
        assert all(np.array_equal(batch[k], expected[k]) for k in expected)
    (tmp_path / "t.bin").write_bytes(b"\0\1")
    with pytest.raises(ValueError, match="name a raw token file NAME.uint16.bin"):
        data_lib.load_tokens(tmp_path / "t.bin")
    (tmp_path / "odd.uint32.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="not a positive whole number of uint32 ids"):
        data_lib.load_tokens(tmp_path / "odd.uint32.bin")
    np.array([1, 2, 300], np.uint16).tofile(tmp_path / "big.uint16.bin")
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        data_lib.load_tokens(tmp_path / "big.uint16.bin")


def test_compression_ratio_counts_each_devices_shards(devices):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from axonn_jax import ParallelConfig, make_mesh
    from axonn_jax.run.loop import compression_ratio

    mesh = make_mesh(ParallelConfig(data=2, row=2, col=2), devices)
    put = lambda shape, spec: jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    # A 128×128 shard per device: packed at 4 bits plus a scale and an offset per 1024 values,
    # against 4 bytes (twice each, as an all-reduce sends them).
    big = {"kernel": put((256, 256), P("col", "row"))}
    assert compression_ratio(big, 4, 1024) == pytest.approx(4 / (0.5 + 8 / 1024))
    # Shards under 1024 values (whatever the whole tensor) and 1-D tensors are reduced exactly.
    small = {"kernel": put((48, 48), P("col", "row")), "bias": put((4096,), P())}  # 24×24 shards
    assert compression_ratio(small, 4, 1024) == 1.0


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_example_configs_build(name, devices):
    from axonn_jax.train import build_trainer

    config = parse(["train", "--config", str(CONFIGS / name)]).run_config
    build_trainer(config, devices)  # the grid and the model's checks pass
