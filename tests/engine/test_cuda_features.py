"""Engine features on CUDA that had run only on the CPU's kernels: speculative decoding (n-gram proposals, a draft
model, the model as its own draft), quantized linears (GPTQ and AWQ checkpoints through the Triton int4/int8 GEMM,
fp8 checkpoints through the fp8 GEMM), the fp8 KV cache (Triton attention over e4m3 codes) and mixture-of-experts
models (the Triton fused-MoE kernel). Each is held to the reference its CPU tests use, computed on the GPU in the same
test: the plain engine's greedy tokens, the de-quantized float32 model's log-probabilities, the float32 cache's,
transformers' greedy tokens. The feature side runs as GPU users run it (compiled forward,
CUDA graphs for pure-decode steps), the reference eagerly.

Runs in the GPU suite's engine-tests phase (``python -m bench.gpu_suite --phase engine-tests``); skipped on CPU-only
machines, where tests/engine/test_spec_decode.py, test_quantization.py and test_kv_cache_fp8.py hold the same
behaviour on the CPU kernels."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.fused_moe import FusedMoE
from engine.worker.model_runner import ModelRunner
from tests.engine import spec_util as spec
from tests.engine.models_util import (TINY_MOE_ARCHITECTURES, build_tiny_model_dir, engine_config, load_hf_model,
                                      random_token_ids)
from tests.engine.quant_checkpoints import INT_CHECKPOINT_CASES, quantize_model_dir
from tests.engine.test_kv_cache_fp8 import PROMPTS as FP8_PROMPTS, _teacher_forced_logits
from tests.engine.test_model_runner import BLOCK_SIZE, MIXED_SCHEDULE, mixed_sequences, run_schedule, scatter_blocks

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by the GPU suite)")

# float32 on both sides, the Triton int4/int8 GEMM's fp32 dots exact ("ieee"): the CPU tests measured 3e-5 to 4e-5
# between the quantized and the de-quantized model on exact kernels; other summation orders on the GPU stay far
# below this.
WQ_LOGPROB_ATOL = 1e-3
# fp8 checkpoints on a GPU with fp8 tensor cores quantize the activations too (per token, or with the checkpoint's
# static scale), as vLLM does; the CPU keeps them in float32. On the calm tiny Llama (activations the size of a
# trained model's) that rounding moves log-probabilities by 0.12-0.13 (measured on the CPU with the activations
# rounded to e4m3 the GPU's way, for the three checkpoints below), a per-tensor weight scale 25% off by 0.24,
# per-channel scales in the wrong order by 0.91.
FP8_LOGPROB_ATOL = 0.2


def _free_cuda() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- speculative decoding ------------------------------------------------------------------------------------------


def test_speculative_decoding_keeps_the_greedy_output(llama_dir, tiny_model_dir):
    """n-gram proposals and a random-weight draft model (another architecture) verified on the GPU: the plain
    engine's greedy tokens, drafts proposed; every block free after each run (generate_checked checks)."""
    plain, _ = spec.generate_checked(llama_dir, device=DEVICE, dtype="float32", enforce_eager=True)
    want = spec.completion_tokens(plain)
    draft = {"model": tiny_model_dir("qwen3"), "num_speculative_tokens": spec.K}
    for name, config in (("ngram", spec.NGRAM), ("draft model", draft)):
        outputs, stats = spec.generate_checked(llama_dir, device=DEVICE, dtype="float32", speculative_config=config)
        assert spec.completion_tokens(outputs) == want, name
        assert stats.num_drafts > 0 and stats.num_draft_tokens > 0, (name, stats)
        _free_cuda()


