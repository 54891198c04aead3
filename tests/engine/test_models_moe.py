"""The mixture-of-experts architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; tiny random-weight models of
tests/engine/models_util.py) through the engine:

- greedy tokens identical to transformers in float32, in one run with chunked prefill, prefix-cache hits,
  preemption and n > 1 (the CPU engine's decode steps replay CPU graphs of the native MoE kernels);
- tensor parallelism (experts split along their intermediate size) over 2 and 3 gloo ranks and expert
  parallelism (experts split whole, 16 over 3 ranks unevenly) give the single process's log-probabilities over a
  mixed chunked-prefill / decode schedule; the full engine with expert parallelism gives TP=1's tokens;
- the config mapping of each architecture and its refusals; dummy weights from a config.json alone; the CUDA
  paths on the fake device (fake implementations of the MoE ops, decode graphs captured with no host sync).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine import distributed as engine_dist
from engine.config import ModelConfig
from engine.distributed.parallel_state import free_port, planned_layout
from engine.layers.fused_moe import FusedMoE, expert_range
from engine.models import get_model_class, load_model_config
from engine.worker.model_runner import ModelRunner
from tests.engine.models_util import (TINY_MOE_ARCHITECTURES, engine_config, load_hf_model, random_token_ids,
                                      tiny_config)
from tests.engine.test_model_runner import LOGPROB_ATOL, MIXED_SCHEDULE, mixed_sequences, scatter_blocks

MAX_TOKENS = 10
# Very different lengths; the last two share the 110-token prompt's first 64 tokens (4 blocks).
_LONG = random_token_ids(110, seed=11)
PROMPTS = [random_token_ids(3, seed=1), random_token_ids(45, seed=2), _LONG]
SHARED = [_LONG[:64] + random_token_ids(9, seed=3), _LONG[:80] + random_token_ids(30, seed=4)]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", TINY_MOE_ARCHITECTURES)
def test_greedy_matches_transformers(tiny_model_dir, arch):
    """24-token steps cut the prompts into chunks mixed with decodes; 10 blocks of 16 cannot hold the batch
    (preemption, recompute); the shared prompts hit the 110-token prompt's cached blocks; n=2 greedy twice."""
    model_dir = tiny_model_dir(arch)
    hf = load_hf_model(model_dir)
    llm = LLM(model_dir, max_num_batched_tokens=24, enable_prefix_caching=True, num_kv_blocks=10, max_model_len=160)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [greedy, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), greedy]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    shared = llm.generate([{"prompt_token_ids": p} for p in SHARED], greedy, use_tqdm=False)
    for prompt, out in zip(PROMPTS + SHARED, outputs + shared):
        expected = _hf_greedy(hf, prompt)
        assert [c.token_ids for c in out.outputs] == [expected] * len(out.outputs), f"prompt of {len(prompt)}"
    assert len(outputs[1].outputs) == 2
    assert [o.num_cached_tokens for o in shared] == [64, 80]
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    layers = [m for m in engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.w13_packed is not None and m.w13_weight.numel() == 0 for m in layers), \
        "the CPU engine runs the native kernel on packed experts"


# ---------------------------------------------------------------------------------------------
# tensor and expert parallelism
# ---------------------------------------------------------------------------------------------

# world size -> (arch, enable_expert_parallel): the shared expert's partial sum (Qwen2-MoE) and OLMoE's q/k norms
# over gathered heads under expert slices, Mixtral's experts whole; 3 ranks slicing Qwen3-MoE's experts and
# sharing its 16 experts unevenly (6, 5, 5). (Qwen2-MoE whole over 2 ranks: the engine test below.)
PARALLEL_CASES = {2: [("qwen2_moe", False), ("olmoe", False), ("mixtral", True)],
                  3: [("qwen3_moe", False), ("qwen3_moe", True)]}


def _schedule_logprobs(model_dir: str, expert_parallel: bool) -> list[torch.Tensor | None]:
    config = engine_config(model_dir, device="cpu", max_model_len=256, block_size=16, num_kv_blocks=64, max_num_seqs=8,
                           max_num_batched_tokens=512, enforce_eager=True, enable_expert_parallel=expert_parallel)
    runner = ModelRunner(config)
    runner.kv_cache.fill_(float("nan"))
    seqs = mixed_sequences(runner.config.vocab_size, seed=3)
    scatter_blocks(seqs, 64, seed=4)
    outputs = []
    for step in MIXED_SCHEDULE:
        scheduled = [(seqs[i], n) for i, n in step]
        logits = runner.compute_logits_for(scheduled)
        outputs.append(None if logits is None else torch.log_softmax(logits, dim=-1))
        for seq, n in scheduled:
            seq.num_computed_tokens += n
    return outputs


