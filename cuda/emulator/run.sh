#!/usr/bin/env bash
# Compiles the CUDA ops for the host with the emulator and checks them against
# the CPU reference ops. No GPU needed; about a minute on 2 cores (four with ASan).
#   cuda/emulator/run.sh [elementwise|attention|attention_options|grouped_linear|small_batch_linear|sampling]       SANITIZE=1 for ASan + UBSan
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
OUT="${EMULATOR_BUILD_DIR:-$ROOT/build/emulator}"
mkdir -p "$OUT"
python3 "$HERE/make_host_sources.py" "$OUT/src"
# No -g by default: a quarter of the compile time; SANITIZE=1 (for its reports' lines) and DEBUG=1 add it.
# -fcf-protection=none: the fibers' stack switch (emu_runtime.h) returns where no call was made.
FLAGS=(-std=c++20 -O1 -w -pthread -fcf-protection=none -DPAGEDSERVE_WGMMA -include "$HERE/emu_runtime.h" -I "$OUT/src" -I "$ROOT/cpp" -I "$CUDA_HOME/include")
if [[ "${SANITIZE:-0}" == 1 ]]; then FLAGS+=(-g -fsanitize=address,undefined -fno-sanitize-recover=undefined); fi
if [[ "${DEBUG:-0}" == 1 ]]; then FLAGS+=(-g); fi
# The CPU ops the kernels are checked against; the CPU-only matrix kernels (packed, int8, GGUF) and the fused
# decoder layer have no CUDA counterpart here and are left out (~40 % of the ops' compile time).
OPS=()
for source in "$ROOT"/cpp/ops/*.cc; do
  case $(basename "$source") in packed_*|int8_*|gguf_*|decoder_layer.cc) ;; *) OPS+=("$source") ;; esac
done
SOURCES=("$HERE"/emulate_*.cc "$OUT"/src/*.cc "${OPS[@]}")
# One compiler per core, each taking every JOBS-th source (one g++ over all of them used one core: ~4 of
# the emulator's ~4.5 minutes in CI on 2 cores).
JOBS="${JOBS:-$(nproc)}"
rm -rf "$OUT/obj" && mkdir -p "$OUT/obj"
pids=()
for ((j = 0; j < JOBS; j++)); do
  (for ((i = j; i < ${#SOURCES[@]}; i += JOBS)); do
     "${CXX:-g++}" "${FLAGS[@]}" -c "${SOURCES[i]}" -o "$OUT/obj/$i.o" || exit 1
   done) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"${CXX:-g++}" "${FLAGS[@]}" "$OUT"/obj/*.o -o "$OUT/emulate_ops"
ASAN_OPTIONS=detect_leaks=0 "$OUT/emulate_ops" "$@"
# The emulated card is an H100, so head-dim-128 prefill ran the wgmma kernel; the attention cases once more
# on the mma.sync kernel, which builds without sm_90a and older cards run.
if [[ $# -eq 0 || "$1" == attention* ]]; then
  echo "attention again on the mma.sync prefill kernel (PAGEDSERVE_WGMMA=0)"
  PAGEDSERVE_WGMMA=0 ASAN_OPTIONS=detect_leaks=0 "$OUT/emulate_ops" "${1:-attention}"
fi
