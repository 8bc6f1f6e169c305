"""The layer stack's backward with each layer's gradient exchange issued one layer late.

Autodiff of a `lax.scan` over layers can exchange (e.g. sum over `data`) a layer's gradients only
in that layer's own backward iteration, where they are the last thing computed: the collective has
no compute left to overlap, and XLA issues its start and done back to back. `scan_exchanging`
writes the stack's backward by hand instead. The reverse loop carries layer i's gradients,
unexchanged, into the iteration of layer i−1, where their exchange starts from the loop's input and
ends in its output, with the whole backward of layer i−1 in between; layer 0's are exchanged after
the loop. An exchange made of stages (the bfloat16 wire's all-to-all, then its all-gather) runs
each stage in an iteration of its own: layer i's k-th stage beside layer i−1−k's backward, so that
no stage waits on another inside one window. An exchange with state (CGX's: each layer's
error-feedback residual and rounding key) takes layer i's slice of a state stack in its first
stage and returns layer i's new slice from it too, written over the old one in place; the custom
backward hands the updated stack back as the state input's "gradient". The forward is the same
scans autodiff would run, each layer's pullback (`jax.vjp`, its remat wrapping included) saved for
the backward without the layer's parameters, which the backward slices again from the stack
instead of keeping a stacked copy. The residuals a layer's remat policy moved to host memory
(`--remat offload`) are fetched one layer ahead: layer i−1's copy to the device is issued in
layer i's iteration and carried into the next, so it runs beside layer i's backward instead of
before layer i−1's (one more layer's residuals on the device). With a gradient sink
(`--offload-gradients`) each layer's finished gradient leaves for host memory as it is placed, with
its sum of squares, and no gradient stack is held on the device.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import in_host_memory, manual_axis_size, varying_axes
from .update import sum_of_squares


def _fetched(stacks: list, j) -> list:
    """Layer `j`'s slices of the host-resident stacks among `stacks`, copied to the device; None
    for each of the others (sliced where they are used). A stack of one layer is left to its use:
    XLA:GPU drops the host copies of a one-layer residual stack fetched this way, keeping the
    activations on the device (tests/test_compile_h100.py)."""
    return [jax.device_put(lax.dynamic_index_in_dim(a, j, keepdims=False), jax.memory.Space.Device)
            if in_host_memory(a) and a.shape[0] > 1 else None for a in stacks]


def _down_the_runs(one: Callable, runs, carry, fetched: Callable):
    """`one(carry, run, local index, layer below)` on every layer, the top run first and each
    run's layers from the top.

    The carry is `(cotangent, layers in flight, gradients, the next layer's fetched residuals)`.
    A run's top layers run unrolled while the exchange's stages fill (a layer in flight is None),
    the rest in one loop whose bottom layer fetches itself once more (one loop body, no unrolled
    bottom layer with temporaries of its own); the next run's top layer is fetched between the
    two runs' loops.

    Args:
      one: one layer's backward.
      runs: `layer_runs`' runs.
      carry: the carry before the top layer.
      fetched: `(run, local index)` or None -> that layer's fetched residuals.

    Returns:
      The carry after the bottom layer.
    """
    for r in reversed(range(len(runs))):
        count = runs[r][1]
        while count and any(v is None for v in carry[1]):
            count -= 1
            carry = one(carry, r, count, (r, count - 1) if count else None)
        if count:
            carry, _ = lax.scan(
                lambda c, j, r=r: (one(c, r, j, (r, jnp.maximum(j - 1, 0))), None), carry,
                jnp.arange(count), reverse=True)
        if r:
            carry = (*carry[:3], fetched((r - 1, runs[r - 1][1] - 1)))
    return carry


def _index(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _place(stack, tree, i):
    """`stack` with layer `i`'s slice replaced by `tree`, cast to the stack's dtype (and moved
    to host memory for a stack there)."""
    def one(s, a):
        a = a.astype(s.dtype)
        return lax.dynamic_update_index_in_dim(
            s, jax.device_put(a, jax.memory.Space.Host) if in_host_memory(s) else a, i, 0)

    return jax.tree.map(one, stack, tree)


def _sunk(sink, tree, i):
    """`sink` (`{"grads", "squares"}`, `scan_exchanging`'s) with layer `i`'s gradients `tree`
    written to its host stacks and their sum of squares (float32) to `squares[i]`.

    Where the squares vary over manual axes, so that their sum over those axes is the layer's
    (each copy holding its share of some leaves), a leaf every copy holds whole counts once per
    copy, divided by their number."""
    over = varying_axes(sink["squares"])
    copies = math.prod(manual_axis_size(a) for a in over)
    squares = sum(sum_of_squares(g) / (1 if over <= varying_axes(g) else copies)
                  for g in jax.tree.leaves(tree))
    return {"grads": _place(sink["grads"], tree, i),
            "squares": sink["squares"].at[i].set(squares)}


def layer_runs(layer: Callable, stacked, groups) -> list[tuple[int, int, Callable]]:
    """`(first layer, count, layer function)` of each run of consecutive layers in `groups`.

    Args:
      layer: the layer function `(layer params, h) -> (h, aux)`.
      stacked: the stack's parameters, every leaf `(layers, ...)`.
      groups: `((count, wrap), ...)`: the run's function is `wrap(layer)`, or `layer` for None.

    Returns:
      One `(first layer, count, layer function)` per group, in stack order.

    Raises:
      ValueError: unless the counts cover the stack's layers.
    """
    total = jax.tree.leaves(stacked)[0].shape[0]
    runs, start = [], 0
    for count, wrap in groups:
        runs.append((start, count, layer if wrap is None else wrap(layer)))
        start += count
    if start != total:
        raise ValueError(f"layer groups cover {start} layers, the stack has {total}")
    return runs


def scan_runs(runs, stacked, x, prepare: Callable = lambda p: p):
    """`x` through the stacked layers, one `lax.scan` per run (`layer_runs`).

    Args:
      runs: `layer_runs` of the layer function.
      stacked: the stack's parameters, every leaf `(layers, ...)`.
      x: the stack's input, `(rows, ...)`.
      prepare: one layer's stored parameters -> what the layer function takes (identity by
        default).

    Returns:
      (x, aux): the stack's output and every aux entry stacked over the layers.
    """
    auxes = []
    for begin, count, f in runs:
        part = jax.tree.map(lambda a: a[begin:begin + count], stacked)
        x, aux = lax.scan(lambda h, p, f=f: f(prepare(p), h), x, part)
        auxes.append(aux)
    return x, _concatenated(auxes)


def _concatenated(auxes: list):
    """The runs' stacked aux entries as one stack."""
    return auxes[0] if len(auxes) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)


