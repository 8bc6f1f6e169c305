"""FP8 training against bf16 (issue 25, item 4), on CPU: the same run (model, data, seed, steps)
with `--dtype bfloat16` and with `--dtype bfloat16 --fp8`, one simulated device; the final
training loss (mean of the last 20 steps) and validation loss of each, and their relative gap.

    python benchmarks/bench_fp8.py                       # gpt-tiny and llama-tiny, 300 steps
    python benchmarks/bench_fp8.py --model gpt-tiny --steps 50

Writes a markdown table to stdout (and `--json F`).
"""
import argparse
import json
import sys

from axonn_jax.mesh import simulate_cpu_devices


def run(model: str, steps: int, fp8: bool, batch_size: int, seq_len: int) -> dict:
    import jax

    from axonn_jax import ParallelConfig
    from axonn_jax.train import TrainOptions, train

    out = train(TrainOptions(model=model, steps=steps, batch_size=batch_size, seq_len=seq_len,
                             dtype="bfloat16", fp8=fp8, eval_every=steps, eval_batches=4,
                             parallel=ParallelConfig()), devices=jax.devices()[:1])
    losses = [h["loss"] for h in out["history"]]
    last = [h for h in out["history"] if "val_loss" in h][-1]
    return {"model": model, "fp8": fp8, "steps": steps, "first_loss": losses[0],
            "train_loss_last20": sum(losses[-20:]) / len(losses[-20:]),
            "val_loss": last["val_loss"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=None, help="default: gpt-tiny, llama-tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    simulate_cpu_devices(1)
    rows = []
    for model in args.model or ["gpt-tiny", "llama-tiny"]:
        bf16, fp8 = (run(model, args.steps, f, args.batch_size, args.seq_len) for f in (False, True))
        rows += [bf16, fp8]
        print(f"| {model} | {args.steps} | {bf16['train_loss_last20']:.4f} | "
              f"{fp8['train_loss_last20']:.4f} | "
              f"{fp8['train_loss_last20'] / bf16['train_loss_last20'] - 1:+.2%} | "
              f"{bf16['val_loss']:.4f} | {fp8['val_loss']:.4f} | "
              f"{fp8['val_loss'] / bf16['val_loss'] - 1:+.2%} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
