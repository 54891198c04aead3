"""`python -m engine generate | chat | download`, run in-process on a tiny model."""
import io
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.__main__ import main

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=32)


def test_generate_prints_greedy_completion(model_dir, llm, capsys):
    main(["generate", PROMPT, "--model", model_dir, "--max-tokens", "6", "--num-kv-blocks", "32"])
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_generate_chat_flag_uses_template(model_dir, llm, capsys):
    main(["generate", PROMPT, "--chat", "--model", model_dir, "--max-tokens", "5", "--num-kv-blocks", "32"])
    expected = llm.chat([{"role": "user", "content": PROMPT}], SamplingParams(temperature=0.0, max_tokens=5),
                        use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_chat_keeps_the_conversation(model_dir, llm, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nTell me more\nexit\nnot read\n"))
    main(["chat", "--model", model_dir, "--max-tokens", "4", "--temperature", "0", "--num-kv-blocks", "32"])
    replies = capsys.readouterr().out.splitlines()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    conversation = [{"role": "user", "content": "Hello there"}]
    first = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "Tell me more"}]
    second = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
    assert "\n".join(replies) == first + "\n" + second


def test_bad_argument_is_a_clean_error(model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", PROMPT, "--model", model_dir, "--max-tokens", "-1"])
    assert exc.value.code == 2 and "max_tokens" in capsys.readouterr().err


def test_download_prints_the_default_model_dir(monkeypatch, capsys):
    import engine.default_model
    monkeypatch.setattr(engine.default_model, "default_model_path", lambda: "/cache/SmolLM2")
    main(["download"])
    assert capsys.readouterr().out == "/cache/SmolLM2\n"


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "engine", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and all(cmd in result.stdout for cmd in ("generate", "chat", "download"))
