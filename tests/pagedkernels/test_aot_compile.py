"""Every Triton launch the pagedkernels wrappers make, compiled ahead of time for Hopper (sm_90) and
Ampere (sm_80) without a GPU, with this machine's Triton and with Triton 3.6 (the GPU image's):
no compile errors, no register spills in a hot kernel, shared memory within each target's limit
(``pagedkernels._aot`` does the work; see its docstring).

The recording tests run in this process (recording launches nothing, so the interpreter does not
matter); the compile test runs ``python -m pagedkernels._aot`` over every distinct variant once per Triton
version, both at once, and writes the combined table to its tmp dir (``aot_report.md``). Compiling all of
them costs about 1,350 CPU-seconds (451 variants x 2 targets x 2 Tritons); results of unchanged variants come
from ``pagedkernels/aot_results.json`` (keyed by Triton version, target, the kernel's source hash and the
specialization; see ``pagedkernels._aot``), so a run compiles only what changed since it was written.
(The one-per-class tier, ``--representatives``, missed fp32 prefill spills that only some masked head
sizes showed, so CI checks them all.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import triton

from pagedkernels import _aot, _backend, decode_attention, prefill_attention

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's NVIDIA backend to compile for CUDA")

REPO_ROOT = Path(__file__).resolve().parents[2]
# The Triton of the GPU image (its torch wheel's pin): kernels must compile with it too.
GPU_IMAGE_TRITON = "3.6.0"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def recorded():
    return _aot.record_matrix()


def _constexprs(launch) -> dict:
    return {k: v for k, v in launch.kwargs.items() if k in launch.kernel.arg_names}


def _dtype(launch, arg: str) -> torch.dtype:
    return launch.args[launch.kernel.arg_names.index(arg)].dtype


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------

def test_every_kernel_is_recorded_for_every_dtype(recorded):
    kernels = {launch.kernel.__name__ for launch in recorded}
    assert kernels == set(_aot.launched_kernels())
    for name, arg in (("_decode_split_kernel", "q_ptr"), ("_prefill_attention_kernel", "q_ptr"),
                      ("_reshape_and_cache_kernel", "key_ptr"), ("_rms_norm_kernel", "x_ptr"),
                      ("_rotary_kernel", "q_ptr"), ("_qk_norm_rotary_kernel", "q_ptr"), ("_silu_and_mul_kernel", "x_ptr"),
                      ("_wq_gemm_kernel", "x_ptr"),
                      ("_gguf_dequantize_kernel", "out_ptr"), ("_fused_moe_kernel", "a_ptr"),
                      ("_moe_sum_kernel", "out_ptr"), ("_moe_topk_kernel", "logits_ptr"),
                      ("_lora_shrink_kernel", "x_ptr"), ("_lora_expand_kernel", "out_ptr")):
        dtypes = {_dtype(launch, arg) for launch in recorded if launch.kernel.__name__ == name}
        assert dtypes == set(_aot.DTYPES), name
    # the caches: every float dtype and float8 (as the uint8 codes the kernels read)
    for name, arg in (("_copy_blocks_kernel", "typed_ptr"), ("_decode_split_kernel", "key_cache_ptr"),
                      ("_prefill_attention_kernel", "key_cache_ptr"), ("_reshape_and_cache_kernel", "key_cache_ptr")):
        dtypes = {_dtype(launch, arg) for launch in recorded if launch.kernel.__name__ == name}
        assert dtypes == set(_aot.DTYPES) | {torch.uint8}, name
    # every weight format of the quantized GEMM: int4, int8, e4m3
    assert {_constexprs(launch)["WEIGHT_FORMAT"] for launch in recorded
            if launch.kernel.__name__ == "_wq_gemm_kernel"} == {0, 1, 2}
    assert {_constexprs(launch)["QTYPE"] for launch in recorded
            if launch.kernel.__name__ == "_gguf_dequantize_kernel"} == {2, 3, 8, 12, 14}
    # both grouped GEMMs of the MoE layer (silu- and gelu-gated, then plain), every row block of the alignment
    moe = [_constexprs(launch) for launch in recorded if launch.kernel.__name__ == "_fused_moe_kernel"]
    assert {c["GATED"] for c in moe} == {0, 1, 2} and {c["BLOCK_M"] for c in moe} == {16, 32, 64, 128}
    assert {_constexprs(launch)["BLOCK_SIZE"] for launch in recorded
            if launch.kernel.__name__ == "_moe_align_kernel"} == {16, 32, 64, 128}


def test_launch_configs_chosen_per_architecture_are_recorded_per_target(recorded):
    """fused_moe's 128-row tiles are chosen per architecture: the table records the matrix as on each target, so
    sm_90 builds Hopper's 128 x 128 gated / 128 x 256 plain tiles and sm_80 the 128 x 64 / 128 x 128 ones."""
    def moe_tiles(launches):
        return {(c["GATED"] > 0, c["BLOCK_N"]) for c in map(_constexprs, launches)
                if launches and c.get("BLOCK_M") == 128 and "A_ROW_DIV" in c}
    assert moe_tiles(recorded) == {(True, 128), (False, 256)}
    assert moe_tiles(_aot.record_matrix((8, 0))) == {(True, 64), (False, 128)}


