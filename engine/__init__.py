"""A small vLLM-style offline inference engine on pagedkernels: `LLM(model).generate(prompts, SamplingParams())`."""
from engine.llm import LLM
from engine.core.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, EngineMetrics, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "EngineMetrics", "GuidedDecodingParams", "Logprob", "LoRARequest",
           "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams"]
