"""pk.paged_prefill_attention against the float64 dense oracle, both backends, every device.

Batches mix first prefills (q_len == seq_len), chunked prefills / prefix hits (0 < q_len < seq_len)
and 1-token decode rows; unused cache slots, spare blocks and table entries are NaN. With the
interpreter's 32-row query tiles and 32-key tiles, the lengths below cross query-tile, key-tile and
page boundaries.
"""

from __future__ import annotations

import pytest
import torch

import pagedkernels as pk
from pagedkernels import prefill_attention as prefill_module
from tests.pagedkernels.oracle import ATTENTION_TOLERANCES, attention_oracle, make_paged_kv

BACKENDS = ["triton", "torch"]
BF16_INTERPRETER_SKIP = "bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA"


def _skip_unsupported(backend: str, device: str, dtype: torch.dtype) -> None:
    if backend == "triton" and device == "cpu" and dtype == torch.bfloat16:
        pytest.skip(BF16_INTERPRETER_SKIP)


def _make_batch(seq_lens, q_lens, block_size, num_kv_heads, group, head_dim, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator=generator)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype).to(device)
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return kv, q, cu_seqlens_q


def _check(seq_lens, q_lens, *, block_size, num_kv_heads, group, head_dim, dtype, backend, device,
           seed=0, scale=None, sliding_window=None, softcap=None, use_out=False):
    _skip_unsupported(backend, device, dtype)
    kv, q, cu = _make_batch(seq_lens, q_lens, block_size, num_kv_heads, group, head_dim, dtype, device, seed)
    out = torch.full_like(q, float("nan")) if use_out else None
    with pk.use_backend(backend):
        result = pk.paged_prefill_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, cu, kv.seq_lens,
                                            scale=scale, sliding_window=sliding_window, softcap=softcap, out=out)
    if use_out:
        assert result is out
    assert result.shape == q.shape and result.dtype == dtype and result.device == q.device
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    for s in range(len(seq_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = attention_oracle(q[rows], kv.keys[s], kv.values[s], scale=scale,
                                    sliding_window=sliding_window, softcap=softcap)
        torch.testing.assert_close(result[rows].double().cpu(), expected, atol=atol, rtol=rtol,
                                   msg=lambda m: f"sequence {s} (seq_len {seq_lens[s]}, q_len {q_lens[s]}): {m}")


# (seq_lens, q_lens): first prefill, prefix hit / chunked prefill, decode rows, mixed.
BATCHES = {
    "first_prefill": ([45, 7], [45, 7]),
    "chunked": ([70, 33], [21, 33]),
    "decode_only": ([1, 17, 40], [1, 1, 1]),
    "mixed": ([37, 1, 66, 9, 24], [37, 1, 19, 1, 5]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_batch_kinds(batch, backend, device):
    seq_lens, q_lens = BATCHES[batch]
    _check(seq_lens, q_lens, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
           backend=backend, device=device)
