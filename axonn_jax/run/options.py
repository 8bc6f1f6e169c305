"""The config tree: every option of a run in nested dataclasses, each default written once.

    RunConfig
      model        which network (a preset or a Hugging Face directory) and its attention kernel
      grid         the device grid, or the planner's pick (`auto`)
      pipeline     microbatches and the pipeline's timetable
      precision    the compute dtype
      optimizer    AdamW, its warm-up/cosine schedule, gradient clipping
      memory       optimizer state in host memory, activation recompute/offload
      compression  CGX-compressed data-parallel gradients
      data         the corpus, batch and sequence, validation
      checkpoint   where and when to save, resuming, stopping
      run          steps, seed, outputs, transport, xla_options

`axonn-jax train`, `plan`, `compile` and `bench` read the same tree (`run.config` makes their flags
and YAML keys from it), so one config file plans, compiles and trains the same run. A field's flag
is `--<name>` unless its metadata names another (`flag`), and it may have aliases (old spellings
keep working: `--data-parallel 2`, `--dp 2`). In YAML and `--set`, a field is named by its path
(`pipeline.schedule`) or by its flag (`schedule`); Python callers may build the tree from the flat
names of the flags (`TrainOptions(steps=3, batch_size=8, parallel=ParallelConfig(data=2))`).

`problems(config, num_devices)` checks a whole config against a device count and returns every
problem, one line each; `check` raises them together.
"""
from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from typing import Any, Callable

import jax.numpy as jnp
import optax

from ..checks import check_choice, collect
from ..config import AXES, SCHEDULES, Axis, ParallelConfig
from ..offload.activations import REMAT_MODES
from ..parallel.context import SCHEMES as CONTEXT_SCHEMES, check_sequence, scheme_problems
from ..parallel.compression import ROUNDINGS, SCOPES, parse_rule
from ..parallel.exchange import REDUCE_DTYPES
from ..parallel.pipeline import unused_schedule
from ..step import xla_options
from ..tp.tensor import COLLECTIVE_MATMUL_CHOICES, collective_matmuls_on
from . import sources
from .sources import LONG_DOCUMENTS

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ATTENTION_CHOICES = ("auto", "xla", "cudnn")
TRANSPORTS = ("xla", "mpi")
XLA_OPTION_CHOICES = xla_options.CHOICES


def option(default: Any = None, help: str = "", *, flag: str | None = None,
           aliases: tuple[str, ...] = (), legacy: str | None = None,
           choices: tuple | Callable[[], Any] | None = None, metavar: str | None = None,
           cli: bool = True, switch_off: bool = False):
    """A field of the tree with what the command line and YAML need to know of it.

    Args:
      default: the field's default.
      help: what it does (the flag's help and the config reference's text).
      flag: its long option (default `--<field name>`).
      aliases: more long options.
      legacy: its name among the flat `TrainOptions` keywords (default: the flag without dashes).
      choices: allowed values (or a function giving them).
      metavar: the flag's value's name in the help.
      cli: False for fields set only from YAML or Python.
      switch_off: a bool whose flag turns it off (`--no-error-feedback`).

    Returns:
      A `dataclasses.field` with these in its metadata.
    """
    meta = dict(help=help, flag=flag, aliases=aliases, legacy=legacy, choices=choices,
                metavar=metavar, cli=cli, switch_off=switch_off)
    return dataclasses.field(default=default, metadata=meta)


