"""Session fixtures for engine tests: the converted SmolLM2 directory and tiny random-weight models."""

from __future__ import annotations

import pytest

from tests.engine.models_util import TINY_ARCHITECTURES, TINY_MOE_ARCHITECTURES, build_tiny_model_dir
from tests.extras import default_model_or_skip


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Path of the converted SmolLM2-135M-Instruct HF directory (converted once per machine, into
    ``$ENGINE_CACHE_DIR`` or ``~/.cache/engine``; see engine/default_model.py)."""
    return default_model_or_skip()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: ``tiny_model_dir(arch)`` -> path of a random-weight float32 model directory of
    ``arch`` in ``TINY_ARCHITECTURES`` or ``TINY_MOE_ARCHITECTURES``, built once per session."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES:
            raise ValueError(f"arch must be one of {TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES}, got {arch!r}")
        if arch not in built:
            out_dir = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            built[arch] = build_tiny_model_dir(arch, out_dir)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir) -> str:
    """The tiny random-weight Llama directory (the default model of the engine-behaviour tests)."""
    return tiny_model_dir("llama")


@pytest.fixture(params=TINY_ARCHITECTURES)
def tiny_arch(request) -> str:
    """Parametrizes a test over the tiny architectures (``TINY_ARCHITECTURES``)."""
    return request.param



@pytest.fixture(scope="session")
def peft_adapters(tiny_model_dir, tmp_path_factory):
    """Factory: ``peft_adapters(arch, names)`` -> {name: directory} of tests/engine/lora_util.py's ADAPTERS for
    that tiny model, made with PEFT once per session (needs peft)."""
    pytest.importorskip("peft", reason="the LoRA oracle is PEFT (pip install peft, the dev extra)")
    from tests.engine.lora_util import ADAPTERS, make_peft_adapter

    made: dict[tuple[str, str], str] = {}

    def get(arch: str, names) -> dict[str, str]:
        for name in names:
            if (arch, name) not in made:
                out = str(tmp_path_factory.mktemp(f"lora-{arch}-{name}"))
                made[(arch, name)] = make_peft_adapter(tiny_model_dir(arch), out, seed=len(made) + 1,
                                                       **ADAPTERS[name])
        return {name: made[(arch, name)] for name in names}

    return get
