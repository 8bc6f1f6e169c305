"""Train steps whose phases run as separate programs, driven from the host.

Two kinds: a gradient reducer between processes (MPI, `transport.mpi`) and a host-driven gradient
phase (the message-driven MPI pipeline, `transport.mpi_pipeline`).

mpi4jax works on process-local, single-device arrays and its ordered effects cannot run in a program
that spans several devices, so the exchange runs on the first device of the process, between the
local gradient program and the update on the local mesh. The programs stay `jax.jit` functions: an
ahead-of-time compiled program with mpi4jax's ordered effects fails from its second call ("supplied
22 arguments but compiled program expected 23": the effect token is not threaded through a
`Compiled` object in JAX 0.10.2).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P



def _like(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@dataclasses.dataclass
class _Lowered:
    """What `.lower(state, batch)` returns: `.compile()` gives the callable step."""

    build: Callable
    state: Any
    batch: Any

    def compile(self):
        return self.build(self.state, self.batch)


@dataclasses.dataclass
class CompiledProcessStep:
    """A train step of three programs, called like a compiled train step.

    Local gradients (averaged over this process's devices), the exchange between processes on the
    first device, and the update on the local mesh.

    Attributes:
      grads: the compiled local gradient program (`BoundStep.loss_and_grads`).
      exchange: the jitted exchange between processes, run on `first_device`.
      exchange_hlo: the exchange's compiled HLO text.
      update: the compiled update program, on the local mesh.
      first_device: the process's first device.
      replicated: the local mesh's replicated sharding.
    """

    grads: Any
    exchange: Callable
    exchange_hlo: str
    update: Any
    first_device: Any
    replicated: NamedSharding

    def __call__(self, state, batch):
        key = state.step_key()
        loss, grads, _, metrics = self.grads(state.params, batch, state.loss_scale, key, None)
        out = self.exchange(*jax.device_put((loss, grads, state.reducer, key), self.first_device))
        return self.update(state, *jax.device_put(out, self.replicated), metrics)

    def as_text(self) -> str:
        """The HLO text of the gradient, exchange and update programs, one after another.

        Returns:
          The three modules' texts, separated by blank lines.
        """
        return "\n\n".join((self.grads.as_text(), self.exchange_hlo, self.update.as_text()))

    def memory_analysis(self):
        """The memory analysis of the gradient program, the one that holds the activations.

        Returns:
          The compiled gradient program's `memory_analysis()`.
        """
        return self.grads.memory_analysis()

    def cost_analysis(self):
        """The cost analysis of the gradient program (the exchange and update are not counted).

        Returns:
          The compiled gradient program's `cost_analysis()`.
        """
        return self.grads.cost_analysis()


def process_programs(bound):
    """(step, eval_loss) of a `BoundStep` whose reducer runs between processes.

    Args:
      bound: the `BoundStep`; its `parts.process_reducer` runs the exchange between processes.

    Returns:
      `(step, eval_loss)`: `step(state, batch) -> (state, metrics)` compiles a
      `CompiledProcessStep` on its first call (shapes are fixed for a bound step) and has a
      `.lower(state, batch)` whose `.compile()` gives one; `eval_loss(params, batch)` is the loss
      averaged over the processes, on the first device.
    """
    reducer = bound.parts.process_reducer
    mesh = bound.parts.mesh
    first = mesh.devices.flat[0]
    single = jax.sharding.SingleDeviceSharding(first)
    replicated = NamedSharding(mesh, P())

    def exchange(loss, grads, red_state, key):
        grads, red_state = reducer.reduce(grads, red_state, key)
        return reducer.mean(loss), grads, red_state

    def update(state, loss, grads, red_state, metrics):
        new, update_metrics = bound.update(state, grads)
        return new.replace(reducer=red_state), {"loss": loss, **metrics, **update_metrics}

    def build(state, batch):
        key = jax.eval_shape(lambda s: s.step_key(), state)
        args = (state.params, batch, state.loss_scale, key, None)
        grads = jax.jit(bound.loss_and_grads).lower(*args).compile()
        loss, g, _, metrics = jax.eval_shape(bound.loss_and_grads, *args)
        jitted = jax.jit(exchange)
        hlo = jitted.lower(*_like((loss, g, state.reducer, key), single)).compile().as_text()
        upd = jax.jit(update, donate_argnums=0).lower(
            state, *_like((loss, g, state.reducer), replicated), metrics).compile()
        return CompiledProcessStep(grads, jitted, hlo, upd, first, replicated)

    compiled: dict = {}

    def step(state, batch):
        if "step" not in compiled:  # shapes are fixed for a bound step: compile once
            compiled["step"] = build(state, batch)
        return compiled["step"](state, batch)

    step.lower = lambda state, batch: _Lowered(build, state, batch)
    local_eval = jax.jit(bound._eval)
    mean = jax.jit(reducer.mean)
    return step, lambda params, batch: mean(jax.device_put(local_eval(params, batch), first))


@dataclasses.dataclass
class CompiledEngineStep:
    """A host-driven gradient phase, then one program that reduces and updates.

    The program reduces over the data-parallel copies and updates: every MPI collective of the
    step in one program (with asynchronous dispatch a host-side collective on the same
    communicator could run concurrently with it and mismatch).

    Attributes:
      engine: the host-driven engine (`transport.mpi_pipeline`) that runs the gradient phase.
      finish: the jitted reduce-and-update program.
      example: `(state, batch)` the analyses inspect the engine's programs with.
    """

    engine: Any
    finish: Callable
    example: tuple

    def __call__(self, state, batch):
        loss, grads, extra = self.engine.run(state.params, batch, state.loss_scale)
        return self.finish(state, loss, grads, {k: np.int32(v) for k, v in extra.items()})

    def as_text(self) -> str:
        """The HLO text of the engine's largest program (`engine.inspect`) on `example`.

        Returns:
          `engine.inspect(*example).as_text()`.
        """
        return self.engine.inspect(*self.example).as_text()

    def memory_analysis(self):
        """The memory analysis of the engine's largest program (`engine.inspect`) on `example`.

        Returns:
          `engine.inspect(*example).memory_analysis()`.
        """
        return self.engine.inspect(*self.example).memory_analysis()

    def cost_analysis(self):
        """The cost analysis of the engine's largest program (`engine.inspect`) on `example`.

        Returns:
          `engine.inspect(*example).cost_analysis()`.
        """
        return self.engine.inspect(*self.example).cost_analysis()


def engine_programs(bound):
    """(step, eval_loss) of a `BoundStep` whose gradient phase is a host-driven engine.

    Args:
      bound: the `BoundStep`; its `host_engine` runs the gradient phase and its
        `parts.process_reducer` the exchange between processes.

    Returns:
      `(step, eval_loss)`: `step(state, batch) -> (state, metrics)` runs a `CompiledEngineStep`
      and has a `.lower(state, batch)` whose `.compile()` gives one; `eval_loss(params, batch)` is
      the loss averaged over the processes and summed over the pipeline's stages (the last
      stage's).
    """
    reducer, engine = bound.parts.process_reducer, bound.host_engine

    def finish(state, loss, grads, extra):
        grads, red_state = reducer.reduce(grads, state.reducer, state.step_key())
        loss = engine.sum_over_stages(reducer.mean(loss))  # nonzero on the last stage only
        new, metrics = bound.update(state, grads)
        return new.replace(reducer=red_state), {"loss": loss, **metrics,
                                                **engine.reduce_metrics(extra)}

    finish = jax.jit(finish, donate_argnums=0)

    def step(state, batch):
        return CompiledEngineStep(engine, finish, (state, batch))(state, batch)

    step.lower = lambda state, batch: _Lowered(
        lambda s, b: CompiledEngineStep(engine, finish, (s, b)), state, batch)
    mean = jax.jit(lambda loss: engine.sum_over_stages(reducer.mean(loss)))
    return step, lambda params, batch: mean(engine.run_forward(params, batch))
