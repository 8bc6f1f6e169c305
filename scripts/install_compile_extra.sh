#!/usr/bin/env bash
# Install the `compile` extra into the virtual environment $1: what compiles train steps for
# abstract H100s on a machine without a GPU (axonn_jax.analysis.targets, `axonn-jax compile`).
# The CUDA plugin must match the installed jaxlib exactly, so its version is read from jaxlib here
# rather than written down.
set -euo pipefail
venv=${1:-.venv}
version=$("$venv/bin/python" -c "import jaxlib; print(jaxlib.__version__)")
"$venv/bin/pip" install --quiet "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version" -e ".[compile]"
