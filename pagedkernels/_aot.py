"""Ahead-of-time compile of every Triton launch the pagedkernels wrappers make, for GPUs this machine
need not have (Hopper sm_90 and Ampere sm_80 by default), with the resources ptxas reports.

    python -m pagedkernels._aot [--targets 90,80] [--triton 3.6.0] [--jobs N] [--representatives]
                                [--out report.json] [--md report.md] [--no-cache] [--update-cache]

1. Record: every public op runs over :func:`launch_matrix` (dtypes, head sizes, GQA groups, page
   sizes, window, softcap, forced splits, norms, rotary, cache ops) on small CPU tensors inside
   ``_backend.simulate_cuda_launches()``, once per target's compute capability: the wrappers choose their launch
   configs exactly as on an H100 (an A100's SMs stand in by the same count), and each ``kernel[grid](...)`` is caught
   by a :class:`_Recorder` instead of launched. Nothing runs, so recording the whole matrix takes a second or two.
2. Specialize: each recorded launch goes through Triton's own binder for the target, which gives
   the signature a real launch would compile (pointer dtypes, divisibility by 16, ints equal to 1,
   constexprs, num_warps / num_stages). Launches with the same specialization compile once; with
   ``--representatives`` (the CI test) only one per tile class (:func:`representatives`).
3. Compile each distinct specialization for every target whose recording made it (a launch config chosen per
   architecture, or programmatic dependent launch, whose kernel waits with griddepcontrol, on sm_90 alone) with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` and read ptxas' ``-v`` report (Triton
   prints it with ``TRITON_DUMP_PTXAS_LOG=1``): registers, spill stores / loads, stack frame; shared memory is
   Triton's allocation (``metadata.shared``) plus ptxas' static smem.

:func:`problems` lists what would fail on the device: a compile error, a spill in a hot kernel
(:data:`HOT_KERNELS`), more shared memory than a block may have (:data:`SHARED_MEMORY_LIMITS`) or
a grid dimension past CUDA's limits. The CLI exits 1 when there are any.

The kernels must be real ``JITFunction``s, not the interpreter's stand-ins, so ``TRITON_INTERPRET``
must be off before pagedkernels is imported; the CLI re-executes itself that way when needed, and
with ``--triton VERSION`` puts that Triton (installed on first use into
``$PAGEDKERNELS_CACHE_DIR/triton-VERSION`` with ``pip install --no-deps --target``) first on the
path. The two Triton versions share these entry points (``create_function_from_signature``,
``JITFunction._pack_args``, ``ASTSource``, ``triton.compile``); :func:`_specialize` is the small
compatibility layer between them.

Results cache: a compile's result (ptxas' resources or the compiler's error) depends only on the Triton
version, the target and what is compiled: the kernel's source and the sources of every function and global
constexpr it uses (Triton's own ``JITFunction.cache_key``), the specialized signature, constexprs and
options. ``aot_results.json`` beside this file keeps results under a hash of exactly those, per Triton
version, so a run compiles only what changed since the file was written (all of it when a kernel or a
launch config changed; ``--no-cache`` compiles everything). ``--update-cache`` rewrites this Triton's part
with the run's results (entries no variant uses any more are dropped). Commit it after a kernel change, or
the next CI run compiles the changed variants itself (correct, only slower).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

KERNEL_MODULES = ("decode_attention", "prefill_attention", "cache_ops", "rms_norm", "rotary", "activation", "wq_gemm",
                  "gguf_quant", "moe_topk", "moe_align", "fused_moe", "lora", "skinny_gemm", "sampling")
RESULTS_CACHE = Path(__file__).with_name("aot_results.json")
# Kernels on the per-token path of every model step: a register spill there is a failure.
HOT_KERNELS = frozenset({"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_attention_kernel",
                         "_reshape_and_cache_kernel", "_rms_norm_kernel", "_wq_gemm_kernel", "_fused_moe_kernel",
                         "_moe_sum_kernel", "_moe_topk_kernel", "_moe_align_kernel", "_lora_shrink_kernel",
                         "_lora_expand_kernel", "_skinny_gemm_kernel", "_rotary_cache_kernel", "_sample_kernel",
                         "_moe_gemv_up_kernel", "_moe_gemv_down_kernel"})
# Shared memory one block may use (opt-in maximum), bytes: sm_90 (H100) 227 KiB, sm_80 (A100) 163 KiB.
SHARED_MEMORY_LIMITS = {90: 227 * 1024, 80: 163 * 1024}
DEFAULT_TARGETS = (90, 80)
# CUDA's grid limits: x up to 2**31 - 1, y and z up to 65535.
GRID_LIMITS = (2**31 - 1, 65535, 65535)
# The SM count the recorded launch configs are chosen for (H100 SXM).
SIMULATED_SMS = 132


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDKERNELS_CACHE_DIR", Path.home() / ".cache" / "pagedkernels"))


def triton_dir(version: str) -> Path:
    """Where ``--triton VERSION`` lives: a plain ``pip install --target`` tree."""
    return cache_dir() / f"triton-{version}"


def ensure_triton(version: str) -> Path:
    """Install Triton ``version`` (no dependencies) into :func:`triton_dir` unless it is there.
    Raises RuntimeError with pip's output when that fails (e.g. no network)."""
    target = triton_dir(version)
    marker = target / f"triton-{version}.dist-info"
    if marker.is_dir() and (target / "triton" / "__init__.py").is_file():
        return target
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--target", str(partial), f"triton=={version}"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"pip could not install triton=={version}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # atomic: a concurrent or interrupted install never leaves half a tree
    return target


