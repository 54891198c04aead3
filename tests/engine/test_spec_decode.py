"""Speculative decoding end to end: greedy output equals non-speculative output token for token on every
architecture, with n-gram proposals and with a random-weight draft model; drafts that are all right, partly right
and all wrong (oracle proposals) leave the output unchanged while acceptance and block usage follow them; prefix
caching, chunked prefill, both preemption modes, n > 1, logprobs, stop tokens and strings, min/max tokens ending
inside a draft, guided decoding and tensor parallelism; and a state machine over the real scheduler and block
manager with drafts accepted, rejected, preempted and aborted shows no block leaked or freed twice."""
import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from tests.engine.block_invariants import assert_refcounts_match_holders, finish_all_and_assert_released
from tests.engine.models_util import TINY_ARCHITECTURES
from tests.engine.sampler_paths import both_sampler_paths  # noqa: F401 (the tests that sample run on both paths)
from tests.engine.spec_util import GREEDY, K, NGRAM
from tests.engine.spec_util import completion_tokens as _tokens
from tests.engine.spec_util import generate_checked as _generate
from tests.engine.spec_util import spec_prompts as _prompts


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir):
    """A random-weight draft with the targets' tokenizer and vocabulary (another architecture, other weights)."""
    return tiny_model_dir("qwen3")


@pytest.mark.usefixtures("both_sampler_paths")
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_speculative_output_equals_plain_output(tiny_model_dir, draft_dir, arch):
    model_dir = tiny_model_dir(arch)
    expected, _ = _generate(model_dir)
    ngram, ngram_stats = _generate(model_dir, speculative_config=NGRAM)
    assert _tokens(ngram) == _tokens(expected)
    assert ngram_stats.num_drafts > 0   # the repeated spans were proposed
    drafted, draft_stats = _generate(model_dir, speculative_config={"model": draft_dir, "num_speculative_tokens": K})
    assert _tokens(drafted) == _tokens(expected)
    assert draft_stats.num_draft_tokens > 0


@pytest.mark.usefixtures("both_sampler_paths")
def test_self_draft_accepts_everything_greedy_and_sampled(llama_dir):
    """The target as its own draft: q = p, so every draft is accepted, greedy or sampled (acceptance
    min(1, p/q) = 1), and a verifying step emits k + 1 tokens."""
    spec = {"model": llama_dir, "num_speculative_tokens": K}
    for params in (GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=21, ignore_eos=True)):
        outputs, stats = _generate(llama_dir, params, speculative_config=spec)
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
        # Every draft accepted; only the last steps of a request verify fewer than k (max_tokens cuts them).
        assert stats.mean_accepted_length == 1 + stats.num_draft_tokens / stats.num_drafts > K
        assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
        assert all(len(c.token_ids) == params.max_tokens for o in outputs for c in o.outputs)


@pytest.mark.usefixtures("both_sampler_paths")
@pytest.mark.parametrize("mistake", [None, 0, 2])
def test_oracle_drafts_right_partly_right_and_wrong(llama_dir, monkeypatch, mistake):
    """Proposals taken from the plain run's own continuation, with one token wrong at `mistake` (None: all
    right): acceptance stops exactly there, the rejected tokens' KV is dropped and recomputed, and the output
    stays the plain one."""
    import engine.worker.model_runner as model_runner_module

    prompts = _prompts()
    expected = _tokens(_generate(llama_dir, prompts=prompts)[0])
    full = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + out[0] for p, out in zip(prompts, expected)}

    def oracle(tokens, *, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max):
        tokens = tokens.tolist()
        for prompt, sequence in full.items():
            if tokens[:len(prompt)] == list(prompt) and sequence[:len(tokens)] == tokens:
                drafts = sequence[len(tokens):len(tokens) + num_speculative_tokens]
                if mistake is not None and mistake < len(drafts):
                    drafts[mistake] = (drafts[mistake] + 1) % 512
                return drafts
        raise AssertionError("a sequence the oracle does not know")

    monkeypatch.setattr(model_runner_module, "propose_ngram", oracle)
    outputs, stats = _generate(llama_dir, prompts=prompts, speculative_config=NGRAM)
    assert _tokens(outputs) == expected
    assert stats.num_drafts > 0
    if mistake is None:
        assert stats.acceptance_rate == 1.0
    else:   # nothing from the wrong token on; before it, everything that was verified
        assert stats.num_accepted_tokens_per_pos[mistake] == 0
        assert (stats.num_accepted_tokens > 0) == (mistake > 0)


