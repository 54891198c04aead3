"""`LLMEngine`: the engine in one process, as vLLM V1 layers it: input processor -> engine core -> output processor.

    add_request:  prompt, SamplingParams -> InputProcessor.process -> EngineCoreRequest -> EngineCore.add_request
    step:         EngineCore.step (schedule -> execute -> update: token-id deltas)
                  -> OutputProcessor.process_outputs (text, stop strings, logprob tokens) -> RequestOutputs,
                  and the completions stop strings ended -> EngineCore.stop_sequences

`LLM` and `AsyncLLMEngine` drive this class; `serve` runs the same three parts in two kinds of process (the core
alone in one, engine/core/core_process.py; input and output processing in each API server, engine/mp_engine.py).
"""
from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.core.beam_search import BeamSearchParams
from engine.step_records import EngineCoreRequest
from engine.core.engine_core import EngineCore
from engine.core.input_processor import InputProcessor
from engine.core.output_processor import OutputProcessor
from engine.outputs import EngineMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import get_tokenizer

logger = logging.getLogger("engine")


class LLMEngine:
    """The engine of an EngineConfig (built and validated by `EngineArgs.create_engine_config()`; `engine.LLM`
    wraps this class and takes the same options as keyword arguments)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.model_config = config.model_config
        # skip_tokenizer_init: token ids in and out, no text (InputProcessor refuses what needs text).
        self.tokenizer = None if config.skip_tokenizer_init else \
            get_tokenizer(config.tokenizer or self.model_config.model_dir)
        self.engine_core = EngineCore(config, tokenizer=self.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, vocab_size=self.model_config.vocab_size,
                                              max_model_len=self.engine_core.max_model_len,
                                              max_num_seqs=config.scheduler_config.max_num_seqs,
                                              enable_lora=config.lora_config is not None,
                                              max_logprobs=config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        """The engine of an `engine.engine_args.EngineArgs`."""
        return cls(engine_args.create_engine_config())

    # The core's state, for callers that look inside (tests, benchmarks, the server's metrics).
    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        return self.engine_core.sampling_defaults

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def block_manager(self):
        return self.engine_core.block_manager

    @property
    def executor(self):
        return self.engine_core.executor

    @property
    def model_runner(self):
        return self.engine_core.executor.model_runner

    @property
    def cache_engine(self):
        return self.engine_core.executor.cache_engine

    @property
    def requests(self):
        return self.engine_core.requests

    @property
    def beam_candidates(self):
        return self.engine_core.beam_candidates

    @property
    def spec_decode_stats(self):
        return self.engine_core.spec_decode_stats

    @property
    def detokenizer(self):
        return self.output_processor.detokenizer

    def _guided_decoding(self):
        return self.engine_core._guided_decoding()

    @property
    def async_grammar_compile(self) -> bool:
        return self.engine_core.async_grammar_compile

    @async_grammar_compile.setter
    def async_grammar_compile(self, value: bool) -> None:
        self.engine_core.async_grammar_compile = value

    def shutdown(self) -> None:
        """Stop the executor's worker processes (tensor parallelism); the engine runs no more steps after it."""
        self.engine_core.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """A fresh SamplingParams with the model's defaults (`sampling_defaults`) over vLLM's."""
        return SamplingParams(**self.sampling_defaults)

    # -- requests --------------------------------------------------------------------------------------------
    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text, token ids): see InputProcessor.process_prompt."""
        return self.input_processor.process_prompt(prompt, truncate_prompt_tokens)

    def bad_words_token_ids(self, bad_words: list[str], tokenizer=None) -> list[list[int]]:
        """params.bad_words as token ids (vLLM's rule): see InputProcessor.bad_words_token_ids."""
        return self.input_processor.bad_words_token_ids(bad_words, tokenizer)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    *, arrival_time: float | None = None,
                    bad_words_token_ids: list[list[int]] | None = None, lora_request=None) -> None:
        """Queue a request. Everything is checked first: a bad request raises ValueError and leaves the engine
        (and the requests already in it) untouched. bad_words_token_ids: params.bad_words already tokenized
        (a server does it off the step loop), else they are tokenized here. lora_request: the LoRA adapter it
        runs with (engine.LoRARequest; None: the base model), loaded and checked now."""
        params = self.default_sampling_params() if params is None else params
        self.add_processed_request(self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time,
                                                                bad_words_token_ids=bad_words_token_ids,
                                                                lora_request=lora_request))

    def add_processed_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the input processor made (a server makes it on a tokenizer thread): ValueError, and
        nothing queued, when the core refuses it."""
        self.engine_core.add_request(request)
        self.output_processor.add_request(request.request_id, request.prompt, request.prompt_token_ids,
                                          request.params)

    def add_beam_request(self, request_id: str, prompt, params: BeamSearchParams, *, lora_request=None) -> None:
        """Queue a beam-search request (see engine/core/beam_search.py); its final RequestOutput holds the finished
        beams, best first, as completions (cumulative_logprob: the beam's sum of logprobs)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        request = self.input_processor.process(request_id, prompt, SamplingParams(temperature=0.0),
                                               lora_request=lora_request)
        self.engine_core.add_beam_request(request, params)
        self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids, request.params,
                                          beam=True)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish_reason "abort"), or None for an unknown id."""
        core_output = self.engine_core.abort_request(request_id)
        if core_output is None:
            self.output_processor.abort_request(request_id)
            return None
        outputs = self.output_processor.process_outputs([core_output]).request_outputs
        return outputs[0] if outputs else None

    def fail_all_requests(self, error: BaseException) -> list[RequestOutput]:
        """Abort every request in the engine after a step raised (their state is unknown): their final outputs,
        each carrying the error, for their streams."""
        return self.output_processor.process_outputs(self.engine_core.fail_all_requests(error)).request_outputs

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (see EngineCore.reset_prefix_cache)."""
        return self.engine_core.reset_prefix_cache()

    # -- LoRA adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) --------------------------------
    def add_lora(self, lora_request) -> bool:
        """Load an adapter now (requests on it later find it loaded); ValueError for a bad one. Returns whether it
        was read from disk."""
        self.input_processor.check_lora_request(lora_request)
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (requests still on it load it again); returns whether it was loaded."""
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (the host cache)."""
        return self.engine_core.list_loras()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    def get_metrics(self) -> EngineMetrics:
        """Counts of requests per state, KV-cache usage, prefix-cache hit rate and running totals."""
        return self.engine_core.get_metrics()

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that produced a token (finished or not; a
        FINAL_ONLY request only when it finishes). A step that raises fails only its own requests (see
        EngineCore._fail_step)."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        for request_id, indices in processed.stops:   # stop strings ended these: no more tokens for them
            self.engine_core.stop_sequences(request_id, indices)
        for request_id in processed.failed:   # their output failed here: the core stops them too
            self.engine_core.abort_request(request_id)
        return processed.request_outputs
