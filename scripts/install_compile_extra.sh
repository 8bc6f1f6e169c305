#!/usr/bin/env bash
# Install what compiles train steps for abstract H100s on a machine without a GPU into the virtual
# environment $1 (axonn_jax.analysis.targets, `axonn-jax compile`): the `compile` extra (nvcc's
# ptxas and libdevice, cuDNN) and the CUDA plugin wheels at the installed jaxlib's exact version,
# which is why the version is read here rather than written down.
# The plugin goes into $1/cuda-plugin, outside site-packages: JAX imports a plugin it finds there
# on every `import jax`, which on a machine without a GPU prints CUDA driver warnings on every
# process's stderr. `analysis.targets.load_cuda_plugin` adds the directory when compiling for H100.
set -euo pipefail
venv=${1:-.venv}
version=$("$venv/bin/python" -c "import jaxlib; print(jaxlib.__version__)")
"$venv/bin/pip" install --quiet -e ".[compile]"
if "$venv/bin/pip" show --quiet jax-cuda12-plugin 2>/dev/null; then  # an older install's place
    "$venv/bin/pip" uninstall --quiet --yes jax-cuda12-plugin jax-cuda12-pjrt
fi
"$venv/bin/pip" install --quiet --no-deps --upgrade --target "$venv/cuda-plugin" \
    "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version"
