"""A backward pass cut in two: the input gradient (B) now, the weight gradients (W) later.

Zero-bubble pipeline schedules (Qi et al., 2023) run a stage's backward as two operations: B, which
computes the gradient of the stage input (the message the previous stage waits for), and W, which
computes the parameter gradients and may wait to fill an idle tick. `split_backward` makes the two
from any backward function, without knowing the model: it traces the function to a jaxpr and sorts
its equations.

- B is every equation the input gradient (and any other output named as B's) depends on.
- W is every remaining equation the parameter gradients depend on. The values W reads that B
  computed are B's *residuals*: B returns them, the caller keeps them, W takes them back.
- A `scan` whose outputs both parts need (the backward of a stack of layers is one transposed scan)
  is split the same way, body and all, into a B scan that also stacks the body's residuals per
  iteration and a W scan over those stacks: a layer's weight gradient `x·dy` runs in W, its input
  gradient in B, and nothing runs twice.
- A `shard_map` whose outputs both need (the backward of a tensor-parallel dense layer: input and
  kernel gradients from one shard_map) is split by dead-code elimination into two shard_maps.
- Calls (`jit`, `checkpoint`, `closed_call`) are inlined first, so their equations sort one by one.
- Any other equation (a `cond`, a `while`) is indivisible: it runs in B when B needs any output of
  it, and W reads the outputs it needs from it as residuals. In particular the weight gradients of
  parts behind a `lax.cond` (a pipeline's embedding and loss head) are computed with B.

The equations are evaluated by binding their primitives, the way `jax.core.eval_jaxpr` does, inside
whatever trace the caller is in (a shard_map, a scan body, a cond branch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from .._compat import jaxpr_internals, scan_layout

_CALLS = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2")


def _inner(eqn):
    """(jaxpr, consts) of a call-like equation, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if inner is None:
        return None
    if hasattr(inner, "consts"):  # a ClosedJaxpr
        return inner.jaxpr, list(inner.consts)
    return inner, []


class _Flat:
    """A jaxpr's equations with every call inlined (its variables renamed to the caller's).

    consts: values of constant variables (the inlined calls' constants, the jaxpr's own);
    alias: a variable defined as another atom (an inlined call's outputs).
    """

    def __init__(self, jaxpr, consts):
        core = jaxpr_internals()
        self.core = core
        self.consts: dict = dict(zip(jaxpr.constvars, consts))
        self.alias: dict = {}
        self.eqns: list = []
        self.invars = list(jaxpr.invars)
        self._add(jaxpr.eqns, {})
        self.outvars = [self.atom(v) for v in jaxpr.outvars]

    def atom(self, v, sub=None):
        """`v` after renaming (`sub`) and aliasing."""
        if isinstance(v, self.core.Literal):
            return v
        v = (sub or {}).get(v, v)
        while not isinstance(v, self.core.Literal) and v in self.alias:
            v = self.alias[v]
        return v

    def _add(self, eqns, sub, inlined: bool = False):
        """Append `eqns` with their inputs renamed by `sub`; the equations of an inlined call
        (`inlined`) also get fresh output variables, since one call's jaxpr (a cached `jit`) may be
        inlined at several places."""
        for eqn in eqns:
            invars = [self.atom(v, sub) for v in eqn.invars]
            inner = _inner(eqn)
            if inner is None:
                outvars = eqn.outvars
                if inlined:
                    outvars = [o if isinstance(o, self.core.DropVar) else sub.setdefault(
                        o, self.core.Var(o.aval)) for o in eqn.outvars]
                self.eqns.append(eqn.replace(invars=invars, outvars=outvars))
                continue
            jaxpr, consts = inner
            inner_sub = dict(zip(jaxpr.invars, invars))
            for var, value in zip(jaxpr.constvars, consts):
                inner_sub[var] = fresh = self.core.Var(var.aval)
                self.consts[fresh] = value
            self._add(jaxpr.eqns, inner_sub, inlined=True)
            for out, inner_out in zip(eqn.outvars, jaxpr.outvars):
                if not isinstance(out, self.core.DropVar):
                    # Inside an inlined call its variables are renamed per call (`sub`).
                    (sub if inlined else self.alias)[out] = self.atom(inner_out, inner_sub)


def _is_var(core, v) -> bool:
    return not isinstance(v, (core.Literal, core.DropVar))


@dataclasses.dataclass
class _ScanPart:
    """One half of a split scan: B (`half='b'`) or W."""

    half: str
    split: "_ScanSplit"


