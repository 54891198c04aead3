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


def _python_blocks_by_section() -> list[tuple[str, str]]:
    """(the heading above it, code) of every Python block, in order."""
    blocks, heading = [], ""
    for part in re.split(r"(^#+ [^\n]*$|^```[^\n]*\n.*?^```)", README.read_text(), flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python\n"):
            blocks.append((heading, part.removeprefix("```python\n").removesuffix("```")))
    return blocks


# Every Python block is run by a test: the Server section's against a loopback server in
# tests/engine/test_server_tools.py::test_readme_server_example_runs, the others here.
SERVER_SECTION = "Server"
LOCAL_BLOCKS = [(heading, code) for heading, code in _python_blocks_by_section() if heading != SERVER_SECTION]


def test_every_python_block_is_run():
    sections = [heading for heading, _ in _python_blocks_by_section()]
    assert sections.count(SERVER_SECTION) == 1, "test_readme_server_example_runs runs one Server block"
    assert len(LOCAL_BLOCKS) + 1 == len(sections) == len(_python_blocks())


@pytest.mark.parametrize("index", range(len(LOCAL_BLOCKS)), ids=[h.split(",")[0].replace(" ", "-").lower()
                                                                 for h, _ in LOCAL_BLOCKS])
def test_readme_example_runs(index, capsys):
    heading, code = LOCAL_BLOCKS[index]
    if "default_model_path" in code:
        from tests.extras import default_model_or_skip
        default_model_or_skip()
    if "default_model_gguf_path" in code:
        from tests.extras import default_model_gguf_or_skip
        default_model_gguf_or_skip()
    namespace: dict = {}
    exec(compile(code, f"README.md[{heading} python block]", "exec"), namespace)
    assert capsys.readouterr().out.strip(), "an example prints what it computes"
    if "outputs" in namespace:
        assert len(namespace["outputs"]) == 2 and all(o.outputs[0].token_ids for o in namespace["outputs"])
    if "gguf_llm" in namespace:
        assert namespace["answer"].strip()


def test_readme_is_documentation_not_a_journal():
    """The README says what the project is and how to use it, in at most 250 lines; dated measurements live in
    docs/performance.md (tests/test_docs.py checks the files it names), the reference in docs/."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    for section in ("Install", "Quick start", "Supported models", "Features", "Performance", "Documentation"):
        assert section in headings, section


def test_serve_examples_serve_the_model_name_the_requests_use():
    """Every `python -m engine serve` example serves the model under the name the curl and Python examples send
    (a model given as a path is served under that path unless --served-model-name names it)."""
    import shlex

    from tests.extras import require_serve_extra

    require_serve_extra()
    from engine.__main__ import build_parser
    from engine.entrypoints.openai.api_server import served_model_name

    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)).replace("\\\n", " ")
    commands = [line for line in bash.splitlines() if line.startswith("python -m engine serve")]
    (server_block,) = [code for heading, code in _python_blocks_by_section() if heading == SERVER_SECTION]
    requested = set(re.findall(r'"model": "([^"]+)"', bash)) | set(re.findall(r'model="([^"]+)"', server_block))
    assert len(commands) == 2 and requested == {"SmolLM2-135M-Instruct"}, (commands, requested)
    for command in commands:
        args = build_parser().parse_args(shlex.split(command, comments=True)[3:])
        assert served_model_name(args) in requested, command
