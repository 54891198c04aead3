"""What a fresh machine gets: the license, the extras' contents and pins, and a suite that collects (and an engine
that imports and generates) without the optional modules."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Modules that only an extra brings (serve, dev), and the main dependencies that images installing the package
# without its dependencies lack (the GPU machine's: xgrammar, gguf, accelerate).
OPTIONAL_MODULES = ("fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "prometheus_client", "openai",
                    "httpx", "jsonschema", "langchain_openai", "langchain_core", "lm_eval", "matplotlib",
                    "xgrammar", "gguf", "accelerate")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def _block_modules_code(modules=OPTIONAL_MODULES) -> str:
    # None in sys.modules: `import x` raises ModuleNotFoundError and importlib.util.find_spec("x") is None, as for
    # a module that is not installed.
    return f"import sys\nfor name in {tuple(modules)!r}:\n    sys.modules[name] = None\n"


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 The pagedkernels-engine authors" in text
    assert "[yyyy]" not in text and len(text.splitlines()) == 202
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]


def test_dev_extra_pins_the_installed_hypothesis():
    """The fuzz tests run a fixed sample that depends on hypothesis' version: the dev extra pins it, and this
    machine must hold that version, or its fuzz runs differ from CI's."""
    (pin,) = [requirement for requirement in PROJECT["optional-dependencies"]["dev"]
              if requirement.startswith("hypothesis")]
    pinned = re.fullmatch(r"hypothesis==([\w.]+)", pin)
    assert pinned, f"the dev extra must pin hypothesis exactly, got {pin!r}"
    try:
        installed = version("hypothesis")
    except PackageNotFoundError:
        pytest.skip("hypothesis is not installed (the dev extra brings it)")
    assert installed == pinned.group(1), \
        f"hypothesis {installed} is installed, the dev extra pins {pinned.group(1)}: pip install -e '.[dev]'"


def test_extras_declare_what_the_server_imports():
    from engine.__main__ import SERVE_MODULES

    extras = PROJECT["optional-dependencies"]
    distributions = {"zmq": "pyzmq"}   # modules whose distribution has another name
    needed = {distributions.get(name, name.replace("_", "-")) for name in SERVE_MODULES}
    assert needed <= _names(extras["serve"]), "the serve extra must bring every module the server imports"
    assert _names(extras["serve"]) <= _names(extras["dev"]), "the dev extra runs the server tests"


def test_collection_needs_no_optional_module(tmp_path):
    """Without any optional module, the whole suite (tests/ and bench/) collects: modules that need one are
    skipped, and those under tests/ say what to install."""
    (tmp_path / "block_optional_modules.py").write_text(_block_modules_code())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}   # plugins of optional packages (langsmith's) stay out
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "block_optional_modules",
         "-p", "_hypothesis_pytestplugin", "-p", "pytest_benchmark.plugin", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "error" not in output.splitlines()[-1], output[-5000:]
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED") and " tests/" in line]
    for module in ("test_server.py", "test_server_api.py", "test_server_fuzz.py", "test_server_tools.py",
                   "test_server_lm_eval.py", "test_guided_decoding.py"):
        assert any(f"tests/engine/{module}" in line for line in skips), (module, skips)
    assert all("pip install" in line for line in skips), skips


def test_engine_imports_and_generates_without_optional_modules(tmp_path):
    """`import engine`, `engine.LLM` and plain generation need none of the optional modules (structured outputs
    import xgrammar on their first request, the server its extra, the GGUF conversion gguf)."""
    from tests.engine.models_util import build_tiny_model_dir

    model_dir = build_tiny_model_dir("qwen2", str(tmp_path / "tiny"))
    code = _block_modules_code() + textwrap.dedent(f"""
        import engine
        from engine import LLM, SamplingParams
        llm = LLM({model_dir!r}, num_kv_blocks=16)
        output = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == 3
        try:
            llm.generate("Hello", SamplingParams(max_tokens=3, guided_decoding={{"regex": "a+"}}), use_tqdm=False)
        except ValueError as e:
            assert "xgrammar" in str(e), e
        else:
            raise AssertionError("a guided request without xgrammar was not refused")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
