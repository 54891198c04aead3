"""A GGUF file as the model: its HF config, its tokenizer and its tensors under HF names.

``LLM(model="path/to/x.gguf")`` (vLLM's convention: the model is the file itself; ``tokenizer=`` may name an
HF tokenizer directory instead of the one the GGUF carries). What a GGUF holds and how it maps:

- **Config**: the ``{arch}.*`` metadata keys, renamed into config.json keys with transformers' own table
  (``transformers.modeling_gguf_pytorch_utils.GGUF_TO_TRANSFORMERS_MAPPING``), plus ``architectures`` and
  ``tie_word_embeddings`` (no ``output.weight`` tensor = tied), as transformers does in
  ``load_gguf_checkpoint``. Special token ids come from ``tokenizer.ggml.*_token_id``.
- **Tokenizer**: transformers rebuilds a fast tokenizer from the ``tokenizer.ggml.*`` arrays
  (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), chat template included.
- **Tensors**: ``blk.N.attn_q.weight`` and friends, named through the ``gguf`` package's tensor name map (the
  same map llama.cpp's converter wrote them with). A tensor is either float (F32/F16/BF16: loaded as floats)
  or block-quantized (``GGUFTensor.quant_type`` names the block type; ``data`` is its bytes, uint8
  ``[N, row_bytes]``, as ``pagedkernels.gguf_gemm`` takes them).
- **q/k permutation**: llama.cpp's converter permutes the rows of Llama's q and k projections (it pairs
  rotary dimensions as GPT-J does: ``x.reshape(heads, 2, dim/2, K).swapaxes(1, 2)``); :func:`unpermute_rows`
  undoes it, as transformers' ``reverse_permute_weights``. A row is a whole output feature, so on a quantized
  tensor it moves its row of blocks: nothing is de-quantized.

Supported architectures: the Llama family as GGUF names it (``llama``: Llama, Mistral, SmolLM2), ``qwen2``
and ``qwen3``. Block types kept quantized: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (``pagedkernels.GGUF_BLOCKS``); any
other block type the ``gguf`` package can de-quantize is loaded as floats.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

# GGUF general.architecture -> (HF architecture, q/k rows permuted by llama.cpp's converter)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def is_gguf_path(path: object) -> bool:
    """Whether ``path`` names a GGUF file (an existing file whose name ends in .gguf)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf") and os.path.isfile(path)


