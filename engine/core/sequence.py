"""One request's state as it moves through the engine."""
import enum
import itertools

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()   # KV in the CPU swap space: block_table holds swap-space block ids
    FINISHED = enum.auto()


# Seed stream of sequence `index` of a seeded request: index 0 uses the seed itself (so n=1 is unchanged),
# the others an odd-constant (golden ratio) step away, so the n streams differ and do not overlap by accident.
_SEED_STREAM_STEP = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def seed_for_index(seed: int, index: int) -> int:
    """The generator seed of sequence `index` of a request seeded with `seed` (any int64): splitmix64 of
    seed + index * step, modulo 2**64. The mix matters because torch's CPU generator keeps only the low 32 bits of
    its seed: without it -1 and 2**63 - 1 (or s and s + 2**32) drew the same tokens; with it, two int64 seeds
    share a stream only by a 2**-32 chance, as any two random seeds do."""
    z = (seed + index * _SEED_STREAM_STEP) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SequenceGroup:
    """The sequences of one request: a single one until the prompt is computed, then n (parallel sampling) or
    the live beams (beam search). Forked sequences share the request's metrics and their parent's blocks."""

    __slots__ = ("request_id", "seqs", "n", "forked", "beam", "error", "error_param", "prompt_logprobs_sent")

    def __init__(self, request_id: str, n: int = 1):
        self.request_id = request_id
        self.seqs: list["Sequence"] = []
        self.n = n
        self.forked = n == 1   # an n > 1 request forks once, when its prompt is computed
        self.beam = None       # the BeamSearchState of a beam-search request
        self.error: str | None = None   # why the engine failed this request (RequestOutput.error)
        self.error_param: str | None = None   # set with error when the request's own field was at fault
        self.prompt_logprobs_sent = False   # its prompt logprobs went out with an output (they go once)

    @property
    def unfinished_seqs(self) -> list["Sequence"]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:   # (most requests: asked for every request every step)
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in seqs)


class Sequence:
    """A request: prompt + generated tokens, how many of them have KV in the cache, and where that KV lives.

    Invariant: `token_ids == prompt_token_ids + output_token_ids` (kept as one list because the model runner
    reads `token_ids[num_computed_tokens:]` every step). Tokens `[0, num_computed_tokens)` have their KV in the
    blocks of `block_table`; the last sampled token is not computed until the next step.
    """

    _counter = itertools.count()

    __slots__ = ("seq_id", "request_id", "prompt", "prompt_token_ids", "output_token_ids", "token_ids",
                 "num_computed_tokens", "num_cached_tokens", "block_table", "status", "params",
                 "arrival_time", "metrics", "num_output_tokens_sent", "logprobs",
                 "cumulative_logprob", "finish_reason", "stop_reason", "stop_token_ids", "max_tokens",
                 "group", "index", "order", "prompt_logprobs", "bad_words_token_ids", "guided", "spec_token_ids",
                 "known_to_workers", "num_tokens_sent", "block_table_synced", "num_output_placeholders", "kv_epoch",
                 "lora_request")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 *, arrival_time: float, eos_token_ids: frozenset[int] = frozenset(),
                 max_model_len: int | None = None, lora_request=None):
        self.seq_id = next(Sequence._counter)
        # Scheduling order (arrival, then index within the request): preemption victims are the largest; the
        # sequences of one request sit next to each other, so a request is preempted as a whole.
        self.order = (self.seq_id, 0)
        self.group = SequenceGroup(request_id, params.n)
        self.group.seqs.append(self)
        self.index = 0   # the completion index within the request
        # With params.prompt_logprobs: one entry per prompt token (None for the first), filled as prefill runs;
        # an entry is [(token id, logprob, rank), ...] (engine/step_records.py LogprobEntry).
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0   # prefix-cache hit of the first admission
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.arrival_time = arrival_time
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # Output tokens (and their logprob entries) already sent in an output: the next one sends the rest.
        self.num_output_tokens_sent = 0
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Ids that end the request when sampled (and that min_tokens masks): stop_token_ids, plus EOS unless ignored.
        self.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        # Output budget: max_tokens, and never past max_model_len tokens in total.
        limit = params.max_tokens if params.max_tokens is not None else float("inf")
        if max_model_len is not None:
            limit = min(limit, max(max_model_len - len(prompt_token_ids), 1))
        self.max_tokens = int(limit) if limit != float("inf") else None
        # Token sequences of params.bad_words (set by the engine, which has the tokenizer): when the output ends
        # with all but the last token of one, that last token is masked.
        self.bad_words_token_ids: list[list[int]] = []
        # Guided decoding: this sequence's grammar matcher (engine/core/guided_decoding.py GrammarState), which has
        # accepted exactly output_token_ids.
        self.guided = None
        # Speculative decoding: the drafts proposed for its next step (verified then, or dropped).
        self.spec_token_ids: list[int] = []
        # What the workers have of it (engine/step_records.py): whether they know it, how many of its tokens they
        # have, and how many leading block-table entries of theirs are still right.
        self.known_to_workers = False
        self.num_tokens_sent = 0
        self.block_table_synced = 0
        # Tokens it will emit from steps already scheduled whose outputs have not come back (vLLM's
        # num_output_placeholders): 0 between steps without async scheduling; with it, the step in flight's one
        # token (the scheduler counts it as a token to compute next; the worker has its id on the device).
        self.num_output_placeholders = 0
        # Bumped whenever its KV moves or goes (preemption): a step scheduled before that must not register or
        # trim its blocks when its output comes back.
        self.kv_epoch = 0
        # The LoRA adapter (engine.lora.LoRARequest) its tokens run with, None for the base model. Its KV differs
        # from the base model's: its prefix-cache hashes start from the adapter (BlockManager.hash_root).
        self.lora_request = lora_request

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def seed(self) -> int | None:
        """The seed of this sequence's own random stream (the worker draws only from it, so its tokens do not
        depend on the batch): a seeded, non-greedy request's seed, sequence i of it i steps away. None: the
        worker's shared generator."""
        if self.params.seed is None or self.params.greedy:
            return None
        return seed_for_index(self.params.seed, self.index)

    def fork(self, index: int) -> "Sequence":
        """A copy of this sequence as completion `index` of the same request. It shares every block of this
        sequence (the caller takes the references in the block manager) and the request's metrics, and draws
        from its own seed stream (`seed`)."""
        child = object.__new__(Sequence)
        for name in Sequence.__slots__:
            setattr(child, name, getattr(self, name))
        child.seq_id = next(Sequence._counter)
        child.order = (self.order[0], index)
        child.index = index
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.block_table = list(self.block_table)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        # The child continues from the parent's grammar state (it has the parent's output tokens).
        child.guided = None if self.guided is None else self.guided.fork()
        child.spec_token_ids = []
        child.known_to_workers, child.num_tokens_sent, child.block_table_synced = False, 0, 0
        child.num_output_placeholders = 0
        self.group.seqs.append(child)
        return child

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
