"""KV-cache block bookkeeping: a free pool, reference counts and prefix caching (no tensors here).

The cache is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence owns a block table (physical
block ids in logical order); block i holds the KV of tokens [i * block_size, (i + 1) * block_size).

Prefix caching: once a block is FULL and its KV computed, it is registered under a chained hash
`hash((parent_hash, tuple(token_ids)))`, so equal hashes mean equal whole prefixes (token ids are kept and
compared too, against hash collisions). A new sequence whose leading full blocks hash the same reuses those
blocks (ref_count + 1) instead of recomputing them. A block whose ref_count drops to 0 goes back to the free
pool but keeps its hash: it can still be hit until it is handed out again. The free pool is LRU ordered
(released blocks go to the tail, allocation takes the head), and a sequence releases its blocks last-first, so
the tail of a prefix is evicted before its head.

Invariants (checked by tests/engine/test_block_manager.py): a block is in the free pool iff its ref_count is 0;
ref_count equals the number of block tables holding it; every registered hash maps to a block carrying that hash.
"""
from collections import OrderedDict

from engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1   # -1: not registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()


def compute_block_hash(parent_hash: int, token_ids) -> int:
    """Chained hash of one full block: depends on the block's tokens and, through parent_hash, on all before."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # LRU: head first out
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission: prefix-cache lookup --------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Admit a sequence without blocks: take every prefix-cache hit on its leading full blocks and set
        `num_computed_tokens` (and `num_cached_tokens`) to the tokens they cover. At least the last token is
        always left to compute, since its logits are needed. Blocks for tokens still to compute come from
        `may_append`."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "allocate() is for sequences without blocks"
        hit_block_ids = self._lookup_prefix(seq.token_ids)
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hit_block_ids
        seq.num_computed_tokens = len(hit_block_ids) * self.block_size

    def _lookup_prefix(self, token_ids: list[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        # Hits cover at most len - 1 tokens: the last token must run through the model to produce logits.
        num_full_blocks = (len(token_ids) - 1) // self.block_size
        hit_block_ids, parent_hash = [], -1
        for i in range(num_full_blocks):
            block_tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent_hash = compute_block_hash(parent_hash, block_tokens)
            block_id = self.hash_to_block_id.get(parent_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table), 0)

    # -- growth: blocks for the tokens about to be computed ----------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether the free pool can cover the next `num_new_tokens` tokens of `seq` (a prefill chunk or a decode)."""
        return self.num_new_blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Grow `seq.block_table` so it has slots for tokens up to num_computed_tokens + num_new_tokens."""
        for _ in range(self.num_new_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._pop_free_block())

    def _pop_free_block(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("no free KV-cache block (the scheduler must check can_append first)")
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:   # evict its cached content: the block is about to be overwritten
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = -1, ()
        block.ref_count = 1
        return block_id

    # -- after a step: register newly full blocks ---------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full and computed (call after num_computed_tokens advanced)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        # Registered blocks form a prefix of the table (held blocks are never evicted): find where it ends.
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash == -1:
            first -= 1
        parent_hash = self.blocks[seq.block_table[first - 1]].hash if first > 0 else -1
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            block_tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block.hash = compute_block_hash(parent_hash, block_tokens)
            block.token_ids = block_tokens
            # If an equal block is already registered (computed concurrently by another sequence), keep that one.
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
            parent_hash = block.hash

    # -- release --------------------------------------------------------------------------------------------------
    def deallocate(self, seq: Sequence) -> None:
        """Release all blocks of `seq` (finished, aborted or preempted) and reset its computed-token count."""
        for block_id in reversed(seq.block_table):   # tail first: evicted before the shared head of a prefix
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released more often than taken"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