def _without_params(pullback, params) -> tuple[list, object, list]:
    """The pullback's arrays to save (its residuals minus the layer's own parameters, matched by
    identity), its treedef, and where each of its leaves comes from: `("param", k)`, the k-th
    parameter leaf; `("saved", None)`, the next saved array; `("static", leaf)`, a leaf that is no
    array (JAX 0.11's `jax.vjp` marks the arguments it does not need with sentinels)."""
    leaves, treedef = jax.tree.flatten(pullback)
    param_leaves = jax.tree.leaves(params)
    where = []
    for leaf in leaves:
        k = next((k for k, q in enumerate(param_leaves) if leaf is q), None)
        where.append(("param", k) if k is not None else ("saved", None)
                     if isinstance(leaf, jax.Array) else ("static", leaf))
    saved = [leaf for leaf, (source, _) in zip(leaves, where) if source == "saved"]
    return saved, treedef, where


def _with_params(saved: list, treedef, where: list, params) -> Callable:
    param_leaves, rest = jax.tree.leaves(params), iter(saved)
    return jax.tree.unflatten(treedef, [param_leaves[k] if source == "param" else
                                        next(rest) if source == "saved" else k
                                        for source, k in where])


def _forward_saving(runs, prepare: Callable, structure: dict, stacked, x):
    """The stack's forward, as `scan_runs`, saving each layer's pullback without its parameters.

    Args:
      runs: `layer_runs`.
      prepare: as `scan_exchanging`'s.
      structure: filled with run r's pullback treedef and residual sources at key r.
      stacked: the stack's parameters, every leaf `(layers, ...)`.
      x: the stack's input.

    Returns:
      `((h, aux), residuals)`: the output, the stacked aux entries, and per run the list of its
      saved arrays, each stacked over the run's layers.
    """
    residuals, auxes = [], []
    for r, (begin, count, f) in enumerate(runs):
        def step(h, p, r=r, f=f):
            prepared = prepare(p)
            (y, aux), pullback = jax.vjp(f, prepared, h)
            kept, treedef, where = _without_params(pullback, prepared)
            structure[r] = (treedef, where)
            return y, (aux, kept)

        part = jax.tree.map(lambda a: a[begin:begin + count], stacked)
        x, (aux, kept) = lax.scan(step, x, part)
        auxes.append(aux)
        residuals.append(kept)
    return (x, _concatenated(auxes)), residuals