@pytest.mark.usefixtures("both_sampler_paths")
def test_an_all_greedy_verification_checks_the_drafts_against_the_picks_alone(llama_dir, monkeypatch):
    """A verification batch whose requests are all greedy checks its drafts against the target's picks
    (rejection_sample_greedy: the plain step's draw of each row, no probabilities); a batch with a random request
    takes rejection_sample, and its greedy requests still give the plain greedy output."""
    import engine.worker.model_runner as model_runner_module

    taken = []
    for name in ("rejection_sample", "rejection_sample_greedy"):
        real = getattr(model_runner_module, name)
        monkeypatch.setattr(model_runner_module, name, lambda *args, _real=real, _name=name, **kwargs:
                            taken.append(_name) or _real(*args, **kwargs))
    prompts = _prompts()
    expected = _tokens(_generate(llama_dir, prompts=prompts)[0])
    outputs, stats = _generate(llama_dir, prompts=prompts, speculative_config=NGRAM)
    assert _tokens(outputs) == expected and stats.num_drafts > 0
    assert taken and set(taken) == {"rejection_sample_greedy"}
    taken.clear()
    mixed = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True), GREEDY, GREEDY]
    outputs, _ = _generate(llama_dir, mixed, prompts=prompts, speculative_config=NGRAM)
    assert "rejection_sample" in taken
    assert [tokens for i, tokens in enumerate(_tokens(outputs)) if i != 1] == \
        [tokens for i, tokens in enumerate(expected) if i != 1]


@pytest.mark.usefixtures("both_sampler_paths")
def test_logprobs_of_several_widths_in_one_verification(llama_dir, monkeypatch):
    """Requests asking for 3, 1 and no top logprobs verify drafts in the same steps (oracle drafts, all right: every
    step emits k + 1 tokens each): their tokens and logprobs equal plain decoding's, each read with the step's
    tokens in its one transfer."""
    import engine.worker.model_runner as model_runner_module

    prompts = _prompts()[:3]
    kinds = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    expected = _generate(llama_dir, kinds, prompts=prompts)[0]
    full = [p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, expected)]

    def oracle(tokens, *, num_speculative_tokens, **kwargs):
        tokens = tokens.tolist()
        sequence = next(s for s in full if s[:len(tokens)] == tokens)
        return sequence[len(tokens):len(tokens) + num_speculative_tokens]

    monkeypatch.setattr(model_runner_module, "propose_ngram", oracle)
    reads = []
    real_read = model_runner_module.ModelRunner._read_speculative
    monkeypatch.setattr(model_runner_module.ModelRunner, "_read_speculative",
                        staticmethod(lambda *args: reads.append(len(args)) or real_read(*args)))
    actual, stats = _generate(llama_dir, kinds, prompts=prompts, speculative_config=NGRAM)
    assert stats.acceptance_rate == 1.0 and reads and set(reads) == {2}
    for got, want in zip(actual, expected):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        assert (got.logprobs is None) == (want.logprobs is None)
        for g, w in zip(got.logprobs or [], want.logprobs or []):
            assert set(g) == set(w)
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in g)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_preemption_prefix_caching_and_chunked_prefill(llama_dir, draft_dir, proposer):
    """A cache too small for the batch (preempting by recomputation, then by swapping: a draft model's cache
    swaps with the model's), a step budget that cuts prompts into chunks, and shared prompt prefixes: the same
    tokens as the plain engine with a roomy cache."""
    prompts = _prompts()
    expected = _tokens(_generate(llama_dir, prompts=prompts)[0])
    spec = NGRAM if proposer == "ngram" else {"model": draft_dir, "num_speculative_tokens": K}
    for mode in ("recompute", "swap"):
        outputs, stats = _generate(llama_dir, prompts=prompts, speculative_config=spec, num_kv_blocks=10,
                                   max_num_batched_tokens=24, preemption_mode=mode, swap_space=0.01,
                                   must_preempt=True)
        assert _tokens(outputs) == expected and stats.num_drafts > 0


