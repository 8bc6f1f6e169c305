#!/usr/bin/env bash
# Install the `mpi` extra (mpi4jax, built from source) into the virtual environment $1.
# The build needs mpich, mpi4py, nanobind, cython in the venv first and no build isolation.
# mpi4jax compiles against the MPI of the `mpich` wheel; if an `nvcc` is on PATH it also builds its
# CUDA bridge, which needs CUDA_PATH to point at the toolkit root holding include/cuda_runtime.h.
set -euo pipefail
venv=${1:-.venv}
export PATH="$PWD/$venv/bin:$PATH"
export MPI4JAX_NO_WARN_JAX_VERSION=1
if [[ -z "${CUDA_PATH:-}" ]] && command -v nvcc >/dev/null; then
  nvcc_bin=$(command -v nvcc)
  # nvcc may be a wrapper script: look for the real binary it runs, then the toolkit root above it.
  real=$(grep -oE '/[^ "]*/bin/nvcc' "$nvcc_bin" 2>/dev/null | head -n1 || true)
  for root in "$(dirname "$(dirname "${real:-$nvcc_bin}")")" "$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")" /usr/local/cuda; do
    if [[ -f "$root/include/cuda_runtime.h" ]]; then export CUDA_PATH="$root"; break; fi
  done
fi
"$venv/bin/pip" install --quiet mpich mpi4py nanobind cython wheel setuptools
"$venv/bin/pip" install --quiet --no-build-isolation -e ".[mpi]"
