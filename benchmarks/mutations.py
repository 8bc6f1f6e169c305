"""Mutation check: do the tests see a wrong gradient? (not part of the test suite)

Applies known bugs one at a time to a temporary copy of the repository (never to these files),
runs the tests named to catch each, in the copy, and prints a table: the mutation, where it was
applied, and the first named test that failed on it (or MISSED). Every named test is first run on
the unmutated copy, so that a test failing for another reason cannot pass for a catch.

Each mutation is data: (name, file, the exact original snippet, its replacement, the tests that
must catch it). When code moves, only the snippets need re-targeting: a snippet that is not found
exactly once stops the script before anything runs.

    python benchmarks/mutations.py                     # all, table to stdout
    python benchmarks/mutations.py --out benchmarks/results/mutations.md
    python benchmarks/mutations.py --only data-sum --only microbatch-mean --list

The tests run with this interpreter (`python -m pytest`), one pytest process per test, each
stopping at its first failure; `mpirun` must be next to it for the MPI mutations.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
COPIED = ("axonn_jax", "tests", "configs", "docs", "README.md", "pyproject.toml")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in `file`
    replacement: str
    tests: tuple[str, ...]  # pytest node ids, tried in order until one fails
    bug: str  # what the mutation does, in words


PIPELINE_GRADS = "tests/test_pipeline.py::test_gradients_equal_reference[grid0-1f1b-4-1]"

MUTATIONS = [
    Mutation(
        "data-sum", "axonn_jax/step/reducers.py",
        # Both paths: the sum exchanged here, and the one the engine made layer by layer.
        "size = manual_axis_size(axis)",
        "size = 1",
        ("tests/test_train.py::test_data_parallel_trajectory_equals_single_device",),
        "gradients summed over `data` instead of averaged"),
    Mutation(
        "mpi-sum", "axonn_jax/transport/mpi.py",
        "reduce=lambda grads, state, key: (mean(grads), state), mean=mean,",
        "reduce=lambda grads, state, key: (allreduce_sum(grads, comm), state), mean=mean,",
        ("tests/test_distributed.py::test_mpirun_transport_equals_single_process[4-2]",),
        "gradients summed over MPI processes instead of averaged"),
    Mutation(
        "mpi-same-rows", "axonn_jax/step/train_step.py",
        "return a[index * size:(index + 1) * size]",
        "return a[:size]",
        ("tests/test_distributed.py::test_mpirun_transport_equals_single_process[4-2]",),
        "every MPI process trains on the first rows of the batch"),
    Mutation(
        "microbatch-mean", "axonn_jax/parallel/pipeline.py",
        "jnp.float32(scale / m)",
        "jnp.float32(scale)",
        (PIPELINE_GRADS,),
        "pipeline gradients summed over microbatches (the 1/M missing)"),
    Mutation(
        "microbatch-shifted", "axonn_jax/parallel/pipeline.py",
        "self.microbatch(self.at(\"backward\", t))",
        "self.microbatch((jnp.maximum(self.at(\"backward\", t), 0) + 1) % self.m)",
        (PIPELINE_GRADS,),
        "a stage's backward reads the next microbatch's inputs"),
    Mutation(
        "stage-norm", "axonn_jax/step/train_step.py",
        "sum_squares, laid_out = self.host_engine.sum_over_stages, None",
        "sum_squares, laid_out = (lambda s: s), None",
        ("tests/test_mpi_pipeline.py::test_mpirun_pipeline_equals_single_process"
         "[2-2-zb-h1-4-extra2]",),
        "the MPI pipeline clips by each stage's own gradient norm, not the global one"),
    Mutation(
        "offload-scaled", "axonn_jax/offload/optimizer.py",
        "if in_host_memory(x) else x for x in sel(self.grad_leaves)]",
        "if in_host_memory(x) else x for x in sel(self.grad_leaves)]\n"
        "        g = [None if x is None else x * (4.0 if x.ndim <= 1 else 0.25) for x in g]",
        ("tests/test_offload.py::test_offloaded_optimizer_gives_identical_losses_and_lives_on_host",
         "tests/test_update_reference.py::test_update_equals_numpy_reference[offload-clipped]"),
        "host-streamed update: vector gradients ×4, matrix gradients ×0.25"),
    Mutation(
        "clip-factor", "axonn_jax/step/update.py",
        "jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm)",
        "jnp.where(grad_norm < max_norm, 1.0, jnp.sqrt(max_norm / grad_norm))",
        ("tests/test_update_reference.py::test_update_equals_numpy_reference[adamw-clipped]",),
        "clipping scales by sqrt(clip / norm)"),
    Mutation(
        "loss-scale", "axonn_jax/step/update.py",
        "inverse = 1.0 / jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32)",
        "inverse = jnp.float32(1.0)",
        ("tests/test_update_reference.py::test_update_equals_numpy_reference[float16-offload]",),
        "fp16 gradients not divided by the loss scale"),
    Mutation(
        "adam-b2", "axonn_jax/run/options.py",
        "option(0.95, \"AdamW's second-moment decay\")", "option(0.999, \"AdamW's second-moment decay\")",
        ("tests/test_update_reference.py::test_update_equals_numpy_reference[adamw]",),
        "AdamW's second-moment decay 0.999 instead of 0.95"),
    Mutation(
        "weight-decay", "axonn_jax/run/options.py",
        "weight_decay=o.weight_decay)", "weight_decay=0.0)",
        ("tests/test_update_reference.py::test_update_equals_numpy_reference[adamw]",),
        "AdamW's weight decay dropped"),
    Mutation(
        "warmup", "axonn_jax/run/options.py",
        "warmup_steps=warmup,", "warmup_steps=warmup + 1,",
        ("tests/test_update_reference.py::test_update_equals_numpy_reference[adamw]",),
        "the warm-up one step longer than asked"),
    Mutation(
        "expert-sum", "axonn_jax/step/train_step.py",
        "return exchange.sum_over_unsplit(grads, specs, axes, total)",
        "return exchange.sum_over_unsplit(grads, specs, axes)",
        ("tests/test_batch_axes.py::test_expert_grids_train_like_one_device[data2-expert2]",),
        "gradients summed over the expert/context axes instead of averaged"),
    Mutation(
        "context-unsplit-param", "axonn_jax/parallel/exchange.py",
        "return tuple(a for a in axes if a not in spec_axes(spec) and a in varying_axes(g))",
        "return tuple(a for a in axes if a not in spec_axes(spec) and a in varying_axes(g)\n"
        "                 and a != 'context')",
        ("tests/test_batch_axes.py::test_context_grids_train_like_one_device[data2-context2-ring]",),
        "a replicated parameter's gradient not summed over the context axis"),
    Mutation(
        "spmd-microbatch-mean", "axonn_jax/step/engines.py",
        "grad_fn(low, b, scale / m)",
        "grad_fn(low, b, scale)",
        ("tests/test_batch_axes.py::test_gradient_accumulation_trains_like_one_device",),
        "gradient accumulation sums the microbatches' gradients (the 1/M missing)"),
    Mutation(
        "cgx-residual-unused", "axonn_jax/parallel/compression.py",
        # The quantized tensors' residual (added inside the quantizer's one pass); their new
        # residual is still returned, the error of quantizing the gradient alone.
        "residual=None if r is None else _leaf_rows(r, bucket_size),",
        "residual=None,",
        ("tests/test_compression.py::test_compressed_psum_within_two_quantization_bound",),
        "CGX: the error-feedback residual is not added before quantizing"),
    Mutation(
        "cgx-residual-dropped", "axonn_jax/parallel/compression.py",
        """        for i, e in zip(idx, errors):
            new_res[i] = e""",
        """        for i, e in zip(idx, errors):
            new_res[i] = e if e is None else jnp.zeros_like(e)""",
        ("tests/test_compression.py::test_compressed_psum_within_two_quantization_bound",),
        "CGX: the new residual is dropped (error feedback resets every step)"),
    Mutation(
        "export-shard-order", "axonn_jax/models/hf.py",
        """    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)""",
        """    if getattr(x, "is_fully_addressable", True):
        a, n = np.asarray(x), len({str(s.index) for s in getattr(x, "addressable_shards", [])})
        if n > 1 and a.shape[-1] % n == 0:  # the shards put back in reverse order
            a = np.concatenate(np.split(a, n, axis=-1)[::-1], axis=-1)
        return a""",
        ("tests/test_llama.py::test_fine_tunes_with_the_tokenizer_and_exports[row2]",),
        "the HF export joins a split tensor's shards in the wrong order"),
    Mutation(
        "export-compute-copy", "axonn_jax/run/loop.py",
        'params = jax.tree.map(_readable, trainer.step.canonical_state(state)["params"])',
        'params = trainer.step.canonical_params(state.params)',
        ("tests/test_llama.py::test_fine_tunes_with_the_tokenizer_and_exports[bf16-offload]",),
        "with offload, the export writes the bf16 device copy, not the fp32 masters"),
    Mutation(
        "remat-auto-dtype", "axonn_jax/step/train_step.py",
        """        self.compute_dtype = DTYPES[o.dtype]
        self.scaler = loss_scaler(o.dtype)
        self.specs = self._param_specs()
        self.reducer = parts.reducer(self.fns.specs)
        self.host_engine = None  # built last: it computes with the plan's functions
        self.plan = self._plan()