@pytest.mark.usefixtures("both_sampler_paths")
def test_parallel_sampling_logprobs_and_stopping_inside_a_draft(llama_dir, monkeypatch):
    """n = 2 (greedy: identical completions), logprobs of every token, a stop token, a stop string and
    max_tokens / min_tokens that end inside a draft (oracle drafts, all right, so every step proposes k)."""
    import engine.worker.model_runner as model_runner_module

    prompt = _prompts()[0]
    plain = _generate(llama_dir, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                      prompts=[prompt])[0][0].outputs[0].token_ids
    sequence = prompt["prompt_token_ids"] + list(plain)
    monkeypatch.setattr(model_runner_module, "propose_ngram",
                        lambda tokens, num_speculative_tokens, **kw: sequence[len(tokens):len(tokens) + num_speculative_tokens])
    stop_token = plain[6]
    cases = [SamplingParams(n=2, temperature=0, max_tokens=11, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0, max_tokens=7, min_tokens=5, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, prompt_logprobs=2)]
    for params in cases:
        expected = _generate(llama_dir, params, prompts=[prompt])[0][0]
        actual, stats = _generate(llama_dir, params, prompts=[prompt], speculative_config=NGRAM)
        actual = actual[0]
        assert [c.token_ids for c in actual.outputs] == [c.token_ids for c in expected.outputs]
        assert [c.finish_reason for c in actual.outputs] == [c.finish_reason for c in expected.outputs]
        assert stats.num_accepted_tokens > 0
        if params.logprobs is not None:
            for got, want in zip(actual.outputs, expected.outputs):
                assert [set(e) for e in got.logprobs] == [set(e) for e in want.logprobs]
                for g, w in zip(got.logprobs, want.logprobs):
                    assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in g)
        if params.prompt_logprobs is not None:
            assert len(actual.prompt_logprobs) == len(expected.prompt_logprobs)
    assert stop_token in plain[:7]


def test_guided_requests_decode_without_drafts(llama_dir):
    pytest.importorskip("xgrammar", reason="guided decoding needs xgrammar (pip install xgrammar)")
    from engine.sampling_params import GuidedDecodingParams

    params = SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="[ab]{3,8}"))
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in _prompts()[:2]]
    expected, _ = _generate(llama_dir, params, prompts=prompts)
    actual, stats = _generate(llama_dir, params, prompts=prompts, speculative_config=NGRAM)
    assert _tokens(actual) == _tokens(expected) and stats.num_drafts == 0


def test_tensor_parallel_speculation_equals_one_process(llama_dir):
    expected, _ = _generate(llama_dir, speculative_config=NGRAM)
    actual, stats = _generate(llama_dir, speculative_config=NGRAM, tensor_parallel_size=2)
    assert _tokens(actual) == _tokens(expected) and stats.num_drafts > 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 32\]"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     r"prompt_lookup_min must be in \[1, 2\]"),
    ({"num_speculative_tokens": 2, "draft": "x"}, "unknown keys"),
    ({"model": "/no/such/dir", "num_speculative_tokens": 2}, "no such directory"),
])
def test_bad_speculative_config_is_refused(llama_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama_dir, num_kv_blocks=16, speculative_config=spec)


# -- state machine: drafts through the real scheduler and block manager ----------------------------------------

BLOCK_SIZE = 4


def next_token(token_ids: list[int], index: int) -> int:
    """The fake model: the next token is a function of the whole context."""
    return (sum(token_ids) * 31 + len(token_ids) + 7 * index) % 7


