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
    install, test = bash_blocks[1].strip().split(" && ")
    assert install.replace("pip install", "") in ci and test in ci


@pytest.mark.parametrize("index", range(2), ids=["pagedkernels", "engine"])
def test_readme_example_runs(index):
    namespace: dict = {}
    exec(compile(_python_blocks()[index], f"README.md[python block {index}]", "exec"), namespace)
    if index == 1:
        assert len(namespace["outputs"]) == 2 and all(o.outputs[0].token_ids for o in namespace["outputs"])
