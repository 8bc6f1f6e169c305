"""The training loop: `train(config, model=None, data=None)`.

The loop compiles the step, restores a checkpoint if asked, and runs the steps; everything else
(validation, the metrics file, checkpoints, the progress bar, the HLO dump, sampling) is a hook
(`run.hooks`) that `train` adds from the config.
"""
from __future__ import annotations

import math
import pathlib
import shutil
import time
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ..analysis.flops import compiled_flops, model_flops_per_device, nominal_peak_flops
from .._compat import DEVICE_MEMORY_KIND, HOST_MEMORY_KIND, memory_kind_of
from ..offload.precision import DTYPES
from ..offload.activations import compiled_peak_bytes
from ..parallel.compression import parse_rules
from ..step.reducers import compressed_wire_bytes, exact_wire_bytes
from ..step.model import StackedModel
from . import data as data_lib
from . import rundir
from .feeds import StepFeed, document_feeds
from .hooks import (Checkpoints, DeviceMemory, ExportPretrained, HloDump, Hook, MetricsFile, Profile,
                    Progress, Sample, SaveWhenStopped, StepInfo, TensorBoard, Validation,
                    parse_step_range)
from . import options
from .options import RunConfig
from .stopping import Diverged, StopRequest, process_agreement
from .trainer import Trainer, build_trainer, lm_example


def tree_bytes_per_device(tree, memory_kind: str | None = None) -> int:
    """Bytes of `tree` held by the most loaded device (shards, not global sizes).

    Args:
      tree: a pytree of jax.Arrays.
      memory_kind: count only the arrays of this memory kind (None: all).

    Returns:
      The bytes of this process's most loaded device (0 for none).
    """
    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        if memory_kind is not None and memory_kind_of(x) != memory_kind:
            continue
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def state_report(state, compiled) -> dict[str, int | float]:
    """The run's constants: the state's size and the compiled step's peak and FLOPs.

    Args:
      state: the train state.
      compiled: the compiled train step.

    Returns:
      `num_params`, train-state bytes per device by memory kind (`state_bytes_device`,
      `state_bytes_host`), the compiled peak (`peak_bytes_compiled`) and the compiled step's
      FLOPs per device (`flops_per_device_compiled`, XLA's cost analysis).
    """
    return {
        "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "state_bytes_device": int(tree_bytes_per_device(state, DEVICE_MEMORY_KIND)),
        "state_bytes_host": int(tree_bytes_per_device(state, HOST_MEMORY_KIND)),
        "peak_bytes_compiled": int(compiled_peak_bytes(compiled)),
        "flops_per_device_compiled": compiled_flops(compiled),
    }


def compression_ratio(params, bits: int, bucket_size: int, min_size: int = 1024,
                      rules=()) -> float:
    """How many times fewer bytes this device sends in CGX's exchange than in an exact all-reduce.

    The gradients are like `params` (this device's local shards), counted as the reducers count
    their wire bytes (`step.reducers`), with the tensors that the size rule (`min_size`) and the
    `PATTERN=BITS` rules keep exact or set apart.

    Args:
      params: the parameters (global jax.Arrays; their shard shapes count).
      bits: the compressed bits per value.
      bucket_size: values per quantization bucket.
      min_size: tensors smaller than this stay exact.
      rules: `PATTERN=BITS` rules (`parallel.compression.parse_rules`).

    Returns:
      The ratio of exact to compressed wire bytes.
    """
    shards = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), params)
    wire = compressed_wire_bytes(bits, bucket_size, min_size, parse_rules(rules))
    return exact_wire_bytes(shards) / wire(shards)