class SpeculativeCoreMachine(RuleBasedStateMachine):
    """A fake model over a shadow KV cache: each step checks every scheduled sequence's context in its blocks,
    writes its new tokens and drafts, accepts the drafts up to the first that differs from the fake model's
    token, emits the accepted ones and one more as the engine does, trims the rejected ones' blocks, and
    proposes new drafts (right or wrong). A finished sequence equals the fake model run without drafts."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BLOCK_SIZE, enable_prefix_caching=True, num_swap_blocks=8)
        self.sched = Scheduler(self.bm, max_num_seqs=5, max_num_batched_tokens=11, preemption_mode="swap")
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}
        self.groups = {}
        self.counter = 0

    @rule(mode=st.sampled_from(["swap", "recompute"]))
    def switch_mode(self, mode):
        self.sched.preemption_mode = mode

    @precondition(lambda self: len(self.groups) < 6)
    @rule(prompt=st.lists(st.integers(0, 6), min_size=1, max_size=10), n=st.integers(1, 2),
          max_tokens=st.integers(1, 14))
    def add(self, prompt, n, max_tokens):
        assume(-(-(len(prompt) + max_tokens + K) // BLOCK_SIZE) + (n - 1) * (-(-(max_tokens + K) // BLOCK_SIZE) + 1)
               + 1 <= 12)
        seq = Sequence(str(self.counter), None, prompt, SamplingParams(n=n, max_tokens=max_tokens),
                       arrival_time=0.0)
        self.counter += 1
        self.groups[seq.request_id] = seq.group
        self.sched.add(seq)

    @rule(data=st.data())
    def step(self, data):
        step = self.sched.schedule()
        for kind, pairs in step.block_moves:
            src, dst = {"copy": (self.gpu, self.gpu), "swap_out": (self.gpu, self.cpu),
                        "swap_in": (self.cpu, self.gpu)}[kind]
            moved = {(d, i): src.get((s, i)) for s, d in pairs for i in range(BLOCK_SIZE)}
            dst.update(moved)
        accepted = {}
        for seq, num_new in step.scheduled:
            for pos in range(seq.num_computed_tokens):   # the context this step attends to
                assert self.gpu.get((seq.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)) == seq.token_ids[pos]
            written = seq.token_ids + seq.spec_token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                self.gpu[seq.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = written[pos]
            if seq.spec_token_ids:
                context, a = list(seq.token_ids), 0
                for draft in seq.spec_token_ids:
                    if draft != next_token(context, seq.index):
                        break
                    context.append(draft)
                    a += 1
                accepted[seq.seq_id] = a
        for seq in self.sched.update_from_output(step, accepted):
            num_drafts = len(seq.spec_token_ids)
            emitted = seq.spec_token_ids[:accepted.get(seq.seq_id, 0)]
            context = seq.token_ids + emitted
            emitted.append(next_token(context, seq.index))
            for token in emitted:
                seq.append_token(token)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    break
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq)
                continue
            if num_drafts:
                self.bm.cache_full_blocks(seq)
                self.bm.trim(seq)
            room = seq.params.max_tokens - seq.num_output_tokens - 1
            right = []
            for _ in range(K):
                right.append(next_token(seq.token_ids + right, seq.index))
            drafts = data.draw(st.sampled_from([right, [(t + 1) % 7 for t in right], right[:2] + [0, 0], []]))
            seq.spec_token_ids = drafts[:max(room, 0)]
        for request_id in [r for r, g in self.groups.items() if g.is_finished]:
            for s in self.groups.pop(request_id).seqs:
                tokens = list(s.prompt_token_ids)
                for _ in range(s.params.max_tokens):
                    tokens.append(next_token(tokens, s.index))
                assert s.token_ids == tokens

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):
        for seq in self.groups.pop(data.draw(st.sampled_from(sorted(self.groups)))).seqs:
            if not seq.is_finished:
                self.sched.finish(seq)

    @invariant()
    def refcounts_match_holders(self):
        assert_refcounts_match_holders(self.bm, self.groups.values())

    def teardown(self):
        finish_all_and_assert_released(self.sched, self.groups.values())

TestSpeculativeCoreMachine = SpeculativeCoreMachine.TestCase
TestSpeculativeCoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])


def test_server_with_speculation_serves_the_same_tokens_and_exports_vllm_metrics(llama_dir):
    """`serve --speculative-config`: the OpenAI client gets the plain engine's greedy tokens, and /metrics has
    vLLM's vllm:spec_decode_* counters."""
    from tests.extras import require_serve_extra

    require_serve_extra()
    import httpx
    import openai

    from engine.async_engine import AsyncLLMEngine
    from engine.entrypoints.openai.api_server import ServerThread, build_app

    prompt = _prompts()[1]["prompt_token_ids"]   # ends inside a repeated span: drafts from the first step
    expected = _generate(llama_dir, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         prompts=[{"prompt_token_ids": prompt}])[0][0].outputs[0].token_ids
    engine = AsyncLLMEngine.from_args(llama_dir, num_kv_blocks=64, max_model_len=160, speculative_config=NGRAM)
    with ServerThread(build_app(engine, served_model_names=["tiny"])) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert completion.usage.completion_tokens == 12
        text = httpx.get(server.url + "/metrics").text
    tokenizer = engine.tokenizer
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    drafts = [line for line in text.splitlines() if line.startswith('vllm:spec_decode_num_draft_tokens_total{')]
    assert drafts and float(drafts[0].split()[-1]) > 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    engine.engine.shutdown()