def test_speculative_verification_graphs_keep_the_greedy_output(llama_dir, monkeypatch):
    """ENGINE_SPEC_DECODE_GRAPHS=1: single-stream n-gram decoding (each verification step one sequence's 1 + drafts
    tokens) replays the CUDA graphs of (1, q), captured on first use, and gives the plain engine's greedy tokens, with
    the drafts and acceptances of the same engine without them; every block free after each run."""
    plain = [spec.completion_tokens(spec.generate_checked(llama_dir, prompts=[p], device=DEVICE, dtype="float32")[0])
             for p in spec.spec_prompts()]
    _free_cuda()
    runs = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("ENGINE_SPEC_DECODE_GRAPHS", graphs)
        llm = LLM(llama_dir, device=DEVICE, dtype="float32", max_model_len=160, num_kv_blocks=64,
                  speculative_config=spec.NGRAM)
        try:
            runner = llm.llm_engine.model_runner
            assert runner.spec_graphs == (graphs == "1")
            tokens = [spec.completion_tokens(llm.generate([p], spec.GREEDY, use_tqdm=False))
                      for p in spec.spec_prompts()]
            runs[graphs] = (tokens, llm.llm_engine.get_metrics().spec_decode, sorted(runner.verify_graphs))
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_cuda()
    assert runs["0"][0] == runs["1"][0] == plain
    assert runs["0"][1] == runs["1"][1] and runs["1"][1].num_drafts > 0
    assert runs["0"][2] == [] and runs["1"][2] and all(b == 1 for b, _ in runs["1"][2])


def test_speculative_draft_model_graphs_keep_the_greedy_output(llama_dir, monkeypatch):
    """ENGINE_SPEC_DECODE_GRAPHS=1 with the model as its own draft: the proposal steps replay the draft's CUDA graphs
    (the four prompts at once: the graph of 4, then smaller ones as requests finish), the verification steps theirs,
    and the greedy tokens are the engine's without graphs and the plain engine's; (nearly) every draft accepted."""
    draft = {"model": llama_dir, "num_speculative_tokens": spec.K}
    runs = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("ENGINE_SPEC_DECODE_GRAPHS", graphs)
        llm = LLM(llama_dir, device=DEVICE, dtype="float32", max_model_len=160, num_kv_blocks=64,
                  speculative_config=draft)
        try:
            drafter = llm.llm_engine.model_runner.drafter
            assert drafter.graphs_on == (graphs == "1")
            tokens = spec.completion_tokens(llm.generate(spec.spec_prompts(), spec.GREEDY, use_tqdm=False))
            runs[graphs] = (tokens, llm.llm_engine.get_metrics().spec_decode, sorted(drafter.graphs))
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_cuda()
    plain, _ = spec.generate_checked(llama_dir, device=DEVICE, dtype="float32")
    assert runs["0"][0] == runs["1"][0] == spec.completion_tokens(plain)
    # (a padded batch's products may round apart from an unpadded one's on the GPU: near-ties may draft apart)
    assert all(stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95 for _, stats, _ in runs.values())
    assert runs["0"][2] == [] and 4 in runs["1"][2]
    _free_cuda()


def test_self_draft_is_accepted_when_sampling(llama_dir):
    """The model as its own draft, sampled (top-p, seeded): q = p up to the GPU's summation order, so (nearly)
    every draft is accepted, and every request gets its max_tokens."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=21, ignore_eos=True)
    outputs, stats = spec.generate_checked(llama_dir, params, device=DEVICE, dtype="float32",
                                          speculative_config={"model": llama_dir, "num_speculative_tokens": spec.K})
    assert all(len(c.token_ids) == params.max_tokens for o in outputs for c in o.outputs)
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.99, stats
    _free_cuda()


# -- quantized linears ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calm_llama_dir(tmp_path_factory):
    """test_kv_cache_fp8.py's tiny Llama with activations the size of a trained model's."""
    return build_tiny_model_dir("llama", str(tmp_path_factory.mktemp("calm-llama")), initializer_range=0.05)


def _runner(model_dir: str, *, enforce_eager: bool, kv_cache_dtype: str = "auto") -> ModelRunner:
    config = engine_config(model_dir, device=DEVICE, dtype="float32", max_model_len=256, block_size=BLOCK_SIZE,
                           num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=512, enforce_eager=enforce_eager,
                           kv_cache_dtype=kv_cache_dtype)
    # graphs captured when a pure-decode step first needs one: `runner.graphs` then says that decodes replayed them
    return ModelRunner(config, capture_graphs_at_startup=False)


def _schedule_logprobs(model_dir: str, *, enforce_eager: bool) -> list[tuple[int, int, torch.Tensor]]:
    """tests/engine/test_model_runner.py's mixed schedule (prompts in chunks beside decodes, then pure-decode steps,
    which replay CUDA graphs when not eager): each entry's log-probabilities, on the host."""
    runner = _runner(model_dir, enforce_eager=enforce_eager)
    runner.kv_cache.fill_(float("nan"))   # a read of a slot not written shows
    seqs = mixed_sequences(runner.config.vocab_size, seed=7)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=2)
    results = [(i, p, logprobs.float().cpu()) for i, p, logprobs in run_schedule(runner, seqs, MIXED_SCHEDULE)]
    assert bool(runner.graphs) == (not enforce_eager), sorted(runner.graphs)
    del runner
    _free_cuda()
    return results


