#!/usr/bin/env bash
# The serving benchmark on a GPU: starts `pagedserve serve` on the default
# model and runs bench/perf/serve_bench.py against it. Usage: gpu_serve_bench.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
python3 bench/perf/serve_bench.py --launch --serve-args "--device cuda" --rates 8,32,128,inf --num-prompts 512 \
  --name serve_cuda --out "$out"
