"""The communication model against the compiled train step, for any preset the planner counts: wire
bytes per (collective kind, mesh axes) per device, predicted (`analysis.comm_model.bytes_by_axes`)
and measured in the compiled step's HLO (`analysis.hlo.bytes_by_axes`), on 8 simulated CPU
devices. Compile only. (tests/test_comm_model.py checks the GPT and Llama grids in the suite; this
reports any model, e.g. the U-Net.)

    python benchmarks/check_comm_model.py --model unet-tiny \
        --grid pipe=2,data=4:2 --grid data=8 --grid data=8/4

A grid is `AXES[:MICROBATCHES][/BITS]`. Results: benchmarks/results/comm_check_<model>.md.
"""
import argparse
import pathlib
import sys

from axonn_jax.mesh import simulate_cpu_devices


def parse_grid(text: str):
    from axonn_jax import ParallelConfig

    text, _, bits = text.partition("/")
    text, _, microbatches = text.partition(":")
    return ParallelConfig.parse(text), int(microbatches or 1), int(bits or 0)


def compare(model: str, batch: int, seq_len: int, grid, microbatches: int, bits: int) -> list[str]:
    """Markdown rows `| grid | kind | axes | predicted | measured | ratio |` of one compiled step."""
    import jax

    from axonn_jax.analysis import comm_model as cm, hlo
    from axonn_jax.run.plan import workload
    from axonn_jax.train import TrainOptions, build_trainer

    options = TrainOptions(model=model, batch_size=batch, seq_len=seq_len, parallel=grid,
                           microbatches=microbatches, compress_bits=bits)
    trainer = build_trainer(options, jax.devices()[:grid.num_devices])
    state = trainer.init_state(abstract=True)
    text = trainer.step.lower(state, trainer.bound.abstract_batch()).compile().as_text()
    measured = hlo.bytes_by_axes(text, grid.as_dict())
    predicted = cm.bytes_by_axes(workload(options, "cpu"), grid)
    name = ",".join(f"{k}={v}" for k, v in grid.as_dict().items() if v > 1) + \
        (f" M={microbatches}" if microbatches > 1 else "") + (f" {bits}-bit" if bits else "")
    rows = []
    for kind, axes in sorted(set(measured) | set(predicted)):
        got, want = measured.get((kind, axes), 0.0), predicted.get((kind, axes), 0.0)
        ratio = f"{want / got:.4f}" if got else "-"
        rows.append(f"| {name} | {kind} | {'+'.join(axes)} | {want:.0f} | {got:.0f} | {ratio} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="unet-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--grid", action="append", default=None,
                   help="AXES[:MICROBATCHES][/BITS]; default: pipe=2,data=4:2, data=8, data=8/4")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    simulate_cpu_devices(8)
    lines = [f"# Communication model against the compiled step: {args.model}, batch "
             f"{args.batch_size}", "", "Wire bytes per device per step.", "",
             "| grid | kind | axes | predicted | measured | predicted / measured |",
             "|---|---|---|---|---|---|"]
    for text in args.grid or ["pipe=2,data=4:2", "data=8", "data=8/4"]:
        lines += compare(args.model, args.batch_size, args.seq_len, *parse_grid(text))
        print("\n".join(lines[-1:]), flush=True)
    out = pathlib.Path(args.out) / f"comm_check_{args.model}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