def _max_logprob_difference(quant_dir: str, deq_dir: str, *, greedy: bool) -> float:
    got = _schedule_logprobs(quant_dir, enforce_eager=False)
    want = _schedule_logprobs(deq_dir, enforce_eager=True)
    worst = 0.0
    for (index, position, logprobs), (_, _, expected) in zip(got, want, strict=True):
        assert torch.isfinite(logprobs).all(), f"seq {index} position {position}: non-finite log-probabilities"
        worst = max(worst, float((logprobs - expected).abs().max()))
        if greedy:
            assert int(logprobs.argmax()) == int(expected.argmax()), f"seq {index} position {position}: greedy"
    return worst


@pytest.mark.parametrize("method, opts", INT_CHECKPOINT_CASES)
def test_int_checkpoints_match_the_dequantized_model(llama_dir, tmp_path, method, opts):
    quant_dir, deq_dir = quantize_model_dir(llama_dir, str(tmp_path), method, **opts)
    worst = _max_logprob_difference(quant_dir, deq_dir, greedy=True)
    assert worst <= WQ_LOGPROB_ATOL, f"log-probabilities differ by {worst} > {WQ_LOGPROB_ATOL}"


@pytest.mark.parametrize("method, opts", [
    ("fp8", dict(activation_scheme="dynamic")),
    ("fp8", dict(activation_scheme="static")),
    ("compressed-tensors", dict(strategy="channel", static=False)),
], ids=["fp8-dynamic", "fp8-static", "compressed-tensors-channel"])
def test_fp8_checkpoints_stay_close_to_the_dequantized_model(calm_llama_dir, tmp_path, method, opts):
    quant_dir, deq_dir = quantize_model_dir(calm_llama_dir, str(tmp_path), method, **opts)
    worst = _max_logprob_difference(quant_dir, deq_dir, greedy=False)
    assert worst <= FP8_LOGPROB_ATOL, f"log-probabilities differ by {worst} > {FP8_LOGPROB_ATOL}"


# -- the fp8 KV cache ----------------------------------------------------------------------------------------------


def test_fp8_kv_cache_close_to_the_float32_cache(calm_llama_dir):
    """test_kv_cache_fp8.py's accuracy test on the GPU: teacher-forced on the float32 cache's greedy tokens (3
    prompts x 32 steps: a prefill, then decode steps replaying CUDA graphs), every step's log-probabilities within
    0.25 of the float32 cache's, the same argmax at >= 85 % of the steps, and some difference (the cache is fp8)."""
    reference = _runner(calm_llama_dir, enforce_eager=True)
    want, greedy = _teacher_forced_logits(reference, FP8_PROMPTS, None, steps=32)
    del reference
    _free_cuda()
    runner = _runner(calm_llama_dir, enforce_eager=False, kv_cache_dtype="fp8")
    assert runner.kv_cache.dtype == torch.float8_e4m3fn and runner.kv_cache.is_cuda
    got, _ = _teacher_forced_logits(runner, FP8_PROMPTS, greedy, steps=32)
    assert runner.graphs, "no decode step went through a CUDA graph"
    diffs, same_argmax, steps = [], 0, 0
    for got_steps, want_steps in zip(got, want, strict=True):
        for g, w in zip(got_steps, want_steps, strict=True):
            diffs.append((torch.log_softmax(g.float(), -1) - torch.log_softmax(w.float(), -1)).abs().max().item())
            same_argmax += int(g.argmax()) == int(w.argmax())
            steps += 1
    assert max(diffs) < 0.25, max(diffs)
    assert min(diffs) > 1e-4, "the fp8 cache should round K/V (no difference at all means it is not fp8)"
    assert same_argmax >= 0.85 * steps, (same_argmax, steps)
    del runner
    _free_cuda()


