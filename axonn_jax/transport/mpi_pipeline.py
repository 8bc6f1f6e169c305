"""AxoNN's message-driven pipeline over MPI: `mpirun -n S·D axonn-jax train --transport mpi --pipe S`.

One process per pipeline stage. Rank `r = d·S + s` runs stage `s` of pipeline `d` (D data-parallel
copies of an S-stage pipeline); it holds only its `L/S` blocks, plus the embedding on the first stage
and the final norm and head on the last, and the optimizer state of exactly those parameters.

A step, on each process:

1. A host loop runs the stage's forward (F) and backward (B) operations for the M microbatches
   (`StageEngine`, the train step's gradient phase: `step.make_train_step(..., engine=...)`). Each
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
3. One jitted program finishes the step (`step.hosted`): the data-parallel mean of the gradients and
   the loss over the D copies of this stage (`transport.mpi.mpi_mean` over the stage's
   communicator), the squared gradient norm and the loss summed over the S stages (the loss is
   nonzero only on the last stage), then the shared update (`step.update`: clipping and the
   optimizer) on this stage's parameters.

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
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..parallel import pipeline as pipeline_lib
from .mpi import allreduce_sum, mpi_mean

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
class StagePosition:
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


def stage_position(comm, num_stages: int) -> StagePosition:
    """Split `comm` (size S·D) into pipelines of `num_stages` consecutive ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if num_stages < 2 or size % num_stages:
        raise ValueError(f"--transport mpi --pipe {num_stages} needs a multiple of {num_stages} MPI "
                         f"processes (one per stage, times data-parallel copies), got {size}")
    group, stage = divmod(rank, num_stages)
    return StagePosition(stage, num_stages, group, size // num_stages,
                         comm.Split(color=group, key=stage), comm.Split(color=stage, key=group))


def mpi_pipeline(position: StagePosition, schedule: str, num_microbatches: int):
    """`(reducer, engine)` for `step.make_train_step`: the mean over the data-parallel copies of
    this stage, and the factory of this process's `StageEngine`."""
    pipeline_lib.make_schedule(schedule, position.num_stages, num_microbatches)  # checks the name
    return mpi_mean(position.data_comm), PipelineEngine(position, schedule, num_microbatches)


@dataclasses.dataclass(frozen=True)
class PipelineEngine:
    """Builds this process's `StageEngine` for the step's model functions; `batch_share`: this
    pipeline trains on rows [g·B/D, (g+1)·B/D) of each global batch of B rows."""

    position: StagePosition
    schedule: str
    num_microbatches: int

    @property
    def batch_share(self) -> tuple[int, int]:
        return self.position.group, self.position.num_groups

    def __call__(self, functions, groups, batch) -> "StageEngine":
        return StageEngine(functions, groups, batch, self.position, self.schedule,
                           self.num_microbatches)


