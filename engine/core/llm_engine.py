"""The engine loop: requests in; a step = schedule -> run the model -> sample -> process outputs; outputs out.

A step that raises (model forward, block moves, sampler, grammar, detokenizer, a bug) fails only the requests
it was working on: they finish with finish_reason "error" and RequestOutput.error, their blocks are freed, and
the engine keeps serving the others (see LLMEngine._fail_step).
"""
import logging
import os
import time

import torch

from engine.core.beam_search import BeamSearchParams, BeamSearchState
from engine.core.block_manager import BlockManager
from engine.executor import WorkerDiedError
from engine.executor.executor import launched_rank, make_executor, run_launched_worker
from engine.config import EngineConfig
from engine.core.detokenizer import Detokenizer, check_stop_strings
from engine.core.generation_config import load_sampling_defaults
from engine.platform import DevicePolicy
from engine.outputs import CompletionOutput, EngineMetrics, Logprob, RequestOutput, SpecDecodeStats
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.core.scheduler import ScheduledStep, Scheduler
from engine.step_records import ModelRunnerOutput, PromptLogprobs
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.gguf_file import is_gguf_path
from engine.tokenizer import get_tokenizer

logger = logging.getLogger("engine")

# The most logprobs (and prompt_logprobs) a request may ask for: vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# Guided decoding limits: the spec's size (a JSON schema's text, a regex, a grammar, all choices together), and
# how long its compilation may take when it runs off the step loop (async_grammar_compile).
MAX_GRAMMAR_SPEC_CHARS = 65536
GRAMMAR_COMPILE_TIMEOUT_S = 10.0



