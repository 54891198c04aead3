"""`python -m engine generate | chat | download`, run in-process on a tiny model."""
import io
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.__main__ import main
from tests.extras import require_serve_extra

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


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_an_unknown_option_shows_its_commands_usage(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--no-such-option"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(f"usage: python -m engine {command[0]} ") and "--max-model-len" in err
    assert "unrecognized arguments: --no-such-option" in err


def test_vllm_options_with_no_effect_here_are_accepted_with_a_note(model_dir, caplog, capsys):
    """Flags common in vLLM scripts run here (a warning says what they mean), instead of an argparse exit or a
    TypeError from LLM(...)."""
    import logging

    from engine.__main__ import build_parser, parse_args
    from engine.engine_args import EngineArgs

    args = parse_args(build_parser(), ["serve", model_dir, "--trust-remote-code", "--disable-log-stats",
                                       "--disable-log-requests", "--no-enable-chunked-prefill"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.trust_remote_code, engine_args.disable_log_stats, engine_args.enable_chunked_prefill) == \
        (True, True, False)
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine_args.create_engine_config()
    assert "no model code is downloaded or run" in caplog.text and "chunked prefill is always on" in caplog.text
    llm = LLM(model_dir, num_kv_blocks=32, trust_remote_code=True, disable_log_stats=True)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="trust_remote_code must be a bool"):
        EngineArgs(model=model_dir, trust_remote_code="yes").create_engine_config()


def test_vllm_parallel_sizes_beyond_one_are_clear_errors(model_dir):
    from engine.__main__ import build_parser, parse_args
    from engine.engine_args import EngineArgs

    args = EngineArgs.from_cli_args(parse_args(build_parser(), ["serve", model_dir, "-pp", "1", "-dp", "1"]))
    assert (args.pipeline_parallel_size, args.data_parallel_size) == (1, 1)
    args.create_engine_config()
    for flag, name in (("--pipeline-parallel-size", "pipeline_parallel_size"), ("-dp", "data_parallel_size")):
        args = EngineArgs.from_cli_args(parse_args(build_parser(), ["serve", model_dir, flag, "2"]))
        with pytest.raises(ValueError, match=f"{name}=2: .* not supported yet; shard the model with "
                                             f"tensor_parallel_size"):
            args.create_engine_config()
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        LLM(model_dir, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(model=model_dir, data_parallel_size=0).create_engine_config()


def test_more_vllm_engine_flags():
    from engine.__main__ import build_parser, parse_args
    from engine.engine_args import EngineArgs

    args = EngineArgs.from_cli_args(parse_args(build_parser(), [
        "serve", "/m", "--override-generation-config", '{"temperature": 0.2}', "--num-gpu-blocks-override", "64",
        "--max-logprobs", "-1", "--revision", "v2", "--tokenizer-revision", "t", "--download-dir", "/d",
        "--hf-overrides", '{"rope_theta": 5.0}']))
    assert args.hf_overrides == {"rope_theta": 5.0}
    assert args.override_generation_config == {"temperature": 0.2} and args.num_kv_blocks == 64
    assert (args.max_logprobs, args.revision, args.tokenizer_revision, args.download_dir) == (-1, "v2", "t", "/d")


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
    """EngineArgs' fields are LLM's keyword arguments, LLMEngine takes the one EngineConfig they build, and
    every command takes them by vLLM's flag names; serve also takes the model positionally."""
    import dataclasses
    import inspect

    from engine.__main__ import build_parser
    from engine.engine_args import EngineArgs
    from engine.core.llm_engine import LLMEngine

    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    parameters = inspect.signature(LLM.__init__).parameters
    kwargs = {name: p.default for name, p in parameters.items() if name not in ("self",)}
    assert set(kwargs) == set(fields)
    assert {k: v for k, v in kwargs.items() if k != "model"} == {k: v for k, v in fields.items() if k != "model"}
    assert list(inspect.signature(LLMEngine.__init__).parameters) == ["self", "config"]
    parser = build_parser()
    spec = parser.parse_args(["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineArgs.from_cli_args(spec).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--speculative-config", "[1]"])
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
    require_serve_extra()
    from engine.entrypoints.openai.api_server import load_chat_template

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template == load_chat_template(template)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_conversation(model_dir, monkeypatch, capsys):
    """Ctrl-C during a reply (SIGINT, delivered while the reply streams) stops it: its request is aborted, what was
    shown stays in the conversation as the assistant's turn, and the next message gets a reply; EOF ends the chat."""
    import copy
    import os
    import signal

    import engine.__main__ as cli

    conversations, built = [], []
    real_build, real_stream = cli._build, LLM.stream_text

    def build(args):
        llm, params = real_build(args)
        built.append(llm)
        return llm, params

    def stream_text(self, prompt, params, *, chat):
        conversations.append(copy.deepcopy(prompt))
        inner = real_stream(self, prompt, params, chat=chat)
        try:
            for i, piece in enumerate(inner):
                yield piece
                if len(conversations) == 1 and i == 0:
                    os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while the first reply streams
        finally:
            inner.close()

    monkeypatch.setattr(cli, "_build", build)
    monkeypatch.setattr(LLM, "stream_text", stream_text)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nTell me more\n"))

    def not_handled(signum, frame):   # the chat did not take the Ctrl-C: fail this test, not the whole session
        raise AssertionError("the Ctrl-C during the reply reached the default handler")

    previous_handler = signal.signal(signal.SIGINT, not_handled)
    try:
        main(["chat", "--model", model_dir, "--max-tokens", "24", "--ignore-eos", "--temperature", "0",
              "--num-kv-blocks", "32"])
        assert signal.getsignal(signal.SIGINT) is not_handled   # restored after each reply
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    out, err = capsys.readouterr()
    assert "reply stopped" in err
    assert len(conversations) == 2
    partial = conversations[1][1]["content"]
    assert conversations[1] == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": partial},
                                {"role": "user", "content": "Tell me more"}]
    llm = built[0]
    full = llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    assert partial and full.text.startswith(partial) and len(partial) < len(full.text)   # stopped early
    second = out.split("\n", 1)[1]
    assert out.startswith(partial + "\n") and second.strip()   # the second turn got its reply
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class _Reader:
    """Collects what a pipe delivers on a thread, so a test can wait for output without blocking on it."""

    def __init__(self, pipe):
        import threading

        self.data = b""
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe):
        import os

        while chunk := os.read(pipe.fileno(), 4096):
            self.data += chunk

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    def wait_for(self, predicate, process, timeout_s: float = 120.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not predicate(self.text):
            assert process.poll() is None, f"exited with {process.returncode}"
            assert time.monotonic() < deadline, self.text[-2000:]
            time.sleep(0.02)


def test_chat_ctrl_c_in_a_real_terminal_session(model_dir):
    """`python -m engine chat` as a process: Ctrl-C during a reply stops it and the next message is answered;
    Ctrl-C at the prompt ends the chat with status 0 and no traceback."""
    import signal

    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "chat", "--model", model_dir, "--max-tokens", "500", "--ignore-eos",
         "--max-model-len", "1024", "--num-kv-blocks", "80"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # A terminal's Ctrl-C reaches a process whose SIGINT is at its default; a test run started in the
        # background by a shell without job control has it ignored, which the chat would inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = _Reader(process.stdout), _Reader(process.stderr)
    try:
        for turn, message in enumerate([b"Hello there\n", b"Tell me more\n"], start=1):
            shown = len(out.text)
            process.stdin.write(message)
            process.stdin.flush()
            out.wait_for(lambda text: text[shown:].strip(), process)        # the reply is streaming
            process.send_signal(signal.SIGINT)
            err.wait_for(lambda text: text.count("reply stopped") == turn, process)
        process.send_signal(signal.SIGINT)                                   # at the prompt
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err.text[-2000:]
    assert "Traceback" not in err.text, err.text[-2000:]


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "pydantic"])
def test_serve_without_the_serve_extra_says_what_to_install(missing, tmp_path):
    """A module of the serve extra that does not import (None in sys.modules) is a one-line error naming the
    extra's install command, exit status 2, before any model is loaded."""
    code = ("import runpy, sys\n"
            f"sys.modules[{missing!r}] = None\n"
            f"sys.argv = ['engine', 'serve', {str(tmp_path / 'no-such-model')!r}]\n"
            "runpy.run_module('engine', run_name='__main__', alter_sys=True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    import importlib.util

    from engine.__main__ import SERVE_MODULES

    # The first module of the extra that does not import is named (on a machine without the extra, not `missing`).
    named = next(name for name in SERVE_MODULES if name == missing or importlib.util.find_spec(name) is None)
    assert f"({named} is not installed)" in result.stderr
    assert 'pip install -c .ci/constraints.txt -e ".[serve]"' in result.stderr