def test_recorded_configs_are_the_cuda_choice(recorded):
    """The wrappers chose as on an H100 (132 SMs), not as for the interpreter: the prefill tiles are
    launch_config(..., "cuda"), fp32 decode runs 8 warps, and one long sequence splits 32 ways
    (8 ways with the CPU's stand-in of 8 SMs)."""
    prefill = [launch for launch in recorded if launch.kernel.__name__ == "_prefill_attention_kernel"]
    for launch in prefill:
        c = _constexprs(launch)
        expected = prefill_attention.launch_config(c["HEAD_DIM_PAD"], c["GROUP_PAD"], _dtype(launch, "q_ptr"), "cuda",
                                                   c["KV_FP8"], head_dim=c["HEAD_DIM"])
        got = (c["BLOCK_M"], c["TILE_N"], launch.kwargs["num_warps"], launch.kwargs["num_stages"])
        assert got == expected
        assert launch.kwargs.get("maxnreg") == prefill_attention.max_registers(_dtype(launch, "q_ptr"), "cuda")
        assert c["BLOCK_M"] == c["BLOCK_Q"] * c["GROUP_PAD"]
    interpreter_configs = {prefill_attention.launch_config(c["HEAD_DIM_PAD"], c["GROUP_PAD"], torch.float16, "cpu")
                           for c in map(_constexprs, prefill)}
    assert {(c["BLOCK_M"], c["TILE_N"], launch.kwargs["num_warps"], launch.kwargs["num_stages"])
            for launch, c in zip(prefill, map(_constexprs, prefill))} - interpreter_configs
    splits = []
    for launch in recorded:
        if launch.kernel.__name__ == "_decode_split_kernel":
            c = _constexprs(launch)
            assert launch.kwargs["num_warps"] == decode_attention.launch_config(_dtype(launch, "q_ptr"), "cuda")
            assert launch.grid[2] == c["NUM_SPLITS"] <= decode_attention.MAX_SPLITS
            splits.append(c["NUM_SPLITS"])
    assert max(splits) == decode_attention.MAX_SPLITS and 1 in splits
    assert {launch.kwargs["num_warps"] for launch in recorded if launch.kernel.__name__ == "_decode_split_kernel"} == {4, 8}


def test_recording_leaves_the_ops_as_they_were(recorded):
    """After recording, the modules hold their kernels again and CPU tensors choose CPU configs."""
    for name, (kernel, module_name) in _aot.launched_kernels().items():
        assert getattr(sys.modules[module_name], name) is kernel
        assert not isinstance(kernel, _aot._Recorder)
    assert _backend.launch_device_kind(torch.device("cpu")) == "cpu"
    assert _backend.num_multiprocessors(torch.device("cpu")) != _aot.SIMULATED_SMS


def test_dot_tiles_are_at_least_16(recorded):
    """tl.dot needs >= 16 in every dimension on a GPU (the interpreter accepts less): every dot
    operand of the recorded configs (the compile below proves it again)."""
    for launch in recorded:
        c = _constexprs(launch)
        if launch.kernel.__name__ == "_decode_split_kernel":  # (BLOCK_H x HEAD_PAD) @ (HEAD_PAD x TILE_N) ...
            assert min(c["BLOCK_H"], c["HEAD_PAD"], c["TILE_N"]) >= 16
        elif launch.kernel.__name__ == "_prefill_attention_kernel":  # (BLOCK_M x HEAD_DIM_PAD) @ (.. x TILE_N)
            assert min(c["BLOCK_M"], c["HEAD_DIM_PAD"], c["TILE_N"]) >= 16
        elif launch.kernel.__name__ == "_fused_moe_kernel":  # (BLOCK_M x BLOCK_K) @ (BLOCK_K x BLOCK_N)
            assert min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) >= 16
        elif launch.kernel.__name__ == "_wq_gemm_kernel":  # (BLOCK_M x BLOCK_K[/2]) @ (.. x BLOCK_N)
            k_dim = c["BLOCK_K"] // 2 if c["WEIGHT_FORMAT"] == 0 else c["BLOCK_K"]
            assert min(c["BLOCK_M"], c["BLOCK_N"], k_dim) >= 16 and c["BLOCK_K"] % 32 == 0
        elif launch.kernel.__name__ == "_lora_shrink_kernel":  # (BLOCK_M x BLOCK_K) @ (BLOCK_K x BLOCK_N)
            assert min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) >= 16
        elif launch.kernel.__name__ == "_lora_expand_kernel":  # (BLOCK_M x BLOCK_R) @ (BLOCK_R x BLOCK_N)
            assert min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_R"]) >= 16


