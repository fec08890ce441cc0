"""Per-request block tables over a :class:`~kvfleet.engine.core.block_pool.BlockPool`, with
prefix caching, copy-on-write forks, swap to a host pool and sliding-window block freeing.

A request holding ``t`` tokens of KV owns ``ceil(t / block_size)`` blocks; token ``i`` lives in
block ``block_table[i // block_size]`` at offset ``i % block_size`` (the model runner turns this
into a slot mapping). Blocks are allocated on demand as prefill chunks and decodes extend the
request, and all return to the pool when it finishes or is preempted. Techniques:

- PagedAttention block tables, ref-counted sharing and copy-on-write (Kwon et al., SOSP 2023);
- automatic prefix caching with chained block hashes (vLLM): block ``k``'s hash covers the
  hash of block ``k - 1``, the block's token ids and the request's extra keys (LoRA id,
  ``cache_salt``), so equal hashes mean equal prefixes. SHA-256 makes a collision (and so a
  wrong-prefix hit) practically impossible;
- swap preemption to a host-memory pool (vLLM v0's ``--swap-space``);
- sliding-window attention (Mistral, Jiang et al. 2023): blocks wholly outside every future
  query's window are freed and their table entries set to :data:`NULL_BLOCK`.

Pure Python, no torch. Block copies and swaps are *planned* here (pairs of block ids) and
carried out by the model runner before the next forward.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.core.radix_index import RadixIndex, RadixNode
from kvfleet.engine.request import Request

NULL_BLOCK = -1
"""Block-table entry of a block freed because it lies wholly outside the sliding window.
Never read (always masked); the runner maps it to a valid id when building tensors."""

_ROOT_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """Chained block hash (vLLM's prefix-caching key): SHA-256 over the parent block's hash,
    the block's token ids (int64) and ``repr(extra_keys)``.

    Args:
        parent_hash: hash of the previous block of the same sequence; None for the first block.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the KV of these tokens (LoRA id, cache salt).

    Returns:
        32-byte digest.
    """
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool` (PagedAttention, Kwon et al. 2023).

    Args:
        num_blocks: blocks in the KV pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: register full blocks under their chained hash and reuse them
            for later requests with the same prefix (vLLM's automatic prefix caching).
        sliding_window: attention window in tokens when *every* layer uses one (Mistral
            style), or the recent window of StreamingLLM; blocks no future query can see are
            freed. None = full attention.
        sink_tokens: StreamingLLM attention sinks (Xiao et al. 2024): the blocks holding the
            first ``sink_tokens`` tokens are kept whatever the window (0 = plain window).
        num_host_blocks: blocks in the host swap pool (0 = swap preemption unavailable).
        pool, host_pool: existing pools to allocate from instead of new ones (``num_blocks`` and
            ``num_host_blocks`` are then ignored): the KV cache groups of
            :class:`~kvfleet.engine.core.hybrid_kv_cache_manager.HybridKVCacheManager` share one.
        cache_key_tag: bytes appended to every block hash this manager puts into or looks up in
            the pool's hash index, so that groups sharing a pool never hit each other's blocks.
        prefix_cache: ``hash`` (chained block hashes, full blocks, vLLM) or ``radix``
            (token-granular radix tree, SGLang's RadixAttention: a match may end inside a
            block, whose cached part is reused by copying the block; the tree keeps its own
            refs on cached blocks and evicts least-recently-used unlocked leaves when the pool
            runs short; a running request holds a lock ref on the node it matched).

    Attributes:
        pool: the KV :class:`BlockPool`.
        host_pool: the host swap :class:`BlockPool`, or None.
        block_size: token slots per block.
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative, tokens;
            ``vllm:prefix_cache_queries_total``).
        prefix_cache_hits: of those, tokens found cached (``vllm:prefix_cache_hits_total``).
        num_cow_copies: blocks copied on write (cumulative).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1``, ``sliding_window < 1`` or
            ``num_host_blocks < 0``, an unknown ``prefix_cache``, or the radix cache with a
            sliding window.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None, num_host_blocks: int = 0, prefix_cache: str = "hash",
                 sink_tokens: int = 0, *, pool: BlockPool | None = None, host_pool: BlockPool | None = None,
                 cache_key_tag: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if sink_tokens < 0 or (sink_tokens and sliding_window is None):
            raise ValueError(f"sink_tokens must be >= 0 and needs a window, got {sink_tokens}")
        if prefix_cache not in ("hash", "radix"):
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {prefix_cache!r}")
        if prefix_cache == "radix" and enable_prefix_caching and sliding_window is not None:
            raise ValueError("the radix prefix cache does not support sliding-window models; use --prefix-cache hash")
        if pool is not None and (prefix_cache == "radix" and enable_prefix_caching):
            raise ValueError("a shared block pool (KV cache groups) needs --prefix-cache hash")
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.host_pool: BlockPool | None = host_pool
        if host_pool is None and num_host_blocks:
            self.host_pool = BlockPool(num_host_blocks)
        self._tag = cache_key_tag
        self.radix: RadixIndex | None = None
        if enable_prefix_caching and prefix_cache == "radix":
            self.radix = RadixIndex(self.pool, block_size)
        self._radix_nodes: dict[str, RadixNode] = {}  # node locked by each running request
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.sink_tokens = sink_tokens
        self._num_sink_blocks = -(-sink_tokens // block_size)
        self._tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # full blocks of the request already hashed/cached
        self._num_nulled: dict[str, int] = {}  # leading blocks already freed by the sliding window
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0

    # ------------------------------------------------------------------ sizes

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once when at most
        ``max_step_tokens`` are computed per step: all of them with full attention; with a
        sliding window, the window plus one step's tokens (plus a partial block at each end)."""
        full = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return full
        return min(full, self._num_sink_blocks + self.num_blocks_for(self.sliding_window - 1 + max_step_tokens) + 1)

    def can_ever_fit(self, num_tokens: int, max_step_tokens: int | None = None) -> bool:
        """True when a request of ``num_tokens`` tokens fits in the whole pool (all blocks free)."""
        if max_step_tokens is None:
            return self.num_blocks_for(num_tokens) <= self.pool.num_blocks
        return self.max_blocks_held(num_tokens, max_step_tokens) <= self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole pool (``num_blocks * block_size``)."""
        return self.pool.num_blocks * self.block_size

    # ------------------------------------------------------------------ prefix caching

    def _extend_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Make ``request.block_hashes`` cover its first ``num_full_blocks`` blocks (all tokens known)."""
        hashes = request.block_hashes
        bs = self.block_size
        extra = request.extra_keys
        while len(hashes) < num_full_blocks:
            k = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            request.tokens_slice(k * bs, (k + 1) * bs), extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the request's tokens from position 0.

        At most ``num_tokens - 1`` tokens are matched: the last token is always computed, so
        its logits exist to sample from. Changes no ref count and no statistic.

        Returns:
            ``(block_ids, num_cached_tokens)``: with the hash index ``num_cached_tokens =
            len(block_ids) * block_size``; with the radix index the match is token-granular and
            the last block may be partly valid (:meth:`allocate_slots` copies it);
            ``([], 0)`` when prefix caching is off or the request already holds KV.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens > 0 or request.swapped_out:
            return [], 0
        if self.radix is not None:
            m = self.radix.match_prefix(request.tokens_slice(0, request.num_tokens - 1), request.extra_keys)
            return m.block_ids, m.num_tokens
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._extend_hashes(request, max_blocks)
        blocks: list[int] = []
        for k in range(max_blocks):
            b = self.pool.get_cached_block(hashes[k] + self._tag)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def match_len(self, request: Request) -> int:
        """Prefix-cache match length of a waiting request in tokens, without touching LRU
        state or ref counts (for the ``lpm`` scheduling policy)."""
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return 0
        if self.radix is not None:
            return self.radix.match_len(request.tokens_slice(0, request.num_tokens - 1), request.extra_keys)
        return self.get_computed_blocks(request)[1]

    def _register_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Register the request's blocks that are full within ``num_tokens`` under their hashes."""
        rid = request.request_id
        done = self._num_registered.get(rid, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._extend_hashes(request, full)
        for k in range(done, full):
            b = table[k]
            if b != NULL_BLOCK:
                self.pool.cache_block(b, hashes[k] + self._tag)
        self._num_registered[rid] = full

    def reset_prefix_cache(self) -> int:
        """Drop every unused cached prefix (free cached blocks of the hash index, unlocked nodes
        of the radix tree); returns how many hashes / blocks were dropped."""
        if self.radix is not None:
            before = self.pool.num_free_blocks
            self.radix.reset()
            return self.pool.num_free_blocks - before
        return self.pool.reset_prefix_cache()

    def _ensure_free(self, n: int) -> bool:
        """True when ``n`` blocks are free, evicting radix-tree leaves if needed."""
        short = n - self.pool.num_free_blocks
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        return self.pool.num_free_blocks >= n

    def _radix_insert(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Insert the request's first ``num_tokens`` computed tokens into the radix tree."""
        if self.radix is None or num_tokens <= 0:
            return
        self.radix.insert(request.tokens_slice(0, num_tokens), table[: self.num_blocks_for(num_tokens)],
                          request.extra_keys)

    # ------------------------------------------------------------------ allocation

    def _free_outside_window(self, request: Request, table: list[int], num_computed: int) -> None:
        """Free leading blocks no query at position >= ``num_computed`` can attend to.

        A query at position ``q`` sees keys ``j`` with ``q - window < j <= q``, so every key
        below ``num_computed - window + 1`` is dead once ``num_computed`` tokens are computed
        (except the attention-sink blocks, which stay).
        """
        window = self.sliding_window
        if window is None:
            return
        first_live = num_computed - window + 1
        rid = request.request_id
        k = max(self._num_nulled.get(rid, 0), self._num_sink_blocks)
        dead: list[int] = []
        while k < len(table) and (k + 1) * self.block_size <= first_live:
            if table[k] != NULL_BLOCK:
                dead.append(table[k])
                table[k] = NULL_BLOCK
            k += 1
        self._num_nulled[rid] = k
        if dead:
            self.pool.free(reversed(dead))

    def free_outside_window(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's leading blocks that no query at position >= ``num_computed_tokens``
        can see (sliding window; attention-sink blocks stay). A no-op without a window or a table."""
        table = self._tables.get(request.request_id)
        if table:
            self._free_outside_window(request, table, num_computed_tokens)

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          computed_blocks: Sequence[int] | None = None, num_cached_tokens: int | None = None) -> int:
        """Free pool blocks that :meth:`allocate_slots` with these arguments would take: new
        blocks, copy-on-write copies and prefix-cache hits revived from the free queue. Blocks
        the sliding window would free are not subtracted (call :meth:`free_outside_window`
        first). Changes nothing; hash index only (the radix index may evict instead).

        Raises:
            ValueError: with the radix prefix index.
        """
        if self.radix is not None:
            raise ValueError("num_blocks_needed is not available with the radix prefix index")
        bs = self.block_size
        pool = self.pool
        table = self._tables.get(request.request_id, [])
        computed = list(computed_blocks or ())
        if num_cached_tokens is None:
            num_cached_tokens = len(computed) * bs
        num_computed = request.num_computed_tokens + num_cached_tokens
        end_block = self.num_blocks_for(num_computed + num_new_tokens)
        cow = sum(1 for k in range(num_computed // bs, min(len(table), end_block))
                  if table[k] != NULL_BLOCK and pool.ref_count(table[k]) > 1)
        revive = sum(1 for b in computed if pool.ref_count(b) == 0)
        return max(0, end_block - len(table) - len(computed)) + cow + revive

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] | None = None, num_cached_tokens: int | None = None, *,
                       admission: bool = False) -> bool:
        """Grow the request's block table to cover ``request.num_computed_tokens +
        len(computed_blocks) * block_size + num_new_tokens`` token slots.

        In order: blocks outside the sliding window are freed; the prefix-cache hit
        ``computed_blocks`` (from :meth:`get_computed_blocks`) are shared by ref count; any
        block the new tokens will be written into that is shared with another request (ref
        count > 1, after a fork) is copied on write (the copy is queued for
        :meth:`take_block_copies`); missing blocks are allocated; blocks that became full are
        registered in the prefix cache (their tokens are known; the runner writes them in this
        step before any later step can read them).

        All-or-nothing: when the pool is short, nothing changes and False is returned (the
        scheduler then preempts someone, or waits).

        Args:
            request: the request; ``request_id``, ``num_computed_tokens`` and its tokens are read.
                The caller advances ``num_computed_tokens`` afterwards.
            num_new_tokens: tokens about to be computed this step (>= 0).
            computed_blocks: prefix-cache hit for a request without blocks yet.
            num_cached_tokens: tokens those blocks hold (default ``len(computed_blocks) *
                block_size``); when it ends inside the last block (radix match), that block is
                copied into a new one instead of shared.
            admission: True when the request is being admitted from the waiting queue (counts
                its tokens as prefix-cache queries and the hit as hits).

        Returns:
            True if the block table now covers the slots, False if the pool was short.

        Raises:
            ValueError: ``num_new_tokens < 0``, or ``computed_blocks`` for a request that
                already holds blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        computed_blocks = list(computed_blocks or ())
        table = self._tables.get(rid)
        if computed_blocks and table:
            raise ValueError(f"request {rid} already holds blocks; a prefix hit only applies to a new request")
        if table is None:
            table = []
        bs = self.block_size
        if num_cached_tokens is None:
            num_cached_tokens = len(computed_blocks) * bs
        if self.num_blocks_for(num_cached_tokens) != len(computed_blocks):
            raise ValueError(f"{num_cached_tokens} cached tokens do not fill {len(computed_blocks)} blocks")
        partial = computed_blocks.pop() if num_cached_tokens % bs else None
        num_computed = request.num_computed_tokens + num_cached_tokens
        total = num_computed + num_new_tokens
        self._free_outside_window(request, table, num_computed)
        pool = self.pool
        # Blocks the new tokens are written into that others share: copy on write.
        cow = [k for k in range(num_computed // bs, min(len(table), self.num_blocks_for(total)))
               if table[k] != NULL_BLOCK and (pool.ref_count(table[k]) > 1 or pool.block_hash(table[k]) is not None)]
        need_new = max(0, self.num_blocks_for(total) - len(table) - len(computed_blocks) - (partial is not None))
        revive = sum(1 for b in computed_blocks if pool.ref_count(b) == 0)
        num_copies = sum(1 for k in cow if pool.ref_count(table[k]) > 1) + (partial is not None)
        if computed_blocks or partial is not None:
            pool.incref(computed_blocks + ([partial] if partial is not None else []))  # pin against eviction
            ok = self._ensure_free(need_new + num_copies)
            pool.free(computed_blocks + ([partial] if partial is not None else []))
            revive = sum(1 for b in computed_blocks if pool.ref_count(b) == 0)
            if not ok or need_new + revive + num_copies > pool.num_free_blocks:
                return False
        elif not self._ensure_free(need_new + revive + num_copies):
            return False
        if computed_blocks or partial is not None:
            pool.incref(computed_blocks)
            table.extend(computed_blocks)
            if partial is not None:  # a radix match ending inside a block: copy its cached part
                new = pool.allocate(1)[0]
                self._pending_copies.append((partial, new))
                table.append(new)
            self._num_registered[rid] = len(computed_blocks)  # they are cached already
            if not request.block_hashes and self.radix is None:
                self._extend_hashes(request, len(computed_blocks))
            if self.radix is not None and admission:
                node = self.radix.match_prefix(request.tokens_slice(0, num_cached_tokens), request.extra_keys).node
                self.radix.lock(node)
                self._radix_nodes[rid] = node
        for k in cow:
            old = table[k]
            if pool.ref_count(old) > 1:
                new = pool.allocate(1)[0]
                self._pending_copies.append((old, new))
                pool.free([old])
                table[k] = new
                self.num_cow_copies += 1
            else:  # our own cached block about to change in place: drop it from the index
                pool.uncache_block(old)
        if need_new:
            table.extend(pool.allocate(need_new))
        self._tables[rid] = table
        if admission:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        if self.radix is not None:
            # Full blocks computed before this step join the tree as they complete (readers of a
            # partial match copy blocks before the forward, so only KV already written counts).
            done = request.num_computed_tokens // bs
            if done > self._num_registered.get(rid, 0):
                self._radix_insert(request, table, done * bs)
                self._num_registered[rid] = done
        elif self.enable_prefix_caching:
            self._register_full_blocks(request, table, total)
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies planned since the last call (then forgotten)."""
        out, self._pending_copies = self._pending_copies, []
        return out

    # ------------------------------------------------------------------ forks (copy-on-write)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks covering its first ``num_tokens`` tokens with ``child``
        (ref counts +1, no copy). The child continues from ``num_tokens``; the block it writes
        next is copied on write if the parent still shares it (see :meth:`allocate_slots`).

        Raises:
            ValueError: the child already holds blocks, or the parent's table does not cover
                ``num_tokens`` tokens.
        """
        if self._tables.get(child.request_id) or child.request_id in self._host_tables:
            raise ValueError(f"request {child.request_id} already holds blocks; cannot fork into it")
        src = self._tables.get(parent.request_id, [])
        nb = self.num_blocks_for(num_tokens)
        if len(src) < nb:
            raise ValueError(f"parent {parent.request_id} holds {len(src)} blocks, fewer than the "
                             f"{nb} covering {num_tokens} tokens")
        table = src[:nb]
        self.pool.incref(b for b in table if b != NULL_BLOCK)
        cid = child.request_id
        self._tables[cid] = table
        full = num_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:full]
        self._num_registered[cid] = min(self._num_registered.get(parent.request_id, 0), full)
        self._num_nulled[cid] = min(self._num_nulled.get(parent.request_id, 0), nb)

    def reassign(self, moves: Sequence[tuple[Request, Request]], num_tokens: int) -> None:
        """Beam-search reshuffle: each ``(child, source)`` pair replaces the child's blocks by a
        fork of the source's first ``num_tokens`` tokens. All forks are taken before any old
        table is dropped, so a source may itself be a child of another pair.

        Raises:
            ValueError: a source's table does not cover ``num_tokens`` tokens.
        """
        nb = self.num_blocks_for(num_tokens)
        snap = []
        for child, source in moves:
            src = self._tables.get(source.request_id, [])
            if len(src) < nb:
                raise ValueError(f"request {source.request_id} holds {len(src)} blocks, fewer than {nb}")
            snap.append((child, source, src[:nb], list(source.block_hashes[: num_tokens // self.block_size]),
                         self._num_registered.get(source.request_id, 0), self._num_nulled.get(source.request_id, 0)))
        for _, _, table, _, _, _ in snap:
            self.pool.incref(b for b in table if b != NULL_BLOCK)
        for child, _, _, _, _, _ in snap:
            self._drop_table(child.request_id)
        full = num_tokens // self.block_size
        for child, _, table, hashes, reg, nulled in snap:
            cid = child.request_id
            self._tables[cid] = table
            child.block_hashes = hashes
            self._num_registered[cid] = min(reg, full)
            self._num_nulled[cid] = min(nulled, nb)

    # ------------------------------------------------------------------ swap

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host swap pool (swap preemption).

        Returns:
            ``(device_block, host_block)`` pairs for the runner to copy before the next
            forward; None (nothing changed) when there is no host pool, the request holds no
            blocks, or the host pool is short.
        """
        hp = self.host_pool
        table = self._tables.get(request.request_id)
        if hp is None or not table:
            return None
        live = [b for b in table if b != NULL_BLOCK]
        if len(live) > hp.num_free_blocks:
            return None
        host = iter(hp.allocate(len(live)))
        host_table = [NULL_BLOCK if b == NULL_BLOCK else next(host) for b in table]
        pairs = [(d, h) for d, h in zip(table, host_table) if d != NULL_BLOCK]
        del self._tables[request.request_id]
        self.pool.free(reversed(live))
        self._host_tables[request.request_id] = host_table
        self._num_registered.pop(request.request_id, None)
        request.swapped_out = True
        return pairs

    def num_blocks_to_swap_in(self, request: Request) -> int:
        """KV blocks a swapped-out request needs to come back (0 if it is not swapped out)."""
        return sum(1 for b in self._host_tables.get(request.request_id, ()) if b != NULL_BLOCK)

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request's blocks back into the KV pool.

        Returns:
            ``(host_block, device_block)`` pairs for the runner; None (nothing changed) when the
            request is not swapped out or the KV pool is short.
        """
        host_table = self._host_tables.get(request.request_id)
        if host_table is None:
            return None
        live = [b for b in host_table if b != NULL_BLOCK]
        if not self._ensure_free(len(live)):
            return None
        dev = iter(self.pool.allocate(len(live)))
        table = [NULL_BLOCK if h == NULL_BLOCK else next(dev) for h in host_table]
        pairs = [(h, d) for h, d in zip(host_table, table) if h != NULL_BLOCK]
        del self._host_tables[request.request_id]
        assert self.host_pool is not None
        self.host_pool.free(live)
        self._tables[request.request_id] = table
        request.swapped_out = False
        if self.enable_prefix_caching and self.radix is None:
            self._num_registered[request.request_id] = 0
            self._register_full_blocks(request, table, request.num_computed_tokens)
        return pairs

    # ------------------------------------------------------------------ KV import (P/D disaggregation)

    def cached_prefix_blocks(self, request: Request) -> list[int]:
        """The blocks of the request's longest cached prefix, whole blocks only (a radix match
        ending inside a block is cut back to its last full block). At most ``num_tokens - 1``
        tokens are matched, as in :meth:`get_computed_blocks`; no ref count changes.

        Used by the prefill side of P/D disaggregation to find the KV it exports
        (:mod:`kvfleet.engine.kv_transfer`).
        """
        blocks, num_tokens = self.get_computed_blocks(request)
        return blocks[: num_tokens // self.block_size]

    def begin_import(self, request: Request, num_tokens: int) -> int | None:
        """Give a placeholder ``request`` (holding no blocks) a block table over its first
        ``num_tokens`` tokens whose KV is about to be written from outside (a KV transfer from a
        prefill engine, llm-d / vLLM P/D disaggregation): the locally cached prefix is shared
        (ref count + 1), the remaining blocks are newly allocated and *not yet* registered in
        the prefix cache. Write their KV, then call :meth:`commit_import` (or
        :meth:`abort_import` on failure); :meth:`free` releases the placeholder afterwards (the
        blocks stay cached).

        Args:
            request: the placeholder; its token ids (the whole prompt) and cache salt are read.
            num_tokens: tokens to cover, a multiple of ``block_size``.

        Returns:
            ``k``, the number of leading blocks that were cached already (``table[:k]``); the
            caller writes ``table[k:]`` (:meth:`get_block_table`). None when the pool is short
            (nothing changed).

        Raises:
            ValueError: prefix caching is off (imported blocks could never be found), a
                ``num_tokens`` that is negative, not a multiple of the block size or beyond the
                request's tokens, or a request that already holds blocks.
        """
        bs = self.block_size
        rid = request.request_id
        if not self.enable_prefix_caching:
            raise ValueError("KV import needs prefix caching (--enable-prefix-caching)")
        if num_tokens < 0 or num_tokens % bs or num_tokens > request.num_tokens:
            raise ValueError(f"num_tokens must be a multiple of the block size {bs} within the request's "
                             f"{request.num_tokens} tokens, got {num_tokens}")
        if self._tables.get(rid) or rid in self._host_tables:
            raise ValueError(f"request {rid} already holds blocks; cannot import into it")
        n = num_tokens // bs
        hit = self.cached_prefix_blocks(request)[:n]
        pool = self.pool
        if hit:
            pool.incref(hit)  # share them; also pins them against eviction by the allocation below
        if not self._ensure_free(n - len(hit)):
            if hit:
                pool.free(hit)
            return None
        self._tables[rid] = hit + pool.allocate(n - len(hit))
        self._num_registered[rid] = len(hit)
        return len(hit)

    def commit_import(self, request: Request, num_tokens: int) -> None:
        """Register the first ``num_tokens`` tokens of an import (:meth:`begin_import`) in the
        prefix cache, once the runner has written their KV: hash index entries (a hash another
        block already holds keeps that block) or radix-tree insertion.

        Raises:
            ValueError: the request holds no import of that many tokens.
        """
        table = self._tables.get(request.request_id)
        if not table or len(table) * self.block_size < num_tokens:
            raise ValueError(f"request {request.request_id} holds no import of {num_tokens} tokens")
        if self.radix is not None:
            self._radix_insert(request, table, num_tokens)
        else:
            self._register_full_blocks(request, table, num_tokens)
        request.num_computed_tokens = num_tokens

    def abort_import(self, request: Request) -> None:
        """Give back the blocks of an import that was not committed: the new blocks return to
        the pool unregistered, the shared cached ones lose the placeholder's ref. Idempotent."""
        if self.radix is None or request.num_computed_tokens == 0:
            self._drop_table(request.request_id)
        else:  # committed already: a normal free (the tree keeps the blocks)
            self.free(request)

    # ------------------------------------------------------------------ release

    def _drop_table(self, rid: str) -> None:
        table = self._tables.pop(rid, None)
        if table:
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        host = self._host_tables.pop(rid, None)
        if host and self.host_pool is not None:
            self.host_pool.free(b for b in host if b != NULL_BLOCK)
        self._num_registered.pop(rid, None)
        self._num_nulled.pop(rid, None)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks (KV pool and host swap pool) and forget its block
        table. Tail blocks go first into the free queue, so the prefix cache evicts a sequence's
        end before its shared beginning. With the radix index, the request's computed tokens
        are inserted into the tree first (which keeps refs on their blocks) and its lock on the
        node it matched is released. Idempotent: a request without blocks is a no-op."""
        rid = request.request_id
        table = self._tables.get(rid)
        if self.radix is not None and table:
            self._radix_insert(request, table, request.num_computed_tokens)
        node = self._radix_nodes.pop(rid, None)
        if node is not None and self.radix is not None:
            self.radix.unlock(node)
        self._drop_table(rid)
        request.swapped_out = False

    # ------------------------------------------------------------------ queries

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table of every KV cache group: ``[get_block_table(request_id)]``
        here (one group); see :class:`~kvfleet.engine.core.hybrid_kv_cache_manager.HybridKVCacheManager`."""
        return [self.get_block_table(request_id)]

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's live block table (block ids in token order, :data:`NULL_BLOCK` for
        blocks freed by the sliding window); a new empty list if it has none.

        The returned list is the manager's own and grows as the request does; do not mutate it.
        """
        return self._tables.get(request_id, [])

    def num_request_blocks(self, request_id: str) -> int:
        """KV blocks currently held by ``request_id`` (window-freed entries excluded)."""
        return sum(1 for b in self._tables.get(request_id, ()) if b != NULL_BLOCK)

    def request_ids(self) -> list[str]:
        """Ids of the requests that currently hold KV blocks."""
        return list(self._tables)

    def is_swapped_out(self, request_id: str) -> bool:
        """True while the request's KV lives in the host swap pool."""
        return request_id in self._host_tables

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1] (``vllm:kv_cache_usage_perc``); blocks that
        only hold cached prefixes count as free (they are evictable)."""
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations: free ones (cached-but-unused included) plus,
        with the radix index, blocks only held by unlocked tree nodes."""
        free = self.pool.num_free_blocks
        if self.radix is not None:
            free += self.radix.num_evictable_blocks
        return free
