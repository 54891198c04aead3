"""The engine on CUDA, as GPU users run it: torch.compile'd forward, CUDA graphs for decode, Triton kernels,
KV cache sized by the profiling forward. Runs in the GPU suite (``python -m bench.gpu_suite``); skipped
on CPU-only machines, where tests/engine/test_cuda_graph_runner.py covers the padding and replay logic
with a test double and test_llm.py the compiled forward."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.models_util import load_hf_model, random_token_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by the GPU suite)")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Nine prompts of very different lengths: decode batches of 9 pad to the size-16 graph; as requests differ
# only in length here, every step decodes all of them.
PROMPTS = [random_token_ids(n, seed=40 + i) for i, n in enumerate([3, 17, 45, 110, 8, 64, 1, 30, 90])]


def _hf_greedy(model_dir: str) -> list[list[int]]:
    model = load_hf_model(model_dir).to("cuda")
    model.generation_config.eos_token_id = None
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=2)
            refs.append(out[0, len(prompt):].tolist())
    del model
    torch.cuda.empty_cache()
    return refs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt", "gemma2", "phi3"])
def test_cuda_graphs_and_compile_match_transformers(tiny_model_dir, arch, monkeypatch):
    """float32, so transformers is an exact reference: the default GPU path (compiled, decode graphs) and
    enforce_eager give transformers' greedy tokens, with every block free afterwards. opt, gemma2 and phi3
    bring learned positions and LayerNorm, the Triton kernels' softcap and sliding window, partial rotary
    and LongRoPE (short factors: max_model_len 256 is the tiny Phi-3's original context)."""
    monkeypatch.delenv("ENGINE_COMPILE", raising=False)
    model_dir = tiny_model_dir(arch)
    refs = _hf_greedy(model_dir)
    for enforce_eager in (False, True):
        llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=16,
                  gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
        runner = llm.llm_engine.model_runner
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        for i, out in enumerate(outputs):
            assert out.outputs[0].token_ids == refs[i], f"prompt {i} (enforce_eager={enforce_eager})"
        assert runner.compiled == (not enforce_eager), "compile fell back to eager (see the log)"
        assert (len(runner.graphs) > 0) == (not enforce_eager)
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        del llm, runner
        torch.cuda.empty_cache()


def test_cuda_kv_cache_sized_from_profile(tiny_model_dir, caplog):
    """The KV budget is gpu_memory_utilization * total - torch's peak over loading and the profile step - what
    grew outside torch (engine/worker/memory.py), logged at start-up; the block count is that budget over the
    block size (capped at what every sequence at full length could use); and after start-up (weights, KV cache,
    captured graphs) the engine holds about what it was allowed."""
    model_dir = tiny_model_dir("llama")
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated()
    with caplog.at_level("INFO", logger="engine.worker.model_runner"):
        llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=256, max_num_seqs=4,
                  gpu_memory_utilization=0.3)
    assert any("memory profile" in r.getMessage() for r in caplog.records)
    runner = llm.llm_engine.model_runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    useful = runner.max_num_seqs * runner.max_blocks_per_seq
    kv_bytes = runner.num_kv_blocks * runner._block_bytes()
    assert 0 < runner.num_kv_blocks <= useful
    assert kv_bytes <= 0.3 * total
    assert torch.cuda.memory_allocated() - allocated_before <= 0.3 * total
    del llm, runner
    torch.cuda.empty_cache()
