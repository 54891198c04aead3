"""The user API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""
import contextlib
import gc
import itertools
import threading
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from engine.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.engine_args import EngineArgs
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


_freeze_lock = threading.Lock()
_freeze_depth = 0
_froze = False


@contextlib.contextmanager
def _heap_frozen():
    """The objects alive when a run starts (the model's modules, the tokenizer, the caller's own) kept out of the
    garbage collector's reach until it ends: a full collection walks every tracked object, and one that the run's
    own allocations set off cost 184 ms in the middle of a 12 s batch (SmolLM2, 48 requests, 2-core EPYC). vLLM
    freezes its engine core's heap once after start-up; this unfreezes at the end instead, because the engine's
    modules sit in reference cycles and a dropped LLM's weights must stay collectable. A heap someone else froze
    is left as it is; nested and concurrent runs freeze once."""
    global _freeze_depth, _froze
    with _freeze_lock:
        if _freeze_depth == 0:
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _freeze_depth += 1
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_depth -= 1
            if _freeze_depth == 0 and _froze:
                gc.unfreeze()
                _froze = False


class LLM:
    """An offline LLM on the paged-KV engine.

    Args:
        model: a local Hugging Face model directory, a GGUF file (``x.gguf``: config and tokenizer from its
            metadata, Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights kept quantized; README "GGUF models"), or a hub id
            (downloaded with huggingface_hub).
        tokenizer: a different tokenizer directory or hub id (default: the model's; a GGUF's own).
        dtype: "auto" (the checkpoint's, except on CPU: bf16 checkpoints in bf16 where the CPU has AMX-BF16 or
            AVX512-BF16, else float32; fp16 and quantized ones in float32), or a torch dtype / name.
        device: "auto" (CUDA when available, else CPU), "cpu" or "cuda[:N]".
        block_size: tokens per KV-cache block.
        max_model_len: longest prompt + output (default: the model's max_position_embeddings).
        max_num_seqs: most sequences in one step.
        max_num_seqs_per_request: most sequences of one request (n > 1) in a step while other requests run or
            wait, the rest taking turns (default: no limit).
        max_num_batched_tokens: token budget of one step (default 8192 on GPUs, 1024 on CPU: chunked prefill
            is always on, so it need not hold a whole prompt; engine/platform.py says why).
        num_kv_blocks: KV-cache size in blocks; overrides the memory-derived size.
        gpu_memory_utilization: share of GPU memory the engine may use (CUDA only).
        kv_cache_dtype: "auto" stores the KV cache in the model's dtype; "fp8" (or "fp8_e4m3", vLLM's names) in
            float8 e4m3, twice the blocks of a 16-bit cache (four times float32's) in the same memory. Each layer
            writes e4m3(k / k_scale), e4m3(v / v_scale) and the attention kernels de-quantize in registers; the
            scales come from the checkpoint (`*.self_attn.k_scale` / `v_scale`, compressed-tensors'
            `k_proj.output_scale` / `v_proj.output_scale`), else 1.0.
        enable_prefix_caching: reuse the KV of full blocks shared with earlier prompts.
        enforce_eager: decode eagerly: no CUDA graphs on GPUs, no CPU graphs on CPUs (and no torch.compile).
        seed: seeds the sampler of unseeded requests (seeded requests use their own generator).
        swap_space: GiB of CPU memory (pinned where CUDA exists) for KV blocks of requests preempted by swapping;
            allocated only with preemption_mode="swap".
        preemption_mode: when KV blocks run out, "recompute" frees a preempted request's blocks and recomputes
            them on resumption; "swap" moves them to the swap space and back (recompute when it is full).
        generation_config: sampling defaults for requests without SamplingParams: "auto" (the model's
            generation_config.json), "vllm" (SamplingParams' own defaults) or a directory holding one.
        tensor_parallel_size: shard the model over this many processes (Megatron-style tensor parallelism on
            torch.distributed: one GPU each, or a share of the CPU cores); this process is rank 0.
        load_format: "auto" reads the model's safetensors; "dummy" (vLLM's name) gives it random weights instead
            (engine/worker/loader.py), so a directory holding only config.json runs: for benchmarks of a shape.
        skip_tokenizer_init: load no tokenizer (vLLM's name). Prompts must then be {"prompt_token_ids": [...]},
            outputs carry token ids and empty text, and whatever needs the tokenizer (text prompts, chat, stop
            strings, bad_words, guided decoding, stream_text) raises ValueError.
        speculative_config: speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": n, "prompt_lookup_min": m} proposes from the sequence's own earlier tokens;
            {"model": DRAFT_DIR, "num_speculative_tokens": k} from a small draft model with the same tokenizer.
            The target verifies the k drafts in one forward; the output distribution is the target's exactly.
        quantization: the linear layers' quantization method (vLLM's name): None follows config.json's
            quantization_config (GPTQ, AWQ, fp8, compressed-tensors fp8 checkpoints load as published); "fp8" on
            a float checkpoint quantizes its linear weights to fp8 on load. README "Quantized models".
        async_scheduling: schedule step N+1 while step N runs, the sampled ids reaching the host one step late
            (vLLM's name; engine/core/engine_core.py). None: on with CUDA unless speculative decoding is on, off
            on CPU. Outputs are the same either way.
        enable_lora: serve PEFT LoRA adapters on the base model, one per request (``generate(...,
            lora_request=LoRARequest(name, int_id, path))``), many in one batch. max_loras: most distinct adapters
            in one step (device slots; requests on others wait their turn). max_lora_rank: largest adapter rank
            (smaller ones are padded to it in the slots). max_cpu_loras: adapters kept loaded in host memory
            (default max_loras); both caches evict the least recently used. engine/lora.
        trust_remote_code, disable_log_stats, enable_chunked_prefill: vLLM's, accepted so that vLLM scripts run;
            nothing here runs remote code, logs periodic stats, or turns chunked prefill off (a warning says so).
        enable_expert_parallel: MoE models under tensor parallelism: each rank holds a share of the experts whole
            (vLLM's name) instead of a slice of every expert's intermediate size.
        pipeline_parallel_size, data_parallel_size: vLLM's; only 1 for now (more is a ValueError saying so).
        max_logprobs: the most logprobs / prompt_logprobs a request may ask for (default 20; -1: the whole
            vocabulary).
        revision, tokenizer_revision, download_dir: a hub model's (and hub tokenizer's) branch, tag or commit, and
            where it downloads to (vLLM's names; a local directory ignores them).
        hf_overrides: config.json keys and values set over the model's (vLLM's name).
        override_generation_config: generation_config.json keys over the model's sampling defaults (vLLM's name).

    The options are `engine.engine_args.EngineArgs` (shared with `python -m engine` and the server).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_seqs_per_request: int | None = None,
                 max_num_batched_tokens: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, seed: int = 0, swap_space: float = 4,
                 preemption_mode: str = "recompute", generation_config: str = "auto",
                 tensor_parallel_size: int = 1, load_format: str = "auto", skip_tokenizer_init: bool = False,
                 speculative_config: dict | None = None, quantization: str | None = None,
                 async_scheduling: bool | None = None, enable_lora: bool = False, max_loras: int = 1,
                 max_lora_rank: int = 16, max_cpu_loras: int | None = None, trust_remote_code: bool = False,
                 disable_log_stats: bool = False, enable_chunked_prefill: bool | None = None,
                 enable_expert_parallel: bool = False, pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                 max_logprobs: int = 20, revision: str | None = None, tokenizer_revision: str | None = None,
                 download_dir: str | None = None, override_generation_config: dict | None = None,
                 hf_overrides: dict | None = None):
        self.llm_engine = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, block_size=block_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_seqs_per_request=max_num_seqs_per_request,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, seed=seed,
            swap_space=swap_space, preemption_mode=preemption_mode,
            generation_config=generation_config, tensor_parallel_size=tensor_parallel_size, load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init, speculative_config=speculative_config,
            quantization=quantization, async_scheduling=async_scheduling, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            trust_remote_code=trust_remote_code, disable_log_stats=disable_log_stats,
            enable_chunked_prefill=enable_chunked_prefill, enable_expert_parallel=enable_expert_parallel,
            pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
            max_logprobs=max_logprobs, revision=revision, tokenizer_revision=tokenizer_revision,
            download_dir=download_dir, override_generation_config=override_generation_config,
            hf_overrides=hf_overrides).create_engine()
        self.request_counter = itertools.count()

    def get_tokenizer(self):
        """The engine's tokenizer (None with skip_tokenizer_init)."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without any gets (vLLM's ``LLM.get_default_sampling_params``): the model's
        generation_config.json fields (temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens as
        max_tokens) over SamplingParams' own defaults, or just those with ``generation_config="vllm"``. A fresh
        object each call, to change before passing it to ``generate``."""
        default = getattr(self.llm_engine, "default_sampling_params", None)
        return default() if default is not None else SamplingParams()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (vLLM's ``LLM.reset_prefix_cache``), e.g. between a benchmark's rounds
        over the same prompts, so each round computes its prompts' KV. Returns False, and keeps the cache, while
        requests are unfinished (a ``generate`` interrupted by an exception leaves them)."""
        return self.llm_engine.reset_prefix_cache()

    def _require_tokenizer(self, what: str):
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(f"{what} needs the tokenizer, and this LLM has none (skip_tokenizer_init=True)")
        return tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of `prompts`.

        prompts: a str, a {"prompt_token_ids": [...]} dict, or a list of those. sampling_params: one for all
        prompts or one per prompt (default SamplingParams()). lora_request: the LoRA adapter of every prompt (an
        `engine.lora.LoRARequest`), or one per prompt (None: the base model); needs enable_lora. Every prompt is
        validated (its adapter loaded and checked) before any runs, so a bad one raises ValueError without
        running the others."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")
        if sampling_params is None:   # the model's defaults (generation_config.json), as vLLM
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        lora_requests = self._lora_requests(lora_request, len(prompts))
        engine = self.llm_engine
        inputs = []
        for prompt, params in zip(prompts, params_list):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
            text, token_ids = engine.process_prompt(prompt, params.truncate_prompt_tokens)
            inputs.append({"prompt": text, "prompt_token_ids": token_ids})
        request_ids = [str(next(self.request_counter)) for _ in inputs]
        try:
            for request_id, prompt, params, lora in zip(request_ids, inputs, params_list, lora_requests):
                # Only the final output is read: the engine builds no output for a request before it finishes.
                engine.add_request(request_id, prompt, params.final_only(), lora_request=lora)
            finished = self._run_engine(len(inputs), use_tqdm)
        except BaseException:
            for request_id in request_ids:   # leave no half-run request behind (e.g. on KeyboardInterrupt)
                engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in request_ids]

    @staticmethod
    def _lora_requests(lora_request, num_prompts: int) -> list:
        """generate()'s lora_request as one entry per prompt (None, one for all, or a list of them)."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
            return list(lora_request)
        return [lora_request] * num_prompts

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool = False,
                    lora_request=None) -> list[BeamSearchOutput]:
        """Beam search for each prompt (see engine/core/beam_search.py for the rule, transformers' beam search with
        its `early_stopping` setting); returns per prompt the finished beams, best first. Beams share KV blocks.
        lora_request: as for generate()."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        inputs = []
        for prompt in prompts:
            text, token_ids = engine.process_prompt(prompt)
            inputs.append({"prompt": text, "prompt_token_ids": token_ids})
        lora_requests = self._lora_requests(lora_request, len(inputs))
        request_ids = [str(next(self.request_counter)) for _ in inputs]
        try:
            for request_id, prompt, lora in zip(request_ids, inputs, lora_requests):
                engine.add_beam_request(request_id, prompt, params, lora_request=lora)
            finished = self._run_engine(len(inputs), use_tqdm)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        results, tokenizer = [], self.get_tokenizer()
        for request_id, prompt in zip(request_ids, inputs):
            out = finished[request_id]
            prompt_ids = prompt["prompt_token_ids"]
            sequences = []
            for c in out.outputs:
                tokens = prompt_ids + c.token_ids
                sequences.append(BeamSearchSequence(
                    tokens=tokens, cum_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                    text=tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else "",
                    finish_reason=c.finish_reason))
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to a list of them,
        through the tokenizer's chat template (or `chat_template`). lora_request: as for generate(), per
        conversation."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self._require_tokenizer("chat")
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            # The template already wrote every special token it wants: do not add a BOS again.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream_text(self, prompt, sampling_params: SamplingParams | None = None, *,
                    chat: bool = False) -> Iterator[str]:
        """Generate one completion and yield its text as it grows (the pieces join to the final text).
        prompt: as for generate(), or with chat=True a conversation (list of messages). The last
        len(longest stop string) - 1 characters are held back until the request ends, since a stop string
        that completes is cut from the text."""
        engine = self.llm_engine
        self._require_tokenizer("stream_text (it streams text)")
        if chat:
            tokenizer = self.get_tokenizer()
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError("the tokenizer has no chat template")
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if sampling_params.n != 1:
            raise ValueError(f"n must be 1 to stream, got {sampling_params.n}")
        text, token_ids = engine.process_prompt(prompt)
        request_id = str(next(self.request_counter))
        engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, sampling_params)
        holdback = max(sampling_params.max_stop_str_len - 1, 0)
        num_sent, finished = 0, False
        try:
            while not finished and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    finished = output.finished
                    error = getattr(output, "error", None)
                    if error:
                        raise RuntimeError(f"request failed: {error}")
                    current = output.outputs[0].text
                    end = len(current) if finished else max(len(current) - holdback, num_sent)
                    if end > num_sent:
                        yield current[num_sent:end]
                        num_sent = end
        finally:
            if not finished:
                engine.abort_request(request_id)

    def _run_engine(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        with _heap_frozen():
            return self._run_steps(num_requests, use_tqdm)

    def _run_steps(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start = time.perf_counter()
        num_input_tokens = num_output_tokens = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    num_input_tokens += len(output.prompt_token_ids)
                    num_output_tokens += len(output.outputs[0].token_ids)
                    if use_tqdm:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.postfix = (f"est. speed input: {num_input_tokens / elapsed:.2f} toks/s, "
                                       f"output: {num_output_tokens / elapsed:.2f} toks/s")
                        bar.update(1)
        bar.close()
        return finished
