"""The docstring rule of axonn_jax's public API: list what breaks it.

    python docs/docstring_rule.py [PATH ...]   (files or directories; default: axonn_jax)

`tests/test_docs.py` holds the package to it. The rule, in modules whose name does not start
with `_` (a package's `__init__.py` included):

- a public class (name without a leading `_`) opens its docstring with a one-line summary;
- a public function, and a public method of a public class (not a dunder, not Flax's `setup`),
  opens its docstring with a one-line summary, then has `Args:` when it takes parameters
  besides `self`/`cls`, and `Returns:` (or `Yields:`) when its own body returns a value and it
  is not annotated `-> None`;
- properties, and methods that implement a method of a `Protocol` class of the package, need
  only the summary (the protocol documents them).
"""
from __future__ import annotations

import ast
import pathlib
import sys

_NO_VALUE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def sources(paths) -> list[tuple[str, str]]:
    """`(path, text)` of every public module under `paths` (files or directories)."""
    files = []
    for p in map(pathlib.Path, paths):
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [(str(f), f.read_text()) for f in files
            if not f.name.startswith("_") or f.name == "__init__.py"]


def _is_protocol(node: ast.ClassDef) -> bool:
    return any(getattr(b, "id", getattr(b, "attr", None)) == "Protocol" for b in node.bases)


def protocol_methods(modules) -> set[str]:
    """Names of the methods of every `Protocol` class in `modules` (`(path, text)` pairs)."""
    return {m.name for _, text in modules for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.ClassDef) and _is_protocol(node)
            for m in node.body if isinstance(m, ast.FunctionDef)}


def has_summary(doc: str | None) -> bool:
    """Whether a docstring's first paragraph is one line."""
    return bool(doc and doc.strip()) and "\n" not in doc.strip().split("\n\n")[0]


def returns_value(fn) -> bool:
    """Whether a function's own body returns a value or yields (nested functions not counted)."""
    if isinstance(fn.returns, ast.Constant) and fn.returns.value is None:
        return False
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, _NO_VALUE):
            continue
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            return True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _parameters(fn) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x]
    return [n for n in names if n not in ("self", "cls")]


def _is_property(fn) -> bool:
    return any(getattr(d, "id", getattr(d, "attr", None)) in ("property", "cached_property",
                                                              "setter")
               for d in fn.decorator_list)


def function_problems(fn, where: str, summary_only: bool = False) -> list[str]:
    """What a function's docstring lacks under the rule, one line each, prefixed by `where`."""
    doc = ast.get_docstring(fn)
    if not has_summary(doc):
        return [f"{where}: no one-line summary"]
    if summary_only or _is_property(fn):
        return []
    lacks = []
    if _parameters(fn) and "Args:" not in doc:
        lacks.append(f"{where}: no Args:")
    if returns_value(fn) and "Returns:" not in doc and "Yields:" not in doc:
        lacks.append(f"{where}: no Returns:")
    return lacks


def _class_problems(node: ast.ClassDef, path: str, protocols: set[str]) -> list[str]:
    found = [] if has_summary(ast.get_docstring(node)) else \
        [f"{path}:{node.lineno} {node.name}: no one-line summary"]
    for m in node.body:
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                not m.name.startswith("_") and m.name != "setup":
            found += function_problems(m, f"{path}:{m.lineno} {node.name}.{m.name}",
                                       m.name in protocols and not _is_protocol(node))
    return found


def problems(modules, protocols: set[str] | None = None) -> list[str]:
    """Every break of the rule in `modules` (`(path, text)` pairs), one line each.

    Args:
      modules: the modules to check.
      protocols: method names that need only a summary (default: `protocol_methods(modules)`).

    Returns:
      Lines `path:line name: what is missing`.
    """
    protocols = protocol_methods(modules) if protocols is None else protocols
    found = []
    for path, text in modules:
        for node in ast.parse(text).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    or node.name.startswith("_"):
                continue
            found += (_class_problems(node, path, protocols) if isinstance(node, ast.ClassDef)
                      else function_problems(node, f"{path}:{node.lineno} {node.name}"))
    return found


if __name__ == "__main__":
    everything = protocol_methods(sources(["axonn_jax"]))
    lines = problems(sources(sys.argv[1:] or ["axonn_jax"]), everything)
    print("\n".join(lines + [f"{len(lines)} problems"]))
    sys.exit(1 if lines else 0)
