"""`TrainOptions`: everything a training run needs, one field per `axonn-jax train` flag."""
from __future__ import annotations

import dataclasses
from typing import Callable

import optax

from ..config import ParallelConfig
from ..models.attention import check_choice
from ..offload.precision import DTYPES


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
    keep: int = 3  # checkpoints: the newest `keep` steps are kept
    keep_every: int = 0  # ... and every multiple of `keep_every` forever (0: none)
    resume: bool | str = False  # "auto": resume when the checkpoint directory holds a checkpoint
    stop_at: int = 0  # stop after this step (schedule still spans `steps`); 0: run to the end
    metrics_out: str | None = None
    dump_hlo: str | None = None
    run_dir: str | None = None  # holds the run's outputs (run.rundir); the CLI always sets one
    profile_steps: str | None = None  # "A:B": a jax.profiler trace of steps A..B into run_dir
    sample_tokens: int = 0
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    microbatches: int = 1
    schedule: str = "gpipe"  # the pipeline's timetable (parallel.pipeline.SCHEDULES)
    virtual_stages: int = 1  # interleaved-1f1b: layer chunks per pipeline stage
    offload_optimizer: bool = False
    remat: str = "none"
    attention: str = "auto"  # the attention core of built-in models: auto, xla, cudnn
    memory_budget_gb: float | None = None
    compress_bits: int = 0
    compress_bucket: int = 1024
    error_feedback: bool = True
    transport: str = "xla"
    init_from: str | None = None  # a Hugging Face directory: its model and parameters (not --model)
    export_to: str | None = None  # write the trained model there as a Hugging Face directory

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        check_choice(self.attention)
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume must be True, False or 'auto', got {self.resume!r}")
        if self.resume and not (self.checkpoint_dir or self.run_dir):
            raise ValueError("--resume needs the run directory (or --checkpoint-dir)")
        if self.checkpoint_every and not (self.checkpoint_dir or self.run_dir):
            raise ValueError("--checkpoint-every needs a place for the checkpoints: "
                             "--checkpoint-dir (or the run directory)")
        if self.stop_at < 0:
            raise ValueError(f"--stop-at must be a step >= 1 (0: run to the end), got {self.stop_at}")
        if self.eval_batches < 1:
            raise ValueError(f"--eval-batches must be positive, got {self.eval_batches}")

    @property
    def warmup(self) -> int:
        return max(1, self.steps // 20) if self.warmup_steps < 0 else self.warmup_steps

    def step_options(self) -> dict:
        """The `make_train_step` options these flags ask for."""
        return dict(microbatches=self.microbatches, schedule=self.schedule,
                    virtual_stages=self.virtual_stages,
                    offload_optimizer=self.offload_optimizer, remat=self.remat,
                    memory_budget_gb=self.memory_budget_gb, compress_bits=self.compress_bits,
                    compress_bucket=self.compress_bucket, error_feedback=self.error_feedback,
                    dtype=self.dtype, clip_norm=self.clip_norm, seed=self.seed)


def make_optimizer(options: TrainOptions) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with linear warmup and cosine decay (clipping is the step's `clip_norm`), and the
    learning-rate schedule `step -> lr`."""
    lr_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=options.lr,
        warmup_steps=options.warmup,
        decay_steps=max(options.steps, options.warmup + 1),
        end_value=options.lr * 0.1,
    )
    adamw = optax.adamw(lr_schedule, b1=0.9, b2=0.95, weight_decay=options.weight_decay)
    return adamw, lr_schedule