""",
        """        self.scaler = loss_scaler(o.dtype)
        self.specs = self._param_specs()
        self.reducer = parts.reducer(self.fns.specs)
        self.host_engine = None  # built last: it computes with the plan's functions
        self.plan = self._plan()
        self.compute_dtype = DTYPES[o.dtype]
""",
        ("tests/test_user_models.py::test_activation_planner_keeps_the_trajectory[bfloat16]",),
        "the activation planner runs before the compute dtype is known (the old crash)"),
    Mutation(
        "remat-auto-cotangent", "axonn_jax/offload/activations.py",
        "ct = jax.eval_shape(f, params, x)", "ct = x",
        ("tests/test_user_models.py::test_activation_planner_keeps_the_trajectory[bfloat16]",),
        "the planner differentiates a block with a cotangent in the input's dtype (bf16 ViT)"),
]


def copy_repository(target: pathlib.Path) -> None:
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, target / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, target / name)


def check_snippets(mutations) -> None:
    """Every snippet occurs exactly once in its file, or nothing runs."""
    problems = []
    for m in mutations:
        count = (REPO / m.file).read_text().count(m.original)
        if count != 1:
            problems.append(f"{m.name}: the snippet occurs {count} times in {m.file} (needs 1)")
    if problems:
        raise SystemExit("mutations.py: re-target these snippets:\n  " + "\n  ".join(problems))


def run_test(copy: pathlib.Path, node: str, timeout: int) -> tuple[bool, float, str]:
    """(passed, seconds, the whole output) of one pytest node id in `copy`."""
    # One compilation cache for all runs: a mutated program has other HLO, hence other keys.
    env = dict(os.environ, PYTHONPATH=str(copy), JAX_COMPILATION_CACHE_DIR=str(copy / ".jax-cache"))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              node], cwd=copy, env=env, capture_output=True, text=True,
                             timeout=timeout)
        passed, text = out.returncode == 0, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        passed, text = False, f"timed out after {timeout} s\n{e.stdout or ''}"
    return passed, time.monotonic() - start, text


def failure_line(text: str) -> str:
    """The first `E   ...` line of a pytest failure, shortened for the table."""
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:110].replace("|", "\\|")
    return text.strip().splitlines()[-1][:110] if text.strip() else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only this mutation (repeat)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--skip-baseline", action="store_true",
                   help="do not first run the named tests on the unmutated copy")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per test run")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    known = {m.name for m in MUTATIONS}
    unknown = set(args.only) - known
    if unknown:
        raise SystemExit(f"mutations.py: unknown mutation(s) {sorted(unknown)}; "
                         f"known: {sorted(known)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:22} {m.file:34} {m.bug}")
        return 0
    check_snippets(chosen)
    rows = []
    with tempfile.TemporaryDirectory(prefix="axonn-mutations-") as tmp:
        copy = pathlib.Path(tmp)
        copy_repository(copy)
        if not args.skip_baseline:
            for node in dict.fromkeys(t for m in chosen for t in m.tests):
                passed, seconds, text = run_test(copy, node, args.timeout)
                print(f"baseline {node}: {'passed' if passed else 'FAILED'} ({seconds:.0f} s)",
                      flush=True)
                if not passed:
                    raise SystemExit(f"mutations.py: {node} fails without a mutation:\n"
                                     f"{text[-2000:]}")
        for m in chosen:
            path = copy / m.file
            pristine = path.read_text()
            path.write_text(pristine.replace(m.original, m.replacement))
            caught, why, spent = None, "", 0.0
            try:
                for node in m.tests:
                    passed, seconds, text = run_test(copy, node, args.timeout)
                    spent += seconds
                    if not passed:
                        caught, why = node, failure_line(text)
                        break
            finally:
                path.write_text(pristine)
            rows.append((m, caught, why, spent))
            print(f"{m.name}: {'caught by ' + caught if caught else 'MISSED'} ({spent:.0f} s)",
                  flush=True)
    table = ["| mutation | where | bug | caught by | how it failed |", "|---|---|---|---|---|"]
    for m, caught, why, _ in rows:
        table.append(f"| {m.name} | `{m.file}` | {m.bug} | "
                     f"{'`' + caught + '`' if caught else '**MISSED**'} | {why} |")
    text = "\n".join(table)
    print("\n" + text)
    if args.out:
        pathlib.Path(args.out).write_text(
            "# Mutation check\n\n`python benchmarks/mutations.py --out "
            "benchmarks/results/mutations.md`: each known bug applied alone to a copy of the "
            "repository, and the first named test that failed on it.\n\n" + text + "\n")
    return 0 if all(caught for _, caught, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
