"""Rules for `axonn_jax.parallelize(..., rules={key: rule})`: how to run a module it does not know,
or that a module it knows stays as written.

A key is a module class (matching its instances and those of its subclasses) or a glob over the
module's `/`-joined path (`fnmatch`: `*` also crosses `/`, e.g. `'*/k_proj'`). Path keys win over
class keys, and a rule wins over the built-in handling of Flax's layers and over `BUILTIN_RULES`
(modules of other libraries, such as transformers' GPT-2 `FlaxConv1D`):

    rules = {TorchStyleLinear: AsDense(kernel="weight", out_in=True),  # kernel (out, in)
             "*/k_proj": Replicated(),              # 2 key/value heads do not divide row = 4
             "*/v_proj": Replicated()}
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class AsDense:
    """Run a module as a tensor-parallel dense layer.

    Its `__call__(x)` computes `x @ kernel (+ bias)` over the last `in_ndim` dims of `x`, from its
    parameters `kernel` (shape `(*in_dims, *out_dims)`, or `(*out_dims, *in_dims)` when `out_in`,
    as torch-style weights) and `bias` (`out_dims`; None: no bias). `out_ndim` counts the output
    feature dims.

    The module's own `__call__` runs only where its parameters do not exist yet (in `init`, to
    create them with its own initializers; XLA drops its unused result); the rule is a promise
    about its arithmetic, which `parallelize` does not check. Its `dtype` attribute, if any, sets
    the compute dtype as in Flax's layers.
    """

    kernel: str = "kernel"
    bias: str | None = "bias"
    out_in: bool = False
    in_ndim: int = 1
    out_ndim: int = 1


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Run the module (and every module inside it) as written, its parameters whole everywhere.

    E.g. grouped-query key/value projections whose heads do not divide `row`. Such parameters
    count as asked for: `max_replicated` does not refuse them.
    """


Rule = AsDense | Replicated


def check_rules(rules: Mapping | None) -> dict:
    """`rules` as a dict, after checking its keys and values.

    Args:
      rules: `{module class or path glob: AsDense or Replicated}`, or None.

    Returns:
      A dict of the rules (empty for None).

    Raises:
      TypeError: a key or a value of another type, named in the message.
    """
    rules = dict(rules or {})
    for key, rule in rules.items():
        if not isinstance(key, (str, type)):
            raise TypeError(f"parallelize: a rules key must be a module class or a path glob, "
                            f"got {key!r}")
        if not isinstance(rule, (AsDense, Replicated)):
            raise TypeError(f"parallelize: rules[{key!r}] must be AsDense(...) or Replicated(), "
                            f"got {rule!r}")
    return rules


def find_rule(rules: Mapping, path: str, module) -> Rule | None:
    """The rule for the module at `path`.

    Args:
      rules: the checked rules (`check_rules`).
      path: the module's `/`-joined path.
      module: the module.

    Returns:
      The rule of the first path glob that matches, else that of the nearest class in the
      module's MRO, else the built-in rule of the nearest class in `BUILTIN_RULES`, else None.
    """
    for key, rule in rules.items():
        if isinstance(key, str) and fnmatch.fnmatchcase(path, key):
            return rule
    for cls in type(module).__mro__:
        if cls in rules:
            return rules[cls]
    for cls in type(module).__mro__:
        builtin = BUILTIN_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if builtin is not None:
            return builtin(module)
    return None


def _flax_conv1d(module) -> AsDense:
    """transformers' `FlaxConv1D` (GPT-2's dense layers): `x @ kernel.T (+ bias)`, its kernel
    stored `(out, in)`."""
    return AsDense(out_in=True, bias="bias" if getattr(module, "use_bias", True) else None)


BUILTIN_RULES = {"transformers.models.gpt2.modeling_flax_gpt2.FlaxConv1D": _flax_conv1d}
"""Rules for modules of other libraries that call `lax.dot_general` themselves, keyed by the
class's qualified name (nothing is imported): `{name: function of the module -> rule}`."""
