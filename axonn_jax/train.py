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
from ._compat import HOST_MEMORY_KIND, ensure_varying, memory_kind_of, pmean, shard_map, to_varying
from .config import ParallelConfig, check_divisible
from .mesh import config_of, make_mesh
from .models import gpt
from .offload import activations
from .offload import optimizer as offload_opt
from .offload import precision
from .parallel import pipeline as pipeline_lib
from .parallel import compression
from .transform import parallelize

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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


def make_optimizer(options: TrainOptions) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with linear warmup and cosine decay, after global-norm gradient clipping."""
    adamw, schedule = make_adamw(options)
    return optax.chain(optax.clip_by_global_norm(options.clip_norm), adamw), schedule


def make_adamw(options: TrainOptions) -> tuple[optax.GradientTransformation, Callable]:
    """The elementwise part of the optimizer (AdamW and its schedule), without clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=options.lr,
        warmup_steps=options.warmup,
        decay_steps=max(options.steps, options.warmup + 1),
        end_value=options.lr * 0.1,
    )
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=options.weight_decay), schedule


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
    Mixed precision adds `'precision'` (loss scale, skipped steps); with `offloaded`, `params` are
    the device copy in the compute dtype and `opt_state` holds the fp32 masters and moments in
    `pinned_host` (see `offload.optimizer`).
    With `--compress-bits` and error feedback it also holds `'compression'`: the residuals, each
    leaf `[data, *param.shape]` split over `data` and then like its parameter (one residual per
    device: each compresses only its own shard of the gradients).
    Batches are `(batch_size, seq_len + 1)` int32 split over `data` and `depth`.
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
    param_spec: Callable[[tuple], P] = lambda path: P()  # state key path -> PartitionSpec
    # The two halves of `train_step`, unjitted, for steps that exchange gradients between them
    # (parallel/mpi.py): (params, batch, loss scale, step, compression residual) -> (loss, grads,
    # residual) and (state, loss, grads, residual=None) -> (state, metrics).
    loss_and_grads: Callable | None = None
    apply_grads: Callable | None = None
    offloaded: offload_opt.HostOffloadedOptimizer | None = None
    activation_plan: activations.Plan | None = None

    def init_state(self, abstract: bool = False):
        """Fresh state, created directly in its sharded placement (`abstract`: ShapeDtypeStructs
        with those shardings, nothing allocated)."""
        dummy = jnp.zeros((config_of(self.mesh).depth, self.options.seq_len), jnp.int32)

        def init(key):
            params = nn.unbox(self.model.init(key, dummy)["params"])
            state = offload_opt.initial_state(params, optimizer=self.optimizer,
                                              offloaded=self.offloaded, dtype=self.options.dtype)
            if _uses_error_feedback(self.options):
                state["compression"] = compression.init_residual(params, self.options.parallel.data)
            return state

        shapes = jax.eval_shape(init, jax.random.key(self.options.seed))
        # Tensor-parallel layers create their parameters boxed with partition specs; every state
        # leaf that mirrors a parameter (optimizer moments, host masters) is placed like it.
        boxed = jax.eval_shape(lambda k: self.model.init(k, dummy)["params"],
                               jax.random.key(self.options.seed))
        by_param = _specs_by_path(nn.get_partition_spec(boxed))

        def spec(path):
            if path[0].key == "compression":  # error-feedback residuals: one per device
                return P("data", *param_spec(path))
            return param_spec(path)

        def param_spec(path):
            names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
            stage = self.param_spec(path)  # P('pipe') for the stacked blocks with pipe > 1
            for start in range(1, len(names)):
                if names[start:] in by_param:
                    tp = by_param[names[start:]]
                    return P(*stage, *tp[len(stage):]) if stage else tp
            return stage

        shardings = jax.tree_util.tree_map_with_path(
            lambda path, _: NamedSharding(self.mesh, spec(path)), shapes)
        if self.offloaded:  # master weights and moments in pinned_host, sharded like their params
            shardings["opt_state"] = self.offloaded.state_shardings(shapes["opt_state"],
                                                                    shardings["params"])
        init = jax.jit(init, out_shardings=shardings)
        key = jax.random.key(self.options.seed)
        return init.eval_shape(key) if abstract else init(key)

    def batch(self, tokens: np.ndarray, step: int, seed_offset: int = 0):
        o = self.options
        return data_lib.global_batch(tokens, o.seed + seed_offset, step, o.batch_size, o.seq_len,
                                     self.batch_sharding)


def _uses_error_feedback(options: TrainOptions) -> bool:
    return options.compress_bits > 0 and options.error_feedback