class _ExchangingBackward:
    """`scan_exchanging`'s backward: the layers' backwards down the runs, each layer's exchange
    stages running beside the backwards of the layers below it.

    Built from the custom VJP's saved values `(stacked, residuals, state, key_data, sink)` and the
    cotangent of the aux entries; `run` takes the output's cotangent.
    """

    def __init__(self, runs, stages: tuple, prepare: Callable, structure: dict, stateful: bool,
                 saved, ct_aux):
        self.runs, self.stages, self.prepare, self.structure = runs, stages, prepare, structure
        self.stateful, self.ct_aux = stateful, ct_aux
        self.stacked, self.residuals, self.state, self.key_data, self.sink = saved
        self.store = _place if self.sink is None else _sunk

    def first(self, v, layer, new_state):
        """Stage 0 of layer `layer`'s gradients `v`, given its state and key; the state stack
        with the layer's new slice written over its old one (read just before: XLA updates
        the stack in place)."""
        if not self.stateful:
            return self.stages[0](v), new_state
        layer_key = None if self.key_data is None else \
            jax.random.fold_in(jax.random.wrap_key_data(self.key_data), layer)
        v, new = self.stages[0](v, None if self.state is None else _index(new_state, layer),
                                layer_key)
        return v, None if new is None else _place(new_state, new, layer)

    def fetched(self, layer):
        """`_fetched` of `layer` (`(run, local index)`; None: no layer, nothing fetched)."""
        return [] if layer is None else _fetched(self.residuals[layer[0]], layer[1])

    def layer_backward(self, r, j, ct_h, ahead):
        """Layer `begin + j`'s (local index j of run r) gradients (unexchanged, stored dtype)
        and the cotangent of its input; `ahead`: its host residuals, fetched already."""
        begin = self.runs[r][0]
        p = _index(self.stacked, begin + j)
        prepared = self.prepare(p)
        kept = [lax.dynamic_index_in_dim(a, j, keepdims=False) if b is None else b
                for a, b in zip(self.residuals[r], ahead)]
        pullback = _with_params(kept, *self.structure[r], prepared)
        g, ct_in = pullback((ct_h, _index(self.ct_aux, begin + j)))
        return jax.tree.map(lambda g, q: g.astype(q.dtype), g, p), ct_in

    def advance(self, grads, flight, below):
        """Every layer in `flight` one exchange stage on (`flight[k]`: layer `below + 1 + k`'s
        value before stage k, or None), the finished one placed (`grads`: the gradient stack and
        the new state stack or None)."""
        grads, new_state = grads
        moved = [None if v is None or k == 0 else self.stages[k](v) for k, v in enumerate(flight)]
        if flight[0] is not None:
            moved[0], new_state = self.first(flight[0], below + 1, new_state)
        if moved[-1] is not None:
            grads = self.store(grads, moved[-1], below + len(self.stages))
        return (grads, new_state), moved[:-1]

    def one(self, carry, r, j, below):
        """Layer `begin + j`'s backward beside the exchanges of the layers above it and the
        fetch of the host residuals of the layer `below` it (`(run, local index)` or None)."""
        ct_h, flight, grads, ahead = carry
        grads, moved = self.advance(grads, flight, self.runs[r][0] + j)
        g, ct_h = self.layer_backward(r, j, ct_h, ahead)
        return ct_h, [g, *moved], grads, self.fetched(below)

    def run(self, ct_h):
        """The cotangents of `(stacked, x, state, key_data, sink)` from the output's `ct_h`."""
        # The state stack starts as the old one: each layer's slice is replaced where it is read.
        last = len(self.runs) - 1
        first_grads = (jax.tree.map(jnp.zeros_like, self.stacked) if self.sink is None
                       else self.sink)
        carry = (ct_h, [None] * len(self.stages), (first_grads, self.state),
                 self.fetched((last, self.runs[last][1] - 1)))
        ct_h, flight, grads, _ = _down_the_runs(self.one, self.runs, carry, self.fetched)
        for t in range(len(self.stages)):  # the bottom layers' exchanges, after the loop
            grads, moved = self.advance(grads, flight, -1 - t)
            flight = [None, *moved]
        grads, new_state = grads
        if self.sink is None:
            return grads, ct_h, new_state, None, None
        return None, ct_h, new_state, None, grads


