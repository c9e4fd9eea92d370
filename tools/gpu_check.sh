#!/usr/bin/env bash
# Everything the GPU machine does, in one call (the device tool runs it in the repo root):
#   tools/gpu_check.sh [build] [test] [bench] [sanitize]      (default: all four)
# build:    pip install --no-build-isolation . with the default QFORMATS_CUDA=AUTO: the visible GPU's
#           architecture only (sm_90 on the H200; CI compiles every architecture); prints the
#           build log's "qformats: CUDA kernels ..." line
# test:     the whole test suite; the GPU tests (tests/*/test_*_cuda.py) run here
# bench:    benchmarks/codecs.py (median of CUDA events, rotated buffers, % of copy bandwidth)
# gemm:     benchmarks/gemm.py (GEMV/GEMM table against cuBLAS fp16, _int_mm, bitsandbytes)
# generate: benchmarks/generate.py (decode tokens/s of a Llama-shaped 7B, fp16 vs each format)
# prefill:  the prefill kernels (gemm/weight_only_prefill_cuda.cuh) in one go: their GPU tests, memcheck and
#           racecheck over 135 of those tests (fp16: seven shapes of different tiles and splits, the
#           stream-K and small-scale tests; PREFILL_SANITIZE: another -k), gemm.py at 256-2048 rows (each
#           format's kernel against its dequantize + cuBLAS), benchmarks/prefill.py (a 16-layer 7B-shaped HF forward over 256-2048-token prompts)
# sanitize: compute-sanitizer memcheck and racecheck over the GPU tests (PATTERN below)
# profile:  Nsight Compute (clocks left alone) on one format's quantize, dequantize and one-row GEMV:
#           PROFILE_FMT (mixed2bit), PROFILE_PARAMS ("layout=tiled"), PROFILE_SHAPE ("4096 14336")
# Logs go to $OUT (the device tool brings them back) or /tmp/qformats-gpu.
set -uo pipefail
OUT=${OUT:-/tmp/qformats-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
stages=${*:-build test bench sanitize}
PREFILL_SANITIZE_DEFAULT="prefill and float16 and (stream_k or 129-300 or 40-3150 or 300-1800 or 40-4050 or 20-14333 or 16-3150 or small_scales)"
. "$(dirname "$0")/carried_wheels.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
status=0
for stage in $stages; do
  echo "=== $stage"
  case $stage in
    build)
      t0=$(date +%s)
      python3 -m pip install --no-build-isolation --no-deps -v . -Cbuild-dir=build/gpu \
        "-Ccmake.define.QFORMATS_FORMATS=${QF_FORMATS:-}" >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
      grep -m1 "qformats: CUDA kernels" "$OUT/build.log" | sed 's/^[ -]*//'
      echo "built in $(( $(date +%s) - t0 )) s"
      python3 -c "import qformats; print('cuda_available:', qformats.cuda_available())" ;;
    test)
      python3 -m pytest tests -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench)
      python3 benchmarks/codecs.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/codecs.txt" | tail -60 ;;
    gemm)
      python3 benchmarks/gemm.py --csv "$OUT/gemm.csv" ${GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm.txt" | tail -80 ;;
    generate)
      python3 benchmarks/generate.py ${GENERATE_ARGS:-} 2>&1 | tee "$OUT/generate.txt" | tail -30 ;;
    prefill)
      python3 -m pytest -q -p no:cacheprovider tests/gemm/test_gemm_cuda.py tests/model/test_nn_cuda.py \
        -k "prefill or many_rows or crossover or dense_path" 2>&1 | tee "$OUT/prefill-tests.log" | tail -3
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      # (all of them under racecheck would take well over the 10 minutes of one device call)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 python3 -m pytest -q -p no:cacheprovider \
          tests/gemm/test_gemm_cuda.py -k "${PREFILL_SANITIZE:-$PREFILL_SANITIZE_DEFAULT}" >"$OUT/prefill-$tool.log" 2>&1 ||
          status=1
        echo "$tool: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/prefill-$tool.log" | tail -2 | tr '\n' ' ')"
      done
      python3 benchmarks/gemm.py --shapes 4096x14336,14336x4096 --n 256,512,1024,2048 \
        --kernels int4,int4+cuBLAS,nf4,nf4+cuBLAS,q4_0,q4_0+cuBLAS 2>&1 | tee "$OUT/prefill-gemm.txt" | grep -E "^\|"
      python3 benchmarks/prefill.py ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.txt" | tail -30 ;;
    profile)
      fmt=${PROFILE_FMT:-mixed2bit} params=${PROFILE_PARAMS-layout=tiled} shape=${PROFILE_SHAPE:-"4096 14336"}
      ncu_run() {  # ncu_run NAME KERNEL-REGEX SKIP COMMAND...: one launch, its sections to $OUT/ncu-NAME.txt
        local name=$1 rx=$2 skip=$3; shift 3
        ncu --clock-control none --kernel-name-base demangled -k "regex:$rx" --launch-skip "$skip" --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
          --section Occupancy --section SchedulerStats "$@" >"$OUT/ncu-$name.txt" 2>&1
        echo "ncu $name: exit $?; $(grep -E ' Duration |Memory Throughput|Compute \(SM\) Throughput' "$OUT/ncu-$name.txt" | tr -s ' ' | tr '\n' ';')"
      }
      # shellcheck disable=SC2086
      ncu_run quantize "[^e]quantize" 2 python3 tools/profile_codec.py "$fmt" $shape --params "$params"
      # shellcheck disable=SC2086
      ncu_run dequantize dequantize 2 python3 tools/profile_codec.py "$fmt" $shape --params "$params"
      # shellcheck disable=SC2086
      ncu_run gemv weight_only 5 python3 tools/profile_gemv.py "$fmt" $shape 1 --params "$params" ;;
    sanitize)
      pattern=${SANITIZE_K:-"cuda and (large or misaligned or stream or poison)"}
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
          python3 -m pytest tests -q -p no:cacheprovider -k "$pattern" >"$OUT/sanitize-$tool.log" 2>&1
        rc=$?
        echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize-$tool.log" | tail -3 | tr '\n' ' ')"
        [ $rc = 0 ] || status=1
      done ;;
  esac
done
exit $status
