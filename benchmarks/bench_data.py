"""Does input keep up with the step? Tokens per second of the document loader (`run/loader.py`) on
this machine against the tokens per second a gpt-tiny / gpt-mini train step consumes, and the time
a training loop waits for its batch when the loader's prefetch runs beside the step.

    python benchmarks/bench_data.py [--devices 8] [--docs 4000] [--seconds 4]

A synthetic corpus (words of a Zipf vocabulary, document lengths log-normal around 800 bytes) is
written as JSONL, Parquet (row groups of 1000 rows) and ArrayRecord; a byte-level BPE tokenizer
(4096 ids) is trained on it with the `tokenizers` library. Loader rows: batches of 16 rows of 256
tokens, the producer alone (no prefetch, so the consumer's rate is the producer's), tokens counted
without padding. Step rows: the median step time of the model on `--devices` simulated CPU devices
(data parallel) at the batch shown, and in the same process the same loop fed by the loader
(byte-level JSONL, a prefetch thread) with the median time `next` waited.

Results go to benchmarks/results/data.json and data.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOADER_BATCH, LOADER_SEQ = 16, 256
MODELS = {"gpt-tiny": (16, 128), "gpt-mini": (16, 128)}  # model: (batch, seq_len)


def write_corpus(directory: pathlib.Path, docs: int) -> dict[str, str]:
    """The corpus in three formats; returns {format: path}."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(2000)]
    p = 1 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    texts = []
    for _ in range(docs):
        n_words = max(1, int(rng.lognormal(np.log(130), 0.6)))  # ~800 bytes on average
        texts.append(" ".join(np.asarray(vocab)[rng.choice(len(vocab), n_words, p=p)]))
    paths = {"jsonl": directory / "docs.jsonl", "parquet": directory / "docs.parquet",
             "array_record": directory / "docs.array_record"}
    paths["jsonl"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"text": texts}), paths["parquet"], row_group_size=1000)
    writer = ArrayRecordWriter(str(paths["array_record"]), "group_size:1")
    for t in texts:
        writer.write(json.dumps({"text": t}).encode())
    writer.close()
    return {k: str(v) for k, v in paths.items()}, texts