# -- mixture of experts --------------------------------------------------------------------------------------------

MOE_PROMPTS = [random_token_ids(n, seed=60 + i) for i, n in enumerate((3, 45, 110, 17))]
MOE_MAX_TOKENS = 10


@pytest.mark.parametrize("arch", TINY_MOE_ARCHITECTURES)
def test_moe_models_match_transformers(tiny_model_dir, arch):
    """Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and OLMoE through the Triton fused-MoE kernel, compiled, decode
    steps in CUDA graphs, float32: transformers' greedy tokens (run on the GPU too), prompts in 24-token chunks
    beside decodes."""
    model_dir = tiny_model_dir(arch)
    hf = load_hf_model(model_dir).to(DEVICE)
    want = []
    with torch.inference_mode():
        for prompt in MOE_PROMPTS:
            out = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=MOE_MAX_TOKENS, do_sample=False,
                              pad_token_id=2, eos_token_id=None)
            want.append(out[0, len(prompt):].tolist())
    del hf
    _free_cuda()
    llm = LLM(model_dir, device=DEVICE, dtype="float32", max_model_len=160, max_num_seqs=8,
              max_num_batched_tokens=24, gpu_memory_utilization=0.3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in MOE_PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=MOE_MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    runner = llm.llm_engine.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.w13_packed is None and m.w13_weight.is_cuda for m in layers), \
        "the GPU engine runs the Triton kernel on the stacked experts"
    assert runner.compiled and runner.graphs
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.llm_engine.shutdown()
    del llm, runner, layers
    _free_cuda()


# -- the few-row decoder layers (skinny_gemm, rotary_embedding_and_cache) ---------------------------------------


@pytest.mark.parametrize("arch, dtype", [("qwen3", "float32"), ("llama", "bfloat16")])
def test_few_row_layers_match_the_cublas_layers(tiny_model_dir, arch, dtype, monkeypatch):
    """ENGINE_SKINNY_GEMM_MAX_ROWS=8: batches of up to 8 rows run the few-row layers (the Triton skinny GEMM with its
    norm, SiLU-and-mul and residual variants, the rotary embedding fused with the cache write), compiled and in
    decode graphs, as users run them. Against the same engine without them (cuBLAS): float32 greedy tokens equal
    and log-probabilities within 1e-3; bf16 log-probabilities within 0.1 (two summation orders in bf16)."""
    model_dir = tiny_model_dir(arch)
    prompts = [{"prompt_token_ids": random_token_ids(n, seed=n)} for n in (5, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)

    def run():
        llm = LLM(model_dir, device=DEVICE, dtype=dtype, max_model_len=256, max_num_seqs=4)
        try:
            skinny = llm.llm_engine.model_runner.skinny_max_rows
            return skinny, llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_cuda()

    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "0")   # cuBLAS (the default runs one-row steps few-row)
    off, reference = run()
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    on, outputs = run()
    assert (off, on) == (0, 8)
    for got, want in zip(outputs, reference):
        got_c, want_c = got.outputs[0], want.outputs[0]
        got_lp = [next(iter(d.values())).logprob for d in got_c.logprobs]
        want_lp = [next(iter(d.values())).logprob for d in want_c.logprobs]
        if dtype == "float32":
            assert got_c.token_ids == want_c.token_ids
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-3
        else:   # bf16: compare while the greedy paths agree
            same = next((i for i, (a, b) in enumerate(zip(got_c.token_ids, want_c.token_ids)) if a != b),
                        len(got_c.token_ids))
            assert same >= 4
            assert max(abs(a - b) for a, b in zip(got_lp[:same], want_lp[:same])) < 0.1


