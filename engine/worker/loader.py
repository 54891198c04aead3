"""Load safetensors checkpoints (single file or sharded) straight into the engine's modules.

Parameter by parameter, as nano-vllm does: each checkpoint tensor is read from ``safe_open`` and
handed to its parameter's ``weight_loader``; names of fused projections are rewritten through the
model's ``packed_modules_mapping`` (``q_proj`` -> ``qkv_proj`` shard "q", ``gate_proj`` ->
``gate_up_proj`` shard 0, ...), and leading prefixes through its ``checkpoint_prefix_mapping`` (OPT's
own checkpoints say ``decoder.`` for ``model.decoder.``). A checkpoint that already stores a fused
projection (Phi-3's ``qkv_proj``, ``gate_up_proj``) loads into it whole (shard id None), which the
parameter's loader splits into its shards. Afterwards every parameter shard must have been loaded; a
missing file, a missing tensor, a wrong shape or an unreadable file is a ValueError naming it.

The per-layer scales of an fp8 KV cache, where a checkpoint has them (vLLM's names: ``*.self_attn.k_scale`` /
``v_scale``, also under ``.attn.``, ``.k_proj.`` / ``.v_proj.`` or ``.qkv_proj.``; compressed-tensors'
``*.k_proj.output_scale`` / ``*.v_proj.output_scale``; the older ``*.kv_scale`` for both), are no parameters:
each is one positive number, stored as a Python float on the attention layer it belongs to (``k_scale`` /
``v_scale`` of engine/layers/attention.py). A model run with a cache in its own dtype ignores them.

``load_dummy_weights`` is ``load_format="dummy"`` (vLLM's name): random weights instead of a checkpoint, so a
model shape can be run from a directory holding only its config.json.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from engine.distributed.parallel_state import get_tp_rank
from engine.gguf_file import is_gguf_path
from engine.layers.attention import Attention
from engine.layers.embed_head import LMHead, VocabEmbedding
from engine.layers.layernorm import LayerNorm, RMSNorm

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors the engine recomputes instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",
                     # fp8 attention's query and softmax scales (vLLM's q_scale / prob_scale): the engine
                     # quantizes the KV cache only, its attention runs in the model's dtype
                     ".q_scale", ".prob_scale", ".q_proj.output_scale")
# Checkpoint names of fp8 KV-cache scales: suffix -> which scales it sets.
_KV_SCALE_SUFFIXES = ((".k_proj.output_scale", ("k",)), (".v_proj.output_scale", ("v",)),
                      (".k_scale", ("k",)), (".v_scale", ("v",)), (".kv_scale", ("k", "v")))
# Modules a scale may hang on below the attention block (vLLM's layouts): dropped to find the block.
_KV_SCALE_HOLDERS = (".attn", ".k_proj", ".v_proj", ".qkv_proj")
# A GGUF model's LM head multiplies the file's blocks, and its token embedding looks rows up in them, when they
# are a type pagedkernels takes (ENGINE_GGUF_VOCAB=float keeps both float, for comparisons).
_GGUF_VOCAB_BLOCKS = os.environ.get("ENGINE_GGUF_VOCAB", "blocks") != "float"
# Seed of load_dummy_weights (fixed, as vLLM's dummy loader: the same model whatever the engine's sampling seed).
DUMMY_SEED = 1234


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of ``model_dir``: the shards its index names, or model.safetensors."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e!r}") from e
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f"weight file {path} (listed in {_INDEX_FILE}) is missing")
        return files
    path = os.path.join(model_dir, _SINGLE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"no weights in {model_dir}: expected {_SINGLE_FILE} or {_INDEX_FILE}")
    return [path]


def load_model(model: nn.Module, model_dir: str) -> None:
    """Copy every checkpoint tensor of ``model_dir`` into ``model``'s parameters (any dtype/device).
    ``model_dir`` may be a GGUF file (see :func:`load_gguf_model`)."""
    if is_gguf_path(model_dir):
        load_gguf_model(model, model_dir)
        return
    packed = getattr(model, "packed_modules_mapping", {})
    prefixes = getattr(model, "checkpoint_prefix_mapping", {})
    experts = getattr(model, "expert_weight_names", {})
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    # Every parameter must come from the checkpoint, except those a quantization method can do without
    # (GPTQ's g_idx without act-order: its default is the in-order grouping).
    expected = {(name, shard) for name, p in params.items() if not getattr(p, "optional_in_checkpoint", False)
                for shard in getattr(p, "shard_ids", (None,))}
    loaded: set[tuple[str, object]] = set()
    attention_layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    for path in weight_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for ckpt_name in f.keys():
                    if _load_kv_scale(ckpt_name, prefixes, attention_layers, f, path):
                        continue
                    target = _target(ckpt_name, packed, prefixes, experts)
                    if target is None:
                        continue
                    param_name, shard_id = target
                    param = params.get(param_name)
                    if param is None:
                        if ckpt_name == "lm_head.weight" and "lm_head.weight" not in params:
                            continue  # tied embeddings: the checkpoint may still carry a copy
                        raise ValueError(f"{path}: tensor {ckpt_name!r} matches no parameter of "
                                         f"{type(model).__name__}")
                    _load_param(param, f.get_tensor(ckpt_name), shard_id, f"{path}: tensor {ckpt_name!r}")
                    if shard_id is None:  # a whole parameter, fused projections included: all its shards
                        loaded.update((param_name, shard) for shard in getattr(param, "shard_ids", (None,)))
                    else:
                        loaded.add((param_name, shard_id))
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weight file {path}: {e}") from e
    missing = sorted(expected - loaded, key=str)
    if missing:
        # A fused checkpoint tensor (Phi-3) is missing once, not once per shard.
        names = list(dict.fromkeys(_checkpoint_name(name, shard, packed, experts) for name, shard in missing))
        raise ValueError(f"weights missing from {model_dir}: {', '.join(names[:10])}"
                         + (f" and {len(names) - 10} more" if len(names) > 10 else ""))


def _load_kv_scale(ckpt_name: str, prefixes: dict, attention_layers: dict[str, Attention], f, path: str) -> bool:
    """If ``ckpt_name`` is an fp8 KV-cache scale, set it on its attention layer and return True."""
    for suffix, kinds in _KV_SCALE_SUFFIXES:
        if ckpt_name.endswith(suffix):
            break
    else:
        return False
    block = _with_prefix_mapping(ckpt_name[:-len(suffix)], prefixes)
    for holder in _KV_SCALE_HOLDERS:
        if block.endswith(holder):
            block = block[:-len(holder)]
            break
    layers = [layer for name, layer in attention_layers.items() if name == block or name.startswith(block + ".")]
    if len(layers) != 1:
        raise ValueError(f"{path}: tensor {ckpt_name!r} (a KV-cache scale) matches "
                         f"{'no' if not layers else len(layers)} attention layers of the model")
    tensor = f.get_tensor(ckpt_name)
    if tensor.numel() != 1:
        raise ValueError(f"{path}: tensor {ckpt_name!r}: a KV-cache scale is one number per layer (per-tensor), "
                         f"got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{path}: tensor {ckpt_name!r}: a KV-cache scale must be a positive finite number, "
                         f"got {value}")
    layer = layers[0]
    for kind in kinds:
        setattr(layer, f"{kind}_scale", value)
    layer.kv_scales_loaded = True
    return True


def _with_prefix_mapping(ckpt_name: str, prefixes: dict) -> str:
    for prefix, replacement in prefixes.items():
        if ckpt_name.startswith(prefix):
            return replacement + ckpt_name[len(prefix):]
    return ckpt_name


def _load_param(param: nn.Parameter, value, shard_id, where: str) -> None:
    """Copy a checkpoint tensor (or a GGUF tensor's blocks) into ``param`` through its weight_loader (or the
    default copy); a ValueError names ``where`` (file and tensor)."""
    try:
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            _default_loader(param, value)
        else:
            loader(param, value, shard_id)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def load_gguf_model(model: nn.Module, path: str) -> None:
    """Load a GGUF file's tensors into ``model`` (engine/gguf_file.py names them and un-permutes llama's q/k).

    A parameter that keeps GGUF blocks (its ``gguf_blocks`` attribute is True: a GGUF-quantized linear) gets
    the :class:`~engine.gguf_file.GGUFTensor` itself, blocks and block type, from its ``weight_loader``; every
    other parameter gets the tensor's values in its dtype (block-quantized embeddings and norms are
    de-quantized)."""
    from engine.gguf_file import iter_gguf_tensors

    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    expected = {(name, shard) for name, p in params.items() if not getattr(p, "optional_in_checkpoint", False)
                for shard in getattr(p, "shard_ids", (None,))}
    by_ckpt_name = {_gguf_checkpoint_name(name, shard, packed, params[name]): (name, shard)
                    for name, shard in expected}
    loaded: set[tuple[str, object]] = set()
    head = next((m for m in model.modules() if isinstance(m, LMHead)), None)
    embed = next((m for m in model.modules() if isinstance(m, VocabEmbedding) and not isinstance(m, LMHead)), None)
    vocab_tensors: dict[str, object] = {}   # the embedding's and the LM head's tensors (one when tied)
    for ckpt_name, tensor in iter_gguf_tensors(path, list(by_ckpt_name)):
        param_name, shard_id = by_ckpt_name[ckpt_name]
        param = params[param_name]
        for role, module in (("head", head), ("embed", embed)):
            if module is not None and param is module.weight:
                vocab_tensors[role] = tensor
        where = f"{path}: tensor {ckpt_name!r}"
        try:
            value = tensor if getattr(param, "gguf_blocks", False) else tensor.dequantize(param.dtype)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        _load_param(param, value, shard_id, where)
        loaded.add((param_name, shard_id))
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = list(dict.fromkeys(_checkpoint_name(name, shard, packed) for name, shard in missing))
        raise ValueError(f"weights missing from {path}: {', '.join(names[:10])}"
                         + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    if _GGUF_VOCAB_BLOCKS:
        _install_gguf_vocab(head, embed, vocab_tensors)


def _install_gguf_vocab(head, embed, tensors: dict) -> None:
    """The LM head multiplies the file's blocks and the embedding looks its rows up in them (one copy when tied),
    where they are a block type pagedkernels takes; the float weights they replace are freed."""
    from engine.layers.quantization.gguf import install_gguf_embedding, install_gguf_lm_head

    tied = head is not None and embed is not None and head.weight is embed.weight
    head_done = "head" in tensors and install_gguf_lm_head(head, tensors["head"])
    shared = head.gguf_qweight if tied and head_done else None
    embed_done = "embed" in tensors and install_gguf_embedding(
        embed, tensors["embed"], shared=shared, shared_type=head.quant_method.quant_type if shared is not None else None)

    def empty(param: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(param.new_empty(0), requires_grad=False)

    if tied:
        if head_done and embed_done:
            head.weight = embed.weight = empty(embed.weight)
        return
    if head_done:
        head.weight = empty(head.weight)
    if embed_done:
        embed.weight = empty(embed.weight)


def _gguf_checkpoint_name(param_name: str, shard_id, packed: dict, param: nn.Parameter) -> str:
    """The HF checkpoint name of a parameter's GGUF tensor: a GGUF linear's ``qweight`` (its blocks) is the
    tensor GGUF calls ``...weight``."""
    name = _checkpoint_name(param_name, shard_id, packed)
    if getattr(param, "gguf_blocks", False) and name.endswith(".qweight"):
        name = name[: -len("qweight")] + "weight"
    return name


# A MoE expert's projection: ``{block}.experts.{expert id}.{projection}.weight``.
_EXPERT_TENSOR = re.compile(r"^(?P<block>.*\.experts)\.(?P<expert>\d+)\.(?P<name>\w+)\.weight$")
# An expert shard kind's stacked parameter (engine/layers/fused_moe.py): gate (w1) and up (w3) share w13.
_EXPERT_PARAMS = {"w1": "w13_weight", "w3": "w13_weight", "w2": "w2_weight"}


def _target(ckpt_name: str, packed: dict, prefixes: dict, experts: dict | None = None) -> tuple[str, object] | None:
    """(parameter name, shard id) a checkpoint tensor loads into; None for tensors to skip. A MoE expert's tensor
    (``experts``: its projection names -> shard kinds) loads into the block's stacked weight, shard
    ``(expert, kind)``."""
    if ckpt_name.endswith(_IGNORED_SUFFIXES):
        return None
    ckpt_name = _with_prefix_mapping(ckpt_name, prefixes)
    match = _EXPERT_TENSOR.match(ckpt_name) if experts else None
    if match is not None and match["name"] in experts:
        kind = experts[match["name"]]
        return f"{match['block']}.{_EXPERT_PARAMS[kind]}", (int(match["expert"]), kind)
    for fragment, (fused, shard_id) in packed.items():
        if f".{fragment}." in ckpt_name:
            return ckpt_name.replace(f".{fragment}.", f".{fused}."), shard_id
    return ckpt_name, None


def _checkpoint_name(param_name: str, shard_id, packed: dict, experts: dict | None = None) -> str:
    if experts and isinstance(shard_id, tuple) and param_name.endswith(tuple(_EXPERT_PARAMS.values())):
        expert, kind = shard_id
        name = next(name for name, k in experts.items() if k == kind)
        return f"{param_name.rpartition('.')[0]}.{expert}.{name}.weight"
    for fragment, (fused, sid) in packed.items():
        if sid == shard_id and f".{fused}." in param_name:
            return param_name.replace(f".{fused}.", f".{fragment}.")
    return param_name


def _default_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tensor.shape != param.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(tensor)


def load_dummy_weights(model: nn.Module, model_dir: str) -> None:
    """Fill ``model``'s parameters with random values instead of reading a checkpoint (``load_format="dummy"``).

    As transformers initializes a fresh model, so activations and logits stay finite and generation runs:
    matrices and embeddings normal(0, ``initializer_range`` of ``model_dir``/config.json, default 0.02),
    norm weights 1, biases 0. Drawn in place where the parameters live (a GPU model's weights never exist on
    the CPU or on disk) from one generator per device seeded with ``DUMMY_SEED + tensor-parallel rank``: every
    run builds the same weights, and each rank draws its own shard (so a sharded dummy model is not the
    same model as the unsharded one)."""
    std = _initializer_range(model_dir)
    norm_params = {id(p) for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))
                   for p in m.parameters(recurse=False)}
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():  # a fixed order: tied weights once, under their first name
            if name.endswith("bias"):
                param.zero_()
            elif id(param) in norm_params:
                param.fill_(1.0)
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(DUMMY_SEED + get_tp_rank())
                _fill_dummy(name, param, std, generators[param.device])


def _fill_dummy(name: str, param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """One parameter of a dummy model: floats normal(0, std); float8 weights the same, rounded; packed integer
    weights and zero points (GPTQ/AWQ int32) random bits, i.e. random 4/8-bit codes; GPTQ's g_idx kept as the
    method made it (each input row's group, in order). Raw GGUF blocks (uint8) hold float16 scales that random bits
    would make NaN: refused."""
    if param.dtype.is_floating_point and param.element_size() > 1:
        param.normal_(0.0, std, generator=generator)
    elif param.dtype.is_floating_point:   # float8
        param.copy_(torch.empty(param.shape, device=param.device).normal_(0.0, std, generator=generator))
    elif name.endswith("g_idx"):
        return   # as created: each input row's group, in order
    elif param.dtype == torch.int32:
        info = torch.iinfo(torch.int32)
        param.copy_(torch.randint(info.min, info.max, param.shape, generator=generator, device=param.device,
                                  dtype=torch.int64).to(torch.int32))
    else:
        raise ValueError(f"load_format='dummy' cannot make random values for {name} ({param.dtype}); "
                         "load this model from its checkpoint")


def _initializer_range(model_dir: str) -> float:
    """config.json's ``initializer_range`` (OPT: ``init_std``), else transformers' usual 0.02 (also for a GGUF
    file, which has no such key)."""
    if is_gguf_path(model_dir):
        return 0.02
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    text = hf.get("text_config", hf)
    std = text.get("initializer_range", text.get("init_std", 0.02))
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        raise ValueError(f"initializer_range in {model_dir}/config.json must be a positive number, got {std!r}")
    return float(std)
