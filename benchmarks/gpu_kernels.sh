#!/usr/bin/env bash
# One GPU session for the kernel work: compile-and-check every kernel, then the kernel benchmarks.
# Run from the repository root on the GPU machine; logs and JSON land in $OUT.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export K3JAX_COMMIT=${K3JAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log"
for b in "$@"; do
  case "$b" in
    kda) python3 benchmarks/kda.py 2>&1 | grep -v "Triton backend is deprecated" | tee "$OUT/kda.log" ;;
    mla) python3 benchmarks/mla_decode.py 2>&1 | grep -v "Triton backend is deprecated" | tee "$OUT/mla.log" ;;
  esac
done