def scan_exchanging(runs, stacked, x, exchange: Callable, prepare: Callable, layer_state=None,
                    sink=None):
    """`x` through the stacked layers, their gradients exchanged one layer late in the backward.

    As `step.model.scan_layers` in the forward; the backward as the module docstring says.

    Args:
      runs: `layer_runs` of the layer function `(prepared layer params, h) -> (h, aux)` (aux a
        dict of arrays).
      stacked: the stack's parameters, every leaf `(layers, ...)`, invariant over the exchange's
        axis.
      x: the stack's input, `(rows, ...)`.
      exchange: one layer's gradients (in the stored dtype, varying over the exchange's axis) ->
        their exchanged value (invariant), e.g. `parallel.exchange.sum_over`; or a tuple of
        stages whose composition that is (`parallel.exchange.sum_over_stages`): layer i's stage k
        then runs beside layer i−1−k's backward.
      prepare: one layer's stored parameters -> what `layer` takes (varying over the exchange's
        axis, cast to the compute dtype); the gradients are cast back to the stored dtype.
      layer_state: None, or `(state, key)` for an exchange with state: `state` None or a pytree
        of `(layers, ...)` stacks (error-feedback residuals), `key` None or a PRNG key. The
        first stage then takes `(gradients, layer i's slice of state or None, key folded with i
        or None)` and returns `(its value, layer i's new slice or None)`.
      sink: None, or `{"grads": stacks shaped like `stacked` in host memory, "squares": float32
        (layers,)}`: each layer's exchanged gradient is then written to the host stacks as the
        backward finishes it, and its sum of squares to `squares`; that is the sink's
        "gradient", and `stacked` gets none (no gradient stack on the device).

    Returns:
      (h, aux): the stack's output and every aux entry stacked on a leading layer axis; the
      gradient of `stacked` is the exchanged one (or the sink's), that of `state` the stack of
      new slices.
    """
    structure = {}  # per run: the pullback's treedef and residual sources (static, set by fwd)
    stages = exchange if isinstance(exchange, tuple) else (exchange,)
    stateful = layer_state is not None
    state, key = layer_state if stateful else (None, None)

    @jax.custom_vjp
    def run(stacked, x, state, key_data, sink):
        return scan_runs(runs, stacked, x, prepare)

    def run_forward(stacked, x, state, key_data, sink):
        out, res = _forward_saving(runs, prepare, structure, stacked, x)
        return out, (stacked, res, state, key_data, sink)

    def run_backward(saved, cotangent):
        return _ExchangingBackward(runs, stages, prepare, structure, stateful, saved,
                                   cotangent[1]).run(cotangent[0])

    run.defvjp(run_forward, run_backward)
    return run(stacked, x, state, None if key is None else jax.random.key_data(key), sink)
