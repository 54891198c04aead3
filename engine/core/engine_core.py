"""The engine core (vLLM V1's EngineCore): requests in as token ids, a step = schedule -> execute -> update,
token-id deltas out. Nothing else: tokenization and validation happen before it (engine/core/input_processor.py),
text, stop strings and RequestOutputs after it (engine/core/output_processor.py). In-process it sits inside
`LLMEngine`; under `serve` it runs alone in a process of its own (engine/core/core_process.py).

A step that raises (model forward, block moves, sampler, grammar, a bug) fails only the requests it was working
on: they finish with finish_reason "error" and an error message, their blocks are freed, and the core keeps
serving the others (see EngineCore._fail_step).

Async scheduling (vLLM's `async_scheduling`; on by default on CUDA): steps are launched one ahead of their
outputs. `step()` schedules and launches step N+1 while step N runs on the device, and only then waits for step N's
sampled ids (copied to the host on the side, one step late) and turns them into outputs, so the host's work of one
step (outputs, scheduling, the next step's inputs) hides under the device's work of the other. The scheduler's
placeholders (engine/core/scheduler.py) let it schedule a sequence whose token is still on the device; the worker
feeds that token to the next forward from the device (engine/worker/model_runner.py). Outputs are the same as
without it; a request that finishes (a stop token, a stop string, an abort) may have had one more step computed,
whose tokens are dropped. Without async scheduling the pipeline is one step deep: launch, wait, output.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from engine.config import EngineConfig
from engine.core.beam_search import BeamSearchParams, BeamSearchState
from engine.core.block_manager import BlockManager
from engine.step_records import CompletionDelta, EngineCoreOutput, EngineCoreRequest, LogprobEntry
from engine.core.generation_config import load_sampling_defaults
from engine.core.input_processor import check_prompt_token_ids
from engine.core.scheduler import ScheduledStep, Scheduler
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.executor import WorkerDiedError
from engine.executor.executor import launched_rank, make_executor, run_launched_worker
from engine.outputs import EngineMetrics, SpecDecodeStats
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.step_records import ModelRunnerOutput, PromptLogprobs

logger = logging.getLogger("engine")

# Guided decoding limits: the spec's size (a JSON schema's text, a regex, a grammar, all choices together), and
# how long its compilation may take when it runs off the step loop (async_grammar_compile).
MAX_GRAMMAR_SPEC_CHARS = 65536
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class EngineCore:
    """The scheduler, the executor and the step loop of an EngineConfig.

    tokenizer: the engine's, for guided decoding's grammars (which are compiled against the vocabulary); None:
    loaded when the first guided request comes (a core process has none of its own otherwise)."""

    def __init__(self, config: EngineConfig, *, tokenizer=None):
        self.config = config
        self.model_config = config.model_config
        model_dir = self.model_config.model_dir
        self._tokenizer = tokenizer
        generation_config = config.generation_config
        # Request fields a request leaves unset take these (the model's generation_config.json, like vLLM's
        # --generation-config auto); a server merges request fields over this dict.
        self.sampling_defaults: dict = load_sampling_defaults(generation_config, model_dir,
                                                              config.override_generation_config)
        try:   # a bad value in the file fails here, not in every request
            SamplingParams(**self.sampling_defaults)
        except ValueError as e:
            raise ValueError(f"generation_config: the model's sampling defaults {self.sampling_defaults} are "
                             f"invalid: {e}") from e
        if self.sampling_defaults:
            logger.info("default sampling parameters from %s's generation_config.json%s: %s",
                        model_dir if generation_config == "auto" else generation_config,
                        " and override_generation_config" if config.override_generation_config else "",
                        self.sampling_defaults)
        self.max_model_len = self.model_config.max_model_len
        tensor_parallel_size = config.parallel_config.tensor_parallel_size
        rank = launched_rank(tensor_parallel_size) if tensor_parallel_size > 1 else None
        if rank:   # torchrun rank > 0: this process is a worker of rank 0's engine, then it is done
            run_launched_worker(rank, tensor_parallel_size, config)
            raise SystemExit(0)
        self.executor = make_executor(config)
        self.shut_down = False   # shutdown(): no requests and no steps after it
        block_size = config.cache_config.block_size
        try:
            self._fit_max_model_len_to_cache(block_size, user_max_model_len=self._user_max_model_len())
        except BaseException:   # a refused engine leaves no worker process or process group behind
            self.executor.shutdown()
            raise
        self.block_manager = BlockManager(self.executor.num_kv_blocks, block_size,
                                          enable_prefix_caching=config.cache_config.enable_prefix_caching,
                                          num_swap_blocks=self.executor.num_swap_blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.scheduler_config.max_num_seqs,
                                   max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                                   preemption_mode=config.scheduler_config.preemption_mode,
                                   max_num_seqs_per_request=config.scheduler_config.max_num_seqs_per_request,
                                   max_loras=config.lora_config.max_loras if config.lora_config is not None else None)
        # Steps launched and not yet turned into outputs, oldest first: at most `pipeline_depth` after a launch
        # (2 with async scheduling: the one running and the one just launched; 1 without).
        self.pipeline_depth = 2 if config.scheduler_config.async_scheduling else 1
        self._in_flight: deque[_InFlightStep] = deque()
        self.requests: dict[str, SequenceGroup] = {}
        self.num_generation_tokens = 0
        self.spec_decode_stats = SpecDecodeStats(config.speculative_config.num_speculative_tokens
                                                 if config.speculative_config is not None else 0)
        # seq_id -> (token ids, logprobs) of a beam's best next tokens, waiting for its group's step.
        self.beam_candidates: dict[int, tuple[list[int], list[float]]] = {}
        self.guided_decoding = None   # engine/core/guided_decoding.py GuidedDecoding, built for the first guided request
        # Serving cores compile grammars on a thread of their own: such a request waits (not scheduled) in
        # _pending_grammars until its grammar is ready, and the steps of the others go on meanwhile. Offline
        # (LLM) requests compile in add_request, where a bad spec is a ValueError.
        self.async_grammar_compile = False
        self.grammar_compile_timeout_s = GRAMMAR_COMPILE_TIMEOUT_S
        self._grammar_pool = None
        # request_id -> (its sequence, the compile future, the deadline (time.monotonic())).
        self._pending_grammars: dict[str, tuple[Sequence, object, float]] = {}
        # Requests a step's output processing touched beyond its own (beams advanced): failed with it if it raises.
        self._step_groups: dict[str, SequenceGroup] = {}
        # LoRA adapters checked (loaded once on every rank): lora_int_id -> LoRARequest.
        self._known_loras: dict = {}

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
                             f"{cache_tokens} tokens ({self.executor.num_kv_blocks} blocks of {block_size}); "
                             f"lower max_model_len or give the cache more blocks (num_kv_blocks / "
                             f"gpu_memory_utilization)")
        logger.warning("the KV cache holds %d tokens, less than the model's max_model_len=%d: max_model_len "
                       "is capped to %d", cache_tokens, self.max_model_len, cache_tokens)
        self.max_model_len = self.model_config.max_model_len = cache_tokens

    def shutdown(self) -> None:
        """Stop the executor's worker processes (tensor parallelism) and release the model and its caches; the
        core takes no more requests and runs no more steps after it."""
        self.shut_down = True
        self.executor.shutdown()
        if self._grammar_pool is not None:   # its thread ends once a compile in flight, if any, is done
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            self._grammar_pool = None

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (from the input processor). What only the core can check is checked first: a refused
        request raises ValueError and leaves the core (and the requests already in it) untouched."""
        request_id, params = request.request_id, request.params
        if self.shut_down:
            raise RuntimeError("the engine is shut down: it takes no more requests")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.scheduler.max_num_seqs}, got {params.n}")
        check_prompt_token_ids(request.prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        if request.lora_request is not None:
            self._check_request_lora(request.lora_request)
        seq = Sequence(request_id, request.prompt, request.prompt_token_ids, params,
                       arrival_time=request.arrival_time, eos_token_ids=self.model_config.eos_token_ids,
                       max_model_len=self.max_model_len, lora_request=request.lora_request)
        if params.bad_words:
            seq.bad_words_token_ids = request.bad_words_token_ids
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

    def add_beam_request(self, request: EngineCoreRequest, params: BeamSearchParams) -> None:
        """Queue a beam-search request (see engine/core/beam_search.py): its one output, when it finishes, holds
        the finished beams, best first (cumulative_logprob: the beam's sum of logprobs). request.params is
        ignored: each beam runs greedy-free, the beam state deciding its tokens and when it stops."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.scheduler.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} is more than max_num_seqs={self.scheduler.max_num_seqs}")
        request.params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        self.add_request(request)
        group = self.requests[request.request_id]
        seq = group.seqs[0]
        bs = self.block_manager.block_size
        needed = (seq.num_prompt_tokens // bs + params.beam_width
                  * (self.block_manager.num_blocks_for(seq.num_prompt_tokens % bs + params.max_tokens) + 1))
        if needed > self.block_manager.num_blocks:
            self.abort_request(request.request_id)
            raise ValueError(f"beam request {request.request_id!r} may need {needed} KV-cache blocks but the cache "
                             f"has only {self.block_manager.num_blocks}")
        group.beam = BeamSearchState(params, seq.num_prompt_tokens, self.model_config.eos_token_ids)

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------------------------
    def _check_lora_enabled(self, what: str) -> None:
        if self.config.lora_config is None:
            raise ValueError(f"{what}: this engine was started without LoRA (enable_lora=True, serve --enable-lora)")

    def _check_request_lora(self, lora_request) -> None:
        """A request's adapter, before the request is queued. One the core has not seen is loaded into the
        workers' host caches now (add_lora): a bad one is a ValueError naming lora_request, the request refused
        alone. One seen before is taken as it is, with no call to the workers: a step that needs it loads it again
        if the host cache let it go (and fails its requests alone should it no longer load)."""
        known = self._known_loras.get(getattr(lora_request, "lora_int_id", None))
        if known is None or (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            self.add_lora(lora_request)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (with a warning) while requests hold KV blocks (vLLM's behaviour)."""
        if self.block_manager.reset_prefix_cache():
            return True
        logger.warning("the prefix cache was not reset: %d KV blocks are held by unfinished requests",
                       self.block_manager.num_blocks - self.block_manager.num_free_blocks)
        return False

    def add_lora(self, lora_request) -> bool:
        """Load an adapter into the workers' host caches now; returns whether it was read from disk. ValueError
        naming lora_request for a bad adapter, or for an id that names another adapter the core knows (requests
        on that one may still be running: its slots must not change weights under them)."""
        self._check_lora_enabled("lora_request")
        from engine.lora import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self._known_loras.get(lora_request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} already names adapter "
                             f"{known.lora_name!r} ({known.lora_path}); {lora_request.lora_name!r} needs another id "
                             f"(or remove_lora the other first)")
        try:
            loaded = self.executor.add_lora(lora_request)
        except ValueError as error:
            raise ValueError(f"lora_request: {error}") from error
        self._known_loras[lora_request.lora_int_id] = lora_request
        return loaded

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the host caches and device slots; returns whether it was loaded. Requests still
        running on it read it again when they are next scheduled (vLLM's remove_lora); a request on it after
        this is checked again."""
        self._check_lora_enabled("remove_lora")
        self._known_loras.pop(lora_int_id, None)
        return self.executor.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded in the host cache."""
        self._check_lora_enabled("list_loras")
        return set(self.executor.list_loras())

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

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar compiled; fail the ones whose grammar did not (a bad spec) or took
        longer than grammar_compile_timeout_s (both the request's fault: the output's error_param names
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

    def _guided_decoding(self):
        if self.guided_decoding is None:
            from engine.core.guided_decoding import GuidedDecoding   # imports xgrammar: only for guided requests
            try:
                import xgrammar  # noqa: F401
            except ImportError as e:
                raise ValueError(f"guided_decoding needs the xgrammar package (pip install xgrammar): {e}") from e
            if self._tokenizer is None:
                from engine.tokenizer import get_tokenizer
                self._tokenizer = get_tokenizer(self.config.tokenizer or self.model_config.model_dir)
            self.guided_decoding = GuidedDecoding(self._tokenizer, self.model_config.vocab_size,
                                                  self.model_config.eos_token_ids)
        return self.guided_decoding

    def fail_all_requests(self, error: BaseException) -> list[EngineCoreOutput]:
        """Abort every request in the core after a step raised (their state is unknown): their final outputs,
        each carrying the error, for their streams."""
        outputs = []
        for request_id in list(self.requests):
            output = self.abort_request(request_id)
            if output is not None:
                output.error = f"the engine step failed: {type(error).__name__}: {error}"
                outputs.append(output)
        return outputs

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
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

    def stop_sequences(self, request_id: str, indices) -> EngineCoreOutput | None:
        """Finish completions `indices` of a request with finish_reason "stop" (the output processor found a stop
        string in their text). Returns the request's final output when that finished it, else None; an unknown
        request or an already finished completion is left as it is."""
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
        """Whether step() has work: requests to schedule, grammars compiling, or steps in flight to finish."""
        return self.scheduler.has_unfinished() or bool(self._pending_grammars) or bool(self._in_flight)

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
    def step(self) -> list[EngineCoreOutput]:
        """One iteration: schedule and launch a step, then finish the oldest step in flight (the one just launched
        without async scheduling, the one before it with). Returns an output for every request that produced
        tokens (finished or not). A step that raises fails only the requests it was working on (_fail_step)."""
        outputs = []
        if self._pending_grammars:
            if not self.scheduler.has_unfinished() and not self._in_flight:
                self._wait_for_grammars(0.05)
            outputs += self._admit_compiled_grammars()
        launched = False
        if self.scheduler.has_unfinished():
            step = self.scheduler.schedule(self._grammar_bitmask if self.guided_decoding is not None else None)
            if step.scheduled:
                outputs += self._launch(step)
                launched = True
            elif not self._in_flight:   # beams swapped back in may still be waiting for their group's step
                outputs += self._advance_beams()
        # After a launch, finish the steps beyond the pipeline's depth; with nothing launched, finish them all
        # (what they bring may be what the next schedule waits for).
        while self._in_flight and (len(self._in_flight) > self.pipeline_depth - 1 or not launched):
            outputs += self._finish(self._in_flight.popleft())
        return outputs

    def has_steps_in_flight(self) -> bool:
        return bool(self._in_flight)

    def _launch(self, step: ScheduledStep) -> list[EngineCoreOutput]:
        """Issue the step's block moves and its forward and sampling on the executor (with async scheduling the
        device runs it while this returns). A failure fails the step's requests (and returns their outputs)."""
        flight = _InFlightStep(step, {seq.request_id: seq.group for seq, _ in step.scheduled})
        self.scheduler.commit(step)
        try:
            flight.moving_blocks = True
            self._move_blocks(step.block_moves)
            flight.moving_blocks = False
            flight.result = self.executor.execute_model(step.output)
        except WorkerDiedError:
            raise   # not one failed step: the model is gone, the core cannot go on
        except Exception as error:
            return self._fail_step(flight, error)
        self._in_flight.append(flight)
        return []

    def _finish(self, flight: "_InFlightStep") -> list[EngineCoreOutput]:
        """The step's output (waiting for its sampled ids) -> update_from_output -> the requests' outputs."""
        step = flight.step
        self._step_groups = flight.groups
        try:
            runner_output = flight.result
            if not isinstance(runner_output, ModelRunnerOutput):
                runner_output = runner_output.get_output()   # the sampled ids, read one step late
            by_id = {seq.seq_id: seq for seq, _ in step.scheduled} \
                if runner_output.prompt_logprobs or runner_output.failed else {}
            for seq_id, prompt_logprobs in runner_output.prompt_logprobs.items():
                self._append_prompt_logprobs(by_id[seq_id], prompt_logprobs)
            # Only now is the KV of the scheduled tokens known written: a failure before this line registers none
            # of their blocks in the prefix cache (a failed step's blocks are then freed unregistered).
            sampling = self.scheduler.update_from_output(step, runner_output.num_accepted_tokens,
                                                         failed=runner_output.failed)
            failed = self._fail_seqs(by_id, runner_output.failed)
            return failed + self._update_requests(sampling, runner_output) + self._advance_beams()
        except WorkerDiedError:
            raise
        except Exception as error:
            return self._fail_step(flight, error)
        finally:
            self._step_groups = {}

    def _fail_seqs(self, by_id: dict[int, Sequence], errors: dict[int, str]) -> list[EngineCoreOutput]:
        """Fail the requests of the sequences whose own sampling failed in the worker (ModelRunnerOutput.failed):
        the rest of the step goes on as if they had not been in it."""
        outputs = []
        for seq_id, message in errors.items():
            group = by_id[seq_id].group
            if group.request_id in self.requests:
                # An adapter that no longer loads (its directory changed since the request came in): the request's
                # own field at fault, as when add_request refuses it.
                lora = message.startswith("lora_request:")
                if lora:
                    group.error_param = "lora_request"
                self._fail_group(group, message if lora else f"sampling failed: {message}")
                outputs.append(self._make_output(group))
        return outputs

    def _fail_group(self, group: SequenceGroup, message: str, *, log: bool = True) -> None:
        """End one request now with finish_reason "error" and the error message, freeing its blocks."""
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

    def _fail_step(self, flight: "_InFlightStep", error: Exception) -> list[EngineCoreOutput]:
        """Fail the requests the step was working on: log the traceback, finish each of their sequences with
        finish_reason "error" (freeing every block), and return their final outputs with `error` set. When the
        failure hit the block moves, the requests whose blocks those moves were writing fail too (their KV
        is unknown). The prefix cache stays sound: blocks are registered only after a forward completed
        (update_from_output), and freed blocks keep only such registrations."""
        failed = {request_id: group for request_id, group in {**flight.groups, **self._step_groups}.items()
                  if request_id in self.requests}
        # The workers may not have seen this step's diff: tell them again what finished before it.
        self.scheduler.finished_seq_ids += flight.step.output.finished_seq_ids
        if flight.moving_blocks:
            failed.update(self._groups_written_by(flight.step.block_moves))
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

    def _advance_beams(self) -> list[EngineCoreOutput]:
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

    @staticmethod
    def _make_beam_output(group: SequenceGroup) -> EngineCoreOutput:
        first = group.seqs[0]
        completions = [CompletionDelta(index=i, token_ids=ids, logprobs=None, cumulative_logprob=cum_logprob,
                                       finish_reason=reason)
                       for i, (_, cum_logprob, ids, reason) in enumerate(group.beam.finished)]
        return EngineCoreOutput(request_id=group.request_id, completions=completions, finished=True,
                                num_cached_tokens=first.num_cached_tokens, metrics=first.metrics, beam=True)

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

    def _update_requests(self, sampling: list[Sequence], runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """For each sequence that reached its end this step: append what it emitted (one sampled token, or under
        speculation the accepted drafts and one more), apply the token-level stop conditions (stop token, length),
        keep the drafts proposed for its next step, release finished requests. Beams keep their candidates for
        their group's step; a max_tokens=0 request finishes ("length"). Stop strings are the output processor's."""
        now = time.time()
        groups: dict[str, SequenceGroup] = {}
        positions: dict[str, int] = {}   # request -> most tokens appended to one of its sequences
        finished = SequenceStatus.FINISHED
        for seq in sampling:
            if seq.status is finished:   # failed this step (_fail_seqs), or with its request
                continue
            try:
                self._update_seq(seq, runner_output, groups, positions, now)
            except Exception as error:   # this request's own failure (its grammar)
                logger.exception("processing the output of request %r failed", seq.request_id)
                groups[seq.request_id] = seq.group
                self._fail_group(seq.group, f"{type(error).__name__}: {error}")
        outputs = []
        for request_id, group in groups.items():
            # One token position per step for all of a request's sequences (several under speculation).
            metrics = group.seqs[0].metrics
            metrics.num_output_tokens += positions.get(request_id, 0)
            if group.is_finished:
                self.requests.pop(request_id, None)
                metrics.finished_time = now
                outputs.append(self._make_output(group))
            elif self._emits_every_step(group):
                outputs.append(self._make_output(group))
        return outputs

    @staticmethod
    def _emits_every_step(group: SequenceGroup) -> bool:
        """Whether a running request that gained tokens this step sends its output now: when it streams (DELTA or
        CUMULATIVE), has stop strings (the output processor looks for them in each step's text), is a beam search
        or failed; a FINAL_ONLY request (LLM.generate's) otherwise waits for its end, whose output carries every
        token since (_make_output sends what was not sent). At 256 running requests, building and processing the
        outputs nobody reads was a fifth of the host's step (the H200 profile of 2026-11-28)."""
        params = group.seqs[0].params
        return (params.output_kind is not RequestOutputKind.FINAL_ONLY or bool(params.stop)
                or group.error is not None or group.beam is not None)

    def _update_seq(self, seq: Sequence, runner_output: ModelRunnerOutput, groups: dict[str, SequenceGroup],
                    positions: dict[str, int], now: float) -> None:
        """_update_requests for one sequence."""
        if seq.group.beam is not None:
            self.beam_candidates[seq.seq_id] = runner_output.beam_candidates[seq.seq_id]
            return
        groups[seq.request_id] = seq.group
        if seq.max_tokens == 0:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            return
        seq_id = seq.seq_id
        tokens = runner_output.sampled_token_ids[seq_id]
        logprobs = runner_output.logprobs.get(seq_id) if runner_output.logprobs else None
        num_drafts = len(seq.spec_token_ids)
        if num_drafts:
            self.spec_decode_stats.record(num_drafts, len(tokens) - 1)
        guided = seq.guided
        if guided is None and logprobs is None and len(tokens) == 1:   # most steps: one token, nothing else to do
            token_id = tokens[0]
            seq.output_token_ids.append(token_id)
            seq.token_ids.append(token_id)
            self._check_stop(seq, token_id)
            appended = 1
        else:
            appended = self._append_tokens(seq, tokens, guided, logprobs)
        if appended:
            self.num_generation_tokens += appended
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if positions.get(seq.request_id, 0) < appended:
                positions[seq.request_id] = appended
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            return
        if num_drafts:
            # The accepted drafts are tokens now: their blocks can be registered; rejected ones' blocks go.
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.trim(seq)
        drafts = runner_output.spec_token_ids.get(seq_id) if runner_output.spec_token_ids else None
        if drafts or num_drafts:
            seq.spec_token_ids = self._next_drafts(seq, drafts)

    def _append_tokens(self, seq: Sequence, tokens: list[int], guided, logprobs) -> int:
        """_update_seq's tokens one by one, each checked by the grammar, with its logprobs, until one stops the
        sequence. Returns how many were appended."""
        if guided is not None and guided.error is not None:
            raise RuntimeError(f"guided decoding: {guided.error}")
        appended = 0
        for j, token_id in enumerate(tokens):
            if guided is not None and not guided.accept(token_id):
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
            if logprobs is not None:
                self._append_logprobs(seq, token_id, logprobs, j)
            self._check_stop(seq, token_id)
            if seq.finish_reason is None and guided is not None and guided.is_terminated:
                seq.finish_reason = "stop"   # the grammar is complete: nothing more may follow
            if seq.finish_reason is not None:
                break
        return appended

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
        for j, (tid, lp, rank, ids, lps) in enumerate(zip(computed.token_ids, computed.logprobs, computed.ranks,
                                                          computed.topk_token_ids, computed.topk_logprobs)):
            seq.prompt_logprobs[computed.start + j] = _logprob_entry(tid, lp, rank, ids, lps)

    def _append_logprobs(self, seq: Sequence, token_id: int, logprobs, j: int) -> None:
        """The logprobs of `seq`'s j-th token this step (`logprobs`: the worker's SampleLogprobs)."""
        seq.logprobs.append(_logprob_entry(token_id, logprobs.logprobs[j], logprobs.ranks[j],
                                           logprobs.topk_token_ids[j], logprobs.topk_logprobs[j]))
        seq.cumulative_logprob += logprobs.logprobs[j]

    @staticmethod
    def _check_stop(seq: Sequence, token_id: int) -> None:
        """Set finish_reason/stop_reason after `token_id` was appended: a stop token (EOS or stop_token_ids, once
        min_tokens are out), then the length limit (max_tokens or max_model_len). Stop strings are found on the
        text, behind the core (engine/core/output_processor.py), which then calls stop_sequences."""
        if token_id in seq.stop_token_ids and seq.num_output_tokens >= seq.params.min_tokens:
            seq.finish_reason = "stop"
            seq.stop_reason = token_id if token_id in seq.params.stop_token_ids else None   # None: EOS
            return
        if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
            seq.finish_reason = "length"

    @staticmethod
    def _make_output(group: SequenceGroup) -> EngineCoreOutput:
        """The request's delta since its last output (tokens and logprobs each sequence gained)."""
        completions = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            start = seq.num_output_tokens_sent
            seq.num_output_tokens_sent = seq.num_output_tokens
            completions.append(CompletionDelta(
                index=seq.index, token_ids=seq.output_token_ids[start:],
                logprobs=None if seq.logprobs is None else seq.logprobs[start:],
                cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason))
        first = group.seqs[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = first.prompt_logprobs, True
        return EngineCoreOutput(request_id=group.request_id, completions=completions, finished=group.is_finished,
                                num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
                                prompt_logprobs=prompt_logprobs, error=group.error,
                                error_param=group.error_param)


def _logprob_entry(token_id: int, logprob: float, rank: int, topk_ids: list[int],
                   topk_logprobs: list[float]) -> LogprobEntry:
    """One position's logprobs: its own token first, then the top-k (1-based ranks) not already listed."""
    entry = [(token_id, logprob, rank)]
    seen = {token_id}
    for r, (other, other_lp) in enumerate(zip(topk_ids, topk_logprobs), start=1):
        if other not in seen:
            seen.add(other)
            entry.append((other, other_lp, r))
    return entry


class _InFlightStep:
    """A launched step: its decisions, the requests it works on, and the executor's result (a ModelRunnerOutput,
    or with async scheduling one whose get_output() waits for the sampled ids)."""

    __slots__ = ("step", "groups", "result", "moving_blocks")

    def __init__(self, step: ScheduledStep, groups: dict[str, SequenceGroup]):
        self.step = step
        self.groups = groups
        self.result = None
        self.moving_blocks = False   # issuing its block moves (a failure there spoils their targets)
