"""A small vLLM-style offline inference engine on pagedkernels: `LLM(model).generate(prompts, SamplingParams())`.

The names below load on first use (PEP 562), so that a process that needs one small module of the package (a chat
template sandbox worker, `python -m engine.chat_template_sandbox`, needs jinja alone) does not import torch and the
engine with it: a server starts two such workers per API server, and replaces a killed one while it serves."""
import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.core.llm_engine",
    "LoRARequest": "engine.lora.request",
    "CompletionOutput": "engine.outputs",
    "EngineMetrics": "engine.outputs",
    "Logprob": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "GuidedDecodingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
}

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "EngineMetrics", "GuidedDecodingParams", "Logprob", "LoRARequest",
           "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
