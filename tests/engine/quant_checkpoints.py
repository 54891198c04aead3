"""Quantized checkpoints of a float model directory, written as the formats publish them, for the engine's
quantization tests (tests/engine/test_quantization.py).

No reference quantizer installs here without CUDA or a newer transformers (GPTQModel and AutoGPTQ build CUDA
extensions, llm-compressor pulls another transformers, AutoAWQ's quantizer needs a GPU), so each format is
quantized by round-to-nearest in the tool's own formulas and packed in the published layout:

- GPTQ (AutoGPTQ's ``quantize``/``pack``): per group, symmetric ``scale = 2 max|w| / maxq``, zero
  ``(maxq + 1) / 2``, or asymmetric ``scale = (max - min) / maxq``, ``zero = round(-min / scale)``;
  ``qweight`` int32 ``[K * bits / 32, N]``, ``qzeros`` int32 ``[groups, N * bits / 32]`` holding zero - 1
  (format "gptq"), ``scales`` fp16 ``[groups, N]``, ``g_idx`` int32 ``[K]``; act-order assigns groups to
  runs of a random column order.
- AWQ (AutoAWQ's WQLinear_GEMM): asymmetric per group, ``qweight`` int32 ``[K, N / 8]`` and ``qzeros``
  ``[groups, N / 8]`` with nibble i of word c = column 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i], ``scales`` fp16.
- FP8: ``weight`` float8_e4m3fn, ``weight_scale`` float32 (``[]`` per tensor as AutoFP8 writes it, ``[N, 1]``
  per channel as compressed-tensors does), ``input_scale`` for static activations.

Beside it, the same model with every quantized weight replaced by its de-quantization, computed from the
packed tensors by the definitions in tests/pagedkernels/quant_oracle.py (element by element, no pagedkernels
code), so the de-quantized model is what the checkpoint means, whatever the quantizer did.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.pagedkernels.quant_oracle import AWQ_ORDER, _pack_words, gptq_dequantize


# Integer checkpoints of three kinds (4-bit GPTQ, 8-bit act-order asymmetric GPTQ, AWQ), as (method, options) for
# quantize_model_dir: the cases the CPU's default GEMM and the GPU's Triton GEMM are held to.
INT_CHECKPOINT_CASES = [
    pytest.param("gptq", dict(bits=4, group_size=128, desc_act=False, sym=True), id="gptq4"),
    pytest.param("gptq", dict(bits=8, group_size=32, desc_act=True, sym=False), id="gptq8-act-order"),
    pytest.param("awq", dict(group_size=32), id="awq"),
]

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def _is_quantized_linear(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and name.split(".")[-2] in LINEAR_SUFFIXES


def _group_minmax(w: np.ndarray, bits: int, sym: bool):
    """GPTQ/AWQ per-group parameters of ``w`` [rows, N] (one group): (scale [N], zero [N] ints)."""
    maxq = 2 ** bits - 1
    lo, hi = np.minimum(w.min(0), 0), np.maximum(w.max(0), 0)
    if sym:
        hi = np.maximum(np.abs(lo), hi)
        scale = 2 * hi / maxq
        zero = np.full(w.shape[1], (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
        scale = np.where(scale == 0, 1.0, scale)
        zero = np.round(-lo / scale).astype(np.int64)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float16).astype(np.float64)
    return scale, zero


def gptq_tensors(weight: torch.Tensor, *, bits: int, group_size: int, sym: bool, checkpoint_format: str,
                 order: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One linear's GPTQ tensors from its float ``[N, K]`` weight; ``order``: act-order's column order (GPTQ
    sorts columns by their Hessian diagonal, the same for every linear of one input: q/k/v, gate/up)."""
    w = weight.double().numpy().T  # [K, N]
    K, N = w.shape
    g = K if group_size == -1 else group_size
    groups, maxq = K // g, 2 ** bits - 1
    order = np.arange(K) if order is None else order
    g_idx = np.empty(K, dtype=np.int64)
    g_idx[order] = np.arange(K) // g
    q = np.zeros((K, N), dtype=np.int64)
    scales, zeros = np.zeros((groups, N)), np.zeros((groups, N), dtype=np.int64)
    for j in range(groups):
        cols = np.nonzero(g_idx == j)[0]
        scale, zero = _group_minmax(w[cols], bits, sym)
        scales[j], zeros[j] = scale, zero
        q[cols] = np.clip(np.round(w[cols] / scale) + zero, 0, maxq)
    stored = (zeros - 1) & maxq if checkpoint_format == "gptq" else zeros
    return dict(qweight=_pack_words(q, bits, 0), qzeros=_pack_words(stored, bits, 1),
                scales=torch.from_numpy(scales).half(), g_idx=torch.from_numpy(g_idx.astype(np.int32)))


