"""Independent float64 references for the quantized-weight tests.

Nothing here calls pagedkernels. Each format is written from its definition, element by element
(numpy integer arithmetic on the packed words / bytes), not from the kernels' vectorized forms:

- the canonical int4 layout (pagedkernels/quant_formats.py): byte j of block b of a row holds values
  32 b + j (low nibble) and 32 b + 16 + j (high nibble);
- GPTQ (AutoGPTQ): qweight int32 [K / per_word, N] packs K, qzeros int32 [groups, N / per_word] packs N,
  value i of a word in its bits [bits * i, bits * (i + 1)); the "gptq" (v1) format stores z - 1 and
  de-quantizes with z = (stored + 1) & (2 ** bits - 1); w[k, n] = (q - z[g_idx[k], n]) * s[g_idx[k], n];
- AWQ (AutoAWQ GEMM): qweight int32 [K, N / 8], nibble i of word c = output column 8 c + ORDER[i];
- GGUF block types: the ``gguf`` package's own ``gguf.quants.dequantize``.

The native CPU GEMMs quantize the activation to int8 per block of 32 (scale max|x| / 127, values
round-half-even(x * (127 / max|x|)) in float32); :func:`int8_activation` reproduces that exactly, so a
native result can be held both to the exact product (within :func:`int8_activation_bound`) and, much
more tightly, to the product with the emulated activation.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_canonical_int4(q: np.ndarray) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K // 2] in the canonical order."""
    N, K = q.shape
    out = np.zeros((N, K // 2), dtype=np.uint8)
    for b in range(K // 32):
        for j in range(16):
            out[:, 16 * b + j] = q[:, 32 * b + j] | (q[:, 32 * b + 16 + j] << 4)
    return torch.from_numpy(out)


def _pack_words(values: np.ndarray, bits: int, axis: int) -> torch.Tensor:
    """Pack 32 / bits consecutive values along ``axis`` into int32 words, value i at bits * i."""
    per_word = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, 0)
    words = np.zeros((v.shape[0] // per_word,) + v.shape[1:], dtype=np.uint64)
    for i in range(per_word):
        words |= v[i::per_word] << np.uint64(bits * i)
    return torch.from_numpy(np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis).copy())


def _unpack_words(words: torch.Tensor, bits: int, axis: int) -> np.ndarray:
    per_word = 32 // bits
    w = np.moveaxis(words.numpy().view(np.uint32).astype(np.uint64), axis, 0)
    out = np.zeros((w.shape[0] * per_word,) + w.shape[1:], dtype=np.int64)
    for i in range(per_word):
        out[i::per_word] = (w >> np.uint64(bits * i)) & np.uint64(2 ** bits - 1)
    return np.moveaxis(out, 0, axis)


def make_gptq(K: int, N: int, *, bits: int, group_size: int, act_order: bool, symmetric: bool,
              checkpoint_format: str, generator: torch.Generator):
    """Random GPTQ tensors (qweight, qzeros, scales, g_idx) as a checkpoint holds them, and the float64
    [N, K] weight they mean."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
    g = K if group_size == -1 else group_size
    groups = K // g
    qmax = 2 ** bits - 1
    q = rng.integers(0, qmax + 1, size=(K, N))
    if symmetric:
        stored = np.full((groups, N), 2 ** (bits - 1) - (1 if checkpoint_format == "gptq" else 0))
    else:
        stored = rng.integers(0, qmax + 1, size=(groups, N))  # includes 15 (v1: wraps to z = 0)
    scales = torch.from_numpy(rng.uniform(0.002, 0.02, size=(groups, N))).half()
    if act_order:
        # GPTQ quantizes columns in a permuted order and gives each run of g of them one group.
        order = rng.permutation(K)
        g_idx = np.empty(K, dtype=np.int64)
        g_idx[order] = np.arange(K) // g
    else:
        g_idx = np.arange(K) // g
    z = (stored + 1) & qmax if checkpoint_format == "gptq" else stored
    s = scales.double().numpy()
    weight = (q - z[g_idx]) * s[g_idx]  # [K, N]
    return dict(qweight=_pack_words(q, bits, 0), qzeros=_pack_words(stored, bits, 1), scales=scales,
                g_idx=torch.from_numpy(g_idx.astype(np.int32))), torch.from_numpy(weight.T.copy())


def gptq_dequantize(qweight, qzeros, scales, g_idx, *, bits: int, checkpoint_format: str) -> torch.Tensor:
    """float64 [N, K] from GPTQ tensors (the definition; used to check make_gptq's packing too)."""
    q = _unpack_words(qweight, bits, 0)
    stored = _unpack_words(qzeros, bits, 1)
    z = (stored + 1) & (2 ** bits - 1) if checkpoint_format == "gptq" else stored
    g = g_idx.long().numpy()
    s = scales.double().numpy()
    return torch.from_numpy(((q - z[g]) * s[g]).T.copy())


def make_awq(K: int, N: int, *, group_size: int, generator: torch.Generator):
    """Random AWQ GEMM tensors (qweight, qzeros, scales) and the float64 [N, K] weight."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
    g = K if group_size == -1 else group_size
    q = rng.integers(0, 16, size=(K, N))
    z = rng.integers(0, 16, size=(K // g, N))
    scales = torch.from_numpy(rng.uniform(0.002, 0.02, size=(K // g, N))).half()

    def pack(values):  # [rows, N] -> int32 [rows, N / 8], nibble i = column 8 c + AWQ_ORDER[i]
        words = np.zeros((values.shape[0], N // 8), dtype=np.uint64)
        for c in range(N // 8):
            for i, col in enumerate(AWQ_ORDER):
                words[:, c] |= values[:, 8 * c + col].astype(np.uint64) << np.uint64(4 * i)
        return torch.from_numpy(words.astype(np.uint32).view(np.int32))

    rows = np.arange(K) // g
    weight = (q - z[rows]) * scales.double().numpy()[rows]
    return dict(qweight=pack(q), qzeros=pack(z), scales=scales), torch.from_numpy(weight.T.copy())


def gguf_reference(qweight: torch.Tensor, quant_type: str) -> torch.Tensor:
    """float64 [N, K] by the gguf package's de-quantization."""
    import gguf
    from gguf import quants

    values = quants.dequantize(qweight.cpu().numpy(), getattr(gguf.GGMLQuantizationType, quant_type))
    return torch.from_numpy(np.asarray(values, dtype=np.float64))


def random_gguf(quant_type: str, N: int, K: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [N, row bytes]: random block bytes (every bit pattern of the quantized values, scales
    and mins occurs) with the float16 fields set to finite values of a realistic size."""
    sizes = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
    values, nbytes = sizes[quant_type]
    nb = K // values
    raw = torch.randint(0, 256, (N, nb, nbytes), dtype=torch.uint8, generator=generator)

    def put(offset, tensor):
        raw[..., offset:offset + 2] = tensor.to(torch.float16).view(torch.uint8).view(N, nb, 2)

    def rand(scale, signed=False):
        u = torch.rand(N, nb, generator=generator)
        return (2 * u - 1) * scale if signed else u * scale + scale / 10

    if quant_type in ("Q8_0", "Q4_0"):
        put(0, rand(0.05))
    elif quant_type == "Q4_1":
        put(0, rand(0.02))
        put(2, rand(0.15, signed=True))
    elif quant_type == "Q4_K":
        put(0, rand(0.003))
        put(2, rand(0.003))
    else:
        put(208, rand(0.0005))
    return raw.view(N, nb * nbytes)


def int8_activation(x: torch.Tensor) -> torch.Tensor:
    """float64 [M, K]: x as the native kernels quantize it (per 32 values: d = max|x| / 127,
    q = round-half-even(x * (127 / max|x|)) in float32), de-quantized: d * q."""
    xf = x.detach().float().cpu()
    M, K = xf.shape
    blocks = xf.view(M, K // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1.0), torch.tensor(0.0))
    q = torch.round(blocks * inv)  # float32 product, then half-to-even
    d = amax / 127.0
    return (q.double() * d.double()).view(M, K)


def int8_activation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most the int8 activation can move x @ W^T: sum_k |w[n,k]| * d(k) / 2."""
    xf = x.detach().double().cpu()
    M, K = xf.shape
    half_step = (xf.view(M, K // 32, 32).abs().amax(-1) / 127 / 2).repeat_interleave(32, -1)
    return half_step @ weight.double().abs().t()
