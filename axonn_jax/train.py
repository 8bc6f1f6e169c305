"""The train-step builder and the training loop.

One code path: the CLI, the benchmarks and the tests all build their step with `build_trainer`.

The step is a `shard_map` that is manual over the batch-replicating axis `data` and automatic over the
rest: each data shard computes the gradients of its own rows, the step reduces them explicitly over
`data` (the hook for compression and host offload), and the optimizer update runs on global arrays,
partitioned by GSPMD like the parameters.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from . import data as data_lib
from ._compat import HOST_MEMORY_KIND, memory_kind_of, shard_map, to_varying
from .config import ParallelConfig, check_divisible
from .mesh import config_of, make_mesh
from .models import gpt
from .transform import parallelize

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class TrainOptions:
    """Everything a training run needs. Field names match the `axonn-jax train` flags."""

    model: str = "gpt-tiny"
    steps: int = 100
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup_steps: int = -1  # -1: 5% of the steps
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    data_path: str | None = None
    eval_every: int = 0  # 0: about ten validations per run
    eval_batches: int = 4
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume: bool = False
    stop_at: int = 0  # stop after this step (schedule still spans `steps`); 0: run to the end
    metrics_out: str | None = None
    dump_hlo: str | None = None
    sample_tokens: int = 0
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    # Modes built by later work; the CLI refuses them until they exist.
    microbatches: int = 1
    schedule: str = "gpipe"
    offload_optimizer: bool = False
    remat: str = "none"
    memory_budget_gb: float | None = None
    compress_bits: int = 0
    compress_bucket: int = 1024
    error_feedback: bool = True
    transport: str = "xla"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 20) if self.warmup_steps < 0 else self.warmup_steps


def unimplemented_options(options: TrainOptions) -> list[str]:
    """The flags of modes that are not built yet, as the user spelled them."""
    p, bad = options.parallel, []
    for axis in ("pipe",):
        if getattr(p, axis) != 1:
            bad.append(f"--{axis} {getattr(p, axis)}")
    defaults = TrainOptions()
    for name in ("microbatches", "schedule", "offload_optimizer", "remat", "memory_budget_gb",
                 "compress_bits", "transport"):
        if getattr(options, name) != getattr(defaults, name):
            bad.append(f"--{name.replace('_', '-').replace('-gb', '')} {getattr(options, name)}")
    return bad


def make_optimizer(options: TrainOptions) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with linear warmup and cosine decay, after global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=options.lr,
        warmup_steps=options.warmup,
        decay_steps=max(options.steps, options.warmup + 1),
        end_value=options.lr * 0.1,
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(options.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=options.weight_decay),
    )
    return optimizer, schedule


def tree_bytes(tree, memory_kind: str | None = None) -> int:
    """Global bytes of the arrays of `tree` (only those in `memory_kind`, when given)."""
    return sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if memory_kind is None or memory_kind_of(x) == memory_kind
    )


def tree_bytes_per_device(tree, memory_kind: str | None = None) -> int:
    """Bytes of `tree` held by the most loaded device (shards, not global sizes)."""
    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        if memory_kind is not None and memory_kind_of(x) != memory_kind:
            continue
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


@dataclasses.dataclass
class Trainer:
    """A compiled training setup: model, mesh, optimizer and the jitted step and eval functions.

    State is a dict `{'step': int32[], 'params': pytree, 'opt_state': pytree}` of global arrays;
    parameters are replicated over `data` (and sharded over the tensor axes by their layers).
    Batches are `(batch_size, seq_len + 1)` int32 split over `data`.
    """

    options: TrainOptions
    mesh: Any
    model: gpt.GPT
    model_config: gpt.GPTConfig
    optimizer: optax.GradientTransformation
    schedule: Callable
    batch_sharding: NamedSharding
    train_step: Callable
    eval_loss: Callable

    def init_state(self):
        """Fresh state, created directly in its sharded placement."""
        dummy = jnp.zeros((config_of(self.mesh).depth, self.options.seq_len), jnp.int32)

        def init(key):
            params = self.model.init(key, dummy)["params"]
            return {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": self.optimizer.init(params)}

        # Tensor-parallel parameters (and the optimizer state mirroring them) come boxed with their
        # partition specs; everything else is replicated.
        abstract = jax.eval_shape(init, jax.random.key(self.options.seed))
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec),
                                 nn.get_partition_spec(abstract))
        return jax.jit(lambda key: nn.unbox(init(key)), out_shardings=shardings)(
            jax.random.key(self.options.seed))

    def batch(self, tokens: np.ndarray, step: int, seed_offset: int = 0):
        o = self.options
        return data_lib.global_batch(tokens, o.seed + seed_offset, step, o.batch_size, o.seq_len,
                                     self.batch_sharding)


def check_tensor_parallel(c: gpt.GPTConfig, config: ParallelConfig) -> None:
    """Raise ValueError naming the numbers unless the GPT's dimensions split over the TP grid."""
    check_divisible("d_model", c.d_model, ("col", "depth"), config)
    check_divisible("d_model", c.d_model, ("row", "depth"), config)
    check_divisible("d_ff", c.d_ff, ("row", "depth"), config)
    check_divisible("num_heads", c.num_heads, ("row",), config)
    check_divisible("vocab_size", c.vocab_size, ("row", "depth"), config)
    check_divisible("max_seq_len", c.max_seq_len, ("row", "depth"), config)


