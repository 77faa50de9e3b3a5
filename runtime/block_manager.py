"""`KVCacheManager`: the paged KV cache's block accounting and prefix cache (no tensors here).

Owns which physical block holds which sequence's tokens, reference counts, the prefix-cache
hash map and the two pools of unreferenced blocks. Must not touch the KV tensors (the runner
and the attention plugins do) nor decide who runs (the scheduler does): the scheduler only sees
opaque `KVBlocks` / `KVAllocation` results, `None` when there is no room (vLLM v1's contract).

Block states (every block is in exactly one):

    held       ref_cnt > 0; listed ref_cnt times across sequences' block tables
    evictable  ref_cnt == 0, has a hash: content still valid, reusable on a prefix hit (LRU order)
    free       ref_cnt == 0, no hash: nothing worth keeping

    allocation takes `free` first, then evicts the least recently freed `evictable` block
    (dropping its hash). A prefix hit takes an `evictable` block back (ref 0 -> 1) or shares a
    `held` one (ref n -> n+1).

Prefix caching (vLLM's automatic prefix caching / SGLang's RadixAttention idea, flattened):
only FULL blocks are hashed, as a chain `h_i = sha256(h_{i-1} || tokens of block i)`, so a
hash names the whole prefix up to and including that block. sha256 rather than Python's `hash`
so that a crafted prompt cannot collide into another user's cached KV. A lookup never covers
the whole sequence: its last token is always recomputed so the step yields logits.

A block is hashed when it is scheduled to be filled, not after (vLLM v1's rule), so requests
admitted in the same step share a prompt's blocks instead of each computing it (n choices, a
batch with a common system prompt): every layer writes the whole step's K/V before any of the
step's attention reads it. Hashes given since the last `commit_pending()` are pending: a step
that fails drops them (`forget_pending()`), since the KV they name may never have been written.

`check_integrity()` verifies all of the above and raises AssertionError on any drift.
"""

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

BlockHash = bytes
_ROOT_HASH: BlockHash = b"qkiln-kv-root"


def hash_block_tokens(parent_hash: BlockHash, token_ids) -> BlockHash:
    """Chained hash of one full block: depends on every token before it, through the parent."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class KVBlocks:
    """A prefix-cache hit for one sequence; pass it back to `allocate_slots` unchanged."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    num_query_tokens: int = 0


