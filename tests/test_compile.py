"""Compiling train steps that never run (`analysis.targets`, `analysis.compiled`, `axonn-jax
compile`): abstract H100s from this CPU-only host, and simulated CPU devices beyond the test
process's 8 (in a child process); the report's memory, bytes and FLOPs beside `plan`'s, under the
same names; a grid that does not fit is one line and exit status 1; the CUDA wheels installed for
this leave plain CPU runs alone."""
import json
import os
import subprocess
import sys

import pytest

from axonn_jax.analysis import compiled as cc, hlo, targets
from axonn_jax.analysis.comm_model import Prediction
from axonn_jax.run.cli import main as cli_main
from test_distributed import REPO, child_env, cli

NO_CUDA = targets.cuda_compile_problem()
needs_cuda = pytest.mark.skipif(NO_CUDA is not None, reason=f"{NO_CUDA}")


def test_h100_topologies():
    assert [targets.h100_topology(n) for n in (1, 8, 16, 1024)] == \
        ["1x1x1", "1x1x8", "1x2x8", "1x128x8"]
    with pytest.raises(ValueError, match="--devices 12: H100 targets come in nodes of 8"):
        targets.h100_topology(12)


def test_cpu_devices_beyond_this_process_name_the_way():
    with pytest.raises(ValueError, match="simulates 8 CPU devices; start it with --devices 16"):
        targets.cpu_devices(16)


@needs_cuda
def test_h100_target_holds_the_published_figures():
    text = targets.h100_target_config()
    for field, value in targets.H100_SXM.items():
        assert field in text
    assert "major: 9 minor: 0" in text and 'platform_name: "CUDA"' in text
    devices = targets.h100_devices(16)
    assert len(devices) == 16 and {d.platform for d in devices} == {"gpu"}
    assert devices[0].device_kind == targets.H100_NAME
    assert len({d.process_index for d in devices}) == 2  # two nodes of 8


def test_report_and_plan_share_field_names():
    names = set(Prediction.__dataclass_fields__) | {"fits"}
    assert set(cc.FIELDS) <= names
    assert set(cc.FIELDS) <= set(cc.CompileReport.__dataclass_fields__) | {"fits"}


@needs_cuda
def test_h100_report_of_a_4d_llama(tmp_path, capsys):
    """Llama (grouped-query heads) on 16 abstract H100s, data × pipe × row × col, 1F1B, bf16,
    cuDNN attention, host-resident optimizer state, CGX: the compiled module has the fused attention
    calls and host buffers, its bf16 gradients are reduced in bf16 (the mesh's platform, not this
    CPU process's); the report's figures are the module's, plan's sit beside them by name."""
    code = cli_main(["compile", "--target", "h100", "--devices", "16", "--model", "llama-tiny",
                     "--batch-size", "16", "--seq-len", "64", "--dtype", "bfloat16", "--dp", "2",
                     "--pipe", "2", "--row", "2", "--col", "2", "--microbatches", "2",
                     "--schedule", "1f1b", "--attention", "cudnn", "--offload-optimizer",
                     "--compress-bits", "8", "--dump-hlo", str(tmp_path), "--json",
                     "--overlap-report"])
    assert code == 0
    (report,) = json.loads(capsys.readouterr().out)
    (module,) = tmp_path.glob("train_step_*.txt")
    text = module.read_text()
    assert "__cudnn$fmha" in text and "S(5)" in text
    assert any(" bf16[" in line.split("all-reduce-start(")[0]
               for line in text.splitlines() if "all-reduce-start(" in line)
    mesh = {"data": 2, "pipe": 2, "depth": 1, "row": 2, "col": 2}
    assert report["comm_bytes_by_axes"] == {
        f"{kind} over {'+'.join(axes)}": b for (kind, axes), b in hlo.bytes_by_axes(text, mesh).items()}
    assert report["comm_bytes_by_axes"]["collective-permute over pipe"] > 0
    assert report["target"] == "h100" and report["devices"] == 16 and report["fits"]
    m = report["memory_breakdown"]
    assert report["memory_per_device_bytes"] >= m["arguments"] + m["temporaries"] - m["aliased"]
    assert report["host_memory_per_device_bytes"] >= m["host_arguments"] > 0
    for field in cc.FIELDS:
        assert field in report and field in report["predicted"]
    assert report["predicted"]["host_memory_per_device_bytes"] > 0
    assert report["flops_per_device"] > report["model_flops_per_device"]  # fused attention counted
    assert report["compile_s"] > 0
    # The schedule replayed: every collective of the module, bytes as `hlo` counts them, and the
    # offloaded state's copies over the host link.
    overlap = report["overlap"]
    host = {k for k in overlap["by_axes"] if k.endswith(" over host")}
    assert host == {"host-to-device over host", "device-to-host over host"}
    assert {k: r["bytes"] for k, r in overlap["by_axes"].items() if k not in host} == \
        pytest.approx(report["comm_bytes_by_axes"])
    assert 0 <= overlap["total"]["hidden"] <= 1 and overlap["matmul_s"] > 0
    assert overlap["step_s"] >= overlap["matmul_s"] + overlap["other_s"]