# ---------------------------------------------------------------------------------------------
# the report's parts
# ---------------------------------------------------------------------------------------------

# ptxas -v as Triton 3.9 (ptxas-blackwell) and 3.6 (ptxas) print it.
PTXAS_LOGS = {
    "3.9": """ptxas-blackwell info    : 28 bytes gmem
ptxas-blackwell info    : Compiling entry function '_rms_norm_kernel' for 'sm_90a'
ptxas-blackwell info    : Function properties for _rms_norm_kernel
    48 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
ptxas-blackwell info    : Used 255 registers, used 1 barriers, 1024 bytes smem
ptxas-blackwell info    : Compile time = 38.700 ms
""",
    "3.6": """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_decode_split_kernel' for 'sm_80'
ptxas info    : Function properties for _decode_split_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 106 registers, used 1 barriers
""",
}


def test_parse_ptxas_log():
    assert _aot.parse_ptxas_log(PTXAS_LOGS["3.9"]) == dict(registers=255, spill_stores=44, spill_loads=40, stack=48,
                                                           static_smem=1024)
    assert _aot.parse_ptxas_log(PTXAS_LOGS["3.6"]) == dict(registers=106, spill_stores=0, spill_loads=0, stack=0,
                                                           static_smem=0)
    assert _aot.parse_ptxas_log("")["registers"] is None


def _row(**changes):
    row = dict(kernel="_rms_norm_kernel", target=90, triton="x", constexprs={}, hot=True, error=None, registers=64,
               spill_stores=0, spill_loads=0, stack=0, shared=1024, grids=[(8, 1, 1)])
    row.update(changes)
    return row


def test_problems_flag_what_fails_on_the_device():
    assert _aot.problems([_row(), _row(kernel="_rotary_kernel", hot=False, spill_stores=8, spill_loads=8)]) == []
    flagged = {
        "spills": _row(spill_stores=4, spill_loads=4),
        "unparsed ptxas report": _row(spill_stores=None, spill_loads=None),
        "compile error": _row(error="CompilationError: dot shape"),
        "shared memory": _row(target=80, shared=200 * 1024),
        "grid": _row(grids=[(1, 70000, 1)]),
    }
    for reason, row in flagged.items():
        assert len(_aot.problems([row])) == 1, reason
    assert _aot.problems([_row(target=90, shared=200 * 1024)]) == []  # fits an H100, not an A100


_CACHE_SCRIPT = r"""
import json, sys
from pathlib import Path
from triton.backends.compiler import GPUTarget
from pagedkernels import _aot

variants = [v for v in _aot.distinct_variants(_aot.record_matrix(), GPUTarget("cuda", 90, 32))
            if v.kernel.__name__ == "_silu_and_mul_kernel"][:2]
keys = [_aot.result_key(v, cc) for v in variants for cc in (90, 80)]
assert len(set(keys)) == 4 and keys == [_aot.result_key(v, cc) for v in variants for cc in (90, 80)], keys
planted = {"registers": 7, "spill_stores": 0, "spill_loads": 0, "stack": 0, "shared": 0, "compile_s": 0.0,
           "error": None}
results = _aot.compile_all(variants, (90,), 1, {keys[0]: planted})
assert results[(0, 90)] == {**planted, "cached": True}, results[(0, 90)]
assert results[(1, 90)]["cached"] is False and results[(1, 90)]["registers"], results[(1, 90)]
path = Path(sys.argv[1])
path.write_text(json.dumps({"0.0.0": {"other": {}}}))
_aot.save_results_cache({keys[0]: results[(0, 90)]}, path)
assert _aot.load_results_cache(path) == {keys[0]: planted}
assert json.loads(path.read_text())["0.0.0"] == {"other": {}}   # another Triton's part is kept
print("ok")
"""


