"""KV cache groups for models whose layers attend over different windows (Gemma 3's interleaved
local / global layers), after vLLM's hybrid KV cache allocator.

With one block table per request, a block could only be freed when *no* layer can see it any
more, so the windowed (local) layers of Gemma 3 would hold their KV for the whole context just
because the global layers need theirs. Here the layers are split into *KV cache groups* of equal
size, each group holding layers of one window (Gemma-3-270M: 15 local layers with window 512 and
3 global ones -> one global group and five local groups of 3 layers). Every group has its own
block table per request, all groups allocate from one shared :class:`BlockPool`, and a block id
names one *page*: the K/V of ``group_size`` layers for ``block_size`` tokens. The model runner
stores ``group_size`` physical layer buffers and lets layer ``i`` of every group use buffer ``i``
(a block is owned by one group at a time, so the groups never collide).

A local group frees its blocks as they leave the window
(:meth:`KVCacheManager.free_outside_window`), so a long generation holds a bounded number of local
blocks and only the global group grows with the context. Prefix caching works per group (each
group tags its block hashes, so a hit returns that group's own blocks); a prefix hit is the
longest prefix every group has cached. Swap and copy-on-write forks act on every group.

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.request import Request


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: layers that share a block table.

    Attributes:
        sliding_window: the window of every layer in the group, tokens (None = full attention).
        layers: the model's layer indices in the group, ascending; ``len(layers) <= group_size``.
    """

    sliding_window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """Split the layers into KV cache groups of one window each and (almost) equal size.

    One group when every layer has the same window. Otherwise the group size is the layer count
    of the rarest window, layers of each window are cut into groups of that size in layer order
    (the last group of a window may be smaller), and full-attention groups come first.

    Args:
        layer_windows: each layer's window in tokens (None = full attention); non-empty.

    Returns:
        The groups; ``max(len(g.layers))`` is the page size in layers.

    Raises:
        ValueError: no layers.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    if len(by_window) == 1:
        (w, layers), = by_window.items()
        return [KVCacheGroupSpec(w, tuple(layers))]
    size = min(len(v) for v in by_window.values())
    groups = []
    for w, layers in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(w, tuple(layers[i:i + size])))
    return groups


class HybridKVCacheManager:
    """Per-request block tables of several KV cache groups over one shared :class:`BlockPool`
    (vLLM's hybrid KV cache manager); the same interface as :class:`KVCacheManager`, which the
    scheduler and engine use.

    Args:
        num_blocks: pages in the shared pool (>= 1); a page holds ``block_size`` tokens of K/V for
            ``group_size`` layers.
        block_size: token slots per block (>= 1).
        group_windows: every group's window in tokens (None = full attention), from
            :func:`kv_cache_groups`; at least two groups.
        enable_prefix_caching: per-group chained block hashes (vLLM's automatic prefix caching).
        num_host_blocks: pages in the host swap pool (0 = no swap preemption).
        prefix_cache: only ``hash`` (the radix index does not support sliding windows).
        max_step_tokens: most tokens a request computes in one step (the scheduler's token
            budget); sizes :attr:`capacity_tokens`.

    Attributes:
        pool: the shared KV :class:`BlockPool`.
        host_pool: the shared host swap :class:`BlockPool`, or None.
        groups: one :class:`KVCacheManager` per group, in ``group_windows`` order.
        block_size: token slots per block.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up and found cached
            (counted once per request, not per group; the hit is the prefix all groups hold).

    Raises:
        ValueError: fewer than two groups, ``prefix_cache != "hash"``, or the arguments
            :class:`KVCacheManager` rejects.
    """

    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence[int | None],
                 enable_prefix_caching: bool = False, num_host_blocks: int = 0, prefix_cache: str = "hash",
                 max_step_tokens: int = 2048) -> None:
        if len(group_windows) < 2:
            raise ValueError(f"a hybrid KV cache needs at least two groups, got {len(group_windows)}")
        if enable_prefix_caching and prefix_cache != "hash":
            raise ValueError("the radix prefix cache does not support sliding-window models; use --prefix-cache hash")
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.pool = BlockPool(num_blocks)
        self.host_pool: BlockPool | None = BlockPool(num_host_blocks) if num_host_blocks else None
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window=w, pool=self.pool,
                           host_pool=self.host_pool, cache_key_tag=g.to_bytes(2, "little") if g else b"")
            for g, w in enumerate(group_windows)
        ]
        self.group_windows = list(group_windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_step_tokens = max_step_tokens
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ sizes

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks one group needs for ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most pages a request of ``num_tokens`` tokens holds at once, summed over the groups
        (full groups: all its blocks; windowed groups: the window plus one step)."""
        return sum(g.max_blocks_held(num_tokens, max_step_tokens) for g in self.groups)

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """True when a request of ``num_tokens`` tokens fits in the whole pool (all blocks free)."""
        step = num_tokens if max_step_tokens is None else max_step_tokens
        return self.max_blocks_held(num_tokens, step) <= self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Longest single request (tokens) the whole pool holds, with :attr:`max_step_tokens`
        computed per step."""
        lo, hi = 0, self.pool.num_blocks * self.block_size
        while lo < hi:  # largest t with can_ever_fit(t)
            mid = (lo + hi + 1) // 2
            if self.can_ever_fit(mid, self.max_step_tokens):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------------ prefix caching

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest prefix of full blocks that every group has cached.

        Returns:
            ``(per-group block ids, num_cached_tokens)``: each group's hit cut to the common
            length; ``([[], ...], 0)`` without a hit. Pass both on to :meth:`allocate_slots`.
        """
        hits = [g.get_computed_blocks(request)[0] for g in self.groups]
        n = min(len(h) for h in hits)
        return [h[:n] for h in hits], n * self.block_size

    def match_len(self, request: Request) -> int:
        """Prefix-cache match length in tokens (the shortest over the groups)."""
        return min(g.match_len(request) for g in self.groups)

    def reset_prefix_cache(self) -> int:
        """Drop every unused cached block of every group; returns how many hashes were dropped."""
        return self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] | None = None, num_cached_tokens: int | None = None,
                       *, admission: bool = False) -> bool:
        """Grow every group's block table to cover the new tokens (see
        :meth:`KVCacheManager.allocate_slots`). First each windowed group frees the blocks that
        left its window; then, only if the pool has the pages *all* groups need, every group
        allocates (all-or-nothing across the groups).

        Args:
            request, num_new_tokens, admission: as :meth:`KVCacheManager.allocate_slots`.
            computed_blocks: the per-group hit from :meth:`get_computed_blocks`.
            num_cached_tokens: tokens that hit holds (default: its blocks times block size).

        Returns:
            True if every group's table now covers the slots, False if the pool was short.

        Raises:
            ValueError: ``num_new_tokens < 0``, or a hit whose group count or lengths disagree.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        per_group = [list(b) for b in computed_blocks] if computed_blocks else [[] for _ in self.groups]
        if len(per_group) != len(self.groups) or len({len(b) for b in per_group}) != 1:
            raise ValueError("computed_blocks must hold one equally long block list per KV cache group")
        if num_cached_tokens is None:
            num_cached_tokens = len(per_group[0]) * self.block_size
        num_computed = request.num_computed_tokens + num_cached_tokens
        for g in self.groups:
            g.free_outside_window(request, num_computed)
        need = sum(g.num_blocks_needed(request, num_new_tokens, b, num_cached_tokens)
                   for g, b in zip(self.groups, per_group, strict=True))
        if need > self.pool.num_free_blocks:
            return False
        for g, b in zip(self.groups, per_group, strict=True):
            ok = g.allocate_slots(request, num_new_tokens, b, num_cached_tokens)
            assert ok, "a KV cache group failed after the pool was checked"
        if admission:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Every group's planned ``(src, dst)`` page copies since the last call."""
        return [pair for g in self.groups for pair in g.take_block_copies()]

    @property
    def num_cow_copies(self) -> int:
        """Blocks copied on write, all groups (cumulative)."""
        return sum(g.num_cow_copies for g in self.groups)

    # ------------------------------------------------------------------ forks, swap, release

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks of every group with ``child`` (:meth:`KVCacheManager.fork`)."""
        for g in self.groups:
            g.fork(parent, child, num_tokens)

    def reassign(self, moves: Sequence[tuple[Request, Request]], num_tokens: int) -> None:
        """Beam-search reshuffle in every group (:meth:`KVCacheManager.reassign`)."""
        for g in self.groups:
            g.reassign(moves, num_tokens)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's pages of every group to the host pool; None (nothing changed) when
        there is no host pool, the request holds nothing, or the host pool is short."""
        hp = self.host_pool
        if hp is None or not any(g.get_block_table(request.request_id) for g in self.groups):
            return None
        if sum(g.num_request_blocks(request.request_id) for g in self.groups) > hp.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        for g in self.groups:
            if g.get_block_table(request.request_id):
                out = g.swap_out(request)
                assert out is not None
                pairs.extend(out)
        request.swapped_out = True
        return pairs

    def num_blocks_to_swap_in(self, request: Request) -> int:
        """Pages a swapped-out request needs to come back, all groups."""
        return sum(g.num_blocks_to_swap_in(request) for g in self.groups)

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request's pages of every group back; None (nothing changed) when
        it is not swapped out or the pool is short."""
        if not self.is_swapped_out(request.request_id):
            return None
        if self.num_blocks_to_swap_in(request) > self.pool.num_free_blocks:
            return None
        pairs: list[tuple[int, int]] = []
        for g in self.groups:
            if g.is_swapped_out(request.request_id):
                back = g.swap_in(request)
                assert back is not None
                pairs.extend(back)
        request.swapped_out = False
        return pairs

    # ------------------------------------------------------------------ KV import (P/D disaggregation)

    def cached_prefix_blocks(self, request: Request) -> list[list[int]]:
        """Each group's blocks of the longest prefix every group has cached (equal lengths; see
        :meth:`get_computed_blocks`). No ref count changes."""
        return self.get_computed_blocks(request)[0]

    def begin_import(self, request: Request, num_tokens: int) -> list[int] | None:
        """:meth:`KVCacheManager.begin_import` in every group, all or nothing.

        Returns:
            each group's count of leading blocks that were cached already (the caller writes
            the rest of that group's table); None when the pool is short (nothing changed).

        Raises:
            ValueError: as :meth:`KVCacheManager.begin_import`.
        """
        done: list[int] = []
        for g in self.groups:
            try:
                k = g.begin_import(request, num_tokens)
            except ValueError:
                for d in self.groups[: len(done)]:
                    d.abort_import(request)
                raise
            if k is None:
                for d in self.groups[: len(done)]:
                    d.abort_import(request)
                return None
            done.append(k)
        return done

    def commit_import(self, request: Request, num_tokens: int) -> None:
        """:meth:`KVCacheManager.commit_import` in every group."""
        for g in self.groups:
            g.commit_import(request, num_tokens)

    def abort_import(self, request: Request) -> None:
        """:meth:`KVCacheManager.abort_import` in every group (idempotent)."""
        for g in self.groups:
            g.abort_import(request)

    def free(self, request: Request) -> None:
        """Return the request's pages of every group (KV and host pools). Idempotent."""
        for g in self.groups:
            g.free(request)

    # ------------------------------------------------------------------ queries

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """The request's live block table of every group, in group order (do not mutate)."""
        return [g.get_block_table(request_id) for g in self.groups]

    def get_block_table(self, request_id: str) -> list[int]:
        """The first group's block table (a full-attention group when the model has one)."""
        return self.groups[0].get_block_table(request_id)

    def num_request_blocks(self, request_id: str) -> int:
        """Pages held by ``request_id``, all groups (window-freed entries excluded)."""
        return sum(g.num_request_blocks(request_id) for g in self.groups)

    def num_group_blocks(self, request_id: str) -> list[int]:
        """Pages held by ``request_id`` in each group."""
        return [g.num_request_blocks(request_id) for g in self.groups]

    def request_ids(self) -> list[str]:
        """Ids of the requests that currently hold KV blocks."""
        return list(dict.fromkeys(r for g in self.groups for r in g.request_ids()))

    def is_swapped_out(self, request_id: str) -> bool:
        """True while the request's KV lives in the host swap pool."""
        return any(g.is_swapped_out(request_id) for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of the shared pool in use, in [0, 1] (cached-but-unused blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Pages available to new allocations (cached-but-unused ones included)."""
        return self.pool.num_free_blocks
