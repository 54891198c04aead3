"""abort_request in every state (waiting, mid-prefill, decoding, forked n > 1, swapped) frees everything the request
held and returns a final "abort" output; engine metrics and per-request timings; and a hypothesis state machine over
add / step / abort (n > 1, swap and recompute preemption, prefix caching) on the real scheduler and block manager
with a shadow KV cache: every block move lands where the sequence reads it, and nothing leaks."""
import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLMEngine, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from tests.engine.block_invariants import assert_refcounts_match_holders, finish_all_and_assert_released
from tests.engine.models_util import make_engine, random_token_ids

PROMPT_70 = random_token_ids(70, seed=41)
PROMPT_40 = random_token_ids(40, seed=42)


def assert_everything_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.requests and not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_swap_blocks == bm.num_swap_blocks and not any(bm.swap_ref_counts)


def assert_aborted(output, n=1):
    assert output.finished and len(output.outputs) >= 1
    assert all(c.finish_reason == "abort" for c in output.outputs if c.finish_reason != "length")
    assert any(c.finish_reason == "abort" for c in output.outputs)


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "decoding", "forked", "swapped"])
def test_abort_in_every_state_frees_everything(llama_dir, when):
    if when == "swapped":   # a long request that outgrows the cache next to a later n = 3 request (the victim)
        engine = make_engine(llama_dir, max_model_len=256, num_kv_blocks=18, preemption_mode="swap",
                           swap_space=1 / 64)
        engine.add_request("other", {"prompt_token_ids": PROMPT_70[:60]},
                           SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        engine.add_request("r", {"prompt_token_ids": PROMPT_40[:45] + PROMPT_70[:5]},
                           SamplingParams(n=3, seed=0, max_tokens=40, ignore_eos=True))
    else:
        engine = make_engine(llama_dir, max_model_len=224, num_kv_blocks=14, max_num_batched_tokens=32)
        engine.add_request("other", {"prompt_token_ids": PROMPT_40},
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        engine.add_request("r", {"prompt_token_ids": PROMPT_70},
                           SamplingParams(n=3 if when == "forked" else 1, seed=0, max_tokens=20, ignore_eos=True))
    n = 3 if when in ("forked", "swapped") else 1
    seq = engine.requests["r"].seqs[0]
    states = {
        "waiting": lambda: seq.status is SequenceStatus.WAITING,
        "mid-prefill": lambda: seq.status is SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_tokens,
        "decoding": lambda: seq.status is SequenceStatus.RUNNING and seq.num_output_tokens > 0,
        "forked": lambda: len(engine.requests["r"].seqs) == 3 and seq.status is SequenceStatus.RUNNING,
        "swapped": lambda: seq.status is SequenceStatus.SWAPPED,
    }
    while not states[when]():
        assert engine.has_unfinished_requests(), f"never reached {when}"
        engine.step()
    out = engine.abort_request("r")
    assert out.request_id == "r" and out.finished and len(out.outputs) == n
    assert all(c.finish_reason == "abort" for c in out.outputs)
    assert engine.abort_request("r") is None
    if when == "swapped":
        assert engine.abort_request("other").outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert_everything_free(engine)


def test_abort_keeps_shared_prefix_cache_consistent(llama_dir):
    """Two requests share cached prompt blocks; aborting one leaves the other's blocks held and correct."""
    engine = make_engine(llama_dir, max_model_len=256, num_kv_blocks=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("ref", {"prompt_token_ids": PROMPT_70}, greedy)
    while engine.has_unfinished_requests():
        (ref,) = engine.step() or [None]
    engine.add_request("a", {"prompt_token_ids": PROMPT_70}, greedy)
    engine.add_request("b", {"prompt_token_ids": PROMPT_70}, greedy)
    engine.step()
    assert engine.requests["a"].seqs[0].num_cached_tokens == 64
    assert engine.abort_request("a").outputs[0].finish_reason == "abort"
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["b"].outputs[0].token_ids == ref.outputs[0].token_ids
    assert_everything_free(engine)


def test_engine_metrics_and_request_timings(llama_dir):
    engine = make_engine(llama_dir, max_model_len=256, num_kv_blocks=32)
    metrics = engine.get_metrics()
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_cache_usage, metrics.prefix_cache_hit_rate) == (
        0, 0, 0.0, 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPT_40}, params)
    engine.add_request("b", {"prompt_token_ids": PROMPT_70}, SamplingParams(n=2, seed=0, max_tokens=6))
    assert engine.get_metrics().num_waiting == 2
    engine.step()
    metrics = engine.get_metrics()
    assert metrics.num_running == 2 and metrics.num_waiting == 0 and metrics.num_swapped == 0
    assert metrics.kv_cache_usage == pytest.approx((3 + 5) / 32)   # b's 2 sequences share its 5 prompt blocks
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finals[o.request_id] = o
    engine.add_request("c", {"prompt_token_ids": PROMPT_40}, params)   # 32 of its 40 tokens are cached
    while engine.has_unfinished_requests():
        engine.step()
    metrics = engine.get_metrics()
    assert metrics.num_prompt_tokens == 40 + 70 + 40
    assert metrics.prefix_cache_hit_rate == pytest.approx(32 / 150)
    assert metrics.num_generation_tokens == 6 + 2 * 6 + 6 - sum(
        6 - len(c.token_ids) for c in finals["b"].outputs)
    assert metrics.kv_cache_usage == 0.0 and metrics.num_preemptions == 0
    m = finals["a"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_to_first_token == pytest.approx(m.first_token_time - m.arrival_time)
    assert m.time_per_output_token == pytest.approx((m.last_token_time - m.first_token_time) / 5)
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0


def test_reset_prefix_cache(llama_dir):
    """vLLM's LLMEngine.reset_prefix_cache: refused while a request holds blocks; afterwards the same prompt is a
    miss (no cached token counted) and its greedy tokens are unchanged."""
    engine = make_engine(llama_dir, max_model_len=256, num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(request_id):
        engine.add_request(request_id, {"prompt_token_ids": PROMPT_40}, params)
        final = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                final = o
                if not o.finished:   # the request holds its blocks
                    assert not engine.reset_prefix_cache()
        return final.outputs[0].token_ids

    first = run("a")
    assert run("b") == first and engine.get_metrics().prefix_cache_hit_rate == pytest.approx(32 / 80)
    assert engine.reset_prefix_cache()
    assert run("c") == first and engine.get_metrics().prefix_cache_hit_rate == pytest.approx(32 / 120)


# -- state machine: real scheduler and block manager, a fake model writing a shadow KV cache -------------------

BLOCK_SIZE = 4


def next_token(token_ids: list[int], index: int) -> int:
    return (sum(token_ids) * 31 + len(token_ids) + 7 * index) % 50


class EngineCoreMachine(RuleBasedStateMachine):
    """Each step: apply the scheduler's block moves to a shadow cache (gpu and cpu dicts of slot -> token), check
    that every scheduled sequence's context is in its blocks, write its new tokens, fork unforked groups, sample a
    deterministic next token. A sequence's output must equal an unconstrained reference run."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, BLOCK_SIZE, enable_prefix_caching=True, num_swap_blocks=8)
        self.mode = "swap"
        self.sched = Scheduler(self.bm, max_num_seqs=6, max_num_batched_tokens=10, preemption_mode=self.mode)
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}
        self.groups = {}
        self.counter = 0

    @rule(mode=st.sampled_from(["swap", "recompute"]))
    def switch_mode(self, mode):
        self.sched.preemption_mode = mode

    @precondition(lambda self: len(self.groups) < 8)
    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12), n=st.integers(1, 3),
          max_tokens=st.integers(1, 12))
    def add(self, prompt, n, max_tokens):
        # Requests that fit the cache alone (LLMEngine.add_request rejects the others).
        assume(-(-(len(prompt) + max_tokens) // BLOCK_SIZE) + (n - 1) * (-(-max_tokens // BLOCK_SIZE) + 1) + 1 <= 10)
        seq = Sequence(str(self.counter), None, prompt, SamplingParams(n=n, max_tokens=max_tokens),
                       arrival_time=0.0)
        self.counter += 1
        self.groups[seq.request_id] = seq.group
        self.sched.add(seq)

    @rule()
    def step(self):
        output = self.sched.schedule()
        for kind, pairs in output.block_moves:
            src, dst = {"copy": (self.gpu, self.gpu), "swap_out": (self.gpu, self.cpu),
                        "swap_in": (self.cpu, self.gpu)}[kind]
            moved = {(d, i): src.get((s, i)) for s, d in pairs for i in range(BLOCK_SIZE)}
            dst.update(moved)
        for seq, num_new in output.scheduled:
            for pos in range(seq.num_computed_tokens):   # the context this step attends to
                block = seq.block_table[pos // BLOCK_SIZE]
                assert self.gpu.get((block, pos % BLOCK_SIZE)) == seq.token_ids[pos], (seq, pos)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                self.gpu[seq.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = seq.token_ids[pos]
        for s in self.sched.update_from_output(output):
            s.append_token(next_token(s.token_ids, s.index))
            if s.num_output_tokens >= s.params.max_tokens:
                self.sched.finish(s)
        for request_id in [r for r, g in self.groups.items() if g.is_finished]:
            self._check_reference(self.groups.pop(request_id))

    def _check_reference(self, group):
        for s in group.seqs:
            tokens = list(s.prompt_token_ids)
            for _ in range(s.params.max_tokens):
                tokens.append(next_token(tokens, s.index))
            assert s.token_ids == tokens

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.groups)))
        for seq in self.groups.pop(request_id).seqs:
            if not seq.is_finished:
                self.sched.finish(seq)

    @invariant()
    def refcounts_match_holders(self):
        assert_refcounts_match_holders(self.bm, self.groups.values())

    def teardown(self):
        finish_all_and_assert_released(self.sched, self.groups.values())

TestEngineCoreMachine = EngineCoreMachine.TestCase
TestEngineCoreMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_requests_get_one_output_with_every_token(llama_dir, async_scheduling):
    """A FINAL_ONLY request (LLM.generate's) without stop strings gets no output before it ends, and that one output
    holds what a streamed twin's last holds (tokens, logprobs, finish reason, token counts); with stop strings it
    goes out every step (the output processor looks for them in each step's text); aborted midway, it returns every
    token generated so far, as its streamed twin does."""
    from engine.sampling_params import RequestOutputKind

    engine = make_engine(llama_dir, async_scheduling=async_scheduling)
    final = RequestOutputKind.FINAL_ONLY
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    requests = {"streamed": base, "final": base.final_only(),
                "final-stop": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2,
                                             stop=["\x00never"], output_kind=final),
                "sampled-n2": SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=9, ignore_eos=True),
                "sampled-n2-final": SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=9, ignore_eos=True,
                                                   output_kind=final),
                "abort-streamed": SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                "abort-final": SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, output_kind=final)}
    for request_id, params in requests.items():
        engine.add_request(request_id, {"prompt_token_ids": PROMPT_40}, params)
    seen: dict[str, list] = {request_id: [] for request_id in requests}
    core_outputs: dict[str, int] = {request_id: 0 for request_id in requests}   # what the core sent, per request
    core_step = engine.engine_core.step

    def counted_step():
        outputs = core_step()
        for out in outputs:
            core_outputs[out.request_id] += 1
        return outputs

    engine.engine_core.step = counted_step
    aborted = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        steps += 1
        if steps == 6:
            aborted = {request_id: engine.abort_request(request_id) for request_id in ("abort-streamed", "abort-final")}
    assert [o.finished for o in seen["final"]] == [True]
    assert [o.finished for o in seen["sampled-n2-final"]] == [True]
    assert not seen["abort-final"] and len(seen["abort-streamed"]) >= 2
    assert core_outputs["final"] == core_outputs["sampled-n2-final"] == 1 and core_outputs["abort-final"] == 0
    assert core_outputs["final-stop"] == core_outputs["streamed"] >= 12   # every step's, for its stop strings

    def completions(output):
        return [(c.index, c.token_ids, c.finish_reason, c.cumulative_logprob,
                 None if c.logprobs is None else [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
                for c in output.outputs]

    assert completions(seen["final"][0]) == completions(seen["streamed"][-1])
    assert completions(seen["final-stop"][-1]) == completions(seen["streamed"][-1])
    assert completions(seen["sampled-n2-final"][0]) == completions(seen["sampled-n2"][-1])
    assert seen["final"][0].metrics.num_output_tokens == seen["streamed"][-1].metrics.num_output_tokens == 12
    abort_streamed, abort_final = aborted["abort-streamed"], aborted["abort-final"]
    assert abort_final.outputs[0].finish_reason == abort_streamed.outputs[0].finish_reason == "abort"
    assert abort_final.outputs[0].token_ids == abort_streamed.outputs[0].token_ids
    assert len(abort_final.outputs[0].token_ids) >= 4
    assert_everything_free(engine)
