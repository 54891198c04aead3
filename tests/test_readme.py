"""The README's examples run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_setup_commands():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert "python -m engine generate" in bash_blocks[0]
    assert "python -m pytest" in bash_blocks[1]
    ci = (README.parent / ".ci" / "run").read_text()
    *installs, test = bash_blocks[1].strip().split(" && ")
    for install in installs:
        assert install.startswith("pip install ") and install.removeprefix("pip install") in ci
    assert test in ci
    # Both start from PyTorch's CPU index: PyPI's torch is the CUDA build everywhere.
    for block in bash_blocks[:2]:
        assert block.startswith("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && ")


def test_plain_install_converts_the_default_model():
    """The main job installs without extras: what the GGUF conversion imports must be a main dependency."""
    import tomllib

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert {"gguf", "accelerate", "transformers", "safetensors"} <= names
    main_job = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)[0]
    assert "-e . &&" in main_job


@pytest.mark.parametrize("index", range(2), ids=["pagedkernels", "engine"])
def test_readme_example_runs(index):
    namespace: dict = {}
    exec(compile(_python_blocks()[index], f"README.md[python block {index}]", "exec"), namespace)
    if index == 1:
        assert len(namespace["outputs"]) == 2 and all(o.outputs[0].token_ids for o in namespace["outputs"])
