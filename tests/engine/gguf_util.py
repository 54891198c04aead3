"""Tiny GGUF files written at test time with the ``gguf`` package (as llama.cpp's converter writes them).

``write_tiny_gguf(path, weight_type)`` writes a random-weight Llama (2 layers, hidden 256, 4 query heads on 2
KV heads of 64, intermediate 512: every linear's K is a multiple of 256, so the K-quants apply) with the tiny
byte-level BPE tokenizer of models_util in the GGUF's own tokenizer arrays, so transformers can rebuild it.
The linear layers are stored as ``weight_type``; embeddings, norms and the untied output layer as F32 (or
``embed_type``). q and k rows are permuted as llama.cpp does (``engine.gguf_file.permute_rows``), so a reader
that forgot to un-permute them computes a different model.

Q8_0 / Q4_0 / Q4_1 are quantized from random float weights with ``gguf.quants.quantize``; Q4_K and Q6_K (which
``gguf.quants`` cannot quantize) are random blocks with scales chosen so the values have a spread like the
float weights. The reference is transformers loading the same file (it de-quantizes every tensor to float).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from tests.engine.models_util import CHATML_TEMPLATE, SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tokenizer

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64


def _random_k_blocks(rows: int, cols: int, quant_type: str, generator: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks of a [rows, cols] weight whose values spread about as the float linears
    (std ~0.1)."""
    from pagedkernels import GGUF_BLOCKS

    values, nbytes = GGUF_BLOCKS[quant_type]
    blocks = generator.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    if quant_type == "Q4_K":   # w = d * sc * q - dmin * m, sc, m 6-bit, q 4-bit
        d = generator.uniform(0.15e-3, 0.45e-3, size=(rows, cols // values)).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // values, 2)
        blocks[..., 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(rows, cols // values, 2)
    else:   # Q6_K: w = d * sc * (q - 32), sc int8
        d = generator.uniform(0.5e-4, 1.5e-4, size=(rows, cols // values)).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // values, 2)
    return blocks.reshape(rows, -1)


def _tokenizer_arrays():
    """(tokens, token types, merges) of models_util's tokenizer, as GGUF's tokenizer.ggml.* arrays."""
    tokenizer = make_tokenizer()
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]   # 3: control, 1: normal
    return tokens, types, merges


def tiny_llama_state(seed: int = 0, *, tie: bool = False) -> dict[str, torch.Tensor]:
    """HF-named float32 weights of the tiny Llama (spread as models_util's tiny models)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.25):
        return torch.randn(*shape, generator=g) * std

    # A tied embedding is the LM head too: the spread of an output layer, so logits stay as large as untied ones.
    state = {"model.embed_tokens.weight": normal(TINY_VOCAB_SIZE, HIDDEN, std=0.25 if tie else 1.0),
             "model.norm.weight": 0.5 + torch.rand(HIDDEN, generator=g)}
    if not tie:
        head = normal(TINY_VOCAB_SIZE, HIDDEN)
        head[:len(SPECIAL_TOKENS)] *= 0.1   # greedy runs rarely end on EOS
        state["lm_head.weight"] = head
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 0.5 + torch.rand(HIDDEN, generator=g),
            p + "post_attention_layernorm.weight": 0.5 + torch.rand(HIDDEN, generator=g),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, std=0.1),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.1),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.1),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=0.1),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN, std=0.1),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN, std=0.1),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE, std=0.1),
        }
    return state


def write_tiny_gguf(path: str, weight_type: str = "Q8_0", *, seed: int = 0, tie: bool = False,
                    embed_type: str = "F32", with_tokenizer: bool = True) -> str:
    """Write the tiny Llama as a GGUF file at ``path`` (see the module docstring) and return ``path``.
    ``weight_type``: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K for the 7 linears of every layer."""
    import gguf
    from gguf import GGMLQuantizationType as T

    from engine.gguf_file import permute_rows

    state = tiny_llama_state(seed, tie=tie)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY_VOCAB_SIZE)
    if with_tokenizer:
        tokens, types, merges = _tokenizer_arrays()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_chat_template(CHATML_TEMPLATE)
    rng = np.random.default_rng(seed + 1)
    for hf_name, tensor in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        if ".q_proj." in hf_name:
            tensor = permute_rows(tensor, HEADS)
        elif ".k_proj." in hf_name:
            tensor = permute_rows(tensor, KV_HEADS)
        is_linear = "layers." in hf_name and tensor.dim() == 2
        kind = weight_type if is_linear else (embed_type if tensor.dim() == 2 else "F32")
        array = tensor.numpy().astype(np.float32)
        if kind == "F32":
            writer.add_tensor(gguf_name, array)
        elif kind == "F16":
            writer.add_tensor(gguf_name, array.astype(np.float16))
        elif kind == "BF16":
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, T.BF16), raw_dtype=T.BF16)
        elif kind in ("Q4_K", "Q6_K"):
            writer.add_tensor(gguf_name, _random_k_blocks(*array.shape, kind, rng), raw_dtype=T[kind])
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, T[kind]), raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_model_from_gguf(path: str):
    """transformers' model of a GGUF file (it de-quantizes every tensor to float32): the reference."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()
