#!/usr/bin/env bash
# In-tree development build: compiles pagedserve._core (and, with
# PAGEDSERVE_BUILD_TESTS, the GoogleTest suites) under build/dev and copies the
# extension into python/pagedserve/, so `PYTHONPATH=python pytest` runs the tree.
# Extra arguments go to CMake, e.g. -DUSE_CUDA=ON for a compile check of cuda/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=${BUILD_DIR:-build/dev}
cmake -S . -B "$BUILD" -G Ninja \
  -DPAGEDSERVE_BUILD_PYTHON=ON -DPAGEDSERVE_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" "$@" >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
cp "$BUILD"/_core*.so python/pagedserve/
# An editable install (pip install -e .) keeps its own copy of the extension in site-packages, which its
# import hook serves even under PYTHONPATH=python: refresh that copy too, or tests run the old one.
installed=$("$PY" -I -c "import pagedserve._core as c; print(c.__file__)" 2>/dev/null || true)
case "$installed" in
  */site-packages/pagedserve/_core*.so) cp "$BUILD"/_core*.so "$(dirname "$installed")/" ;;
esac