@pytest.mark.parametrize("mistake", [None, 2])
def test_verification_graphs_keep_the_greedy_output(llama_dir, monkeypatch, mistake):
    """Speculative verification in graphs (ModelRunner.set_spec_decode_graphs; the CPU double of CUDA graphs stands
    in for them, with the decode graphs): single-stream generation with oracle proposals (the plain run's own
    continuation, one token wrong at `mistake`), whose verification steps each hold one sequence's 1 + drafts tokens,
    replays the graphs of (1, q), accepts what the eager steps accept and gives the tokens of plain decoding."""
    import engine.worker.model_runner as model_runner_module

    prompts = _prompts()
    expected = [_tokens(_generate(llama_dir, prompts=[prompt])[0]) for prompt in prompts]
    full = {tuple(p["prompt_token_ids"]): p["prompt_token_ids"] + out[0][0] for p, out in zip(prompts, expected)}

    def oracle(tokens, *, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max):
        tokens = tokens.tolist()
        sequence = next(s for prompt, s in full.items() if tokens[:len(prompt)] == list(prompt))
        drafts = sequence[len(tokens):len(tokens) + num_speculative_tokens]
        if mistake is not None and mistake < len(drafts):
            drafts[mistake] = (drafts[mistake] + 1) % 512
        return drafts

    monkeypatch.setattr(model_runner_module, "propose_ngram", oracle)

    def single_stream(graphs: bool):
        llm = LLM(llama_dir, max_model_len=160, num_kv_blocks=64, speculative_config=NGRAM, enforce_eager=True)
        try:
            runner = _graphed(llm) if graphs else llm.llm_engine.model_runner
            tokens = [_tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) for prompt in prompts]
            stats = llm.llm_engine.get_metrics().spec_decode
            replays = sum(graph.num_replays for graph in runner.verify_graphs.values())
            return tokens, stats, sorted(runner.verify_graphs), replays
        finally:
            llm.llm_engine.shutdown()

    eager_tokens, eager_stats, none, _ = single_stream(graphs=False)
    tokens, stats, shapes, replays = single_stream(graphs=True)
    assert tokens == eager_tokens == expected and none == []
    assert shapes and all(batch_size == 1 for batch_size, _ in shapes) and replays > len(shapes)
    assert stats == eager_stats and stats.num_accepted_tokens > 0
    assert (stats.acceptance_rate == 1.0) == (mistake is None)


def _graphed(llm):
    """``llm``'s runner with the CPU double of CUDA graphs and speculative graphs on (verification and proposal
    steps; the model's decode steps too), as ENGINE_SPEC_DECODE_GRAPHS=1 has them on CUDA."""
    from engine.worker.model_runner import EagerGraphRunner, graph_batch_sizes

    runner = llm.llm_engine.model_runner
    runner.graph_runner_class, runner.enforce_eager = EagerGraphRunner, False
    runner.graph_batch_sizes = graph_batch_sizes(runner.max_num_seqs)
    runner._allocate_static_buffers()
    for layer in runner.attention_layers:   # graph replays take the decode op (valid padding rows)
        layer.use_decode_kernel = True
    assert runner.set_spec_decode_graphs(True)
    return runner


