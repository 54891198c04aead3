"""End to end through LLM / LLMEngine: greedy parity with transformers (SmolLM2 and a random-weight model of
each architecture) under chunked prefill, prefix caching on/off and preemption; logprobs; every
SamplingParams field that acts after sampling (stop strings, stop tokens, EOS, min/max tokens,
max_model_len); seeded sampling independent of the batch; bad input; abort; no leaked blocks."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import resolve_model_path
from engine.tokenizer import get_tokenizer
from tests.engine.models_util import TINY_ARCHITECTURES, hf_log_softmax, load_hf_model, random_token_ids

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# Very different lengths; the last two share a 64-token prefix (4 full blocks) with the 110-token prompt.
_LONG = random_token_ids(110, seed=11)
TINY_PROMPTS = [random_token_ids(3, seed=1), random_token_ids(45, seed=2), _LONG]
TINY_SHARED = [_LONG[:64] + random_token_ids(9, seed=3), _LONG[:80] + random_token_ids(30, seed=4)]

# name -> LLM keyword arguments. "chunked": a 24-token step budget cuts every long prompt into chunks and
# mixes them with decodes. "preempt": 10 blocks of 16 slots cannot hold the batch (the 110-token prompt alone
# needs 8), so running requests are preempted and recomputed; its max_model_len is what the cache holds (the
# engine refuses a max_model_len the cache cannot hold).
CONFIGS = {
    "chunked-prefix": dict(max_num_batched_tokens=24, enable_prefix_caching=True, num_kv_blocks=64, max_model_len=256),
    "no-prefix": dict(max_num_batched_tokens=512, enable_prefix_caching=False, num_kv_blocks=64, max_model_len=256),
    "preempt": dict(max_num_batched_tokens=64, enable_prefix_caching=True, num_kv_blocks=10, max_model_len=160),
}


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=2, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    """arch -> transformers reference model that never stops at EOS (the engine side uses ignore_eos)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = load_hf_model(tiny_model_dir(arch))
            model.generation_config.eos_token_id = None
            cache[arch] = model
        return cache[arch]
    return get


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    """(arch, config name) -> LLM, built once per module."""
    cache = {}

    def get(arch, config="chunked-prefix"):
        if (arch, config) not in cache:
            cache[arch, config] = LLM(tiny_model_dir(arch), **CONFIGS[config])
        return cache[arch, config]
    return get


@pytest.fixture(scope="module")
def hf_refs(tiny_hf):
    cache = {}

    def get(arch, prompt_index, prompts):
        key = (arch, tuple(prompts[prompt_index]))
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf(arch), prompts[prompt_index], MAX_TOKENS)
        return cache[key]
    return get


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_greedy_matches_transformers(tiny_llm, hf_refs, arch, config):
    llm = tiny_llm(arch, config)
    scheduler = llm.llm_engine.scheduler
    preemptions_before = scheduler.num_preemptions
    outputs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], GREEDY, use_tqdm=False)
    shared = llm.generate([{"prompt_token_ids": p} for p in TINY_SHARED], GREEDY, use_tqdm=False)
    for i, out in enumerate(outputs):
        assert out.outputs[0].token_ids == hf_refs(arch, i, TINY_PROMPTS), f"prompt {i}"
        assert out.outputs[0].finish_reason == "length" and out.prompt_token_ids == TINY_PROMPTS[i]
    for i, out in enumerate(shared):
        assert out.outputs[0].token_ids == hf_refs(arch, i, TINY_SHARED), f"shared-prefix prompt {i}"
    if CONFIGS[config]["enable_prefix_caching"]:
        assert [o.num_cached_tokens for o in shared] == [64, 80]
    else:
        assert all(o.num_cached_tokens == 0 for o in outputs + shared)
    if config == "preempt":
        assert scheduler.num_preemptions > preemptions_before
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("config", ["chunked-prefix", "preempt"])
def test_tiny_greedy_matches_transformers_compiled(tiny_model_dir, hf_refs, config, monkeypatch):
    """The forward under torch.compile (the GPU default; ENGINE_COMPILE=1 here on CPU): mixed chunked-prefill
    steps, prefix hits and preemption give transformers' tokens, and nothing fell back to eager."""
    monkeypatch.setenv("ENGINE_COMPILE", "1")
    llm = LLM(tiny_model_dir("llama"), **CONFIGS[config])
    outputs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], GREEDY, use_tqdm=False)
    for i, out in enumerate(outputs):
        assert out.outputs[0].token_ids == hf_refs("llama", i, TINY_PROMPTS), f"prompt {i}"
    assert llm.llm_engine.model_runner.compiled
    assert_all_blocks_free(llm)


def test_tiny_logprobs_match_transformers(tiny_llm, tiny_hf):
    llm, hf = tiny_llm("qwen2"), tiny_hf("qwen2")
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)]
    outputs = llm.generate([{"prompt_token_ids": TINY_PROMPTS[1]}] * 2, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out, p in zip(outputs, params):
        completion = out.outputs[0]
        ref = hf_log_softmax(hf, TINY_PROMPTS[1] + completion.token_ids)[len(TINY_PROMPTS[1]) - 1:-1]
        assert len(completion.logprobs) == 6
        total = 0.0
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert token in entry and len(entry) in (p.logprobs, p.logprobs + 1)   # top-k, plus sampled if outside
            for token_id, lp in entry.items():
                assert abs(lp.logprob - ref[step, token_id].item()) < 2e-3
                assert lp.rank == int((ref[step] > ref[step, token_id]).sum()) + 1
                assert lp.decoded_token == tokenizer.decode([token_id])
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert all(next(iter(e.values())).rank == 1 for e in outputs[0].outputs[0].logprobs)   # greedy: sampled = top


def test_repetition_penalty_matches_transformers(tiny_llm, tiny_hf):
    # transformers' RepetitionPenaltyLogitsProcessor penalizes prompt + output tokens, as vLLM does.
    llm, hf = tiny_llm("llama"), tiny_hf("llama")
    prompt = TINY_PROMPTS[1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS, repetition_penalty=1.8)
    assert out[0].outputs[0].token_ids != hf_greedy(hf, prompt, MAX_TOKENS)   # the penalty changed something


# -- SmolLM2 ---------------------------------------------------------------------------------------------------

SMOL_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning "
    "walked down to the harbour, checked his nets, and told the children stories about",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    # A 32-token step budget splits the long prompt into chunks mixed with the others' decodes.
    return LLM(smollm2_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=32, num_kv_blocks=64)


@pytest.fixture(scope="module")
def smol_hf(smollm2_dir):
    return load_hf_model(smollm2_dir, torch.float32)


def test_smollm2_greedy_and_logprobs_match_transformers(smol_llm, smol_hf):
    tokenizer = smol_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    outputs = smol_llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(SMOL_PROMPTS, outputs):
        prompt_ids = tokenizer.encode(prompt)
        assert out.prompt == prompt and out.prompt_token_ids == prompt_ids
        completion = out.outputs[0]
        with torch.inference_mode():
            hf_out = smol_hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, pad_token_id=2,
                                      output_logits=True, return_dict_in_generate=True)
        # transformers stops at the same EOS ids (generation_config), so the lists must be equal, length and all.
        assert completion.token_ids == hf_out.sequences[0, len(prompt_ids):].tolist(), prompt
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        ref = torch.log_softmax(torch.cat(hf_out.logits).float(), dim=-1)   # raw logits of each generated step
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(entry[token].logprob - ref[step, token].item()) < 2e-3
            assert sorted(lp.rank for lp in entry.values()) == [1, 2]
    assert_all_blocks_free(smol_llm)


def test_smollm2_chat_eos_stop_and_ignore_eos(smol_llm):
    conversation = [{"role": "user", "content": "What is 2+2? Reply with just the number."}]
    out = smol_llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    completion = out.outputs[0]
    eos_ids = smol_llm.llm_engine.model_config.eos_token_ids
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.token_ids[-1] in eos_ids and "<|im_end|>" not in completion.text
    n = len(completion.token_ids)
    ignored = smol_llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True,
                                                         skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids[:n] == completion.token_ids and len(ignored.token_ids) == n + 2
    assert ignored.finish_reason == "length" and "<|im_end|>" in ignored.text


# -- SamplingParams fields end to end (tiny llama) --------------------------------------------------------------

def greedy_run(llm, prompt, **overrides):
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True) | overrides
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_stop_strings_cut_text_across_tokens(tiny_llm):
    llm = tiny_llm("llama")
    base = greedy_run(llm, TINY_PROMPTS[1])
    text = base.text
    # A 3-character ASCII stop string from the second half of the text.
    start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].strip())
    stop = text[start:start + 3]
    first = text.find(stop)
    for include in (False, True):
        out = greedy_run(llm, TINY_PROMPTS[1], stop=[stop, "\x00never"], include_stop_str_in_output=include)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (text[:first + len(stop)] if include else text[:first])
        assert out.token_ids == base.token_ids[:len(out.token_ids)] and len(out.token_ids) < 16


def test_stop_token_ids_min_tokens_max_tokens(tiny_llm):
    llm = tiny_llm("llama")
    base = greedy_run(llm, TINY_PROMPTS[2])
    stop_token = base.token_ids[4]
    k = base.token_ids.index(stop_token)
    out = greedy_run(llm, TINY_PROMPTS[2], stop_token_ids=[stop_token])
    assert out.token_ids == base.token_ids[:k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_token
    assert base.text.startswith(out.text) and len(out.text) < len(base.text)
    held = greedy_run(llm, TINY_PROMPTS[2], stop_token_ids=[stop_token], min_tokens=k + 3)
    assert len(held.token_ids) >= k + 3 and stop_token not in held.token_ids[:k + 3]
    short = greedy_run(llm, TINY_PROMPTS[2], max_tokens=5)
    assert short.token_ids == base.token_ids[:5] and short.finish_reason == "length"


def test_max_model_len_caps_output(tiny_llm):
    llm = tiny_llm("llama")   # max_model_len=256
    out = greedy_run(llm, random_token_ids(250, seed=9), max_tokens=20)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        greedy_run(llm, random_token_ids(257, seed=9))


def test_seeded_sampling_independent_of_batch(tiny_llm):
    llm = tiny_llm("llama")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": TINY_PROMPTS[1]}
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": random_token_ids(n, seed=20 + n)} for n in (5, 60, 17)]
    other_params = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=1.3, seed=1, max_tokens=12), SamplingParams(temperature=0.0)]
    crowded = llm.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [seeded] + other_params[2:],
                           use_tqdm=False)[2].outputs[0].token_ids
    assert crowded == alone
    reseeded = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=8, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert reseeded != alone
    top1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert top1 == greedy_run(llm, TINY_PROMPTS[1], max_tokens=12).token_ids


# -- robustness ----------------------------------------------------------------------------------------------

