"""Loading the tokenizer of a model directory (transformers' fast tokenizer; tokenization only, no model code)."""
import os

# A directory holds a usable tokenizer when it has one of these (fast, SentencePiece, or BPE vocab files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")


def get_tokenizer(path: str):
    """The tokenizer stored in `path` (a local directory, or a GGUF file). A chat template kept in a separate
    `chat_template.jinja` is attached when the tokenizer config has none. Raises ValueError when the
    directory has no usable tokenizer."""
    from transformers import AutoTokenizer

    from engine.gguf_file import is_gguf_path, load_gguf_tokenizer

    if is_gguf_path(path):   # the tokenizer a GGUF model file carries
        return load_gguf_tokenizer(path)
    # transformers 5 builds an empty one-token tokenizer when the files are missing: refuse that here.
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    template_file = os.path.join(path, "chat_template.jinja")
    if getattr(tokenizer, "chat_template", None) is None and os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer
