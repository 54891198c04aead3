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


def test_generate_streams_text_as_the_engine_produces_it(model_dir, llm, monkeypatch):
    """Each engine step's new text is printed (and flushed) before the next step runs, not all at the end."""
    from engine.core.llm_engine import LLMEngine

    steps, writes = [0], []
    real_step = LLMEngine.step

    def counting_step(self):
        steps[0] += 1
        return real_step(self)

    class RecordingStdout(io.StringIO):
        def write(self, text):
            writes.append((steps[0], text))
            return super().write(text)

    monkeypatch.setattr(LLMEngine, "step", counting_step)
    monkeypatch.setattr(sys, "stdout", RecordingStdout())
    main(["generate", PROMPT, "--model", model_dir, "--max-tokens", "12", "--num-kv-blocks", "32",
          "--sampling-seed", "3", "--temperature", "1.0", "--ignore-eos"])
    expected = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert "".join(text for _, text in writes) == expected + "\n"
    pieces = [(step, text) for step, text in writes if text and text != "\n"]
    assert len({step for step, _ in pieces}) > 3   # printed over many steps
    assert pieces[0][0] < steps[0]


def test_engine_options_are_one_definition():
    """EngineArgs' fields are LLMEngine's and LLM's keyword arguments, and every command takes them by
    vLLM's flag names; serve also takes the model positionally."""
    import dataclasses
    import inspect

    from engine.__main__ import build_parser
    from engine.engine_args import EngineArgs
    from engine.core.llm_engine import LLMEngine

    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for cls in (LLMEngine, LLM):
        parameters = inspect.signature(cls.__init__).parameters
        kwargs = {name: p.default for name, p in parameters.items() if name not in ("self",)}
        assert set(kwargs) == set(fields), cls
        assert {k: v for k, v in kwargs.items() if k != "model"} == {k: v for k, v in fields.items()
                                                                     if k != "model"}, cls
    parser = build_parser()
    flags = ["--tokenizer", "/tok", "--gpu-memory-utilization", "0.5", "--swap-space", "2", "--preemption-mode",
             "swap", "--generation-config", "vllm", "--max-model-len", "64", "--enforce-eager",
             "--no-enable-prefix-caching", "--block-size", "32", "--max-num-seqs", "8", "--seed", "5"]
    expected = EngineArgs(model="/m", tokenizer="/tok", gpu_memory_utilization=0.5, swap_space=2.0,
                          preemption_mode="swap", generation_config="vllm", max_model_len=64, enforce_eager=True,
                          enable_prefix_caching=False, block_size=32, max_num_seqs=8, seed=5)
    serve = parser.parse_args(["serve", "/m", *flags, "--chat-template", "t.jinja", "--tool-call-parser", "hermes",
                               "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
                               "--trust-request-chat-template"])
    assert EngineArgs.from_cli_args(serve) == expected
    assert (serve.chat_template, serve.tool_call_parser, serve.reasoning_parser) == ("t.jinja", "hermes", "qwen3")
    assert EngineArgs.from_cli_args(parser.parse_args(["serve", "--model", "/m", *flags])) == expected
    assert EngineArgs.from_cli_args(parser.parse_args(["generate", "hi", "--model", "/m", *flags])) == expected
    assert EngineArgs.from_cli_args(parser.parse_args(["chat", "--model", "/m", *flags])) == expected


def test_serve_chat_template_option(tmp_path):
    from engine.entrypoints.openai.api_server import load_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template == load_chat_template(template)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
