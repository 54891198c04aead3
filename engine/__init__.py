"""A small vLLM-style offline inference engine on pagedkernels: `LLM(model).generate(prompts, SamplingParams())`."""
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]
