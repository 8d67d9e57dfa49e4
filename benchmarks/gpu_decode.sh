#!/usr/bin/env bash
# The end-to-end decode baseline on the GPU machine: Kimi-Linear-48B-A3B shape, random bf16 weights.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.97
export K3JAX_COMMIT=${K3JAX_COMMIT:-unknown}
python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --batch 1 64 --prompt-len 128 --new-tokens 64 \
  --repeats 3 "$@" 2>&1 | grep -v "Triton backend is deprecated" | tee "$OUT/decode.log"