@needs_cuda
def test_offloaded_update_writes_the_host_state_in_place(capsys):
    """`--offload-optimizer` on abstract H100s: the update loop reads and writes the same host
    buffers, so the compiled step holds the host state once (its loop once read the step's
    inputs and wrote copies: host temporaries of nearly the whole state, 19.3 GB beside 24.4 GB
    for an 8-layer GPT of width 4096)."""
    assert cli_main(["compile", "--target", "h100", "--devices", "2", "--model", "llama-tiny",
                     "--batch-size", "4", "--seq-len", "64", "--dtype", "bfloat16", "--dp", "2",
                     "--offload-optimizer", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    m = report["memory_breakdown"]
    assert m["host_arguments"] > 0 and m["host_temporaries"] == 0, m


def test_cpu_target_beyond_this_process(tmp_path):
    """32 simulated CPU devices in a child process (`--target cpu --devices 32`), all five axes."""
    out = subprocess.run(cli("compile", "--target", "cpu", "--devices", "32", "--model",
                             "gpt-tiny", "--batch-size", "16", "--seq-len", "32", "--dp", "2",
                             "--pipe", "2", "--depth", "2", "--row", "2", "--col", "2",
                             "--microbatches", "2", "--schedule", "1f1b", "--json"),
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (report,) = json.loads(out.stdout)
    assert report["target"] == "cpu" and report["devices"] == 32
    axes = {key.split(" over ")[1] for key in report["comm_bytes_by_axes"]}
    assert {"pipe", "depth", "row", "col"} <= axes
    assert report["comm_bytes_by_axes"]["collective-permute over pipe"] == \
        report["predicted"]["comm_bytes_per_device"]["collective-permute"]


def test_a_grid_that_does_not_fit_is_one_line(capsys):
    """gpt-20b's fp32 state (16 bytes a parameter) on 8 data-parallel devices: 330 GB each."""
    code = cli_main(["compile", "--target", "cpu", "--devices", "8", "--model", "gpt-20b",
                     "--batch-size", "8", "--seq-len", "32", "--dp", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("axonn-jax compile: grid data=8 does not fit: ")
    assert "GB per device" in err[0] and "> 80 GB on cpu" in err[0]


@needs_cuda
def test_plain_cpu_runs_ignore_the_cuda_plugin(tmp_path):
    """With the CUDA compile wheels installed, `axonn-jax train --devices N` on this machine without
    a GPU runs on the CPU without JAX_PLATFORMS in the environment (no plugin traceback)."""
    import importlib.util
    import pathlib

    env = child_env()
    env.pop("JAX_PLATFORMS")
    plugins = pathlib.Path(importlib.util.find_spec("jax_plugins.xla_cuda12").origin).parents[2]
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(plugins)])
    out = subprocess.run(cli("train", "--devices", "2", "--steps", "1", "--batch-size", "2",
                             "--seq-len", "8", "--eval-batches", "1", "--run-dir",
                             str(tmp_path / "run")),
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Unable to load CUDA" not in out.stderr


@needs_cuda
def test_loading_the_cuda_plugin_prints_no_traceback():
    """A fresh process that loads the compile-only CUDA plugin and then starts JAX's backends
    (what `axonn-jax compile --target h100` does) writes no traceback: JAX's plugin search once
    found the late-registered plugin and logged a second registration's error."""
    code = ("from axonn_jax.analysis import targets; import jax; "
            "assert targets.load_cuda_plugin(); print(jax.device_count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