class Loop:
    """Runs `trainer`'s step from `state` over the batches of `feed` until `end_step`.

    Each step's record holds the feed's metrics (`data_wait_s`: the seconds the step waited for
    its batch, ...). A step whose loss or gradient norm is not finite raises `Diverged` before
    its state is kept; under float16 such steps are skipped by the step itself. The step is
    compiled when the loop is made.

    Args:
      trainer: the run's `Trainer`.
      state: the train state to start from (its `step` is the starting step).
      feed: the batches (`run.feeds`).
      hooks: called around the steps (see `run.hooks`).
      console: a `rich` console the hooks print to.
      end_step: the step to stop after.
      stop: asked at every step boundary whether the job stops there (`run.stopping`); then
        `stopped` names the signal.
    """

    def __init__(self, trainer: Trainer, state, feed, hooks: list[Hook],
                 console, end_step: int, stop: StopRequest | None = None):
        self.trainer, self.state, self.feed, self.hooks = trainer, state, feed, hooks
        self.console, self.end_step, self.stop = console, end_step, stop
        self.is_main = trainer.is_main
        self.start_step = int(state.step)
        self.history: list[dict] = []
        self.completed = False
        self.stopped: str | None = None
        self.compiled = trainer.step.lower(state, feed.example(self.start_step)).compile()
        self.report = state_report(state, self.compiled)
        rows = jax.tree.leaves(trainer.example_batch)[0].shape[0]
        self.examples_per_step = rows
        self.tokens_per_step = rows * trainer.options.data.seq_len \
            if trainer.preset and trainer.preset.data == "tokens" else None
        self.peak_flops = None
        o = trainer.options
        if self.tokens_per_step and o.run.transport == "xla":  # a built-in model on one mesh
            self.report["model_flops_per_device"] = model_flops_per_device(
                trainer.preset.config, self.tokens_per_step, o.data.seq_len,
                o.parallel.num_devices)
            self.peak_flops = nominal_peak_flops(jax.devices()[0], DTYPES[o.precision.dtype])

    def run(self):
        """Run the steps, calling the hooks; their `end` runs also when a step raises.

        Returns:
          The last state kept.

        Raises:
          Diverged: a step's loss or gradient norm is not finite (not under float16).
        """
        started = []
        try:
            for hook in self.hooks:
                hook.start(self)
                started.append(hook)
            for step in range(self.start_step, self.end_step):
                if self.stop is not None and (signal_name := self.stop.agreed()):
                    self.stopped = signal_name
                    break
                state, record = self._step(step)
                # An infinite gradient norm with a finite loss has already spoilt the update.
                bad = [k for k in ("loss", "grad_norm") if not math.isfinite(record.get(k, 0.0))]
                if bad and self.trainer.options.precision.dtype != "float16":
                    raise Diverged(f"the {bad[0]} of step {step + 1} is {record[bad[0]]}: the run "
                                   f"diverged (a lower --lr?); stopped without keeping that step")
                self.state = state
                info = StepInfo(step + 1, self.state, record)
                for hook in self.hooks:
                    hook.step(info)
                self.history.append(record)
            self.completed = self.stopped is None
        finally:
            for hook in reversed(started):  # unwound like nested contexts
                hook.end(self)
        return self.state

    def _step(self, step: int):
        batch = self.feed.batch(step)
        t0 = time.perf_counter()
        state, metrics = self.compiled(self.state, batch)
        metrics = {k: _plain(v) for k, v in metrics.items()}  # waits for the step
        dt = time.perf_counter() - t0
        record = {"step": step + 1, **metrics, "lr": float(self.trainer.lr_schedule(step)),
                  "examples_per_s": self.examples_per_step / dt, "step_time_s": dt,
                  **self.feed.stats(), **self.report}
        if self.tokens_per_step:
            record["tokens_per_s"] = self.tokens_per_step / dt
        if self.peak_flops:
            record["mfu"] = self.report["model_flops_per_device"] / dt / self.peak_flops
        return state, record


def _plain(value):
    """A metric as JSON holds it: a float, or per layer a (nested) list of floats."""
    value = np.asarray(value)
    return float(value) if value.ndim == 0 else value.astype(float).tolist()


def _as_batches(data) -> Callable[[int], Any]:
    """`step -> batch` from a callable (returned as it is) or an iterable of batches (read in
    order; a resumed run skips the batches of the steps already done)."""
    if callable(data):
        return data
    if not isinstance(data, Iterable):
        raise TypeError(f"train: data must be a function step -> batch or an iterable of batches, "
                        f"got {type(data).__name__}")
    iterator, position = iter(data), [0]

    def batch(step: int):
        if step < position[0]:
            raise ValueError(f"train: an iterable of batches is read once, in order; step {step} "
                             f"was asked after step {position[0] - 1}")
        for _ in range(step - position[0]):
            next(iterator)
        position[0] = step + 1
        return next(iterator)

    return batch