def _reader(path: str):
    """The file's GGUFReader (a memory map). Parsing the metadata takes seconds for a 49k-token vocabulary, and
    the config, the tokenizer's special ids and the weights all read it: the last two readers are kept, keyed
    by the file's identity (path, size, modification time)."""
    stat = os.stat(path)
    return _cached_reader(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency of the engine
        raise ImportError("reading a GGUF model needs the 'gguf' package: pip install gguf") from e
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # GGUFReader raises ValueError/struct errors/... for files that are not GGUF
        raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader, path: str) -> tuple[str, str, bool]:
    """(GGUF architecture, HF architecture, q/k permuted) of a GGUF file; ValueError for unsupported ones."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)})")
    hf_arch, permuted = GGUF_ARCHITECTURES[arch]
    name = str(_field(reader, "general.name", "")).lower()
    if arch == "llama" and "mistral" in name:   # llama.cpp writes Mistral as llama; transformers tells by name
        hf_arch = "MistralForCausalLM"
    return arch, hf_arch, permuted


def read_gguf_config(path: str, reader=None) -> tuple[dict, dict]:
    """(config.json dict, generation_config.json dict) of a GGUF file, from its metadata."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    reader = reader if reader is not None else _reader(path)
    arch, hf_arch, _ = gguf_architecture(reader, path)
    mapping = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config: dict = {}
    for key, field in reader.fields.items():
        prefix, _, rest = key.partition(".")
        if prefix == "tokenizer" and not rest.endswith("_token_id"):
            continue   # the vocabulary arrays: the tokenizer's business (and slow to parse)
        renames = mapping.get(prefix)
        if renames is None or rest not in renames or renames[rest] in (None, -1):
            continue
        value = field.contents()
        config[renames[rest]] = value
    config.pop("_model_name_or_path", None)
    config["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(hf_arch, arch)
    config["architectures"] = [hf_arch]
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens.data)
    # rope scaling (llama.cpp: {arch}.rope.scaling.type / .factor / .original_context_length)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = _field(reader, f"{arch}.rope.scaling.factor")
        if scaling_type != "linear" or factor is None:
            raise ValueError(f"{path}: rope scaling {scaling_type!r} in GGUF metadata is not supported "
                             f"(only 'linear' with a factor)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    config.setdefault("hidden_act", "silu")
    # Linears in a block type pagedkernels multiplies as stored: the GGUF linear method keeps them so
    # (engine/layers/quantization/gguf.py); a file of float linears loads as an unquantized model.
    from pagedkernels import GGUF_BLOCKS

    from gguf import GGMLQuantizationType
    if any(t.name.startswith("blk.") and len(t.shape) == 2 and GGMLQuantizationType(t.tensor_type).name in GGUF_BLOCKS
           for t in reader.tensors):
        config["quantization_config"] = {"quant_method": "gguf"}
    config["dtype"] = "bfloat16"   # the compute dtype "auto" means: float32 on CPU, bf16 on GPUs
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in generation and eot != generation["eos_token_id"]:
        generation["eos_token_id"] = [generation["eos_token_id"], int(eot)]
    return config, generation


def load_gguf_tokenizer(path: str):
    """The tokenizer a GGUF file carries, rebuilt by transformers (chat template included)."""
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"cannot load the tokenizer of GGUF file {path}: {e}") from e


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``) on ``[N, ...]`` rows.

    ``num_heads``: the heads the rows belong to (q: attention heads, k: KV heads). Works on float rows and on
    rows of quantized blocks alike (each row moves whole)."""
    n = rows.shape[0]
    if n % (2 * num_heads):
        raise ValueError(f"{n} rows are not {num_heads} heads of an even number of rows")
    return rows.reshape(num_heads, n // num_heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def permute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (the inverse of :func:`unpermute_rows`), for writing test GGUFs."""
    n = rows.shape[0]
    return rows.reshape(num_heads, 2, n // num_heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


@dataclass(slots=True)
class GGUFTensor:
    """A tensor as the file stores it. ``quant_type`` None: ``data`` is float, in its logical shape.
    Otherwise ``data`` is uint8 ``[N, row_bytes]`` of ``quant_type`` blocks (``pagedkernels.GGUF_BLOCKS``)
    and ``shape`` the logical ``(N, K)``."""
    data: torch.Tensor
    quant_type: str | None
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as ``dtype`` (a float tensor as it is; blocks through pagedkernels' de-quantization)."""
        if self.quant_type is None:
            return self.data.to(dtype)
        from pagedkernels import gguf_dequantize
        return gguf_dequantize(self.data.contiguous(), self.quant_type, dtype=dtype)


def _to_tensor(t, path: str) -> GGUFTensor:
    """A ReaderTensor as a GGUFTensor (copied out of the memory map)."""
    from gguf import GGMLQuantizationType, dequantize

    from pagedkernels import GGUF_BLOCKS

    type_name = GGMLQuantizationType(t.tensor_type).name
    shape = tuple(int(d) for d in reversed(t.shape))   # GGUF lists dimensions fastest-first
    raw = np.ascontiguousarray(t.data)
    if type_name in ("F32", "F16"):
        return GGUFTensor(torch.from_numpy(raw.copy()).reshape(shape), None, shape)
    if type_name == "BF16":
        data = torch.from_numpy(raw.view(np.uint8).copy()).view(torch.bfloat16).reshape(shape)
        return GGUFTensor(data, None, shape)
    if type_name in GGUF_BLOCKS and len(shape) == 2:
        return GGUFTensor(torch.from_numpy(raw.copy()).reshape(shape[0], -1), type_name, shape)
    try:
        values = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name!r} has block type {type_name}, which cannot be read") from e
    return GGUFTensor(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape), None, shape)


def gguf_tensor_name_map(arch: str, num_layers: int, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, for the HF checkpoint names ``hf_names`` (``.weight``/``.bias``
    names), through the ``gguf`` package's tensor name map of ``arch``."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if model_arch is None:
        raise ValueError(f"the gguf package knows no architecture {arch!r}")
    name_map = get_tensor_name_map(model_arch, num_layers)
    out = {}
    for hf_name in hf_names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base) if dot else None
        if gguf_base is not None:
            out[f"{gguf_base}.{suffix}"] = hf_name
    return out


def iter_gguf_tensors(path: str, hf_names: list[str], *, reader=None):
    """(HF checkpoint name, GGUFTensor) for every tensor of the GGUF file, q/k rows un-permuted for llama (by
    the head counts of its metadata, as llama.cpp's converter permuted them).

    ``hf_names``: the checkpoint names the model expects (``model.layers.0.self_attn.q_proj.weight``, ...);
    a GGUF tensor that maps to none of them is a ValueError, except ``rope_freqs`` (llama.cpp's precomputed
    llama3 rope factors, which the engine computes from the config) and ``output.weight`` of a model whose
    embeddings are tied."""
    reader = reader if reader is not None else _reader(path)
    arch, _, permuted = gguf_architecture(reader, path)
    num_layers = int(_field(reader, f"{arch}.block_count"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    names = gguf_tensor_name_map(arch, num_layers, hf_names)
    for t in reader.tensors:
        hf_name = names.get(t.name)
        if hf_name is None:
            if t.name.startswith("rope_freqs") or (t.name == "output.weight" and "lm_head.weight" not in hf_names):
                continue
            raise ValueError(f"{path}: GGUF tensor {t.name!r} matches no parameter of the model")
        tensor = _to_tensor(t, path)
        if permuted and t.name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias")):
            heads = num_heads if ".attn_q." in t.name else num_kv_heads
            tensor.data = unpermute_rows(tensor.data, heads).contiguous()
        yield hf_name, tensor