def _parallel_worker(rank: int, world_size: int, init_method: str, cases: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    engine_dist.init_distributed_environment(world_size, rank, init_method=init_method, backend="gloo")
    try:
        for arch, model_dir, expert_parallel in cases:
            outputs = _schedule_logprobs(model_dir, expert_parallel)
            if rank == 0:
                torch.save(outputs, os.path.join(out_dir, f"{arch}-{expert_parallel}.pt"))
    finally:
        engine_dist.destroy_distributed_environment()


@pytest.mark.parametrize("world_size", sorted(PARALLEL_CASES))
def test_parallel_logprobs_equal_one_process(tiny_model_dir, tmp_path, world_size):
    cases = [(arch, tiny_model_dir(arch), ep) for arch, ep in PARALLEL_CASES[world_size]]
    mp.spawn(_parallel_worker, args=(world_size, f"tcp://127.0.0.1:{free_port()}", cases, str(tmp_path)),
             nprocs=world_size, join=True)
    references = {}
    for arch, model_dir, expert_parallel in cases:
        if arch not in references:
            references[arch] = _schedule_logprobs(model_dir, False)
        sharded = torch.load(tmp_path / f"{arch}-{expert_parallel}.pt")
        for step, (expected, actual) in enumerate(zip(references[arch], sharded)):
            assert torch.isfinite(actual).all(), f"{arch} step {step}: non-finite log-probabilities"
            torch.testing.assert_close(actual, expected, atol=LOGPROB_ATOL, rtol=0,
                                       msg=lambda m: f"{arch} ep={expert_parallel} step {step}: {m}")


def test_engine_with_expert_parallelism_equals_tp1(tiny_model_dir):
    """LLM(tensor_parallel_size=2, enable_expert_parallel=True): a spawned worker holds half the experts (and
    half of Qwen2-MoE's shared expert); chunked prefill, prefix hits, n > 1 and recompute preemption give
    TP=1's tokens."""
    from tests.engine.test_tp_engine import _generate

    model_dir = tiny_model_dir("qwen2_moe")
    kwargs = dict(num_kv_blocks=12, max_model_len=192, preemption_mode="recompute")
    expected, preemptions_1, hit_rate_1 = _generate(model_dir, 1, **kwargs)
    actual, preemptions_2, hit_rate_2 = _generate(model_dir, 2, enable_expert_parallel=True, **kwargs)
    assert actual == expected
    assert hit_rate_2 == hit_rate_1 > 0 and preemptions_2 == preemptions_1 > 0


def test_expert_shares():
    assert [expert_range(16, 3, r) for r in range(3)] == [(0, 6), (6, 11), (11, 16)]
    assert [expert_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]


# ---------------------------------------------------------------------------------------------
# configs, refusals, dummy weights, the CUDA paths
# ---------------------------------------------------------------------------------------------


def _config(arch: str, tmp_path, **overrides) -> ModelConfig:
    config = tiny_config(arch, **overrides)
    config.to_json_file(str(tmp_path / "config.json"))
    return load_model_config(str(tmp_path), device="cpu")


def test_config_mapping(tmp_path):
    qwen3 = _config("qwen3_moe", tmp_path)
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size) == (16, 4, 48)
    assert qwen3.moe_layers == (True, False) and qwen3.intermediate_size == 192 and qwen3.norm_topk_prob
    mixtral = _config("mixtral", tmp_path)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (True, True) and mixtral.moe_intermediate_size == 96
    qwen2 = _config("qwen2_moe", tmp_path, decoder_sparse_step=2)
    assert qwen2.moe_layers == (False, True) and qwen2.shared_expert_intermediate_size == 96
    assert qwen2.attention_bias and not qwen2.norm_topk_prob
    olmoe = _config("olmoe", tmp_path)
    assert olmoe.clip_qkv == 3.0 and olmoe.num_experts == 8 and not olmoe.attention_bias
    # config.json written by hand with the hub's key for Qwen3-MoE's experts ("num_experts")
    text = json.loads((tmp_path / "config.json").read_text()) | {"architectures": ["Qwen3MoeForCausalLM"],
                                                                   "num_experts": 12, "num_experts_per_tok": 2,
                                                                   "moe_intermediate_size": 32}
    text.pop("num_local_experts", None)
    (tmp_path / "config.json").write_text(json.dumps(text))
    assert load_model_config(str(tmp_path), device="cpu").num_experts == 12
    (tmp_path / "config.json").write_text(json.dumps(text | {"num_experts_per_tok": 13}))
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=12\]"):
        load_model_config(str(tmp_path), device="cpu")