@dataclasses.dataclass
class _Stack:
    """A residual that a split scan stacks over its iterations (a key of the evaluation env)."""

    aval: Any

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


class _Plan:
    """The B and W steps of one jaxpr (top level or a scan body).

    b_steps / w_steps: equations (or split-scan halves) in order; b_inputs / w_inputs: the
    variables each part reads; residuals: the variables W reads that B defines (or inputs W may not
    read itself, `w_free`); b_out_index / w_out_index: which outputs each part returns (a W output
    that B defines is a residual W passes on).
    """

    def __init__(self, flat: _Flat, need_b: Sequence[bool], w_free: set, pass_early=False):
        self.flat = flat
        self.b_out_index = [i for i, b in enumerate(need_b) if b]
        self.w_out_index = [i for i, b in enumerate(need_b) if not b]
        self._splits: dict = {}
        self._b_pass(need_b)
        # W's outputs that B computes anyway ("early"): B returns them instead of W passing them
        # on as residuals (`pass_early`: a scan body's outputs all come from one of its two scans).
        core = flat.core
        self.early_index = [] if pass_early else [
            i for i in self.w_out_index if not _is_var(core, flat.outvars[i])
            or flat.outvars[i] in self.defined_b or flat.outvars[i] in flat.invars]
        self.late_index = [i for i in self.w_out_index if i not in self.early_index]
        self._w_pass(self.late_index, w_free)

    def _b_pass(self, need_b):
        flat, core = self.flat, self.flat.core
        needed = {v for v, b in zip(flat.outvars, need_b) if b and _is_var(core, v)}
        steps = []
        for eqn in reversed(flat.eqns):
            used = [_is_var(core, o) and o in needed for o in eqn.outvars]
            if not any(used):
                continue
            partial = not all(u or isinstance(o, core.DropVar) for u, o in zip(used, eqn.outvars))
            if eqn.primitive.name == "scan" and partial:
                split = self._splits[id(eqn)] = _ScanSplit(flat, eqn, used)
                steps.append(_ScanPart("b", split))
                needed |= split.b_top_inputs
                continue
            if eqn.primitive.name == "shard_map" and partial:
                eqn = _dce(eqn, used)
            steps.append(eqn)
            needed |= {v for v in eqn.invars if _is_var(core, v)}
        steps.reverse()
        self.b_steps, self.b_inputs = steps, needed
        self.defined_b = set()
        for step in steps:
            outs = step.split.b_top_outputs if isinstance(step, _ScanPart) else step.outvars
            self.defined_b |= {o for o in outs if not isinstance(o, core.DropVar)}

    def _w_pass(self, late_index, w_free):
        flat, core = self.flat, self.flat.core
        needed, residuals = set(), []

        def want(v):
            if isinstance(v, (core.Literal, core.DropVar)) or v in flat.consts:
                return
            if v in self.defined_b or (v in flat.invars and v not in w_free):
                if v not in residuals:
                    residuals.append(v)
            else:
                needed.add(v)

        for i in late_index:
            want(flat.outvars[i])
        steps = []
        for eqn in reversed(flat.eqns):
            used = [_is_var(core, o) and o in needed for o in eqn.outvars]
            if not any(used):
                continue
            if id(eqn) in self._splits:
                split = self._splits[id(eqn)]
                steps.append(_ScanPart("w", split))
                inputs = split.w_top_inputs
            else:
                if eqn.primitive.name == "shard_map" and not all(used):
                    eqn = _dce(eqn, used)
                steps.append(eqn)
                inputs = eqn.invars
            for v in inputs:
                want(v)
        steps.reverse()
        self.w_steps, self.residuals = steps, residuals
        self.w_inputs = needed | set(residuals)


def _dce(eqn, used):
    """`eqn` computing only its `used` outputs (JAX's dead-code elimination rule for it)."""
    return jaxpr_internals().dce_eqn(list(used), eqn)