def _evaluator(trainer: Trainer, feed, num_batches: int):
    """`params -> mean loss` over the first `num_batches` batches of the validation `feed`."""
    return lambda params: float(np.mean([float(trainer.step.eval_loss(params, b))
                                         for b in feed.first(num_batches)]))


def _tokenizer(config: RunConfig):
    """The `tokenizer.json` of the `--init-from` directory, or None (byte-level tokens)."""
    if not config.model.init_from:
        return None
    path = pathlib.Path(config.model.init_from) / "tokenizer.json"
    return path if path.is_file() else None


def _language_model_data(config: RunConfig, vocab_size: int):
    d, seed = config.data, config.run.seed
    corpus = data_lib.Corpus.load(d.path, min_tokens=d.seq_len + 2,
                                  tokenizer=_tokenizer(config), vocab_size=vocab_size)
    make = lambda tokens, seed: data_lib.TokenBatches(tokens, seed, d.batch_size,  # noqa: E731
                                                      d.seq_len)
    return make(corpus.train, seed), make(corpus.val, seed + 10_000), corpus


def train(config: RunConfig, model: StackedModel | None = None, data=None, *, eval_data=None,
          devices=None, console=None, hooks: list[Hook] = ()) -> dict[str, Any]:
    """Run a training job and return its summary.

    Called from the main thread, the run catches SIGTERM, SIGUSR1 and Ctrl-C while it runs: it
    stops at the next step boundary and saves a checkpoint (`run.stopping`).

    Args:
      config: the run's config tree (`run.options`; `TrainOptions(**flat names)` builds one).
      model: None trains the model the config names on the corpus `data.path` (default: the
        Python standard library's sources) or on the documents of `data.sources` (packed, read
        per process, their position saved with the checkpoints: `run.feeds`); or any
        `StackedModel`, with those documents or with `data`.
      data (Callable | Iterable | None): for a caller's model, a function `step -> batch` or an
        iterable of batches (global batches: numpy pytrees with a leading batch axis of
        `data.batch_size`).
      eval_data (Callable | Iterable | None): validation batches, like `data` (validation
        needs it).
      devices (Sequence[jax.Device] | None): the devices to run on (None: all; see
        `build_trainer`).
      console (rich.console.Console | None): a console to print to (None: one, quiet on
        processes other than the main).
      hooks: more hooks, run after the built-in ones. With `run.run_dir` the metrics, HLO dump,
        checkpoints (when asked), TensorBoard events and `profile_steps` trace go there
        (`run.rundir`).

    Returns:
      A dict: `history` (one record per step), `val_history`, the final `state`, the `trainer`,
      the state report, `stopped` (the name of the signal that stopped the run early, or None)
      and, when sampled, `sample`.

    Raises:
      run.stopping.Diverged: a non-finite loss.
      ValueError: `data` with document sources, `data` without a model, or a caller's model
        without data; a config that cannot run (`run.options.ConfigError`).
    """
    with StopRequest() as stop:
        return _train(stop, config, model, data, eval_data, devices, console, hooks)


def _train(stop: StopRequest, config: RunConfig, model, data, eval_data, devices, console,
           hooks) -> dict[str, Any]:
    config = rundir.with_run_dir(config)
    outputs = _run_dir_hooks(config)  # checked before the work starts
    r, c = config.run, config.checkpoint
    options.check(config, builtin_model=model is None)  # what needs no grid, before any work
    if data is not None and config.data.sources:
        raise ValueError("train: data and document sources (data.sources) both given; pass one")
    corpus = vocab_size = None
    documents = bool(config.data.sources)
    if model is None:
        if data is not None:
            raise ValueError("train: data without a model; the built-in models read data.path")
        preset = options.preset_of(config)
        if preset.data == "images":
            data, eval_data = (preset.config.batches(r.seed + offset, config.data.batch_size)
                               for offset in (0, 10_000))
        else:
            vocab_size = preset.config.vocab_size
            if not documents:
                data, eval_data, corpus = _language_model_data(config, vocab_size)
    elif data is None and not documents:
        raise ValueError("train: a caller's model needs data (a function step -> batch or an "
                         "iterable of batches) or document sources (data.sources)")
    batches = None if documents else _as_batches(data)
    example = None if model is None else lm_example(config) if documents else jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batches(0))
    trainer = build_trainer(config, devices, model=model, example_batch=example)
    config = trainer.options  # its grid resolved
    if documents:
        sharding = trainer.step.batch_shardings(trainer.example_batch)["inputs"]
        feed, eval_feed = document_feeds(config, sharding, _tokenizer(config), vocab_size)
    else:
        feed = StepFeed(batches, trainer.place, "" if corpus is None else
                        f"corpus {len(corpus.train):,} train / {len(corpus.val):,} validation tokens")
        eval_feed = None if eval_data is None else StepFeed(_as_batches(eval_data), trainer.place)
    try:
        return _run(stop, config, trainer, feed, eval_feed, console, hooks, outputs)
    finally:
        feed.close()