def build_trainer(options: TrainOptions, devices=None) -> Trainer:
    """Validate `options` against the devices and build the jitted train and eval steps."""
    config = options.parallel
    mesh = make_mesh(config, devices)
    model_config = gpt.get_config(options.model)
    if options.seq_len > model_config.max_seq_len:
        raise ValueError(f"--seq-len {options.seq_len} exceeds {options.model}'s max_seq_len "
                         f"{model_config.max_seq_len}")
    check_divisible("--batch-size", options.batch_size, ("data", "depth"), config)
    model = gpt.GPT(model_config, dtype=DTYPES[options.dtype])
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(model_config, config)
        model = parallelize(model, mesh)
    optimizer, schedule = make_optimizer(options)
    batch_sharding = NamedSharding(mesh, P(("data", "depth")))

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        return gpt.cross_entropy(logits, batch[:, 1:])

    def local_loss_and_grads(params, batch):
        # Varying over `data`: each shard keeps its own gradients until the explicit reduction.
        params = to_varying(params, ("data",))
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    loss_and_grads = shard_map(local_loss_and_grads, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=(P(), P()), axis_names={"data"})
    if config.data == 1 and config.tensor_parallel_size > 1:
        # Nothing to reduce; and XLA rejects an all-reduce over the size-1 `data` axis of gradients
        # that come out of the tensor-parallel shard_maps.
        loss_and_grads = jax.value_and_grad(loss_fn)

    def step(state, batch):
        loss, grads = loss_and_grads(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    eval_loss = shard_map(lambda p, b: jax.lax.pmean(loss_fn(p, b), "data"), mesh=mesh,
                          in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"})
    return Trainer(options, mesh, model, model_config, optimizer, schedule, batch_sharding,
                   train_step=jax.jit(step, donate_argnums=0), eval_loss=jax.jit(eval_loss))


def sample(trainer: Trainer, params, prompt: str, num_tokens: int, seed: int = 0,
           temperature: float = 0.8) -> str:
    """Continue `prompt` by `num_tokens` sampled bytes (a fixed window of `seq_len` tokens)."""
    o, mesh = trainer.options, trainer.mesh
    rows = config_of(mesh).data * config_of(mesh).depth
    window = o.seq_len
    tokens = np.zeros((rows, window), np.int32)
    prompt_tokens = data_lib.encode(prompt)[-window:]
    tokens[:, : len(prompt_tokens)] = prompt_tokens
    pos = len(prompt_tokens)

    @jax.jit
    def next_token(params, tokens, pos, key):
        logits = trainer.model.apply({"params": params}, tokens)
        logits = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
        return jax.random.categorical(key, logits / temperature, axis=-1)

    out = list(prompt_tokens)
    key = jax.random.key(seed)
    for i in range(num_tokens):
        key, sub = jax.random.split(key)
        if pos == window:  # slide the window
            tokens = np.roll(tokens, -1, axis=1)
            pos -= 1
        nxt = np.asarray(next_token(params, jax.device_put(tokens, trainer.batch_sharding), pos, sub))
        tokens[:, pos] = nxt
        out.append(int(nxt[0]))
        pos += 1
    return data_lib.decode(out)


def state_report(trainer: Trainer, state, compiled) -> dict[str, int]:
    """Train-state bytes per device by memory kind, parameter count and the compiled peak."""
    from ._compat import DEVICE_MEMORY_KIND

    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0) or (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes)
    return {
        "num_params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
        "state_bytes_device": int(tree_bytes_per_device(state, DEVICE_MEMORY_KIND)),
        "state_bytes_host": int(tree_bytes_per_device(state, HOST_MEMORY_KIND)),
        "peak_bytes_compiled": int(peak),
    }


def evaluate(trainer: Trainer, params, tokens: np.ndarray) -> float:
    """Mean loss over `eval_batches` fixed validation batches."""
    losses = [trainer.eval_loss(params, trainer.batch(tokens, i, seed_offset=10_000))
              for i in range(trainer.options.eval_batches)]
    return float(np.mean([float(l) for l in losses]))


def train(options: TrainOptions, devices=None, console=None) -> dict[str, Any]:
    """Run a training job; returns a summary with the loss history and first/last validation loss."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .checkpoint import Checkpointer

    bad = unimplemented_options(options)
    if bad:
        raise NotImplementedError(f"not implemented yet: {', '.join(bad)}")
    is_main = jax.process_index() == 0
    console = console or Console(quiet=not is_main)
    trainer = build_trainer(options, devices)
    corpus = data_lib.Corpus.load(options.data_path, min_tokens=options.seq_len + 2)
    state = trainer.init_state()
    checkpointer = Checkpointer(options.checkpoint_dir, options.checkpoint_every) \
        if options.checkpoint_dir else None
    if options.resume:
        state = checkpointer.restore(state)
        console.print(f"resumed from step {int(state['step'])} in {options.checkpoint_dir}")
    start = int(state["step"])

    compiled = trainer.train_step.lower(state, trainer.batch(corpus.train, start)).compile()
    if options.dump_hlo:
        out = pathlib.Path(options.dump_hlo)
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_step.hlo.txt").write_text(compiled.as_text())
    report = state_report(trainer, state, compiled)
    grid = " ".join(f"{k}={v}" for k, v in options.parallel.as_dict().items())
    console.print(
        f"[bold]{options.model}[/]: {report['num_params']:,} parameters on grid {grid}; train state "
        f"{report['state_bytes_device'] / 2**20:.1f} MiB/device on device, "
        f"{report['state_bytes_host'] / 2**20:.1f} MiB/device on host; compiled peak "
        f"{report['peak_bytes_compiled'] / 2**20:.1f} MiB; corpus {len(corpus.train):,} train / "
        f"{len(corpus.val):,} validation tokens"
    )
    eval_every = options.eval_every or max(1, options.steps // 10)
    metrics_file = open(options.metrics_out, "a" if options.resume else "w") \
        if options.metrics_out and is_main else None
    history, val_history = [], []
    tokens_per_step = options.batch_size * options.seq_len
    val_first = evaluate(trainer, state["params"], corpus.val)
    val_history.append((start, val_first))
    console.print(f"validation loss at step {start}: {val_first:.4f}")
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                        console=console, disable=not is_main)
    try:
        with progress:
            task = progress.add_task("train", total=options.steps, completed=start, info="")
            end = min(options.steps, options.stop_at or options.steps)
            for step in range(start, end):
                batch = trainer.batch(corpus.train, step)
                t0 = time.perf_counter()
                state, metrics = compiled(state, batch)
                metrics = {k: float(v) for k, v in metrics.items()}  # waits for the step
                dt = time.perf_counter() - t0
                record = {"step": step + 1, **metrics, "tokens_per_s": tokens_per_step / dt,
                          "step_time_s": dt, **report}
                if (step + 1) % eval_every == 0 or step + 1 == options.steps:
                    record["val_loss"] = evaluate(trainer, state["params"], corpus.val)
                    val_history.append((step + 1, record["val_loss"]))
                    if not console.is_terminal:
                        console.print(f"step {step + 1}: loss {metrics['loss']:.4f} "
                                      f"val_loss {record['val_loss']:.4f} "
                                      f"{record['tokens_per_s']:,.0f} tok/s")
                history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if checkpointer:
                    checkpointer.maybe_save(step + 1, state)
                progress.update(task, advance=1, info=f"loss {metrics['loss']:.3f} "
                                f"{record['tokens_per_s']:,.0f} tok/s {dt * 1e3:.0f} ms/step")
    finally:
        if metrics_file:
            metrics_file.close()
        if checkpointer:
            checkpointer.maybe_save(int(state["step"]), state, force=checkpointer.every > 0)
            checkpointer.close()
    summary = {"history": history, "val_history": val_history, "state": state, "trainer": trainer,
               **report}
    if val_history:
        console.print(f"validation loss: first {val_history[0][1]:.4f} -> last {val_history[-1][1]:.4f}")
    if options.sample_tokens:
        text = sample(trainer, state["params"], "def ", options.sample_tokens, seed=options.seed)
        console.print("[bold]sample:[/]")
        console.print(text, markup=False, highlight=False)
        summary["sample"] = text
    return summary
