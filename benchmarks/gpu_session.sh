#!/usr/bin/env bash
# One run on the GPU machine: bring the carried wheels in, then run the named steps in order, each
# under its own time limit; logs and JSON land in $OUT/work and come back as $OUT/results.tgz.
#   bash benchmarks/gpu_session.sh tests moe decode
# Steps:
#   tests skinny-tests skinny pair-tiles ttft glue-tests moe moe-mxfp4 moe-hopper moe-hopper-repeat moe-hopper-hlo
#   hopper-sass moe-sweep gemv decode decode-fast decode-packed decode-ab decode-sweep decode-host host-costs chunk-calls
#   decode-overhead decode-before checkpoint-read kda kda-prefill kda-bench kda-scaling kda-ncu mla-ncu
#   mla-ncu-source moe-ncu kda-decode-ncu kda-varlen kda-hopper kda-split skinny-sweep kda-state k3-layers moe-ep
#   decode-ep2 multiprocess mla mla-merge mla-step small-launches mla-ptxas mla-tests mla-layer-tests speculative
#   speculative-tests speculative-verify speculative-e2e prefill-tests prefill server-load batch-job
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}
W=$OUT/work; mkdir -p "$W"
site=/tmp/site
# nvidia-cuda-nvdisasm is unpacked beside, onto PATH, not installed: as a package its nvidia/cu13 (no ptxas) would
# become JAX's CUDA root. hopper_mxfp4_sass.py hands it to Mosaic GPU's SASS dump.
for w in .whl/nvidia_cuda_nvdisasm-*.whl; do
  [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/nvdisasm && chmod +x /tmp/nvdisasm/nvidia/*/bin/* \
    && export PATH=$PATH:$(dirname /tmp/nvdisasm/nvidia/*/bin/nvdisasm)