def unsupported_combination(config: ParallelConfig, options: TrainOptions) -> str | None:
    """The combination of modes on `config` that the trainer does not run yet, spelled as flags, or
    None when it runs."""
    if config.pipe > 1:
        # Every stage runs the same program, so a per-layer activation plan must be uniform.
        if options.remat == "auto":
            return "--remat auto with --pipe > 1"
    return None


def check_tensor_parallel(c: gpt.GPTConfig, config: ParallelConfig) -> None:
    """Raise ValueError naming the numbers unless the GPT's dimensions split over the TP grid."""
    check_divisible("d_model", c.d_model, ("col", "depth"), config)
    check_divisible("d_model", c.d_model, ("row", "depth"), config)
    check_divisible("d_ff", c.d_ff, ("row", "depth"), config)
    check_divisible("num_heads", c.num_heads, ("row",), config)
    check_divisible("vocab_size", c.vocab_size, ("row", "depth"), config)
    check_divisible("max_seq_len", c.max_seq_len, ("row", "depth"), config)


def _specs_by_path(specs) -> dict[tuple[str, ...], P]:
    """`{('blocks', 'query', 'kernel'): PartitionSpec, ...}` from a tree of PartitionSpecs."""
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    return {tuple(k.key for k in path): spec for path, spec in flat}