@pytest.mark.usefixtures("both_sampler_paths")
@pytest.mark.parametrize("sampled, draft", [(False, "self"), (False, "other"), (True, "self")])
def test_draft_model_proposals_replay_graphs(llama_dir, draft_dir, sampled, draft, monkeypatch):
    """A draft model's proposal steps in graphs (the CPU double): the four prompts in one batch propose through the
    graphs of their padded batch sizes (4, then smaller as requests finish), each captured once and replayed k times
    a proposal, and the output, drafts and acceptances are the eager engine's: greedy, the plain engine's tokens,
    every draft accepted with the model as its own draft (another model: another attention shape, q/k norms);
    sampled (top-p, seeded, greedy and random rows mixed: the draws made after the replay), with the model as its
    own draft, every draft accepted and the same tokens as the eager proposals drew. The draft's forward over the
    tokens a verification graph verifies runs inside that graph: outside graphs only for the other steps (prefills,
    verifications of unequal lengths), one call a step at most."""
    from engine.worker.decode_graphs import EagerGraphRunner

    in_graph = [False]
    for name in ("capture", "replay"):
        def inside(self, *args, _real=getattr(EagerGraphRunner, name), **kwargs):
            in_graph[0] = True
            try:
                return _real(self, *args, **kwargs)
            finally:
                in_graph[0] = False
        monkeypatch.setattr(EagerGraphRunner, name, inside)

    if sampled:
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3 + i, max_tokens=21, ignore_eos=True)
                  for i in range(3)] + [GREEDY]
    else:
        params = GREEDY
    spec = {"model": llama_dir if draft == "self" else draft_dir, "num_speculative_tokens": K}

    def run(graphs: bool):
        llm = LLM(llama_dir, max_model_len=160, num_kv_blocks=64, speculative_config=spec, enforce_eager=True)
        try:
            runner = llm.llm_engine.model_runner
            drafter = runner.drafter
            assert drafter.graphs_on is False and not drafter.graphs
            if graphs:
                _graphed(llm)
                assert drafter.graphs_on and all(layer.use_decode_kernel for layer in drafter.layers)
            calls = {"steps": 0, "outside": 0, "inside": 0}
            real_step, real_execute = drafter.run_target_step, runner.execute_model

            def run_target_step(*args, **kwargs):
                calls["inside" if in_graph[0] else "outside"] += 1
                return real_step(*args, **kwargs)

            def execute_model(*args, **kwargs):
                before = calls["outside"]
                try:
                    return real_execute(*args, **kwargs)
                finally:
                    calls["steps"] += 1
                    assert calls["outside"] - before <= 1
            drafter.run_target_step, runner.execute_model = run_target_step, execute_model
            outputs = _tokens(llm.generate(_prompts(), params, use_tqdm=False))
            bm = llm.llm_engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks
            replays = {size: graph.num_replays for size, graph in drafter.graphs.items()}
            return outputs, llm.llm_engine.get_metrics().spec_decode, replays, calls, len(runner.verify_graphs)
        finally:
            llm.llm_engine.shutdown()

    eager, eager_stats, none, eager_calls, _ = run(graphs=False)
    graphed, stats, replays, calls, verify_shapes = run(graphs=True)
    assert eager_calls["outside"] == eager_calls["steps"] and eager_calls["inside"] == 0
    # every verification replay (and each graph's capture) ran the draft's forward inside the graph
    assert verify_shapes and calls["inside"] > 0 and calls["outside"] + calls["inside"] > calls["steps"]
    assert calls["outside"] < calls["steps"]
    assert none == {} and 4 in replays and set(replays) <= {1, 2, 4}
    assert all(count >= K and count % K == 0 for count in replays.values())   # k replays a proposal
    assert graphed == eager and stats.num_draft_tokens > 0
    assert stats == eager_stats   # the same drafts proposed, the same accepted
    if draft == "self":
        assert stats.acceptance_rate == 1.0
    if sampled:
        assert all(len(completion) == 21 for request in graphed[:3] for completion in request)
    else:
        assert graphed == _tokens(_generate(llama_dir)[0])


def test_turning_speculative_graphs_off_drops_the_draft_graphs(llama_dir):
    """set_spec_decode_graphs(False) (and drop_graphs) drop a draft model's graphs; off, its layers take the op the
    device policy gives them in eager (CPU: the prefill op)."""
    llm = LLM(llama_dir, max_model_len=160, num_kv_blocks=64, speculative_config={"model": llama_dir,
              "num_speculative_tokens": K}, enforce_eager=True)
    try:
        runner = _graphed(llm)
        drafter = runner.drafter
        llm.generate(_prompts()[:1], GREEDY, use_tqdm=False)
        assert list(drafter.graphs) == [1]
        runner.drop_graphs()
        assert drafter.graphs == {} and drafter.graphs_on
        llm.generate(_prompts()[:1], GREEDY, use_tqdm=False)
        assert list(drafter.graphs) == [1]
        assert runner.set_spec_decode_graphs(False) is False
        assert drafter.graphs == {} and not drafter.graphs_on
        assert not any(layer.use_decode_kernel for layer in drafter.layers)
        llm.generate(_prompts()[:1], GREEDY, use_tqdm=False)
        assert drafter.graphs == {}
    finally:
        llm.llm_engine.shutdown()
