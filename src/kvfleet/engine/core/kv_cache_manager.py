"""Per-request block tables over a :class:`~kvfleet.engine.core.block_pool.BlockPool`.

A request holding ``t`` tokens of KV owns ``ceil(t / block_size)`` blocks; token ``i`` lives in
block ``block_table[i // block_size]`` at offset ``i % block_size`` (the model runner turns this
into a slot mapping). Blocks are allocated on demand as prefill chunks and decodes extend the
request, and all return to the pool when it finishes or is preempted. Technique: PagedAttention
/ vLLM (Kwon et al., SOSP 2023).

Pure Python, no torch.
"""

from __future__ import annotations

from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.request import Request


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).

    Attributes:
        pool: the underlying :class:`BlockPool`.
        block_size: token slots per block.

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """True when ``num_tokens`` tokens fit in the whole pool (all blocks free)."""
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole pool (``num_blocks * block_size``)."""
        return self.pool.num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to cover ``request.num_computed_tokens + num_new_tokens``
        token slots, allocating blocks on demand.

        All-or-nothing: when the pool has fewer free blocks than needed, nothing is allocated
        and False is returned (the scheduler then preempts someone, or waits).

        Args:
            request: the request; only ``request_id`` and ``num_computed_tokens`` are read.
            num_new_tokens: tokens about to be computed this step (>= 0).

        Returns:
            True if the block table now covers the slots, False if the pool was short.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self._tables.get(request.request_id)
        have = len(table) if table is not None else 0
        need = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - have
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        new_blocks = self.pool.allocate(need)
        if table is None:
            self._tables[request.request_id] = new_blocks
        else:
            table.extend(new_blocks)
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (tail blocks first in the free queue)
        and forget its block table. Idempotent: a request without blocks is a no-op."""
        table = self._tables.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's live block table (block ids, in token order); a new empty list if it has none.

        The returned list is the manager's own and grows as the request does; do not mutate it.
        """
        return self._tables.get(request_id, [])

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks currently held by ``request_id``."""
        return len(self._tables.get(request_id, ()))

    def request_ids(self) -> list[str]:
        """Ids of the requests that currently hold blocks."""
        return list(self._tables)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1] (``vllm:kv_cache_usage_perc``)."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the pool."""
        return self.pool.num_free_blocks
