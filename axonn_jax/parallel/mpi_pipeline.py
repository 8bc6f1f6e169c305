"""AxoNN's message-driven pipeline over MPI: `mpirun -n S·D axonn-jax train --transport mpi --pipe S`.

One process per pipeline stage. Rank `r = d·S + s` runs stage `s` of pipeline `d` (D data-parallel
copies of an S-stage pipeline); it holds only its `L/S` blocks, plus the embedding on the first stage
and the final norm and head on the last, and the optimizer state of exactly those parameters.

A step, on each process:

1. A host loop runs the stage's forward (F) and backward (B) operations for the M microbatches. Each
   is one `jax.jit` program: "receive the activation (mpi4jax `recv`), run the stage" and "receive the
   output gradient, recompute the stage forward and take its vjp, accumulate the parameter
   gradients". The loop is message-driven, as in AxoNN: `permitted` says which operations the
   schedule allows next (at most one F and one B), `comm.Iprobe` says whose message has arrived, and
   the stage runs whichever is ready; when both are, the one the static schedule runs first.
   The first stage's forwards need no message (it embeds the tokens), nor the last stage's
   backwards (its loss is local).
2. Outputs go to the neighbour as non-blocking `MPI_Isend`s (mpi4py) of the host copy, completed
   before the step ends. mpi4jax 0.9 has only a blocking `send`: with it, stage s sending an
   activation to s+1 while s+1 sends a gradient to s deadlocks once the messages are large enough for
   MPI's rendezvous protocol (4 MB both ways hangs under MPICH; measured), which 1F1B does
   in its steady state.
3. One jitted program finishes the step: the data-parallel mean of the gradients and the loss over
   the D copies of this stage (mpi4jax `allreduce` of one flattened vector), the squared gradient
   norm and the loss summed over the S stages (one more `allreduce` of two numbers; the loss is
   nonzero only on the last stage), then global-norm clipping and AdamW on this stage's parameters.

The backward recomputes the stage forward from the stashed stage input, like the in-process engine
(parallel/pipeline.py): a stage keeps one input activation per microbatch in flight. With `1f1b` a
stage s starts a forward only while fewer than S − s microbatches are in flight, so no stage ever
holds more than S stashed inputs, whatever M is; `gpipe` runs all M forwards before any backward.
Send buffers are bounded the same way: an activation send is pending only while its microbatch is
in flight at the sender (the receiver takes it before it can send that microbatch's gradient back),
a gradient send only while its microbatch is in flight at the receiver.

Messages between two stages travel on their own communicator, tagged `2·microbatch + kind`. Each
stage receives activations only from s−1 and gradients only from s+1, in microbatch order, and MPI
does not let messages from one sender overtake each other, so `Iprobe` for the exact tag tells that
the next message is there and the receive (any tag, one compiled program for all microbatches)
takes it.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import data as data_lib
from ..models import gpt
from ..offload import optimizer as offload_opt
from ..train import DTYPES, EMBED_PARAMS, HEAD_PARAMS, STACK_PARAMS, gpt_stage_functions, make_adamw
from . import pipeline as pipeline_lib

ACT, GRAD = 0, 1  # message kinds: activation forward, its gradient backward


def tag(kind: int, microbatch: int) -> int:
    return 2 * microbatch + kind


def permitted(schedule: str, num_stages: int, num_microbatches: int, stage: int,
              forwards: int, backwards: int) -> list[tuple[str, int]]:
    """The operations stage `stage` may run next, after `forwards` forwards and `backwards`
    backwards: `[("F", mb)]`, `[("B", mb)]`, both (the one the static schedule runs first comes
    first) or none. Microbatches go through each kind of operation in order.

    gpipe: every forward, then every backward. 1f1b: a backward as soon as its gradient is there,
    a forward while fewer than `num_stages − stage` microbatches are in flight (the static 1F1B
    order's warm-up depth + 1), which bounds a stage's stashed inputs by `num_stages`.
    """
    m, in_flight = num_microbatches, forwards - backwards
    ops = []
    limit = m if schedule == "gpipe" else num_stages - stage
    if forwards < m and in_flight < limit:
        ops.append(("F", forwards))
    if in_flight > 0 and (schedule == "1f1b" or forwards == m):
        ops.append(("B", backwards))
    if len(ops) == 2:
        order = pipeline_lib.stage_order(schedule, num_stages, num_microbatches, stage,
                                           lockstep=False)
        ops.sort(key=order.index)
    return ops


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits: stage `stage` of `num_stages`, data group `group` of `num_groups`;
    `pipe_comm` joins the stages of its pipeline (rank = stage), `data_comm` the copies of its
    stage (rank = group)."""

    stage: int
    num_stages: int
    group: int
    num_groups: int
    pipe_comm: Any
    data_comm: Any

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def make_layout(comm, num_stages: int) -> Layout:
    """Split `comm` (size S·D) into pipelines of `num_stages` consecutive ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if num_stages < 2 or size % num_stages:
        raise ValueError(f"--transport mpi --pipe {num_stages} needs a multiple of {num_stages} MPI "
                         f"processes (one per stage, times data-parallel copies), got {size}")
    group, stage = divmod(rank, num_stages)
    return Layout(stage, num_stages, group, size // num_stages,
                  comm.Split(color=group, key=stage), comm.Split(color=stage, key=group))


def stage_params(params: dict, layout: Layout, num_layers: int) -> dict:
    """This stage's part of the GPT's parameters: its slice of the stacked blocks (leading layer
    axis), plus the embedding on the first stage and the final norm and head on the last."""
    per = num_layers // layout.num_stages
    lo = layout.stage * per
    mine = {STACK_PARAMS: jax.tree.map(lambda x: x[lo:lo + per], params[STACK_PARAMS])}
    if layout.first:
        mine |= {k: params[k] for k in EMBED_PARAMS}
    if layout.last:
        mine |= {k: params[k] for k in HEAD_PARAMS}
    return mine


class StageEngine:
    """The jitted operations of one stage and the message-driven loop that runs them.

    params: this stage's parameter dict (`stage_params`); batch: `(b, seq_len + 1)` int32, this
    pipeline's rows, cut into M microbatches of `b/M` rows; activations `(b/M, seq_len, d_model)`.
    """

    def __init__(self, model: gpt.GPT, layout: Layout, schedule: str, num_microbatches: int,
                 seq_len: int, rows: int):
        import mpi4jax

        self.layout, self.schedule, self.m = layout, schedule, num_microbatches
        self.comm = layout.pipe_comm
        s, m = layout.stage, num_microbatches
        embed_fn, stage_fn, head_fn = gpt_stage_functions(model, layout.num_stages)
        mb_rows = rows // m
        act = jnp.zeros((mb_rows, seq_len, model.config.d_model), model.dtype)
        comm = self.comm

        def microbatch(batch, mb):
            rows_ = jax.lax.dynamic_slice_in_dim(batch, mb * mb_rows, mb_rows)
            return rows_[:, :-1], rows_[:, 1:]

        def apply(p, x, targets):
            """Stage input (tokens on the first stage) -> output (the loss on the last)."""
            if layout.first:
                x = embed_fn({k: p[k] for k in EMBED_PARAMS}, x)
            y = stage_fn(p[STACK_PARAMS], x)
            if layout.last:
                return head_fn({k: p[k] for k in HEAD_PARAMS}, y, targets)
            return y

        def recv(kind):
            source = s - 1 if kind == ACT else s + 1
            return mpi4jax.recv(jnp.zeros_like(act), source, comm=comm)

        def forward(params, batch, mb):
            """F: (stashed stage input, output to send). The last stage only receives: its
            backward recomputes the forward."""
            tokens, targets = microbatch(batch, mb)
            x = tokens if layout.first else recv(ACT)
            return x, (None if layout.last else apply(params, x, targets))

        def backward(params, grads, loss, x, batch, mb):
            """B: (gradients + this microbatch's, loss + its share, input gradient to send)."""
            _, targets = microbatch(batch, mb)
            if layout.first:  # integer tokens: differentiate the parameters only
                out, vjp = jax.vjp(lambda p: apply(p, x, targets), params)
            else:
                out, vjp = jax.vjp(lambda p, x_: apply(p, x_, targets), params, x)
            g_out = jnp.full((), 1.0 / m, out.dtype) if layout.last else recv(GRAD)
            g = vjp(g_out)
            grads = jax.tree.map(jnp.add, grads, g[0])
            if layout.last:
                loss = loss + out.astype(jnp.float32) / m
            return grads, loss, (None if layout.first else g[1])

        def evaluate(params, loss, batch, mb):
            """Forward only: (loss + this microbatch's share on the last stage, output to send)."""
            x, y = forward(params, batch, mb)
            if layout.last:
                return loss + apply(params, x, microbatch(batch, mb)[1]).astype(jnp.float32) / m, None
            return loss, y

        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward, donate_argnums=(1, 2))
        self.evaluate = jax.jit(evaluate, donate_argnums=1)

    def _ready(self, op: tuple[str, int]) -> bool:
        kind, mb = op
        if kind == "F":
            return self.layout.first or self.comm.Iprobe(source=self.layout.stage - 1,
                                                         tag=tag(ACT, mb))
        return self.layout.last or self.comm.Iprobe(source=self.layout.stage + 1, tag=tag(GRAD, mb))

    def _send(self, sends: list, y, kind: int, mb: int):
        buf = np.asarray(y)  # kept alive with its request until the send completes
        dest = self.layout.stage + 1 if kind == ACT else self.layout.stage - 1
        sends.append((self.comm.Isend(buf, dest=dest, tag=tag(kind, mb)), buf))

    @staticmethod
    def _complete(sends: list, wait: bool = False) -> list:
        from mpi4py import MPI

        if wait:
            MPI.Request.Waitall([r for r, _ in sends])
            return []
        return [(r, b) for r, b in sends if not r.Test()]

    def run(self, params, batch) -> tuple[Any, jax.Array, int, int]:
        """Forwards and backwards of every microbatch, each as soon as its message is there and the
        schedule permits. Returns (summed gradients like `params`, mean microbatch loss (0 except on
        the last stage), most stage inputs stashed at once, operations run earlier than the static
        schedule would have: a message arrived before the one the static order waits for)."""
        s, p, m = self.layout.stage, self.layout.num_stages, self.m
        static = pipeline_lib.stage_order(self.schedule, p, m, s, lockstep=False)
        reordered = 0
        grads = jax.tree.map(jnp.zeros_like, params)
        loss = jnp.zeros((), jnp.float32)
        stash: dict[int, jax.Array] = {}
        sends: list = []
        forwards = backwards = peak = 0
        idle = 0
        while backwards < m:
            ops = permitted(self.schedule, p, m, s, forwards, backwards)
            op = next((o for o in ops if self._ready(o)), None)
            if op is None:  # nothing has arrived: let the sends progress, then look again
                sends = self._complete(sends)
                time.sleep(min(1e-3, 1e-5 * 2 ** min(idle, 7)))
                idle += 1
                continue
            idle = 0
            reordered += op != static[forwards + backwards]
            mb = np.int32(op[1])
            if op[0] == "F":
                stash[op[1]], y = self.forward(params, batch, mb)
                peak = max(peak, len(stash))
                if y is not None:
                    self._send(sends, y, ACT, op[1])
                forwards += 1
            else:
                grads, loss, g_x = self.backward(params, grads, loss, stash.pop(op[1]), batch, mb)
                if g_x is not None:
                    self._send(sends, g_x, GRAD, op[1])
                backwards += 1
        self._complete(sends, wait=True)
        return grads, loss, peak, reordered

    def run_forward(self, params, batch) -> jax.Array:
        """The forward of every microbatch in order (evaluation); the mean loss on the last stage,
        0 elsewhere. Receives block: only activations flow, so nothing waits on this stage."""
        loss = jnp.zeros((), jnp.float32)
        sends: list = []
        for mb in range(self.m):
            loss, y = self.evaluate(params, loss, batch, np.int32(mb))
            if y is not None:
                self._send(sends, y, ACT, mb)
        self._complete(sends, wait=True)
        return loss


def make_finish(layout: Layout, optimizer: optax.GradientTransformation, clip_norm: float,
                schedule: Callable) -> Callable:
    """`(state, grads, loss, stash_peak, reordered) -> (state, metrics)`: gradients and loss
    averaged over the data groups, the global gradient norm over all stages, clipping as
    `optax.clip_by_global_norm` does, then the elementwise `optimizer` (AdamW) on this stage's
    parameters. Metrics are equal on every process of a pipeline; `stash_peak` becomes the most
    stage inputs any of its stages held, `reordered` the operations its stages ran out of the static
    order.

    Every MPI collective of a step is in here, in one program: with asynchronous dispatch, a
    host-side collective on the same communicator could run concurrently with it and mismatch."""
    import mpi4jax
    from mpi4py import MPI

    from .mpi import exchange_fn, make_gradient_reducer

    exchange = exchange_fn(make_gradient_reducer(layout.data_comm)) if layout.num_groups > 1 \
        else lambda loss, grads: (loss, grads)

    def finish(state, grads, loss, stash_peak, reordered):
        loss, grads = exchange(loss, grads)
        sumsq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        total = mpi4jax.allreduce(jnp.stack([sumsq, loss, reordered.astype(jnp.float32)]),
                                  op=MPI.SUM, comm=layout.pipe_comm)
        norm, loss = jnp.sqrt(total[0]), total[1]
        clipped = jax.tree.map(
            lambda g: jax.lax.select(norm < clip_norm, g, (g / norm.astype(g.dtype)) * clip_norm),
            grads)
        updates, opt_state = optimizer.update(clipped, state["opt_state"], state["params"])
        new = {**state, "step": state["step"] + 1, "opt_state": opt_state,
               "params": optax.apply_updates(state["params"], updates)}
        stash_peak = mpi4jax.allreduce(stash_peak, op=MPI.MAX, comm=layout.pipe_comm)
        return new, {"loss": loss, "grad_norm": norm, "lr": schedule(state["step"]),
                     "stash_peak": stash_peak, "reordered_ops": total[2]}

    return jax.jit(finish, donate_argnums=0)


@dataclasses.dataclass
class CompiledPipelineStep:
    """One step of this process, called like a compiled `Trainer.train_step`. The programs stay
    `jax.jit` functions (an AOT-compiled program with mpi4jax calls fails from its second call);
    `as_text` / `memory_analysis` compile copies of them for inspection."""

    engine: StageEngine
    finish: Callable
    example: tuple
    _inspected: Any = dataclasses.field(default=None, repr=False)

    def __call__(self, state, batch):
        grads, loss, peak, reordered = self.engine.run(state["params"], batch)
        return self.finish(state, grads, loss, np.int32(peak), np.int32(reordered))

    def _backward_compiled(self):
        if self._inspected is None:
            state, batch = self.example
            params, e = state["params"], self.engine
            x = jax.eval_shape(e.forward, params, batch, np.int32(0))[0]
            self._inspected = e.backward.lower(params, params, jnp.zeros((), jnp.float32), x,
                                               batch, np.int32(0)).compile()
        return self._inspected

    def as_text(self) -> str:
        """Compiled HLO of this stage's backward operation (the largest of its programs)."""
        return self._backward_compiled().as_text()

    def memory_analysis(self):
        """Of the backward operation, which holds the recomputed stage's activations."""
        return self._backward_compiled().memory_analysis()


@dataclasses.dataclass
class PipelineStep:
    """`train_step` of the trainer: `.lower(state, batch).compile()` gives the callable step."""

    engine: StageEngine
    finish: Callable

    def lower(self, state, batch):
        from .mpi import _Lowered

        return _Lowered(self, state, batch)

    def compile(self, state, batch) -> CompiledPipelineStep:
        return CompiledPipelineStep(self.engine, self.finish, (state, batch))


@dataclasses.dataclass
class MpiPipelineTrainer:
    """What `train.train` needs of a trainer, for one stage process of an MPI pipeline job.

    State: `{'step', 'params', 'opt_state'}` of this stage's parameters only, on the process's
    device. Batches: this pipeline's `global batch / D` rows, `(b, seq_len + 1)` int32.
    """

    options: Any
    layout: Layout
    model: gpt.GPT
    engine: StageEngine
    optimizer: optax.GradientTransformation
    schedule: Callable
    finish: Callable
    rank: int
    train_step: PipelineStep
    activation_plan: None = None

    def init_state(self):
        """This stage's parameters, initialized exactly as the whole model's are (same key, same
        values), and its optimizer state."""
        o = self.options
        dummy = jnp.zeros((1, o.seq_len), jnp.int32)

        def init(key):
            params = nn.unbox(self.model.init(key, dummy)["params"])
            mine = stage_params(params, self.layout, self.model.config.num_layers)
            return offload_opt.initial_state(mine, optimizer=self.optimizer, offloaded=None,
                                             dtype=o.dtype)

        return jax.jit(init)(jax.random.key(o.seed))

    def batch(self, tokens: np.ndarray, step: int, seed_offset: int = 0) -> jax.Array:
        """Rows `[d·b, (d+1)·b)` (b = global batch / D) of global batch `step`, on this process's
        device."""
        o = self.options
        offsets = data_lib.batch_offsets(len(tokens), o.seed + seed_offset, step, o.batch_size,
                                         o.seq_len)
        mine = offsets.reshape(self.layout.num_groups, -1)[self.layout.group]
        return jnp.asarray(data_lib.batch_rows(tokens, mine, o.seq_len))

    def eval_loss(self, params, batch) -> jax.Array:
        """Mean loss of the global batch (all pipelines), on every process."""
        loss = self.engine.run_forward(params, batch)
        return _mean_loss(self.layout)(loss)

    def checkpointer(self, directory: str, every: int = 0):
        """Each stage's state in its own subdirectory `stage-s-of-S`, written by the stage's
        process in data group 0 and read by every copy of the stage."""
        from .mpi import RankZeroCheckpointer

        path = pathlib.Path(directory) / f"stage-{self.layout.stage}-of-{self.layout.num_stages}"
        return RankZeroCheckpointer(path, every, comm=self.layout.data_comm)


def _mean_loss(layout: Layout) -> Callable:
    import mpi4jax
    from mpi4py import MPI

    @jax.jit
    def mean(loss):
        loss = mpi4jax.allreduce(loss, op=MPI.SUM, comm=layout.pipe_comm)
        return mpi4jax.allreduce(loss, op=MPI.SUM, comm=layout.data_comm) / layout.num_groups

    return mean


def refused(options) -> str | None:
    """The option of `options` this path does not run, spelled as a flag, or None."""
    c = options.parallel
    for flag, used in (("--row/--col/--depth", c.tensor_parallel_size > 1),
                       (f"--data-parallel {c.data} (more than one device per process)", c.data > 1),
                       (f"--dtype {options.dtype}", options.dtype != "float32"),
                       ("--offload-optimizer", options.offload_optimizer),
                       (f"--remat {options.remat}", options.remat != "none"),
                       ("--memory-budget", options.memory_budget_gb is not None),
                       (f"--compress-bits {options.compress_bits}", options.compress_bits),
                       ("--sample-tokens", options.sample_tokens)):
        if used:
            return flag
    return None


def build_pipeline_trainer(options, comm) -> MpiPipelineTrainer:
    """The trainer of this process in a `--transport mpi --pipe S` job over the processes of `comm`."""
    if flag := refused(options):
        raise NotImplementedError(f"{flag} with --transport mpi --pipe > 1 is not implemented yet")
    num_stages, m = options.parallel.pipe, options.microbatches
    layout = make_layout(comm, num_stages)
    config = gpt.get_config(options.model)
    if options.seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {options.seq_len} exceeds {options.model}'s max_seq_len "
                         f"{config.max_seq_len}")
    pipeline_lib.check_layers(config.num_layers, num_stages)
    if m < 1 or options.batch_size % (layout.num_groups * m):
        raise ValueError(f"--batch-size {options.batch_size} is not divisible by data groups × "
                         f"microbatches = {layout.num_groups} × {m}")
    model = gpt.GPT(config, dtype=DTYPES[options.dtype])
    engine = StageEngine(model, layout, options.schedule, m, options.seq_len,
                         options.batch_size // layout.num_groups)
    adamw, schedule = make_adamw(options)
    finish = make_finish(layout, adamw, options.clip_norm, schedule)
    return MpiPipelineTrainer(options, layout, model, engine, adamw, schedule, finish,
                              rank=comm.Get_rank(), train_step=PipelineStep(engine, finish))