done
packages=$(ls .whl/*.whl 2>/dev/null | grep -v nvidia_cuda_nvdisasm)
if [ -n "$packages" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site $packages
  # tokamax imports xprof.cli.tools at import time; the machine's xprof lacks it and nothing here calls it.
  mkdir -p $site/xprof/cli && touch $site/xprof/__init__.py $site/xprof/cli/__init__.py
  printf 'def get_kernel_stats_tool(*a, **k):\n    raise NotImplementedError\n' > $site/xprof/cli/tools.py
fi
export PYTHONPATH=$PWD:$site
export K3JAX_COMMIT=${K3JAX_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$W/gpu.txt"
# Triton's autotune results (fla's kernels pick their launch settings by timing every one on a first call, ~30-100 s
# a shape), kept per GPU model from run to run: a run returns $OUT/triton-autotune-<model>.tgz; saved as
# .triton-autotune/<model>.tgz at the repository root and brought along, it is unpacked before the steps.
gpu_model=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '_')
gpu_model=${gpu_model:-unknown_gpu}
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1
mkdir -p $TRITON_CACHE_DIR
[ -f ".triton-autotune/$gpu_model.tgz" ] && tar xzf ".triton-autotune/$gpu_model.tgz" -C $TRITON_CACHE_DIR
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$W/gpu.txt"
quiet() { grep -v "Triton backend is deprecated" ; }
# Programs under ncu allocate GPU memory as they go instead of taking 97% of it up front: ncu saves and restores the
# memory a profiled kernel may touch for each replay pass, and a whole preallocated H200 pool may be what kept it at
# "Profiling: 0%" past its limit there (runs 2 and 33 on an H200; the H100 finished in about 75 s a launch).
NCU_ENV="env XLA_PYTHON_CLIENT_PREALLOCATE=false"
ncu_path() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }
# ncu_metrics NAME KERNEL_REGEX PROGRAM...: one launch (the second matching) profiled with the raw metrics of
# ncu_summary.py, summarised as $W/NAME.md and NAME.json; fails (status 1) when ncu is missing or its pass fails
# (on some machines ncu hangs at "Profiling: 0%" until the limit).
ncu_metrics() {
  local name=$1 regex=$2; shift 2
  local ncu; ncu=$(ncu_path)
  [ -n "$ncu" ] || { echo "$name: no ncu on this machine" | tee "$W/$name.err"; return 1; }
  $NCU_ENV timeout ${NCU_LIMIT:-120} $ncu --clock-control none -k regex:$regex --launch-skip 1 --launch-count 1 --csv \
      --page raw --metrics $(python3 benchmarks/ncu_summary.py --metrics) "$@" > "$W/$name.csv" 2> "$W/$name.err" \
      || { echo "$name: the metrics pass failed" | tee -a "$W/$name.err"; tail -4 "$W/$name.csv"; return 1; }
  python3 benchmarks/ncu_summary.py "$W/$name.csv" --json "$W/$name.json" | tee "$W/$name.md"
}
# ncu_profile NAME KERNEL_REGEX PROGRAM...: ncu_metrics, then in a second pass the warp-state samples per SASS
# instruction (ncu_source_summary.py): $W/NAME_sass.md and its JSON, the report itself as NAME.ncu-rep.
ncu_profile() {
  local name=$1 regex=$2; shift 2
  ncu_metrics "$name" "$regex" "$@" || return
  local ncu; ncu=$(ncu_path)
  $NCU_ENV timeout ${NCU_LIMIT:-120} $ncu --clock-control none -k regex:$regex --launch-skip 1 --launch-count 1 \
      --section SourceCounters --section WarpStateStats -o "$W/$name" -f "$@" >> "$W/$name.err" 2>&1 \
      || { echo "$name: the source-counters pass failed" | tee -a "$W/$name.err"; tail -4 "$W/$name.err"; return; }
  $ncu --import "$W/$name.ncu-rep" --page source --csv --print-source sass > "$W/${name}_sass.csv" 2>> "$W/$name.err"
  python3 benchmarks/ncu_source_summary.py "$W/${name}_sass.csv" --json "$W/${name}_sass.json" \
      | tee "$W/${name}_sass.md"
  tail -3 "$W/$name.err"
}
# Test steps stop pytest at their limit with SIGINT (then SIGKILL 30 s later), so that it still prints what passed
# and failed before the limit; a plain SIGTERM loses the summary.
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    tests) workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4}")   # pytest-xdist there
           K3JAX_TEST_DEVICE=gpu XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
             timeout -s INT -k 30 ${TESTS_LIMIT:-560} python3 -m pytest -q -p no:cacheprovider -o addopts="" $workers \
             tests/pallas_kernels/test_kda_kernels.py tests/pallas_kernels/test_mla_decode.py \
             tests/pallas_kernels/test_moe_gmm.py 2>&1 | quiet | tail -30 | tee "$W/tests.log" ;;
    moe) OUT=$W timeout 240 python3 benchmarks/moe.py --models kimi-linear 2>&1 | quiet | tee "$W/moe.log" ;;
    moe-mxfp4) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_moe_gmm_mxfp4.py 2>&1 | quiet | grep -E "passed|failed|FAILED|Interrupt|Error" | tail -20 \
              | tee "$W/moe_mxfp4_tests.log"
          OUT=$W timeout ${MXFP4_LIMIT:-240} python3 benchmarks/moe_mxfp4.py ${MXFP4_ARGS:-} 2>&1 | quiet | tee "$W/moe_mxfp4.log" ;;
    moe-hopper) [ "${HOPPER_TEST_LIMIT:-200}" = 0 ] || K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 ${HOPPER_TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              ${HOPPER_TEST_FILES:-tests/pallas_kernels/test_moe_gmm_hopper_mxfp4.py} ${HOPPER_TEST_K:+-k} ${HOPPER_TEST_K:+"$HOPPER_TEST_K"} \
              2>&1 | quiet | tee "$W/moe_hopper_tests_full.log" \
              | grep -E "passed|failed|FAILED|Interrupt|Error" | tail -30 | tee "$W/moe_hopper_tests.log"
          OUT=$W timeout ${HOPPER_LIMIT:-300} python3 benchmarks/moe_mxfp4.py ${HOPPER_FLAGS:---hopper-sweep} --tokens ${HOPPER_TOKENS:-1 8 64} \
              ${HOPPER_ARGS:-} 2>&1 | quiet | tee "$W/moe_hopper.log" ;;
    # moe-hopper-repeat: HOPPER_REPEATS (5) runs of the routed experts through the Mosaic GPU kernel (HOPPER_TOKENS,
    # HOPPER_ARGS, each under HOPPER_LIMIT), then the median of each setting over them (benchmarks/median_runs.py).
    moe-hopper-repeat) for i in $(seq ${HOPPER_REPEATS:-5}); do mkdir -p "$W/repeat$i"
              OUT=$W/repeat$i timeout ${HOPPER_LIMIT:-150} python3 benchmarks/moe_mxfp4.py --hopper --models kimi-linear \
              --tokens ${HOPPER_TOKENS:-64} ${HOPPER_ARGS:-} 2>&1 | quiet | tee "$W/moe_hopper_repeat$i.log" \
              | grep -E "hopper |Error|Traceback"
          done
          python3 benchmarks/median_runs.py "$W"/repeat*/moe_mxfp4.json --json "$W/moe_hopper_median.json" \
              | tee "$W/moe_hopper_median.md" ;;
    # (its JSON in $W/hlo, beside the modules: not over a moe-hopper step's $W/moe_mxfp4.json)
    moe-hopper-hlo) rm -rf /tmp/hlo; mkdir -p "$W/hlo"
          XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" OUT=$W/hlo timeout ${HLO_LIMIT:-150} \
              python3 benchmarks/moe_mxfp4.py --hopper --models kimi-linear --tokens ${HOPPER_TOKENS:-64} \
              --profile ${HLO_ARGS:-} 2>&1 | quiet | tail -6 | tee "$W/moe_hopper_hlo.log"
          # the optimised modules that launch the Mosaic GPU kernel: which XLA fusions build its inputs and outputs
          grep -l "mosaic_gpu" /tmp/hlo/*after_optimizations.txt 2>/dev/null \
              | xargs -r -I{} cp {} "$W/hlo/" ;;
    hopper-sass) OUT=$W timeout ${SASS_LIMIT:-120} python3 benchmarks/hopper_mxfp4_sass.py --out "$W/sass" \
              ${SASS_FORMS:+--forms} ${SASS_FORMS:-} 2>&1 | quiet \
              | grep -v "^    @" | tail -80 | tee "$W/hopper_sass.log" ;;
    moe-sweep) OUT=$W timeout 300 python3 benchmarks/moe.py --models kimi-linear --sweep 2>&1 | quiet | tee "$W/moe.log" ;;
    decode) OUT=$W timeout 420 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
              --moe auto --batch 1 64 --new-tokens 32 --profile --prefill 1x8192 64x1024 --name decode_after 2>&1 \
              | quiet | tee "$W/decode.log" ;;
    decode-fast) OUT=$W timeout ${DECODE_LIMIT:-360} python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
              --moe auto --batch ${DECODE_BATCH:-1 64} --new-tokens 32 --profile ${DECODE_ARGS:-} --name decode_fast 2>&1 | quiet | tee "$W/decode.log" ;;
    # decode-packed: one run per layout in PACKED_EXPERTS (e.g. "columns handoff"), each under DECODE_LIMIT.
    decode-packed) for layout in ${PACKED_EXPERTS:-columns}; do
              OUT=$W timeout ${DECODE_LIMIT:-420} python3 benchmarks/decode.py --model kimi-linear-48b \
              --dtype bfloat16 --kernels pallas --moe auto --packed-experts $layout --batch ${DECODE_BATCH:-1 64} \
              --new-tokens 32 --profile ${DECODE_ARGS:-} --name decode_packed_$layout 2>&1 \
              | quiet | tee "$W/decode_packed_$layout.log"; done ;;
    decode-ab) OUT=$W timeout ${DECODE_LIMIT:-300} python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch ${DECODE_BATCH:-1} --new-tokens ${DECODE_TOKENS:-32} --repeats 1 \
              --interleave ${DECODE_ROUNDS:-10} --name decode_ab ${DECODE_ARGS:-} 2>&1 | quiet | tee "$W/decode_ab.log" ;;
    decode-sweep) OUT=$W timeout ${DECODE_LIMIT:-500} python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch ${DECODE_BATCH:-1 8 32 64 128 256} --new-tokens 32 --name decode_sweep \
              2>&1 | quiet | grep -v "^ *@" | tee "$W/decode_sweep.log" ;;
    decode-host) OUT=$W timeout ${HOST_LIMIT:-240} python3 benchmarks/decode_host_trace.py --model kimi-linear-48b \
              --dtype bfloat16 --kernels pallas --moe auto --batch ${HOST_BATCH:-1} ${HOST_ARGS:-} 2>&1 | quiet \
              | tee "$W/decode_host.log" ;;
    chunk-calls) OUT=$W timeout 200 python3 benchmarks/chunk_calls.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch ${CHUNK_BATCH:-1} 2>&1 | quiet | tee "$W/chunk_calls.log" ;;
    host-costs) OUT=$W timeout 120 python3 benchmarks/host_costs.py 2>&1 | quiet | tee "$W/host_costs.log" ;;
    decode-overhead) OUT=$W timeout ${OVERHEAD_LIMIT:-300} python3 benchmarks/decode_overhead.py --model kimi-linear-48b \
              --dtype bfloat16 --kernels pallas --moe auto --batch ${OVERHEAD_BATCH:-1} --tokens 2 4 8 16 32 64 \
              ${OVERHEAD_ARGS:-} 2>&1 | quiet | tee "$W/decode_overhead.log" ;;
    skinny-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_skinny.py tests/pallas_kernels/test_moe_gmm.py tests/pallas_kernels/test_router.py \
              tests/pallas_kernels/test_rms_norm.py -k "not mgpu" 2>&1 | quiet | tail -8 \
              | tee "$W/skinny_tests.log" ;;
    skinny) OUT=$W timeout 200 python3 benchmarks/skinny.py 2>&1 | quiet | tee "$W/skinny.log" ;;
    pair-tiles) OUT=$W timeout 200 python3 benchmarks/pair_tiles.py 2>&1 | quiet | tee "$W/pair_tiles.log" ;;
    ttft) OUT=$W timeout 200 python3 benchmarks/ttft_overhead.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
              --moe auto --tokens 8192 2>&1 | quiet | tee "$W/ttft.log" ;;
    glue-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_router.py tests/pallas_kernels/test_rms_norm.py tests/pallas_kernels/test_mla_absorb.py \
              tests/pallas_kernels/test_mla_decode_hopper.py tests/pallas_kernels/test_moe_gmm.py tests/k3jax/test_mla.py \
              -k "not mgpu" 2>&1 | quiet | grep -E "passed|failed|FAILED|Interrupt|Error" | tail -20 | tee "$W/glue_tests.log" ;;
    checkpoint-read) OUT=$W timeout 200 python3 benchmarks/checkpoint_read.py 2>&1 | quiet | tee "$W/checkpoint_read.log" ;;
    decode-xla-linear) OUT=$W timeout 240 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --linear xla --batch 1 --new-tokens 32 --name decode_xla_linear 2>&1 | quiet \
              | tail -6 | tee "$W/decode_xla_linear.log" ;;
    decode-graphs) XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL \
              OUT=$W timeout 240 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
              --moe auto --batch 1 --new-tokens 32 --name decode_graphs 2>&1 | quiet | tail -8 | tee "$W/decode_graphs.log" ;;
    decode-before) OUT=$W timeout 300 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe gather --batch 1 --prompt-len 16 --new-tokens 32 --profile --name decode_before \
              2>&1 | quiet | tee "$W/decode_before.log" ;;
    gemv) sos=$(python3 -c "import glob, site; print(' '.join(glob.glob(site.getsitepackages()[0] + '/jax_plugins/*/*.so')))")
          strings $sos 2>/dev/null | grep -E "^xla_gpu_(enable_dot_strength|enable_command_buffer|graph_min|enable_triton_gemm|enable_cublaslt)" \
            | sort -u | head -20 | tee "$W/xla_flags.txt"
          OUT=$W timeout 120 python3 benchmarks/gemv.py 2>&1 | quiet | tail -22 | tee "$W/gemv.log"
          if grep -q xla_gpu_enable_dot_strength_reduction "$W/xla_flags.txt"; then
            XLA_FLAGS=--xla_gpu_enable_dot_strength_reduction=false OUT=$W timeout 120 python3 benchmarks/gemv.py \
              --name gemv_no_strength_reduction 2>&1 | quiet | tail -22 | tee "$W/gemv_nsr.log"
          fi ;;
    kda) OUT=$W timeout 420 python3 benchmarks/kda.py 2>&1 | quiet | tee "$W/kda.log" ;;
    kda-prefill) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 ${KDA_TEST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_kda_kernels.py tests/pallas_kernels/test_kda_varlen.py -k "chunk or varlen" 2>&1 \
              | quiet | grep -E "passed|failed|FAILED|Interrupt|Error|assert" | tail -20 | tee "$W/kda_prefill_tests.log"
          OUT=$W timeout ${KDA_LIMIT:-420} python3 benchmarks/kda.py --prefill-only ${KDA_ARGS:-} 2>&1 | quiet \
              | tee "$W/kda_prefill.log" ;;
    kda-bench) OUT=$W XLA_PYTHON_CLIENT_MEM_FRACTION=${KDA_MEM_FRACTION:-0.5} timeout ${KDA_LIMIT:-420} \
              python3 benchmarks/kda.py --prefill-only ${KDA_ARGS:-} 2>&1 | quiet | tee "$W/kda_bench.log" ;;
    kda-scaling) OUT=$W timeout ${KDA_LIMIT:-300} python3 benchmarks/kda.py --prefill-only --heads 32 --variants default \
              --qk-dtypes raw --lengths 1024 2048 4096 8192 16384 32768 --iters 20 --name kda_prefill_lengths 2>&1 | quiet \
              | tee "$W/kda_lengths.log"
          OUT=$W timeout ${KDA_DECODE_LIMIT:-240} python3 benchmarks/kda.py --decode-only --batches 1 8 16 32 64 128 256 \
              --warps 4 --splits 0 --ceiling --iters 30 --name kda_decode_batches 2>&1 | quiet | tee "$W/kda_batches.log" ;;
    kda-ncu) NCU=$(ncu_path)
          [ -n "$NCU" ] || { echo "kda-ncu: no ncu on this machine" | tee "$W/kda_ncu.err"; continue; }
          $NCU_ENV timeout ${NCU_LIMIT:-150} $NCU --clock-control none -k regex:${NCU_KERNELS:-kda_chunk} \
              --launch-count ${NCU_COUNT:-4} \
              --csv --page raw --metrics $(python3 benchmarks/ncu_summary.py --metrics) python3 benchmarks/kda_prefill_once.py \
              --heads ${NCU_HEADS:-32} > "$W/kda_ncu.csv" 2> "$W/kda_ncu.err"; tail -3 "$W/kda_ncu.err"
          python3 benchmarks/ncu_summary.py "$W/kda_ncu.csv" --json "$W/kda_ncu.json" | tee "$W/kda_ncu.md" ;;
    mla-ncu) # the Hopper MLA kernel's forms at one shape (MLA_NCU_SHAPE, HxBxCTX), each in its own program; the
          # second call of each is the profiled one (the first compiles)
          for impl in ${MLA_NCU_IMPLS:-hopper hopper-columns}; do
            ncu_metrics mla_ncu_$impl mosaic python3 benchmarks/mla_decode_once.py --impl $impl \
                --shape ${MLA_NCU_SHAPE:-96x64x4096}
          done ;;
    mla-ncu-source) for impl in ${MLA_NCU_IMPLS:-hopper}; do
            ncu_profile mla_ncu_src_$impl mosaic python3 benchmarks/mla_decode_once.py --impl $impl \
                --shape ${MLA_NCU_SHAPE:-96x64x4096}
          done ;;
    moe-ncu) # the MXFP4 Mosaic GPU launches at MOE_NCU_TOKENS of Kimi-Linear's experts, each in its own program (the
          # second call's launch is the profiled one): metrics, then the warp-state samples per SASS line
          for launch in ${MOE_NCU_LAUNCHES:-gate down}; do
            ncu_profile moe_ncu_${launch}_t${MOE_NCU_TOKENS:-64} mosaic python3 benchmarks/moe_mxfp4_once.py \
                --launch $launch --tokens ${MOE_NCU_TOKENS:-64} ${MOE_NCU_ARGS:-}
          done ;;
    kda-decode-ncu) ncu_profile kda_decode_ncu_b${KDA_NCU_BATCH:-64} kda_decode python3 benchmarks/kda_decode_once.py \
              --batch ${KDA_NCU_BATCH:-64} --warps ${KDA_NCU_WARPS:-4} --splits ${KDA_NCU_SPLITS:-1} ;;
    mla) OUT=$W timeout ${MLA_LIMIT:-300} python3 benchmarks/mla_decode.py ${MLA_ARGS:-} 2>&1 | quiet | tee "$W/mla.log" ;;
    mla-ptxas) OUT=$W timeout 600 python3 benchmarks/mla_ptxas.py ${MLA_PTXAS_ARGS:---impl hopper hopper-columns} 2>&1 \
              | quiet | tee "$W/mla_ptxas.log" ;;
    moe-ep) OUT=$W timeout 300 python3 benchmarks/moe_ep.py 2>&1 | quiet | tee "$W/moe_ep.log" ;;
    decode-ep2) for d in gather ragged; do
              OUT=$W timeout 420 python3 benchmarks/decode.py --model kimi-linear-48b --dtype bfloat16 --kernels pallas \
              --moe auto --batch 1 64 256 --new-tokens 32 --mesh expert=2 --ep-dispatch $d --name decode_ep2_$d 2>&1 \
              | quiet | tail -8 | tee "$W/decode_ep2_$d.log"; done ;;
    multiprocess) timeout 300 python3 benchmarks/multiprocess_gpu.py 2>&1 | quiet | tail -8 | tee "$W/multiprocess.log" ;;
    k3-layers) OUT=$W timeout ${K3_LIMIT:-400} python3 benchmarks/k3_layers.py ${K3_ARGS:-} 2>&1 | quiet | tee "$W/k3_layers.log" ;;
    kda-varlen) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_kda_varlen.py tests/pallas_kernels/test_kda_kernels.py -k "varlen or chunk" 2>&1 \
              | quiet | grep -E "passed|failed|FAILED|Interrupt|Error" | tail -20 | tee "$W/kda_varlen_tests.log"
          OUT=$W timeout ${VARLEN_LIMIT:-240} python3 benchmarks/kda_varlen.py ${VARLEN_ARGS:-} 2>&1 | quiet \
              | tee "$W/kda_varlen.log" ;;
    kda-hopper) [ "${KDA_HOPPER_TEST_LIMIT:-180}" = 0 ] || K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 ${KDA_HOPPER_TEST_LIMIT:-180} \
              python3 -m pytest -q -p no:cacheprovider \
              -o addopts="" tests/pallas_kernels/test_kda_decode_hopper.py ${KDA_HOPPER_TEST_ARGS:-} 2>&1 | quiet \
              | grep -E "passed|failed|FAILED|Interrupt|Error|assert" | tail -20 | tee "$W/kda_hopper_tests.log"
          OUT=$W timeout ${KDA_HOPPER_LIMIT:-300} python3 benchmarks/kda.py --decode-only --no-fla --warps 4 \
              --splits 1 --batches 64 256 1 8 --ceiling --profile --iters 30 --name kda_decode_hopper \
              ${KDA_HOPPER_ARGS:-} 2>&1 | quiet | tail -14 | tee "$W/kda_hopper.log" ;;
    kda-split) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_kda_kernels.py -k decode 2>&1 | quiet \
              | grep -E "passed|failed|FAILED|Interrupt|Error|assert" | tail -20 | tee "$W/kda_split_tests.log"
          OUT=$W timeout ${SPLIT_LIMIT:-240} python3 benchmarks/kda.py --decode-only --no-fla --warps 4 8 \
              --splits 1 2 4 8 2>&1 | quiet | tail -14 | tee "$W/kda_split.log" ;;
    skinny-sweep) OUT=$W timeout ${SWEEP_LIMIT:-240} python3 benchmarks/skinny.py --sweep 2>&1 | quiet \
              | tee "$W/skinny_sweep.log" ;;
    kda-state) OUT=$W timeout 240 python3 benchmarks/kda.py --decode-only --no-fla --state-dtype float32 bfloat16 \
              2>&1 | quiet | tail -14 | tee "$W/kda_state.log" ;;
    mla-merge) OUT=$W timeout ${MLA_MERGE_LIMIT:-150} python3 benchmarks/mla_merge.py 2>&1 | quiet | tee "$W/mla_merge.log" ;;
    mla-step) OUT=$W timeout ${MLA_STEP_LIMIT:-240} python3 benchmarks/mla_decode_step.py ${MLA_STEP_ARGS:-} 2>&1 | quiet \
              | tee "$W/mla_step.log" ;;
    small-launches) OUT=$W timeout 150 python3 benchmarks/small_launches.py 2>&1 | quiet | grep -v "^|---\|^| rows" \
              | tee "$W/small_launches.log" ;;
    mla-layer-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/k3jax/test_mla.py -k "hopper or cache_attention or two_part" 2>&1 | quiet \
              | grep -E "passed|failed|FAILED|Interrupt|Error|assert" | tail -30 | tee "$W/mla_layer_tests.log" ;;
    mla-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -x \
              tests/pallas_kernels/test_mla_decode_hopper.py tests/pallas_kernels/test_mla_decode.py 2>&1 | quiet \
              | tail -40 | tee "$W/mla_tests.log" ;;
    speculative-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/pallas_kernels/test_kda_decode_steps.py 2>&1 | quiet | tail -5 | tee "$W/speculative_tests.log" ;;
    speculative) OUT=$W timeout 540 python3 benchmarks/speculative.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch 1 8 64 --q 1 2 4 8 --e2e-batch 1 8 --k 4 --e2e-first \
              --embed-std 4 --error-rates 1 0.25 0.1 0 --new-tokens 64 2>&1 | quiet | tee "$W/speculative.log" ;;
    speculative-e2e) OUT=$W timeout 330 python3 benchmarks/speculative.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch 1 --q 5 --e2e-batch 1 --k 4 --e2e-first --embed-std 4 \
              --error-rates 1 0.25 0.1 0 --new-tokens 64 --name speculative_e2e 2>&1 | quiet | tee "$W/speculative_e2e.log" ;;
    prefill-tests) K3JAX_TEST_DEVICE=gpu timeout -s INT -k 30 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
              tests/k3jax/test_mla.py -k "cudnn or rotated or two_part or chunk_attention or flash_prefill" 2>&1 | quiet \
              | grep -E "passed|failed|FAILED|Interrupt|Error|assert" | tail -30 \
              | tee "$W/prefill_tests.log"
          OUT=$W timeout 150 python3 benchmarks/mla_prefill.py --shape 48b --tokens 8192 --dtype bfloat16 \
              --forms naive,cudnn,flash --iters 10 2>&1 | quiet | tail -8 | tee "$W/mla_prefill.log" ;;
    prefill) JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1 OUT=$W \
              timeout ${PREFILL_LIMIT:-560} python3 benchmarks/prefill.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --prefill ${PREFILL_ROWS:-1x8192 64x1024 1x32768 1x131072} \
              --profile 1x8192 --mla-prefill ${MLA_PREFILL:-auto} --name prefill 2>&1 | quiet | tee "$W/prefill.log" ;;
    server-load) OUT=$W timeout 200 python3 benchmarks/server_load.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --concurrency ${SERVER_LEVELS:-1 4 16 64 256} --duration 15 --budget 170 2>&1 | quiet \
              | tee "$W/server_load.log" ;;
    speculative-verify) OUT=$W timeout 300 python3 benchmarks/speculative.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --batch 1 8 64 --q 1 2 4 8 --verify-only --name speculative_verify \
              2>&1 | quiet | tee "$W/speculative_verify.log" ;;
    batch-job) OUT=$W timeout 240 python3 benchmarks/batch_job.py --model kimi-linear-48b --dtype bfloat16 \
              --kernels pallas --moe auto --requests 1024 --slots 64 --prompt-min 65 --prompt-max 128 --output-min 16 \
              --output-median 32 --output-max 128 --chunk-steps 16 --warmup-threads 8 --time-limit 220 2>&1 | quiet \
              | tee "$W/batch_job.log" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== step $step took $(( $(date +%s) - start )) s" | tee -a "$W/steps.txt"
done
# Keep the optimized decode HLO (which fusion is which kernel), compressed; drop the rest of the dumps.
for f in "$W"/hlo_dump/*decode_chunk*after_optimizations.txt; do [ -f "$f" ] && gzip -c "$f" > "$W/$(basename "$f").gz"; done
rm -rf "$W/hlo_dump" "$W/hlo_dump_prefill"
tuned=$(cd $TRITON_CACHE_DIR && find . -name '*.autotune.json')
[ -n "$tuned" ] && tar czf "$OUT/triton-autotune-$gpu_model.tgz" -C $TRITON_CACHE_DIR $tuned
tar czf "$OUT/results.tgz" -C "$W" --exclude='trace_*' . 2>/dev/null
tar czf "$OUT/traces.tgz" -C "$W" $(cd "$W" && ls -d trace_* 2>/dev/null) 2>/dev/null || true
cat "$W/steps.txt"
