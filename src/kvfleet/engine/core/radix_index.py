"""Token-granular radix-tree prefix index over the paged KV block pool.

Technique: RadixAttention (SGLang; Zheng et al., "SGLang: Efficient Execution of Structured
Language Model Programs", NeurIPS 2024). Finished (and running) requests leave their prompt
and output tokens in a radix tree whose edges are token runs; a new request walks the tree
to find the longest cached prefix of its tokens, at token granularity, so a match may end in
the middle of a KV block (the caller then copies that partial block before writing into it).
Least-recently-used leaves are evicted when the pool runs short; nodes used by running
requests are protected by lock refs.

Mapping onto the paged pool (:class:`~kvfleet.engine.core.block_pool.BlockPool`): a node
holds the token run at absolute positions ``[start, end)`` of its path, and for every block
index ``k`` in ``start // block_size .. (end - 1) // block_size`` the physical block id that
the request which inserted the run (its *owner*) used for block ``k``. That block holds valid
KV for every position of block ``k`` up to ``end``: the owner wrote (or copied) all of them,
and the positions before ``start`` are the shared prefix. So the block table of a match takes,
for each block index, the block recorded by the deepest matched node overlapping it. Each
node holds one pool reference on each block it records (:meth:`BlockPool.incref`); evicting
the node drops them (:meth:`BlockPool.free`), and a block returns to the free queue once no
request and no tree node references it.

Also :func:`order_by_longest_prefix`, SGLang's longest-prefix-match ("lpm") scheduling order.

Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvfleet.engine.core.block_pool import BlockPool

T = TypeVar("T")

__all__ = ["RadixIndex", "RadixMatch", "RadixNode", "order_by_longest_prefix"]


class RadixNode:
    """One node of the radix tree: a token run of the cached path and the blocks holding it.

    Attributes:
        parent: parent node (None for the root and for evicted nodes).
        children: child nodes keyed by their first token id (at the root: by
            ``(extra_key, first token id)``, so every extra key has its own subtree).
        tokens: the token ids of the run, positions ``[start, end)`` of the path.
        start: absolute position of the first token of the run (0 for children of the root).
        blocks: physical block ids for block indices ``start // block_size ..
            (end - 1) // block_size`` (empty for the root); the node holds one pool ref on each.
        extra_key: the extra key of the subtree (LoRA id, cache salt), None for the root.
        lock_ref: number of outstanding :meth:`RadixIndex.lock` calls on this node or a
            descendant; a node with ``lock_ref > 0`` is never evicted.
        last_access: value of the index's monotonic access counter at the last match/insert
            that went through this node (larger = more recent).
        evicted: True once the node has been removed from the tree.
    """

    __slots__ = ("parent", "children", "tokens", "start", "blocks", "extra_key", "lock_ref", "last_access", "evicted")

    def __init__(
        self,
        parent: RadixNode | None,
        tokens: tuple[int, ...],
        start: int,
        blocks: list[int],
        extra_key: Hashable | None,
        last_access: int,
    ) -> None:
        self.parent = parent
        self.children: dict[Hashable, RadixNode] = {}
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access = last_access
        self.evicted = False

    @property
    def end(self) -> int:
        """Absolute position one past the last token of the run."""
        return self.start + len(self.tokens)

    @property
    def is_root(self) -> bool:
        """True for the tree root (it holds no tokens and is never evicted)."""
        return self.parent is None and not self.evicted

    def __repr__(self) -> str:
        return (
            f"RadixNode([{self.start}, {self.end}), blocks={self.blocks}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass
class RadixMatch:
    """Result of :meth:`RadixIndex.match_prefix`.

    Attributes:
        num_tokens: number of leading tokens found in the cache (token-granular: may end in
            the middle of a block).
        block_ids: ``ceil(num_tokens / block_size)`` block ids; ``block_ids[k]`` holds valid
            KV for positions ``[k * block_size, min((k + 1) * block_size, num_tokens))``. The
            last one is only partially valid when ``num_tokens % block_size != 0``; the caller
            must copy it before writing further positions into it. No refs are taken: call
            :meth:`BlockPool.incref` on blocks it wants to share, and :meth:`RadixIndex.lock`
            on ``node`` to keep them cached.
        node: deepest node the match touched (the one holding the last matched token, which
            may be only partly matched); the root when ``num_tokens == 0``.
    """

    num_tokens: int
    block_ids: list[int]
    node: RadixNode


def _check_hashable(extra_key: Hashable | None) -> None:
    try:
        hash(extra_key)
    except TypeError as e:
        raise ValueError(f"extra_key must be hashable, got {type(extra_key).__name__}") from e


class RadixIndex:
    """Radix-tree prefix cache index over a :class:`BlockPool` (SGLang RadixAttention,
    Zheng et al. 2024), token-granular, with LRU leaf eviction and lock refs.

    The index never allocates blocks; it only takes references on blocks that a request
    owns when the request's tokens are inserted (:meth:`insert`), and drops them on eviction.

    Args:
        pool: the block pool whose ids the tree references.
        block_size: token slots per block (>= 1), as used by the pool's owner.

    Raises:
        ValueError: ``block_size < 1``.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._clock = 0
        self.root = RadixNode(None, (), 0, [], None, 0)
        self._num_cached_tokens = 0
        # block id -> number of *unlocked* tree nodes referencing it (for num_evictable_blocks).
        self._unlocked_refs: Counter[int] = Counter()

    # ------------------------------------------------------------------ helpers

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, node: RadixNode, token: int, extra_key: Hashable | None) -> Hashable:
        return (extra_key, token) if node is self.root else token

    def _node_key(self, node: RadixNode) -> Hashable:
        assert node.parent is not None
        return self._child_key(node.parent, node.tokens[0], node.extra_key)

    def _drop_unlocked_refs(self, blocks: list[int]) -> None:
        refs = self._unlocked_refs
        for b in blocks:
            refs[b] -= 1
            if refs[b] == 0:
                del refs[b]

    def _block_range(self, start: int, end: int) -> range:
        """Block indices overlapping positions [start, end) (end > start)."""
        return range(start // self.block_size, (end - 1) // self.block_size + 1)

    def _walk(self, tokens: tuple[int, ...], extra_key: Hashable | None) -> tuple[int, list[RadixNode], int]:
        """Follow ``tokens`` down the tree.

        Returns:
            (matched tokens, matched nodes from the root's child down, tokens matched in the
            last node — equal to its length when the last node is fully matched).
        """
        node = self.root
        pos = 0
        path: list[RadixNode] = []
        in_last = 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(self._child_key(node, tokens[pos], extra_key))
            if child is None:
                break
            run = child.tokens
            length = len(run)
            if tokens[pos : pos + length] == run:
                k = length
            else:
                k = 1  # first token matched via the child key
                limit = min(length, n - pos)
                while k < limit and tokens[pos + k] == run[k]:
                    k += 1
            path.append(child)
            pos += k
            in_last = k
            if k < length:
                break
            node = child
        return pos, path, in_last

    def _table(self, path: list[RadixNode], num_tokens: int) -> list[int]:
        table: list[int] = []
        for node in path:
            end = min(node.end, num_tokens)
            first = node.start // self.block_size
            for k in self._block_range(node.start, end):
                b = node.blocks[k - first]
                if k < len(table):
                    table[k] = b  # deeper node holds the later tokens of this block
                else:
                    table.append(b)
        return table

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, token_ids: Sequence[int], extra_key: Hashable | None = None) -> RadixMatch:
        """Longest cached prefix of ``token_ids`` under ``extra_key``; refreshes LRU times
        of the nodes on the path. Never changes ref counts or the tree's shape.

        Args:
            token_ids: the request's tokens (prompt, or prompt + output so far).
            extra_key: keys a separate tree (LoRA adapter id, cache salt); None = default.

        Returns:
            :class:`RadixMatch` (``num_tokens`` may be any value in ``0 .. len(token_ids)``).

        Raises:
            ValueError: ``extra_key`` is not hashable.
        """
        _check_hashable(extra_key)
        tokens = tuple(token_ids)
        num, path, _ = self._walk(tokens, extra_key)
        if path:
            now = self._tick()
            for node in path:
                node.last_access = now
        return RadixMatch(num_tokens=num, block_ids=self._table(path, num), node=path[-1] if path else self.root)

    def match_len(self, token_ids: Sequence[int], extra_key: Hashable | None = None) -> int:
        """``match_prefix(token_ids, extra_key).num_tokens`` without refreshing LRU times
        (for scheduling decisions such as :func:`order_by_longest_prefix`).

        Raises:
            ValueError: ``extra_key`` is not hashable.
        """
        _check_hashable(extra_key)
        return self._walk(tuple(token_ids), extra_key)[0]

    # ------------------------------------------------------------------ locks

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (``lock_ref += 1`` on each).

        A running request locks the node of its match (or of its insert) so that the blocks
        it reads stay cached; pair every lock with one :meth:`unlock`.

        Raises:
            ValueError: the node has been evicted.
        """
        if node.evicted:
            raise ValueError("cannot lock an evicted radix node")
        cur: RadixNode | None = node
        while cur is not None:
            if cur.lock_ref == 0:
                self._drop_unlocked_refs(cur.blocks)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node`` (``lock_ref -= 1`` on it and its ancestors).

        Raises:
            ValueError: the node is not locked (its lock_ref would go below 0); nothing changes.
        """
        if node.lock_ref <= 0:
            raise ValueError(f"unlock of a radix node that is not locked (lock_ref={node.lock_ref})")
        cur: RadixNode | None = node
        while cur is not None:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._unlocked_refs.update(cur.blocks)
            cur = cur.parent

    # ------------------------------------------------------------------ insert

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split ``node`` after its first ``k`` tokens (0 < k < len). The existing object keeps
        the lower half (so outstanding locks on it stay valid); a new parent takes the upper
        half, with the same lock_ref and access time. A block straddling the split point is
        then referenced by both halves and gets one more pool ref. Returns the new parent."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.tokens)
        bs = self.block_size
        mid = node.start + k
        first = node.start // bs
        upper_blocks = node.blocks[: (mid - 1) // bs - first + 1]
        lower_blocks = node.blocks[mid // bs - first :]
        key = self._node_key(node)
        upper = RadixNode(parent, node.tokens[:k], node.start, upper_blocks, node.extra_key, node.last_access)
        upper.lock_ref = node.lock_ref
        parent.children[key] = upper
        node.parent = upper
        node.tokens = node.tokens[k:]
        node.start = mid
        node.blocks = lower_blocks
        upper.children[self._node_key(node)] = node
        if mid % bs:
            shared = upper_blocks[-1]
            self.pool.incref([shared])
            if node.lock_ref == 0:
                self._unlocked_refs[shared] += 1
        return upper

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: Hashable | None = None) -> int:
        """Cache the KV of ``token_ids`` held in the blocks ``block_ids`` (the caller's block
        table), sharing the blocks by ref count.

        Tokens already in the tree are not re-inserted: the tree keeps its own blocks for them
        (and the caller keeps its refs on its duplicates). For the new suffix, starting at
        position ``m``, a new leaf records ``block_ids[m // block_size ..]`` and takes one pool
        ref on each of them. If the path diverges inside an existing node, that node is split;
        when the split falls inside a block, both halves reference it (one more pool ref).
        Refreshes LRU times along the path.

        Args:
            token_ids: the tokens whose KV has been written, positions ``0 .. len - 1``.
            block_ids: the owner's block table; at least ``ceil(len(token_ids) / block_size)``
                entries (extra entries are ignored). Blocks taken by the tree must be in use
                (ref count >= 1) and hold the KV of these tokens (positions of a partial first
                block before ``m`` included, e.g. copied from the matched block).
            extra_key: separate tree (LoRA id, cache salt); must match the key used to look
                the prefix up.

        Returns:
            Number of newly cached tokens (``len(token_ids)`` minus the part already cached).

        Raises:
            ValueError: ``block_ids`` is too short, a block id newly referenced is out of range
                or free in the pool, or ``extra_key`` is not hashable. Nothing is changed.
        """
        _check_hashable(extra_key)
        tokens = tuple(token_ids)
        n = len(tokens)
        bs = self.block_size
        need = -(-n // bs)
        if len(block_ids) < need:
            raise ValueError(f"{n} tokens need {need} block ids (block_size={bs}), got {len(block_ids)}")
        num, path, in_last = self._walk(tokens, extra_key)
        new_blocks = [int(b) for b in block_ids[num // bs : need]] if num < n else []
        for b in new_blocks:
            if not 0 <= b < self.pool.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.pool.num_blocks})")
            if self.pool.ref_count(b) == 0:
                raise ValueError(f"block {b} is free in the pool; insert only blocks the caller holds")
        now = self._tick()
        for node in path:
            node.last_access = now
        if num == n:
            return 0
        parent = self.root
        if path:
            last = path[-1]
            parent = self._split(last, in_last) if in_last < len(last.tokens) else last
        leaf = RadixNode(parent, tokens[num:], num, new_blocks, extra_key, now)
        parent.children[self._node_key(leaf)] = leaf
        self.pool.incref(new_blocks)
        self._unlocked_refs.update(new_blocks)  # a fresh leaf is unlocked
        self._num_cached_tokens += n - num
        return n - num

    # ------------------------------------------------------------------ eviction

    def _evictable_leaves(self) -> list[tuple[int, int, RadixNode]]:
        heap = [(node.last_access, id(node), node) for node in self._iter_nodes() if self._is_evictable_leaf(node)]
        heapq.heapify(heap)
        return heap

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _remove_leaf(self, node: RadixNode) -> int:
        """Detach an unlocked leaf and drop its block refs; returns blocks that became free."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._node_key(node)]
        node.parent = None
        node.evicted = True
        self._num_cached_tokens -= len(node.tokens)
        self._drop_unlocked_refs(node.blocks)
        self.pool.free(reversed(node.blocks))  # tail first in the free queue
        return sum(1 for b in set(node.blocks) if self.pool.ref_count(b) == 0)

    def evict(self, num_blocks: int) -> int:
        """Evict least-recently-used unlocked leaves (a parent whose last child goes becomes a
        leaf and a candidate itself) until ``num_blocks`` blocks have been freed in the pool
        (ref count reached 0), or nothing evictable is left.

        A node's blocks reach ref count 0 only when no request and no other node references
        them, so evicting a leaf may free fewer blocks than it records (possibly none).

        Args:
            num_blocks: blocks wanted free (>= 0).

        Returns:
            Blocks actually freed (may exceed ``num_blocks`` by one leaf's worth, or fall short
            when everything left is locked or still used by requests).

        Raises:
            ValueError: ``num_blocks < 0``.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({num_blocks})")
        return self._evict(num_blocks)

    def _evict(self, num_blocks: int | None) -> int:
        if num_blocks == 0:
            return 0
        heap = self._evictable_leaves()
        freed = 0
        while heap and (num_blocks is None or freed < num_blocks):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove_leaf(node)
            if parent is not None and self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Evict every unlocked node (all of them when nothing is locked)."""
        self._evict(None)

    # ------------------------------------------------------------------ stats / introspection

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held in the tree (sum of all node runs)."""
        return self._num_cached_tokens

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that evicting every unlocked node would return to the pool: those whose
        only references are unlocked tree nodes. O(blocks the tree references)."""
        ref = self.pool.ref_count
        return sum(1 for b, c in self._unlocked_refs.items() if c > 0 and ref(b) == c)

    def _iter_nodes(self) -> Iterator[RadixNode]:
        """All nodes, root first (depth-first, iterative)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def nodes(self) -> list[RadixNode]:
        """All non-root nodes of the tree (for tests, metrics and debugging)."""
        return [n for n in self._iter_nodes() if n is not self.root]

    def tree_ref_counts(self) -> Counter[int]:
        """Block id -> number of tree nodes referencing it (= pool refs held by the tree)."""
        c: Counter[int] = Counter()
        for node in self._iter_nodes():
            c.update(node.blocks)
        return c

    def __repr__(self) -> str:
        return (
            f"RadixIndex(block_size={self.block_size}, cached_tokens={self._num_cached_tokens}, "
            f"nodes={len(self.nodes())})"
        )


def order_by_longest_prefix(waiting: Sequence[T], match_len: Callable[[T], int], max_queue: int = 128) -> list[T]:
    """Longest-prefix-match ("lpm") scheduling order (SGLang, Zheng et al. 2024): waiting
    requests sorted by the number of their tokens already in the prefix cache, longest first,
    so requests sharing a cached prefix run while it is still cached. Stable: requests with
    equal matches keep their first-come-first-served order.

    Matching costs O(prompt length) per request, so when more than ``max_queue`` requests wait
    the queue is returned in FCFS order unchanged (SGLang's fallback).

    Args:
        waiting: requests in arrival (FCFS) order.
        match_len: cached-prefix length of a request in tokens, e.g.
            ``lambda r: index.match_len(r.all_token_ids, r.extra_key)``.
        max_queue: longest queue that is still sorted (>= 0).

    Returns:
        A new list with the same requests.

    Raises:
        ValueError: ``max_queue < 0``.
    """
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if len(waiting) > max_queue:
        return list(waiting)
    keyed = [(match_len(r), r) for r in waiting]
    order = sorted(range(len(keyed)), key=lambda i: -keyed[i][0])  # sorted() is stable
    return [keyed[i][1] for i in order]
