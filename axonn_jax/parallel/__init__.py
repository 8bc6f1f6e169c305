from . import ulysses  # noqa: F401  (registers --context-attention ulysses)
