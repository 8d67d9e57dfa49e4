set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 PYTHONPATH=$PWD K3JAX_COMMIT=2abd301
for v in base while pdl; do
  case $v in
    base) F="" ;;
    while) F="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" ;;
    pdl) F="--xla_gpu_enable_pdl=true" ;;
  esac
  mkdir -p $OUT/$v
  XLA_FLAGS="$F" OUT=$OUT/$v timeout 110 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
    --moe auto --batch 1 --new-tokens 32 --name decode_flags_$v 2>&1 | grep -v "Triton backend is deprecated" | grep -E "TPOT|Error|error|Unknown|rror" | head -5
  echo "== $v done"
done
