"""Fixed pool of KV cache block ids with reference counts, a free queue and a block-hash index.

The KV cache is split into fixed-size blocks of ``block_size`` token slots; a request's
KV lives in a list of (not necessarily contiguous) blocks, its *block table*. This module
only does the bookkeeping over integer block ids ``0 .. num_blocks - 1``; the model runner
owns the tensors the ids index. Technique: PagedAttention / vLLM (Kwon et al., SOSP 2023).

Prefix caching (vLLM's automatic prefix caching): a full block can be registered under its
*block hash*; when its last owner frees it, it keeps its content and its hash while it waits
in the free queue, so a later request with the same prefix revives it with :meth:`incref`
instead of recomputing it. The free queue is therefore also the LRU list of cached blocks:
a block is evicted from the hash index only when :meth:`allocate` hands it out for new
content, oldest-freed first.

Pure Python, no torch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool holds fewer free blocks than an allocation asked for (nothing was allocated)."""


class BlockPool:
    """Fixed pool of KV block ids ``0 .. num_blocks - 1`` with ref counts and a free queue
    (PagedAttention, Kwon et al. 2023).

    A block is *free* when its ref count is 0; free blocks wait in a FIFO free queue
    (least recently freed first), so that a later prefix cache can evict the coldest block
    first. Sharing (copy-on-write forks, prefix caching) raises a block's ref count with
    :meth:`incref`; :meth:`free` lowers it.

    Attributes:
        num_blocks: total blocks in the pool (>= 1).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks: int = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # Insertion-ordered set of free block ids: O(1) pop from the front, O(1) removal
        # of an arbitrary id (needed when a free cached block is revived by incref).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_evictions: int = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref count > 0, in [0, 1] (``vllm:kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (oldest-freed first) and set their ref counts to 1.

        Args:
            n: number of blocks (>= 0).

        Returns:
            ``n`` distinct block ids.

        Raises:
            ValueError: ``n < 0``.
            NoFreeBlocksError: fewer than ``n`` blocks are free; nothing is allocated.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, only {len(self._free)} of {self.num_blocks} free")
        out: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._ref_counts[block_id] = 1
            h = self._block_hash[block_id]
            if h is not None:  # evict its cached content: it is about to be overwritten
                self._block_hash[block_id] = None
                del self._cached[h]
                self.num_evictions += 1
            out.append(block_id)
        return out

    # ------------------------------------------------------------------ block hashes

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block registered under ``block_hash`` (in use or free-but-cached), or None."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash.

        Returns:
            True if registered; False when another block already holds this hash (two requests
            computed the same prefix at once: the first stays the cached copy) or the block
            already has a hash.

        Raises:
            ValueError: id out of range, or the block is free (only in-use content is cached).
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only in-use blocks can be cached")
        if self._block_hash[block_id] is not None or block_hash in self._cached:
            return False
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash a block is cached under, or None."""
        self._check_id(block_id)
        return self._block_hash[block_id]

    def uncache_block(self, block_id: int) -> None:
        """Drop a block from the hash index (its content is about to change in place)."""
        self._check_id(block_id)
        h = self._block_hash[block_id]
        if h is not None:
            self._block_hash[block_id] = None
            del self._cached[h]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the hash index (in use or free)."""
        return len(self._cached)

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all *free* cached blocks (in-use ones stay cached).

        Returns:
            the number of hashes dropped.
        """
        dropped = 0
        for b in list(self._free):
            h = self._block_hash[b]
            if h is not None:
                self._block_hash[b] = None
                del self._cached[h]
                dropped += 1
        return dropped

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a block listed twice gets two).

        A free block (ref count 0) is taken out of the free queue and becomes used again;
        this is how a prefix cache revives a cached block whose owner has finished.

        Raises:
            ValueError: an id is out of range (nothing is changed).
        """
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
        for b in ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching ref count 0 goes to the back of
        the free queue (in the order given, so pass a block table reversed to make its tail the
        first to be reused).

        Raises:
            ValueError: an id is out of range, or would drop below ref count 0 (freeing a free
                block, or listing a block more often than its ref count); nothing is changed.
        """
        ids = list(block_ids)
        for b, times in Counter(ids).items():
            self._check_id(b)
            if self._ref_counts[b] < times:
                raise ValueError(
                    f"block {b} freed {times} time(s) but its ref count is {self._ref_counts[b]}"
                )
        for b in ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block_id: int) -> int:
        """Current ref count of ``block_id`` (0 = free).

        Raises:
            ValueError: id out of range.
        """
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Free block ids in free-queue order (next to be allocated first). For tests and debugging."""
        return list(self._free)

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free_blocks})"