# ------------------------------------------------------------------------------------------------
# 1. record
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` a wrapper made, and the matrix case that made it."""
    kernel: Any  # triton JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    case: str


def _stand_in(value: Any) -> Any:
    """A tensor argument as a 16-element tensor of its dtype, its address a multiple of 16 bytes or not as the
    argument's was (all Triton specializes a pointer on), other arguments as they are. A launch then keeps no
    activation or weight of its case alive: the matrix's layer-sized cases (a Mixtral layer's weights are 2 GB)
    cost no memory once recorded, and the compile pool can fork."""
    if not isinstance(value, torch.Tensor):
        return value
    small = torch.empty(32, dtype=value.dtype)
    return small[:16] if value.data_ptr() % 16 == 0 else small[1:17]


class _Recorder:
    """Stands in for a kernel in its module while recording: ``kernel[grid](...)`` appends a Launch (its tensors
    replaced by :func:`_stand_in`'s)."""

    def __init__(self, kernel: Any, launches: list[Launch], case: list[str]):
        self.kernel, self.launches, self.case = kernel, launches, case

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append(Launch(self.kernel, tuple(int(g) for g in grid), tuple(map(_stand_in, args)),
                                        {k: _stand_in(v) for k, v in kwargs.items()}, self.case[0]))
        return record


def launched_kernels() -> dict[str, tuple[Any, str]]:
    """Every kernel a wrapper launches (``@triton.jit`` functions named ``*_kernel`` in the op
    modules; the ``@triton.jit`` helpers they call are compiled into them): name -> (kernel, module).
    Under the interpreter these are its stand-ins: they record like kernels but cannot compile."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"pagedkernels.{name}")
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and isinstance(value, (JITFunction, InterpretedFunction)):
                found[attr] = (value, module.__name__)
    return found


@contextlib.contextmanager
def record_launches(capability: tuple[int, int] = (9, 0)) -> Iterator[tuple[list[Launch], list[str]]]:
    """Swap every launched kernel for a recorder and simulate a CUDA device of ``capability`` for the body. Yields
    the list the launches go to and a one-item list holding the current case label (set it per case).
    Nothing is launched, so this works under the interpreter too (compiling needs it off)."""
    from . import _backend

    launches: list[Launch] = []
    case = [""]
    originals = []
    for attr, (kernel, module_name) in launched_kernels().items():
        module = sys.modules[module_name]
        originals.append((module, attr, kernel))
        setattr(module, attr, _Recorder(kernel, launches, case))
    try:
        with _backend.simulate_cuda_launches(SIMULATED_SMS, capability):
            yield launches, case
    finally:
        for module, attr, kernel in originals:
            setattr(module, attr, kernel)


def _randn(*shape, dtype, generator):
    return torch.randn(*shape, generator=generator).to(dtype)


def _paged_inputs(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, generator: torch.Generator, *, table_width: int | None = None):
    """KV caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` with each of ``num_seqs``
    sequences owning its own blocks, its table padded to ``table_width`` columns."""
    blocks_per_seq = -(-seq_len // block_size)
    width = max(blocks_per_seq, table_width or 0)
    num_blocks = num_seqs * blocks_per_seq
    key_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator)
    value_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=generator)
    block_tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    block_tables[:, :blocks_per_seq] = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    return key_cache, value_cache, block_tables, seq_lens


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head sizes: the common ones, then odd multiples of 16 whose tiles are padded (48 -> 64, 112 -> 128,
# 160 -> 256). Each padded width (64, 128, 256) has at least two, so the alternation below gives
# every width both feature sets under both group classes.
HEAD_SIZES = (64, 48, 128, 80, 96, 112, 256, 160)


def _attention_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """Decode and prefill for every dtype x head size, twice: once without GQA (group 1: the prefill
    tiles differ) and once with a group of 4 or 8; one of the two with sliding window + softcap (the
    most live values), alternating with the head size. Page sizes 16 and 32, and the split counts,
    vary along with them: each changes a constexpr, not the tile shapes."""
    import pagedkernels as pk

    num_kv_heads = 2
    for dtype in DTYPES:
        for i, head_dim in enumerate(HEAD_SIZES):
            for group, block_size, capped in ((1, 16, i % 2 == 0), (4 + 4 * (i // 2 % 2), 32, i % 2 == 1)):
                window, softcap = (100, 30.0) if capped else (None, None)
                label = (f"{str(dtype).replace('torch.', '')} head={head_dim} group={group} block={block_size}"
                         f"{' window+softcap' if capped else ''}")

                def decode(gen, dtype=dtype, head_dim=head_dim, group=group, block_size=block_size, window=window,
                           softcap=softcap, capped=capped, i=i):
                    # Capped: a forced split count (under a 100-token window the H100 heuristic would
                    # not split). Plain: one sequence with a 4096-token table, which the heuristic
                    # splits 32 ways, then a batch that fills the GPU unsplit.
                    calls = ((3, 8, 2 + i % 3),) if capped else ((1, 4096 // block_size, None), (80, 8, None))
                    for num_seqs, width, forced in calls:
                        k, v, table, lens = _paged_inputs(num_seqs, 40, num_kv_heads, head_dim, block_size, dtype,
                                                          gen, table_width=width)
                        q = _randn(num_seqs, num_kv_heads * group, head_dim, dtype=dtype, generator=gen)
                        pk.paged_decode_attention(q, k, v, table, lens, sliding_window=window, softcap=softcap,
                                                  num_splits=forced)

                def prefill(gen, dtype=dtype, head_dim=head_dim, group=group, block_size=block_size, window=window,
                            softcap=softcap):
                    # Three sequences: a first prefill, a chunk after a cached prefix, a decode row.
                    q_lens, seq_lens = [37, 20, 1], [37, 60, 45]
                    k, v, table, _ = _paged_inputs(3, max(seq_lens), num_kv_heads, head_dim, block_size, dtype, gen)
                    lens = torch.tensor(seq_lens, dtype=torch.int32)
                    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32)
                    q = _randn(sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype, generator=gen)
                    pk.paged_prefill_attention(q, k, v, table, cu, lens, sliding_window=window, softcap=softcap)

                yield f"decode {label}", decode
                yield f"prefill {label}", prefill


def _fused_reduce_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """Decode with split counters (the splits merged in the split kernel, no reduce launch) for every dtype x head
    size: one sequence over a 4096-token table (32 splits on an H100), the GQA group, window and softcap alternating
    as in the plain cases; and float8 caches at head 128 with all three."""
    import pagedkernels as pk

    fp8 = torch.float8_e4m3fn
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for i, head_dim in enumerate(HEAD_SIZES):
            group, capped = (1, False) if i % 2 == 0 else (4 + 4 * (i // 2 % 2), True)
            cases = [(head_dim, group, capped, None)] + ([(128, 8, True, fp8)] if i == 0 else [])
            for head, grp, cap, cache_dtype in cases:
                label = (f"{name} head={head} group={grp}{' float8 cache' if cache_dtype else ''}"
                         f"{' window+softcap' if cap else ''}")

                def decode(gen, dtype=dtype, head=head, grp=grp, cap=cap, cache_dtype=cache_dtype):
                    k, v, table, lens = _paged_inputs(1, 40, 2, head, 16, torch.float32 if cache_dtype else dtype,
                                                      gen, table_width=4096 // 16)
                    scales = {}
                    if cache_dtype is not None:
                        k, v, scales = k.to(cache_dtype), v.to(cache_dtype), dict(k_scale=0.1, v_scale=0.2)
                    q = _randn(1, 2 * grp, head, dtype=dtype, generator=gen)
                    pk.paged_decode_attention(q, k, v, table, lens, sliding_window=1000 if cap else None,
                                              softcap=30.0 if cap else None,
                                              split_counters=torch.zeros(2, dtype=torch.int32), **scales)
                yield f"decode fused reduce {label}", decode


def _rope_decode_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """rotary_cache_decode_attention (the rotary embedding and the KV-cache write inside the decode split kernel) for
    every dtype x head size: the q/k norms, GPT-J pairs with a partial rotary, the split counters and the GQA group
    alternating with the head size, one sequence over a 4096-token table (32 splits on an H100) or a batch that
    fills the GPU unsplit; and float8 caches at head 128 with the norms."""
    import pagedkernels as pk

    fp8 = torch.float8_e4m3fn
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for i, head_dim in enumerate(HEAD_SIZES):
            norm, is_neox, counters, split = i % 2 == 0, i % 4 != 3, i % 4 < 2, i % 3 != 2
            group = (1, 3, 4, 8)[i % 4]
            rot_dim = head_dim if is_neox else 32
            cases = [(head_dim, group, rot_dim, norm, is_neox, None)]
            if i == 0:
                cases.append((128, 8, 128, True, True, fp8))
            for head, grp, rot, nrm, neox, cache_dtype in cases:
                label = (f"{name} head={head} group={grp} rot={rot} {'neox' if neox else 'gptj'}"
                         f"{' qk_norm' if nrm else ''}"
                         f"{' float8 cache' if cache_dtype else ''}{' counters' if counters else ''}"
                         f"{' split' if split else ' unsplit'}")

                def rope_decode(gen, dtype=dtype, head=head, grp=grp, rot=rot, nrm=nrm, neox=neox,
                                cache_dtype=cache_dtype, counters=counters, split=split):
                    num_seqs, width = (1, 4096 // 16) if split else (80, 8)
                    k, v, table, lens = _paged_inputs(num_seqs, 40, 2, head, 16,
                                                      torch.float32 if cache_dtype else dtype, gen, table_width=width)
                    scales = {}
                    if cache_dtype is not None:
                        k, v, scales = k.to(cache_dtype), v.to(cache_dtype), dict(k_scale=0.1, v_scale=0.2)
                    qkv = _randn(num_seqs, (2 * grp + 4) * head, dtype=dtype, generator=gen)
                    q, k_new, v_new = qkv.split([2 * grp * head, 2 * head, 2 * head], 1)
                    weights = dict(q_weight=_randn(head, dtype=dtype, generator=gen),
                                   k_weight=_randn(head, dtype=dtype, generator=gen), eps=1e-6) if nrm else {}
                    slots = table[:, 39 // 16].long() * 16 + 39 % 16
                    pk.rotary_cache_decode_attention(
                        torch.full((num_seqs,), 39), q.view(num_seqs, 2 * grp, head), k_new, v_new, k, v, slots,
                        pk.compute_cos_sin_cache(64, rot, 10000.0), table, lens, is_neox=neox, **weights, **scales,
                        split_counters=torch.zeros(2 * num_seqs, dtype=torch.int32) if counters else None)
                yield f"rotary_cache_decode {label}", rope_decode


def _cache_op_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    import pagedkernels as pk

    for d, dtype in enumerate(DTYPES):
        name = str(dtype).replace("torch.", "")
        # (num_kv_heads, head_dim): Llama-8B, SmolLM2 (3 x 64), one wide head, a padded head.
        for num_kv_heads, head_dim in ((8, 128), (3, 64), (1, 256), (4, 80)):
            def reshape(gen, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim):
                k, v, _, _ = _paged_inputs(2, 32, num_kv_heads, head_dim, 16, dtype, gen)
                # key/value as strided views of a fused qkv projection, the engine's layout
                qkv = _randn(5, (2 * num_kv_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, generator=gen)
                key = qkv[:, : num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
                value = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
                pk.reshape_and_cache(key, value, k, v, torch.tensor([0, 17, 33, -1, 63]))
            yield f"reshape_and_cache {name} kv_heads={num_kv_heads} head={head_dim}", reshape
        for num_kv_heads, head_dim in ((8, 128), (1, 64)):
            def copy(gen, dtype=dtype, num_kv_heads=num_kv_heads, head_dim=head_dim):
                caches = [_paged_inputs(1, 64, num_kv_heads, head_dim, 16, dtype, gen)[0] for _ in range(4)]
                pk.copy_blocks(caches[:2], caches[2:], torch.tensor([[0, 1], [2, 3]]))
            yield f"copy_blocks {name} kv_heads={num_kv_heads} head={head_dim}", copy


def _elementwise_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    import pagedkernels as pk

    for d, dtype in enumerate(DTYPES):
        name = str(dtype).replace("torch.", "")
        # hidden sizes: SmolLM2 (576), Llama-8B (4096), the largest one-tile row (8192), a chunked row.
        for j, hidden in enumerate((576, 4096, 8192, 12288)):
            def norm(gen, dtype=dtype, hidden=hidden):
                x = _randn(3, hidden, dtype=dtype, generator=gen)
                weight = _randn(hidden, dtype=dtype, generator=gen)
                pk.rms_norm(x, weight, 1e-6)
                pk.fused_add_rms_norm(x, _randn(3, hidden, dtype=dtype, generator=gen), weight, 1e-6)
            yield f"rms_norm {name} hidden={hidden}", norm
        # An fp32 residual stream under 16-bit activations.
        if dtype != torch.float32:
            def mixed_norm(gen, dtype=dtype):
                x = _randn(3, 4096, dtype=dtype, generator=gen)
                pk.fused_add_rms_norm(x, _randn(3, 4096, dtype=torch.float32, generator=gen),
                                      _randn(4096, dtype=dtype, generator=gen), 1e-6)
            yield f"fused_add_rms_norm {name} residual=float32", mixed_norm
        # (num_q_heads, num_kv_heads, head_size, rot_dim, is_neox): Llama, SmolLM2, partial GPT-J rotary.
        for num_q_heads, num_kv_heads, head_size, rot_dim, is_neox in ((32, 8, 128, 128, True), (9, 3, 64, 64, True),
                                                                        (16, 16, 256, 64, False)):
            def rotary(gen, dtype=dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                       rot_dim=rot_dim, is_neox=is_neox):
                cos_sin = pk.compute_cos_sin_cache(64, rot_dim, 10000.0, dtype=dtype)
                positions = torch.tensor([0, 5, 63])
                qkv = _randn(3, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, generator=gen)
                q = qkv[:, : num_q_heads * head_size]
                k = qkv[:, num_q_heads * head_size: (num_q_heads + num_kv_heads) * head_size]
                pk.rotary_embedding(positions, q, k, cos_sin, is_neox=is_neox, head_size=head_size)
                pk.rotary_embedding(positions, q, None, cos_sin, is_neox=is_neox, head_size=head_size)
            yield (f"rotary {name} heads={num_q_heads}/{num_kv_heads} head={head_size} rot={rot_dim} "
                   f"{'neox' if is_neox else 'gptj'}"), rotary
        # Qwen3's q/k norm and rotary in one launch: Qwen3-0.6B, Qwen3-30B-A3B, and a partial GPT-J rotary.
        for num_q_heads, num_kv_heads, head_size, rot_dim, is_neox in ((16, 8, 128, 128, True), (32, 4, 128, 128, True),
                                                                        (16, 16, 256, 64, False)):
            def qk_norm_rotary(gen, dtype=dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_size=head_size, rot_dim=rot_dim, is_neox=is_neox):
                cos_sin = pk.compute_cos_sin_cache(64, rot_dim, 10000.0)
                positions = torch.tensor([0, 5, 63])
                qkv = _randn(3, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, generator=gen)
                q = qkv[:, : num_q_heads * head_size]
                k = qkv[:, num_q_heads * head_size: (num_q_heads + num_kv_heads) * head_size]
                pk.qk_norm_rotary_embedding(positions, q, k, _randn(head_size, dtype=dtype, generator=gen),
                                            _randn(head_size, dtype=dtype, generator=gen), 1e-6, cos_sin,
                                            is_neox=is_neox, head_size=head_size)
            yield (f"qk_norm_rotary {name} heads={num_q_heads}/{num_kv_heads} head={head_size} rot={rot_dim} "
                   f"{'neox' if is_neox else 'gptj'}"), qk_norm_rotary
        # The rotary embedding and the KV-cache write in one launch (the few-row decoder layers'): Qwen3-0.6B with
        # its q/k norms, Llama-3-8B without, into a cache of the model's dtype or float8; a partial GPT-J rotary.
        for num_q_heads, num_kv_heads, head_size, rot_dim, is_neox, norm, fp8 in (
                (16, 8, 128, 128, True, True, False), (32, 8, 128, 128, True, False, False),
                (16, 8, 128, 128, True, True, True), (16, 16, 256, 64, False, True, False),
                (32, 32, 96, 32, True, False, True)):
            def rotary_cache(gen, dtype=dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, rot_dim=rot_dim, is_neox=is_neox, norm=norm, fp8=fp8):
                cos_sin = pk.compute_cos_sin_cache(64, rot_dim, 10000.0)
                positions = torch.tensor([0, 5, 63])
                qkv = _randn(3, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, generator=gen)
                q, k, v = qkv.split([num_q_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], 1)
                caches = [torch.zeros(4, 16, num_kv_heads, head_size, dtype=torch.float8_e4m3fn if fp8 else dtype)
                          for _ in range(2)]
                weights = dict(q_weight=_randn(head_size, dtype=dtype, generator=gen),
                               k_weight=_randn(head_size, dtype=dtype, generator=gen), eps=1e-6) if norm else {}
                pk.rotary_embedding_and_cache(positions, q, k, v, *caches, torch.tensor([3, 17, -1]), cos_sin,
                                              is_neox=is_neox, head_size=head_size, **weights,
                                              **(dict(k_scale=0.5, v_scale=0.25) if fp8 else {}))
            yield (f"rotary_and_cache {name} heads={num_q_heads}/{num_kv_heads} head={head_size} rot={rot_dim} "
                   f"{'neox' if is_neox else 'gptj'}{' qk_norm' if norm else ''}{' fp8' if fp8 else ''}"), rotary_cache
        def silu(gen, dtype=dtype):
            pk.silu_and_mul(_randn(3, 2 * 1536, dtype=dtype, generator=gen))
        yield f"silu_and_mul {name}", silu


def _sampling_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """The sampler's draw: float32 logits (what the engine's LM head gives the sampler), 16-bit ones too; a
    vocabulary of Qwen3's size (many blocks, a ragged last one)."""
    import pagedkernels as pk

    for dtype in DTYPES:
        def draw(gen, dtype=dtype):
            logits = _randn(3, 151936, dtype=dtype, generator=gen)
            pk.sample_from_logits(logits, torch.tensor([0.0, 0.6, 1.0]), torch.rand(3, generator=gen))
        yield f"sample_from_logits {str(dtype).replace('torch.', '')} vocab=151936", draw

        def filtered(gen, dtype=dtype):   # min-p / top-k / top-p: the threshold search's passes compiled in
            logits = _randn(3, 151936, dtype=dtype, generator=gen)
            pk.sample_from_logits(logits, torch.tensor([0.0, 0.6, 1.0]), torch.rand(3, generator=gen),
                                  torch.tensor([0, 20, 50]), torch.tensor([0.9, 0.95, 1.0]),
                                  torch.tensor([0.0, 0.05, 0.1]))
        yield f"sample_from_logits min-p/top-k/top-p {str(dtype).replace('torch.', '')} vocab=151936", filtered


