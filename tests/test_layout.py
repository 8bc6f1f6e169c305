"""The package's structure: no import cycle, and lower layers never import higher ones."""
import ast
import pathlib

from conftest import parse_python

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "axonn_jax"

# Lowest first; a module may import only modules of its own layer or below.
LAYERS = [("config", "mesh", "_compat", "collectives", "checks", "batch_axis"), ("tp",), ("parallel",),
          ("offload",), ("step",),
          ("models",), ("transport",), ("analysis",), ("run",), ("__init__", "__main__", "train")]


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """`{module: axonn_jax modules it imports}`, imports inside functions included."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    found = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(parse_python(path)):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("axonn_jax")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("axonn_jax"):
                    continue
                for alias in node.names:  # `from . import x` may name a module
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        found[name] = {t for t in targets if t in modules and t != name}
    return found


def _layer(module: str) -> int:
    first = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if first in names)


def test_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_lower_layers_never_import_higher_ones():
    upward = [f"{m} -> {t}" for m, targets in _imports().items() for t in targets
              if _layer(t) > _layer(m)]
    assert not upward, upward


def test_analysis_knows_no_model_type():
    """The communication model adds up what the parts declare: no isinstance dispatch on a model
    config type anywhere in `analysis/`, and `comm_model` names none."""
    configs = ("GPTConfig", "LlamaConfig", "UNetConfig", "ResNetConfig")
    found = []
    for path in (PACKAGE / "analysis").rglob("*.py"):
        for node in ast.walk(parse_python(path)):
            text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Name, ast.Attribute)) else \
                " ".join(a.name for a in getattr(node, "names", []))
            dispatch = isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance"
            if (dispatch or path.name == "comm_model.py") and any(c in text for c in configs):
                found.append(f"{path.name}:{node.lineno} {text}")
    assert not found, found


def test_no_context_variable_decides_what_is_traced():
    """The kernels' modes (`tp.options.KernelOptions`) and the transforms' state are passed
    explicitly: no module reads a `contextvars.ContextVar`, whose value at trace time would
    change the program without being part of what `jax.jit` caches on."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(parse_python(path)):
            names = [a.name for a in getattr(node, "names", [])] \
                if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if "contextvars" in names or getattr(node, "module", None) == "contextvars" or \
                    (isinstance(node, ast.Attribute) and node.attr == "ContextVar") or \
                    (isinstance(node, ast.Name) and node.id == "ContextVar"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