def _presets():
    from ..models import presets

    return sorted(presets())


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which network (a preset or a Hugging Face directory) and its attention kernel."""

    name: str = option("gpt-tiny", "model preset", flag="--model", choices=_presets)
    init_from: str | None = option(None, "fine-tune a Hugging Face Llama or GPT-2 directory "
                                   "(config.json + safetensors; its tokenizer.json tokenizes the "
                                   "data); replaces --model", metavar="HF_DIR")
    export_to: str | None = option(None, "write the trained model there as a Hugging Face "
                                   "directory", metavar="DIR")
    attention: str = option("auto", "attention core of built-in models: cuDNN flash attention (a "
                            "CUDA GPU, bf16/fp16), XLA's, or auto (cuDNN where it runs)",
                            choices=ATTENTION_CHOICES)
    context_attention: str = option("ring", "attention across the context axis: one of "
                                    f"{', '.join(CONTEXT_SCHEMES)} (docs/axes/context.md)",
                                    choices=tuple(CONTEXT_SCHEMES))
    sample_tokens: int = option(0, "generate a sample of this many tokens at the end")
    moe_capacity_factor: float | None = option(
        None, "mixture-of-experts layers route with a capacity: each expert takes "
        "ceil(F·tokens·top_k/experts) assignments, the rest are dropped and counted (default: "
        "the preset's, dropless for the built-in ones)", metavar="F")
    moe_dispatch_factor: float | None = option(
        None, "dropless mixture-of-experts layers over --expert devices send each device at "
        "most ceil(F·tokens·top_k/expert) rows, the rest are dropped and counted (default: the "
        "preset's; none: every row could go to one device, nothing dropped)",
        metavar="F")


@dataclasses.dataclass(frozen=True)
class GridOptions:
    """Sizes of the grid's axes; `data` None fills the devices the others leave."""

    data: int | None = option(None, "data-parallel size (default: devices / the other axes)",
                              flag="--data-parallel", aliases=("--dp",))
    pipe: int = option(1, "pipeline stages")
    expert: int = option(1, "devices the experts of mixture-of-experts layers are split over "
                         "(the rest of the model is data-parallel over them)")
    context: int = option(1, "devices each sequence is split over (load-balanced chunks)")
    depth: int = option(1, "depth of 3D tensor parallelism")
    row: int = option(1, "rows of 2D tensor parallelism")
    col: int = option(1, "columns of 2D tensor parallelism")
    collective_matmul: str = option("auto", "tensor-parallel layers gather their input rows in "
                                    "a ring, one matmul per row block while the next block "
                                    "travels (collective matmul): on, off, or auto (on GPUs, "
                                    "without --fp8)", choices=COLLECTIVE_MATMUL_CHOICES)
    auto: bool = option(False, "let the planner choose the grid (and microbatches)",
                        flag="--auto-grid")
    devices: int | None = option(None, "devices of the job: simulated CPU devices to create (set "
                                 "before JAX starts); for `plan`, the devices to plan for")

    def sizes(self) -> dict[str, int | None]:
        """`{axis: size}` in mesh order (`data` may be None).

        Returns:
          The sizes of `AXES`, in that order.
        """
        return {axis: getattr(self, axis) for axis in AXES}


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Microbatches and the pipeline's timetable."""

    microbatches: int = option(1, "microbatches per step (a pipeline's, or gradient accumulation)")
    schedule: str = option("1f1b", "the pipeline's timetable", choices=SCHEDULES)
    virtual_stages: int = option(1, "interleaved-1f1b: layer chunks per pipeline stage",
                                 metavar="V")


