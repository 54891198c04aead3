#!/usr/bin/env bash
# The benchmarks run end to end on tiny models (pytest marker bench_e2e): the GPU suite's dry run with only the GPU
# image's packages importable, the report's dry runs, and the quick runs of bench.engine_cpu, bench.moe_cpu,
# bench.lora_engine_cpu and bench.tp_cpu. About 3 minutes on 2 cores; run after changing bench/ and before a GPU
# session (a phase that would fail on the lent machine fails here first). The default `pytest` leaves them out.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider -m bench_e2e bench "$@"
