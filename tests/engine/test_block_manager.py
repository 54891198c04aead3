"""Block manager: hand-written cases for prefix caching and LRU eviction, and a hypothesis state machine that
drives admit / compute / grow / free / preempt with shared prefixes and checks the invariants after every step.

The state machine keeps a shadow of the KV cache (which token each slot holds, written when a token is
"computed"), so a prefix hit that hands out the wrong block, or an eviction of a block still in use, shows up
as a sequence whose computed tokens disagree with the shadow."""
import random

import pytest

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence


def make_seq(token_ids, request_id="r"):
    return Sequence(request_id, None, token_ids, SamplingParams(), arrival_time=0.0)


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Take a waiting sequence's prefix-cache hits (and no other block)."""
    assert bm.allocate_slots(seq, 0, bm.lookup_prefix(seq))


def compute(bm: BlockManager, seq: Sequence, num_new_tokens: int) -> None:
    """What the scheduler + model runner do for one step of `seq`."""
    assert bm.allocate_slots(seq, num_new_tokens)
    seq.num_computed_tokens += num_new_tokens
    bm.cache_full_blocks(seq)


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm.free_block_ids), [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
            dict(bm.hash_to_block_id))


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [random.Random(0).randrange(1000) for _ in range(10)]
    a = make_seq(prompt)
    admit(bm, a)
    assert a.num_computed_tokens == 0
    compute(bm, a, 10)
    assert len(a.block_table) == 3

    b = make_seq(prompt[:8] + [7, 7, 7])   # shares two full blocks
    admit(bm, b)
    assert b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]

    c = make_seq(prompt[:8])   # fully cached prompt: the last block is recomputed for its logits
    admit(bm, c)
    assert c.num_computed_tokens == 4 and c.block_table == a.block_table[:1]

    d = make_seq(prompt[:4] + [5, 5, 5, 5, 5])   # diverges in block 1
    admit(bm, d)
    assert d.num_computed_tokens == 4

    for s in (a, b, c, d):
        bm.deallocate(s)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_cached_blocks_survive_free_until_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5, 6, 9])
    admit(bm, a)
    compute(bm, a, 7)
    table = list(a.block_table)
    bm.deallocate(a)
    # Still cached after free: an equal prompt hits all three full blocks.
    b = make_seq([1, 2, 3, 4, 5, 6, 9])
    admit(bm, b)
    assert b.block_table == table[:3] and b.num_computed_tokens == 6
    bm.deallocate(b)
    # Freed tail first: the next allocations take the never-hashed block, then the LAST prefix block.
    c = make_seq([42] * 4)
    admit(bm, c)
    assert bm.allocate_slots(c, 4)
    assert table[2] in c.block_table and table[0] not in c.block_table
    d = make_seq([1, 2, 3, 4, 5, 6, 9])
    admit(bm, d)
    assert d.num_computed_tokens == 4   # blocks 0 and 1 of the prefix are still cached
    bm.deallocate(c)
    bm.deallocate(d)
    assert bm.num_free_blocks == 4


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(12)))
    admit(bm, a)
    compute(bm, a, 12)
    b = make_seq(list(range(12)))
    admit(bm, b)
    assert b.num_computed_tokens == 0 and not bm.hash_to_block_id


def test_reset_prefix_cache_forgets_every_block_and_is_refused_while_blocks_are_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(12)))
    admit(bm, a)
    compute(bm, a, 12)
    before = snapshot(bm)
    assert not bm.reset_prefix_cache()   # a holds its blocks: nothing changes
    assert snapshot(bm) == before
    bm.deallocate(a)
    assert bm.lookup_prefix(make_seq(list(range(12)))) != []
    assert bm.reset_prefix_cache()
    assert not bm.hash_to_block_id and all(b.hash == -1 and b.token_ids == () for b in bm.blocks)
    assert bm.num_free_blocks == 8
    b = make_seq(list(range(12)))
    admit(bm, b)
    assert b.num_computed_tokens == 0   # a miss: computed afresh
    compute(bm, b, 12)
    c = make_seq(list(range(12)))
    admit(bm, c)
    assert c.num_computed_tokens == 8   # and cached again after


def test_allocate_slots_counts_blocks_of_a_chunk_and_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(20)))
    admit(bm, a)
    before = snapshot(bm)
    assert not bm.allocate_slots(a, 13)
    assert snapshot(bm) == before and a.block_table == [] and a.num_computed_tokens == 0
    compute(bm, a, 5)
    before = snapshot(bm)
    assert not bm.allocate_slots(a, 8) and snapshot(bm) == before and len(a.block_table) == 2
    assert bm.allocate_slots(a, 7) and len(a.block_table) == 3