class StageEngine:
    """The jitted operations of one stage and the message-driven loop that runs them: the gradient
    phase of this process's train step.

    functions: the model's `step.model.ModelFunctions`; batch: the abstract batch of this pipeline
    (`b` rows), cut into M microbatches of `b/M` rows; activations `(b/M, ...)` like the
    embedding's output.
    """

    def __init__(self, functions, groups, batch, position: StagePosition, schedule: str,
                 num_microbatches: int):
        import mpi4jax

        if functions.model.head_reads_embed:
            # The first and last stages would each hold the table and sum its two gradients.
            raise NotImplementedError("a head that reads the embedding's parameters (tied "
                                      "embeddings) with --transport mpi --pipe > 1 is not "
                                      "implemented yet")
        self.position, self.schedule, self.m = position, schedule, num_microbatches
        self.comm = position.pipe_comm
        s, m, pos = position.stage, num_microbatches, position
        rows = jax.tree.leaves(batch)[0].shape[0]
        self.layers = pipeline_lib.check_layers(functions.model.num_layers, position.num_stages)
        if rows % m:
            raise ValueError(f"the {rows} rows of a pipeline's batch are not divisible by "
                             f"microbatches = {m}")
        mb_rows = rows // m
        x = functions.activation
        act = jnp.zeros((mb_rows, *x.shape[1:]), x.dtype)
        comm = self.comm
        stage_groups = None if groups is None else ((self.layers, groups[0][1]),)

        def microbatch(batch, mb):
            return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, mb * mb_rows, mb_rows),
                                batch)

        def apply(p, x, mb_batch):
            """Stage input (the batch on the first stage) -> output (the loss on the last)."""
            if pos.first:
                x = functions.embed(p["embed"], mb_batch)
            y = functions.run_blocks(p["blocks"], x, stage_groups)
            if pos.last:
                return functions.head(p["head"], y, mb_batch).astype(jnp.float32)
            return y

        def recv(kind):
            source = s - 1 if kind == ACT else s + 1
            return mpi4jax.recv(jnp.zeros_like(act), source, comm=comm)

        def forward(params, batch, mb):
            """F: (stashed stage input, output to send). The last stage only receives: its
            backward recomputes the forward."""
            mb_batch = microbatch(batch, mb)
            x = mb_batch if pos.first else recv(ACT)
            return x, (None if pos.last else apply(params, x, mb_batch))

        def backward(params, grads, loss, x, batch, mb):
            """B: (gradients + this microbatch's, loss + its share, input gradient to send)."""
            mb_batch = microbatch(batch, mb)
            if pos.first:  # the input is the batch: differentiate the parameters only
                out, vjp = jax.vjp(lambda p: apply(p, None, mb_batch), params)
            else:
                out, vjp = jax.vjp(lambda p, x_: apply(p, x_, mb_batch), params, x)
            g_out = jnp.full((), 1.0 / m, out.dtype) if pos.last else recv(GRAD)
            g = vjp(g_out)
            grads = jax.tree.map(jnp.add, grads, g[0])
            if pos.last:
                loss = loss + out / m
            return grads, loss, (None if pos.first else g[1])

        def evaluate(params, loss, batch, mb):
            """Forward only: (loss + this microbatch's share on the last stage, output to send)."""
            x, y = forward(params, batch, mb)
            if pos.last:
                return loss + apply(params, x, microbatch(batch, mb)) / m, None
            return loss, y

        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward, donate_argnums=(1, 2))
        self.evaluate = jax.jit(evaluate, donate_argnums=1)

    def stage_params(self, params: dict) -> dict:
        """This stage's part of the model's parameters: its slice of the stacked blocks, plus the
        embedding on the first stage and the head on the last."""
        lo = self.position.stage * self.layers
        mine = {"blocks": jax.tree.map(lambda x: x[lo:lo + self.layers], params["blocks"])}
        if self.position.first:
            mine["embed"] = params["embed"]
        if self.position.last:
            mine["head"] = params["head"]
        return mine

    def sum_over_stages(self, x):
        """`x` summed over the stages of this pipeline (traceable)."""
        return allreduce_sum(x, self.position.pipe_comm)

    def reduce_metrics(self, extra: dict) -> dict:
        """The engine's metrics over the pipeline: the most stage inputs any stage held, the
        operations its stages ran out of the static order (traceable)."""
        import mpi4jax
        from mpi4py import MPI

        comm = self.position.pipe_comm
        return {"stash_peak": mpi4jax.allreduce(extra["stash_peak"], op=MPI.MAX, comm=comm),
                "reordered_ops": allreduce_sum(extra["reordered_ops"], comm)}

    def _ready(self, op: tuple[str, int]) -> bool:
        kind, mb = op
        if kind == "F":
            return self.position.first or self.comm.Iprobe(source=self.position.stage - 1,
                                                           tag=tag(ACT, mb))
        return self.position.last or self.comm.Iprobe(source=self.position.stage + 1,
                                                      tag=tag(GRAD, mb))

    def _send(self, sends: list, y, kind: int, mb: int):
        buf = np.asarray(y)  # kept alive with its request until the send completes
        dest = self.position.stage + 1 if kind == ACT else self.position.stage - 1
        sends.append((self.comm.Isend(buf, dest=dest, tag=tag(kind, mb)), buf))

    @staticmethod
    def _complete(sends: list, wait: bool = False) -> list:
        from mpi4py import MPI

        if wait:
            MPI.Request.Waitall([r for r, _ in sends])
            return []
        return [(r, b) for r, b in sends if not r.Test()]

    def run(self, params, batch) -> tuple[jax.Array, Any, dict]:
        """Forwards and backwards of every microbatch, each as soon as its message is there and the
        schedule permits. Returns (mean microbatch loss (0 except on the last stage), summed
        gradients like `params`, {'stash_peak': most stage inputs stashed at once,
        'reordered_ops': operations run earlier than the static schedule would have (a message
        arrived before the one the static order waits for)})."""
        s, p, m = self.position.stage, self.position.num_stages, self.m
        static = pipeline_lib.stage_order(self.schedule, p, m, s, lockstep=False)
        reordered = 0
        grads = jax.tree.map(jnp.zeros_like, params)
        loss = jnp.zeros((), jnp.float32)
        stash: dict[int, Any] = {}
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
        return loss, grads, {"stash_peak": peak, "reordered_ops": reordered}

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

    def inspect(self, state, batch):
        """This stage's backward operation compiled (its largest program: it holds the recomputed
        stage's activations), for `as_text` / `memory_analysis`."""
        params = state["params"]
        x = jax.eval_shape(self.forward, params, batch, np.int32(0))[0]
        return self.backward.lower(params, params, jnp.zeros((), jnp.float32), x, batch,
                                   np.int32(0)).compile()
