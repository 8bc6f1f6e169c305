"""AxoNN's message-driven pipeline over MPI.

Launched as `mpirun -n S·D axonn-jax train --transport mpi --pipe S`.

One process per pipeline stage. Rank `r = d·S + s` runs stage `s` of pipeline `d` (D data-parallel
copies of an S-stage pipeline); it holds only its layers (`L/S` of them, as V chunks of `L/(S·V)`
with `--schedule interleaved-1f1b --virtual-stages V`), plus the embedding on the first stage and
the final norm and head on the last, and the optimizer state of exactly those parameters.

A step, on each process:

1. A host loop runs the stage's operations for the M microbatches (`StageEngine`, the train step's
   gradient phase: `step.make_train_step(..., engine=...)`): forwards (F), backwards (B) and, for
   `zb-h1`, weight-gradient operations (W). Each is one `jax.jit` program on this process's
   device, computing in the step's dtype with the step's (parameter-casting) stage functions:
   F "run the chunk on the received activation", B "recompute the chunk forward and take its vjp
   at the received output gradient (or at the loss, times the loss scale, on the last virtual
   stage), accumulate the parameter gradients", or with `zb-h1` B "… take the input gradient
   only" and W "the parameter gradients from B's residuals" (`parallel.backward_split`).
   The loop is message-driven, as in AxoNN: `permitted` says which operations the schedule allows
   next (at most one F, one B and one W), `comm.Iprobe` says whose message has arrived, and the
   stage runs whichever is ready; when both an F and a B are, the one the static order runs first.
   A W never waits for a message: it runs when nothing else is ready (filling what would be idle
   time), when the stage may not start another forward until a W frees a microbatch, and at the
   end. The first virtual stage's forwards need no message (it embeds the tokens), nor the last
   one's backwards (its loss is local).
2. Messages are host buffers: an output is copied to the host and sent with a non-blocking
   `MPI_Isend` (mpi4py), completed before the step ends; a message that `Iprobe` found is received
   with `MPI_Recv` into a host buffer and put on the device. (mpi4jax 0.9 has only a blocking
   `send`: stage s sending an activation to s+1 while s+1 sends a gradient to s deadlocks once the
   messages are large enough for MPI's rendezvous protocol (4 MB both ways hangs under MPICH;
   measured), which 1F1B does in its steady state.) Buffers travel as bytes, so any dtype
   (bfloat16 included) goes as it is. Activations and gradients travel on communicators of their
   own, so a receive takes the next message of its kind from that neighbour even when the same
   neighbour sends both kinds (two stages with interleaved chunks).
3. One jitted program finishes the step (`step.hosted`): the data-parallel mean of the gradients and
   the loss over the D copies of this stage (`transport.mpi.mpi_mean` over the stage's
   communicator), the squared gradient norm and the loss summed over the S stages (the loss is
   nonzero only on the last stage), then the shared update (`step.update`: clipping, loss scale
   and the optimizer) on this stage's parameters.

The backward recomputes the chunk forward from the stashed chunk input, like the in-process engine
(parallel/pipeline.py). With `1f1b` a stage s starts a forward only while fewer than S − s
microbatches are in flight, so no stage ever holds more than S stashed inputs, whatever M is;
`gpipe` runs all M forwards before any backward; `interleaved-1f1b` allows (V−1)·S + S − s chunk
inputs; `zb-h1` paces forwards like 1F1B and keeps at most S microbatches between their forward and
their W on any stage (1F1B's peak), as ZB-H1 does. Send buffers are bounded the same way.

Messages are tagged `microbatch · S·V + receiving virtual stage`. Each stage receives activations
only from its predecessor on the ring and gradients only from its successor, in the order both
run them, and MPI does not let messages from one sender overtake each other on a communicator, so
`Iprobe` for the exact tag tells that the next message is there.

Not implemented: tensor-parallel stages (several devices per process). mpi4jax works on single-
device arrays, and this step's reductions over MPI (the gradient mean, and the squared gradient
norm summed over stages inside the update, for clipping) run inside one program with the update;
with a stage on a local mesh they must move to the process's first device between the gradient
phase and an update on the mesh, as `step.hosted.process_programs` does for data parallelism,
and the update must take the global norm from outside. `run.trainer` refuses the combination.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..parallel import pipeline as pipeline_lib
from ..parallel.backward_split import split_backward
from .mpi import allreduce_sum, mpi_mean

ACT, GRAD = 0, 1  # message kinds: activation forward, its gradient backward


def tag(microbatch: int, virtual_stage: int, num_virtual: int) -> int:
    """The tag of a message to `virtual_stage` about `microbatch` (its kind is its communicator).

    Args:
      microbatch: the microbatch's index.
      virtual_stage: the receiving virtual stage (chunk × stages + stage).
      num_virtual: virtual stages of the pipeline.

    Returns:
      `microbatch × num_virtual + virtual_stage`.
    """
    return microbatch * num_virtual + virtual_stage


def permitted(schedule: str, num_stages: int, num_microbatches: int, stage: int,
              forwards: int, backwards: int, weights: int = 0,
              virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """The operations `(kind, microbatch, chunk)` stage `stage` may run next.

    After `forwards` forwards, `backwards` backwards and `weights` weight-gradient operations: at
    most one of each kind, an F and a B in the order the static schedule runs them, a W last. Each
    kind goes through its operations in the order of `parallel.pipeline.stage_order`
    (asynchronous warm-up).

    gpipe: every forward, then every backward. 1f1b / zb-h1: a backward once its forward ran, a
    forward while fewer than `num_stages − stage` microbatches are in flight (the static order's
    warm-up + 1), which bounds a stage's stashed inputs by `num_stages`; interleaved-1f1b: likewise
    with its (longer) warm-up, in chunk operations. zb-h1: a W of each microbatch whose B ran, and
    no forward while `num_stages` microbatches wait for their W.

    Args:
      schedule: `gpipe`, `1f1b`, `interleaved-1f1b` or `zb-h1`.
      num_stages: the pipeline's stages.
      num_microbatches: microbatches per step.
      stage: this stage.
      forwards: forward operations run so far.
      backwards: backward operations run so far.
      weights: weight-gradient operations run so far (zb-h1).
      virtual_stages: chunks per stage (interleaved-1f1b).

    Returns:
      The permitted operations, F and B in static order, W last.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    kind = pipeline_lib.schedule_kind(schedule)
    order = pipeline_lib.stage_order(schedule, p, m, stage, lockstep=False, virtual_stages=v)
    f_ops = [op for op in order if op[0] == "F"]
    b_ops = [op for op in order if op[0] == "B"]
    in_flight = forwards - backwards
    # In flight at most: the forwards the static order runs before its first backward.
    limit = m if kind.flush else next(i for i, op in enumerate(order) if op[0] == "B")
    ops = []
    if forwards < m * v and in_flight < limit and (not kind.split_backward or forwards - weights < p):
        ops.append(f_ops[forwards])
    if backwards < m * v and (not kind.flush or forwards == m):
        b = b_ops[backwards]
        if f_ops.index(("F", *b[1:])) < forwards:  # its forward ran
            ops.append(b)
    if len(ops) == 2:
        ops.sort(key=order.index)
    if kind.split_backward and weights < backwards:
        ops.append(("W", *b_ops[weights][1:]))
    return ops