def test_bad_inputs_rejected_while_others_run(tiny_llm):
    llm = tiny_llm("qwen3")
    engine = llm.llm_engine
    expected = greedy_run(llm, TINY_PROMPTS[1], max_tokens=8).token_ids
    engine.add_request("good", {"prompt_token_ids": TINY_PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    vocab = engine.model_config.vocab_size
    bad_prompts = {
        "empty": "", "empty ids": {"prompt_token_ids": []}, "id = vocab": {"prompt_token_ids": [5, vocab]},
        "negative id": {"prompt_token_ids": [-1]}, "too long": {"prompt_token_ids": [5] * 300},
        "unknown key": {"text": "hi"}, "not a prompt": 123, "float ids": {"prompt_token_ids": [1.5]},
    }
    for name, prompt in bad_prompts.items():
        with pytest.raises(ValueError):
            engine.add_request(f"bad {name}", prompt, SamplingParams())
    with pytest.raises(ValueError, match="params"):
        engine.add_request("bad params", "hello", {"temperature": 0.5})
    with pytest.raises(ValueError, match="already"):
        engine.add_request("good", "hello", SamplingParams())
    assert list(engine.requests) == ["good"]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "good" and final.finished and final.outputs[0].token_ids == expected
    # A bad prompt in a batch fails the whole call before anything is queued.
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_all_blocks_free(llm)


def test_request_larger_than_the_cache_is_rejected(tiny_llm):
    # 10 blocks of 16 and max_model_len 160: one sequence always fits, the two of an n=2 request of 150+ do not.
    llm = tiny_llm("llama", "preempt")
    with pytest.raises(ValueError, match="KV-cache blocks"):
        llm.generate({"prompt_token_ids": random_token_ids(150, seed=3)},
                     SamplingParams(n=2, max_tokens=20, ignore_eos=True), use_tqdm=False)


def test_abort_frees_everything(tiny_llm):
    llm = tiny_llm("mistral")
    engine = llm.llm_engine
    for i, prompt in enumerate(TINY_PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("r2")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("r2") is None and engine.abort_request("nope") is None
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == ["r0", "r1"]
    assert_all_blocks_free(llm)


def test_progress_bar_reports_throughput(tiny_llm, capsys):
    llm = tiny_llm("llama")
    llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "toks/s" in err


def test_chat_template_from_separate_jinja_file(tiny_model_dir, tmp_path):
    import json
    import shutil
    src = tiny_model_dir("qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user]hi"


def test_chat_batches_conversations(tiny_llm):
    llm = tiny_llm("qwen2")
    conversations = [[{"role": "user", "content": "Hello"}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                      {"role": "user", "content": "Numbers: 1 2 3"}]]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outputs[1].prompt == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
                                 "<|im_start|>user\nNumbers: 1 2 3<|im_end|>\n<|im_start|>assistant\n")
    single = llm.chat(conversations[1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_model_resolution_errors(monkeypatch):
    for path in ("/nonexistent/model/dir", "./models/x", "~/nothing", "a/b/c"):
        with pytest.raises(ValueError, match="no such directory"):
            resolve_model_path(path)
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="could not be fetched"):
        LLM("some-org/some-model")


def test_hub_revision_and_download_dir_reach_the_download(monkeypatch, tiny_model_dir, tmp_path):
    # vLLM's revision, tokenizer_revision and download_dir: what huggingface_hub is asked for (no network here: a
    # stand-in returns a local model as the download).
    import huggingface_hub

    local, calls = tiny_model_dir("llama"), []

    def download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], kwargs["cache_dir"]))
        return local
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    llm = LLM("some-org/some-model", revision="v1.0", tokenizer="some-org/some-tokenizer", tokenizer_revision="abc123",
              download_dir=str(tmp_path), num_kv_blocks=16)
    assert calls == [("some-org/some-model", "v1.0", str(tmp_path)), ("some-org/some-tokenizer", "abc123", str(tmp_path))]
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs
    with pytest.raises(ValueError, match="revision must be a str"):
        LLM(local, revision=3)


def test_hf_overrides_equal_an_edited_config_json(tiny_model_dir, tmp_path):
    # vLLM's hf_overrides: config.json keys set over the file's, as if the file said so.
    import json
    import shutil

    original = tiny_model_dir("llama")
    edited = tmp_path / "edited"
    shutil.copytree(original, edited)
    config = json.loads((edited / "config.json").read_text())
    overrides = {"rope_theta": 123.0, "max_position_embeddings": 96}
    (edited / "config.json").write_text(json.dumps({**config, **overrides}))
    prompt, params = {"prompt_token_ids": random_token_ids(40, seed=2)}, SamplingParams(max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    overridden = LLM(original, num_kv_blocks=16, hf_overrides=overrides)
    assert overridden.llm_engine.max_model_len == 96
    assert tokens(overridden) == tokens(LLM(str(edited), num_kv_blocks=16))
    assert tokens(overridden) != tokens(LLM(original, num_kv_blocks=16))   # it did change the model
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM(original, hf_overrides=[("rope_theta", 1.0)])


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(max_num_seqs=0), dict(max_num_batched_tokens=-1),
                                 dict(num_kv_blocks=0), dict(gpu_memory_utilization=1.5), dict(device="tpu")])