def _fp8_kv_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """float8 caches: the write for every activation dtype, decode (split and not) and prefill for every
    dtype at the padded head widths 64 / 128 / 256 (one with GQA, window and softcap), copy_blocks."""
    import pagedkernels as pk

    fp8 = torch.float8_e4m3fn
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")

        def reshape(gen, dtype=dtype):
            k, v, _, _ = _paged_inputs(2, 32, 8, 128, 16, torch.float32, gen)
            key = _randn(5, 8, 128, dtype=dtype, generator=gen)
            pk.reshape_and_cache(key, key, k.to(fp8), v.to(fp8), torch.tensor([0, 17, 33, -1, 63]), k_scale=0.5,
                                 v_scale=2.0)
        yield f"reshape_and_cache {name} -> float8", reshape
        for head_dim, group, capped in ((64, 1, False), (128, 4, True), (256, 8, False)):
            window, softcap = (100, 30.0) if capped else (None, None)
            label = f"{name} head={head_dim} group={group} float8 cache{' window+softcap' if capped else ''}"

            def decode(gen, dtype=dtype, head_dim=head_dim, group=group, window=window, softcap=softcap):
                for num_seqs, width in ((1, 4096 // 16), (80, 8)):
                    k, v, table, lens = _paged_inputs(num_seqs, 40, 2, head_dim, 16, torch.float32, gen,
                                                      table_width=width)
                    q = _randn(num_seqs, 2 * group, head_dim, dtype=dtype, generator=gen)
                    pk.paged_decode_attention(q, k.to(fp8), v.to(fp8), table, lens, sliding_window=window,
                                              softcap=softcap, k_scale=0.1, v_scale=0.2)

            def prefill(gen, dtype=dtype, head_dim=head_dim, group=group, window=window, softcap=softcap):
                k, v, table, _ = _paged_inputs(3, 60, 2, head_dim, 16, torch.float32, gen)
                q = _randn(58, 2 * group, head_dim, dtype=dtype, generator=gen)
                cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32)
                lens = torch.tensor([37, 60, 45], dtype=torch.int32)
                pk.paged_prefill_attention(q, k.to(fp8), v.to(fp8), table, cu, lens,
                                           sliding_window=window, softcap=softcap, k_scale=0.1, v_scale=0.2)
            yield f"decode {label}", decode
            yield f"prefill {label}", prefill

    def copy(gen):
        caches = [_paged_inputs(1, 64, 8, 128, 16, torch.float32, gen)[0].to(fp8) for _ in range(4)]
        pk.copy_blocks(caches[:2], caches[2:], torch.tensor([[0, 1], [2, 3]]))
    yield "copy_blocks float8", copy


def _quant_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """wq_gemm for every activation dtype: decode shapes (M = 1 and 8: 16-row tiles, split-K) and prefill
    shapes (M = 64: 64 x 128 tiles; M = 256: 128 x 64) with int4 and int8, zero points and the
    symmetric default, groups that span a K tile and groups smaller than one (32: the per-column
    scale gather); fp8_gemm's weight-only launch (per channel and per tensor); GGUF de-quantization of
    every block type into every dtype."""
    import pagedkernels as pk
    from .quant_formats import quantize_wq

    N, K = 2048, 2048
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for M, bits, group, symmetric in ((1, 4, 128, False), (8, 8, 32, True), (1, 4, 32, True), (64, 4, 32, False),
                                          (64, 8, -1, True), (256, 4, 128, False), (256, 8, 64, False)):
            def wq(gen, dtype=dtype, M=M, bits=bits, group=group, symmetric=symmetric):
                w = quantize_wq(torch.randn(N, K, generator=gen), bits=bits, group_size=group, symmetric=symmetric,
                                scale_dtype=dtype)
                x = _randn(M, K, dtype=dtype, generator=gen)
                pk.wq_gemm(x, w.qweight, w.scales, w.zeros, bits=bits, group_size=group)
            yield f"wq_gemm {name} M={M} int{bits} group={group}{' symmetric' if symmetric else ''}", wq
        for M, per_channel in ((1, True), (256, False)):
            def fp8(gen, dtype=dtype, M=M, per_channel=per_channel):
                weight, scale = pk.quantize_fp8_weight(torch.randn(N, K, generator=gen), per_channel=per_channel)
                # CPU tensors under simulate_cuda_launches: the weight-only launch (sm_80), not _scaled_mm
                pk.fp8_gemm(_randn(M, K, dtype=dtype, generator=gen), weight, scale)
            yield f"fp8_gemm weight-only {name} M={M} {'per-channel' if per_channel else 'per-tensor'}", fp8
        for quant_type, (values, nbytes) in pk.GGUF_BLOCKS.items():
            def dequantize(gen, dtype=dtype, quant_type=quant_type, values=values, nbytes=nbytes):
                raw = torch.randint(0, 256, (64, 4096 // values * nbytes), dtype=torch.uint8, generator=gen)
                pk.gguf_dequantize(raw, quant_type, dtype=dtype)
            yield f"gguf_dequantize {quant_type} -> {name}", dequantize


# Mixture-of-experts layer shapes (experts, top_k, hidden, intermediate): Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B,
# and sizes that are no multiple of 16 (unaligned strides).
MOE_SHAPES = ((128, 8, 2048, 768), (8, 2, 4096, 14336), (64, 8, 2048, 1024), (6, 2, 1000, 360))


def _moe_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """fused_moe (both grouped GEMMs, the top-k sum, the alignment) for every dtype at the layer shapes of
    MOE_SHAPES and token counts that take each row block (decode: BLOCK_M 16 and its column-block choices; 32;
    64), GeGLU once; the router's top-k for every logits dtype at 8 / 60 / 128 experts and DeepSeek-V3's grouped
    sigmoid routing; the alignment with int64 ids. Activations and weights are never read while recording:
    torch.empty, so the large ones take no memory and no time."""
    import pagedkernels as pk

    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for experts, top_k, hidden, intermediate in MOE_SHAPES:
            for tokens in (1, 16, 256, 4096):
                def moe(gen, dtype=dtype, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                        tokens=tokens):
                    w13 = torch.empty(experts, 2 * intermediate, hidden, dtype=dtype)
                    w2 = torch.empty(experts, hidden, intermediate, dtype=dtype)
                    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
                    pk.fused_moe(torch.empty(tokens, hidden, dtype=dtype), w13, w2,
                                 torch.rand(tokens, top_k, generator=gen), ids,
                                 activation="gelu_tanh" if experts == 6 and tokens == 16 else "silu")
                yield f"fused_moe {name} E={experts} top{top_k} H={hidden} I={intermediate} tokens={tokens}", moe

            def gemv(gen, dtype=dtype, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate):
                w13 = torch.empty(experts, 2 * intermediate, hidden, dtype=dtype)
                w2 = torch.empty(experts, hidden, intermediate, dtype=dtype)
                previous = pk.set_moe_gemv_max_tokens(4)
                try:
                    for tokens in (1, 4):
                        ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
                        pk.fused_moe(torch.empty(tokens, hidden, dtype=dtype), w13, w2,
                                     torch.rand(tokens, top_k, generator=gen), ids,
                                     activation="gelu_tanh" if experts == 6 else "silu")
                finally:
                    pk.set_moe_gemv_max_tokens(previous)
            yield f"fused_moe matrix-vector {name} E={experts} top{top_k} H={hidden} I={intermediate}", gemv
        for experts, top_k, scoring, groups in ((8, 2, "softmax", 1), (60, 4, "softmax", 1), (128, 8, "softmax", 1),
                                                (256, 8, "sigmoid", 8)):
            def topk(gen, dtype=dtype, experts=experts, top_k=top_k, scoring=scoring, groups=groups):
                bias = torch.randn(experts, generator=gen) if groups > 1 else None
                for tokens in (1, 300):
                    pk.moe_topk(_randn(tokens, experts, dtype=dtype, generator=gen), top_k, scoring=scoring,
                                renormalize=True, correction_bias=bias, num_expert_group=groups,
                                topk_group=4 if groups > 1 else 1, weights_dtype=dtype)
            yield f"moe_topk {name} E={experts} top{top_k} {scoring} groups={groups}", topk

    def align(gen):
        pk.moe_align_block_size(torch.randint(0, 128, (4096, 8), generator=gen), 64, 128)
    yield "moe_align_block_size int64 ids E=128 block 64", align


def _lora_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """lora_shrink and lora_expand for every dtype at Llama-3-8B's projections (K 4096 or 14336) over two adapter
    slots: decode (1 token: 16-token tiles, K split 16 or 32 ways) and prefill (64 and 256 tokens: 64-token tiles)
    at the shrink's output widths 8 (one slice of rank 8: a 16-wide tile), 48 (q/k/v at rank 16), 96 (rank 32) and
    128 (gate/up at rank 64: a 64-wide tile twice), so the expand's rank tiles are 16, 32 and 64; with and without
    ``lora_ranks`` (a slot of half the stack's rank), one slice and several. With ``lora_ranks`` the engine's call,
    add_lora (the expand reading the shrink's K-split planes: at 1 token in rank chunks of 16, 32 and 64, and at 64
    and 128 tokens (a 128-row decode step's down projection at rank 16) in 64-token tiles of rank chunks 32 and
    16)."""
    import pagedkernels as pk

    qkv, gate_up = (4096, 1024, 1024), (14336, 14336)
    # (tokens, in_features, slice sizes, rank, with lora_ranks: the engine's calls, which always give them)
    shapes = ((1, 4096, qkv, 16, True), (1, 4096, qkv, 32, True), (1, 4096, gate_up, 64, True),
              (1, 14336, (4096,), 8, True), (1, 14336, (4096,), 8, False),
              (64, 4096, qkv, 32, False), (64, 4096, qkv, 32, True), (128, 3072, (1024,), 16, True),
              (256, 4096, gate_up, 64, True))
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for num_tokens, in_features, sizes, rank, ranked in shapes:
            def call(gen, dtype=dtype, num_tokens=num_tokens, in_features=in_features, sizes=sizes, rank=rank,
                     ranked=ranked):
                x = _randn(num_tokens, in_features, dtype=dtype, generator=gen)
                lora_a = _randn(2, len(sizes) * rank, in_features, dtype=dtype, generator=gen)
                lora_b = _randn(2, sum(sizes), rank, dtype=dtype, generator=gen)
                indices = torch.randint(-1, 2, (num_tokens,), generator=gen, dtype=torch.int32)
                mapping = dict(zip(("sorted_token_ids", "lora_token_starts"), pk.lora_mapping(indices, 2)))
                if ranked:
                    mapping["lora_ranks"] = torch.tensor([[rank // 2] * len(sizes), [rank] * len(sizes)],
                                                         dtype=torch.int32)
                out = torch.zeros(num_tokens, sum(sizes), dtype=dtype)
                if ranked:   # the engine's call: the expand sums the shrink's K-split planes
                    pk.add_lora(x, lora_a, lora_b, indices, out, slice_sizes=sizes, **mapping)
                    return
                buffer = pk.lora_shrink(x, lora_a, indices, **mapping)
                pk.lora_expand(buffer, lora_b, indices, out, slice_sizes=sizes, **mapping)
            yield (f"lora {name} tokens={num_tokens} K={in_features} slices={len(sizes)} rank={rank}"
                   f"{' lora_ranks' if ranked else ''}"), call


def _skinny_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """skinny_gemm for every dtype at Qwen3-0.6B's and Llama-3-8B's decode projections: 1 to 8 rows (the rows
    unrolled), 1 to 16 output rows a program (1: the 0.6B down projection, 16 with 8 warps: the 8B gate/up), K of
    one block and of 28, with the RMSNorm or SiLU-and-mul prologue, the residual epilogue and a bias, and plain; and
    the two LM heads at one row with the final norm in the prologue."""
    import pagedkernels as pk

    # (rows, N, K, prologue, residual, bias)
    shapes = ((1, 4096, 1024, "norm", False, False), (1, 1024, 3072, "silu", True, False),
              (8, 6144, 1024, "norm", False, True), (4, 4096, 14336, "silu", True, False),
              (2, 28672, 4096, "norm", False, False), (3, 1024, 2048, None, True, True),
              (1, 2048, 1024, None, False, False),
              # the LM heads with the final norm folded in (the engine's skinny_lm_head), Qwen3-0.6B's and Llama-3-8B's
              (1, 151936, 1024, "norm", False, False), (1, 128256, 4096, "norm", False, False))
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        for M, N, K, prologue, residual, bias in shapes:
            def call(gen, dtype=dtype, M=M, N=N, K=K, prologue=prologue, residual=residual, bias=bias):
                norm = prologue == "norm"
                x = _randn(M, 2 * K if prologue == "silu" else K, dtype=dtype, generator=gen)
                weight = torch.empty(N, K, dtype=dtype)   # recorded, not run: its values are never read
                pk.skinny_gemm(x, weight, torch.zeros(N, dtype=dtype) if bias else None,
                               norm_weight=torch.ones(K, dtype=dtype) if norm else None, eps=1e-6 if norm else None,
                               gated="silu" if prologue == "silu" else None,
                               residual=torch.zeros(M, N, dtype=dtype) if residual else None)
            yield (f"skinny_gemm {name} M={M} N={N} K={K}{' ' + prologue if prologue else ''}"
                   f"{' residual' if residual else ''}{' bias' if bias else ''}"), call
    # the deep launches (set_skinny_gemm_deep: K tiles widened, two in flight where K takes several), the 16-bit
    # dtypes at Qwen3-0.6B's and Llama-3-8B's batch-1 decoder projections and LM heads as the engine calls them
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")

        def deep(gen, dtype=dtype):
            previous = pk.set_skinny_gemm_deep(True)
            try:
                for N, K, prologue in ((4096, 1024, "norm"), (1024, 2048, None), (6144, 1024, "norm"),
                                       (1024, 3072, "silu"), (6144, 4096, "norm"), (4096, 4096, None),
                                       (28672, 4096, "norm"), (4096, 14336, "silu"), (151936, 1024, "norm"),
                                       (128256, 4096, "norm")):
                    x = _randn(1, 2 * K if prologue == "silu" else K, dtype=dtype, generator=gen)
                    pk.skinny_gemm(x, torch.empty(N, K, dtype=dtype),
                                   norm_weight=torch.ones(K, dtype=dtype) if prologue == "norm" else None,
                                   eps=1e-6 if prologue == "norm" else None,
                                   gated="silu" if prologue == "silu" else None,
                                   residual=torch.zeros(1, N, dtype=dtype) if prologue != "norm" else None)
            finally:
                pk.set_skinny_gemm_deep(previous)
        yield f"skinny_gemm deep {name} batch-1 projections", deep


def _pdl_cases() -> Iterator[tuple[str, Callable[[torch.Generator], None]]]:
    """The decode path's kernels launched with programmatic dependent launch (PAGEDKERNELS_PDL=1), in the 16-bit
    dtypes at Qwen3-0.6B's and Llama-3-8B's batch-1 shapes: skinny_gemm (its first weight tile loaded before the
    wait) with each prologue and the residual epilogue, rotary_embedding_and_cache with and without q/k norms, and
    a decode that splits (split + reduce, and the split kernel merging them itself)."""
    import pagedkernels as pk

    from . import _backend

    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")

        def call(gen, dtype=dtype):
            with mock.patch.object(_backend, "_pdl", True):
                for deep in (False, True):   # and the deep launches (set_skinny_gemm_deep)
                    previous = pk.set_skinny_gemm_deep(deep)
                    try:
                        for M, N, K, prologue in ((1, 4096, 1024, "norm"), (1, 1024, 3072, "silu"),
                                                  (1, 28672, 4096, None)):
                            x = _randn(M, 2 * K if prologue == "silu" else K, dtype=dtype, generator=gen)
                            pk.skinny_gemm(x, torch.empty(N, K, dtype=dtype),
                                           norm_weight=torch.ones(K, dtype=dtype) if prologue == "norm" else None,
                                           eps=1e-6 if prologue == "norm" else None,
                                           gated="silu" if prologue == "silu" else None,
                                           residual=torch.zeros(M, N, dtype=dtype) if prologue != "norm" else None)
                    finally:
                        pk.set_skinny_gemm_deep(previous)
                k, v, table, lens = _paged_inputs(1, 40, 8, 128, 16, dtype, gen, table_width=64)
                q = _randn(1, 16, 128, dtype=dtype, generator=gen)
                pk.paged_decode_attention(q, k, v, table, lens)
                pk.paged_decode_attention(q, k, v, table, lens, split_counters=torch.zeros(8, dtype=torch.int32))
                cos_sin = pk.compute_cos_sin_cache(64, 128, 1e6)
                for norm in (True, False):
                    q, k_new, v_new = _randn(1, 32 * 128, dtype=dtype, generator=gen).split([2048, 1024, 1024], 1)
                    weights = dict(q_weight=torch.ones(128, dtype=dtype), k_weight=torch.ones(128, dtype=dtype),
                                   eps=1e-6) if norm else {}
                    pk.rotary_embedding_and_cache(torch.tensor([39]), q, k_new, v_new, k, v, torch.tensor([39]),
                                                  cos_sin, head_size=128, **weights)
                    pk.rotary_cache_decode_attention(torch.tensor([39]), q.view(1, 16, 128), k_new, v_new, k, v,
                                                     torch.tensor([39]), cos_sin, table, lens, **weights,
                                                     split_counters=torch.zeros(8, dtype=torch.int32))
                previous = pk.set_moe_gemv_max_tokens(1)   # fused_moe's matrix-vector launches, Qwen3-30B-A3B
                try:
                    pk.fused_moe(_randn(1, 2048, dtype=dtype, generator=gen), torch.empty(128, 1536, 2048, dtype=dtype),
                                 torch.empty(128, 2048, 768, dtype=dtype), torch.rand(1, 8, generator=gen),
                                 torch.randperm(128, generator=gen)[:8].view(1, 8).int())
                finally:
                    pk.set_moe_gemv_max_tokens(previous)
        yield f"programmatic dependent launch {name}", call


def launch_matrix() -> list[tuple[str, Callable[[torch.Generator], None]]]:
    """(label, call) for every case: each call runs public ops on small CPU tensors."""
    return [*_attention_cases(), *_fused_reduce_cases(), *_rope_decode_cases(), *_cache_op_cases(),
            *_elementwise_cases(), *_sampling_cases(), *_fp8_kv_cases(),
            *_quant_cases(), *_moe_cases(), *_lora_cases(), *_skinny_cases(), *_pdl_cases()]


def record_matrix(capability: tuple[int, int] = (9, 0)) -> list[Launch]:
    """Every launch the wrappers make over :func:`launch_matrix`, configured as on an H100 (as on a device of
    ``capability`` with its SM count)."""
    generator = torch.Generator().manual_seed(0)
    with record_launches(capability) as (launches, case):
        for label, call in launch_matrix():
            case[0] = label
            before = len(launches)
            call(generator)
            if len(launches) == before:
                raise RuntimeError(f"matrix case {label!r} launched no kernel")
    return launches


# ------------------------------------------------------------------------------------------------
# 2. specialize
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    """One distinct specialization of a kernel: what one compile produces."""
    kernel: Any
    signature: dict
    constexprs: dict  # {(arg index,): value}
    attrs: dict
    option_kwargs: dict  # the launch's compile options as the wrapper passed them (num_warps, ...)
    options: dict  # all backend options as Triton parsed them for the first target (for the report)
    key: str
    cases: list[str]
    grids: list[tuple[int, ...]]
    # the targets (compute capability x 10) whose recording made this launch; empty: every target
    capabilities: set[int] = dataclasses.field(default_factory=set)

    def describe(self) -> dict:
        """The report's view: the kernel's own constexprs (not the strides Triton specialized to 1),
        pointer dtypes and launch options."""
        names = self.kernel.arg_names
        return {
            "kernel": self.kernel.__name__,
            "constexprs": {names[path[0]]: _jsonable(value) for path, value in sorted(self.constexprs.items())
                           if not names[path[0]].startswith("stride")},
            "pointer_dtypes": sorted({t for t in self.signature.values() if t.startswith("*")}),
            "num_warps": self.options.get("num_warps"),
            "num_stages": self.options.get("num_stages"),
        }


def _jsonable(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _specialize(launch: Launch, target) -> tuple[dict, dict, dict, Any]:
    """(signature, constexprs, attrs, options) that ``launch`` would compile on ``target``: Triton's
    own binder (the code its launcher runs) applied to the recorded arguments. The same calls exist
    in Triton 3.6 and 3.9; 3.9's launcher adds options 3.6 lacks (``fpsan_homomorphic_casts``),
    which we never pass, so both take the defaults."""
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET=0 before pagedkernels is imported")
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


def distinct_variants(launches: list[Launch], target) -> list[Variant]:
    """Launches grouped by their specialization on ``target``, first-seen order."""
    variants: dict[str, Variant] = {}
    for launch in launches:
        signature, constexprs, attrs, options = _specialize(launch, target)
        option_values = {k: _jsonable(v) for k, v in sorted(vars(options).items())}
        key = repr((launch.kernel.__name__, sorted(signature.items()), sorted(constexprs.items(), key=repr),
                    sorted(attrs.items(), key=repr), sorted(option_values.items())))
        variant = variants.get(key)
        if variant is None:
            option_kwargs = {k: v for k, v in launch.kwargs.items() if k not in launch.kernel.arg_names}
            variant = variants[key] = Variant(launch.kernel, signature, constexprs, attrs, option_kwargs,
                                              option_values, key, [], [])
        if launch.case not in variant.cases:
            variant.cases.append(launch.case)
        variant.grids.append(launch.grid)
    return list(variants.values())


def record_variants(targets: tuple[int, ...]) -> tuple[list[Launch], list[Variant]]:
    """The matrix recorded as on a device of each target's compute capability (the launch configs that depend on
    the architecture differ), its launches specialized on the first target and merged: each variant notes the
    targets whose recording made it (:func:`variant_targets` builds it for those only)."""
    from triton.backends.compiler import GPUTarget

    specialize_on = GPUTarget("cuda", targets[0], 32)
    launches: list[Launch] = []
    merged: dict[str, Variant] = {}
    for cc in targets:
        recorded = record_matrix(divmod(cc, 10))
        launches += recorded
        for variant in distinct_variants(recorded, specialize_on):
            seen = merged.setdefault(variant.key, variant)
            if seen is not variant:
                seen.cases += [case for case in variant.cases if case not in seen.cases]
                seen.grids += variant.grids
            seen.capabilities.add(cc)
    return launches, list(merged.values())


# Constexprs that only change values inside code of the same shape (a bound, a mask limit, a scalar,
# an optional path): variants that differ only in these share their tile shapes, so their register
# and shared-memory needs differ only by what the optional paths add. With ``representatives_only``
# one variant per class is compiled: the one with the most of these set (window, softcap, splits,
# padded head, GQA), i.e. the most live values. ptxas' register allocation is not monotonic in the
# work, though (a plain variant once spilled 12 B where the capped one of its class did not), so the
# full run (the CLI without --representatives, ~20 CPU-minutes) stays the complete check: run it
# when a kernel or a launch config changes.
VALUE_CONSTEXPRS = {
    "_decode_split_kernel": ("NUM_QUERIES_PER_KV", "HEAD_DIM", "BLOCK_SIZE", "NUM_SPLITS", "SLIDING_WINDOW",
                             "USE_SOFTCAP"),
    "_decode_reduce_kernel": ("HEAD_DIM", "NUM_SPLITS"),
    "_prefill_attention_kernel": ("GROUP", "GROUP_PAD", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_Q", "SLIDING_WINDOW",
                                  "USE_SOFTCAP"),
    "_rotary_kernel": ("Q_HEAD_BLOCKS", "K_HEAD_BLOCKS"),
    "_qk_norm_rotary_kernel": ("Q_HEAD_BLOCKS", "K_HEAD_BLOCKS"),
    "_rotary_cache_kernel": ("Q_HEAD_BLOCKS", "K_HEAD_BLOCKS", "CACHE_HEAD_BLOCKS"),
    "_fused_moe_kernel": ("A_ROW_DIV",),
    "_moe_sum_kernel": ("TOP_K",),
    "_moe_gemv_up_kernel": ("TOP_K",),
    "_moe_gemv_down_kernel": ("TOP_K",),
}
# fp16 and bf16 pointers also fall in one class: the configs never tell them apart, and every
# kernel compiled to the same registers and shared memory for both (Triton 3.6 and 3.9, sm_90 and
# sm_80, in the full run). bf16 represents them: the interpreter cannot check its numerics.
_SIXTEEN_BIT = {"*fp16": "*16bit", "*bf16": "*16bit"}


def _is_set(name: str, value: Any, constexprs: dict[str, Any]) -> bool:
    if name == "HEAD_DIM":  # a padded head is the masked (costlier) path
        return value != constexprs.get("HEAD_PAD", constexprs.get("HEAD_DIM_PAD", value))
    return value not in (0, 1, False, None)


def representatives(variants: list[Variant]) -> list[Variant]:
    """One variant per class: same kernel, pointer types (fp16 = bf16), options and constexprs but
    those of :data:`VALUE_CONSTEXPRS`; the specialization attributes (divisibility of strides) are
    ignored too."""
    chosen: dict[str, tuple[tuple[int, bool], Variant]] = {}
    for variant in variants:
        name = variant.kernel.__name__
        collapsed = VALUE_CONSTEXPRS.get(name, ())
        constexprs = {variant.kernel.arg_names[path[0]]: value for path, value in variant.constexprs.items()}
        shape = sorted((k, repr(v)) for k, v in constexprs.items() if k not in collapsed)
        types = sorted((k, _SIXTEEN_BIT.get(t, t)) for k, t in variant.signature.items())
        key = repr((name, types, shape, sorted(variant.options.items())))
        score = (sum(_is_set(k, constexprs[k], constexprs) for k in collapsed if k in constexprs),
                 "*bf16" in variant.signature.values())
        if key not in chosen or score > chosen[key][0]:
            chosen[key] = (score, variant)
    return [variant for _, variant in chosen.values()]


# ------------------------------------------------------------------------------------------------
# 3. compile
# ------------------------------------------------------------------------------------------------

_PTXAS_PATTERNS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas_log(log: str) -> dict[str, int | None]:
    """Resource counts from ptxas' ``-v`` output for one kernel (None where a line is missing;
    static smem 0 when ptxas prints none)."""
    values = {}
    for name, pattern in _PTXAS_PATTERNS.items():
        match = pattern.search(log)
        values[name] = int(match.group(1)) if match else (0 if name == "static_smem" else None)
    return values


def compile_variant(variant: Variant, capability: int) -> dict:
    """Compile for ``sm_<capability>``; returns registers, spill_stores, spill_loads, stack, shared
    (bytes), compile_s and error (None, or the compiler's message: then no resource fields)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    # The variant was specialized for one target; the specialization rules (divisibility, dtypes)
    # do not depend on the NVIDIA architecture, but option defaults do, so they are parsed again.
    options = make_backend(target).parse_options(dict(variant.option_kwargs))
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(variant.kernel, variant.signature, variant.constexprs, variant.attrs),
                                      target=target, options=options.__dict__)
    except Exception as e:  # noqa: BLE001  (any compile failure is a finding, reported per variant)
        message = f"{type(e).__name__}: {e}"
        return {"error": message[-1500:], "compile_s": round(time.perf_counter() - start, 2)}
    resources = parse_ptxas_log(log.getvalue())
    return {
        "registers": resources["registers"],
        "spill_stores": resources["spill_stores"],
        "spill_loads": resources["spill_loads"],
        "stack": resources["stack"],
        "shared": int(compiled.metadata.shared) + resources["static_smem"],
        "compile_s": round(time.perf_counter() - start, 2),
        "error": None,
    }


_POOL_VARIANTS: list[Variant] = []


def _compile_job(job: tuple[int, int]) -> tuple[int, int, dict]:
    index, capability = job
    return index, capability, compile_variant(_POOL_VARIANTS[index], capability)


def result_key(variant: Variant, capability: int, *, keep_paths: bool = False) -> str:
    """What a compile's result depends on (see the module docstring), hashed: the Triton version, the target,
    the kernel's source with everything it uses (``JITFunction.cache_key``) and the specialization (file
    paths in its options cut to their names, see :func:`_without_paths`; ``keep_paths`` keeps them, for
    re-keying a cache written before)."""
    import hashlib

    import triton

    text = json.dumps([triton.__version__, capability, variant.kernel.cache_key,
                       variant.key if keep_paths else _without_paths(variant.key)])
    return hashlib.sha256(text.encode()).hexdigest()


def _without_paths(key: str) -> str:
    """``key`` with every quoted absolute path cut to its file name: options such as ``extern_libs`` name
    files inside the Triton install (libdevice), whose location differs between machines and environments
    but whose content comes with the Triton version."""
    return re.sub(r"""(['"])/[^'"]*/([^'"/]+)\1""", r"\1\2\1", key)


def load_results_cache(path: Path = RESULTS_CACHE) -> dict[str, dict]:
    """This Triton's cached results, {result_key: result}; empty when there are none."""
    import triton

    if not path.exists():
        return {}
    return json.loads(path.read_text()).get(triton.__version__, {})


def save_results_cache(results: dict[str, dict], path: Path = RESULTS_CACHE) -> None:
    """Replace this Triton's part of the cache file with ``results`` (other versions' parts kept)."""
    import triton

    data = json.loads(path.read_text()) if path.exists() else {}
    data[triton.__version__] = {k: {f: v for f, v in r.items() if f != "cached"} for k, r in sorted(results.items())}
    path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")


def variant_targets(variant: Variant, targets: tuple[int, ...]) -> tuple[int, ...]:
    """The targets ``variant`` is built for: those whose recording made it (all, for a variant made without
    :func:`record_variants`), and a launch with programmatic dependent launch (``launch_pdl``; its kernel waits with
    griddepcontrol, an sm_90 instruction) for sm_90 and later only."""
    made = tuple(cc for cc in targets if not variant.capabilities or cc in variant.capabilities)
    return tuple(cc for cc in made if cc >= 90) if variant.option_kwargs.get("launch_pdl") else made


def compile_all(variants: list[Variant], targets: tuple[int, ...], jobs: int,
                cache: dict[str, dict] | None = None) -> dict[tuple[int, int], dict]:
    """{(variant index, capability): result}, over a pool of ``jobs`` forked processes (compiles
    are CPU-bound and independent). Longest first: attention kernels take seconds, the rest less.
    Results found in ``cache`` (by :func:`result_key`) are taken from it, marked ``"cached": True``."""
    global _POOL_VARIANTS
    _POOL_VARIANTS = variants
    results: dict[tuple[int, int], dict] = {}
    cache = cache or {}
    for i, variant in enumerate(variants):
        for cc in variant_targets(variant, targets):
            hit = cache.get(result_key(variant, cc))
            if hit is not None:
                results[(i, cc)] = {**hit, "cached": True}
    weight = {"_prefill_attention_kernel": 0, "_decode_split_kernel": 1}
    work = sorted(((i, cc) for i, variant in enumerate(variants) for cc in variant_targets(variant, targets)
                   if (i, cc) not in results),
                  key=lambda job: weight.get(variants[job[0]].kernel.__name__, 2))
    if jobs <= 1 or len(work) <= 1:
        results.update({(i, cc): {**result, "cached": False} for i, cc, result in map(_compile_job, work)})
        return results
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(jobs, len(work))) as pool:
        results.update({(i, cc): {**result, "cached": False}
                        for i, cc, result in pool.imap_unordered(_compile_job, work)})
    return results


def problems(rows: list[dict]) -> list[str]:
    """What would fail on the device, one line each (see the module docstring)."""
    found = []
    for row in rows:
        where = f"{row['kernel']} sm_{row['target']} triton {row['triton']} {row['constexprs']}"
        if row["error"]:
            found.append(f"compile error: {where}: {row['error']}")
            continue
        spilled = (row["spill_stores"] or 0) + (row["spill_loads"] or 0)
        if row["hot"] and (spilled or row["spill_stores"] is None):
            found.append(f"spills in a hot kernel: {where}: {row['spill_stores']} B stored, "
                         f"{row['spill_loads']} B loaded, {row['registers']} registers")
        limit = SHARED_MEMORY_LIMITS.get(row["target"])
        if limit is not None and row["shared"] > limit:
            found.append(f"shared memory over the sm_{row['target']} limit: {where}: {row['shared']} B > {limit} B")
        for grid in row["grids"]:
            if any(g > lim for g, lim in zip(grid, GRID_LIMITS)):
                found.append(f"grid {grid} past CUDA's limits {GRID_LIMITS}: {where}")
                break
    return found


def run(targets: tuple[int, ...] = DEFAULT_TARGETS, jobs: int = 1, representatives_only: bool = False,
        use_cache: bool = True, update_cache: bool = False, kernels: tuple[str, ...] | None = None) -> dict:
    """Record, specialize and compile (every distinct variant, or with ``representatives_only`` one
    per class of :data:`VALUE_CONSTEXPRS`), taking unchanged results from the results cache unless
    ``use_cache`` is off; returns the report (see :func:`main` for its use). ``update_cache`` writes this
    run's results as this Triton's cache."""
    import triton

    start = time.perf_counter()
    launches, distinct = record_variants(targets)
    recorded = time.perf_counter()
    variants = representatives(distinct) if representatives_only else distinct
    if kernels is not None:
        unknown = set(kernels) - set(launched_kernels())
        if unknown:
            raise ValueError(f"kernels {sorted(unknown)} are not launched by any op (known: {sorted(launched_kernels())})")
        variants = [v for v in variants if v.kernel.__name__ in kernels]
    results = compile_all(variants, targets, jobs, load_results_cache() if use_cache else None)
    if update_cache:
        fresh = {result_key(variants[i], cc): r for (i, cc), r in results.items()}
        # A run over some kernels adds its results to the cache; the other kernels' entries stay.
        save_results_cache({**load_results_cache(), **fresh} if kernels is not None else fresh)
    rows = []
    for i, variant in enumerate(variants):
        for cc in variant_targets(variant, targets):
            rows.append({**variant.describe(), "target": cc, "triton": triton.__version__,
                         "hot": variant.kernel.__name__ in HOT_KERNELS, "cases": variant.cases,
                         "grids": sorted(set(variant.grids)), **results[(i, cc)]})
    report = {
        "triton": triton.__version__,
        "targets": list(targets),
        "simulated_sms": SIMULATED_SMS,
        "cases": len(launch_matrix()),
        "launches": len(launches),
        "distinct_variants": len(distinct),
        "variants": len(variants),
        "representatives_only": representatives_only,
        "kernels_only": None if kernels is None else sorted(kernels),
        "kernels_recorded": sorted({v.kernel.__name__ for v in distinct}),
        "kernels_launchable": sorted(launched_kernels()),
        "record_s": round(recorded - start, 2),
        "total_s": round(time.perf_counter() - start, 2),
        "compiled": sum(not r["cached"] for r in results.values()),
        "from_cache": sum(r["cached"] for r in results.values()),
        "rows": rows,
    }
    report["problems"] = problems(rows)
    return report


def markdown_table(rows: list[dict]) -> str:
    """One line per (variant, target, Triton): kernel, the constexprs that tell variants apart,
    warps/stages, registers, spill bytes, stack and shared memory."""
    lines = ["| kernel | triton | sm | constexprs | dtypes | warps/stages | regs | spill st/ld B | stack B "
             "| shared B | compile s |", "|" + "---|" * 11]
    for row in sorted(rows, key=lambda r: (r["kernel"], r["triton"], -r["target"])):
        constexprs = " ".join(f"{k}={v}" for k, v in row["constexprs"].items())
        dtypes = ",".join(t.lstrip("*") for t in row["pointer_dtypes"])
        if row["error"]:
            resources = "| compile error | | | |"
        else:
            resources = (f"| {row['registers']} | {row['spill_stores']}/{row['spill_loads']} | {row['stack']} "
                         f"| {row['shared']} |")
        lines.append(f"| {row['kernel']} | {row['triton']} | {row['target']} | {constexprs} | {dtypes} "
                     f"| {row['num_warps']}/{row['num_stages']} {resources} {row['compile_s']} |")
    return "\n".join(lines) + "\n"


def summary(report: dict) -> str:
    rows = [r for r in report["rows"] if not r["error"]]
    by_kernel: dict[str, list[dict]] = {}
    for row in rows:
        by_kernel.setdefault(row["kernel"], []).append(row)
    compiled = "representatives" if report["representatives_only"] else "all"
    lines = [f"triton {report['triton']}: {report['cases']} cases, {report['launches']} launches, "
             f"{report['distinct_variants']} distinct variants, {report['variants']} compiled ({compiled}) "
             f"x sm_{'/sm_'.join(map(str, report['targets']))} in {report['total_s']} s "
             f"({report.get('compiled', '?')} compiled, {report.get('from_cache', 0)} from the results cache)"]
    for kernel, krows in sorted(by_kernel.items()):
        spills = sum(1 for r in krows if (r["spill_stores"] or 0) + (r["spill_loads"] or 0))
        lines.append(f"  {kernel}: {len(krows)} compiles, registers {min(r['registers'] for r in krows)}-"
                     f"{max(r['registers'] for r in krows)}, max shared {max(r['shared'] for r in krows)} B, "
                     f"{spills} with spills")
    lines += [f"  PROBLEM {p}" for p in report["problems"]]
    return "\n".join(lines)


def _reexec_if_needed(triton_path: Path | None) -> None:
    """Run again in a fresh interpreter when kernels were decorated for the interpreter or when
    another Triton must come first on the path (both are fixed at import time)."""
    import triton

    from . import _backend

    wrong_triton = triton_path is not None and Path(triton.__file__).resolve().parents[1] != triton_path.resolve()
    if not (_backend.interpreter_active() or wrong_triton):
        return
    if os.environ.get("_PAGEDKERNELS_AOT_REEXEC"):
        raise RuntimeError(f"could not switch to Triton at {triton_path} with the interpreter off")
    env = {**os.environ, "TRITON_INTERPRET": "0", "_PAGEDKERNELS_AOT_REEXEC": "1"}
    if triton_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(triton_path), env.get("PYTHONPATH", "")) if p)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pagedkernels._aot", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkernels._aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(map(str, DEFAULT_TARGETS)),
                        help="compute capabilities, comma-separated (default 90,80)")
    parser.add_argument("--triton", metavar="VERSION",
                        help="compile with this Triton (pip-installed on first use under the cache dir)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--representatives", action="store_true",
                        help="compile one variant per class of VALUE_CONSTEXPRS (the CI test's tier)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--md", type=Path, help="write the Markdown table here")
    parser.add_argument("--no-cache", action="store_true",
                        help=f"compile every variant, ignoring the results cache ({RESULTS_CACHE.name})")
    parser.add_argument("--update-cache", action="store_true",
                        help="write this run's results as this Triton's part of the results cache (with --kernels: "
                             "add them to it)")
    parser.add_argument("--kernels", help="compile only these kernels (comma-separated names, e.g. "
                                          "_fused_moe_kernel,_moe_sum_kernel)")
    args = parser.parse_args(argv)
    if args.update_cache and args.representatives:
        parser.error("--update-cache records every variant: it cannot be combined with --representatives")
    targets = tuple(int(t) for t in args.targets.split(","))
    triton_path = ensure_triton(args.triton) if args.triton else None
    _reexec_if_needed(triton_path)

    # A private Triton cache: every variant is compiled (so ptxas prints its report), and nothing
    # compiled here mixes with the user's cache.
    with tempfile.TemporaryDirectory(prefix="pagedkernels-aot-") as triton_cache:
        os.environ["TRITON_CACHE_DIR"] = triton_cache
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        report = run(targets, max(1, args.jobs), args.representatives, use_cache=not args.no_cache,
                     update_cache=args.update_cache,
                     kernels=tuple(args.kernels.split(",")) if args.kernels else None)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown_table(report["rows"]))
    print(summary(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
