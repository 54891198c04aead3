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
import struct
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


def _reader(path: str) -> "GGUFFile":
    """The file's metadata and tensor table (see :class:`GGUFFile`), parsed once per file identity (path, size,
    modification time): the config, the special ids and the weights all read it."""
    stat = os.stat(path)
    return _cached_reader(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int) -> "GGUFFile":
    try:
        return GGUFFile(path)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


@dataclass(slots=True)
class StringArray:
    """A metadata array of strings, left unparsed (the tokenizer's 49k tokens and merges): its length only."""
    count: int


@dataclass(slots=True)
class TensorInfo:
    name: str
    tensor_type: int     # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple         # GGUF's order: fastest-varying dimension first
    data: np.ndarray     # float types: typed, logical shape (slowest first); others: uint8 [..., row bytes]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """A GGUF file's key-value metadata (``fields``: key -> value; string arrays as :class:`StringArray`) and its
    tensors (``tensors``: :class:`TensorInfo` over a read-only memory map), read with ``struct``.

    The ``gguf`` package's GGUFReader parses every metadata element through numpy views, which takes ~4 s for a
    49k-token vocabulary; this reads what the engine needs (scalars, strings, small arrays) and skips over the
    tokenizer's string arrays (the tokenizer is transformers' to rebuild)."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        raw = memoryview(buf)
        if bytes(raw[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", raw, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self._raw, self._pos = raw, 24
        self.fields: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.fields[key] = self._value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            tensor_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), int(tensor_type), int(offset)))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = []
        for name, dims, tensor_type, offset in infos:
            qtype = GGMLQuantizationType(tensor_type)
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
            logical = tuple(reversed(dims))
            n_values = int(np.prod(dims)) if dims else 1
            nbytes = n_values // block_values * block_bytes
            start = data_start + offset
            if start + nbytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            chunk = buf[start:start + nbytes]
            typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}.get(qtype.name)
            if typed is not None:
                data = chunk.view(typed).reshape(logical)
            else:
                data = chunk.reshape(*logical[:-1], logical[-1] // block_values * block_bytes)
            self.tensors.append(TensorInfo(name, tensor_type, dims, data))

    def _unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self._raw, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._raw[self._pos:self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type == _STRING:
                for _ in range(count):   # skipped, not decoded
                    (length,) = struct.unpack_from("<Q", self._raw, self._pos)
                    self._pos += 8 + length
                return StringArray(count)
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self._raw, self._pos))
                self._pos += count * struct.calcsize(fmt)
                return values
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self._unpack(_SCALARS[value_type])[0]


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_architecture(reader, path: str) -> tuple[str, str, bool]:
    """(GGUF architecture, HF architecture, q/k permuted) of a GGUF file; ValueError for unsupported ones, and for
    mixture-of-experts files (their experts are llama.cpp's stacked ``ffn_*_exps`` tensors, which the engine does
    not load: MoE models load from their HF checkpoints)."""
    arch = _field(reader, "general.architecture")
    experts = _field(reader, f"{arch}.expert_count", 0) or 0
    stacked = [t.name for t in reader.tensors if "_exps." in t.name]
    if experts or stacked:
        raise ValueError(f"{path}: a mixture-of-experts GGUF ({arch}, {experts} experts; tensors such as "
                         f"{(stacked or ['ffn_gate_exps'])[0]!r}) is not supported: the engine has no loader for "
                         f"llama.cpp's stacked expert tensors (ffn_gate_exps / ffn_up_exps / ffn_down_exps). Load "
                         f"the model's HF safetensors checkpoint instead (Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE "
                         f"are supported there)")
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
    for key, value in reader.fields.items():
        prefix, _, rest = key.partition(".")
        if prefix == "tokenizer" and not rest.endswith("_token_id"):
            continue   # the vocabulary arrays: the tokenizer's business
        renames = mapping.get(prefix)
        if renames is None or rest not in renames or renames[rest] in (None, -1):
            continue
        config[renames[rest]] = value
    config.pop("_model_name_or_path", None)
    config["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(hf_arch, arch)
    config["architectures"] = [hf_arch]
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        config["vocab_size"] = tokens.count if isinstance(tokens, StringArray) else len(tokens)
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
    raw = np.array(t.data)   # a copy out of the memory map
    if type_name in ("F32", "F16"):
        return GGUFTensor(torch.from_numpy(raw).reshape(shape), None, shape)
    if type_name == "BF16":
        data = torch.from_numpy(raw.view(np.uint8)).view(torch.bfloat16).reshape(shape)
        return GGUFTensor(data, None, shape)
    if type_name in GGUF_BLOCKS and len(shape) == 2:
        return GGUFTensor(torch.from_numpy(raw).reshape(shape[0], -1), type_name, shape)
    try:
        values = dequantize(raw, GGMLQuantizationType(t.tensor_type))
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
