"""KV-cache block bookkeeping: a free pool, reference counts and prefix caching (no tensors here).

The cache is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence owns a block table (physical
block ids in logical order); block i holds the KV of tokens [i * block_size, (i + 1) * block_size).

Prefix caching: once a block is FULL and its KV computed, it is registered under a chained hash
`hash((parent_hash, tuple(token_ids)))`, so equal hashes mean equal whole prefixes (token ids are kept and
compared too, against hash collisions). A new sequence whose leading full blocks hash the same reuses those
blocks (ref_count + 1) instead of recomputing them. A block whose ref_count drops to 0 goes back to the free
pool but keeps its hash: it can still be hit until it is handed out again. The free pool is LRU ordered
(released blocks go to the tail, allocation takes the head), and a sequence releases its blocks last-first, so
the tail of a prefix is evicted before its head. A sequence on a LoRA adapter computes other KV from the same
tokens: its chain starts from the adapter (`hash_root`) instead of -1, so it hits only blocks of that adapter.

Sharing within a request (parallel sampling, beam search): `fork` gives a child sequence its parent's block
table, taking one more reference on every block. A block is written only at the sequence's next token slot; when
that block is shared (ref_count > 1; only a partly filled last block can be, full blocks are never written again)
`allocate_slots` first gives the writer a private copy (copy-on-write) and records the (src, dst) pair; the engine
issues one `copy_blocks` call for all pairs of a step before the forward.

Admission is look, then take: `lookup_prefix` finds a waiting sequence's cache hits without touching anything,
and `allocate_slots` takes those hits and the blocks for the tokens to compute together, or nothing at all, so a
sequence that does not fit leaves no trace (no act-then-undo).

Swapping: a CPU swap space of `num_swap_blocks` blocks with its own free list and reference counts.
`swap_out(seqs)` moves the distinct blocks of a request's sequences to the swap space (a shared block moves once
and stays shared), `swap_in` moves them back into fresh cache blocks; both record (src, dst) pairs for
`pagedkernels.swap_blocks`, issued by the engine before the forward.

The block manager keeps no list of moves: each verb that decides one (a copy-on-write, a swap) appends it to the
`moves` list its caller passes, the scheduler's list for the step, in the order decided. A block released by a
swap-out or preemption can be handed out again in the same step, so a later move may overwrite what an earlier one
reads; `group_block_moves` cuts the list into runs that are safe to issue as one call each (normally one per kind).

Invariants (checked by tests/engine/test_block_manager.py): a block is in the free pool iff its ref_count is 0;
ref_count equals the number of block tables holding it; every registered hash maps to a block carrying that hash;
the same holds for swap blocks and the tables of swapped sequences.
"""
from collections import OrderedDict

from engine.core.sequence import Sequence


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