def test_shapes_that_do_not_shard_are_refused(tmp_path):
    """Built on the meta device as a rank of the planned group (what the engine checks before it starts a
    worker): 3 ranks split Qwen3-MoE's experts either way; 5 do not split an intermediate size of 48; 32 ranks
    cannot share 16 experts; a quantized MoE checkpoint is refused by name."""
    import dataclasses

    config = _config("qwen3_moe", tmp_path)
    model_class = get_model_class(config.architecture)
    for expert_parallel in (False, True):
        with planned_layout(3, 2), torch.device("meta"):
            model = model_class(dataclasses.replace(config, enable_expert_parallel=expert_parallel))
        experts = model.model.layers[0].mlp.experts
        assert experts.w13_weight.shape == ((5, 96, 128) if expert_parallel else (16, 32, 128))
    with planned_layout(5, 0), torch.device("meta"), \
            pytest.raises(ValueError, match=r"moe_intermediate_size=48 is not divisible by tensor_parallel_size=5"):
        FusedMoE(16, 4, 128, 48, renormalize=True)
    with planned_layout(32, 0), torch.device("meta"), \
            pytest.raises(ValueError, match="num_experts=16 cannot be shared by tensor_parallel_size=32"):
        FusedMoE(16, 4, 128, 48, renormalize=True, enable_expert_parallel=True)
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\) of mixture-of-experts models"):
        LLM(str(tmp_path), load_format="dummy", quantization="fp8", skip_tokenizer_init=True, num_kv_blocks=8,
            max_model_len=64)


def test_dummy_weights_from_a_config_alone(tmp_path):
    """load_format="dummy" (the benchmarks' full-size models): a directory holding only config.json runs, with
    experts in float32 panels (random values are no 16-bit numbers)."""
    tiny_config("olmoe").to_json_file(str(tmp_path / "config.json"))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64)
    out = llm.generate({"prompt_token_ids": random_token_ids(12, seed=1)},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    layer = next(m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, FusedMoE))
    assert layer.w13_packed.dtype == torch.float32 and torch.isfinite(layer.w13_packed).all()


def test_cli_generate_runs_a_moe_directory(tiny_model_dir, capsys):
    """``python -m engine generate --model <MoE dir>`` as for dense models (in-process), greedy: the text of the
    engine's tokens."""
    from engine.__main__ import main

    model_dir = tiny_model_dir("qwen3_moe")
    main(["generate", "Once upon a time", "--model", model_dir, "--max-tokens", "6", "--num-kv-blocks", "16",
          "--max-model-len", "128"])
    printed = capsys.readouterr().out
    llm = LLM(model_dir, num_kv_blocks=16, max_model_len=128, enforce_eager=True)
    expected = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert printed == expected[0].outputs[0].text + "\n" and expected[0].outputs[0].token_ids


def test_the_cuda_paths_capture_with_no_host_sync(tiny_model_dir):
    """Qwen2-MoE (router, experts, shared expert) on the fake CUDA device: the forward runs through the MoE ops'
    fake implementations and every decode graph of the ladder captures, with no host sync."""
    from tests.engine.fake_cuda import FakeCudaMemory, FakeGraphRunner, GiB, fake_cuda
    from tests.engine.test_fake_cuda import _mixed_batch, _runner

    model_dir = tiny_model_dir("qwen2_moe")
    FakeGraphRunner.captured_batch_sizes = []
    batch = _mixed_batch()   # token ids drawn before the fake device takes over
    with fake_cuda(FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)):
        runner = _runner(model_dir, num_kv_blocks=64)
        assert FakeGraphRunner.captured_batch_sizes
        layer = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
        assert layer.w13_weight.is_cuda and layer.w13_packed is None   # GPUs multiply the stacked weights
        logits = runner.compute_logits_for(batch)
        assert logits.shape == (4, runner.config.vocab_size) and logits.device.type == "cuda"


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_moe_gguf_is_refused_naming_what_is_missing(tmp_path, arch):
    """llama.cpp writes Qwen3-MoE as qwen3moe and Mixtral as llama with an expert count, its experts stacked in
    ffn_*_exps tensors: a clear refusal naming them, not an unsupported architecture or an unknown tensor."""
    import numpy as np
    gguf = pytest.importorskip("gguf")

    path = tmp_path / f"{arch}-moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"mixture-of-experts GGUF \({arch}, 8 experts; tensors such as "
                                         r"'blk.0.ffn_gate_exps.weight'\) is not supported.*HF safetensors"):
        LLM(str(path))