class _ScanSplit:
    """A scan eqn split into a B scan and a W scan (see the module docstring)."""

    def __init__(self, flat: _Flat, eqn, used_b: list[bool]):
        core = flat.core
        self.eqn = eqn
        p = eqn.params
        nc, nk, body, body_consts = scan_layout(p)
        self.nc, self.nk = nc, nk
        inner = _Flat(body, body_consts)
        n_out = len(body.outvars)
        b_carry = {i for i in range(nk) if used_b[i]}
        while True:
            need = [(i < nk and i in b_carry) or (i >= nk and used_b[i]) for i in range(n_out)]
            w_free = set(inner.invars[:nc]) | set(inner.invars[nc + nk:]) | {
                inner.invars[nc + i] for i in range(nk) if i not in b_carry}
            plan = _Plan(inner, need, w_free, pass_early=True)
            more = {i for i in range(nk) if inner.invars[nc + i] in plan.b_inputs} - b_carry
            if not more:
                break
            b_carry |= more
        self.plan, self.inner = plan, inner
        self.b_carry = sorted(b_carry)
        self.w_carry = [i for i in range(nk) if i not in b_carry]
        self.b_ys = [j for j in range(n_out - nk) if used_b[nk + j]]
        self.w_ys = [j for j in range(n_out - nk) if not used_b[nk + j]]
        length = p["length"]
        self.stacks = [_Stack(v.aval.update(shape=(length, *v.aval.shape))) for v in plan.residuals]
        outs = eqn.outvars
        self.b_top_outputs = [outs[i] for i in self.b_carry] + [outs[nk + j] for j in self.b_ys]
        self.b_top_outputs += self.stacks
        ins, body_ins = eqn.invars, inner.invars
        # Every carry of a part is an operand of that part's scan, read or not.
        self._b_wanted = plan.b_inputs | {body_ins[nc + i] for i in self.b_carry}
        self._w_wanted = plan.w_inputs | {body_ins[nc + i] for i in self.w_carry}
        self.b_top_inputs = {v for v, b in zip(ins, body_ins) if _is_var(core, v) and
                             b in self._b_wanted}
        self.w_top_inputs = [v for v, b in zip(ins, body_ins) if _is_var(core, v) and
                             b in self._w_wanted] + self.stacks

    def _read(self, read, wanted):
        """The scan's operands whose body variables are in `wanted` (None for the others)."""
        return [read(v) if b in wanted else None for v, b in zip(self.eqn.invars, self.inner.invars)]

    def run_b(self, read):
        p, nc, nk = self.eqn.params, self.nc, self.nk
        ins = self._read(read, self._b_wanted)
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        plan = self.plan

        def body(c, x):
            vals = consts + _fill(nk, self.b_carry, c) + list(x)
            outs, res = _run_b(plan, vals)
            by_index = dict(zip(plan.b_out_index, outs))
            new_c = [by_index[i] for i in self.b_carry]
            return new_c, ([by_index[nk + j] for j in self.b_ys], res)

        c, (ys, stacks) = jax.lax.scan(body, [carry[i] for i in self.b_carry], xs,
                                       length=p["length"], reverse=p["reverse"],
                                       unroll=p.get("unroll", 1))
        return c + ys + stacks

    def run_w(self, read):
        p, nc, nk = self.eqn.params, self.nc, self.nk
        ins = self._read(read, self._w_wanted)
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        stacks = [read(s) for s in self.stacks]
        plan = self.plan

        def body(c, x):
            x, res = x
            vals = consts + _fill(nk, self.w_carry, c) + list(x)
            outs = _run_w(plan, vals, res)
            by_index = dict(zip(plan.late_index, outs))
            return [by_index[i] for i in self.w_carry], [by_index[nk + j] for j in self.w_ys]

        c, ys = jax.lax.scan(body, [carry[i] for i in self.w_carry], (xs, stacks),
                             length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1))
        outs = self.eqn.outvars
        return list(zip([outs[i] for i in self.w_carry] + [outs[nk + j] for j in self.w_ys],
                        c + ys))


def _fill(n, index, values):
    """A list of `n` entries with `values` at `index` (None elsewhere: variables a part never reads)."""
    out = [None] * n
    for i, v in zip(index, values):
        out[i] = v
    return out


def _eval(flat: _Flat, steps, env: dict):
    core = flat.core

    def read(v):
        if isinstance(v, core.Literal):
            return v.val
        if isinstance(v, _Stack):
            return env[v]
        v = flat.atom(v)
        if isinstance(v, core.Literal):
            return v.val
        return flat.consts[v] if v in flat.consts else env[v]

    for step in steps:
        if isinstance(step, _ScanPart):
            if step.half == "b":
                outs = step.split.run_b(read)
                for o, val in zip(step.split.b_top_outputs, outs):
                    if not isinstance(o, core.DropVar):
                        env[o] = val
            else:
                for o, val in step.split.run_w(read):
                    if not isinstance(o, core.DropVar):
                        env[o] = val
            continue
        params = step.primitive.get_bind_params(step.params)
        if isinstance(params, tuple):  # pragma: no cover - JAX versions returning (subfuns, params)
            subfuns, params = params
        else:
            subfuns = []
        with step.ctx.manager:
            ans = step.primitive.bind(*subfuns, *[read(v) for v in step.invars], **params)
        outs = ans if step.primitive.multiple_results else [ans]
        for o, val in zip(step.outvars, outs):
            if not isinstance(o, core.DropVar):
                env[o] = val
    return read