# -- programmatic dependent launch ---------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0 or later")
def test_programmatic_dependent_launch_keeps_every_output(tiny_model_dir, monkeypatch):
    """PAGEDKERNELS_PDL=1 (the decode path's kernels launched while the one ahead finishes, in the decode graphs):
    a batch of one (the few-row layers) and of three give the same tokens and log-probabilities, to the bit, as
    without it."""
    import pagedkernels

    model_dir = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run(pdl: bool):
        previous = pagedkernels.set_programmatic_dependent_launch(pdl)
        llm = LLM(model_dir, device=DEVICE, dtype="bfloat16", max_model_len=256, max_num_seqs=4)
        try:
            return [[(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate([{"prompt_token_ids": random_token_ids(n, seed=n)} for n in lens], params,
                                           use_tqdm=False)]
                    for lens in ((30,), (5, 17, 40))]
        finally:
            pagedkernels.set_programmatic_dependent_launch(previous)
            llm.llm_engine.shutdown()
            del llm
            _free_cuda()

    assert run(True) == run(False)


# -- the decode op's reduce fused into its split kernel ---------------------------------------------------------------


# each feature's settings: the decode op's merge in its split kernel, the rotary embedding and cache write in it too,
# the final norm inside the LM head's few-row product
FUSED_FEATURES = {"reduce": ("ENGINE_DECODE_FUSED_REDUCE",), "rope": ("ENGINE_DECODE_FUSED_ROPE",),
                  "both": ("ENGINE_DECODE_FUSED_REDUCE", "ENGINE_DECODE_FUSED_ROPE"), "head": ("ENGINE_SKINNY_LM_HEAD",),
                  "all": ("ENGINE_DECODE_FUSED_REDUCE", "ENGINE_DECODE_FUSED_ROPE", "ENGINE_SKINNY_LM_HEAD")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("feature", list(FUSED_FEATURES))
def test_fused_decode_reduce_keeps_every_output(tiny_model_dir, monkeypatch, dtype, feature):
    """ENGINE_DECODE_FUSED_REDUCE=1 (the split kernel's last split merges the partial results, no reduce kernel),
    ENGINE_DECODE_FUSED_ROPE=1 (the few-row layers' rotary embedding and KV-cache write in the split kernel,
    pagedkernels.rotary_cache_decode_attention; the few-row layers up to 4 rows here), both, ENGINE_SKINNY_LM_HEAD=1
    (the step graphs' final norm inside the LM head's few-row product), or all three, on prompts long enough for
    several non-empty splits, batches of one and of three: the tokens of the unfused path and log-probabilities
    within the rounding (float32: the same greedy tokens; bf16: the same tokens until a near-tie of the top two, which
    the rounding may flip, and the rest follow it)."""
    model_dir = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "4")
    on = FUSED_FEATURES[feature]

    def run(fused: bool):
        for name in ("ENGINE_DECODE_FUSED_REDUCE", "ENGINE_DECODE_FUSED_ROPE", "ENGINE_SKINNY_LM_HEAD"):
            monkeypatch.setenv(name, "1" if fused and name in on else "0")
        llm = LLM(model_dir, device=DEVICE, dtype=dtype, max_model_len=1024, max_num_seqs=4)
        try:
            runner = llm.llm_engine.model_runner
            assert all((layer.decode_split_counters is not None) == (fused and "ENGINE_DECODE_FUSED_REDUCE" in on)
                       and layer.decode_fused_rope == (fused and "ENGINE_DECODE_FUSED_ROPE" in on)
                       for layer in runner.attention_layers)
            assert runner.skinny_head == (fused and "ENGINE_SKINNY_LM_HEAD" in on)
            outputs = [[o.outputs[0] for o in llm.generate([{"prompt_token_ids": random_token_ids(n, seed=n)}
                                                            for n in lens], params, use_tqdm=False)]
                       for lens in ((300,), (150, 420, 700))]
            assert not runner.decode_split_counters.any()
            return outputs
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_cuda()

    fused, unfused = run(True), run(False)
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for batch_fused, batch_unfused in zip(fused, unfused):
        for a, b in zip(batch_fused, batch_unfused):
            if dtype == "float32":
                assert a.token_ids == b.token_ids
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            for lp_a, lp_b in zip(a.logprobs[:same + 1], b.logprobs[:same + 1]):
                for token in lp_a.keys() & lp_b.keys():
                    assert abs(lp_a[token].logprob - lp_b[token].logprob) < tolerance
            if same < len(a.token_ids):   # bf16 rounds the two merges' sums apart: only a near-tie may flip a token
                top2 = sorted((lp.logprob for lp in b.logprobs[same].values()), reverse=True)[:2]
                assert top2[0] - top2[1] < 2 * tolerance, (same, top2)
