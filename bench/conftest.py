"""Fixtures shared by the bench tests: one tiny random-weight Llama and one in-process server on it for the
session (bench/test_serve.py and bench/test_soak.py drive the same server: one engine start-up, not two)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    from tests.engine.models_util import build_tiny_model_dir

    return build_tiny_model_dir("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def server(tiny_llama):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.api_server import ServerThread, build_app

    engine = AsyncLLMEngine.from_args(tiny_llama, num_kv_blocks=256, max_model_len=256)
    with ServerThread(build_app(engine, served_model_names=["tiny"])) as server:
        yield server