def test_lookup_prefix_has_no_side_effects_and_a_failed_admission_leaves_no_trace():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a, 5)
    bm.deallocate(a)                      # three blocks cached and free, LRU order: tail of the prefix first
    b = make_seq([1, 2, 3, 4] + [9] * 7)  # hits two blocks, then needs 4 more: 6 > 4 blocks
    before = snapshot(bm)
    hits = bm.lookup_prefix(b)
    assert len(hits) == 2 and snapshot(bm) == before
    assert not bm.allocate_slots(b, b.num_tokens - 4, hits)
    assert snapshot(bm) == before and b.block_table == [] and b.num_computed_tokens == 0
    # The hits still count as free in the pool: taking them and 1 fresh block fits (3 of 4 blocks).
    assert bm.num_new_blocks_needed(b, 2, hits) == 3
    assert bm.allocate_slots(b, 2, hits) and b.num_computed_tokens == 4 and b.block_table[:2] == hits


def test_allocate_slots_copies_a_shared_block_before_writing_it():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    compute(bm, parent, 6)
    child = parent.fork(1)
    bm.fork(parent, child)
    parent.append_token(7)
    child.append_token(8)
    assert bm.num_new_blocks_needed(child, 1) == 1   # the shared, partly filled last block is copied
    with pytest.raises(ValueError, match="moves list"):
        bm.allocate_slots(child, 1)
    moves = []
    assert bm.allocate_slots(child, 1, moves=moves)
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert moves == [("copy", parent.block_table[1], child.block_table[1])]
    assert bm.blocks[parent.block_table[1]].ref_count == 1


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences are drawn from a few shared prefixes over a tiny alphabet so prefix hits are frequent."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=3)
        self.running: list[Sequence] = []
        self.shadow: dict[int, list] = {b: [None] * 3 for b in range(12)}   # block -> token held per slot
        self.prefixes = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9, 9], [8, 8, 8, 8]]
        self.counter = 0

    def _write_shadow(self, seq, start, end):
        for pos in range(start, end):
            self.shadow[seq.block_table[pos // 3]][pos % 3] = seq.token_ids[pos]

    @rule(prefix=st.integers(0, 2), cut=st.integers(0, 7), tail=st.lists(st.integers(1, 3), max_size=8))
    def admit(self, prefix, cut, tail):
        tokens = self.prefixes[prefix][:cut] + tail
        if not tokens:
            return
        seq = make_seq(tokens, request_id=str(self.counter))
        self.counter += 1
        hits = self.bm.lookup_prefix(seq)
        num_new = seq.num_tokens - len(hits) * 3
        if not self.bm.allocate_slots(seq, num_new, hits):
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return
        assert seq.num_computed_tokens % 3 == 0 and seq.num_computed_tokens <= len(tokens) - 1
        self._write_shadow(seq, seq.num_computed_tokens, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_full_blocks(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.running))
        seq.append_token(token)
        if not self.bm.allocate_slots(seq, 1):
            self.preempt_seq(seq)
            return
        self._write_shadow(seq, seq.num_computed_tokens, seq.num_tokens)
        seq.num_computed_tokens += 1
        self.bm.cache_full_blocks(seq)

    def preempt_seq(self, seq):
        self.running.remove(seq)
        self.bm.deallocate(seq)
        assert seq.num_computed_tokens == 0 and seq.block_table == []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        self.preempt_seq(data.draw(st.sampled_from(self.running)))

    @invariant()
    def free_iff_unreferenced_and_refcounts_match_holders(self):
        holders = {b: 0 for b in range(self.bm.num_blocks)}
        for seq in self.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                holders[b] += 1
        for b, block in enumerate(self.bm.blocks):
            assert block.ref_count == holders[b]
            assert (b in self.bm.free_block_ids) == (block.ref_count == 0)

    @invariant()
    def hash_table_consistent(self):
        for h, b in self.bm.hash_to_block_id.items():
            assert self.bm.blocks[b].hash == h and len(self.bm.blocks[b].token_ids) == 3

    @invariant()
    def computed_tokens_are_in_the_cache(self):
        for seq in self.running:
            assert len(seq.block_table) * 3 >= seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens):
                assert self.shadow[seq.block_table[pos // 3]][pos % 3] == seq.token_ids[pos], (seq, pos)

    def teardown(self):
        for seq in list(self.running):
            self.preempt_seq(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(block.ref_count == 0 for block in self.bm.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