def _run_b(plan: _Plan, invals):
    """(B's outputs and W's early ones, in output order; the residuals)."""
    env = {v: x for v, x in zip(plan.flat.invars, invals) if x is not None}
    read = _eval(plan.flat, plan.b_steps, env)
    outs = [read(plan.flat.outvars[i]) for i in sorted(plan.b_out_index + plan.early_index)]
    return outs, [read(v) for v in plan.residuals]


def _run_w(plan: _Plan, invals, residuals):
    """W's late outputs, in output order."""
    env = {v: x for v, x in zip(plan.flat.invars, invals) if x is not None}
    env.update(zip(plan.residuals, residuals))
    read = _eval(plan.flat, plan.w_steps, env)
    return [read(plan.flat.outvars[i]) for i in plan.late_index]


@dataclasses.dataclass
class BackwardSplit:
    """`fn`'s outputs computed in two parts (see the module docstring); made by `split_backward`.

    b(*args) -> (B's outputs (a pytree like `fn`'s first outputs), early, residuals);
    w(w_args, residuals) -> late. `early` / `late`: lists of W's outputs (the leaves of `fn`'s
    other outputs, flattened) at positions `early_index` / `late_index`: those B computes anyway
    (behind an indivisible equation) and those W computes. `w_args`: the arguments marked free,
    in order (e.g. the parameters, which W may read in a later tick); `residual_avals`: what the
    caller keeps between the two (shapes, dtypes and the manual axes they vary over).
    """

    plan: _Plan
    w_free_mask: list[bool]
    b_tree: Any
    num_b: int
    early_index: list[int]
    late_index: list[int]
    residual_avals: list

    def b(self, *args):
        """Run B: the outputs named as B's, W's outputs B computes anyway, and the residuals.

        Args:
          *args: `fn`'s arguments (all of them, shaped as the example arguments).

        Returns:
          `(B's outputs (a pytree like fn's first num_b_outputs outputs), early, residuals)`:
          `early` the list of W's outputs at `early_index`, `residuals` what W reads from B.
        """
        outs, residuals = _run_b(self.plan, jax.tree.leaves(args))
        return jax.tree.unflatten(self.b_tree, outs[:self.num_b]), outs[self.num_b:], residuals

    def w(self, w_args, residuals):
        """Run W: the rest of `fn`'s outputs, from the free arguments and B's residuals.

        Args:
          w_args: the arguments marked free (`w_free`), in order.
          residuals: what `b` returned as residuals.

        Returns:
          `late`: the list of W's outputs at `late_index` (flattened leaves of fn's other outputs).
        """
        it = iter(jax.tree.leaves(w_args))
        full = [next(it) if free else None for free in self.w_free_mask]
        return _run_w(self.plan, full, residuals)


def split_backward(fn: Callable, args: tuple, *, w_free: tuple[bool, ...],
                   num_b_outputs: int) -> BackwardSplit:
    """Split `fn(*args) -> (out_0, ..., out_k)` into B (outputs 0 … num_b_outputs−1) and W.

    W computes the rest of the outputs. Any value W needs that is not a free argument is a
    residual.

    Args:
      fn: the backward function to split.
      args: example arguments (arrays or tracers: their avals, including the manual axes they
        vary over, fix the jaxpr).
      w_free: one flag per argument of `args`: W may read argument i directly (it is still
        there when W runs).
      num_b_outputs: how many of `fn`'s leading outputs are B's.

    Returns:
      The `BackwardSplit`, whose `b` and `w` run the two parts.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat = _Flat(closed.jaxpr, list(closed.consts))
    b_tree = jax.tree.structure(tuple(out_shape[:num_b_outputs]))
    n_b = b_tree.num_leaves
    n_w = len(jax.tree.leaves(tuple(out_shape[num_b_outputs:])))
    mask = [free for free, a in zip(w_free, args) for _ in jax.tree.leaves(a)]
    plan = _Plan(flat, [i < n_b for i in range(n_b + n_w)],
                 {v for v, m in zip(flat.invars, mask) if m})
    return BackwardSplit(plan, mask, b_tree, n_b, [i - n_b for i in plan.early_index],
                         [i - n_b for i in plan.late_index], [v.aval for v in plan.residuals])
