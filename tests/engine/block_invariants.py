"""The block manager's invariants, checked by the state machines that drive the real scheduler and block manager
with a fake model (tests/engine/test_abort_metrics.py, tests/engine/test_spec_decode.py)."""
from engine.core.sequence import SequenceStatus


def assert_refcounts_match_holders(block_manager, groups) -> None:
    """A block's (and a swap block's) reference count is the number of live sequences' tables holding it, and it
    is in the free pool exactly when that is 0."""
    holders, swap_holders = {}, {}
    for group in groups:
        for seq in group.seqs:
            table = swap_holders if seq.status is SequenceStatus.SWAPPED else holders
            for block_id in seq.block_table:
                table[block_id] = table.get(block_id, 0) + 1
    for block in block_manager.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in block_manager.free_block_ids)
    for swap_id, count in enumerate(block_manager.swap_ref_counts):
        assert count == swap_holders.get(swap_id, 0)
        assert (count == 0) == (swap_id in block_manager.free_swap_block_ids)


def finish_all_and_assert_released(scheduler, groups) -> None:
    """Finish what is left: nothing is scheduled any more and every block and swap block is free."""
    for group in groups:
        for seq in group.unfinished_seqs:
            scheduler.finish(seq)
    block_manager = scheduler.block_manager
    assert not scheduler.has_unfinished()
    assert block_manager.num_free_blocks == block_manager.num_blocks
    assert block_manager.num_free_swap_blocks == block_manager.num_swap_blocks
