"""AxoNN's claim on the scale table: where does offloading the optimizer state pay?

    python benchmarks/offload_claim.py

AxoNN (IPDPS'22) keeps fp32 state in host memory: less memory per GPU, hence fewer pipeline
stages or less tensor/depth splitting, hence less communication, and a faster step. For every
row of the scale table whose grid `plan` picks (`benchmarks/scale.py`), this asks `plan` for the
best grid with the state on the device and the best with `--offload-optimizer` (on `h100-dgx`:
its host link, `comm_model.Machine.host_bw`, times the state's transfers; "gradients too" where
`plan` also put the gradients in host memory, `--offload-gradients`) and writes the ratio to
`results/offload_claim.md`. Rows whose replayed compiled steps were measured beside are quoted
from `results/offload_claim_replay.json` when it exists (`axonn-jax compile --target h100
--overlap-report --json` of both grids).
"""
from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))


def _best(args: list[str]):
    """`plan`'s fastest fitting prediction for these flags, or None."""
    from axonn_jax.analysis import comm_model as cm
    from axonn_jax.run import cli
    from axonn_jax.run.plan import ranked

    config = cli.parse(["plan", *args]).run_config
    found = ranked(config, config.grid.devices, cm.MACHINES["h100-dgx"])
    return found[0] if found else None


def _grid(p) -> str:
    return " × ".join(f"{a} {v}" for a, v in p.grid.as_dict().items() if v > 1) or "one device"


def rows() -> dict[str, dict]:
    """Each planned row's best on-device and offloaded predictions."""
    from scale import ROWS

    out = {}
    for name, row in ROWS.items():
        if row.flags or not row.seq:  # a pinned grid, or the U-Net (no offload model)
            continue
        args = ["--model", row.model, "--devices", str(row.devices), "--batch-size",
                str(row.batch), "--seq-len", str(row.seq), "--dtype", "bfloat16"]
        device, offload = _best(args), _best([*args, "--offload-optimizer"])
        out[name] = {k: p and {"grid": _grid(p) + (", gradients too" if p.offload_gradients
                                                   else ""),
                               "microbatches": p.microbatches, "remat": p.remat,
                              "step_s": p.step_time_s, "memory_gb": p.memory_per_device_bytes / 1e9}
                     for k, p in (("device", device), ("offload", offload))}
        print(name, out[name], flush=True)
    return out


def write(found: dict) -> None:
    """results/offload_claim.md from `rows()` and the replayed pairs."""
    import jax

    replay_path = RESULTS / "offload_claim_replay.json"
    replayed = json.loads(replay_path.read_text()) if replay_path.exists() else {}
    lines = ["# Does offloading the optimizer state pay? AxoNN's claim on the scale table", "",
             f"`python benchmarks/offload_claim.py` (JAX {jax.__version__}, `plan` on `h100-dgx`, "
             "no GPU). For each scale-table row whose grid `plan` picks: its best grid with the "
             "fp32 state on the device against its best with `--offload-optimizer` (the state's "
             "host transfers at the host link's rate), bf16.", "",
             "| row | state on the device: grid, M, remat | s | GB | offloaded: grid, M, remat | s "
             "| GB | offloaded / device |", "|---|---|---|---|---|---|---|---|"]
    for name, r in found.items():
        d, o = r["device"], r["offload"]
        cell = lambda p: (f"{p['grid']}, {p['microbatches']}, {p['remat']} | {p['step_s']:.3f} | "  # noqa: E731
                          f"{p['memory_gb']:.1f}") if p else "none fits | | "
        ratio = f"**{o['step_s'] / d['step_s']:.3f}×**" if d and o else "–"
        lines.append(f"| {name} | {cell(d)} | {cell(o)} | {ratio} |")
    lines += ["", *replayed.get("notes", [])]
    (RESULTS / "offload_claim.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    write(rows())