def test_results_cache_takes_hits_and_compiles_misses(tmp_path):
    """A cached result (by its key: Triton version, target, the kernel's source hash and the
    specialization) is used as it is; a variant without one is compiled; saving keeps other Tritons'
    parts. (In a subprocess: the kernels must be real JITFunctions, not the interpreter's.)"""
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    with tempfile.TemporaryDirectory(prefix="pagedkernels-aot-test-") as triton_cache:
        env["TRITON_CACHE_DIR"], env["TRITON_DUMP_PTXAS_LOG"] = triton_cache, "1"
        result = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(tmp_path / "cache.json")], cwd=REPO_ROOT,
                                env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# the compile
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_image_triton() -> Path | None:
    """Triton 3.6's install dir (None when this machine's Triton is that version). Installed on first
    use; in CI a failure to get it fails the test, elsewhere (e.g. offline) it skips."""
    if triton.__version__ == GPU_IMAGE_TRITON:
        return None
    try:
        return _aot.ensure_triton(GPU_IMAGE_TRITON)
    except RuntimeError as e:
        if _in_ci():
            pytest.fail(f"CI must compile with Triton {GPU_IMAGE_TRITON}: {e}")
        pytest.skip(f"Triton {GPU_IMAGE_TRITON} is not installable here (pip, no network?): {e}")


@pytest.mark.slow
def test_every_launch_compiles_for_sm90_and_sm80(tmp_path, gpu_image_triton):
    versions = [None] + ([GPU_IMAGE_TRITON] if gpu_image_triton is not None else [])
    # Each run gets every core: while both run the OS shares them, and the one that finishes first
    # (3.6 compiles faster) leaves them all to the other instead of one idle core.
    jobs = os.cpu_count() or 1
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    running = {}
    for version in versions:
        name = version or "local"
        command = [sys.executable, "-m", "pagedkernels._aot", "--jobs", str(jobs),
                   "--targets", "90,80", "--out", str(tmp_path / f"{name}.json"), "--md", str(tmp_path / f"{name}.md")]
        if version:
            command += ["--triton", version]
        running[name] = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
    reports, outputs = {}, {}
    for name, proc in running.items():
        outputs[name], _ = proc.communicate(timeout=900)
        # exit 1 = problems found (asserted on below, with the list); anything else is a crash
        assert proc.returncode in (0, 1) and (tmp_path / f"{name}.json").exists(), outputs[name][-4000:]
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())

    rows = [row for report in reports.values() for row in report["rows"]]
    table = tmp_path / "aot_report.md"
    table.write_text("\n".join(f"{_aot.summary(r)}\n" for r in reports.values()) + "\n" + _aot.markdown_table(rows))
    print(f"\nAOT compile report: {table}")
    for report in reports.values():
        print(_aot.summary(report))

    assert reports["local"]["triton"] == triton.__version__
    if gpu_image_triton is not None:
        assert reports[GPU_IMAGE_TRITON]["triton"] == GPU_IMAGE_TRITON  # that Triton, not this machine's
    for report in reports.values():
        assert report["targets"] == [90, 80]
        assert report["kernels_recorded"] == report["kernels_launchable"]
        assert 0 < report["variants"] == report["distinct_variants"] <= report["launches"]
        assert not report["representatives_only"]
        # every variant on the targets whose recording made it: both, but the programmatic-dependent-launch ones
        # (griddepcontrol) and the launch configs chosen for Hopper alone (fused_moe's widest tiles) on sm_90, and
        # those chosen for the rest on sm_80 (fused_moe's narrower tiles; the PDL cases' launches without PDL)
        pdl = [row for row in report["rows"] if row["constexprs"].get("USE_PDL")]
        assert pdl and all(row["target"] == 90 for row in pdl)
        by_target = {cc: {(row["kernel"], json.dumps(row["constexprs"], sort_keys=True), str(row["pointer_dtypes"]),
                           row["num_warps"], row["num_stages"]) for row in report["rows"] if row["target"] == cc}
                     for cc in (90, 80)}
        only = {cc: {key[0] for key in by_target[cc] - by_target[80 if cc == 90 else 90]} for cc in (90, 80)}
        pdl_kernels = {row["kernel"] for row in pdl}
        assert only[90] == {"_fused_moe_kernel", *pdl_kernels}
        assert "_fused_moe_kernel" in only[80] and only[80] <= {"_fused_moe_kernel", *pdl_kernels}
        assert len(report["rows"]) <= 2 * report["variants"]
        assert {row["kernel"] for row in report["rows"]} == set(report["kernels_launchable"])
        # ptxas' report was read for every compile (registers are only there)
        assert all(row["error"] or row["registers"] for row in report["rows"])
    problems = [p for report in reports.values() for p in report["problems"]]
    assert not problems, "\n".join(problems)
