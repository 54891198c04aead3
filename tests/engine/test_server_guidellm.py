"""`python -m engine serve` judged by guidellm, a load generator nobody here wrote (Red Hat's, vLLM's own
benchmarking tool), as its users run it: its openai_http backend drives the server with concurrent streams of
synthetic prompts through chat completions streamed with usage on every chunk (its defaults), behind an API key.
Every request must succeed, with exactly the tokens asked for (guidellm reads them from the server's usage), and the
server's Prometheus counters must agree with what guidellm counted. (Its other routes send what the openai client
sends in the other server tests.)"""
import json
import subprocess
import sys

import pytest

from tests.extras import require_serve_extra

require_serve_extra("guidellm", "httpx")
from tests.engine.test_server_isolation import MODEL, ServeProcess, httpx, metric_samples  # noqa: E402

API_KEY = "guidellm-key"
REQUESTS = 12
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def served(llama_dir):
    server = ServeProcess(llama_dir, "--max-model-len", "256", "--api-key", API_KEY)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in "".join(server.lines), "".join(server.lines)[-4000:]


def counters(served) -> dict[str, float]:
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
    return {name: sum(metric_samples(text, name))
            for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total")}


def test_guidellm_concurrent_streams_all_succeed_with_the_tokens_asked(served, llama_dir, tmp_path):
    before = counters(served)
    out = tmp_path / "guidellm.json"
    backend = f"kind=openai_http,target={served.url},model={MODEL},api_key={API_KEY},timeout=120"
    run = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "--backend", backend, "--profile", "kind=concurrent,streams=4",
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", f"kind=synthetic_text,prompt_tokens=24,output_tokens={OUTPUT_TOKENS}",
         "--tokenizer", f"kind=hf_auto,model={llama_dir}", "--output", f"kind=json,path={out}", "--disable-console"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, totals
    requests = benchmark["requests"]["successful"]
    assert [r["output_tokens"] for r in requests] == [OUTPUT_TOKENS] * REQUESTS
    assert all(r["prompt_tokens"] > 0 and r["output"] for r in requests)
    # The first token before the last; no more chunks than tokens (a token that ends inside a UTF-8 character,
    # frequent in the random model's text, waits for the next one).
    assert all(0 < r["time_to_first_token_ms"] < r["request_latency"] * 1000 for r in requests)
    assert all(0 < r["info"]["timings"]["token_iterations"] <= OUTPUT_TOKENS for r in requests)
    after = counters(served)
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == REQUESTS
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == REQUESTS * OUTPUT_TOKENS
    assert (after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
            == sum(r["prompt_tokens"] for r in requests))
