#!/usr/bin/env bash
# The GPU suite (benchmarks, tests on CUDA, reports) from the repository root; all phases unless --phase N.
#   bash scripts/gpu_suite.sh [--phase N] [--out DIR] [other bench.gpu_suite options]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python -m bench.gpu_suite "$@"