def test_bad_engine_arguments(tiny_model_dir, bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        LLM(tiny_model_dir("llama"), **bad)


@pytest.mark.parametrize("damage,message", [
    ("truncate weights", "weight file"), ("remove weights", "no weights"), ("remove config", "config.json"),
    ("remove tokenizer", "no tokenizer"),
])
def test_broken_model_directory_is_a_clear_error(tiny_model_dir, tmp_path, damage, message):
    import os
    import shutil
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("qwen3"), model_dir)
    weights = os.path.join(model_dir, "model.safetensors")
    if damage == "truncate weights":
        data = open(weights, "rb").read()
        open(weights, "wb").write(data[:len(data) // 2])
    elif damage == "remove weights":
        os.remove(weights)
    elif damage == "remove config":
        os.remove(os.path.join(model_dir, "config.json"))
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(model_dir, name))
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, num_kv_blocks=8)


def test_a_run_freezes_the_heap_it_started_with_and_thaws_it_after(tiny_model_dir):
    """During generate the objects alive at its start are out of the garbage collector's walks (no full
    collection over the model's modules mid-batch); after it they are back, so a dropped LLM, whose modules sit in
    reference cycles, is collected. A heap the caller froze stays frozen."""
    import gc
    import weakref

    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=16, max_model_len=64)
    runner = llm.llm_engine.executor.model_runner
    seen = []
    original = runner.execute_model

    def watch(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return original(*args, **kwargs)

    runner.execute_model = watch
    assert gc.get_freeze_count() == 0
    llm.generate([{"prompt_token_ids": random_token_ids(5, seed=1)}], GREEDY, use_tqdm=False)
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0

    gc.freeze()   # the caller's own freeze: a run neither adds to it nor undoes it
    try:
        frozen = gc.get_freeze_count()
        seen.clear()
        llm.generate([{"prompt_token_ids": random_token_ids(5, seed=2)}], GREEDY, use_tqdm=False)
        # (frozen objects that die by reference counting leave the count: it can only fall)
        assert seen and all(0 < count <= frozen for count in seen) and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()

    weight = weakref.ref(next(runner.model.parameters()))
    del llm, runner, original, watch
    gc.collect()
    assert weight() is None, "the dropped LLM's weights were not collected"


def test_shutdown_releases_the_model_and_cache_while_the_llm_is_still_held(tiny_model_dir):
    """A benchmark or a server that shuts an engine down but keeps a reference to it (a closure, an argument tuple,
    a traceback) must still get its memory back: on a GPU the next engine needs it. The weights and the KV cache
    are collected at shutdown; a step after it is a clear error, not a crash in a half-empty runner."""
    import gc
    import weakref

    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=16, max_model_len=64, swap_space=0.01,
              preemption_mode="swap")
    held = (llm,)   # what kept 113 GiB alive on the H200 of 2026-11-30 (bench.engine_gpu's batch-1 arguments)
    llm.generate([{"prompt_token_ids": random_token_ids(5, seed=1)}], GREEDY, use_tqdm=False)
    runner = llm.llm_engine.executor.model_runner
    parts = runner.build_seconds   # where the start-up went (logged, and recorded by the GPU benchmarks)
    assert set(parts) == {"model", "memory profile and KV cache", "total"}   # no graphs captured at start on CPU
    assert parts["total"] >= parts["model"] + parts["memory profile and KV cache"] and parts["model"] > 0
    weight, cache = weakref.ref(next(runner.model.parameters())), weakref.ref(runner.kv_cache)
    swap = weakref.ref(llm.llm_engine.executor.cache_engine.swap_cache)
    del runner
    llm.llm_engine.shutdown()
    llm.llm_engine.shutdown()   # idempotent
    gc.collect()
    assert held[0] is llm
    assert weight() is None and cache() is None and swap() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": random_token_ids(5, seed=2)}], GREEDY, use_tqdm=False)