def resolve_model_path(model: str) -> str:
    """`model` if it is a local directory or GGUF file, else a Hugging Face hub id downloaded with
    huggingface_hub."""
    if os.path.isdir(model) or is_gguf_path(model):
        return model
    if isinstance(model, str) and model.endswith(".gguf"):
        raise ValueError(f"GGUF file {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:   # offline, unknown repo, invalid id: all mean "no such model here"
        raise ValueError(f"model {model!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face hub ({type(e).__name__}: {e})") from e


def _no_text(token_id: int) -> None:
    """Logprob.decoded_token where the front end decodes it (LLMEngine.detokenize False)."""
    return None


class LLMEngine:
    """The engine of an EngineConfig (built and validated by `EngineArgs.create_engine_config()`; `engine.LLM`
    wraps this class and takes the same options as keyword arguments)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device
        self.device_policy = DevicePolicy.for_device(self.device)
        self.model_config = config.model_config
        model_dir = self.model_config.model_dir
        generation_config = config.generation_config
        # Request fields a request leaves unset take these (the model's generation_config.json, like vLLM's
        # --generation-config auto); a server merges request fields over this dict.
        self.sampling_defaults: dict = load_sampling_defaults(generation_config, model_dir)
        try:   # a bad value in the file fails here, not in every request
            SamplingParams(**self.sampling_defaults)
        except ValueError as e:
            raise ValueError(f"generation_config: the model's sampling defaults {self.sampling_defaults} are "
                             f"invalid: {e}") from e
        if self.sampling_defaults:
            logger.info("default sampling parameters from %s's generation_config.json: %s",
                        model_dir if generation_config == "auto" else generation_config, self.sampling_defaults)
        # skip_tokenizer_init: token ids in and out, no text (see _tokenize, _check_needs_no_tokenizer).
        self.tokenizer = None if config.skip_tokenizer_init else get_tokenizer(config.tokenizer or model_dir)
        self.max_model_len = self.model_config.max_model_len
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        tensor_parallel_size = config.parallel_config.tensor_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        rank = launched_rank(tensor_parallel_size) if tensor_parallel_size > 1 else None
        if rank:   # torchrun rank > 0: this process is a worker of rank 0's engine, then it is done
            run_launched_worker(rank, tensor_parallel_size, config)
            raise SystemExit(0)
        self.executor = make_executor(config)
        block_size = config.cache_config.block_size
        try:
            # Rank 0's runner and swap space (this process's share of the model).
            self.model_runner, self.cache_engine = self.executor.model_runner, self.executor.cache_engine
            self._fit_max_model_len_to_cache(block_size, user_max_model_len=self._user_max_model_len())
        except BaseException:   # a refused engine leaves no worker process or process group behind
            self.executor.shutdown()
            raise
        self.block_manager = BlockManager(self.executor.num_kv_blocks, block_size,
                                          enable_prefix_caching=config.cache_config.enable_prefix_caching,
                                          num_swap_blocks=self.executor.num_swap_blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.scheduler_config.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   preemption_mode=config.scheduler_config.preemption_mode,
                                   max_num_seqs_per_request=config.scheduler_config.max_num_seqs_per_request)
        self.detokenizer = Detokenizer(self.tokenizer)
        # False in the engine core of `serve` (engine/core/engine_core.py): its API server processes detokenize,
        # find stop strings and decode logprob tokens (engine/mp_engine.py), so the step loop here checks stop
        # tokens and lengths only, leaves output_text empty, and finishes a completion when told (stop_sequences).
        self.detokenize = True
        self.requests: dict[str, SequenceGroup] = {}
        self.num_generation_tokens = 0
        self.spec_decode_stats = SpecDecodeStats(config.speculative_config.num_speculative_tokens
                                                 if config.speculative_config is not None else 0)
        # seq_id -> (token ids, logprobs) of a beam's best next tokens, waiting for its group's step.
        self.beam_candidates: dict[int, tuple[list[int], list[float]]] = {}
        self.guided_decoding = None   # engine/core/guided_decoding.py GuidedDecoding, built for the first guided request
        # Serving engines compile grammars on a thread of their own: such a request waits (not scheduled) in
        # _pending_grammars until its grammar is ready, and the steps of the others go on meanwhile. Offline
        # (LLM) requests compile in add_request, where a bad spec is a ValueError.
        self.async_grammar_compile = False
        self.grammar_compile_timeout_s = GRAMMAR_COMPILE_TIMEOUT_S
        self._grammar_pool = None
        # request_id -> (its sequence, the compile future, the deadline (time.monotonic())).
        self._pending_grammars: dict[str, tuple[Sequence, object, float]] = {}
        # The requests the current step works on (request_id -> group): the ones failed if the step raises.
        self._step_groups: dict[str, SequenceGroup] = {}
        self._moving_blocks = False   # the step is issuing block moves (a failure there spoils their targets)
        self._step_block_moves: list[tuple[str, list[tuple[int, int]]]] = []
        self._step_finished_seq_ids: list[int] = []

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        """The engine of an `engine.engine_args.EngineArgs`."""
        return cls(engine_args.create_engine_config())

    def _user_max_model_len(self) -> int | None:
        """max_model_len if the user set it (then a cache that cannot hold it is an error), else None."""
        return self.model_config.max_model_len if self.model_config.max_model_len_set_by_user else None

    def _fit_max_model_len_to_cache(self, block_size: int, *, user_max_model_len: int | None) -> None:
        """A sequence of max_model_len tokens must fit in the KV cache alone. When it does not, cap
        max_model_len to what the cache holds (with a warning), or refuse to start if the user asked for that
        max_model_len (as vLLM does)."""
        cache_tokens = self.executor.num_kv_blocks * block_size
        if cache_tokens >= self.max_model_len:
            return
        if user_max_model_len is not None:
            raise ValueError(f"max_model_len={user_max_model_len} does not fit in the KV cache, which holds "
                             f"{cache_tokens} tokens ({self.model_runner.num_kv_blocks} blocks of {block_size}); "
                             f"lower max_model_len or give the cache more blocks (num_kv_blocks / "
                             f"gpu_memory_utilization)")
        logger.warning("the KV cache holds %d tokens, less than the model's max_model_len=%d: max_model_len "
                       "is capped to %d", cache_tokens, self.max_model_len, cache_tokens)
        self.max_model_len = self.model_config.max_model_len = cache_tokens

    def shutdown(self) -> None:
        """Stop the executor's worker processes (tensor parallelism); the engine runs no more steps after it."""
        self.executor.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """A fresh SamplingParams with the model's defaults (`sampling_defaults`) over vLLM's."""
        return SamplingParams(**self.sampling_defaults)

    # -- requests --------------------------------------------------------------------------------------------
    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Validate a prompt (str, {"prompt": str} or {"prompt_token_ids": [...]}, optionally with "prompt"
        as its text) and return (text, token ids). With truncate_prompt_tokens=k only the last k tokens are
        kept (before the length check; the text is then theirs). Raises ValueError on bad input."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or not prompt:
                raise ValueError(f"a prompt dict has the keys 'prompt' and/or 'prompt_token_ids', got {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
                if isinstance(token_ids, torch.Tensor):
                    token_ids = token_ids.tolist()
                if not isinstance(token_ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                    raise ValueError(f"prompt_token_ids must be a list of int, got {token_ids!r:.100}")
                token_ids = list(token_ids)
            else:
                text, token_ids = self._tokenize(prompt["prompt"])
        else:
            text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        if truncate_prompt_tokens is not None and len(token_ids) > truncate_prompt_tokens:
            token_ids = token_ids[-truncate_prompt_tokens:]
            text = None if text is None or self.tokenizer is None else \
                self.detokenizer.decode(token_ids, skip_special_tokens=False)
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        return text, token_ids

    def _tokenize(self, text) -> tuple[str, list[int]]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str or a dict with 'prompt_token_ids', got {type(text).__name__}")
        if not text:
            raise ValueError("prompt is empty")
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs the tokenizer, and this engine has none "
                             "(skip_tokenizer_init=True); give {'prompt_token_ids': [...]}")
        return text, self.tokenizer.encode(text)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    *, arrival_time: float | None = None,
                    bad_words_token_ids: list[list[int]] | None = None) -> None:
        """Queue a request. Everything is checked first: a bad request raises ValueError and leaves the engine
        (and the requests already in it) untouched. bad_words_token_ids: params.bad_words already tokenized
        (bad_words_token_ids(); a server does it off the step loop), else they are tokenized here."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.scheduler.max_num_seqs}, got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(MAX_LOGPROBS, self.model_config.vocab_size):
                raise ValueError(f"{name} must be <= {min(MAX_LOGPROBS, self.model_config.vocab_size)}, got {value}")
        self._check_token_ids(params)
        self._check_needs_no_tokenizer(params)
        text, token_ids = self.process_prompt(prompt, params.truncate_prompt_tokens)
        seq = Sequence(request_id, text, token_ids, params, arrival_time=arrival_time or time.time(),
                       eos_token_ids=self.model_config.eos_token_ids, max_model_len=self.max_model_len)
        if params.bad_words:
            if bad_words_token_ids is None:
                bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
            vocab_size = self.model_config.vocab_size
            if not all(0 <= t < vocab_size for ids in bad_words_token_ids for t in ids):
                raise ValueError(f"bad_words has a token id outside the vocabulary [0, {vocab_size})")
            seq.bad_words_token_ids = bad_words_token_ids
        pending_grammar = None
        if params.guided_decoding is not None:
            guided = self._guided_decoding()
            self._check_grammar_size(params.guided_decoding)
            compiled = guided.cached(params.guided_decoding)
            if compiled is not None or not self.async_grammar_compile:
                seq.guided = guided.new_state(params.guided_decoding, compiled)   # ValueError on a bad spec
            else:
                pending_grammar = self._compile_grammar_async(params.guided_decoding)
        # The longest this request can get must fit in the whole cache, or it could never run alone: its
        # prompt blocks once, plus for each of its n sequences the blocks of its output and a copied last block.
        max_computed = seq.num_prompt_tokens + (seq.max_tokens if seq.max_tokens is not None
                                                else self.max_model_len) - 1
        needed_blocks = self.block_manager.num_blocks_for(min(max_computed, self.max_model_len))
        if params.n > 1:
            num_output_blocks = needed_blocks - seq.num_prompt_tokens // self.block_manager.block_size
            needed_blocks += (params.n - 1) * (num_output_blocks + 1) + 1
        if needed_blocks > self.block_manager.num_blocks:
            raise ValueError(f"max_tokens: request {request_id!r} may need {needed_blocks} KV-cache blocks but the "
                             f"cache has only {self.block_manager.num_blocks}; lower max_tokens or raise num_kv_blocks")
        self.requests[request_id] = seq.group
        if pending_grammar is not None:
            self._pending_grammars[request_id] = (seq, pending_grammar,
                                                  time.monotonic() + self.grammar_compile_timeout_s)
        else:
            self.scheduler.add(seq)

    @staticmethod
    def _check_grammar_size(spec) -> None:
        from engine.core.guided_decoding import grammar_key

        size = len(grammar_key(spec)[1])
        if size > MAX_GRAMMAR_SPEC_CHARS:
            raise ValueError(f"guided_decoding {spec.kind} has {size} characters; this engine compiles at most "
                             f"{MAX_GRAMMAR_SPEC_CHARS}")

    def _compile_grammar_async(self, spec):
        if self._grammar_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            # xgrammar releases the GIL while compiling: the step loop runs on meanwhile.
            self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-grammar")
        return self._grammar_pool.submit(self.guided_decoding.compile, spec)

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled; fail the ones whose grammar did not (a bad spec) or took
        longer than grammar_compile_timeout_s (both the request's fault: RequestOutput.error_param names
        guided_decoding)."""
        outputs = []
        now = time.monotonic()
        for request_id, (seq, future, deadline) in list(self._pending_grammars.items()):
            if not future.done() and now < deadline:
                continue
            del self._pending_grammars[request_id]
            if future.done() and future.exception() is None:
                seq.guided = self.guided_decoding.new_state(seq.params.guided_decoding, future.result())
                self.scheduler.add(seq)
                continue
            if future.done():
                message = str(future.exception())
            else:
                future.cancel()   # a compile already running finishes on its thread; its result is dropped
                message = (f"guided_decoding: the grammar did not compile within "
                           f"{self.grammar_compile_timeout_s:g} s")
            self._fail_group(seq.group, message, log=False)
            output = self._make_output(seq.group)
            output.error_param = "guided_decoding"
            outputs.append(output)
        return outputs

    def _wait_for_grammars(self, timeout_s: float) -> None:
        """Block up to timeout_s for a pending grammar (when nothing else can run: no busy loop)."""
        from concurrent.futures import FIRST_COMPLETED, wait
        futures = [future for _, future, _ in self._pending_grammars.values()]
        if futures:
            deadline = min(deadline for _, _, deadline in self._pending_grammars.values())
            wait(futures, timeout=max(0.0, min(timeout_s, deadline - time.monotonic())),
                 return_when=FIRST_COMPLETED)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(params, name)
            bad = [t for t in (ids or ()) if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    def _check_needs_no_tokenizer(self, params: SamplingParams) -> None:
        """Without a tokenizer (skip_tokenizer_init) the options that work on text are refused up front."""
        if self.tokenizer is not None:
            return
        for name in ("stop", "bad_words", "guided_decoding"):
            if getattr(params, name):
                raise ValueError(f"{name} needs the tokenizer, and this engine has none (skip_tokenizer_init=True)")

    def bad_words_token_ids(self, bad_words: list[str], tokenizer=None) -> list[list[int]]:
        """vLLM's rule: each word's tokens, and those of " " + word when that is a different first token of
        the same length (the word in the middle of a text). tokenizer: a copy of the engine's (a thread's own)."""
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        vocab_size = self.model_config.vocab_size
        token_ids = []
        for word in bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced and plain and spaced[0] != plain[0] \
                    and len(spaced) == len(plain) else (plain,):
                if ids and all(t < vocab_size for t in ids):
                    token_ids.append(ids)
        return token_ids

    def _guided_decoding(self):
        if self.guided_decoding is None:
            from engine.core.guided_decoding import GuidedDecoding   # imports xgrammar: only for guided requests
            try:
                import xgrammar  # noqa: F401
            except ImportError as e:
                raise ValueError(f"guided_decoding needs the xgrammar package (pip install xgrammar): {e}") from e
            self.guided_decoding = GuidedDecoding(self.tokenizer, self.model_config.vocab_size,
                                                  self.model_config.eos_token_ids)
        return self.guided_decoding

    def add_beam_request(self, request_id: str, prompt, params: BeamSearchParams) -> None:
        """Queue a beam-search request (see engine/core/beam_search.py); its final RequestOutput holds the finished
        beams, best first, as completions (cumulative_logprob: the beam's sum of logprobs)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.scheduler.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} is more than max_num_seqs={self.scheduler.max_num_seqs}")
        # Each beam runs greedy-free: the beam state decides tokens and stopping, so the sequence itself never stops.
        seq_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        self.add_request(request_id, prompt, seq_params)
        group = self.requests[request_id]
        seq = group.seqs[0]
        bs = self.block_manager.block_size
        needed = (seq.num_prompt_tokens // bs + params.beam_width
                  * (self.block_manager.num_blocks_for(seq.num_prompt_tokens % bs + params.max_tokens) + 1))
        if needed > self.block_manager.num_blocks:
            self.abort_request(request_id)
            raise ValueError(f"beam request {request_id!r} may need {needed} KV-cache blocks but the cache has only "
                             f"{self.block_manager.num_blocks}")
        group.beam = BeamSearchState(params, seq.num_prompt_tokens, self.model_config.eos_token_ids)

    def fail_all_requests(self, error: BaseException) -> list[RequestOutput]:
        """Abort every request in the engine after a step raised (their state is unknown): their final outputs,
        each carrying the error, for their streams."""
        outputs = []
        for request_id in list(self.requests):
            output = self.abort_request(request_id)
            if output is not None:
                output.error = f"the engine step failed: {type(error).__name__}: {error}"
                outputs.append(output)
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its final output (finish_reason "abort"), or None for an unknown id."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return None
        pending = self._pending_grammars.pop(request_id, None)
        if pending is not None:   # never queued: nothing to free
            pending[1].cancel()
            for seq in group.seqs:
                seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
        for seq in group.seqs:
            self.beam_candidates.pop(seq.seq_id, None)
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        group.seqs[0].metrics.finished_time = time.time()
        return self._make_output(group)

    def stop_sequences(self, request_id: str, indices) -> RequestOutput | None:
        """Finish completions `indices` of a request with finish_reason "stop" (a front end that detokenizes found
        a stop string in their text). Returns the request's final output when that finished it, else None; an
        unknown request or an already finished completion is left as it is."""
        group = self.requests.get(request_id)
        if group is None or group.beam is not None:
            return None
        indices = set(indices)
        for seq in group.seqs:
            if seq.index in indices and not seq.is_finished:
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
        if not group.is_finished:
            return None
        del self.requests[request_id]
        group.seqs[0].metrics.finished_time = time.time()
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_grammars)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_metrics(self) -> EngineMetrics:
        """Counts of requests per state, KV-cache usage, prefix-cache hit rate and running totals."""
        sched, bm = self.scheduler, self.block_manager
        num_prompt_tokens = sched.num_prompt_tokens
        return EngineMetrics(
            num_running=len({s.request_id for s in sched.running}),
            num_waiting=len({s.request_id for s in sched.waiting}),
            num_swapped=len(getattr(sched, "swapped", ())),
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            prefix_cache_hit_rate=sched.num_cached_prompt_tokens / num_prompt_tokens if num_prompt_tokens else 0.0,
            num_preemptions=sched.num_preemptions,
            num_generation_tokens=self.num_generation_tokens,
            num_prompt_tokens=num_prompt_tokens,
            spec_decode=self.spec_decode_stats if self.config.speculative_config is not None else None)

    # -- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that produced a token (finished or not).
        If anything after scheduling raises, the requests of this step fail alone (see _fail_step)."""
        if self._pending_grammars:
            if not self.scheduler.has_unfinished():
                self._wait_for_grammars(0.05)
            failed = self._admit_compiled_grammars()
            if failed or not self.scheduler.has_unfinished():
                return failed   # the others step next time
        step = self.scheduler.schedule(self._grammar_bitmask if self.guided_decoding is not None else None)
        self._step_groups = {seq.request_id: seq.group for seq, _ in step.scheduled}
        self._step_block_moves = step.block_moves
        self._step_finished_seq_ids = step.output.finished_seq_ids
        self._moving_blocks = False
        try:
            return self._run_step(step)
        except WorkerDiedError:
            raise   # not one failed step: the model is gone, the engine cannot go on
        except Exception as error:
            return self._fail_step(error)
        finally:
            self._step_groups = {}

    def _run_step(self, step: ScheduledStep) -> list[RequestOutput]:
        """schedule (done) -> block moves and the step on the executor (forward and sampling in the worker) ->
        update_from_output -> process outputs."""
        if not step.scheduled:   # beams swapped back in may still be waiting for their group's step
            return self._advance_beams()
        self._moving_blocks = True
        self._move_blocks(step.block_moves)
        self._moving_blocks = False
        runner_output = self.executor.execute_model(step.output)
        by_id = {seq.seq_id: seq for seq, _ in step.scheduled}
        for seq_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            self._append_prompt_logprobs(by_id[seq_id], prompt_logprobs)
        # Only now is the KV of the scheduled tokens written: a failure before this line registers none of
        # their blocks in the prefix cache (a failed step's blocks are then freed unregistered).
        sampling = self.scheduler.update_from_output(step, runner_output.num_accepted_tokens)
        failed = self._fail_seqs(by_id, runner_output.failed)
        return failed + self._process_outputs(sampling, runner_output) + self._advance_beams()

    def _fail_seqs(self, by_id: dict[int, Sequence], errors: dict[int, str]) -> list[RequestOutput]:
        """Fail the requests of the sequences whose own sampling failed in the worker (ModelRunnerOutput.failed):
        the rest of the step goes on as if they had not been in it."""
        outputs = []
        for seq_id, message in errors.items():
            group = by_id[seq_id].group
            if group.request_id in self.requests:
                self._fail_group(group, f"sampling failed: {message}")
                outputs.append(self._make_output(group))
        return outputs

    def _fail_group(self, group: SequenceGroup, message: str, *, log: bool = True) -> None:
        """End one request now with finish_reason "error" and RequestOutput.error = message, freeing its blocks."""
        if log:
            logger.error("failing request %r: %s", group.request_id, message)
        group.error = message
        for seq in group.seqs:
            self.beam_candidates.pop(seq.seq_id, None)
            if not seq.is_finished:
                seq.finish_reason, seq.stop_reason = "error", None
                try:
                    self.scheduler.finish(seq)
                except Exception:   # keep failing the others; this sequence's state was already broken
                    logger.exception("could not free the blocks of failed request %r", group.request_id)
                    seq.status = SequenceStatus.FINISHED
        self.requests.pop(group.request_id, None)
        group.seqs[0].metrics.finished_time = time.time()

    def _grammar_bitmask(self, seqs: list[Sequence]):
        """The guided-decoding bitmask of `seqs` (the scheduler's callback while it writes the step)."""
        from engine.core.guided_decoding import fill_bitmask
        return fill_bitmask([seq.guided for seq in seqs], self.model_config.vocab_size)

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """Fail the requests the step was working on: log the traceback, finish each of their sequences with
        finish_reason "error" (freeing every block), and return their final outputs with `error` set. When the
        failure hit the block moves, the requests whose blocks those moves were writing fail too (their KV
        is unknown). The prefix cache stays sound: blocks are registered only after a forward completed
        (update_from_output), and freed blocks keep only such registrations."""
        failed = dict(self._step_groups)
        # The workers may not have seen this step's diff: tell them again what finished before it.
        self.scheduler.finished_seq_ids += self._step_finished_seq_ids
        if self._moving_blocks:
            failed.update(self._groups_written_by(self._step_block_moves))
        logger.error("engine step failed; failing its %d request(s): %s", len(failed),
                     ", ".join(failed) or "none", exc_info=error)
        message = f"internal error in engine step: {type(error).__name__}: {error}"
        now = time.time()
        outputs = []
        for request_id, group in failed.items():
            for seq in group.seqs:
                seq.finish_reason = "error" if seq.is_finished else seq.finish_reason
            self._fail_group(group, message, log=False)
            group.seqs[0].metrics.finished_time = now
            outputs.append(self._make_output(group))
        return outputs

    def _groups_written_by(self, moves: list[tuple[str, list[tuple[int, int]]]]) -> dict[str, SequenceGroup]:
        """The requests holding a destination block of `moves` (cache blocks of copies and swap-ins, swap-space
        blocks of swap-outs)."""
        cache_dsts = {dst for kind, pairs in moves if kind != "swap_out" for _, dst in pairs}
        swap_dsts = {dst for kind, pairs in moves if kind == "swap_out" for _, dst in pairs}
        groups = {}
        for request_id, group in self.requests.items():
            for seq in group.seqs:
                dsts = swap_dsts if seq.status is SequenceStatus.SWAPPED else cache_dsts
                if not seq.is_finished and dsts.intersection(seq.block_table):
                    groups[request_id] = group
        return groups

    def _advance_beams(self) -> list[RequestOutput]:
        """Move every beam-search request whose live beams all have their next-token logprobs one step on:
        continue, fork (blocks shared) or free beams as BeamSearchState chose; return the finished ones."""
        outputs = []
        for group in [g for g in self.requests.values() if g.beam is not None]:
            beams = group.unfinished_seqs
            if not all(s.status is SequenceStatus.RUNNING and s.seq_id in self.beam_candidates for s in beams):
                continue
            self._step_groups[group.request_id] = group
            state = group.beam
            chosen = state.step([s.output_token_ids for s in beams], [self.beam_candidates.pop(s.seq_id) for s in beams])
            now = time.time()
            metrics = group.seqs[0].metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_output_tokens += 1
            self.num_generation_tokens += len(chosen)
            if state.done:
                for seq in beams:
                    seq.finish_reason = "length"
                    self.scheduler.finish(seq)
                del self.requests[group.request_id]
                metrics.finished_time = now
                outputs.append(self._make_beam_output(group))
                continue
            # Forks first (they copy the parent's tokens before the parent takes its own next token).
            used: set[int] = set()
            next_beams = []
            for parent_pos, token_id in chosen:
                parent = beams[parent_pos]
                if parent_pos in used:
                    child = self.scheduler.fork(parent, state.next_index)
                    state.next_index += 1
                else:
                    used.add(parent_pos)
                    child = parent
                next_beams.append((child, token_id))
            for pos, seq in enumerate(beams):
                if pos not in used:
                    self.scheduler.finish(seq)
            for seq, token_id in next_beams:
                seq.append_token(token_id)
            group.seqs = [seq for seq, _ in next_beams]
        return outputs

    def _make_beam_output(self, group: SequenceGroup) -> RequestOutput:
        first = group.seqs[0]
        decode = (lambda ids, **_: "") if self.tokenizer is None else self.tokenizer.decode
        completions = [CompletionOutput(index=i, text=decode(ids, skip_special_tokens=True),
                                        token_ids=ids, cumulative_logprob=cum_logprob, logprobs=None,
                                        finish_reason=reason)
                       for i, (_, cum_logprob, ids, reason) in enumerate(group.beam.finished)]
        return RequestOutput(request_id=group.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             outputs=completions, finished=True, num_cached_tokens=first.num_cached_tokens,
                             metrics=first.metrics)

    def _move_blocks(self, block_moves: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """Issue this step's block moves, in the order the scheduler decided them: swap-outs, swap-ins and
        copy-on-write copies (one call per kind in the usual case)."""
        for kind, pairs in block_moves:
            if kind == "copy":
                self.executor.copy_blocks(pairs)
            elif kind == "swap_out":
                self.executor.swap_out(pairs)
            else:
                self.executor.swap_in(pairs)

    def _process_outputs(self, sampling: list[Sequence], runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """For each sequence that reached its end this step: append what it emitted (one sampled token, or under
        speculation the accepted drafts and one more), detokenize, apply the stop conditions (the first one met
        ends the sequence there), keep the drafts proposed for its next step, release finished requests.
        Beams keep their candidates for their group's step; a max_tokens=0 request finishes ("length")."""
        now = time.time()
        groups: dict[str, SequenceGroup] = {}
        positions: dict[str, int] = {}   # request -> most tokens appended to one of its sequences
        for seq in sampling:
            if seq.is_finished:   # failed this step (_fail_seqs), or with its request
                continue
            try:
                self._process_seq_output(seq, runner_output, groups, positions, now)
            except Exception as error:   # this request's own failure (its grammar, its detokenization)
                logger.exception("processing the output of request %r failed", seq.request_id)
                groups[seq.request_id] = seq.group
                self._fail_group(seq.group, f"{type(error).__name__}: {error}")
        for request_id, group in groups.items():
            # One token position per step for all of a request's sequences (several under speculation).
            group.seqs[0].metrics.num_output_tokens += positions.get(request_id, 0)
            if group.is_finished:
                self.requests.pop(request_id, None)
                group.seqs[0].metrics.finished_time = now
        # FINAL_ONLY requests (offline generation) get their one output when they finish.
        return [self._make_output(group) for group in groups.values()
                if group.is_finished or group.seqs[0].params.output_kind is not RequestOutputKind.FINAL_ONLY]

    def _process_seq_output(self, seq: Sequence, runner_output: ModelRunnerOutput,
                            groups: dict[str, SequenceGroup], positions: dict[str, int], now: float) -> None:
        """_process_outputs for one sequence."""
        if seq.group.beam is not None:
            self.beam_candidates[seq.seq_id] = runner_output.beam_candidates[seq.seq_id]
            return
        groups[seq.request_id] = seq.group
        if seq.max_tokens == 0:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            return
        tokens = runner_output.sampled_token_ids[seq.seq_id]
        logprobs = runner_output.logprobs.get(seq.seq_id)
        num_drafts = len(seq.spec_token_ids)
        if num_drafts:
            self.spec_decode_stats.record(num_drafts, len(tokens) - 1)
        if seq.guided is not None and seq.guided.error is not None:
            raise RuntimeError(f"guided decoding: {seq.guided.error}")
        appended = 0
        for j, token_id in enumerate(tokens):
            if seq.guided is not None and not seq.guided.accept(token_id):
                # Only the sampler's last-resort fallback can pick a token the grammar forbids (see sampler.py),
                # and only when the grammar allows no token at all: it dead-ends here. The request's grammar is
                # at fault (a client error naming guided_decoding), not the engine.
                seq.finish_reason = "error"
                seq.group.error = (f"guided_decoding: the grammar admits no token after {seq.num_output_tokens} "
                                   f"generated token(s) and is not complete (it dead-ends)")
                seq.group.error_param = "guided_decoding"
                break
            seq.append_token(token_id)
            appended += 1
            self.num_generation_tokens += 1
            if logprobs is not None:
                self._append_logprobs(seq, token_id, logprobs, j)
            self._check_stop(seq, token_id)
            if seq.finish_reason is None and seq.guided is not None and seq.guided.is_terminated:
                seq.finish_reason = "stop"   # the grammar is complete: nothing more may follow
            if seq.finish_reason is not None:
                break
        if appended:
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            seq.metrics.last_token_time = now
            positions[seq.request_id] = max(positions.get(seq.request_id, 0), appended)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            return
        if num_drafts:
            # The accepted drafts are tokens now: their blocks can be registered; rejected ones' blocks go.
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.trim(seq)
        seq.spec_token_ids = self._next_drafts(seq, runner_output.spec_token_ids.get(seq.seq_id))

    def _next_drafts(self, seq: Sequence, drafts: list[int] | None) -> list[int]:
        """The drafts `seq` verifies next step: what the worker proposed, cut so that every token they could
        become stays within max_tokens and max_model_len; none for a guided sequence (its grammar would have to
        accept them before they are verified)."""
        if not drafts or seq.guided is not None:
            return []
        room = self.max_model_len - seq.num_tokens
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def _append_prompt_logprobs(self, seq: Sequence, computed: PromptLogprobs) -> None:
        """Prompt logprobs the worker computed for positions computed.start.. of `seq`."""
        decode = self.detokenizer.decode_token if self.detokenize else _no_text
        for j, (tid, lp, rank, ids, lps) in enumerate(zip(computed.token_ids, computed.logprobs, computed.ranks,
                                                          computed.topk_token_ids, computed.topk_logprobs)):
            entry = {tid: Logprob(lp, rank, decode(tid))}
            for r, (other, other_lp) in enumerate(zip(ids, lps), start=1):
                if other not in entry:
                    entry[other] = Logprob(other_lp, r, decode(other))
            seq.prompt_logprobs[computed.start + j] = entry

    def _append_logprobs(self, seq: Sequence, token_id: int, logprobs, j: int) -> None:
        """The logprobs of `seq`'s j-th token this step (`logprobs`: the worker's SampleLogprobs)."""
        decode = self.detokenizer.decode_token if self.detokenize else _no_text
        entry = {token_id: Logprob(logprobs.logprobs[j], logprobs.ranks[j], decode(token_id))}
        for rank, (tid, lp) in enumerate(zip(logprobs.topk_token_ids[j], logprobs.topk_logprobs[j]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, decode(tid))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprobs.logprobs[j]

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        """Set finish_reason/stop_reason after `token_id` was appended, and extend the output text.
        Order: stop token (EOS or stop_token_ids; its text is left out unless include_stop_str_in_output),
        stop string in the new text, then the length limit (max_tokens or max_model_len). Without `detokenize`
        there is no text here: the front end does the text and the stop strings (OutputAccumulator)."""
        params = seq.params
        if token_id in seq.stop_token_ids and seq.num_output_tokens >= params.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token_id if token_id in params.stop_token_ids else None   # None: EOS
            if params.include_stop_str_in_output and self.detokenize:
                self.detokenizer.update(seq)
            return
        if self.detokenize:
            num_new_chars = self.detokenizer.update(seq)
            if seq.num_output_tokens >= params.min_tokens:
                stop_str = check_stop_strings(seq, num_new_chars)
                if stop_str is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    return
        if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = "length"

    @staticmethod
    def _make_output(group: SequenceGroup) -> RequestOutput:
        completions = [CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            for seq in sorted(group.seqs, key=lambda s: s.index)]
        first = group.seqs[0]
        return RequestOutput(request_id=group.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             outputs=completions, finished=group.is_finished,
                             num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
                             prompt_logprobs=first.prompt_logprobs, error=group.error,
                             error_param=group.error_param)
