"""Native CPU kernels (``csrc/paged_attention_cpu.c``): built with the system C compiler on first use,
loaded through ctypes.

The PyTorch twins are the reference on CPU but pay per-sequence Python and per-op costs: at 48
decoding sequences the attention twin spends ~100 us per sequence and layer. The native kernel
walks the block table directly (no gathered copy of K/V) with an online softmax, one OpenMP work
item per (sequence, KV head, chunk of 16 queries), on torch's own OpenMP runtime (same soname,
already loaded by torch).

The shared object is cached under ``$PAGEDKERNELS_CACHE_DIR`` (default ``~/.cache/pagedkernels``),
keyed by the source, the compiler command and the CPU. Without a working compiler the ``auto``
backend keeps the PyTorch twins on CPU; backend ``"native"`` then raises with the compiler's output.
``PAGEDKERNELS_NATIVE=0`` disables it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
MAX_HEAD_DIM, MAX_GROUP = 256, 64
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_build_error: str | None = None


def cpu_name() -> str:
    """The CPU's model name (part of the build cache key; benchmarks label results with it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _compile_command(compiler: str, src: Path, dst: Path) -> list[str]:
    return [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", str(src), "-o", str(dst),
            "-lm"]


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it if needed; None (see :func:`build_error`) if that fails."""
    global _build_error
    if os.environ.get("PAGEDKERNELS_NATIVE", "1").strip() in ("0", "false", "False"):
        _build_error = "disabled by PAGEDKERNELS_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _build_error = "no C compiler found (set CC or install gcc)"
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_compile_command(compiler, Path("s"), Path("d"))).encode()
                         + cpu_name().encode() + platform.machine().encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PAGEDKERNELS_CACHE_DIR", Path.home() / ".cache" / "pagedkernels"))
    target = cache_dir / f"paged_attention_cpu-{key}.so"
    try:
        if not target.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: concurrent first uses never load a partial file.
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run(_compile_command(compiler, SOURCE, built), capture_output=True, text=True)
                if proc.returncode != 0:
                    _build_error = f"{compiler} failed:\n{proc.stderr.strip()}"
                    return None
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        _build_error = f"could not build or load {target}: {exc}"
        return None
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.pk_paged_attention.restype = ctypes.c_int
    lib.pk_paged_attention.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64,
                                       i32, i32, i32, i32, f32, i32, f32, ptr, i64, i64, i32, i32]
    lib.pk_reshape_and_cache.restype = None
    lib.pk_reshape_and_cache.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr,
                                         i64, i32, i32, i32, i32]
    return lib


def build_error() -> str | None:
    """Why :func:`library` returned None (after it was called), else None."""
    return _build_error


def supports(q: torch.Tensor, head_dim: int, group: int) -> bool:
    """Whether the native attention kernel covers this call (CPU tensor, dtype and shape limits)."""
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def paged_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window,
                    softcap, out) -> None:
    """Both attention ops: ``cu_seqlens_q`` None means decode (row s is sequence s's one query).
    Arguments were validated by the op (int32 metadata, caches and ``out`` contiguous in head_dim);
    ``out`` is written in place."""
    lib = library()
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    rc = lib.pk_paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0),
        cu_seqlens_q.contiguous().data_ptr() if cu_seqlens_q is not None else None,
        seq_lens.contiguous().data_ptr(), seq_lens.shape[0], num_q_heads, num_kv_heads, head_dim, block_size,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), out.data_ptr(), out.stride(0), out.stride(1),
        DTYPE_CODES[q.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"pagedkernels native attention failed (code {rc})")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Validated arguments (last dims contiguous, int64 slots); negative slots are skipped."""
    lib = library()
    slots = slot_mapping.contiguous()
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    lib.pk_reshape_and_cache(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        slots.data_ptr(), slots.shape[0], num_kv_heads, head_dim, block_size, key.element_size())
