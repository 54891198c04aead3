"""kv_cache_dtype="fp8": the KV cache in float8 e4m3 with per-layer k/v scales (engine/config.py, the runner's cache
allocation and sizing, engine/layers/attention.py, the scales in engine/worker/loader.py).

- Exactness: the fp8 engine's logits (prefill and decode steps) equal a float32-cache engine whose K/V are rounded
  to e4m3 (x / scale, then back times scale) before they are written: the cache's write, the kernels'
  de-quantization and the scales are all right, with scale 1.0 and with a checkpoint's scales.
- Accuracy against the float32 cache, on a tiny Llama whose activations are the size of a trained model's (the
  default tiny models' initializer_range of 0.25 makes scores so sharp that any perturbation flips tokens).
- A checkpoint's scales are used: K/V scaled far beyond e4m3's 448 (q and o projections scaled back, so the model
  is the same function) run with the checkpoint's k_scale/v_scale exactly as the unscaled model does, and clip
  without them; vLLM's and compressed-tensors' names.
- Memory: twice the blocks of a 16-bit cache (four times float32's) in the same budget (fake-CUDA tier, the
  profile included), the swap space twice/four times the blocks too.
- Preemption (swap and recompute), prefix caching with chunked prefill, speculative decoding and TP=2 give the
  same tokens as the plain fp8 run.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import pagedkernels as pk
from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.worker.cache_engine import num_swap_blocks_for
from engine.worker.model_runner import EagerGraphRunner, ModelRunner
from tests.engine.models_util import ScheduledSeq as Seq, build_tiny_model_dir, engine_config, random_token_ids

FP8 = torch.float8_e4m3fn
BLOCK_SIZE = 16
# K/V of the scaled checkpoint are the tiny Llama's times this (a power of two: the scaled model's float32
# products are the original's exactly), far beyond e4m3's largest value, 448.
KV_BLOW_UP = 256.0



def _runner(model_dir: str, kv_cache_dtype: str = "auto", *, decode_graphs: bool = False) -> ModelRunner:
    """A CPU runner; decode_graphs: pure-decode batches replay through the CPU double of CUDA graphs, which runs
    the decode op (eager CPU decodes take the prefill op)."""
    config = engine_config(model_dir, device="cpu", max_model_len=256, block_size=BLOCK_SIZE, num_kv_blocks=64,
                           max_num_seqs=8, max_num_batched_tokens=512, enforce_eager=not decode_graphs,
                           kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(config, graph_runner_class=EagerGraphRunner if decode_graphs else None, compile_model=False)


def _teacher_forced_logits(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]] | None,
                           steps: int) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Each prompt prefilled (all prompts in one mixed batch), then `steps` decode steps of the whole batch. The
    token fed at each step is the given continuation's (teacher forcing), or the argmax when none is given.
    Returns the float32 logits of every step per prompt and the tokens fed."""
    seqs = [Seq(list(p), 0, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(prompts)]
    logits = runner.compute_logits_for([(s, len(s.token_ids)) for s in seqs])
    per_seq: list[list[torch.Tensor]] = [[] for _ in seqs]
    fed: list[list[int]] = [[] for _ in seqs]
    for step in range(steps):
        for i, s in enumerate(seqs):
            per_seq[i].append(logits[i].clone())
            token = continuations[i][step] if continuations is not None else int(logits[i].argmax())
            fed[i].append(token)
            s.num_computed_tokens = len(s.token_ids)
            s.token_ids.append(token)
        logits = runner.compute_logits_for([(s, 1) for s in seqs])
    return per_seq, fed


PROMPTS = [random_token_ids(n, seed=50 + i) for i, n in enumerate((23, 41, 9))]


@pytest.fixture(scope="module")
def calm_llama_dir(tmp_path_factory):
    """A tiny Llama with initializer_range 0.05: K/V up to ~3 and logits of std ~0.6, as in a trained model's
    layers, where the default tiny models (0.25: K/V up to 15, attention nearly one-hot) flip greedy tokens under
    any perturbation of a few percent."""
    return build_tiny_model_dir("llama", str(tmp_path_factory.mktemp("calm-llama")), initializer_range=0.05)


def _with_tensors(src: str, dst: str, update, config_update=None) -> str:
    """A copy of model directory `src` at `dst` whose tensors are `update(tensors)` (a dict, changed in place)
    and whose config.json gets `config_update`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    update(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    if config_update:
        with open(os.path.join(dst, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config.update(config_update)
        with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
    return dst


def _num_layers(tensors: dict) -> int:
    return len({name.split(".")[2] for name in tensors if name.startswith("model.layers.")})


# -- exactness --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["prefill-op", "decode-op"])
@pytest.mark.parametrize("scales", [None, (0.03125, 0.015625)], ids=["scale-1", "checkpoint-scales"])
def test_fp8_cache_is_attention_over_e4m3_rounded_kv(llama_dir, tmp_path, monkeypatch, scales, decode_graphs):
    """The fp8 engine = a float32-cache engine writing e4m3-rounded K/V, bit for bit, in prefill and decode steps
    (decodes through the prefill op as eager CPU runs them, or the decode op as graphs do). The checkpoint scales (k
    1/32, v 1/64) are small enough that the tiny Llama's K/V (up to ~15) clip at 448 * scale: the check covers the
    clamp as well as the rounding. They are powers of two, so the kernels' folding them into the score scale and the
    output's normalization is exact and the two engines agree exactly. With v 3/128 they agreed to rounding, and this
    model's nearly one-hot attention amplified that by chance: 6e-5 on one set of prompts, 0.027 on another; other
    scales are held to the float64 oracle by tests/pagedkernels/test_fp8_kv_cache.py."""
    model_dir = llama_dir
    k_scale, v_scale = scales or (1.0, 1.0)
    if scales is not None:
        def add_scales(tensors):
            for i in range(_num_layers(tensors)):
                tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
                tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
        model_dir = _with_tensors(llama_dir, str(tmp_path / "scaled"), add_scales)
    fp8 = _runner(model_dir, "fp8", decode_graphs=decode_graphs)
    assert fp8.kv_cache.dtype == FP8 and fp8.kv_cache.element_size() == 1
    layers = fp8.attention_layers
    assert [(layer.k_scale, layer.v_scale) for layer in layers] == [(k_scale, v_scale)] * len(layers)
    fp8_logits, fed = _teacher_forced_logits(fp8, PROMPTS, None, steps=6)

    write = pk.reshape_and_cache

    def write_e4m3_rounded(key, value, key_cache, value_cache, slot_mapping, **scale_kwargs):
        assert key_cache.dtype == torch.float32 and scale_kwargs == {"k_scale": 1.0, "v_scale": 1.0}
        key = (key / k_scale).clamp(-448, 448).to(FP8).float() * k_scale
        value = (value / v_scale).clamp(-448, 448).to(FP8).float() * v_scale
        write(key, value, key_cache, value_cache, slot_mapping)

    if decode_graphs:
        assert fp8.graphs, "the decode steps should have replayed graphs"
    # the same checkpoint: a float32 cache ignores its scales
    float32 = _runner(model_dir, "auto", decode_graphs=decode_graphs)
    monkeypatch.setattr(pk, "reshape_and_cache", write_e4m3_rounded)
    reference, _ = _teacher_forced_logits(float32, PROMPTS, fed, steps=6)
    for got_steps, want_steps in zip(fp8_logits, reference):
        for got, want in zip(got_steps, want_steps):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- accuracy against the float32 cache ----------------------------------------------------------------------------


def test_fp8_cache_logits_close_to_float32_cache(calm_llama_dir):
    """Teacher-forced on the float32 cache's greedy tokens, 3 prompts x 32 steps (prefill, then decodes): every
    step's log-probabilities within 0.25 of the float32 cache's (measured: at most 0.11, median 0.07, against
    logits of std ~0.6) and the same argmax at >= 85 % of the steps (measured 181/192 = 94 % over 6 prompts).
    e4m3 keeps 3 mantissa bits: every K and V element moves by up to 1/16 of itself, which is what the bound
    allows; the argmax differs only where the top two logits of this random-weight model are that close."""
    float32 = _runner(calm_llama_dir, "auto")
    reference, greedy = _teacher_forced_logits(float32, PROMPTS, None, steps=32)
    fp8, _ = _teacher_forced_logits(_runner(calm_llama_dir, "fp8"), PROMPTS, greedy, steps=32)
    diffs, same_argmax, steps = [], 0, 0
    for got_steps, want_steps in zip(fp8, reference):
        for got, want in zip(got_steps, want_steps):
            diffs.append((torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item())
            same_argmax += int(got.argmax()) == int(want.argmax())
            steps += 1
    assert max(diffs) < 0.25, max(diffs)
    assert min(diffs) > 1e-4, "the fp8 cache should round K/V (no difference at all means it is not fp8)"
    assert same_argmax >= 0.85 * steps, (same_argmax, steps)


# -- the checkpoint's scales ------------------------------------------------------------------------------------


def _blow_up_kv(tensors: dict) -> None:
    """K and V times KV_BLOW_UP, q and o divided by it: the same function in float32 (powers of two), K/V up to
    ~4000."""
    for i in range(_num_layers(tensors)):
        prefix = f"model.layers.{i}.self_attn."
        tensors[prefix + "k_proj.weight"] = tensors[prefix + "k_proj.weight"] * KV_BLOW_UP
        tensors[prefix + "v_proj.weight"] = tensors[prefix + "v_proj.weight"] * KV_BLOW_UP
        tensors[prefix + "q_proj.weight"] = tensors[prefix + "q_proj.weight"] / KV_BLOW_UP
        tensors[prefix + "o_proj.weight"] = tensors[prefix + "o_proj.weight"] / KV_BLOW_UP


@pytest.mark.parametrize("style", ["vllm", "compressed-tensors"])
def test_checkpoint_scales_are_used(llama_dir, tmp_path, style):
    """K/V beyond e4m3's range: with the checkpoint's scales (KV_BLOW_UP) the fp8 cache holds the same codes as
    the unscaled model's with scale 1.0, so the logits are that model's; without them (scale 1.0) K/V clip at 448
    and the logits are far off."""
    def with_scales(tensors):
        _blow_up_kv(tensors)
        for i in range(_num_layers(tensors)):
            prefix = f"model.layers.{i}.self_attn."
            if style == "vllm":
                tensors[prefix + "k_scale"] = torch.tensor(KV_BLOW_UP)
                tensors[prefix + "v_scale"] = torch.tensor(KV_BLOW_UP)
            else:   # llm-compressor's kv-cache scheme: the k/v projections' output scales, shape [1]
                tensors[prefix + "k_proj.output_scale"] = torch.tensor([KV_BLOW_UP])
                tensors[prefix + "v_proj.output_scale"] = torch.tensor([KV_BLOW_UP])

    scheme = {"quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}}
    scaled = _with_tensors(llama_dir, str(tmp_path / "scaled"), with_scales,
                           scheme if style == "compressed-tensors" else None)
    unscaled = _with_tensors(llama_dir, str(tmp_path / "no-scales"), _blow_up_kv)

    want, fed = _teacher_forced_logits(_runner(llama_dir, "fp8"), PROMPTS, None, steps=4)
    scaled_runner = _runner(scaled, "fp8")
    assert {(layer.k_scale, layer.v_scale) for layer in scaled_runner.attention_layers} == {(KV_BLOW_UP,) * 2}
    got, _ = _teacher_forced_logits(scaled_runner, PROMPTS, fed, steps=4)
    clipped, _ = _teacher_forced_logits(_runner(unscaled, "fp8"), PROMPTS, fed, steps=4)
    float32, _ = _teacher_forced_logits(_runner(scaled, "auto"), PROMPTS, fed, steps=4)
    float32_original, _ = _teacher_forced_logits(_runner(llama_dir, "auto"), PROMPTS, fed, steps=4)
    for i in range(len(PROMPTS)):
        for step in range(4):
            torch.testing.assert_close(got[i][step], want[i][step], rtol=0, atol=2e-4)
            # the scaled checkpoint is the same model (its float32 cache ignores the scales)
            torch.testing.assert_close(float32[i][step], float32_original[i][step], rtol=0, atol=2e-4)
    worst_clipped = max((c - w).abs().max().item() for cs, ws in zip(clipped, want) for c, w in zip(cs, ws))
    assert worst_clipped > 1.0, worst_clipped


def test_bad_scales_and_schemes_are_refused(llama_dir, tmp_path):
    def per_channel(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.ones(2)

    with pytest.raises(ValueError, match="k_scale.*one number per layer"):
        _runner(_with_tensors(llama_dir, str(tmp_path / "a"), per_channel), "fp8")

    def stray(tensors):
        tensors["model.layers.7.self_attn.v_scale"] = torch.tensor(2.0)

    with pytest.raises(ValueError, match="v_scale.*matches no attention layers"):
        _runner(_with_tensors(llama_dir, str(tmp_path / "b"), stray), "fp8")

    def negative(tensors):
        tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([-1.0])

    with pytest.raises(ValueError, match="positive finite"):
        _runner(_with_tensors(llama_dir, str(tmp_path / "c"), negative), "fp8")

    dynamic = {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                            "dynamic": True}}}
    model_dir = _with_tensors(llama_dir, str(tmp_path / "d"), lambda tensors: None, dynamic)
    with pytest.raises(ValueError, match="kv_cache_scheme.*dynamic=True"):
        engine_config(model_dir, device="cpu", kv_cache_dtype="fp8")
    assert engine_config(model_dir, device="cpu").cache_config.kv_cache_dtype == "auto"  # not used: not checked


def test_options(llama_dir):
    from engine.__main__ import build_parser

    parser = build_parser()
    for value in ("auto", "fp8", "fp8_e4m3"):
        args = parser.parse_args(["generate", "hi", "--model", "/m", "--kv-cache-dtype", value])
        assert EngineArgs.from_cli_args(args).kv_cache_dtype == value
        assert EngineArgs.from_cli_args(parser.parse_args(["serve", "/m", "--kv-cache-dtype", value])
                                        ).kv_cache_dtype == value
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="fp8_e5m2.*not supported.*e4m3"):
        LLM(llama_dir, kv_cache_dtype="fp8_e5m2", num_kv_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'"):
        LLM(llama_dir, kv_cache_dtype="float16", num_kv_blocks=8)
    config = engine_config(llama_dir, device="cpu", kv_cache_dtype="fp8_e4m3", num_kv_blocks=8)
    assert config.cache_config.kv_cache_dtype == "fp8_e4m3"
    assert ModelRunner(config).kv_cache.dtype == FP8


# -- memory ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, ratio", [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_fp8_holds_more_blocks_in_the_same_memory(llama_dir, dtype, ratio):
    """On the fake CUDA device (the profile step and the block arithmetic of a GPU): the same budget holds 2x the
    blocks of a 16-bit cache and 4x float32's; the fp8 runner runs a mixed batch and a decode graph through the
    ops' fake implementations; a swap space of the same size holds as many more blocks."""
    from tests.engine.fake_cuda import GiB, FakeCudaMemory, FakeGraphRunner, fake_cuda

    budget = 3 * 2 ** 20 + 12345   # bytes for the KV cache after the profile: small, so no cap on blocks applies
    counts, block_bytes = {}, {}
    # token ids drawn outside the fake mode (whose tensors hold no values)
    prompt, decoded = random_token_ids(37, seed=1), random_token_ids(20)
    decoding = {n: random_token_ids(n + 1, seed=n) for n in (3, 9)}
    for kv_cache_dtype in ("auto", "fp8"):
        memory = FakeCudaMemory(total=80 * GiB, free=79 * GiB, peak_bytes=GiB // 4, non_torch_bytes=GiB // 4)
        with fake_cuda(memory):
            config = engine_config(llama_dir, device="cuda", dtype=dtype, max_model_len=1024, block_size=BLOCK_SIZE,
                                   gpu_memory_utilization=(GiB // 2 + budget) / (80 * GiB), max_num_seqs=16,
                                   max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
            runner = ModelRunner(config, graph_runner_class=FakeGraphRunner, compile_model=False,
                                 capture_graphs_at_startup=False)
            assert runner.kv_cache.dtype == (FP8 if kv_cache_dtype == "fp8" else getattr(torch, dtype))
            assert runner.kv_cache.device.type == "cuda"
            assert runner.num_kv_blocks < 16 * math.ceil(1024 / BLOCK_SIZE)   # the budget decides, not the cap
            counts[kv_cache_dtype], block_bytes[kv_cache_dtype] = runner.num_kv_blocks, runner._block_bytes()
            if kv_cache_dtype == "fp8":
                seqs = [(Seq(prompt, 0, [5, 9, 2]), 37), (Seq(decoded, 19, [8, 6]), 1)]
                assert runner.compute_logits_for(seqs).shape == (2, runner.config.vocab_size)
                decodes = [(Seq(decoding[n], n, [4 + n]), 1) for n in (3, 9)]
                assert runner.compute_logits_for(decodes).device.type == "cuda"   # the decode graph of 2
                assert 2 in runner.graphs
            swap = num_swap_blocks_for(1 / 64, [runner.kv_cache])
            counts[kv_cache_dtype + " swap"] = swap
    assert block_bytes["auto"] == ratio * block_bytes["fp8"]
    assert counts["fp8"] in (ratio * counts["auto"] + r for r in range(ratio))
    assert counts["fp8 swap"] == ratio * counts["auto swap"]


# -- the engine's paths ------------------------------------------------------------------------------------------

REQUEST_PROMPTS = [{"prompt_token_ids": random_token_ids(n, seed=70 + i)} for i, n in enumerate([20, 45, 33, 60, 17])]
REQUEST_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(seed=1, max_tokens=36, ignore_eos=True),
    SamplingParams(n=2, seed=2, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(seed=4, max_tokens=40, ignore_eos=True),
]


def _outputs(llm: LLM, prompts=REQUEST_PROMPTS, params=REQUEST_PARAMS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [[c.token_ids for c in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def fp8_reference(tiny_model_dir):
    return _outputs(LLM(tiny_model_dir("llama"), max_model_len=256, num_kv_blocks=128, kv_cache_dtype="fp8"))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_fp8(tiny_model_dir, fp8_reference, mode):
    """A cache of 10 blocks for a batch that needs ~35: many preemptions, the same tokens as the unconstrained
    fp8 run (swapped blocks come back byte for byte; recomputed ones are written as the same codes)."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=160, num_kv_blocks=10, max_num_batched_tokens=64,
              preemption_mode=mode, swap_space=1 / 256, kv_cache_dtype="fp8")
    assert llm.llm_engine.model_runner.kv_cache.dtype == FP8
    if mode == "swap":
        swap_cache = llm.llm_engine.cache_engine.swap_cache
        assert swap_cache.dtype == FP8 and swap_cache.device.type == "cpu"
    assert _outputs(llm) == fp8_reference
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions >= 3, scheduler.num_preemptions
    assert (scheduler.num_swap_preemptions > 0) == (mode == "swap")


def test_prefix_caching_and_chunked_prefill_under_fp8(tiny_model_dir, fp8_reference):
    """Prompts sharing a 40-token prefix, run after the prompt that caches it, in 16-token chunks: the same tokens as
    each prompt alone with no cache and no chunking (a cached block holds the codes a recomputation writes)."""
    model_dir = tiny_model_dir("llama")
    shared = random_token_ids(40, seed=11)
    prompts = [{"prompt_token_ids": shared + random_token_ids(n, seed=20 + i)} for i, n in enumerate((7, 30, 3))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model_dir, max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False, kv_cache_dtype="fp8")
    want = [_outputs(plain, [p], [params]) for p in prompts]
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16, kv_cache_dtype="fp8")
    got = [_outputs(llm, prompts[:1], [params])] + [[o] for o in _outputs(llm, prompts[1:], [params] * 2)]
    assert got == want
    assert llm.llm_engine.get_metrics().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("proposer", ["ngram", "self-draft"])
def test_speculative_decoding_under_fp8(tiny_model_dir, proposer):
    """Drafts verified against the fp8 cache (n-gram lookups, or the model as its own draft, whose cache is fp8
    too): the greedy tokens of the plain fp8 run, drafts accepted."""
    model_dir = tiny_model_dir("llama")
    motif = random_token_ids(12, seed=3)
    prompts = [{"prompt_token_ids": motif * 4 + random_token_ids(5, seed=i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = _outputs(LLM(model_dir, max_model_len=256, num_kv_blocks=64, kv_cache_dtype="fp8"), prompts, [params] * 3)
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if proposer == "ngram"
            else {"model": model_dir, "num_speculative_tokens": 3})
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, kv_cache_dtype="fp8", speculative_config=spec)
    if proposer == "self-draft":
        assert llm.llm_engine.model_runner.drafter.kv_cache.dtype == FP8
    assert _outputs(llm, prompts, [params] * 3) == want
    stats = llm.llm_engine.get_metrics().spec_decode
    assert stats.num_accepted_tokens > 0, stats


def test_tp2_equals_tp1_under_fp8(tiny_model_dir):
    """Each rank's cache holds its KV heads in fp8 with the same scales: the tokens of the unsharded fp8 run."""
    model_dir = tiny_model_dir("llama")
    prompts, params = REQUEST_PROMPTS[:3], REQUEST_PARAMS[:3]
    want = _outputs(LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32,
                        kv_cache_dtype="fp8"), prompts, params)
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, kv_cache_dtype="fp8",
              tensor_parallel_size=2)
    try:
        assert _outputs(llm, prompts, params) == want
    finally:
        llm.llm_engine.shutdown()