def train_tokenizer(texts, path: pathlib.Path) -> str:
    """A byte-level BPE `tokenizer.json` of 4096 ids (end of document: `<|endoftext|>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def loader_rate(sources: list[dict], tokenizer, vocab: int, seconds: float, workers: int) -> dict:
    """Batches and real (not padding) tokens per second of the loader alone."""
    from axonn_jax.run import loader

    cfg = loader.DataConfig.from_dict({"sources": sources, "workers": workers,
                                       "prefetch": 2 if workers else 0, "val_fraction": 0.0})
    batches = loader.make_batches(cfg, LOADER_SEQ, LOADER_BATCH, tokenizer, 0, 1, vocab_size=vocab)
    next(batches)  # indexes, worker processes, tokenizer: not timed
    batches.stats()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(batches)
        n += 1
    elapsed = time.perf_counter() - t0
    stats = batches.stats()
    batches.close()
    slots = n * LOADER_BATCH * LOADER_SEQ
    return {"batches_per_s": n / elapsed, "tokens_per_s": slots * (1 - stats["data_padding"]) / elapsed,
            "padding": stats["data_padding"], "documents_per_s": stats["data_documents"] * n / elapsed}


def step_rates(model: str, batch: int, seq_len: int, corpus: str, steps: int) -> dict:
    """Median step time on fixed data, and the same loop fed by the loader (prefetch thread):
    median step time and median wait for `next`."""
    import jax
    import numpy as np

    from axonn_jax import ParallelConfig
    from axonn_jax.run import loader
    from axonn_jax.run.trainer import build_trainer
    from axonn_jax.train import TrainOptions
    from timing import median_step_time

    trainer = build_trainer(TrainOptions(model=model, batch_size=batch, seq_len=seq_len,
                                         parallel=ParallelConfig(data=jax.device_count())))
    state = trainer.init_state()
    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
    fixed = trainer.place({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    step = trainer.step.lower(state, fixed).compile()
    alone, state = median_step_time(step, state, fixed, steps)
    cfg = loader.DataConfig.from_dict({"sources": [corpus], "prefetch": 4, "val_fraction": 0.0})
    batches = loader.make_batches(cfg, seq_len, batch, None, 0, 1, vocab_size=256)
    waits, times = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        local = next(batches)
        t1 = time.perf_counter()
        state, metrics = step(state, trainer.place({k: local[k] for k in ("inputs", "targets")}))
        jax.block_until_ready((state, metrics))
        if i:  # the first one waited for the loader to start
            waits.append(t1 - t0)
            times.append(time.perf_counter() - t0)
    batches.close()
    tokens_per_step = batch * seq_len
    return {"model": model, "batch": batch, "seq_len": seq_len, "step_s": alone,
            "tokens_per_s": tokens_per_step / alone, "fed_step_s": statistics.median(times),
            "wait_s": statistics.median(waits), "wait_max_s": max(waits)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    from axonn_jax.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices)
    import os

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AXONN_JAX_CACHE"] = tmp  # indexes: not into the user's cache
        directory = pathlib.Path(tmp)
        paths, texts = write_corpus(directory, args.docs)
        bpe = train_tokenizer(texts, directory / "tokenizer.json")
        mixture = [{"path": paths["jsonl"], "weight": 2}, {"path": paths["parquet"]},
                   {"path": paths["array_record"]}]
        cases = [("jsonl", "bytes", [paths["jsonl"]], None, 256, 0),
                 ("parquet", "bytes", [paths["parquet"]], None, 256, 0),
                 ("array_record", "bytes", [paths["array_record"]], None, 256, 0),
                 ("mixture 2:1:1", "bytes", mixture, None, 256, 0),
                 ("jsonl", "BPE 4096", [paths["jsonl"]], bpe, 4096, 0),
                 ("jsonl", "BPE 4096, 2 workers", [paths["jsonl"]], bpe, 4096, 2)]
        loaders = [{"source": name, "tokens": tok, "workers": workers,
                    **loader_rate(src, tokenizer, vocab, args.seconds, workers)}
                   for name, tok, src, tokenizer, vocab, workers in cases]
        steps = [step_rates(m, b, s, paths["jsonl"], args.steps) for m, (b, s) in MODELS.items()]
    result = {"devices": jax.device_count(), "backend": jax.default_backend(),
              "cpus": os.cpu_count(), "docs": args.docs, "loader_batch": LOADER_BATCH,
              "loader_seq_len": LOADER_SEQ, "loaders": loaders, "steps": steps,
              "load_average": os.getloadavg()[0]}  # other jobs on the machine
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Data loader against the step: {os.cpu_count()} CPU cores (load average "
             f"{result['load_average']:.1f} at the end), {jax.device_count()} simulated "
             f"{jax.default_backend()} devices, {args.docs} documents (~800 bytes)", "",
             f"Loader alone, batches of {LOADER_BATCH} x {LOADER_SEQ} packed tokens:", "",
             "| source | tokens | batches/s | tokens/s (no padding) | documents/s | padding |",
             "|---|---|---|---|---|---|"]
    for r in loaders:
        lines.append(f"| {r['source']} | {r['tokens']} | {r['batches_per_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['documents_per_s']:,.0f} | {r['padding']:.1%} |")
    lines += ["", "Train step (data parallel) alone, and fed by the loader (byte-level JSONL, a "
              "prefetch thread of 4 batches):", "",
              "| model | batch x seq | step s | tokens/s consumed | loader / step (JSONL bytes) | "
              "fed step s | wait for next s (median, max) |", "|---|---|---|---|---|---|---|"]
    for r in steps:
        ratio = loaders[0]["tokens_per_s"] / r["tokens_per_s"]
        lines.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {r['step_s']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio:.1f}x | {r['fed_step_s']:.4f} | "
                     f"{r['wait_s']:.4f}, {r['wait_max_s']:.4f} |")
    (out / "data.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