@dataclass(frozen=True)
class KVAllocation:
    """What `allocate_slots` did. The runner reads block tables through `block_table`."""

    new_block_ids: tuple[int, ...]
    num_cached_tokens: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._hash_to_block: dict[BlockHash, int] = {}
        self._seq_blocks: dict = {}  # seq_id -> list[block_id], in token order
        self._seq_hashes: dict = {}  # seq_id -> chained hashes of its full blocks (tokens never change)
        self._num_hashed_blocks: dict = {}  # seq_id -> leading blocks already offered to the hash map
        self._pending: list[int] = []  # blocks hashed since the last commit_pending()
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens found cached

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq_blocks.get(seq_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, seq, lookup: bool = True) -> tuple[KVBlocks, int]:
        """Longest cached prefix of `seq` in full blocks, never all of its tokens (none without
        `lookup`: a sequence that must compute every token)."""
        if not (self.enable_prefix_caching and lookup):
            return KVBlocks(), 0  # nothing looked up: not a miss in the hit rate
        # (n - 1) // bs: with n a multiple of bs the last block is left out, so >= 1 token is computed.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._block_hashes(seq, max_blocks):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_tokens = len(block_ids) * self.block_size
        return KVBlocks(tuple(block_ids), num_tokens, seq.num_tokens), num_tokens

    # ----------------------------------------------------------------- actions
    def allocate_slots(self, seq, num_new_tokens: int, computed_blocks: KVBlocks | None = None):
        """Make room for `num_new_tokens` after the computed ones; `None` (and no change) if full.

        With `computed_blocks` (first allocation of a sequence, from `get_computed_blocks`),
        the hit blocks are taken first and the new tokens follow them; otherwise they follow
        `seq.num_computed_tokens`.
        """
        held = self._seq_blocks.get(seq.seq_id, [])
        hit = computed_blocks.block_ids if computed_blocks is not None else ()
        if computed_blocks is not None:
            assert not held, f"sequence {seq.seq_id!r} already holds blocks; computed_blocks is for admission"
            num_computed = computed_blocks.num_tokens
        else:
            num_computed = seq.num_computed_tokens
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_new = max(0, num_required - len(held) - len(hit))
        # A hit block waiting in the evictable pool leaves it when taken, so it is not room.
        num_hit_evictable = sum(1 for b in hit if self.blocks[b].ref_cnt == 0)
        if num_new > self.num_free_blocks - num_hit_evictable:
            return None
        for block_id in hit:
            self._take_cached_block(block_id)
        new_ids = tuple(self._take_free_block() for _ in range(num_new))
        blocks = self._seq_blocks.setdefault(seq.seq_id, [])
        blocks.extend(hit)
        blocks.extend(new_ids)
        if computed_blocks is not None:
            self._num_hashed_blocks[seq.seq_id] = len(hit)
            # the hit rate is of prompts: a preempted sequence finding its own freed blocks again
            # (and looking up its outputs) counted as hits the cache never gave another request
            if self.enable_prefix_caching and seq.num_preemptions == 0:
                self.prefix_cache_queries += computed_blocks.num_query_tokens
                self.prefix_cache_hits += computed_blocks.num_tokens
        return KVAllocation(new_ids, num_computed if computed_blocks is not None else 0)

    def cache_full_blocks(self, seq, num_computed_tokens: int | None = None) -> None:
        """Register hashes of the blocks full of computed tokens not registered before, counting
        `num_computed_tokens` of them (default: the sequence's; the scheduler passes what this
        step will have computed). They stay pending until `commit_pending()`."""
        if not self.enable_prefix_caching:
            return
        blocks = self._seq_blocks[seq.seq_id]
        if num_computed_tokens is None:
            num_computed_tokens = seq.num_computed_tokens
        num_full = num_computed_tokens // self.block_size
        start = self._num_hashed_blocks.get(seq.seq_id, 0)
        if num_full <= start:
            return
        assert num_full <= len(blocks), f"sequence {seq.seq_id!r} computed tokens it holds no block for"
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            block = self.blocks[blocks[i]]
            if block.block_hash is not None:
                assert block.block_hash == hashes[i], f"block {block.block_id} hash changed under a holder"
            elif hashes[i] not in self._hash_to_block:
                # If another sequence computed the same prefix concurrently, its block keeps the
                # hash and this duplicate stays unhashed (it goes straight to `free` when released).
                block.block_hash = hashes[i]
                self._hash_to_block[hashes[i]] = block.block_id
                self._pending.append(block.block_id)
        self._num_hashed_blocks[seq.seq_id] = num_full

    def commit_pending(self) -> None:
        """The step that fills the pending blocks ran: their hashes name written KV."""
        self._pending.clear()

    def forget_pending(self) -> None:
        """Drop the pending hashes (their step failed). Whoever holds one of those blocks must be
        freed and recomputed: the scheduler preempts the failed step's sequences."""
        for block_id in self._pending:
            block = self.blocks[block_id]
            if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id:
                del self._hash_to_block[block.block_hash]
            block.block_hash = None
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._free.append(block_id)
        self._pending.clear()

    def free(self, seq) -> None:
        """Release all of `seq`'s blocks; safe to call on a sequence that holds none."""
        blocks = self._seq_blocks.pop(seq.seq_id, [])
        self._seq_hashes.pop(seq.seq_id, None)
        self._num_hashed_blocks.pop(seq.seq_id, None)
        # Tail first: the end of a sequence is the least shareable prefix, so it is evicted first.
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after new weights); cached content is no longer reusable."""
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()
        self._pending.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    # ----------------------------------------------------------------- internals
    def _block_hashes(self, seq, num_blocks: int) -> list[BlockHash]:
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        tokens = seq.token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def _take_cached_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id, \
            f"prefix hit on block {block_id} whose hash was dropped between lookup and allocation"
        if block.ref_cnt == 0:
            del self._evictable[block_id]
        block.ref_cnt += 1

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
        self.blocks[block_id].ref_cnt = 1
        return block_id

    def check_integrity(self) -> None:
        """Raise AssertionError if any accounting invariant of the module docstring is broken."""
        free, evictable = list(self._free), list(self._evictable)
        free_set, evictable_set = set(free), set(evictable)
        assert len(free_set) == len(free), "a block is on the free list twice"
        assert not free_set & evictable_set, f"blocks both free and evictable: {free_set & evictable_set}"
        holders = Counter()
        for seq_id, blocks in self._seq_blocks.items():
            assert len(set(blocks)) == len(blocks), f"sequence {seq_id!r} lists a block twice: {blocks}"
            assert self._num_hashed_blocks.get(seq_id, 0) <= len(blocks), f"sequence {seq_id!r} hashed too far"
            holders.update(blocks)
        for block in self.blocks:
            b = block.block_id
            assert block.ref_cnt == holders.get(b, 0), \
                f"block {b}: ref_cnt {block.ref_cnt} but held by {holders.get(b, 0)} sequences"
            if block.ref_cnt > 0:
                assert b not in free_set and b not in evictable_set, f"block {b} is held and also free"
            else:
                assert (b in free_set) != (b in evictable_set), f"unreferenced block {b} is in no pool"
            assert b not in free_set or block.block_hash is None, f"free block {b} still has a hash"
            assert b not in evictable_set or block.block_hash is not None, f"evictable block {b} has no hash"
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) == b, f"block {b}'s hash maps elsewhere"
        for block_hash, b in self._hash_to_block.items():
            assert self.blocks[b].block_hash == block_hash, f"hash map points at block {b} with another hash"
        for b in self._pending:  # mid-step: hashed when scheduled, so forget_pending can find them
            block_hash = self.blocks[b].block_hash
            assert block_hash is not None and self._hash_to_block.get(block_hash) == b, \
                f"pending block {b} lost its hash"
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        assert len(free) + len(evictable) + num_used == self.num_blocks, \
            f"free {len(free)} + evictable {len(evictable)} + used {num_used} != total {self.num_blocks}"
