#!/usr/bin/env bash
# What one lent GPU machine runs (the `device` tool's `run`, from the repository root): the
# versions there, the XLA:GPU collective-pipelining flags its jaxlib knows, then the GPU suite
# within a time budget; results and the variants' compiled modules land in $OUT.
#     bash benchmarks/gpu_lease.sh [BUDGET_S [SECTIONS]]
set -u
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
$PY - <<'PYEOF'
import glob, os, re, jax_plugins
names = set()
for so in glob.glob(os.path.join(jax_plugins.__path__[0], "*", "*.so")):
    names |= set(re.findall(rb"xla_gpu_[a-z0-9_]*pipelin[a-z0-9_]*", open(so, "rb").read()))
print("pipelining flags in the plugin:", sorted(n.decode() for n in names))
PYEOF
$PY benchmarks/gpu_suite.py --out "$OUT" --budget-s "${1:-400}" --hlo-dir /tmp/hlo \
    ${2:+--sections $2} 2>&1 | tee "$OUT/suite_log.txt"
tar -C /tmp -czf "$OUT/hlo.tar.gz" hlo 2>/dev/null
ls -la "$OUT"
