#!/usr/bin/env bash
# Build the Python 3.12 virtual environment benchmarks/peers.py runs in (default: .peers-venv at the
# repository root): MaxText 0.2.5 (which needs Python >= 3.12) and this project on one pinned
# jax/jaxlib, plus what compiles for abstract H100s without a GPU (scripts/install_compile_extra.sh's
# CUDA plugin in $VENV/cuda-plugin and the `compile` extra's wheels).
# MaxText's own dependency lists (its extras) pull in TPU, GCS, Transformer Engine and dozens of tools;
# it is installed with --no-deps beside the few packages that its train step's import chain needs.
# Usage: benchmarks/make_peer_venv.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.peers-venv}
jax_version=${JAX_VERSION:-0.12.0.1}
python=${PYTHON312:-$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)}

"$python" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install --quiet --upgrade pip
"$pip" install --quiet "jax==$jax_version" "jaxlib==$jax_version" \
    flax optax orbax-checkpoint rich pyyaml tensorboardX matplotlib \
    "nvidia-cuda-nvcc-cu12>=12.6.85" "nvidia-cudnn-cu12>=9.8,<10" \
    absl-py omegaconf pydantic jaxtyping etils psutil pillow sympy jinja2 tiktoken sentencepiece \
    tokenizers huggingface_hub transformers aqtp qwix drjax grain tokamax pathwaysutils
"$pip" install --quiet --no-deps maxtext==0.2.5
"$pip" install --quiet --no-deps -e .
"$pip" install --quiet --no-deps --upgrade --target "$venv/cuda-plugin" \
    "jax-cuda12-plugin==$jax_version" "jax-cuda12-pjrt==$jax_version"
"$venv/bin/python" -c "import jax, jaxlib, maxtext; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
