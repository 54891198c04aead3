"""Scheduler: token budget, chunked prefill, arrival-order mixing, max_num_seqs, FCFS admission, preemption of
the latest arrival and its exact resumption. Sequences are driven by hand (a fake model: each step appends one
token to every sequence whose scheduled tokens reached its end)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus


def make_seq(num_prompt_tokens, request_id, first_token=0):
    tokens = [(first_token + 7 * i) % 997 + 1 for i in range(num_prompt_tokens)]
    return Sequence(request_id, None, tokens, SamplingParams(), arrival_time=0.0)


def fake_step(scheduler: Scheduler, output, next_token=5):
    """Advance like the engine: count the computed tokens, then sample for sequences that reached their end."""
    for seq in scheduler.update_from_output(output):
        seq.append_token(next_token)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, prefix=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def test_budget_chunks_long_prompt_and_takes_running_sequences_in_arrival_order():
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_seq(6, "a"), make_seq(25, "b", first_token=3)
    sched.add(a)
    sched.add(b)
    step1 = sched.schedule()
    assert [(s.request_id, n) for s, n in step1.scheduled] == [("a", 6), ("b", 4)]   # b chunked to the remaining budget
    fake_step(sched, step1)
    step2 = sched.schedule()
    assert [(s.request_id, n) for s, n in step2.scheduled] == [("a", 1), ("b", 9)]   # a, which arrived first, decodes first
    fake_step(sched, step2)
    assert b.num_computed_tokens == 13 and b.num_output_tokens == 0 and a.num_output_tokens == 2
    for _ in range(2):
        fake_step(sched, sched.schedule())
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1
    assert sum(n for _, n in sched.schedule().scheduled) == 2   # two decodes


def test_decodes_go_before_prompts_computed_in_chunks():
    """A request recomputing its tokens after a preemption (an old arrival, so first in arrival order) or any prompt
    in chunks takes the budget after the requests that are decoding, which keep their one token a step."""
    sched = make_scheduler(max_num_batched_tokens=8)
    long, short = make_seq(30, "long"), make_seq(3, "short", first_token=2)
    sched.add(long)
    fake_step(sched, sched.schedule())   # long: 8 of its 30 prompt tokens
    sched.add(short)
    step = sched.schedule()              # long takes the whole budget: short waits
    assert [(s.request_id, n) for s, n in step.scheduled] == [("long", 8)]
    fake_step(sched, step)
    sched.finish(long)                   # (long is done for this test; short gets admitted and decodes)
    fake_step(sched, sched.schedule())
    assert short.num_output_tokens == 1
    late = make_seq(40, "late", first_token=4)
    sched.add(late)
    fake_step(sched, sched.schedule())   # short decodes, late's prompt starts in the rest of the budget
    # Now an older request recomputing (preempted): it is in `running` before short, but short decodes first.
    old = make_seq(20, "old", first_token=5)
    old.seq_id, old.order = -1, (-1, 0)  # arrived before everyone
    sched.running.insert(0, old)
    old.status = SequenceStatus.RUNNING
    assert sched.block_manager.allocate_slots(old, 0)
    step = sched.schedule()
    assert [s.request_id for s, _ in step.scheduled][:1] == ["short"]
    assert dict((s.request_id, n) for s, n in step.scheduled) == {"short": 1, "old": 7}


def test_max_num_seqs_and_fcfs():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(3, str(i), first_token=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s.request_id for s, _ in step.scheduled] == ["0", "1"]
    assert [s.request_id for s in sched.waiting] == ["2", "3"]
    sched.finish(seqs[0])
    fake_step(sched, step)
    step = sched.schedule()
    assert [s.request_id for s, _ in step.scheduled] == ["1", "2"]


def test_prefix_hit_reduces_scheduled_tokens():
    sched = make_scheduler(max_num_batched_tokens=64)
    a = make_seq(12, "a")
    sched.add(a)
    fake_step(sched, sched.schedule())
    b = Sequence("b", None, a.prompt_token_ids[:8] + [900, 901, 902], SamplingParams(), arrival_time=0.0)
    sched.add(b)
    step = sched.schedule()
    assert ("b", 3) in [(s.request_id, n) for s, n in step.scheduled]
    assert b.num_cached_tokens == 8


def test_preempts_latest_arrival_and_resumes_identically():
    # 8 blocks of 4 slots; three sequences of 8 prompt tokens each need 2 blocks, then grow.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, prefix=False)
    seqs = [make_seq(8, str(i), first_token=100 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    victims = []
    for step_index in range(40):
        before = {s.request_id: s.status for s in seqs}
        step = sched.schedule()
        for s in seqs:
            if before[s.request_id] is SequenceStatus.RUNNING and s.status is SequenceStatus.WAITING:
                victims.append((s.request_id, [r.request_id for r in sched.running]))
                assert s.num_computed_tokens == 0 and s.block_table == [] and sched.waiting[0] is s
        # The victim always arrived after every sequence still running.
        fake_step(sched, step, next_token=step_index + 1)
        for s in seqs:
            if s.num_output_tokens >= 6 and s.status is SequenceStatus.RUNNING:
                sched.finish(s)
        if not sched.has_unfinished():
            break
    assert victims, "the cache was sized so that preemption must happen"
    for victim, still_running in victims:
        assert all(int(r) < int(victim) for r in still_running)
    assert sched.num_preemptions == len(victims)
    assert all(s.num_output_tokens == 6 for s in seqs)
    # Preempted sequences kept their generated tokens: token_ids is still prompt + outputs.
    for s in seqs:
        assert s.token_ids == s.prompt_token_ids + s.output_token_ids
    assert sched.block_manager.num_free_blocks == 8


def test_no_admission_when_blocks_short():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq(10, "a"), make_seq(5, "b", first_token=50)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [s.request_id for s, _ in step.scheduled] == ["a"]   # b needs 2 blocks, 0 left
    assert sched.block_manager.num_free_blocks == 0 and list(sched.waiting) == [b]


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0)])
def test_rejects_bad_limits(bad):
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=16) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        Scheduler(BlockManager(4, 4), **kwargs)


def next_token_of(token_ids) -> int:
    """The fake model: the next token is a function of the whole context (like greedy decoding)."""
    return hash(tuple(token_ids)) % 5 + 1


@settings(max_examples=100, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 24), min_size=1, max_size=7),
    max_tokens=st.lists(st.integers(1, 12), min_size=7, max_size=7),
    shared_prefix=st.integers(0, 16),
    num_blocks=st.integers(6, 14),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 5),
    prefix=st.booleans(),
    arrivals=st.lists(st.integers(0, 6), min_size=7, max_size=7),
)
def test_random_workloads_finish_with_reference_tokens(prompt_lens, max_tokens, shared_prefix, num_blocks, budget,
                                                       max_num_seqs, prefix, arrivals):
    """Any workload: each step respects the budget and max_num_seqs, every computed token reads correct KV
    (a shadow cache checks prefix hits, chunking and preemption), each request ends with exactly the tokens the
    fake model gives it alone, and all blocks are free at the end."""
    block_size = 4
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget, prefix=prefix)
    base = [(3 * i) % 11 + 1 for i in range(24)]
    seqs = []
    for i, n in enumerate(prompt_lens):
        prompt = (base[:shared_prefix] + [(i * 7 + j) % 13 + 1 for j in range(n)])[:max(n, 1)]
        max_tok = max_tokens[i]
        # The engine rejects requests that could not run alone; so does this workload.
        if sched.block_manager.num_blocks_for(len(prompt) + max_tok - 1) > num_blocks:
            continue
        seq = Sequence(str(i), None, prompt, SamplingParams(max_tokens=max_tok), arrival_time=0.0)
        seqs.append(seq)
    pending = sorted(seqs, key=lambda s: arrivals[int(s.request_id)])
    shadow: dict[tuple[int, int], int] = {}
    for step in range(2000):
        while pending and arrivals[int(pending[0].request_id)] <= step:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        output = sched.schedule()
        scheduled = output.scheduled
        assert sum(n for _, n in scheduled) <= budget and len(sched.running) <= max_num_seqs
        assert len({s.seq_id for s, _ in scheduled}) == len(scheduled)
        for seq, n in scheduled:
            assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
            for pos in range(seq.num_computed_tokens):   # what attention reads
                assert shadow[seq.block_table[pos // block_size], pos % block_size] == seq.token_ids[pos]
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):   # what the step writes
                shadow[seq.block_table[pos // block_size], pos % block_size] = seq.token_ids[pos]
        for seq in sched.update_from_output(output):
            seq.append_token(next_token_of(seq.token_ids))
            if seq.num_output_tokens == seq.params.max_tokens:
                sched.finish(seq)
    else:
        raise AssertionError("workload did not finish")
    for seq in seqs:
        expected = list(seq.prompt_token_ids)
        for _ in range(seq.params.max_tokens):
            expected.append(next_token_of(expected))
        assert seq.token_ids == expected
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)
