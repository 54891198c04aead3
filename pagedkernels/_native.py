"""Native CPU kernels (``csrc/*.c``): built with the system C compiler on first use, loaded through ctypes.

The PyTorch twins are the reference on CPU but pay per-sequence Python and per-op costs: at 48
decoding sequences the attention twin spends ~100 us per sequence and layer, and an RMSNorm or a
rotary embedding of a decode batch is half a dozen small tensor ops. ``paged_attention_cpu.c`` walks
the block table directly (no gathered copy of K/V) with an online softmax, one OpenMP work item per
(sequence, KV head, chunk of 16 queries), a prefill's chunk of queries in one pass over the keys;
``elementwise_cpu.c`` does RMSNorm (with the residual add),
rotary embedding and SiLU-and-mul in one pass each; ``moe_cpu.c`` does a mixture-of-experts layer in one call
(the routing's top-k; the experts: a counting sort of the routed slots by expert, then each expert's slots one
GEMM through the 16-bit-weight GEMM's panel kernel, ``w16_panel.h``); ``lora_cpu.c`` groups a batch's tokens by
adapter slot and runs the LoRA shrink and expand per (slot, block of weights). All run on torch's own OpenMP
runtime (same soname, already loaded by torch).

The kernels check the metadata values that index memory (block ids, lengths, slots, positions; LoRA: the adapter
slots; MoE: the expert ids) in the same pass that uses them and report a bad one with a return code; the op then
runs its Python check to raise the ValueError that names it. So the native path costs no separate pass over the
metadata per call, and no call can read or write outside its tensors.

The shared object is cached under ``$PAGEDKERNELS_CACHE_DIR`` (default ``~/.cache/pagedkernels``),
keyed by the source, the compiler command and the CPU. Without a working compiler the ``auto``
backend keeps the PyTorch twins on CPU; backend ``"native"`` then raises with the compiler's output.
``PAGEDKERNELS_NATIVE=0`` disables it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_attention_cpu.c", CSRC / "elementwise_cpu.c", CSRC / "quant_cpu.c", CSRC / "w16_gemm_cpu.c",
           CSRC / "moe_cpu.c", CSRC / "lora_cpu.c")
HEADERS = (CSRC / "cpu_common.h", CSRC / "w16_panel.h")
MAX_HEAD_DIM, MAX_GROUP = 256, 64
MAX_ROTARY_DIM = 512
# Return codes of the kernels.
OK, BAD_VALUES, OUT_OF_MEMORY = 0, 1, -2
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}

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


def native_march() -> str:
    """The ``-march`` the kernels are built for: ``native`` unless ``PAGEDKERNELS_NATIVE_MARCH`` says
    otherwise (the tests build ``x86-64`` too, so the portable C paths behind the SIMD ones run)."""
    return os.environ.get("PAGEDKERNELS_NATIVE_MARCH", "native").strip() or "native"


def native_extra_flags() -> list[str]:
    """Compiler flags added to the build from ``PAGEDKERNELS_NATIVE_CFLAGS`` (whitespace-separated; part of the
    cache key like every flag): an ISA the ``-march`` lacks (``-mavx512bf16``), or ``-DPK_EMULATE_AVX512BF16``, which
    builds the AVX512-BF16 kernels with their one instruction emulated, so a machine without it tests the rest."""
    return os.environ.get("PAGEDKERNELS_NATIVE_CFLAGS", "").split()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them in /proc/cpuinfo (``avx2``, ``avx512f``, ``avx512_bf16``,
    ``amx_bf16``, ...); empty where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_isa(flags: frozenset[str] | None = None) -> str | None:
    """The CPU's fast bf16 arithmetic: ``"amx-bf16"`` (AMX tiles, Intel Xeons since Sapphire Rapids), ``"avx512-bf16"``
    (pair dot products without AMX: Cooper Lake, AMD Zen 4 and 5), or None (bf16 only widened to float32: AVX2 and
    older, and every non-x86 CPU here). ``flags``: /proc/cpuinfo's (default: this machine's)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags and "amx_tile" in flags:
        return "amx-bf16"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    return None