@dataclasses.dataclass(frozen=True)
class StagePosition:
    """Where this process sits: its stage, its data group, and their communicators.

    Stage `stage` of `num_stages`, data group `group` of `num_groups`; `pipe_comm` joins the
    stages of its pipeline (rank = stage), `data_comm` the copies of its stage (rank = group).
    """

    stage: int
    num_stages: int
    group: int
    num_groups: int
    pipe_comm: Any
    data_comm: Any

    @property
    def first(self) -> bool:
        """Whether this is the first stage (it holds the embedding)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this is the last stage (it holds the head and computes the loss)."""
        return self.stage == self.num_stages - 1


def runs_stages(grid) -> bool:
    """Whether `--transport mpi` runs `grid` as this engine does: a process per pipeline stage.

    Args:
      grid: the run's `ParallelConfig`.

    Returns:
      True with more than one stage (else the processes split `data`, each running the whole
      step on its devices).
    """
    return grid.pipe > 1


def stage_position(comm, num_stages: int) -> StagePosition:
    """Split `comm` (size S·D) into pipelines of `num_stages` consecutive ranks.

    Args:
      comm: an MPI communicator of S·D processes.
      num_stages: S, at least 2.

    Returns:
      This process's `StagePosition`.

    Raises:
      ValueError: fewer than 2 stages, or a size that is not a multiple of `num_stages`.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if num_stages < 2 or size % num_stages:
        raise ValueError(f"--transport mpi --pipe {num_stages} needs a multiple of {num_stages} MPI "
                         f"processes (one per stage, times data-parallel copies), got {size}")
    group, stage = divmod(rank, num_stages)
    return StagePosition(stage, num_stages, group, size // num_stages,
                         comm.Split(color=group, key=stage), comm.Split(color=stage, key=group))


def mpi_pipeline(position: StagePosition, schedule: str, num_microbatches: int,
                 virtual_stages: int = 1):
    """`(reducer, engine)` for `step.make_train_step`.

    Args:
      position: this process's `StagePosition`.
      schedule: the pipeline schedule (`config.SCHEDULES`).
      num_microbatches: microbatches per step.
      virtual_stages: chunks per stage (interleaved-1f1b).

    Returns:
      The mean over the data-parallel copies of this stage, and the factory of this process's
      `StageEngine`.

    Raises:
      ValueError: the schedule cannot run these stages and microbatches.
    """
    pipeline_lib.check_schedule(schedule, position.num_stages, num_microbatches, virtual_stages)
    return mpi_mean(position.data_comm), PipelineEngine(position, schedule, num_microbatches,
                                                        virtual_stages)


@dataclasses.dataclass(frozen=True)
class PipelineEngine:
    """Builds this process's `StageEngine` for a bound train step.

    `batch_share`: this pipeline trains on rows [g·B/D, (g+1)·B/D) of each global batch of B rows.
    """

    position: StagePosition
    schedule: str
    num_microbatches: int
    virtual_stages: int = 1

    @property
    def batch_share(self) -> tuple[int, int]:
        """(this pipeline's data group g, the number of groups D)."""
        return self.position.group, self.position.num_groups

    def __call__(self, bound) -> "StageEngine":
        return StageEngine(bound, self.position, self.schedule, self.num_microbatches,
                           self.virtual_stages)


class StageEngine:
    """The jitted operations of one stage and the message-driven loop that runs them.

    The gradient phase of this process's train step.

    bound: the train step bound to this pipeline's batch shape (`step.train_step.BoundStep`: its
    `compute` functions, which cast the parameters to the compute dtype, and its abstract batch of
    `b` rows, cut into M microbatches of `b/M` rows); activations `(b/M, ...)` like the
    embedding's output.
    """

    def __init__(self, bound, position: StagePosition, schedule: str, num_microbatches: int,
                 virtual_stages: int = 1):
        if bound.fns.model.head_reads_embed:
            # The first and last stages would each hold the table and sum its two gradients.
            raise NotImplementedError("a head that reads the embedding's parameters (tied "
                                      "embeddings) with --transport mpi --pipe > 1 is not "
                                      "implemented yet")
        self.position, self.schedule, self.m = position, schedule, num_microbatches
        self.split_backward = pipeline_lib.schedule_kind(schedule).split_backward
        self.v = virtual_stages
        self.comms = {ACT: position.pipe_comm.Dup(), GRAD: position.pipe_comm.Dup()}
        model = bound.model
        self.layers = pipeline_lib.check_layers(model.num_layers, position.num_stages)
        self.n = pipeline_lib.check_layers(model.num_layers, position.num_stages, self.v)
        batch = bound.batch
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % num_microbatches:
            raise ValueError(f"the {rows} rows of a pipeline's batch are not divisible by "
                             f"microbatches = {num_microbatches}")
        self.mb_rows = rows // num_microbatches
        compute = bound.compute
        embed, stage_fn, head = compute.embed, compute.stage(self.n), compute.head
        self._fns = embed, stage_fn, head
        mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.mb_rows, *a.shape[1:]), a.dtype),
                          batch)
        self.act = jax.eval_shape(embed, jax.eval_shape(bound.fns.init, jax.random.key(0))["embed"],
                                  mb)
        self._programs: dict = {}
        self._splits: dict = {}

    # ------------------------------------------------------------------ the stage's functions

    def _virtual(self, chunk: int) -> tuple[bool, bool]:
        """Whether chunk `chunk` of this stage is the first / the last virtual stage."""
        pos = self.position
        return pos.first and chunk == 0, pos.last and chunk == self.v - 1

    def _chunk(self, p, c):
        """The stage parameters with `blocks` cut to chunk c's layers."""
        n = self.n
        return {**p, "blocks": jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * n, n),
                                            p["blocks"])}

    def _apply(self, prm, x, mb_batch, first: bool, last: bool):
        """A chunk's input (the batch when `first`) -> (output (the loss when `last`), the
        chunk's auxiliary loss); prm: the stage's parameters with one chunk's `blocks`
        (`_chunk`)."""
        embed, stage_fn, head = self._fns
        if first:
            x = embed(prm["embed"], mb_batch)
        y, extra, _ = stage_fn(prm["blocks"], x, mb_batch)
        return (head(prm["head"], y, mb_batch) + extra if last else y), extra

    def _microbatch(self, batch, mb):
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, mb * self.mb_rows,
                                                                   self.mb_rows), batch)

    def _backward_fn(self, first: bool, last: bool):
        """(p, x, mb_batch, c, cot, scale) -> (input gradient, loss share, gradients of the
        parameters of chunk c (`_chunk`))."""
        m = self.m

        def backward(p, x, mb_batch, c, cot, scale):
            prm = self._chunk(p, c)
            if first:  # the input is the batch: differentiate the parameters only
                (out, extra), vjp = jax.vjp(lambda q: self._apply(q, None, mb_batch, True, last),
                                            prm)
            else:
                (out, extra), vjp = jax.vjp(
                    lambda q, x_: self._apply(q, x_, mb_batch, False, last), prm, x)
            weight = (scale / m).astype(jnp.float32)
            # The loss (with the chunk's auxiliary loss) on the last stage, the auxiliary loss
            # elsewhere, each weighted scale / M.
            g_out = weight.astype(out.dtype) if last else cot
            g = vjp((g_out, jnp.zeros_like(extra) if last else weight))
            g_x = jnp.zeros((), jnp.float32) if first else g[1]
            share = out.astype(jnp.float32) if last else extra.astype(jnp.float32)
            return g_x, share / m, g[0]

        return backward

    def _accumulate(self, grads, updates: dict, c):
        """grads + updates {flat leaf index of the stage's parameters: gradient}: `blocks` leaves
        (chunk c's gradients) go to the chunk's rows of the stage's layer stack."""
        paths, tree = jax.tree_util.tree_flatten_with_path(grads)
        flat = [x for _, x in paths]
        for i, g in updates.items():
            if getattr(paths[i][0][0], "key", None) == "blocks":
                old = jax.lax.dynamic_slice_in_dim(flat[i], c * self.n, self.n)
                flat[i] = jax.lax.dynamic_update_slice_in_dim(flat[i], old + g, c * self.n, 0)
            else:
                flat[i] = flat[i] + g
        return jax.tree.unflatten(tree, flat)

    def _program(self, kind: str, first: bool, last: bool, params=None, batch=None):
        """The jitted operation `kind` of a virtual stage that is `first` / `last` (built once)."""
        key = kind, first, last
        if key in self._programs:
            return self._programs[key]
        if kind == "F":
            def forward(p, x, batch, mb, c):
                return self._apply(self._chunk(p, c), x, self._microbatch(batch, mb), first, last)[0]

            program = jax.jit(forward)
        elif kind == "B" and not self.split_backward:
            backward = self._backward_fn(first, last)

            def full(p, grads, loss, x, batch, mb, c, cot, scale):
                g_x, share, g_p = backward(p, x, self._microbatch(batch, mb), c, cot, scale)
                grads = self._accumulate(grads, dict(enumerate(jax.tree.leaves(g_p))), c)
                return grads, loss + share, g_x

            program = jax.jit(full, donate_argnums=(1, 2))
        else:
            split = self._split(first, last, params, batch)
            if kind == "B":
                def input_part(p, grads, loss, x, batch, mb, c, cot, scale):
                    (g_x, share), early, residuals = split.b(
                        p, x, self._microbatch(batch, mb), c, cot, scale)
                    grads = self._accumulate(grads, dict(zip(split.early_index, early)), c)
                    return grads, loss + share, g_x, residuals

                program = jax.jit(input_part, donate_argnums=(1, 2))
            else:
                def weight_part(p, grads, c, residuals):
                    late = split.w((p,), residuals)
                    return self._accumulate(grads, dict(zip(split.late_index, late)), c)

                program = jax.jit(weight_part, donate_argnums=(1,))
        self._programs[key] = program
        return program

    def _split(self, first: bool, last: bool, params, batch):
        """The B/W split of this virtual stage's backward (traced at the parameters' shapes)."""
        key = first, last
        if key not in self._splits:
            shape = lambda t: jax.tree.map(  # noqa: E731
                lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), t)
            mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.mb_rows, *a.shape[1:]),
                                                             a.dtype), batch)
            # No input on the first virtual stage, no output cotangent on the last (as in `run`).
            example = (shape(params), None if first else self.act, mb,
                       jax.ShapeDtypeStruct((), jnp.int32), None if last else self.act,
                       jax.ShapeDtypeStruct((), jnp.float32))
            self._splits[key] = split_backward(
                self._backward_fn(first, last), example, w_free=(True,) + (False,) * 5,
                num_b_outputs=2)
        return self._splits[key]

    # ------------------------------------------------------------------ parameters, reductions

    def stage_params(self, params: dict) -> dict:
        """This stage's part of the model's parameters (in the model's layer order).

        Args:
          params: the whole model's parameters (`blocks` stacked over all layers, `embed`,
            `head`).

        Returns:
          Its layers, chunk by chunk (`parallel.pipeline.interleave_order`), plus the embedding
          on the first stage and the head on the last.
        """
        lo = self.position.stage * self.layers
        layers = jax.tree.leaves(params["blocks"])[0].shape[0]
        index = pipeline_lib.interleave_order(layers, self.position.num_stages, self.v)
        index = index[lo:lo + self.layers]
        mine = {"blocks": jax.tree.map(lambda x: x[index], params["blocks"])}
        if self.position.first:
            mine["embed"] = params["embed"]
        if self.position.last:
            mine["head"] = params["head"]
        return mine

    def sum_over_stages(self, x):
        """`x` summed over the stages of this pipeline (traceable).

        Args:
          x: a pytree of arrays on this process's device.

        Returns:
          The sum over the pipeline's processes.
        """
        return allreduce_sum(x, self.position.pipe_comm)

    def reduce_metrics(self, extra: dict) -> dict:
        """The engine's metrics over the pipeline (traceable).

        Args:
          extra: this stage's `stash_peak` and `reordered_ops` (`run`'s third result).

        Returns:
          The most chunk inputs any stage held, and the operations its stages ran out of the
          static order, summed.
        """
        import mpi4jax
        from mpi4py import MPI

        comm = self.position.pipe_comm
        return {"stash_peak": mpi4jax.allreduce(extra["stash_peak"], op=MPI.MAX, comm=comm),
                "reordered_ops": allreduce_sum(extra["reordered_ops"], comm)}

    # ------------------------------------------------------------------ messages

    def _peer(self, kind: int) -> int:
        s, p = self.position.stage, self.position.num_stages
        return (s - 1) % p if kind == ACT else (s + 1) % p

    def _needs_message(self, op) -> tuple[int, int] | None:
        """(kind, tag) of the message operation `op` waits for, or None."""
        kind, mb, c = op
        p, v = self.position.num_stages, self.v
        j = c * p + self.position.stage
        if kind == "F" and j > 0:
            return ACT, tag(mb, j, p * v)
        if kind == "B" and j < p * v - 1:
            return GRAD, tag(mb, j, p * v)
        return None

    def _ready(self, op) -> bool:
        need = self._needs_message(op)
        return need is None or self.comms[need[0]].Iprobe(source=self._peer(need[0]), tag=need[1])

    def _receive(self, op):
        from mpi4py import MPI

        kind, t = self._needs_message(op)
        buf = np.empty(self.act.shape, self.act.dtype)
        self.comms[kind].Recv([buf.view(np.uint8), MPI.BYTE], source=self._peer(kind), tag=t)
        return jax.device_put(buf, jax.local_devices()[0])

    def _send(self, sends: list, y, kind: int, mb: int, to_virtual: int):
        from mpi4py import MPI

        buf = np.ascontiguousarray(np.asarray(y))  # kept alive with its request until sent
        dest = (self.position.stage + (1 if kind == ACT else -1)) % self.position.num_stages
        request = self.comms[kind].Isend([buf.view(np.uint8), MPI.BYTE], dest=dest,
                                         tag=tag(mb, to_virtual, self.position.num_stages * self.v))
        sends.append((request, buf))

    @staticmethod
    def _complete(sends: list, wait: bool = False) -> list:
        from mpi4py import MPI

        if wait:
            MPI.Request.Waitall([r for r, _ in sends])
            return []
        return [(r, b) for r, b in sends if not r.Test()]

    # ------------------------------------------------------------------ the step

    def run(self, params, batch, scale=None) -> tuple[jax.Array, Any, dict]:
        """Run every operation of every microbatch, each once its message is there and permitted.

        Args:
          params: this stage's parameters (`stage_params`).
          batch: this pipeline's batch.
          scale: the loss scale (None: 1).

        Returns:
          (mean microbatch loss (0 except on the last stage), summed gradients like `params`
          (scaled by `scale`), {'stash_peak': most chunk inputs stashed at once,
          'reordered_ops': forwards and backwards run earlier than the static order would have
          (a message arrived before the one the static order waits for)}).
        """
        s, p, m, v = self.position.stage, self.position.num_stages, self.m, self.v
        scale = jnp.float32(1.0) if scale is None else scale
        static = pipeline_lib.stage_order(self.schedule, p, m, s, lockstep=False, virtual_stages=v)
        grads = jax.tree.map(jnp.zeros_like, params)
        loss = jnp.zeros((), jnp.float32)
        stash: dict = {}
        residuals: dict = {}
        sends: list = []
        done = {"F": 0, "B": 0, "W": 0}
        reordered = peak = idle = 0
        while done["B"] < m * v or done["W"] < (m * v if self.split_backward else 0):
            ops = permitted(self.schedule, p, m, s, done["F"], done["B"], done["W"], v)
            op = next((o for o in ops if self._ready(o)), None)
            if op is None:  # nothing has arrived: let the sends progress, then look again
                sends = self._complete(sends)
                time.sleep(min(1e-3, 1e-5 * 2 ** min(idle, 7)))
                idle += 1
                continue
            idle = 0
            kind, mb, c = op
            first, last = self._virtual(c)
            j = c * p + s
            if kind != "W":
                reordered += op != static[done["F"] + done["B"]]
            args = (np.int32(mb), np.int32(c))
            if kind == "F":
                x = None if first else self._receive(op)
                stash[mb, c] = x
                peak = max(peak, len(stash))
                if not last:
                    y = self._program("F", first, last)(params, x, batch, *args)
                    self._send(sends, y, ACT, mb, j + 1)
            elif kind == "B":
                cot = None if last else self._receive(op)
                out = self._program("B", first, last, params, batch)(
                    params, grads, loss, stash.pop((mb, c)), batch, *args, cot, scale)
                grads, loss, g_x = out[:3]
                if len(out) == 4:
                    residuals[mb, c] = out[3]
                if not first:
                    self._send(sends, g_x, GRAD, mb, j - 1)
            else:
                grads = self._program("W", first, last, params, batch)(
                    params, grads, np.int32(c), residuals.pop((mb, c)))
            done[kind] += 1
        self._complete(sends, wait=True)
        return loss, grads, {"stash_peak": peak, "reordered_ops": reordered}

    def run_forward(self, params, batch) -> jax.Array:
        """The forward of every microbatch (evaluation), in the static order of forwards.

        Receives block: only activations flow, so nothing waits on this stage.

        Args:
          params: this stage's parameters (`stage_params`).
          batch: this pipeline's batch.

        Returns:
          The mean loss on the last stage, 0 elsewhere.
        """
        s, p, m, v = self.position.stage, self.position.num_stages, self.m, self.v
        order = [op for op in pipeline_lib.stage_order(self.schedule, p, m, s, lockstep=False,
                                                       virtual_stages=v) if op[0] == "F"]
        loss = jnp.zeros((), jnp.float32)
        sends: list = []
        for op in order:
            _, mb, c = op
            first, last = self._virtual(c)
            x = None if first else self._receive(op)
            y = self._program("F", first, last)(params, x, batch, np.int32(mb), np.int32(c))
            if last:
                loss = loss + y.astype(jnp.float32) / m
            else:
                self._send(sends, y, ACT, mb, c * p + s + 1)
        self._complete(sends, wait=True)
        return loss

    def inspect(self, state, batch):
        """This stage's backward operation of its first chunk, compiled.

        Its largest program: it holds the recomputed chunk's activations.

        Args:
          state: a train state (its `params`: this stage's).
          batch: this pipeline's batch.

        Returns:
          The `jax.stages.Compiled`, for `as_text` / `memory_analysis`.
        """
        params = state.params
        first, last = self._virtual(0)
        x = None if first else jnp.zeros(self.act.shape, self.act.dtype)
        cot = None if last else jnp.zeros(self.act.shape, self.act.dtype)
        program = self._program("B", first, last, params, batch)
        return program.lower(params, params, jnp.zeros((), jnp.float32), x, batch, np.int32(0),
                             np.int32(0), cot, jnp.float32(1.0)).compile()