def build_trainer(options: TrainOptions, devices=None) -> Trainer:
    """Validate `options` against the devices and build the jitted train and eval steps."""
    config = options.parallel
    mesh = make_mesh(config, devices)
    model_config = gpt.get_config(options.model)
    if options.seq_len > model_config.max_seq_len:
        raise ValueError(f"--seq-len {options.seq_len} exceeds {options.model}'s max_seq_len "
                         f"{model_config.max_seq_len}")
    check_divisible("--batch-size", options.batch_size, ("data", "depth"), config)
    if reason := unsupported_combination(config, options):
        raise NotImplementedError(f"{reason} is not implemented yet")
    if options.microbatches < 1:
        raise ValueError(f"--microbatches must be positive, got {options.microbatches}")
    if options.microbatches > 1 and config.pipe == 1:
        raise ValueError(f"--microbatches {options.microbatches} needs --pipe > 1")
    if config.pipe > 1:
        pipeline_lib.check_layers(model_config.num_layers, config.pipe)
        if options.batch_size % (config.data * options.microbatches):
            raise ValueError(f"--batch-size = {options.batch_size} is not divisible by data × "
                             f"microbatches = {config.data} × {options.microbatches}")
    activation_plan = activations.make_plan(options, model_config, devices, build_trainer)
    model = gpt.GPT(model_config, dtype=DTYPES[options.dtype],
                    layer_groups=activation_plan.layer_groups() if activation_plan else None)
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(model_config, config)
        model = parallelize(model, mesh)
    optimizer, schedule = make_optimizer(options)
    offloaded = offload_opt.HostOffloadedOptimizer(
        make_adamw(options)[0], options.clip_norm, DTYPES[options.dtype], model_config.num_layers,
        num_stages=config.pipe, guard=precision.uses_guard(options.dtype)) \
        if options.offload_optimizer else None
    batch_sharding = NamedSharding(mesh, P(("data", "depth")))
    if options.compress_bits:
        compression.check_args(options.compress_bits, options.compress_bucket)
        # How the tensor axes split each gradient: every device compresses its own shard.
        dummy = jnp.zeros((config.depth, options.seq_len), jnp.int32)
        grad_specs = nn.get_partition_spec(jax.eval_shape(
            lambda k: model.init(k, dummy)["params"], jax.random.key(options.seed)))

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        return gpt.cross_entropy(logits, batch[:, 1:])

    def reduce_gradients(grads, step, residual):
        """Mean of the data shards' gradients: exact, or CGX-compressed (`--compress-bits`), each
        device compressing its own tensor-/pipeline-parallel shard (the `depth` sum stays exact)."""
        if not options.compress_bits:
            return pmean(grads, "data"), residual
        # With error feedback the residual carries nearest rounding's bias into the next step
        # (measured better than stochastic + feedback at 2 bits); without it, stochastic rounding
        # keeps the mean unbiased, its noise a pure function of (seed, step).
        key = None if options.error_feedback else \
            jax.random.fold_in(jax.random.key(options.seed), step)
        local = None if residual is None else jax.tree.map(lambda r: r[0], residual)
        grads, local = compression.sharded_compressed_pmean(
            grads, grad_specs, mesh, "data", bits=options.compress_bits,
            bucket_size=options.compress_bucket, key=key, residual=local)
        return grads, None if local is None else jax.tree.map(lambda r: r[None], local)

    def local_loss_and_grads(params, batch, scale, step, residual):
        # Varying over `data`: each shard keeps its own gradients until the explicit reduction.
        params = to_varying(params, ("data",))
        # `scale`: the fp16 loss scale (1 otherwise); gradients stay scaled until the update.
        loss, grads = jax.value_and_grad(lambda p, b: loss_fn(p, b) * scale)(params, batch)
        grads, residual = reduce_gradients(grads, step, residual)
        return jax.lax.pmean(loss, "data") / scale, grads, residual

    def unreduced_loss_and_grads(params, batch, scale, step, residual):
        loss, grads = jax.value_and_grad(lambda p, b: loss_fn(p, b) * scale)(params, batch)
        return loss / scale, grads, residual

    param_spec = lambda path: P()  # noqa: E731
    if config.pipe > 1:
        loss_and_grads, param_spec = pipelined_loss_and_grads(model, options, mesh,
                                                              reduce_gradients)
    elif config.data == 1 and config.tensor_parallel_size > 1:
        # Nothing to reduce; and XLA rejects an all-reduce over the size-1 `data` axis of gradients
        # that come out of the tensor-parallel shard_maps.
        loss_and_grads = unreduced_loss_and_grads
    else:
        loss_and_grads = shard_map(local_loss_and_grads, mesh=mesh,
                                   in_specs=(P(), P("data"), P(), P(), P("data")),
                                   out_specs=(P(), P(), P("data")), axis_names={"data"})

    def apply_grads(state, loss, grads, residual=None):
        new_state, metrics = offload_opt.apply_gradients(state, grads, optimizer=optimizer,
                                                         offloaded=offloaded, dtype=options.dtype)
        if residual is not None:
            new_state["compression"] = residual
        return new_state, {"loss": loss, **metrics, "lr": schedule(state["step"])}

    def step(state, batch):
        return apply_grads(state, *loss_and_grads(state["params"], batch, precision.scale_of(state),
                                                  state["step"], state.get("compression")))

    eval_loss = shard_map(lambda p, b: jax.lax.pmean(loss_fn(p, b), "data"), mesh=mesh,
                          in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"})
    return Trainer(options, mesh, model, model_config, optimizer, schedule, batch_sharding,
                   train_step=jax.jit(step, donate_argnums=0), eval_loss=jax.jit(eval_loss),
                   param_spec=param_spec, loss_and_grads=loss_and_grads,
                   apply_grads=apply_grads, offloaded=offloaded, activation_plan=activation_plan)


EMBED_PARAMS, STACK_PARAMS, HEAD_PARAMS = ("wte", "wpe"), "blocks", ("ln_f", "head")


def gpt_stage_functions(model: gpt.GPT, num_stages: int):
    """The GPT cut for the pipeline engine: `embed_fn(embed_params, tokens) -> x`,
    `stage_fn(block_params, x) -> x` for one stage's `num_layers/num_stages` blocks, and
    `head_fn(head_params, x, targets) -> mean cross-entropy`. Parameter dicts use the GPT's own keys
    (EMBED_PARAMS, the STACK_PARAMS subtree sliced to the stage, HEAD_PARAMS)."""
    layers = pipeline_lib.check_layers(model.config.num_layers, num_stages)
    groups = None
    if model.layer_groups:  # a uniform --remat plan: the same decision for the stage's layers
        if len(model.layer_groups) != 1:
            raise ValueError("pipeline stages need one activation decision for all layers")
        groups = ((layers, model.layer_groups[0][1]),)
    stage_model = gpt.GPT(dataclasses.replace(model.config, num_layers=layers), dtype=model.dtype,
                          block_wrapper=model.block_wrapper, layer_groups=groups)
    if hasattr(model, "axonn_mesh"):  # tensor-parallel stages
        stage_model = parallelize(stage_model, model.axonn_mesh)

    def embed_fn(p, tokens):
        return model.apply({"params": p}, tokens, method=gpt.GPT.embed)

    def stage_fn(p, x):
        return stage_model.apply({"params": {STACK_PARAMS: p}}, x, method=gpt.GPT.run_blocks)

    def head_fn(p, x, targets):
        return gpt.cross_entropy(model.apply({"params": p}, x, method=gpt.GPT.logits), targets)

    return embed_fn, stage_fn, head_fn


def pipelined_loss_and_grads(model: gpt.GPT, options: TrainOptions, mesh, reduce_gradients=None):
    """`(params, batch, scale, step, residual) -> (loss, grads, residual)` through the pipeline
    engine, and the state layout.

    The step is manual over `data` and `pipe`: block parameters (and their optimizer moments) are
    split over `pipe` on their leading layer axis, everything else is replicated; the batch is split
    over `data` and replicated over `pipe`. Embedding and head run on the first and last stage.
    `reduce_gradients(grads, step, residual) -> (grads, residual)` averages the gradients over
    `data` inside the step (default: exact `pmean`); `residual` (error feedback) is split over
    `data` and like the parameters over `pipe`.
    """
    config = config_of(mesh)
    sched = pipeline_lib.make_schedule(options.schedule, config.pipe, options.microbatches)
    embed_fn, stage_fn, head_fn = gpt_stage_functions(model, config.pipe)

    def local_loss_and_grads(params, batch, scale, step, residual):
        params = ensure_varying(params, ("data", "pipe"))
        split = ({k: params[k] for k in EMBED_PARAMS}, params[STACK_PARAMS],
                 {k: params[k] for k in HEAD_PARAMS})
        # `scale`: the fp16 loss scale (1 otherwise); gradients stay scaled until the update.
        scaled_head = lambda p, x, t: head_fn(p, x, t) * scale  # noqa: E731
        loss, (g_embed, g_stack, g_head) = pipeline_lib.pipeline_loss_and_grads(
            embed_fn, stage_fn, scaled_head, split, batch[:, :-1], batch[:, 1:], sched)
        grads = {**g_embed, STACK_PARAMS: g_stack, **g_head}
        if reduce_gradients is None:
            grads = pmean(grads, "data")
        else:
            grads, residual = reduce_gradients(grads, step, residual)
        return jax.lax.pmean(loss, "data") / scale, grads, residual

    specs = {k: P() for k in EMBED_PARAMS + HEAD_PARAMS} | {STACK_PARAMS: P("pipe")}
    res_specs = {k: P("data") for k in EMBED_PARAMS + HEAD_PARAMS} | \
        {STACK_PARAMS: P("data", "pipe")}

    def fn(params, batch, scale, step, residual):
        r_specs = P("data") if residual is None else res_specs  # None: no leaves to match
        return shard_map(local_loss_and_grads, mesh=mesh,
                         in_specs=(specs, P("data"), P(), P(), r_specs),
                         out_specs=(P(), specs, r_specs), axis_names={"data", "pipe"})(
            params, batch, scale, step, residual)

    def param_spec(path) -> P:
        keys = [getattr(k, "key", None) for k in path]
        return P("pipe") if STACK_PARAMS in keys else P()

    return fn, param_spec


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


def compiled_peak_bytes(compiled) -> int:
    """Peak bytes per device of a compiled program, from its memory analysis.

    The CPU backend's `peak_memory_in_bytes` leaves out the temporaries (it can be smaller than the
    temp allocation); there the live-bytes bound arguments + outputs - aliased + temporaries is used.
    """
    mem = compiled.memory_analysis()
    peak = getattr(mem, "peak_memory_in_bytes", 0)
    if peak < mem.temp_size_in_bytes or not peak:
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
    return int(peak)


def state_report(trainer: Trainer, state, compiled) -> dict[str, int]:
    """Train-state bytes per device by memory kind, parameter count and the compiled peak."""
    from ._compat import DEVICE_MEMORY_KIND

    peak = compiled_peak_bytes(compiled)
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

    if options.transport == "mpi":
        from .parallel.mpi import build_mpi_trainer

        trainer = build_mpi_trainer(options, devices)
        is_main = trainer.rank == 0
    else:
        trainer = build_trainer(options, devices)
        is_main = jax.process_index() == 0
    console = console or Console(quiet=not is_main)
    corpus = data_lib.Corpus.load(options.data_path, min_tokens=options.seq_len + 2)
    state = trainer.init_state()
    make_checkpointer = Checkpointer
    if options.transport == "mpi":
        from .parallel.mpi import RankZeroCheckpointer

        # The MPI pipeline brings its own (one checkpoint per stage).
        make_checkpointer = getattr(trainer, "checkpointer", RankZeroCheckpointer)
    checkpointer = make_checkpointer(options.checkpoint_dir, options.checkpoint_every) \
        if options.checkpoint_dir else None
    if options.resume:
        state = checkpointer.restore(state)
        console.print(f"resumed from step {int(state['step'])} in {options.checkpoint_dir}")
    start = int(state["step"])

    compiled = trainer.train_step.lower(state, trainer.batch(corpus.train, start)).compile()
    if options.dump_hlo and is_main:
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
    if trainer.activation_plan is not None:
        console.print(trainer.activation_plan.describe(report["peak_bytes_compiled"]))
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