def c_compiler() -> str | None:
    """The C compiler the kernels build with: ``CC``, else ``cc``, else ``gcc`` on PATH (None if none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile_command(compiler: str, sources: tuple[Path, ...], dst: Path) -> list[str]:
    # -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC will not
    # if-convert a float comparison (it might raise "invalid"), so every loop with a select (the exp's clamp,
    # SiLU's sign, the softmax's tile mask) stayed scalar wherever there are no AVX-512 masks: SiLU-and-mul
    # built for AVX2 ran element by element. It allows no reassociation: results are the same bits.
    return [compiler, "-O3", f"-march={native_march()}", *native_extra_flags(), "-fno-trapping-math", "-fopenmp",
            "-shared", "-fPIC", "-std=gnu11", *map(str, sources), "-o", str(dst), "-lm"]


def build(compiler: str, sources: tuple[Path, ...], dst: Path) -> subprocess.CompletedProcess:
    """Build the shared library ``dst`` from ``sources`` with :func:`_compile_command`'s flags: each source compiled
    to an object file in a process of its own, as many at once as this process may use CPUs, then linked (one
    compiler call on all of them used one core: ~2x slower on 2 cores). The result's returncode is the first
    failure's (0 when all succeeded); its stderr holds every compiler's."""
    full = _compile_command(compiler, sources, dst)
    flags = [a for a in full[1:full.index(str(sources[0]))] if a != "-shared"]
    objects = [dst.with_name(f"{dst.stem}.{i}.{src.stem}.o") for i, src in enumerate(sources)]
    commands = [[compiler, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources, objects)]
    try:
        workers = len(os.sched_getaffinity(0))
    except AttributeError:   # macOS
        workers = os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(commands)))) as pool:
        results = list(pool.map(lambda command: subprocess.run(command, capture_output=True, text=True), commands))
    failed = [r for r in results if r.returncode != 0]
    if not failed:
        link = [compiler, "-fopenmp", "-shared", "-fPIC", *map(str, objects), "-o", str(dst), "-lm"]
        results.append(subprocess.run(link, capture_output=True, text=True))
        failed = [r for r in results[-1:] if r.returncode != 0]
    for obj in objects:
        obj.unlink(missing_ok=True)
    return subprocess.CompletedProcess(commands, failed[0].returncode if failed else 0,
                                       "".join(r.stdout for r in results), "".join(r.stderr for r in results))


_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
# The kernels' C signatures (each returns int: 0, or one of the codes above). The graph replayer's dispatch
# (pk_graph_replay, see :func:`graph_source`) is generated from this table, so the two cannot drift apart.
SIGNATURES = {
    "pk_paged_attention": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                           _i64, _i32, _i32, _i32, _i32, _f32, _i32, _f32, _ptr, _i64, _i64, _i32, _i32, _i64, _i64,
                           _i64, _i32, _f32, _f32],
    "pk_reshape_and_cache": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr,
                             _i64, _i32, _i32, _i32, _i32, _i64, _i32, _i32, _f32, _f32],
    "pk_rms_norm": [_ptr, _i64, _i32, _ptr, _i64, _i32, _ptr, _i32, _ptr, _i64, _i32, _i64, _i64, _f32, _i32],
    "pk_rotary_embedding": [_ptr, _i64, _ptr, _i64, _i64, _i32, _ptr, _i64, _i64, _i32, _i32, _ptr, _i64, _i32, _i32,
                            _i32, _i64, _i32],
    "pk_silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32, _i32],
    "pk_quant_gemm": [_ptr, _i64, _i32, _i64, _i64, _ptr, _i64, _i32, _i64, _ptr, _ptr, _i32, _ptr, _i64, _i32, _i32],
    "pk_quant_dequantize": [_ptr, _i64, _i64, _i32, _i64, _ptr, _ptr, _i32, _ptr, _i64, _i32, _i32],
    "pk_quant_simd_level": [],
    "pk_w16_gemm": [_ptr, _i64, _i32, _i64, _i64, _ptr, _i64, _i32, _ptr, _i64, _i32, _i32],
    "pk_bf16_dot_path": [],
    "pk_moe_topk": [_ptr, _i64, _i32, _i64, _i64, _i64, _i32, _i32, _ptr, _i32, _i64, _i64, _ptr, _i32, _ptr, _i32],
    "pk_fused_moe": [_ptr, _i64, _i32, _i64, _i64, _ptr, _i32, _ptr, _i32, _i64, _ptr, _ptr, _i32, _i64, _i64, _ptr,
                     _i64, _i32, _ptr, _i64, _i32, _ptr, _i32],
    "pk_lora_shrink": [_ptr, _i64, _i32, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _f32, _ptr, _i64,
                       _i32],
    "pk_lora_expand": [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32, _ptr, _i64,
                       _i32, _i32],
}
# Kernels a CPU graph (pagedkernels.cpu_graph) can record and replay, by their index in this tuple.
GRAPH_KERNELS = tuple(name for name, argtypes in SIGNATURES.items() if argtypes)
GRAPH_MAX_INTS, GRAPH_MAX_FLOATS, GRAPH_MAX_ROW_ARGS = 32, 4, 2
# Per kernel, the positions (in its signature) of the arguments that count the rows it processes along its
# inputs' outermost dimension (tokens, or sequences of one decode token each), each row independent of the others
# and nothing past the count read or written: a CPU graph replaying fewer rows than it recorded rewrites them.
ROW_ARGS = {
    "pk_paged_attention": (15, 29),   # num_seqs, num_tokens
    "pk_reshape_and_cache": (15,),    # num_tokens
    "pk_rms_norm": (11,),             # rows
    "pk_rotary_embedding": (1,),      # num_tokens
    "pk_silu_and_mul": (4,),          # rows
    "pk_quant_gemm": (3,),            # M
    "pk_w16_gemm": (3,),              # M
    "pk_moe_topk": (3,),              # num_tokens
    "pk_fused_moe": (3,),             # num_tokens
    "pk_lora_shrink": (3,),           # M (tokens)
    "pk_lora_expand": (2,),           # M (tokens)
}


class GraphCall(ctypes.Structure):
    """One recorded kernel call: its index in GRAPH_KERNELS, its integer and pointer arguments in order
    (``i``), its float arguments in order (``f``); pk_graph_replay unpacks them into the kernel's signature.
    ``row_slot``/``row_per``: the slots of ``i`` that count rows (-1: none) and the rows each counts per row of
    the graph; a replay of ``rows`` rows sets ``i[row_slot[j]] = rows * row_per[j]`` first (0: as recorded)."""
    _fields_ = [("kind", ctypes.c_int64), ("i", ctypes.c_int64 * GRAPH_MAX_INTS),
                ("f", ctypes.c_float * GRAPH_MAX_FLOATS), ("row_slot", ctypes.c_int64 * GRAPH_MAX_ROW_ARGS),
                ("row_per", ctypes.c_int64 * GRAPH_MAX_ROW_ARGS)]


def graph_source() -> str:
    """C source of ``pk_graph_replay(calls, n, rows, &rc)``: runs n recorded calls in order (with ``rows`` > 0,
    their row counts set for that many rows first: see :class:`GraphCall`), returns -1, or the index of the first
    call that returned non-zero (its code in rc, the calls after it not run)."""
    ctype = {_i64: "int64_t", _i32: "int", _f32: "float", _ptr: "void *"}
    lines = ["/* Generated by pagedkernels/_native.py (graph_source): the CPU graph replayer. */",
             "#include <stdint.h>",
             f"typedef struct {{ int64_t kind; int64_t i[{GRAPH_MAX_INTS}]; float f[{GRAPH_MAX_FLOATS}]; "
             f"int64_t row_slot[{GRAPH_MAX_ROW_ARGS}]; int64_t row_per[{GRAPH_MAX_ROW_ARGS}]; }} pk_call;"]
    cases = []
    for kind, name in enumerate(GRAPH_KERNELS):
        argtypes = SIGNATURES[name]
        lines.append(f"int {name}({', '.join(ctype[t] for t in argtypes)});")
        args, n_int, n_float = [], 0, 0
        for t in argtypes:
            if t is _f32:
                args.append(f"c->f[{n_float}]")
                n_float += 1
            else:
                args.append(f"(void *)(intptr_t)c->i[{n_int}]" if t is _ptr else
                            f"(int)c->i[{n_int}]" if t is _i32 else f"c->i[{n_int}]")
                n_int += 1
        assert n_int <= GRAPH_MAX_INTS and n_float <= GRAPH_MAX_FLOATS, name
        cases.append(f"        case {kind}: rc = {name}({', '.join(args)}); break;")
    lines += ["int64_t pk_graph_replay(pk_call *calls, int64_t n, int64_t rows, int *rc_out) {",
              "    for (int64_t k = 0; k < n; k++) {",
              "        pk_call *c = calls + k;",
              "        int rc;",
              "        if (rows > 0)",
              f"            for (int j = 0; j < {GRAPH_MAX_ROW_ARGS}; j++)",
              "                if (c->row_slot[j] >= 0) c->i[c->row_slot[j]] = rows * c->row_per[j];",
              "        switch (c->kind) {", *cases,
              "        default: rc = -1;",
              "        }",
              "        if (rc != 0) {",
              "            *rc_out = rc;",
              "            return k;",
              "        }",
              "    }",
              "    *rc_out = 0;",
              "    return -1;",
              "}", ""]
    return "\n".join(lines)


# A pagedkernels.cpu_graph recorder while a CPU graph captures, else None; it records the capturing thread's calls.
_recorder = None


def library():
    """The loaded kernel library, building it if needed; None (see :func:`build_error`) if that fails. While a
    CPU graph captures (pagedkernels.cpu_graph), the recorder standing in for it: each kernel call is recorded,
    then run."""
    recorder = _recorder
    if recorder is not None and recorder.thread == threading.get_ident():
        return recorder
    return _load_library()


@functools.lru_cache(maxsize=None)
def _load_library() -> ctypes.CDLL | None:
    global _build_error
    if os.environ.get("PAGEDKERNELS_NATIVE", "1").strip() in ("0", "false", "False"):
        _build_error = "disabled by PAGEDKERNELS_NATIVE=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _build_error = "no C compiler found (set CC or install gcc)"
        return None
    generated = graph_source()
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + generated.encode()
    key = hashlib.sha256(source + " ".join(_compile_command(compiler, (Path("s"),), Path("d"))).encode()
                         + cpu_name().encode() + platform.machine().encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PAGEDKERNELS_CACHE_DIR", Path.home() / ".cache" / "pagedkernels"))
    target = cache_dir / f"pagedkernels_cpu-{key}.so"
    try:
        if not target.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            # Build beside the target and rename: concurrent first uses never load a partial file.
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                built = Path(tmp) / target.name
                graph_c = Path(tmp) / "graph_cpu.c"
                graph_c.write_text(generated)
                proc = build(compiler, SOURCES + (graph_c,), built)
                if proc.returncode != 0:
                    _build_error = f"{compiler} failed:\n{proc.stderr.strip()}"
                    return None
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        _build_error = f"could not build or load {target}: {exc}"
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    lib.pk_w16_amx.restype, lib.pk_w16_amx.argtypes = ctypes.c_int, [_i64, ctypes.POINTER(_i64)]
    lib.pk_graph_replay.restype = ctypes.c_int64
    lib.pk_graph_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]
    return lib


def build_error() -> str | None:
    """Why :func:`library` returned None (after it was called), else None."""
    return _build_error


def supports(q: torch.Tensor, head_dim: int, group: int) -> bool:
    """Whether the native attention kernel covers this call (CPU tensor, dtype and shape limits)."""
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def _check_rc(rc: int, what: str) -> bool:
    """True for success, False for values out of range (the caller names them); raises otherwise."""
    if rc == OK:
        return True
    if rc == BAD_VALUES:
        return False
    reason = "out of memory" if rc == OUT_OF_MEMORY else f"code {rc}"
    raise RuntimeError(f"pagedkernels native {what} failed ({reason})")


def paged_attention(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window,
                    softcap, out, k_scale: float = 1.0, v_scale: float = 1.0) -> bool:
    """Both attention ops: ``cu_seqlens_q`` None means decode (row s is sequence s's one query). An fp8
    cache's values are multiplied by ``k_scale`` / ``v_scale``.
    Arguments were checked by the op except for their values (int32 metadata, caches and ``out``
    contiguous in head_dim); ``out`` is written in place. Returns False, having written nothing, when
    the metadata index outside the cache or the tables (the op then raises the ValueError naming it)."""
    lib = library()
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    rc = lib.pk_paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0),
        cu_seqlens_q.contiguous().data_ptr() if cu_seqlens_q is not None else None,
        seq_lens.contiguous().data_ptr(), seq_lens.shape[0], num_q_heads, num_kv_heads, head_dim, block_size,
        float(scale), int(sliding_window or 0), float(softcap or 0.0), out.data_ptr(), out.stride(0), out.stride(1),
        DTYPE_CODES[q.dtype], torch.get_num_threads(), num_blocks, num_tokens, block_tables.shape[1],
        DTYPE_CODES[key_cache.dtype], float(k_scale), float(v_scale))
    return _check_rc(rc, "attention")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> bool:
    """Checked arguments (last dims contiguous, int64 slots); negative slots are skipped; fp8 caches get
    e4m3(x / scale). Returns False, having written nothing, when a slot is past the cache."""
    lib = library()
    slots = slot_mapping.contiguous()
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    rc = lib.pk_reshape_and_cache(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
        key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        slots.data_ptr(), slots.shape[0], num_kv_heads, head_dim, block_size, key.element_size(), num_blocks,
        DTYPE_CODES[key.dtype], DTYPE_CODES[key_cache.dtype], float(k_scale), float(v_scale))
    return _check_rc(rc, "reshape_and_cache")


def rms_norm(x2d, residual2d, weight, out2d, eps: float) -> None:
    """2-D row views (last dim contiguous, any float dtypes); ``residual2d`` None for the plain norm.
    ``out2d`` may be ``x2d``."""
    rows, hidden = x2d.shape
    res = residual2d
    rc = library().pk_rms_norm(
        x2d.data_ptr(), x2d.stride(0), DTYPE_CODES[x2d.dtype],
        None if res is None else res.data_ptr(), 0 if res is None else res.stride(0),
        0 if res is None else DTYPE_CODES[res.dtype], weight.data_ptr(), DTYPE_CODES[weight.dtype],
        out2d.data_ptr(), out2d.stride(0), DTYPE_CODES[out2d.dtype], rows, hidden, float(eps),
        torch.get_num_threads())
    _check_rc(rc, "rms_norm")


def rotary_embedding(positions, q3, k3, cos_sin_cache, is_neox: bool) -> bool:
    """q3/k3 ``[num_tokens, heads, head_size]`` views (k3 may be None), same dtype, rotated in place;
    ``positions`` int64. Returns False, having rotated nothing, when a position is outside the cache."""
    positions = positions.contiguous()
    max_position, rot_dim = cos_sin_cache.shape
    rc = library().pk_rotary_embedding(
        positions.data_ptr(), positions.shape[0], q3.data_ptr(), q3.stride(0), q3.stride(1), q3.shape[1],
        None if k3 is None else k3.data_ptr(), 0 if k3 is None else k3.stride(0),
        0 if k3 is None else k3.stride(1), 0 if k3 is None else k3.shape[1], DTYPE_CODES[q3.dtype],
        cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), DTYPE_CODES[cos_sin_cache.dtype], rot_dim // 2,
        int(bool(is_neox)), max_position, torch.get_num_threads())
    return _check_rc(rc, "rotary_embedding")


def silu_and_mul(x2d, out2d) -> None:
    """``[rows, 2d]`` -> ``[rows, d]`` row views of one dtype (last dims contiguous)."""
    rows, d = out2d.shape
    rc = library().pk_silu_and_mul(x2d.data_ptr(), x2d.stride(0), out2d.data_ptr(), out2d.stride(0), rows, d,
                                   DTYPE_CODES[x2d.dtype], torch.get_num_threads())
    _check_rc(rc, "silu_and_mul")


# Weight formats of csrc/quant_cpu.c: the canonical int4/int8 layouts and GGUF's block types (ggml's ids).
QUANT_FORMATS = {"wq4": 0, "wq8": 1, "Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14, "Q4_0x8": 102,
                 "Q4_1x8": 103, "Q8_0x8": 108}
SIMD_LEVELS = ("portable C", "AVX2", "AVX-VNNI", "AVX-512 VNNI")


def quant_simd_level() -> str:
    """Which integer dot product the quantized-GEMM kernels were built with (see csrc/quant_cpu.c)."""
    return SIMD_LEVELS[library().pk_quant_simd_level()]


def quant_gemm(x2d, weight, fmt: str, group_size: int, scales, zeros, out2d) -> None:
    """``out2d [M, N] = x2d [M, K] @ W^T`` for W in ``fmt`` (``weight`` uint8, rows of its bytes
    back to back); ``scales``/``zeros`` ([N, groups], contiguous, one dtype; zeros may be None) for the
    canonical formats only. Row views with contiguous last dimensions; checked by the op."""
    M, K = x2d.shape
    rc = library().pk_quant_gemm(
        x2d.data_ptr(), x2d.stride(0), DTYPE_CODES[x2d.dtype], M, K, weight.data_ptr(), out2d.shape[1],
        QUANT_FORMATS[fmt], group_size, None if scales is None else scales.data_ptr(),
        None if zeros is None else zeros.data_ptr(), 0 if scales is None else DTYPE_CODES[scales.dtype],
        out2d.data_ptr(), out2d.stride(0), DTYPE_CODES[out2d.dtype], torch.get_num_threads())
    _check_rc(rc, "quantized GEMM")


def w16_gemm(x2d, packed, n: int, out2d) -> None:
    """``out2d [M, n] = x2d [M, K] @ W^T`` for ``packed`` = ``pack_w16(W)``, the float32 product of the values rounded
    once to out2d's dtype (x2d and out2d float32, float16 or bfloat16); checked by the op."""
    M, K = x2d.shape
    rc = library().pk_w16_gemm(x2d.data_ptr(), x2d.stride(0), DTYPE_CODES[x2d.dtype], M, K, packed.data_ptr(), n,
                               DTYPE_CODES[packed.dtype], out2d.data_ptr(), out2d.stride(0), DTYPE_CODES[out2d.dtype],
                               torch.get_num_threads())
    _check_rc(rc, "16-bit-weight GEMM")


def w16_amx(min_rows: int | None = None) -> tuple[bool, int]:
    """Whether a bf16 x bf16 :func:`w16_gemm` can take AMX tiles here (a build with AMX-TILE and AMX-BF16, Linux
    granting the process the tile state, ``PAGEDKERNELS_CPU_AMX`` not 0), and the rows from which it does; ``min_rows``
    first sets those rows (``sys.maxsize``: never, the pair dot products for every row). Returns (usable, min_rows)."""
    current = _i64()
    usable = library().pk_w16_amx(-1 if min_rows is None else int(min_rows), ctypes.byref(current))
    return bool(usable), current.value


BF16_DOT_PATHS = ("bf16 widened to float32", "AVX512-BF16", "AVX512-BF16 (emulated)")


def bf16_dot_path() -> str:
    """How the built kernels multiply bf16 by bf16 (the 16-bit-weight GEMM's bf16 activations, the attention's
    bf16 query-key products): one of :data:`BF16_DOT_PATHS` (see csrc/cpu_common.h, PK_BF16_DOT)."""
    return BF16_DOT_PATHS[library().pk_bf16_dot_path()]


def quant_dequantize(weight, N: int, K: int, fmt: str, group_size: int, scales, zeros, out2d) -> None:
    """``out2d [N, K]`` = W de-quantized (arguments as for :func:`quant_gemm`)."""
    rc = library().pk_quant_dequantize(
        weight.data_ptr(), N, K, QUANT_FORMATS[fmt], group_size, None if scales is None else scales.data_ptr(),
        None if zeros is None else zeros.data_ptr(), 0 if scales is None else DTYPE_CODES[scales.dtype],
        out2d.data_ptr(), out2d.stride(0), DTYPE_CODES[out2d.dtype], torch.get_num_threads())
    _check_rc(rc, "de-quantization")


def moe_topk(logits2d, top_k: int, scoring: int, renormalize: bool, bias, num_groups: int, topk_groups: int,
             weights_out, ids_out) -> None:
    """Checked arguments (``logits2d`` last dim contiguous; outputs contiguous, ids int32); ``scoring`` 0 softmax,
    1 sigmoid."""
    num_tokens, num_experts = logits2d.shape
    rc = library().pk_moe_topk(
        logits2d.data_ptr(), logits2d.stride(0), DTYPE_CODES[logits2d.dtype], num_tokens, num_experts, top_k,
        int(scoring), int(bool(renormalize)), None if bias is None else bias.data_ptr(),
        0 if bias is None else DTYPE_CODES[bias.dtype], num_groups, topk_groups, weights_out.data_ptr(),
        DTYPE_CODES[weights_out.dtype], ids_out.data_ptr(), torch.get_num_threads())
    _check_rc(rc, "moe_topk")


def fused_moe(hidden, w13_packed, w2_packed, topk_weights, topk_ids, activation: int, expert_map,
              intermediate: int, out, native_scratch_bytes) -> bool:
    """The MoE MLP for ``hidden`` (float32, bfloat16 or float16) and pack_moe_weight panels (arguments checked by the
    op); ``out`` [M, H] in hidden's dtype written in place. Returns False, having written nothing, when an id is
    outside its table. native_scratch_bytes: the op's (pagedkernels.fused_moe.native_scratch_bytes: the kernel's
    scratch layout lives with the op, and this loader imports no op module)."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts = w13_packed.shape[0]
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    expert_map = None if expert_map is None else expert_map.contiguous()
    widened_rows = hidden.dtype != torch.float32 or out.dtype != torch.float32
    scratch = torch.empty(native_scratch_bytes(num_tokens, top_k, hidden_size, intermediate, num_experts,
                                               widened_rows=widened_rows), dtype=torch.uint8)
    rc = library().pk_fused_moe(
        hidden.data_ptr(), hidden.stride(0), DTYPE_CODES[hidden.dtype], num_tokens, hidden_size, ids.data_ptr(),
        int(ids.dtype == torch.int64), weights.data_ptr(), DTYPE_CODES[weights.dtype], top_k, w13_packed.data_ptr(),
        w2_packed.data_ptr(), DTYPE_CODES[w13_packed.dtype], num_experts, intermediate,
        None if expert_map is None else expert_map.data_ptr(), 0 if expert_map is None else expert_map.numel(),
        int(activation), out.data_ptr(), out.stride(0), DTYPE_CODES[out.dtype], scratch.data_ptr(),
        torch.get_num_threads())
    return _check_rc(rc, "fused_moe")


def lora_shrink(x, lora_a, token_lora_indices, scale: float, out, lora_ranks=None) -> bool:
    """``out = scale * x @ lora_a[idx]^T`` per token (zero rows for idx -1; rows past a slot's rank in
    ``lora_ranks``, when given, zero and not read); arguments checked by the op. Returns False, having written
    nothing, when an index or a rank is out of range."""
    M, K = x.shape
    num_loras, N, _ = lora_a.shape
    idx = token_lora_indices.contiguous()
    ranks, num_slices = (0, 1) if lora_ranks is None else (lora_ranks.data_ptr(), lora_ranks.shape[1])
    rc = library().pk_lora_shrink(x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], M, K, lora_a.data_ptr(),
                                  lora_a.stride(0), lora_a.stride(1), N, num_loras, idx.data_ptr(), ranks, num_slices,
                                  float(scale), out.data_ptr(), out.stride(0), torch.get_num_threads())
    return _check_rc(rc, "lora_shrink")


def lora_expand(buffer, lora_b, token_lora_indices, slice_sizes: tuple[int, ...], out, lora_ranks=None) -> bool:
    """``out[t, slice s] += buffer[t, s*R:(s+1)*R] @ lora_b[idx[t], slice s]^T`` per token with an adapter (up to
    the slot's rank in ``lora_ranks`` when given); arguments checked by the op. Returns False, having written
    nothing, when an index or a rank is out of range."""
    M = buffer.shape[0]
    num_loras, _, rank = lora_b.shape
    sizes = tuple(slice_sizes) + (0,) * (3 - len(slice_sizes))
    idx = token_lora_indices.contiguous()
    ranks = 0 if lora_ranks is None else lora_ranks.data_ptr()
    rc = library().pk_lora_expand(buffer.data_ptr(), buffer.stride(0), M, rank,
                                  lora_b.data_ptr(), lora_b.stride(0), lora_b.stride(1), num_loras, idx.data_ptr(),
                                  ranks, *sizes, len(slice_sizes), out.data_ptr(), out.stride(0),
                                  DTYPE_CODES[out.dtype], torch.get_num_threads())
    return _check_rc(rc, "lora_expand")
