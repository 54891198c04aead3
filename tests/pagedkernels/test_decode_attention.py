"""pk.paged_decode_attention against the float64 dense oracle, Triton (interpreted on CPU) and torch."""

import pytest
import torch

import pagedkernels as pk
from tests.pagedkernels.oracle import ATTENTION_TOLERANCES, attention_oracle, make_paged_kv

BACKENDS = ["triton", "torch"]


def _skip_unsupported(backend, dtype, device):
    if backend == "triton" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter; tested on CUDA")


def _case(seq_lens, *, num_kv_heads, group, head_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator=gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    return q, kv


def _expected(q, kv, **kwargs):
    rows = []
    for s, n in enumerate(kv.seq_lens.tolist()):
        if n == 0:
            rows.append(torch.zeros(q.shape[1:], dtype=torch.float64))
        else:
            rows.append(attention_oracle(q[s:s + 1], kv.keys[s], kv.values[s], **kwargs)[0])
    return torch.stack(rows)


def _run_and_check(backend, q, kv, **kwargs):
    oracle_kwargs = {k: v for k, v in kwargs.items() if k in ("scale", "sliding_window", "softcap")}
    with pk.use_backend(backend):
        out = pk.paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    atol, rtol = ATTENTION_TOLERANCES[q.dtype]
    torch.testing.assert_close(out.double().cpu(), _expected(q, kv, **oracle_kwargs), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matches_oracle(backend, dtype, device):
    _skip_unsupported(backend, dtype, device)
    q, kv = _case([1, 17, 40], num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=dtype, device=device)
    _run_and_check(backend, q, kv)
