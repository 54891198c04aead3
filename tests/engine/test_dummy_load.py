"""load_format="dummy" (random weights, a directory with only config.json) and skip_tokenizer_init=True (token ids
in and out, no text), vLLM's names: the engine features the GPU suite builds its benchmark models with."""
import json
import math
import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.models import load_model_config
from engine.distributed.parallel_state import planned_layout
from engine.engine_args import EngineArgs
from engine.layers.layernorm import LayerNorm, RMSNorm
from engine.models import get_model_class
from engine.sampling_params import GuidedDecodingParams
from engine.worker.loader import load_dummy_weights
from tests.engine.models_util import TINY_VOCAB_SIZE, random_token_ids, tiny_config

PROMPTS = [{"prompt_token_ids": random_token_ids(n, seed=60 + i)} for i, n in enumerate((5, 23, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """Factory: arch -> a directory holding only that tiny architecture's config.json."""
    built = {}

    def get(arch: str) -> str:
        if arch not in built:
            out_dir = str(tmp_path_factory.mktemp(f"config-only-{arch}"))
            tiny_config(arch).to_json_file(os.path.join(out_dir, "config.json"))
            built[arch] = out_dir
        return built[arch]

    return get


def _dummy_llm(model_dir: str, **kwargs) -> LLM:
    """On the CPU unless told otherwise (on a GPU machine too: the CUDA path has its own test below)."""
    kwargs = {"device": "cpu", "max_model_len": 128, "num_kv_blocks": 32, **kwargs}
    return LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == GREEDY.max_tokens and completion.text == "" and out.prompt is None
        for entry in completion.logprobs:
            assert all(math.isfinite(lp.logprob) and lp.decoded_token is None for lp in entry.values())
    return [out.outputs[0].token_ids for out in outputs]


def _build(model_dir: str) -> torch.nn.Module:
    config = load_model_config(model_dir)
    model = get_model_class(config.architecture)(config)
    for param in model.parameters():
        param.data.fill_(float("nan"))   # a parameter the loader skips stays NaN
    load_dummy_weights(model, model_dir)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt", "gemma2", "phi3"])
def test_config_only_directory_generates(config_only_dir, arch):
    """No checkpoint, no tokenizer: the model runs on random weights, token ids in and out, logits finite, and a
    second engine builds the same weights (the same greedy tokens)."""
    model_dir = config_only_dir(arch)
    assert os.listdir(model_dir) == ["config.json"]
    first = _greedy(_dummy_llm(model_dir))
    assert _greedy(_dummy_llm(model_dir)) == first
    assert len({tuple(tokens) for tokens in first}) > 1   # the output depends on the prompt: a working model


def test_dummy_weights_are_initialized_like_transformers(config_only_dir):
    """Every parameter is set (none left NaN): norms 1, biases 0, matrices normal(0, initializer_range);
    deterministic."""
    model_dir = config_only_dir("opt")   # LayerNorms with biases, biases on every linear
    std = json.load(open(os.path.join(model_dir, "config.json")))["init_std"]
    model = _build(model_dir)
    norms = {id(p) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm)) for p in m.parameters()}
    matrices = []
    for name, param in model.named_parameters():
        assert not param.isnan().any(), name
        if name.endswith("bias"):
            assert (param == 0).all(), name
        elif id(param) in norms:
            assert (param == 1).all(), name
        else:
            matrices.append(param.flatten())
    values = torch.cat(matrices)
    assert abs(values.std().item() - std) < 0.02 * std and abs(values.mean().item()) < 0.01 * std
    for a, b in zip(model.parameters(), _build(model_dir).parameters()):
        assert torch.equal(a, b)


def test_each_rank_draws_its_own_shard(config_only_dir):
    """Under tensor parallelism rank r builds its shard only (half the rows) and draws it from its own seed."""
    model_dir = config_only_dir("llama")
    full = dict(_build(model_dir).named_parameters())
    shards = []
    for rank in (0, 1):
        with planned_layout(2, rank):
            shards.append(dict(_build(model_dir).named_parameters()))
    name = "model.layers.0.mlp.gate_up_proj.weight"
    assert shards[0][name].shape[0] == shards[1][name].shape[0] == full[name].shape[0] // 2
    assert not torch.equal(shards[0][name], shards[1][name])
    with planned_layout(2, 1):
        again = dict(_build(model_dir).named_parameters())
    assert all(torch.equal(again[n], p) for n, p in shards[1].items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensor parallelism needs gloo, which the engine's group "
                    "picks only where CUDA is absent (engine/distributed/parallel_state.py)")
def test_tensor_parallel_dummy_model_is_deterministic(config_only_dir):
    """tensor_parallel_size=2: each rank initializes its own shard in its own process; two runs give the same
    greedy tokens."""
    model_dir = config_only_dir("qwen3")
    runs = []
    for _ in range(2):
        llm = _dummy_llm(model_dir, tensor_parallel_size=2)
        try:
            runs.append(_greedy(llm))
        finally:
            llm.llm_engine.shutdown()
    assert runs[0] == runs[1]


def test_without_tokenizer_text_features_are_value_errors(config_only_dir):
    llm = _dummy_llm(config_only_dir("llama"))
    assert llm.get_tokenizer() is None
    ids = PROMPTS[0]
    for prompt in ("Once upon a time", {"prompt": "Once upon a time"}):
        with pytest.raises(ValueError, match="prompt.*skip_tokenizer_init"):
            llm.generate(prompt, use_tqdm=False)
    for name, params in (("stop", SamplingParams(stop=["."])), ("bad_words", SamplingParams(bad_words=["x"])),
                         ("guided_decoding", SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+")))):
        with pytest.raises(ValueError, match=f"{name} needs the tokenizer"):
            llm.generate(ids, params, use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs the tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="stream_text"):
        next(llm.stream_text(ids))
    assert not llm.llm_engine.has_unfinished_requests()
    # What needs no text still works: n > 1, truncation (of a prompt given with its text too), beam search.
    out = llm.generate({**ids, "prompt": "given"}, SamplingParams(n=2, max_tokens=3, truncate_prompt_tokens=2),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids["prompt_token_ids"][-2:] and out.prompt is None
    assert [c.text for c in out.outputs] == ["", ""] and all(len(c.token_ids) == 3 for c in out.outputs)
    from engine.core.beam_search import BeamSearchParams
    beams = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
    assert beams and all(b.text == "" and len(b.tokens) == len(ids["prompt_token_ids"]) + 3 for b in beams)


def test_dummy_weights_with_a_tokenizer(tiny_model_dir):
    """load_format="dummy" on a full model directory ignores its checkpoint but keeps its tokenizer: text in,
    text out, and different tokens from the checkpoint's weights."""
    model_dir = tiny_model_dir("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    dummy = LLM(model_dir, load_format="dummy", device="cpu", max_model_len=128, num_kv_blocks=32)
    real = LLM(model_dir, device="cpu", max_model_len=128, num_kv_blocks=32)
    a, b = (llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0] for llm in (dummy, real))
    assert a.text == dummy.get_tokenizer().decode(a.token_ids, skip_special_tokens=True) and a.text
    assert a.token_ids != b.token_ids


def test_options_and_flags(config_only_dir):
    from engine.__main__ import build_parser

    args = build_parser().parse_args(["generate", "x", "--model", "/m", "--load-format", "dummy",
                                      "--skip-tokenizer-init"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="/m", load_format="dummy", skip_tokenizer_init=True)
    assert EngineArgs(model="/m").load_format == "auto" and not EngineArgs().skip_tokenizer_init
    model_dir = config_only_dir("llama")
    with pytest.raises(ValueError, match="load_format"):
        LLM(model_dir, load_format="pt", skip_tokenizer_init=True, device="cpu")
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(model_dir, load_format="dummy", skip_tokenizer_init="yes", device="cpu")
    # load_format="auto" reads the checkpoint, which a config-only directory does not have.
    with pytest.raises(ValueError, match="no weights"):
        LLM(model_dir, skip_tokenizer_init=True, device="cpu", num_kv_blocks=8)
    # Without skip_tokenizer_init the tokenizer is required.
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(model_dir, load_format="dummy", device="cpu", num_kv_blocks=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by the GPU suite)")
def test_dummy_bf16_on_cuda_with_compile_and_graphs(config_only_dir):
    """The GPU suite's path: bf16, compiled forward and decode graphs, weights drawn on the GPU."""
    model_dir = config_only_dir("qwen3")
    runs = []
    for _ in range(2):
        llm = _dummy_llm(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=8, num_kv_blocks=None,
                         gpu_memory_utilization=0.3)
        runner = llm.llm_engine.model_runner
        assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in runner.model.parameters())
        runs.append(_greedy(llm))
        assert runner.graphs
        del llm, runner
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
    assert TINY_VOCAB_SIZE > max(t for tokens in runs[0] for t in tokens)


@pytest.mark.parametrize("method, opts", [("gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": True}),
                                          ("awq", {"group_size": 32}), ("fp8", {"per_channel": True})])
def test_quantized_dummy_model_generates(tmp_path, method, opts):
    """A quantized model's config alone builds a dummy model too (the GPU suite's quantized benchmarks): packed
    codes random, g_idx as created, float8 weights rounded from normal draws; the logits are finite."""
    from tests.engine.quant_checkpoints import quantization_config

    config = tiny_config("llama").to_dict()
    config["quantization_config"] = quantization_config(method, **opts)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = _greedy(_dummy_llm(str(tmp_path)))
    assert len({tuple(t) for t in tokens}) > 1
