#!/usr/bin/env bash
# Whole GPU suite (tests on CUDA + kernel benchmarks + report), from the repository root.
#   bash scripts/gpu_suite.sh [--out DIR] [other bench.gpu_suite options]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python -m bench.gpu_suite "$@"
