"""docs/ is checked as the README is: every Python block runs, every command line parses, every link and every
results file it names exists.

The README's own Python blocks run in tests/test_readme.py (its Server block against a loopback server in
tests/engine/test_server_tools.py); the checks of command lines, links and results files here cover the README too.
"""

import functools
import glob
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


# -- Python blocks ------------------------------------------------------------------------------------------------
DOC_BLOCKS = [(path, index, code) for path in DOCS for index, code in enumerate(code_blocks(path, "python"))]


def test_docs_have_runnable_examples():
    pages = {path.name for path, _, _ in DOC_BLOCKS}
    assert {"architecture.md", "pagedkernels.md", "quantization.md", "usage.md"} <= pages, pages


@pytest.mark.parametrize("path, index, code", DOC_BLOCKS, ids=[f"{p.stem}-{i}" for p, i, _ in DOC_BLOCKS])
def test_docs_example_runs(path, index, code, capsys):
    if "default_model_path" in code:
        from tests.extras import default_model_or_skip
        default_model_or_skip()
    namespace: dict = {}
    exec(compile(code, f"{path.relative_to(ROOT)}[python block {index}]", "exec"), namespace)
    assert capsys.readouterr().out.strip(), "an example prints what it computes"
    if "beams" in namespace:   # usage.md: n > 1, beam search, prompt logprobs, swap, metrics
        assert len(namespace["four"]) == 4 and all(c.token_ids for c in namespace["four"])
        assert namespace["best"].text and namespace["best"].tokens and namespace["scored"][-1]
        assert namespace["metrics"].num_running == namespace["metrics"].num_waiting == 0
    if "processed" in namespace:   # architecture.md: the layers driven by hand
        engine = namespace["engine"]
        assert not engine.has_unfinished_requests() and engine.get_metrics().num_generation_tokens == 8
    if "decode_triton" in namespace:   # pagedkernels.md: the backends agree
        import torch
        torch.testing.assert_close(namespace["decode"], namespace["decode_triton"], rtol=1e-4, atol=1e-4)


# -- command lines -------------------------------------------------------------------------------------------------
def command_lines(path: Path) -> list[list[str]]:
    """Every command of every bash block of `path`: continuation lines joined, `&&` chains split, comments and
    leading VAR=value assignments dropped."""
    commands = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split(" && "):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words:
                    commands.append(words)
    return commands


COMMANDS = [(path, words) for path in PAGES for words in command_lines(path)]


def _module_and_args(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `python -m MODULE ...` or `torchrun ... -m MODULE ...`, else None."""
    if words[0] in ("python", "python3", "torchrun") and "-m" in words:
        at = words.index("-m")
        return words[at + 1], words[at + 2:]
    return None


@pytest.mark.parametrize("path, words", COMMANDS,
                         ids=[f"{p.stem}-{' '.join(w[:4])}"[:60] for p, w in COMMANDS])
def test_command_line_is_valid(path, words):
    """`python -m engine ...` lines parse with the engine's own parser (an option renamed or gone fails here);
    other modules exist and define every --flag the line gives; scripts run by bash exist."""
    if words[0] in ("pip", "curl"):
        return   # the install lines are tests/test_readme.py's; the curl request runs in tests/engine/test_server.py
    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), words
        return
    module_args = _module_and_args(words)
    assert module_args is not None, f"{path.name}: a command these tests do not know how to check: {words}"
    module, args = module_args
    if module == "engine":
        from engine.__main__ import build_parser, parse_args

        try:
            parse_args(build_parser(), args)
        except SystemExit as e:
            pytest.fail(f"{path.name}: `python -m engine {' '.join(args)}` does not parse (exit {e.code})")
        return
    flags = [arg.split("=")[0] for arg in args if arg.startswith("--")]
    if module == "pytest":   # its options come from its plugins too (pytest-xdist's -n and --dist)
        known = set(re.findall(r"(?<![\w-])--[\w-]+", _pytest_help()))
        assert not set(flags) - known, f"{path.name}: pytest (with the installed plugins) has no {set(flags) - known}"
        return
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{path.name}: no module {module}"
    source = Path(spec.origin).read_text()
    for flag in flags:
        assert f'"{flag}"' in source, f"{path.name}: {module} has no {flag}"


@functools.lru_cache(maxsize=1)
def _pytest_help() -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


# -- links and results files -----------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


LINKS = [(path, target) for path in [*PAGES, ROOT / "bench" / "README.md"]
         for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path, target", LINKS, ids=[f"{p.parent.name}-{p.stem}-{t}" for p, t in LINKS])
def test_link_resolves(path, target):
    file, _, anchor = target.partition("#")
    linked = (path.parent / file).resolve() if file else path
    assert linked.is_file(), f"{path.name}: {target} is not a file"
    if anchor:
        assert anchor in _anchors(linked), f"{path.name}: {linked.name} has no heading for #{anchor}"


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    range_match = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    choices = ([str(i) for i in range(int(range_match.group(1)), int(range_match.group(2)) + 1)]
               if range_match else body.split(","))
    return [expanded for choice in choices
            for expanded in _expand_braces(pattern[:match.start()] + choice + pattern[match.end():])]


RESULTS = sorted({(path, name) for path in PAGES
                  for name in re.findall(r"`(?:bench/results/)?(\*?-?20\d\d-\d\d-\d\d-[^`\s]*|\*-[^`\s]*)`",
                                         path.read_text())})


def test_performance_record_names_results_files():
    assert sum(1 for path, _ in RESULTS if path.name == "performance.md") >= 30


@pytest.mark.parametrize("path, name", RESULTS, ids=[f"{p.stem}-{n}" for p, n in RESULTS])
def test_results_file_exists(path, name):
    """Every results file a page names (a `*` or `{a,b}` / `{1..8}` set: every member) is in bench/results/."""
    for pattern in _expand_braces(name):
        assert glob.glob(str(ROOT / "bench" / "results" / pattern)), f"{path.name}: no bench/results/{pattern}"
