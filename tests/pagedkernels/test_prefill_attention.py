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
from tests.pagedkernels.oracle import assert_attention_close, attention_oracle, make_paged_kv

BACKENDS = ["triton", "torch", "native"]
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
    for s in range(len(seq_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = attention_oracle(q[rows], kv.keys[s], kv.values[s], scale=scale,
                                    sliding_window=sliding_window, softcap=softcap)
        assert_attention_close(result[rows], expected,
                               msg=f"sequence {s} (seq_len {seq_lens[s]}, q_len {q_lens[s]})")


# (seq_lens, q_lens): first prefill, prefix hit / chunked prefill, decode rows, mixed, and a batch with
# many sequences (the native kernel then gives each thread whole sequences, all KV heads, instead of
# one KV head each: both work splits are covered).
BATCHES = {
    "first_prefill": ([45, 7], [45, 7]),
    "chunked": ([70, 33], [21, 33]),
    "decode_only": ([1, 17, 40], [1, 1, 1]),
    "mixed": ([37, 1, 66, 9, 24], [37, 1, 19, 1, 5]),
    "many_sequences": ([3 + 7 * i for i in range(20)] + [30, 41], [1] * 20 + [30, 18]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_batch_kinds(batch, backend, device):
    seq_lens, q_lens = BATCHES[batch]
    _check(seq_lens, q_lens, block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32,
           backend=backend, device=device)


MIXED = ([37, 1, 66, 9, 24], [37, 1, 19, 1, 5])


# A covering grid rather than the cross product: the common head sizes and padded ones (48, 112, 160
# and the smallest, 32), block size 8..128, GQA groups 1, 2, 3, 4, 7, 16 and every dtype appear, each
# with a mixed batch.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "head_dim, block_size, num_kv_heads, group, dtype",
    [
        (64, 8, 2, 1, torch.float16),
        (80, 16, 1, 3, torch.float32),
        (96, 32, 2, 4, torch.float16),
        (128, 128, 1, 7, torch.float32),
        (256, 16, 1, 16, torch.float16),
        (128, 8, 2, 4, torch.bfloat16),
        (80, 32, 1, 7, torch.bfloat16),
        (256, 8, 1, 3, torch.float32),
        # head sizes whose tiles are padded to the next power of two (masked head dimension)
        (48, 16, 2, 2, torch.float32),
        (112, 8, 1, 4, torch.float16),
        (160, 32, 1, 2, torch.float32),
        (32, 16, 2, 1, torch.float16),
    ],
)
def test_shapes_and_dtypes(head_dim, block_size, num_kv_heads, group, dtype, backend, device):
    _check(*MIXED, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
           dtype=dtype, backend=backend, device=device, seed=head_dim + block_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "sliding_window, softcap, scale, dtype",
    [
        (1, None, None, torch.float32),  # each query sees only itself
        (8, None, None, torch.float16),  # window smaller than a page and a tile
        (70, None, 0.05, torch.float32),  # window start inside earlier tiles; fully visible middle tile
        (1000, None, None, torch.float16),  # window longer than every sequence: plain causal
        (None, 5.0, None, torch.float32),
        (None, 2.0, 0.3, torch.float16),  # large scale: the softcap saturates
        (33, 10.0, None, torch.float32),
        (33, 10.0, None, torch.bfloat16),
    ],
)
def test_sliding_window_softcap_scale(sliding_window, softcap, scale, dtype, backend, device):
    _check([150, 40, 9, 60], [6, 40, 1, 60], block_size=16, num_kv_heads=2, group=2, head_dim=64, dtype=dtype,
           backend=backend, device=device, sliding_window=sliding_window, softcap=softcap, scale=scale)


# fp16 and bf16 through every feature: first prefills, chunked prefills and decode rows in varlen
# batches, GQA and MHA, pages of 8 to 32 tokens, a sliding window, a softcap, and a 4096-token context,
# where a kernel keeping its accumulator or softmax sum in 16 bits fails the per-vector bound
# (oracle.ATTENTION_VECTOR_RTOL). bf16 Triton is checked on CUDA (the interpreter's is wrong).
HALF_PRECISION_CASES = {
    # seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, options
    "first_prefill_gqa": ([45, 7], [45, 7], 2, 2, 64, 16, {}),
    "chunked_mha": ([70, 33], [21, 33], 2, 1, 128, 8, {}),
    "mixed_decode_rows": ([37, 1, 66, 9, 24], [37, 1, 19, 1, 5], 1, 7, 80, 32, {}),
    "window": ([150, 40, 9, 60], [6, 40, 1, 60], 2, 2, 64, 16, dict(sliding_window=8)),
    "softcap": ([150, 40, 9, 60], [6, 40, 1, 60], 2, 2, 64, 16, dict(softcap=2.0, scale=0.3)),
    "window_softcap": ([70, 33, 1], [70, 12, 1], 2, 4, 96, 16, dict(sliding_window=33, softcap=10.0)),
    "long_context": ([4096, 200], [40, 200], 1, 4, 128, 16, {}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(HALF_PRECISION_CASES))
def test_half_precision_features(backend, dtype, case, device):
    seq_lens, q_lens, num_kv_heads, group, head_dim, block_size, options = HALF_PRECISION_CASES[case]
    _check(seq_lens, q_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
           dtype=dtype, backend=backend, device=device, seed=len(case), **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_query_sequences_and_out(backend, device):
    # Sequences with no new token (q_len 0) own no output rows; `out` is filled and returned. Then a sequence of
    # nothing (seq_len 0), as the engine's compiled forward pads a batch of one sequence with
    # (engine/worker/model_runner.py _no_dimension_of_one).
    _check([12, 30, 5, 20], [0, 30, 0, 3], block_size=8, num_kv_heads=1, group=4, head_dim=64,
           dtype=torch.float16, backend=backend, device=device, use_out=True)
    _check([21, 0], [21, 0], block_size=8, num_kv_heads=1, group=4, head_dim=64,
           dtype=torch.float16, backend=backend, device=device, use_out=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_q(backend, device):
    # q as the engine slices it out of a fused qkv projection: rows strided, heads contiguous.
    seq_lens, q_lens = [40, 25], [40, 7]
    num_kv_heads, group, head_dim = 2, 2, 64
    kv, q, cu = _make_batch(seq_lens, q_lens, 16, num_kv_heads, group, head_dim, torch.float32, device, seed=3)
    qkv = torch.randn(q.shape[0], (group + 2) * num_kv_heads * head_dim, device=device)
    strided_q = qkv[:, : group * num_kv_heads * head_dim].view_as(q)
    strided_q.copy_(q)
    assert not strided_q.is_contiguous()
    with pk.use_backend(backend):
        result = pk.paged_prefill_attention(strided_q, kv.key_cache, kv.value_cache, kv.block_tables, cu,
                                            kv.seq_lens)
    for s in range(len(seq_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = attention_oracle(q[rows], kv.keys[s], kv.values[s])
        torch.testing.assert_close(result[rows].double().cpu(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_caches(backend, device):
    # Caches stored [num_blocks, num_kv_heads, block_size, head_dim] and viewed in the API layout:
    # the kernel must follow the strides, the twin must not assume a plain layout.
    seq_lens, q_lens = [45, 20], [12, 20]
    kv, q, cu = _make_batch(seq_lens, q_lens, 16, 2, 2, 64, torch.float16, device, seed=11)
    key_cache = kv.key_cache.transpose(1, 2).contiguous().transpose(1, 2)
    value_cache = kv.value_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert not key_cache.is_contiguous()
    with pk.use_backend(backend):
        result = pk.paged_prefill_attention(q, key_cache, value_cache, kv.block_tables, cu, kv.seq_lens)
    for s in range(len(seq_lens)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        expected = attention_oracle(q[rows], kv.keys[s], kv.values[s])
        torch.testing.assert_close(result[rows].double().cpu(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.triton
@pytest.mark.parametrize("launch_config", [(128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 2), (64, 16, 8, 2),
                                           (16, 16, 4, 1)])
def test_triton_gpu_tile_configs(launch_config, device, monkeypatch):
    """The interpreter normally runs 32 x 32 tiles; the GPU configurations (and the smallest legal
    one) must be just as correct: query tiles spanning several sequences' tokens, key tiles smaller
    and larger than a page."""
    monkeypatch.setattr(prefill_module, "launch_config",
                        lambda head_dim_pad, group_pad, dtype, device_kind, kv_fp8=False, head_dim=None:
                        (max(launch_config[0], group_pad), *launch_config[1:]))
    _check([70, 1, 90, 17], [70, 1, 12, 3], block_size=16, num_kv_heads=2, group=3, head_dim=96,
           dtype=torch.float32, backend="triton", device=device, sliding_window=50)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selected_backend_runs(backend, device, monkeypatch):
    """Each backend runs its own implementation (once) and never another's."""
    from pagedkernels import _native

    impls = {"triton": (prefill_module, "_prefill_attention_triton"),
             "torch": (prefill_module, "_prefill_attention_torch"),
             "native": (_native, "paged_attention")}
    launched = []
    for name, (module, attr) in impls.items():
        if name == backend:
            real = getattr(module, attr)
            monkeypatch.setattr(module, attr, lambda *args, _real=real: launched.append(args) or _real(*args))
        else:
            monkeypatch.setattr(module, attr, lambda *args, _n=attr: pytest.fail(f"{_n} ran under backend {backend!r}"))
    if backend == "triton":
        kernel = prefill_module._prefill_attention_kernel
        launches = []

        class CountingKernel:
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]

        monkeypatch.setattr(prefill_module, "_prefill_attention_kernel", CountingKernel())
    _check([20, 9], [5, 9], block_size=8, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32,
           backend=backend, device=device)
    assert len(launched) == 1
    if backend == "triton":
        assert len(launches) == 1


# ---------------------------------------------------------------- argument validation


def _valid_args(device="cpu"):
    kv, q, cu = _make_batch([20, 9], [5, 9], 8, 2, 2, 64, torch.float32, device, seed=7)
    return dict(q=q, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                cu_seqlens_q=cu, seq_lens=kv.seq_lens)


def _replace(**changes):
    return lambda args: {**args, **{k: (v(args) if callable(v) else v) for k, v in changes.items()}}


BAD_CALLS = {
    "q_dtype": (_replace(q=lambda a: a["q"].double()), "q"),
    "q_rank": (_replace(q=lambda a: a["q"].flatten(1)), "q"),
    "q_not_tensor": (_replace(q=lambda a: a["q"].tolist()), "q"),
    "cache_dtype": (_replace(key_cache=lambda a: a["key_cache"].half(), value_cache=lambda a: a["value_cache"].half()),
                    "key_cache"),
    "value_cache_shape": (_replace(value_cache=lambda a: a["value_cache"][:-1]), "value_cache"),
    "cache_device": (_replace(key_cache=lambda a: a["key_cache"].to("meta"),
                              value_cache=lambda a: a["value_cache"].to("meta")), "key_cache"),
    "head_dim_mismatch": (_replace(q=lambda a: a["q"].repeat(1, 1, 2)), "head_dim"),
    "head_size": (_replace(q=lambda a: a["q"][..., :40].contiguous(),
                           key_cache=lambda a: a["key_cache"][..., :40].contiguous(),
                           value_cache=lambda a: a["value_cache"][..., :40].contiguous()), "head size"),
    "head_size_small": (_replace(q=lambda a: a["q"][..., :16].contiguous(),
                                 key_cache=lambda a: a["key_cache"][..., :16].contiguous(),
                                 value_cache=lambda a: a["value_cache"][..., :16].contiguous()), "head size"),
    "gqa_ratio": (_replace(q=lambda a: a["q"][:, :3].contiguous()), "num_q_heads"),
    "block_tables_dtype": (_replace(block_tables=lambda a: a["block_tables"].long()), "block_tables"),
    "block_tables_rows": (_replace(block_tables=lambda a: a["block_tables"][:1]), "block_tables"),
    "cu_seqlens_dtype": (_replace(cu_seqlens_q=lambda a: a["cu_seqlens_q"].long()), "cu_seqlens_q"),
    "cu_seqlens_length": (_replace(cu_seqlens_q=lambda a: a["cu_seqlens_q"][:-1]), "cu_seqlens_q"),
    "seq_lens_dtype": (_replace(seq_lens=lambda a: a["seq_lens"].long()), "seq_lens"),
    "seq_lens_rank": (_replace(seq_lens=lambda a: a["seq_lens"][None]), "seq_lens"),
    "sliding_window_zero": (_replace(sliding_window=0), "sliding_window"),
    "sliding_window_float": (_replace(sliding_window=2.5), "sliding_window"),
    "softcap_negative": (_replace(softcap=-1.0), "softcap"),
    "scale_type": (_replace(scale="0.1"), "scale"),
    "out_shape": (_replace(out=lambda a: torch.empty_like(a["q"][1:])), "out"),
    "out_dtype": (_replace(out=lambda a: torch.empty_like(a["q"], dtype=torch.float16)), "out"),
    "out_strided": (_replace(out=lambda a: torch.empty(a["q"].shape[::-1]).permute(2, 1, 0)), "out"),
    # value checks (CPU, or CUDA with PAGEDKERNELS_DEBUG=1)
    "cu_seqlens_start": (_replace(cu_seqlens_q=lambda a: a["cu_seqlens_q"] + 1), "cu_seqlens_q"),
    "cu_seqlens_decreasing": (_replace(cu_seqlens_q=lambda a: a["cu_seqlens_q"][[0, 2, 1]]), "cu_seqlens_q"),
    "cu_seqlens_total": (_replace(q=lambda a: a["q"][:-1]), "cu_seqlens_q"),
    "seq_lens_negative": (_replace(cu_seqlens_q=lambda a: a["cu_seqlens_q"][[0, 0, 2]],
                                   seq_lens=lambda a: a["seq_lens"] * torch.tensor([-1, 1], dtype=torch.int32,
                                                                                  device=a["seq_lens"].device)),
                          "seq_lens must be non-negative"),
    "q_len_over_seq_len": (_replace(seq_lens=lambda a: a["seq_lens"] - torch.tensor([0, 1], dtype=torch.int32,
                                                                                      device=a["seq_lens"].device)),
                           "seq_lens"),
    "block_table_too_short": (_replace(block_tables=lambda a: a["block_tables"][:, :2]), "block_tables"),
    "block_id_out_of_range": (_replace(block_tables=lambda a: a["block_tables"] + a["key_cache"].shape[0]),
                              "block_tables"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_value_error(case, backend, device, monkeypatch):
    monkeypatch.setenv("PAGEDKERNELS_DEBUG", "1")  # value checks on CUDA too
    change, match = BAD_CALLS[case]
    args = change(_valid_args(device))
    with pk.use_backend(backend), pytest.raises(ValueError, match=match):
        pk.paged_prefill_attention(**args)