def _run(stop: StopRequest, config: RunConfig, trainer: Trainer, feed, eval_feed, console,
         hooks, outputs) -> dict[str, Any]:
    """Restore, build the hooks and run the loop of `train` (see there)."""
    from rich.console import Console

    r, c = config.run, config.checkpoint
    console = console or Console(quiet=not trainer.is_main)
    stop.agree = process_agreement(r.transport)
    state = trainer.init_state()
    checkpointer = trainer.make_checkpointer(
        c.dir, c.every, keep=c.keep, keep_every=c.keep_every, info={"seed": r.seed},
        note=console.print, data=feed) if c.dir else None
    resume = c.resume
    if resume == "auto":
        resume = checkpointer.latest_step() is not None
        if not resume:
            console.print(f"--resume auto: no checkpoint in {c.dir}; starting from step 0")
    if resume:
        state = checkpointer.restore(state)
        console.print(f"resumed from step {int(state.step)} in {c.dir}")
    end = min(r.steps, c.stop_at or r.steps)
    if int(state.step) >= end:
        checkpointer.close()
        last = f"--steps {r.steps}" if end == r.steps else f"--stop-at {end}"
        console.print(f"nothing to do: the checkpoint is at step {int(state.step)} and the run "
                      f"ends at step {end} ({last}); the run is already complete")
        return {"history": [], "val_history": [], "state": state, "trainer": trainer,
                "stopped": None}
    built, validation, sample = _hooks(config, trainer, eval_feed, feed, resume, checkpointer,
                                       outputs, console)
    loop = Loop(trainer, state, feed, built + list(hooks), console, end, stop)
    if config.compression.bits:
        c = config.compression
        loop.report["compression_ratio"] = compression_ratio(
            state.params, c.bits, c.bucket, c.min_size, c.rules)
    _describe(loop, trainer, feed.describe(), console)
    state = loop.run()
    if loop.stopped:
        # A barrier: every process has saved before any exits (mpirun stops a whole job as soon
        # as one of its processes exits with an error code).
        stop.agree(0)
        where = c.dir or (r.run_dir and pathlib.Path(r.run_dir) / rundir.CHECKPOINTS)
        console.print(f"{loop.stopped}: stopped after step {int(state.step)}; " + (
            f"checkpoint saved in {where}" if where else "nothing saved (no checkpoint directory)"))
    summary = {"history": loop.history, "val_history": validation.history if validation else [],
               "state": state, "trainer": trainer, "stopped": loop.stopped, **loop.report}
    if sample is not None:
        summary["sample"] = sample.text
    return summary