def hash_root(seq: Sequence) -> int:
    """The parent hash of `seq`'s first block: -1 on the base model; on a LoRA adapter a value of the adapter's own
    (its id, name and directory: vLLM keys its blocks by the adapter too), so no two adapters share KV blocks."""
    lora = seq.lora_request
    return -1 if lora is None else hash(("lora", lora.lora_int_id, lora.lora_name, lora.lora_path))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0):
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
        self.num_copies = 0                                # total copy-on-write block copies
        self.num_swap_blocks = num_swap_blocks
        self.swap_ref_counts = [0] * num_swap_blocks
        self.free_swap_block_ids: list[int] = list(range(num_swap_blocks - 1, -1, -1))   # pop() takes the lowest

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): the next prompts compute their KV afresh, as a
        benchmark's rounds after the first need. Only while no sequence holds a block: returns False (and changes
        nothing) otherwise."""
        if len(self.free_block_ids) != self.num_blocks:
            return False
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, ()
        return True

    # -- admission and growth ----------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """The prefix-cache hits of a sequence without blocks: ids of the cached blocks holding its leading full
        blocks. No side effects (the scheduler may look and then not admit). Hits never cover the last token,
        whose logits are needed; a request asking for prompt logprobs gets none (the cache holds KV, not logits)."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "lookup_prefix() is for sequences without blocks"
        if not self.enable_prefix_caching or (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0):
            return []
        token_ids = seq.token_ids
        num_full_blocks = (len(token_ids) - 1) // self.block_size
        hit_block_ids, parent_hash = [], hash_root(seq)
        for i in range(num_full_blocks):
            block_tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent_hash = compute_block_hash(parent_hash, block_tokens)
            block_id = self.hash_to_block_id.get(parent_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = ()) -> int:
        """Blocks `allocate_slots(seq, num_new_tokens, cached_block_ids)` takes out of the free pool: fresh blocks
        for the tokens, the private copy when the first block written is shared, and the hits still in the pool."""
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        num_held = len(seq.block_table) + len(cached_block_ids)
        num_fresh = max(self.num_blocks_for(num_computed + num_new_tokens) - num_held, 0)
        num_hits_in_pool = sum(1 for block_id in cached_block_ids if self.blocks[block_id].ref_count == 0)
        return num_fresh + num_hits_in_pool + (not cached_block_ids and self._needs_copy(seq))

    def _needs_copy(self, seq: Sequence) -> bool:
        first = seq.num_computed_tokens // self.block_size
        return first < len(seq.block_table) and self.blocks[seq.block_table[first]].ref_count > 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = (), *,
                       moves: list[tuple[str, int, int]] | None = None) -> bool:
        """All or nothing: give `seq` slots for its next `num_new_tokens` tokens, first taking the prefix-cache
        hits `cached_block_ids` (from `lookup_prefix`; only for a sequence without blocks, whose
        `num_computed_tokens` then covers them) and copying the block about to be written if another sequence
        shares it (copy-on-write: ("copy", src, dst) appended to `moves`, which must then be given). Returns False,
        and changes nothing, when the free pool cannot cover all of it."""
        if cached_block_ids:
            assert not seq.block_table and seq.num_computed_tokens == 0, "cache hits are for sequences without blocks"
        elif seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            # The slots are held already (most decode steps): nothing to take, nor to copy unless the block written
            # first is shared (_needs_copy, inlined: this runs for every running sequence every step).
            table = seq.block_table
            first = seq.num_computed_tokens // self.block_size
            if first >= len(table) or self.blocks[table[first]].ref_count <= 1:
                return True
        if self.num_new_blocks_needed(seq, num_new_tokens, cached_block_ids) > len(self.free_block_ids):
            return False
        # Hits leave the free pool before any fresh block is popped, so popping can never evict one of them.
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        if cached_block_ids:
            seq.block_table = list(cached_block_ids)
            seq.block_table_synced = 0
            seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        if self._needs_copy(seq):
            if moves is None:
                raise ValueError("allocate_slots needs a moves list: the block to write is shared (copy-on-write)")
            first = seq.num_computed_tokens // self.block_size
            src = seq.block_table[first]
            self.blocks[src].ref_count -= 1   # still >= 1: the other holders keep it
            dst = self._pop_free_block()
            seq.block_table[first] = dst
            seq.block_table_synced = min(seq.block_table_synced, first)
            moves.append(("copy", src, dst))
            self.num_copies += 1
        for _ in range(max(self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table), 0)):
            seq.block_table.append(self._pop_free_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a copy of `parent`, see Sequence.fork) now holds every block of the parent too."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def _pop_free_block(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("no free KV-cache block (allocate_slots checks the pool before popping)")
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:   # evict its cached content: the block is about to be overwritten
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = -1, ()
        block.ref_count = 1
        return block_id

    # -- after a step: register newly full blocks ---------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register the blocks of `seq` that are full and computed: its first `num_computed_tokens` tokens (default
        seq.num_computed_tokens; a step's output passes what that step computed, the count having run ahead with
        the next step already scheduled)."""
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        # Computed tokens past the sequence's tokens are accepted drafts not appended yet: not counted until then.
        block_table = seq.block_table
        num_full = min(min(num_computed_tokens, len(seq.token_ids)) // self.block_size, len(block_table))
        if num_full == 0 or self.blocks[block_table[num_full - 1]].hash != -1:
            return   # nothing full, or every full block registered already (most steps)
        # Registered blocks form a prefix of the table (held blocks are never evicted): find where it ends.
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash == -1:
            first -= 1
        parent_hash = self.blocks[seq.block_table[first - 1]].hash if first > 0 else hash_root(seq)
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
            self._release(block_id)
        seq.block_table = []
        seq.block_table_synced = 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Release the blocks of `seq` past the one holding its last token: those a step's rejected draft tokens
        were written to (their KV is dropped; none of these blocks is registered, since a block is cached only
        once its tokens are computed and kept)."""
        num_needed = self.num_blocks_for(seq.num_tokens)
        for block_id in reversed(seq.block_table[num_needed:]):
            self._release(block_id)
        del seq.block_table[num_needed:]
        seq.block_table_synced = min(seq.block_table_synced, num_needed)

    # -- swapping ---------------------------------------------------------------------------------------------------
    @property
    def num_free_swap_blocks(self) -> int:
        return len(self.free_swap_block_ids)

    @staticmethod
    def _distinct_blocks(seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for seq in seqs for b in seq.block_table))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(self._distinct_blocks(seqs)) <= len(self.free_swap_block_ids)

    def swap_out(self, seqs: list[Sequence], moves: list[tuple[str, int, int]]) -> None:
        """Move the blocks of `seqs` (one request) to the swap space; their tables then hold swap block ids.
        Appends the ("swap_out", cache block, swap block) copies to `moves`. The cache blocks are released (a cached prefix block
        stays in the prefix cache until it is handed out again); num_computed_tokens is kept."""
        mapping = {}
        for block_id in self._distinct_blocks(seqs):
            mapping[block_id] = self.free_swap_block_ids.pop()
        for seq in seqs:
            for block_id in reversed(seq.block_table):
                self._release(block_id)
            seq.block_table = [mapping[b] for b in seq.block_table]
            seq.block_table_synced = 0
            for swap_id in seq.block_table:
                self.swap_ref_counts[swap_id] += 1
        moves += [("swap_out", src, dst) for src, dst in mapping.items()]

    def can_swap_in(self, seqs: list[Sequence], num_headroom_blocks: int = 0) -> bool:
        return len(self._distinct_blocks(seqs)) + num_headroom_blocks <= len(self.free_block_ids)

    def swap_in(self, seqs: list[Sequence], moves: list[tuple[str, int, int]]) -> None:
        """Move swapped `seqs` back into fresh cache blocks; appends the ("swap_in", swap block, cache block) copies
        to `moves`."""
        mapping = {}
        for swap_id in self._distinct_blocks(seqs):
            mapping[swap_id] = self._pop_free_block()
            self.blocks[mapping[swap_id]].ref_count = 0
        for seq in seqs:
            for swap_id in seq.block_table:
                self._release_swap(swap_id)
            seq.block_table = [mapping[b] for b in seq.block_table]
            seq.block_table_synced = 0
            for block_id in seq.block_table:
                self.blocks[block_id].ref_count += 1
        moves += [("swap_in", src, dst) for src, dst in mapping.items()]

    def free_swapped(self, seq: Sequence) -> None:
        """Release the swap blocks of a swapped sequence (finished or aborted while swapped)."""
        for swap_id in seq.block_table:
            self._release_swap(swap_id)
        seq.block_table = []
        seq.block_table_synced = 0
        seq.num_computed_tokens = 0

    def _release_swap(self, swap_id: int) -> None:
        self.swap_ref_counts[swap_id] -= 1
        assert self.swap_ref_counts[swap_id] >= 0, f"swap block {swap_id} released more often than taken"
        if self.swap_ref_counts[swap_id] == 0:
            self.free_swap_block_ids.append(swap_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None


def group_block_moves(moves: list[tuple[str, int, int]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """A step's block moves [(kind, src, dst)], in decision order, as [(kind, [(src, dst), ...])] runs to issue in
    order. A run ends where the kind changes or a pair would touch a block already read or written in the run (the
    pairs of one call must be independent)."""
    runs: list[tuple[str, list[tuple[int, int]]]] = []
    reads: set[tuple[str, int]] = set()
    writes: set[tuple[str, int]] = set()
    for kind, src, dst in moves:
        src_key = ("cpu" if kind == "swap_in" else "gpu", src)
        dst_key = ("cpu" if kind == "swap_out" else "gpu", dst)
        if not runs or runs[-1][0] != kind or src_key in writes or dst_key in reads or dst_key in writes:
            runs.append((kind, []))
            reads, writes = set(), set()
        runs[-1][1].append((src, dst))
        reads.add(src_key)
        writes.add(dst_key)
    return runs