def _awq_pack(values: np.ndarray) -> torch.Tensor:
    rows, N = values.shape
    words = np.zeros((rows, N // 8), dtype=np.uint64)
    for c in range(N // 8):
        for i, col in enumerate(AWQ_ORDER):
            words[:, c] |= values[:, 8 * c + col].astype(np.uint64) << np.uint64(4 * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def awq_tensors(weight: torch.Tensor, *, group_size: int) -> dict[str, torch.Tensor]:
    w = weight.double().numpy().T  # [K, N]
    K, N = w.shape
    g = K if group_size == -1 else group_size
    q = np.zeros((K, N), dtype=np.int64)
    scales, zeros = np.zeros((K // g, N)), np.zeros((K // g, N), dtype=np.int64)
    for j in range(K // g):
        rows = slice(j * g, (j + 1) * g)
        scale, zero = _group_minmax(w[rows], 4, sym=False)
        scales[j], zeros[j] = scale, zero
        q[rows] = np.clip(np.round(w[rows] / scale) + zero, 0, 15)
    return dict(qweight=_awq_pack(q), qzeros=_awq_pack(zeros), scales=torch.from_numpy(scales).half())


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int):
    """float64 [N, K] from AWQ GEMM tensors, nibble by nibble from the definition."""
    def unpack(words: torch.Tensor) -> np.ndarray:
        w = words.numpy().view(np.uint32).astype(np.uint64)
        out = np.zeros((w.shape[0], w.shape[1] * 8), dtype=np.int64)
        for c in range(w.shape[1]):
            for i, col in enumerate(AWQ_ORDER):
                out[:, 8 * c + col] = (w[:, c] >> np.uint64(4 * i)) & np.uint64(15)
        return out

    q, z = unpack(qweight), unpack(qzeros)
    K = q.shape[0]
    rows = np.arange(K) // (K if group_size == -1 else group_size)
    return torch.from_numpy(((q - z[rows]) * scales.double().numpy()[rows]).T.copy())


def fp8_tensors(weight: torch.Tensor, *, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale: [N, 1] per channel, [] per tensor)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_model_dir(src: str, dst: str, method: str, **opts) -> tuple[str, str]:
    """Write ``dst/quantized`` (the checkpoint in ``method``'s format, config.json carrying its
    quantization_config) and ``dst/dequantized`` (float32, the de-quantized weights) from the float model in
    ``src``. Returns both directories. ``method``: "gptq" (bits, group_size, desc_act, sym, checkpoint_format),
    "awq" (group_size), "fp8" (activation_scheme) or "compressed-tensors" (strategy, static)."""
    quant_dir, deq_dir = os.path.join(dst, "quantized"), os.path.join(dst, "dequantized")
    for d in (quant_dir, deq_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    rng = np.random.default_rng(opts.pop("seed", 0))
    orders: dict[tuple[str, str], np.ndarray] = {}   # act-order: one column order per layer input
    same_input = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not _is_quantized_linear(name):
            quantized[name] = dequantized[name] = tensor
            continue
        base = name[: -len(".weight")]
        if method == "gptq":
            order = None
            if opts["desc_act"]:
                layer, _, proj = base.rpartition(".")
                key = (layer.rpartition(".")[0], same_input.get(proj, proj))
                order = orders.setdefault(key, rng.permutation(tensor.shape[1]))
            t = gptq_tensors(tensor, bits=opts["bits"], group_size=opts["group_size"], sym=opts["sym"],
                             checkpoint_format=opts.get("checkpoint_format", "gptq"), order=order)
            deq = gptq_dequantize(**t, bits=opts["bits"], checkpoint_format=opts.get("checkpoint_format", "gptq"))
        elif method == "awq":
            t = awq_tensors(tensor, group_size=opts["group_size"])
            deq = awq_dequantize(**t, group_size=opts["group_size"])
        else:
            per_channel = method == "compressed-tensors" and opts.get("strategy") == "channel"
            q, scale = fp8_tensors(tensor, per_channel=per_channel)
            t = {"weight": q, "weight_scale": scale}
            static = opts.get("static", opts.get("activation_scheme") == "static")
            if static:
                t["input_scale"] = torch.tensor(float(rng.uniform(0.01, 0.05)), dtype=torch.float32)
            deq = q.double() * scale.double()
        for key, value in t.items():
            quantized[f"{base}.{key}"] = value.contiguous()
        dequantized[name] = deq.float().contiguous()
        # The quantizer is round-to-nearest: the de-quantized weight stays within a step of the float one.
        assert torch.allclose(deq.float(), tensor, atol=float(tensor.abs().max()) / 4), name
    save_file(quantized, os.path.join(quant_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(quant_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(method, **opts)
    with open(os.path.join(quant_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return quant_dir, deq_dir


def quantization_config(method: str, **opts) -> dict:
    """config.json's quantization_config as each tool writes it."""
    if method == "gptq":   # GPTQModel / AutoGPTQ (optimum's GPTQConfig has the same keys)
        return {"quant_method": "gptq", "bits": opts["bits"], "group_size": opts["group_size"],
                "desc_act": opts["desc_act"], "sym": opts["sym"], "damp_percent": 0.01, "true_sequential": True,
                "static_groups": False, "lm_head": False,
                "checkpoint_format": opts.get("checkpoint_format", "gptq")}
    if method == "awq":    # AutoAWQ through transformers' AwqConfig
        return {"quant_method": "awq", "bits": 4, "group_size": opts["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "fp8":    # AutoFP8 / vLLM
        return {"quant_method": "fp8", "activation_scheme": opts.get("activation_scheme", "dynamic"),
                "ignored_layers": ["lm_head"]}
    static = opts.get("static", False)
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if static else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True})
    return {   # llm-compressor's FP8 / FP8_DYNAMIC presets
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": opts.get("strategy", "tensor"),
                        "dynamic": False, "symmetric": True, "group_size": None},
            "input_activations": acts}},
        "ignore": ["lm_head"], "kv_cache_scheme": None,
    }
