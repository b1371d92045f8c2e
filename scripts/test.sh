#!/usr/bin/env bash
# The test command (README, .ci/run): installs what a fresh machine lacks,
# builds, runs the GoogleTest suites with CTest in an
# AddressSanitizer + UndefinedBehaviorSanitizer build, runs the CUDA kernels
# on the host emulator against the CPU ops (cuda/emulator, needs the CUDA
# headers only), compiles the CUDA sources with nvcc when it is present (build
# check only), then runs pytest against the installed package.
#
#   bash scripts/test.sh            everything
#   SKIP_SANITIZER=1 bash scripts/test.sh     (GoogleTest in a plain build instead)
#   SKIP_EMULATOR=1 bash scripts/test.sh      (never in CI: there the emulator must run)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=$(nproc)
step() { printf '\n==> %s  [%d s into the run]\n' "$*" "$SECONDS"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

step "system packages"
apt_needed=()
dpkg -s libgtest-dev >/dev/null 2>&1 || apt_needed+=(libgtest-dev)
command -v cmake >/dev/null || apt_needed+=(cmake)
command -v ninja >/dev/null || apt_needed+=(ninja-build)
command -v chromium >/dev/null || apt_needed+=(chromium)
if [ ${#apt_needed[@]} -gt 0 ]; then
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${apt_needed[@]}" >/dev/null
fi

step "python environment"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0          # the CPU wheel; an unpinned torch pulls a CUDA build
python -m pip install -q ".[test]"               # builds pagedserve._core with scikit-build-core
PYBIND11_DIR=$(python -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null || true)

ctest_build() {  # name, extra cmake args...
  local dir=build/$1; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPAGEDSERVE_BUILD_PYTHON=OFF \
    -DPAGEDSERVE_BUILD_TESTS=ON "$@" >/dev/null
  cmake --build "$dir" -j "$JOBS"
  ctest --test-dir "$dir" --output-on-failure -j "$JOBS"
}

# The suites run once, under the sanitizers (CMakeLists.txt builds them at -O1); the package itself was just
# built at -O3 with the same warnings-as-errors. SKIP_SANITIZER=1 runs them in a plain build instead.
if [ -z "${SKIP_SANITIZER:-}" ]; then
  step "GoogleTest (ASan + UBSan build)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest_build test-sanitize -DPAGEDSERVE_SANITIZE=ON
else
  step "GoogleTest (plain build)"
  ctest_build test-plain
fi

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -n "${SKIP_EMULATOR:-}" ] && [ -z "${CI:-}" ]; then
  step "CUDA emulator: skipped (SKIP_EMULATOR)"
elif [ -f "$CUDA_HOME/include/cuda_runtime.h" ]; then
  step "CUDA kernels on the host emulator, checked against the CPU ops (no GPU needed)"
  emulator_start=$SECONDS
  CUDA_HOME=$CUDA_HOME bash cuda/emulator/run.sh
  echo "emulator: $((SECONDS - emulator_start)) s"
elif [ -n "${CI:-}" ]; then
  echo "CI runs the CUDA emulator, which needs the CUDA headers: none under $CUDA_HOME/include (set CUDA_HOME)" >&2
  exit 1
else
  step "CUDA emulator: skipped (no CUDA headers under $CUDA_HOME/include; set CUDA_HOME)"
fi

if command -v nvcc >/dev/null && ls cuda/*.cu >/dev/null 2>&1; then
  step "CUDA sources: nvcc build check (no GPU needed)"
  cmake -S . -B build/cuda-check -G Ninja -DUSE_CUDA=ON -DPAGEDSERVE_BUILD_PYTHON=ON -DCMAKE_OPTIMIZE_DEPENDENCIES=ON \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DPython_EXECUTABLE="$(command -v python)" \
    -Dpybind11_DIR="$PYBIND11_DIR" >/dev/null
  # The kernels and their bindings only (sm_90, warnings and spills as errors): the CPU ops and the other
  # bindings were just built by pip, and the extension is linked on a GPU machine (scripts/gpu_check.sh).
  cuda_objects=$(ninja -C build/cuda-check -t targets all \
    | grep -oE '^CMakeFiles/(pagedserve_cuda\.dir/cuda|_core\.dir/cuda/bindings)/[^:]*\.o')
  # shellcheck disable=SC2086
  ninja -C build/cuda-check -j "$JOBS" $cuda_objects
fi

# Two workers on two cores (pytest-xdist), a test file each at a time so a file's module fixtures (servers,
# loaded models) start once: 24 -> ~17 minutes on CI's 2-core Zen 3. Tests marked serial time the engine
# and run alone afterwards. The 40 slowest tests are listed at the end, to see where CI's time goes.
WORKERS=${PYTEST_WORKERS:-$((JOBS < 4 ? JOBS : 4))}
step "pytest ($WORKERS workers)"
cd "$ROOT"
pytest_run() {  # pytest's exit 5 (no test selected, e.g. by a -k given to this script) is not a failure
  python -m pytest tests_py -q -p no:cacheprovider "$@" || { local rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }
}
# OMP_WAIT_POLICY=PASSIVE: with two workers on two cores, torch's OpenMP threads spinning after each parallel
# region took CPU from the other worker (2-core Zen 3, four bench smoke runs: 20% less CPU, 13% less wall).
OMP_WAIT_POLICY=PASSIVE pytest_run -n "$WORKERS" --dist loadfile -m "not serial" --durations=40 "$@"
step "pytest: tests that time the engine, alone"
pytest_run -m serial "$@"
step "done"