@dataclasses.dataclass(frozen=True)
class PrecisionOptions:
    """The compute dtype, FP8 GEMMs and the dtype of the exact gradient exchange."""

    dtype: str = option("float32", "compute dtype; fp32 master weights (float16: dynamic loss "
                        "scaling)", choices=DTYPE_NAMES)
    fp8: bool = option(False, "FP8 GEMMs in every dense layer (e4m3 forward, e5m2 gradients, "
                       "per-tensor current scaling); the rest computes in --dtype (bfloat16 "
                       "advised)")
    reduce_dtype: str = option("float32", "what the exact data-parallel gradient exchange sends: "
                               "float32, or bfloat16 (half the bytes; the received pieces are "
                               "summed in float32)", choices=REDUCE_DTYPES)


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """AdamW, its warm-up/cosine schedule, gradient clipping."""

    lr: float = option(3e-3, "peak learning rate")
    warmup_steps: int = option(-1, "linear warm-up steps (-1: 5%% of --steps)")
    weight_decay: float = option(0.1, "AdamW's decoupled weight decay")
    b1: float = option(0.9, "AdamW's first-moment decay")
    b2: float = option(0.95, "AdamW's second-moment decay")
    clip_norm: float | None = option(1.0, "clip the gradients' global norm to this (none: never)")


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Optimizer state in host memory, activation recompute/offload."""

    offload_optimizer: bool = option(False, "fp32 master weights and optimizer state in host "
                                     "memory, streamed through the device per layer")
    offload_gradients: bool = option(False, "with --offload-optimizer: each block's gradients "
                                     "go to host memory as its backward finishes (no gradient "
                                     "stack on the device; grids without a batch axis)")
    remat: str = option("none", "what each block keeps for the backward (auto: KARMA's planner "
                        "within --memory-budget)", choices=REMAT_MODES)
    budget_gb: float | None = option(None, "device memory budget of --remat auto",
                                     flag="--memory-budget", legacy="memory_budget_gb",
                                     metavar="GB")


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """CGX-compressed data-parallel gradients."""

    bits: int = option(0, "CGX: bits per gradient value over `data` (0: exact all-reduce)",
                       flag="--compress-bits", legacy="compress_bits")
    bucket: int = option(1024, "CGX: values per quantization bucket", flag="--compress-bucket",
                         legacy="compress_bucket")
    error_feedback: bool = option(True, "CGX: carry each device's rounding error to the next "
                                  "step", flag="--no-error-feedback", legacy="error_feedback",
                                  switch_off=True)
    min_size: int = option(1024, "CGX: gradient shards of fewer elements (and 1-D ones: biases, "
                           "norms) are exchanged exact", flag="--compress-min-size",
                           legacy="compress_min_size", metavar="N")
    rules: tuple = option((), "CGX: bits of the parameters whose '/'-joined path matches the "
                          "regular expression PATTERN (BITS 1..8, or exact); the first matching "
                          "rule wins over --compress-bits and the size filter; repeat for more "
                          "(YAML: rules: ['embed=exact', 'mlp=8'])", flag="--compress-rule",
                          legacy="compress_rules", metavar="PATTERN=BITS")
    rounding: str = option("auto", "CGX: round values to their levels to nearest, or "
                           "stochastically (unbiased; noise from the step's key); auto: nearest "
                           "with error feedback, stochastic without",
                           flag="--compress-rounding", legacy="compress_rounding",
                           choices=ROUNDINGS)
    scope: str = option("all", "CGX: compress over every data-parallel device (all), or only "
                        "between nodes (inter-node: an exact reduce-scatter inside each node, "
                        "each device's share compressed across nodes)",
                        flag="--compress-scope", legacy="compress_scope", choices=SCOPES)
    node_size: int | None = option(None, "CGX: devices per node for --compress-scope "
                                   "inter-node (default: 8 on GPUs, an H100 node; the devices "
                                   "of one process on CPU; in `plan`, the machine's)",
                                   flag="--compress-node-size",
                                   legacy="compress_node_size", metavar="N")
    in_backward: bool = option(True, "CGX: exchange each layer's gradients inside the backward, "
                               "beside the next layers' compute (where the exact exchange runs "
                               "there too); off: all of them after the backward",
                               flag="--compress-after-backward", legacy="compress_in_backward",
                               switch_off=True)

    def __post_init__(self):
        # YAML may give a rule as a mapping {PATTERN: BITS}: kept as PATTERN=BITS text.
        value = self.rules
        listed = (value,) if isinstance(value, (str, dict)) else tuple(value or ())
        flat = []
        for rule in listed:
            flat += [f"{k}={v}" for k, v in rule.items()] if isinstance(rule, dict) else [rule]
        object.__setattr__(self, "rules", tuple(str(r) for r in flat))


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One source of a mixture of documents (`data.sources`).

    Its `path` is a JSONL, Parquet, ArrayRecord, text or token file, a directory or a glob of them
    (`run.sources`); its `weight` gives the share of documents drawn from it (weight / the sum of
    the weights); `text_field` (default 'text') or `ids_field` names the field of a record that
    holds the text or the token ids. Values are checked by `problems` (a weight <= 0, a missing
    file: one line each).
    """

    path: str
    weight: Any = 1.0
    text_field: str | None = None
    ids_field: str | None = None

    @classmethod
    def of(cls, value) -> "DataSource":
        """The source a flag, a YAML entry or a DataSource gives.

        Args:
          value: `PATH[:WEIGHT]` (the flag's form; a colon not followed by a number is part of
            the path), a mapping `{path, weight, text_field | ids_field}` (YAML's) or a
            DataSource.

        Returns:
          The `DataSource`.

        Raises:
          ValueError: (one line) another shape, or a mapping with an unknown key.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            path, sep, weight = value.rpartition(":")
            try:
                return cls(path, float(weight)) if sep and path else cls(value)
            except ValueError:  # a colon that is part of the path
                return cls(value)
        return cls(**sources.source_fields(value))

    def problems(self) -> list[str]:
        """What is wrong with this source, one line each (the files' existence included).

        Returns:
          The problems (empty when none).
        """
        found = []
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == float("inf"):
            found.append(f"data source {self.path!r}: weight must be a number > 0, got {w!r}")
        if self.text_field is not None and self.ids_field is not None:
            found.append(f"data source {self.path!r}: give text_field or ids_field, not both")
        try:
            sources.source_files(self.path)
        except (ValueError, FileNotFoundError) as e:
            found.append(str(e))
        return found


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The corpus or the document sources, batch and sequence, validation."""

    path: str | None = option(None, "text file, directory of text files, or .npy/.bin token "
                              "file (default: the Python standard library's sources)",
                              flag="--data", legacy="data_path", metavar="PATH")
    sources: tuple = option((), "train on documents (packed whole into sequences, read per "
                            "host, resumed exactly) from this source: a JSONL, Parquet, "
                            "ArrayRecord, text or token file, a directory or a glob; repeat for "
                            "a weighted mixture (YAML: sources: [{path, weight, text_field | "
                            "ids_field}]); replaces --data", flag="--data-source",
                            legacy="data_sources", metavar="PATH[:WEIGHT]")
    eos_id: int | None = option(None, "documents: the end-of-document token (default: the "
                                "tokenizer's; 0 for byte-level tokens)")
    long_documents: str = option("split", "documents: one longer than a sequence is split "
                                 "over sequences, or refused", choices=LONG_DOCUMENTS)
    val_fraction: float = option(0.01, "documents: the fraction of each source held out for "
                                 "validation")
    workers: int = option(0, "documents: Grain worker processes that read and tokenize them "
                          "(0: a thread of this process)", flag="--data-workers")
    prefetch: int = option(2, "documents: batches read ahead", flag="--data-prefetch")
    batch_size: int = option(16, "global batch (sequences)", aliases=("--batch",))
    seq_len: int = option(64, "tokens per sequence")
    eval_every: int = option(0, "validate every N steps (0: about ten validations per run)")
    eval_batches: int = option(4, "validation batches")

    def __post_init__(self):
        value = self.sources
        listed = (value,) if isinstance(value, (str, dict, DataSource)) else tuple(value or ())
        object.__setattr__(self, "sources", tuple(DataSource.of(s) for s in listed))

    def loader_config(self, seed: int) -> dict:
        """The `run.loader.DataConfig.from_dict` mapping of the document sources.

        Args:
          seed: the seed of their shuffles (the run's).

        Returns:
          `{sources, eos_id, long_documents, val_fraction, seed, workers, prefetch}`, each
          source's fields that are not None.
        """
        return {"sources": [{k: v for k, v in dataclasses.asdict(s).items() if v is not None}
                            for s in self.sources],
                "eos_id": self.eos_id, "long_documents": self.long_documents,
                "val_fraction": self.val_fraction, "seed": seed, "workers": self.workers,
                "prefetch": self.prefetch}


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Where and when to save, resuming, stopping."""

    dir: str | None = option(None, "where checkpoints go (default: RUN_DIR/checkpoints)",
                             flag="--checkpoint-dir", legacy="checkpoint_dir")
    every: int = option(0, "save every N steps", flag="--checkpoint-every",
                        legacy="checkpoint_every")
    keep: int = option(3, "keep the newest N checkpoints", metavar="N")
    keep_every: int = option(0, "and every checkpoint whose step is a multiple of K, forever",
                             metavar="K")
    resume: bool | str = option(False, "continue the run in RUN_DIR (with its config.yaml) from "
                                "its latest checkpoint; `--resume auto`: continue when the "
                                "checkpoint directory holds a checkpoint, else start",
                                metavar="RUN_DIR")
    stop_at: int = option(0, "stop after this step and save a checkpoint, e.g. before a job's "
                          "time limit (resume later). SIGTERM/SIGUSR1 stop at the next step "
                          "(exit code 75), Ctrl-C too (130)", metavar="STEP")


@dataclasses.dataclass(frozen=True)
class RunOutputs:
    """Steps, seed, outputs, transport, XLA options."""

    steps: int = option(100, "training steps")
    seed: int = option(0, "seed of the parameters, the batches and stochastic rounding")
    run_dir: str | None = option(None, "where the run's config, metrics, log, checkpoints, HLO, "
                                 "TensorBoard events, profile and plots go (default: "
                                 "runs/<model>-<time>)", metavar="DIR")
    metrics_out: str | None = option(None, "one JSON object per step (default: "
                                     "RUN_DIR/metrics.jsonl)", metavar="FILE.jsonl")
    dump_hlo: str | None = option(None, "write the optimized HLO of the compiled train step "
                                  "(default: RUN_DIR/hlo)", metavar="DIR")
    profile_steps: str | None = option(None, "write a jax.profiler trace of steps A to B into "
                                       "RUN_DIR/profile", metavar="A:B")
    transport: str = option("xla", "how processes exchange gradients and pipeline messages",
                            choices=TRANSPORTS)
    xla_options: str = option("library", "XLA options of the step on GPUs: the library's "
                              "overlap options (step/xla_options.py) or XLA's defaults",
                              choices=XLA_OPTION_CHOICES)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every option of a run (see the module docstring)."""

    model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    grid: GridOptions = dataclasses.field(default_factory=GridOptions)
    pipeline: PipelineOptions = dataclasses.field(default_factory=PipelineOptions)
    precision: PrecisionOptions = dataclasses.field(default_factory=PrecisionOptions)
    optimizer: OptimizerOptions = dataclasses.field(default_factory=OptimizerOptions)
    memory: MemoryOptions = dataclasses.field(default_factory=MemoryOptions)
    compression: CompressionOptions = dataclasses.field(default_factory=CompressionOptions)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    run: RunOutputs = dataclasses.field(default_factory=RunOutputs)
    given: frozenset = dataclasses.field(default=frozenset(), compare=False, repr=False)
    """Paths of the fields the command line set (a config file, `--set`, a flag): `plan` evaluates
    the grid a config names rather than ranking them all, and options set there that would have
    no effect are refused."""

    @property
    def parallel(self) -> ParallelConfig:
        """The grid as a `ParallelConfig` (`grid.data` must be resolved: see `resolve_grid`)."""
        if self.grid.data is None:
            raise ValueError("the grid's data size is not resolved yet (run.options.resolve_grid)")
        return ParallelConfig(**self.grid.sizes())

    @property
    def warmup(self) -> int:
        """Warm-up steps (the default: 5% of the steps, at least one)."""
        o = self.optimizer
        return max(1, self.run.steps // 20) if o.warmup_steps < 0 else o.warmup_steps

    def replace(self, **paths) -> "RunConfig":
        """A copy with fields replaced by path or by flat name.

        For example `config.replace(**{"pipeline.schedule": "gpipe"})`.

        Args:
          **paths (Any): values by path, or by flat name as `TrainOptions` takes them.

        Returns:
          The new config (see `build`).
        """
        return build(paths, base=self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)
                             if f.name != "given"}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One field of the tree: its path, its dataclass field, its type, its flags and its flat name.

    Attributes:
      path: `section.field` ('pipeline.schedule').
      field: the dataclass field (its metadata from `option`).
      hint: the field's annotation, resolved (`int | None`).
      flags: the flags naming it (the first is its own).
      legacy: its flat name among `TrainOptions`' keywords.
    """

    path: str
    field: dataclasses.Field
    hint: Any
    flags: tuple[str, ...]
    legacy: str

    @property
    def key(self) -> str:
        """Its flat key: the first flag without dashes, dashes as underscores (`data_parallel`)."""
        return self.flags[0].lstrip("-").replace("-", "_")

    @property
    def default(self):
        """The field's default."""
        return self.field.default

    @property
    def meta(self) -> dict:
        """The field's metadata (`option`'s arguments)."""
        return self.field.metadata

    def _members(self) -> tuple:
        return typing.get_args(self.hint) if isinstance(self.hint, types.UnionType) else (self.hint,)

    @property
    def optional(self) -> bool:
        """Whether it takes None (its annotation says `| None`)."""
        return type(None) in self._members()

    @property
    def kind(self) -> type:
        """The type of its value: the annotation without None (and `str` for `bool | str`)."""
        values = [t for t in self._members() if t not in (type(None), bool)]
        return values[0] if values else bool

    @property
    def switch_with_value(self) -> bool:
        """Whether it is a switch that may also take a value (`bool | str`: `--resume [RUN_DIR]`)."""
        return bool in self._members() and self.kind is not bool

    def choices(self):
        """The values it allows.

        Returns:
          The choices (a function's are computed now), or None for any value.
        """
        c = self.meta["choices"]
        return c() if callable(c) else c


def leaves() -> list[Leaf]:
    """Every field of the tree, section by section.

    Returns:
      A `Leaf` per field, in `SECTIONS`' order and each section's field order.
    """
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            flags = (flag, *f.metadata.get("aliases", ()))
            legacy = f.metadata.get("legacy") or flag.lstrip("-").replace("-", "_")
            out.append(Leaf(f"{section}.{f.name}", f, hints[f.name], flags, legacy))
    return out


def _by(attribute: str) -> dict[str, Leaf]:
    return {getattr(leaf, attribute): leaf for leaf in leaves()}


def build(values: dict[str, Any], base: RunConfig | None = None,
          given: frozenset = frozenset()) -> RunConfig:
    """A config from `{path or flat name: value}` over `base`.

    Values are taken as given (`run.config` types and checks text).

    Args:
      values: values by path, flat name or flag key; a flat `parallel=ParallelConfig(...)` sets
        the grid, and a section name may take a section object.
      base: the config to start from (default: the defaults).
      given: paths to add to the config's `given` (what the command line set).

    Returns:
      The `RunConfig`.

    Raises:
      TypeError: an unknown name, or `parallel` that is not a `ParallelConfig`.
    """
    by_path, by_legacy, by_key = _by("path"), _by("legacy"), _by("key")
    sections = {name: dataclasses.asdict(getattr(base or RunConfig(), name)) for name in SECTIONS}
    for name, value in values.items():
        if name == "parallel":
            if not isinstance(value, ParallelConfig):
                raise TypeError(f"parallel must be a ParallelConfig, got {type(value).__name__}")
            sections["grid"].update(value.as_dict())
            continue
        if name in SECTIONS and isinstance(value, SECTIONS[name]):
            sections[name] = dataclasses.asdict(value)
            continue
        leaf = by_path.get(name) or by_legacy.get(name) or by_key.get(name)
        if leaf is None:
            raise TypeError(f"unknown option {name!r}")
        section, field = leaf.path.split(".")
        sections[section][field] = value
    return RunConfig(**{name: SECTIONS[name](**v) for name, v in sections.items()},
                     given=(base.given if base else frozenset()) | frozenset(given))


def TrainOptions(**values) -> RunConfig:  # noqa: N802 - the flat spelling of earlier releases
    """The config tree from flat option names, paths, or whole sections.

    Values no grid or device count can make right are refused here; the rest is checked when a
    run is built.

    Args:
      **values (Any): flat option names (`steps`, `batch_size`, `parallel=ParallelConfig(data=2)`,
        `compress_bits`, ...: the flags' names), paths (`pipeline.schedule`), or sections.

    Returns:
      The `RunConfig`.

    Raises:
      ConfigError: every such problem, one line each.
      TypeError: an unknown name.
    """
    config = build(values)
    found = _field_problems(config)
    if found:
        raise ConfigError(found)
    return config


# ---------------------------------------------------------------------------------------------
# Checks: every problem of a config, one line each.


class ConfigError(ValueError):
    """A config that cannot run; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _field_problems(config: RunConfig) -> list[str]:
    """Values that no grid or device count can make right."""
    found = []
    for leaf in leaves():
        section, field = leaf.path.split(".")
        value = getattr(getattr(config, section), field)
        choices = leaf.choices()
        if choices is not None:
            collect(found, check_choice, leaf.flags[0], value, choices)
    c, d, r = config.checkpoint, config.data, config.run
    positive = [("--steps", r.steps), ("--batch-size", d.batch_size), ("--seq-len", d.seq_len),
                ("--eval-batches", d.eval_batches), ("--microbatches", config.pipeline.microbatches),
                ("--virtual-stages", config.pipeline.virtual_stages), ("--keep", c.keep)]
    positive += [(leaf.flags[0], getattr(config.grid, leaf.path.split(".")[1]))
                 for leaf in leaves() if leaf.path in {f"grid.{a}" for a in AXES}]
    for flag, value in positive:
        if value is not None and value < 1:
            found.append(f"{flag} must be positive, got {value}")
    if config.grid.devices is not None and config.grid.devices < 1:
        found.append(f"--devices must be positive, got {config.grid.devices}")
    if c.stop_at < 0:
        found.append(f"--stop-at must be a step >= 1 (0: run to the end), got {c.stop_at}")
    for flag, value in (("--keep-every", c.keep_every), ("--checkpoint-every", c.every),
                        ("--eval-every", d.eval_every)):
        if value < 0:
            found.append(f"{flag} must be >= 0, got {value}")
    if c.resume not in (True, False, "auto"):
        found.append(f"--resume must be true, false or auto, got {c.resume!r}")
    if c.resume and not (c.dir or r.run_dir):
        found.append("--resume needs the run directory (or --checkpoint-dir)")
    if c.every and not (c.dir or r.run_dir):
        found.append("--checkpoint-every needs a place for the checkpoints: --checkpoint-dir (or "
                     "the run directory)")
    if r.metrics_out and pathlib.Path(r.metrics_out).is_dir():
        found.append(f"--metrics-out {r.metrics_out} is a directory; name a file "
                     "(e.g. metrics.jsonl)")
    if r.profile_steps is not None:
        from .hooks import parse_step_range

        collect(found, parse_step_range, r.profile_steps)
    for rule in config.compression.rules:
        collect(found, parse_rule, rule)
    if config.compression.min_size < 0:
        found.append(f"--compress-min-size must be >= 0, got {config.compression.min_size}")
    return found + _data_problems(config)


def _data_problems(config: RunConfig) -> list[str]:
    """The document sources' problems (a weight <= 0, a missing file, ...), one line each."""
    d = config.data
    if not d.sources:
        return []
    found = [line for s in d.sources for line in s.problems()]
    if d.path is not None:
        found.append("--data and --data-source name two corpora; give one")
    if not 0 <= d.val_fraction < 1:
        found.append(f"--val-fraction must be in [0, 1), got {d.val_fraction}")
    for flag, value in (("--data-workers", d.workers), ("--data-prefetch", d.prefetch),
                        ("--eos-id", d.eos_id)):
        if value is not None and value < 0:
            found.append(f"{flag} must be >= 0, got {value}")
    if config.run.transport == "mpi":
        found.append("--data-source with --transport mpi is not implemented yet (use --transport xla)")
    return found


def _ignored(config: RunConfig) -> list[str]:
    """Options the command line set to something that would have no effect on this config:
    refused, not ignored (a default value, as a written-out config holds them all, is no request;
    Python callers build configs for many grids with one set of options and are not refused)."""
    found = []
    schedule = config.pipeline.schedule
    if "pipeline.schedule" in config.given and schedule != PipelineOptions().schedule \
            and not config.grid.auto and (why := unused_schedule(schedule, config.grid.pipe)):
        found.append(why)
    c, default = config.compression, CompressionOptions()
    if not c.bits:
        if "compression.bucket" in config.given and c.bucket != default.bucket:
            found.append("--compress-bucket needs gradient compression (--compress-bits)")
        if "compression.error_feedback" in config.given and \
                c.error_feedback != default.error_feedback:
            found.append("--no-error-feedback needs gradient compression (--compress-bits)")
        for field, flag in (("min_size", "--compress-min-size"), ("rules", "--compress-rule"),
                            ("rounding", "--compress-rounding"),
                            ("scope", "--compress-scope"),
                            ("node_size", "--compress-node-size")):
            if f"compression.{field}" in config.given and \
                    getattr(c, field) != getattr(default, field):
                found.append(f"{flag} needs gradient compression (--compress-bits)")
    if config.grid.auto:
        explicit = [f"--{a}" for a in AXES[1:] if getattr(config.grid, a) != 1]
        explicit += ["--data-parallel"] if config.grid.data is not None else []
        if explicit:
            found.append(f"--auto-grid chooses the grid itself; drop {', '.join(explicit)}")
    return found


def preset_of(config: RunConfig):
    """The built-in model the config names (`models.Preset`): `--init-from`'s or `--model`'s.

    Args:
      config: the run's config; its `--moe-capacity-factor` / `--moe-dispatch-factor` are set
        in the preset's config.

    Returns:
      The `models.Preset`.

    Raises:
      ValueError: an unknown model or a Hugging Face directory of another architecture; a
        routing factor that is not > 0, or given for a model without mixture-of-experts layers.
    """
    from .. import models

    preset = models.pretrained(config.model.init_from) if config.model.init_from else \
        models.get(config.model.name)
    routing = {name: value for name, value in (
        ("capacity_factor", config.model.moe_capacity_factor),
        ("dispatch_factor", config.model.moe_dispatch_factor)) if value is not None}
    flags = {name: f"--moe-{name.replace('_', '-')}" for name in routing}
    for name, value in routing.items():
        if not value > 0:
            raise ValueError(f"{flags[name]} {value} must be > 0")
    if routing and not {f.name for f in dataclasses.fields(preset.config)} >= routing.keys():
        raise ValueError(f"{', '.join(flags.values())}: {preset.name} has no mixture-of-experts "
                         "layers")
    return preset.with_config(**routing) if routing else preset


def grid_problems(config: RunConfig, grid: ParallelConfig, *, num_layers: int | None = None,
                  rows: int | None = None, num_devices: int | None = None,
                  platform: str | None = None) -> list[str]:
    """What stops this config's step from running on `grid`, one line each.

    Args:
      config: the run's config.
      grid: the grid.
      num_layers: the model's layers (None: unchecked).
      rows: the rows of the local batch (default: the config's batch).
      num_devices: the devices the grid must fit (None: unchecked).
      platform: the devices' platform, e.g. `cpu` or `gpu` (None: unchecked).

    Returns:
      The problems (empty when none).
    """
    from ..config import check_grid
    from ..step.train_step import StepOptions, option_problems

    found: list[str] = []
    if num_devices is not None:
        collect(found, grid.validate, num_devices)
    p = config.pipeline
    collect(found, check_grid, grid, batch_size=rows or config.data.batch_size,
            microbatches=p.microbatches, flags=True)
    mpi = config.run.transport == "mpi"
    if grid.context > 1:
        collect(found, check_sequence, config.data.seq_len, grid.context)
        found += scheme_problems(config.model.context_attention, grid.pipe, platform)
    found += option_problems(grid, StepOptions(**step_options(config)), num_layers=num_layers,
                             between_processes=mpi)
    collect(found, collective_matmuls_on, config.grid.collective_matmul, platform or "cpu",
            config.precision.fp8)
    return found


def model_problems(config: RunConfig, grid: ParallelConfig | None,
                   platform: str | None = None) -> list[str]:
    """What stops the built-in model the config names from running, one line each.

    Args:
      config: the run's config.
      grid: the grid (None: the checks that need none).
      platform: the devices' platform (None: unchecked).

    Returns:
      The problems (empty when none).
    """
    from ..models import attention
    from ..offload.precision import DTYPES

    found: list[str] = []
    try:
        preset = preset_of(config)
    except (ValueError, FileNotFoundError) as e:
        return [str(e)]
    if preset.data == "images":
        for flag, used in (("--sample-tokens", config.model.sample_tokens),
                           ("--export-to", config.model.export_to),
                           ("--data", config.data.path), ("--data-source", config.data.sources)):
            if used:
                found.append(f"{flag} is for language models; {preset.name} trains on "
                             "procedurally drawn images")
        return found + ([] if grid is None else _grid_of_model(preset, grid))
    if config.data.seq_len > preset.config.max_seq_len:
        found.append(f"--seq-len {config.data.seq_len} exceeds {preset.name}'s max_seq_len "
                     f"{preset.config.max_seq_len}")
    collect(found, attention.check, config.model.attention, DTYPES[config.precision.dtype],
            getattr(preset.config, "head_dim", None), platform)
    return found + ([] if grid is None else _grid_of_model(preset, grid))


def _grid_of_model(preset, grid: ParallelConfig) -> list[str]:
    found: list[str] = []
    if grid.tensor_parallel_size > 1:
        collect(found, preset.check_grid, grid)
    return found


def problems(config: RunConfig, grid: ParallelConfig | None = None, *,
             num_layers: int | None = None, rows: int | None = None,
             num_devices: int | None = None, platform: str | None = None,
             builtin_model: bool = True) -> list[str]:
    """Every problem of `config`, one line each.

    Args:
      config: the run's config.
      grid: the grid (None: the checks that need no grid).
      num_layers: the model's layers (None: the built-in model's, when it is trained).
      rows: the rows of the local batch (default: the config's batch).
      num_devices: the devices (None: unchecked).
      platform: the devices' platform (None: unchecked).
      builtin_model: the config's model is the one trained (not a caller's `StackedModel`).

    Returns:
      The problems (empty when none). Values wrong whatever the grid come alone, then the
      built-in model's problems alone: the later checks assume sane values.
    """
    found = _field_problems(config) + _ignored(config)
    if found:
        return found  # the rest assumes sane values
    if builtin_model:
        found += model_problems(config, grid, platform)
        if found:
            return found
        if num_layers is None:
            num_layers = preset_of(config).build(jnp.float32).num_layers
    if grid is not None:
        found += grid_problems(config, grid, num_layers=num_layers, rows=rows,
                               num_devices=num_devices, platform=platform)
    return found


def check(config: RunConfig, grid: ParallelConfig | None = None, **kwargs) -> None:
    """Raise ConfigError with every problem of `problems(config, grid, **kwargs)`.

    Args:
      config: the run's config.
      grid: the grid (None: the checks that need no grid).
      **kwargs: `problems`' keyword arguments.

    Raises:
      ConfigError: the problems, duplicates dropped.
    """
    found = problems(config, grid, **kwargs)
    if found:
        raise ConfigError(list(dict.fromkeys(found)))


# ---------------------------------------------------------------------------------------------
# What the tree makes.


def resolve_grid(config: RunConfig, num_devices: int) -> ParallelConfig:
    """The grid of `config` on `num_devices` devices: `data` fills what the other axes leave.

    Under `--transport mpi` the pipeline stages are processes, not this process's devices.

    Args:
      config: the run's config.
      num_devices: the devices.

    Returns:
      The `ParallelConfig`.

    Raises:
      ConfigError: `data` is unset and the other axes do not divide the devices.
    """
    g = config.grid
    inner = 1
    for axis in AXES[1:]:
        if not (axis == Axis.PIPE and config.run.transport == "mpi"):
            inner *= getattr(g, axis)
    data = g.data
    if data is None:
        if num_devices % inner:
            others = "·".join(a for a in AXES[1:] if not (a == Axis.PIPE and
                                                         config.run.transport == "mpi"))
            raise ConfigError([f"{others} = {inner} does not divide the {num_devices} devices"])
        data = num_devices // inner
    return ParallelConfig(**{**g.sizes(), Axis.DATA: data})


def with_grid(config: RunConfig, grid: ParallelConfig, microbatches: int | None = None,
              remat: str | None = None) -> RunConfig:
    """`config` with its grid set to `grid` (and the planner off), e.g. the grid that ran.

    Args:
      config: the run's config.
      grid: the grid.
      microbatches: the microbatches (None: the config's).
      remat: the remat mode (None: the config's).

    Returns:
      The new config.
    """
    values: dict[str, Any] = {f"grid.{a}": getattr(grid, a) for a in AXES}
    values["grid.auto"] = False
    if microbatches is not None:
        values["pipeline.microbatches"] = microbatches
    if remat is not None:
        values["memory.remat"] = remat
    return config.replace(**values)


def make_optimizer(config: RunConfig) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with linear warm-up and cosine decay to a tenth of the peak, and its schedule.

    Gradient clipping is the step's, not the optimizer's.

    Args:
      config: the run's config (`optimizer`, `run.steps`, `warmup`).

    Returns:
      `(optimizer, lr_schedule)`: the optax transformation and the schedule `step -> lr`.
    """
    o = config.optimizer
    steps, warmup = config.run.steps, config.warmup
    lr_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=o.lr * 0.1)
    adamw = optax.adamw(lr_schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    return adamw, lr_schedule


def step_options(config: RunConfig) -> dict:
    """The `make_train_step` options of the config.

    Args:
      config: the run's config.

    Returns:
      The keyword arguments of `step.train_step.make_train_step` (pipeline, memory,
      compression, precision, clipping, XLA options and collective matmul).
    """
    p, m, c = config.pipeline, config.memory, config.compression
    return dict(microbatches=p.microbatches, schedule=p.schedule, virtual_stages=p.virtual_stages,
                offload_optimizer=m.offload_optimizer, offload_gradients=m.offload_gradients,
                remat=m.remat,
                memory_budget_gb=m.budget_gb, compress_bits=c.bits, compress_bucket=c.bucket,
                error_feedback=c.error_feedback, compress_min_size=c.min_size,
                compress_rules=c.rules, compress_rounding=c.rounding,
                compress_in_backward=c.in_backward, compress_scope=c.scope,
                compress_node_size=c.node_size,
                reduce_dtype=config.precision.reduce_dtype,
                dtype=config.precision.dtype,
                fp8=config.precision.fp8, clip_norm=config.optimizer.clip_norm,
                xla_options=config.run.xla_options, collective_matmul=config.grid.collective_matmul)