def _hooks(config: RunConfig, trainer: Trainer, eval_feed, feed, resume: bool, checkpointer,
           outputs: list[Hook], console):
    """The loop's built-in hooks for the config (with the run directory's `outputs` after the
    metrics file), its validation hook and its sampling hook (None when not asked for)."""
    r, c, d = config.run, config.checkpoint, config.data
    validation = sample = None
    built: list[Hook] = []
    if r.dump_hlo:
        built.append(HloDump(r.dump_hlo))
    if eval_feed is not None:
        every = d.eval_every or max(1, r.steps // 10)
        validation = Validation(_evaluator(trainer, eval_feed, d.eval_batches), every, r.steps)
        built.append(validation)
    built.append(DeviceMemory())
    if r.metrics_out:
        built.append(MetricsFile(r.metrics_out, append=resume))
    built += outputs
    if checkpointer:
        built.append(Checkpoints(checkpointer))
    elif r.run_dir:  # a signal still saves the run
        built.append(SaveWhenStopped(lambda: trainer.make_checkpointer(
            pathlib.Path(r.run_dir) / rundir.CHECKPOINTS, 0, data=feed)))
    elif c.stop_at:
        console.print(f"warning: --stop-at {c.stop_at} without --checkpoint-dir: the "
                      "progress is not saved")
    built.append(Progress())
    if config.model.sample_tokens and trainer.preset:
        sample = Sample(_sampler(trainer))
        built.append(sample)
    if config.model.export_to:
        if not trainer.preset:
            raise ValueError("train: export_to needs a built-in or --init-from model")
        built.append(ExportPretrained(lambda state: _export(trainer, state)))
    return built, validation, sample


def _run_dir_hooks(config: RunConfig) -> list[Hook]:
    """The TensorBoard writer and the `--profile-steps` trace, in the run directory."""
    r = config.run
    steps = parse_step_range(r.profile_steps) if r.profile_steps else None
    if not r.run_dir:
        if steps:
            raise ValueError("--profile-steps writes into the run directory: set run_dir")
        return []
    root = pathlib.Path(r.run_dir)
    return [TensorBoard(root / rundir.TENSORBOARD)] + \
        ([Profile(root / rundir.PROFILE, *steps)] if steps else [])


def _describe(loop: Loop, trainer: Trainer, data: str, console) -> None:
    o, r = trainer.options, loop.report
    grid = " ".join(f"{k}={v}" for k, v in o.parallel.as_dict().items())
    name = trainer.preset.name if trainer.preset else type(trainer.model.block).__name__ + " stack"
    data = f"; {data}" if data else ""
    console.print(
        f"[bold]{name}[/]: {r['num_params']:,} parameters on grid {grid}; train state "
        f"{r['state_bytes_device'] / 2**20:.1f} MiB/device on device, "
        f"{r['state_bytes_host'] / 2**20:.1f} MiB/device on host; compiled peak "
        f"{r['peak_bytes_compiled'] / 2**20:.1f} MiB{data}")
    plan = trainer.step.bind(trainer.local_example()).plan
    if o.memory.remat == "auto" and plan is not None:
        console.print(plan.describe(r["peak_bytes_compiled"]))


def _sampler(trainer: Trainer) -> Callable[[Any], str]:
    """`params -> text`: a continuation of "def " (tokenized like the training data)."""
    from ..models.sampling import generate

    o, preset = trainer.options, trainer.preset
    tokenizer = _tokenizer(o)
    if tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        encode, decode = (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    else:
        encode, decode = data_lib.encode, data_lib.decode
    network = preset.network(jnp.float32, o.parallel)
    d = o.data

    def sample(params) -> str:
        tokens = generate(network, trainer.step.canonical_params(params), encode("def "),
                          o.model.sample_tokens, window=d.seq_len, key=jax.random.key(o.run.seed))
        return decode(tokens)

    return sample


def _export(trainer: Trainer, state) -> None:
    """Write the parameters of train `state` to `--export-to` as a Hugging Face directory, with
    the `--init-from` directory's tokenizer and generation files. The parameters are those a
    checkpoint holds: with `--offload-optimizer` the fp32 masters, not their compute-dtype copy."""
    o, preset = trainer.options, trainer.preset
    network = preset.network(DTYPES[o.precision.dtype], o.parallel)
    m = o.model
    params = jax.tree.map(_readable, trainer.step.canonical_state(state)["params"])
    preset.family.to_pretrained(network, params, m.export_to)
    if m.init_from and jax.process_index() == 0:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "generation_config.json", "tokenizer.model"):
            if (pathlib.Path(m.init_from) / name).is_file():
                shutil.copyfile(pathlib.Path(m.init_from) / name, pathlib.Path(m.export_to) / name)


def _readable(x):
    """A host-resident array (offloaded masters) as one the export can index layer by layer:
    host memory cannot be indexed by device programs."""
    if memory_kind_of(x) in (None, DEVICE_MEMORY_KIND):
        return x
    if x.is_fully_addressable:
        return np.asarray(x)
    return jax.device_put(x, x.sharding.with_memory_kind(DEVICE_MEMORY_KIND))
