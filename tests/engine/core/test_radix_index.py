"""RadixIndex (token-granular radix prefix tree over the block pool) and the lpm ordering.

The KV content is modelled by a fake slot array: a request writes, for each of its positions
``p``, the value ``(extra_key, tokens[:p + 1])`` (what the real KV depends on: the whole prefix
and the adapter/salt) into slot ``(block_table[p // bs], p % bs)``. A match is correct when
reading the slots through its ``block_ids`` gives exactly those values at every matched position.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.engine.core.block_pool import BlockPool, NoFreeBlocksError
from kvfleet.engine.core.radix_index import RadixIndex, RadixMatch, RadixNode, order_by_longest_prefix


def kv(key: Hashable | None, tokens: Sequence[int], p: int) -> tuple:
    return (key, tuple(tokens[: p + 1]))


class Sim:
    """A minimal KV cache manager around a RadixIndex, with a fake slot array."""

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.bs = bs
        self.pool = BlockPool(num_blocks)
        self.index = RadixIndex(self.pool, bs)
        self.slots: dict[tuple[int, int], object] = {}
        self.external: Counter[int] = Counter()  # pool refs held by requests (not the tree)
        self._garbage = 0

    def allocate(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        for b in blocks:  # a reused block's old content is gone
            for off in range(self.bs):
                self._garbage += 1
                self.slots[(b, off)] = ("garbage", self._garbage)
        self.external.update(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.pool.free(list(reversed(blocks)))
        self.external.subtract(blocks)

    def read(self, table: Sequence[int], p: int) -> object:
        return self.slots[(table[p // self.bs], p % self.bs)]

    def check_match(self, tokens: Sequence[int], key: Hashable | None, m: RadixMatch) -> None:
        assert 0 <= m.num_tokens <= len(tokens)
        assert len(m.block_ids) == -(-m.num_tokens // self.bs)
        for p in range(m.num_tokens):
            assert self.read(m.block_ids, p) == kv(key, tokens, p), f"wrong KV at position {p}"
        for b in m.block_ids:
            assert self.pool.ref_count(b) > 0  # the tree still holds it
        if m.num_tokens == 0:
            assert m.node is self.index.root
        else:
            assert not m.node.evicted and m.node.start < m.num_tokens <= m.node.end

    def write_request(self, tokens: Sequence[int], key: Hashable | None) -> tuple[list[int], RadixMatch]:
        """Match, share full matched blocks, copy a partial one, write the rest. Returns the
        request's block table (refs held) and its (locked) match. Raises NoFreeBlocksError."""
        bs = self.bs
        m = self.index.match_prefix(tokens, key)
        self.check_match(tokens, key, m)
        self.index.lock(m.node)
        full = m.num_tokens // bs
        table = list(m.block_ids[:full])
        self.pool.incref(table)
        self.external.update(table)
        need = -(-len(tokens) // bs) - full
        try:
            if need > self.pool.num_free_blocks:
                self.index.evict(need - self.pool.num_free_blocks)
            new = self.allocate(need)
        except NoFreeBlocksError:
            self.release(table)
            self.index.unlock(m.node)
            raise
        if m.num_tokens % bs:  # copy-on-write of the partially matched block
            src = m.block_ids[full]
            for off in range(m.num_tokens % bs):
                self.slots[(new[0], off)] = self.slots[(src, off)]
        table += new
        for p in range(m.num_tokens, len(tokens)):
            self.slots[(table[p // bs], p % bs)] = kv(key, tokens, p)
        return table, m


def path_tokens(node: RadixNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return tuple(t for run in reversed(parts) for t in run)


# ---------------------------------------------------------------------------------- unit tests


def test_full_and_mid_block_matches_read_back_the_right_kv() -> None:
    sim = Sim(16, 4)
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens, 3 blocks
    table, m = sim.write_request(toks, None)
    assert m.num_tokens == 0 and m.block_ids == [] and m.node is sim.index.root
    assert sim.index.insert(toks, table) == 10
    assert sim.index.num_cached_tokens == 10
    assert [sim.pool.ref_count(b) for b in table] == [2, 2, 2]  # owner + one node
    for n in [0, 1, 3, 4, 5, 8, 9, 10]:
        probe = toks[:n] + [99, 98]
        m = sim.index.match_prefix(probe)
        assert m.num_tokens == n
        assert m.block_ids == table[: -(-n // 4)]
        sim.check_match(probe, None, m)
    assert sim.index.match_prefix(toks + [1, 2, 3]).num_tokens == 10
    assert sim.index.match_prefix([6, 5]).num_tokens == 0


def test_split_mid_block_gives_both_halves_a_ref_and_correct_tables() -> None:
    sim = Sim(16, 4)
    a = list(range(100, 110))  # 10 tokens
    ta, ma = sim.write_request(a, None)
    sim.index.insert(a, ta)
    sim.index.unlock(ma.node)
    b = a[:6] + [1, 2, 3, 4, 5]  # diverges at position 6, inside block 1
    tb, mb = sim.write_request(b, None)
    assert mb.num_tokens == 6 and mb.block_ids == ta[:2]
    assert tb[0] == ta[0] and tb[1] != ta[1]  # block 1 was copied, block 0 shared
    before = Counter({x: sim.pool.ref_count(x) for x in ta})
    assert sim.index.insert(b, tb) == 5
    # ta[1] now referenced by both halves of the split node; ta[0], ta[2] unchanged
    assert sim.pool.ref_count(ta[1]) == before[ta[1]] + 1
    assert sim.pool.ref_count(ta[0]) == before[ta[0]] and sim.pool.ref_count(ta[2]) == before[ta[2]]
    starts = sorted((n.start, n.end) for n in sim.index.nodes())
    assert starts == [(0, 6), (6, 10), (6, 11)]
    for probe in (a, b, a[:7], b[:7], a[:5], b[:8] + [0]):
        m = sim.index.match_prefix(probe)
        sim.check_match(probe, None, m)
    assert sim.index.match_prefix(b).block_ids == [ta[0], tb[1], tb[2]]
    assert sim.index.match_prefix(a).block_ids == ta
    assert sim.index.match_prefix(a[:6] + [77]).block_ids == ta[:2]  # deepest node is the upper half
    assert sim.index.num_cached_tokens == 15


def test_extension_by_the_same_owner_references_its_partial_block_twice() -> None:
    sim = Sim(16, 4)
    toks = [1, 2, 3, 4, 5, 6]
    table, m = sim.write_request(toks, None)
    sim.index.insert(toks, table)
    # decode continues in the owner's own (partially filled) last block, then re-insert
    more = toks + [7, 8, 9]
    table += sim.allocate(1)
    for p in range(6, 9):
        sim.slots[(table[p // 4], p % 4)] = kv(None, more, p)
    assert sim.index.insert(more, table) == 3
    assert sim.pool.ref_count(table[1]) == 3  # owner + node [0,6) + node [6,9)
    for n in range(10):
        probe = more[:n]
        sim.check_match(probe, None, sim.index.match_prefix(probe))
    assert sim.index.insert(more, table) == 0  # already cached: nothing changes
    assert sim.pool.ref_count(table[1]) == 3


def test_extra_keys_are_separate_trees() -> None:
    sim = Sim(32, 2)
    toks = [3, 1, 4, 1, 5]
    for key in (None, "lora-1", ("salt", "x")):
        assert sim.index.match_len(toks, key) == 0
        table, m = sim.write_request(toks, key)
        assert sim.index.insert(toks, table, key) == 5
    assert sim.index.num_cached_tokens == 15
    for key in (None, "lora-1", ("salt", "x")):
        m = sim.index.match_prefix(toks, key)
        assert m.num_tokens == 5
        sim.check_match(toks, key, m)
    assert sim.index.match_len(toks, "other") == 0
    with pytest.raises(ValueError, match="hashable"):
        sim.index.match_prefix(toks, ["unhashable"])  # type: ignore[arg-type]


def test_match_never_changes_refs_and_match_len_never_touches_lru() -> None:
    sim = Sim(8, 2)
    toks = [1, 2, 3, 4, 5]
    table, m = sim.write_request(toks, None)
    sim.index.insert(toks, table)
    refs = [sim.pool.ref_count(b) for b in range(8)]
    times = {id(n): n.last_access for n in sim.index.nodes()}
    assert sim.index.match_len(toks[:3]) == 3
    assert {id(n): n.last_access for n in sim.index.nodes()} == times
    m = sim.index.match_prefix(toks[:3])
    assert m.node.last_access > times[id(m.node)]
    assert [sim.pool.ref_count(b) for b in range(8)] == refs


def test_lock_unlock_and_errors() -> None:
    sim = Sim(8, 2)
    toks = [1, 2, 3, 4]
    table, m = sim.write_request(toks, None)
    sim.index.insert(toks, table)
    sim.index.unlock(m.node)  # that was the root
    with pytest.raises(ValueError, match="not locked"):
        sim.index.unlock(sim.index.root)
    sim.release(table)
    node = sim.index.match_prefix(toks).node
    sim.index.lock(node)
    sim.index.lock(node)
    assert sim.index.evict(10) == 0 and not node.evicted
    assert sim.index.num_evictable_blocks == 0
    sim.index.unlock(node)
    assert sim.index.evict(10) == 0 and node.lock_ref == 1
    sim.index.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        sim.index.unlock(node)
    assert node.lock_ref == 0 and sim.index.root.lock_ref == 0
    assert sim.index.num_evictable_blocks == 2
    assert sim.index.evict(1) == 2 and node.evicted  # a whole leaf goes at once
    with pytest.raises(ValueError, match="evicted"):
        sim.index.lock(node)
    assert sim.pool.num_free_blocks == 8


def test_lock_survives_a_split_of_the_locked_node() -> None:
    sim = Sim(16, 4)
    a = list(range(10))
    ta, ma = sim.write_request(a, None)
    sim.index.insert(a, ta)
    sim.index.unlock(ma.node)
    node = sim.index.match_prefix(a).node
    sim.index.lock(node)
    b = a[:6] + [50]
    tb, mb = sim.write_request(b, None)
    sim.index.insert(b, tb)  # splits the locked node at 6
    sim.index.unlock(mb.node)
    sim.release(ta)
    sim.release(tb)
    upper = node.parent
    assert upper is not None and upper.lock_ref == 1 and (upper.start, upper.end) == (0, 6)
    sim.index.evict(100)  # only the unlocked sibling [6, 7) can go
    assert not node.evicted and not upper.evicted
    assert sim.index.match_len(b) == 6 and sim.index.match_len(a) == 10
    sim.index.unlock(node)
    sim.index.reset()
    assert sim.pool.num_free_blocks == 16 and sim.index.num_cached_tokens == 0 and sim.index.nodes() == []


def test_insert_validation_changes_nothing() -> None:
    sim = Sim(8, 4)
    toks = list(range(9))  # needs 3 blocks
    table, m = sim.write_request(toks, None)
    with pytest.raises(ValueError, match="need 3 block ids"):
        sim.index.insert(toks, table[:2])
    free = [b for b in range(8) if sim.pool.ref_count(b) == 0]
    with pytest.raises(ValueError, match="is free"):
        sim.index.insert(toks, table[:2] + [free[0]])
    with pytest.raises(ValueError, match="out of range"):
        sim.index.insert(toks, table[:2] + [8])
    with pytest.raises(ValueError, match="hashable"):
        sim.index.insert(toks, table, extra_key={})  # type: ignore[arg-type]
    assert sim.index.nodes() == [] and sim.index.num_cached_tokens == 0
    assert all(sim.pool.ref_count(b) == 1 for b in table)
    assert sim.index.insert([], []) == 0
    assert sim.index.insert(toks, table + [free[0]]) == 9  # extra entries ignored
    assert sim.pool.ref_count(free[0]) == 0
    with pytest.raises(ValueError, match="block_size"):
        RadixIndex(sim.pool, 0)


def test_evict_is_lru_over_leaves_and_counts_only_freed_blocks() -> None:
    sim = Sim(32, 2)
    seqs = {name: [i, i, i, i] for i, name in enumerate("abcd")}
    for toks in seqs.values():
        table, m = sim.write_request(toks, None)
        sim.index.insert(toks, table)
        sim.release(table)
        sim.index.unlock(m.node)
    sim.index.match_prefix(seqs["a"])  # a is now most recent; b is the oldest
    assert sim.index.num_evictable_blocks == 8
    with pytest.raises(ValueError, match="negative"):
        sim.index.evict(-1)
    assert sim.index.evict(0) == 0
    assert sim.index.evict(1) == 2  # one leaf of 2 blocks
    assert [sim.index.match_len(seqs[k]) for k in "abcd"] == [4, 0, 4, 4]
    assert sim.index.evict(3) == 4  # c then d
    assert [sim.index.match_len(seqs[k]) for k in "abcd"] == [4, 0, 0, 0]
    # a leaf whose blocks a request still holds is evicted but frees nothing
    toks = [9, 9, 9]
    table, m = sim.write_request(toks, None)
    sim.index.insert(toks, table)
    sim.index.unlock(m.node)
    sim.index.match_prefix(seqs["a"])
    assert sim.index.num_evictable_blocks == 2
    assert sim.index.evict(1) == 0 + 2  # [9,9,9] is older: evicted (0 freed), then a (2 freed)
    assert sim.index.match_len(toks) == 0 and all(sim.pool.ref_count(b) == 1 for b in table)


def test_insert_refreshes_the_lru_time_of_its_path() -> None:
    sim = Sim(16, 2)
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    ta, ma = sim.write_request(a, None)
    sim.index.insert(a, ta)
    tb, mb = sim.write_request(b, None)
    sim.index.insert(b, tb)
    for m in (ma, mb):
        sim.index.unlock(m.node)
    node_a = sim.index.match_prefix(a).node
    sim.index.match_prefix(b)  # b more recent than a
    assert sim.index.insert(a, ta) == 0  # re-insert of cached tokens still counts as a use
    assert not node_a.evicted
    sim.release(ta)
    sim.release(tb)
    assert sim.index.evict(1) == 2
    assert sim.index.match_len(a) == 4 and sim.index.match_len(b) == 0


def test_parent_becomes_evictable_when_its_children_go() -> None:
    sim = Sim(32, 2)
    base = [7, 7, 7, 7]
    for tail in ([1, 1], [2, 2], [3, 3]):
        toks = base + tail
        table, m = sim.write_request(toks, None)
        sim.index.insert(toks, table)
        sim.release(table)
        sim.index.unlock(m.node)
    assert len(sim.index.nodes()) == 4  # base + 3 leaves
    assert sim.index.num_evictable_blocks == 5
    assert sim.index.evict(4) == 5  # 3 leaves (1 block each) then the parent (2 blocks)
    assert sim.index.nodes() == [] and sim.pool.num_free_blocks == 32


def test_reset_frees_everything_unlocked() -> None:
    sim = Sim(16, 3)
    keep = [4, 4, 4, 4, 4]
    t1, m1 = sim.write_request(keep, "k")
    sim.index.insert(keep, t1, "k")
    sim.index.unlock(m1.node)
    t2, m2 = sim.write_request([1, 2, 3, 4], None)
    sim.index.insert([1, 2, 3, 4], t2)
    sim.index.unlock(m2.node)
    sim.release(t1)
    sim.release(t2)
    locked = sim.index.match_prefix(keep, "k").node
    sim.index.lock(locked)
    sim.index.reset()
    assert sim.index.match_len(keep, "k") == 5 and sim.index.match_len([1, 2, 3, 4]) == 0
    assert sim.pool.num_free_blocks == 16 - 2
    sim.index.unlock(locked)
    sim.index.reset()
    assert sim.pool.num_free_blocks == 16 and sim.index.num_cached_tokens == 0


# ---------------------------------------------------------------------------------- lpm order


def test_order_by_longest_prefix_sorts_longest_first_and_is_stable() -> None:
    lens = {"a": 0, "b": 7, "c": 3, "d": 7, "e": 0, "f": 3}
    out = order_by_longest_prefix(list("abcdef"), lens.__getitem__)
    assert out == ["b", "d", "c", "f", "a", "e"]
    assert order_by_longest_prefix([], lens.__getitem__) == []


def test_order_by_longest_prefix_falls_back_to_fcfs_for_long_queues() -> None:
    calls: list[int] = []

    def ml(x: int) -> int:
        calls.append(x)
        return x

    waiting = list(range(10))
    assert order_by_longest_prefix(waiting, ml, max_queue=9) == waiting and calls == []
    assert order_by_longest_prefix(waiting, ml, max_queue=10) == waiting[::-1]
    assert order_by_longest_prefix(tuple(waiting), ml, max_queue=0) == waiting
    with pytest.raises(ValueError, match="max_queue"):
        order_by_longest_prefix(waiting, ml, max_queue=-1)


def test_order_by_longest_prefix_with_a_real_index() -> None:
    sim = Sim(16, 2)
    sys_prompt = [1, 2, 3, 4, 5, 6]
    table, m = sim.write_request(sys_prompt, None)
    sim.index.insert(sys_prompt, table)
    reqs = [[9, 9], sys_prompt[:3] + [0], sys_prompt + [8], [1, 2, 0]]
    out = order_by_longest_prefix(reqs, sim.index.match_len)
    assert out == [reqs[2], reqs[1], reqs[3], reqs[0]]


# ---------------------------------------------------------------------------------- property test

KEYS = st.sampled_from([None, "lora-1", "salt"])
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=14)


class RadixMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict / finish sequences against the fake KV."""

    @initialize(bs=st.integers(1, 4), num_blocks=st.integers(4, 24))
    def setup(self, bs: int, num_blocks: int) -> None:
        self.sim = Sim(num_blocks, bs)
        self.running: list[tuple[list[int], Hashable | None, list[int], RadixNode]] = []
        self.ext_locks: list[RadixNode] = []
        self.seen: list[tuple[list[int], Hashable | None]] = []

    # -- requests -------------------------------------------------------------------------

    def _start(self, tokens: list[int], key: Hashable | None, keep: bool) -> None:
        sim = self.sim
        try:
            table, m = sim.write_request(tokens, key)
        except NoFreeBlocksError:
            return
        cached_before = sim.index.num_cached_tokens
        new = sim.index.insert(tokens, table, key)
        assert new == len(tokens) - m.num_tokens  # the matched path was locked meanwhile
        assert sim.index.num_cached_tokens == cached_before + new
        m2 = sim.index.match_prefix(tokens, key)
        assert m2.num_tokens == len(tokens)
        sim.check_match(tokens, key, m2)
        sim.index.lock(m2.node)
        sim.index.unlock(m.node)
        self.seen.append((tokens, key))
        if keep:
            self.running.append((tokens, key, table, m2.node))
        else:
            sim.index.unlock(m2.node)
            sim.release(table)

    @rule(tokens=TOKENS, key=KEYS, keep=st.booleans())
    def start_request(self, tokens: list[int], key: Hashable | None, keep: bool) -> None:
        self._start(tokens, key, keep)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), suffix=TOKENS, keep=st.booleans())
    def start_from_seen(self, data: st.DataObject, suffix: list[int], keep: bool) -> None:
        tokens, key = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(0, len(tokens)))
        self._start(tokens[:cut] + suffix, key, keep)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend_request(self, data: st.DataObject, more: list[int]) -> None:
        """A running request decodes more tokens into its own blocks and re-inserts."""
        sim, bs = self.sim, self.sim.bs
        i = data.draw(st.integers(0, len(self.running) - 1))
        tokens, key, table, node = self.running[i]
        full = tokens + more
        need = -(-len(full) // bs) - len(table)
        if need > sim.pool.num_free_blocks:
            sim.index.evict(need - sim.pool.num_free_blocks)
        if need > sim.pool.num_free_blocks:
            return
        table = table + sim.allocate(need)
        for p in range(len(tokens), len(full)):
            sim.slots[(table[p // bs], p % bs)] = kv(key, full, p)
        before = sim.index.num_cached_tokens
        expected = len(full) - sim.index.match_len(full, key)  # another request may have cached some
        assert sim.index.insert(full, table, key) == expected
        assert sim.index.num_cached_tokens == before + expected
        m = sim.index.match_prefix(full, key)
        assert m.num_tokens == len(full)
        sim.index.lock(m.node)
        sim.index.unlock(node)
        self.running[i] = (full, key, table, m.node)
        self.seen.append((full, key))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.running) - 1))
        _, _, table, node = self.running.pop(i)
        self.sim.index.unlock(node)
        self.sim.release(table)

    # -- lookups and locks ------------------------------------------------------------------

    @rule(tokens=TOKENS, key=KEYS)
    def match(self, tokens: list[int], key: Hashable | None) -> None:
        sim = self.sim
        refs = [sim.pool.ref_count(b) for b in range(sim.pool.num_blocks)]
        n = sim.index.match_len(tokens, key)
        m = sim.index.match_prefix(tokens, key)
        assert m.num_tokens == n
        sim.check_match(tokens, key, m)
        assert [sim.pool.ref_count(b) for b in range(sim.pool.num_blocks)] == refs

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def match_seen_prefix(self, data: st.DataObject) -> None:
        tokens, key = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(0, len(tokens)))
        self.sim.check_match(tokens[:cut], key, self.sim.index.match_prefix(tokens[:cut], key))

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def external_lock(self, data: st.DataObject) -> None:
        tokens, key = data.draw(st.sampled_from(self.seen))
        cut = data.draw(st.integers(0, len(tokens)))
        node = self.sim.index.match_prefix(tokens[:cut], key).node
        self.sim.index.lock(node)
        self.ext_locks.append(node)

    @precondition(lambda self: self.ext_locks)
    @rule(data=st.data())
    def external_unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.ext_locks) - 1))
        self.sim.index.unlock(self.ext_locks.pop(i))

    # -- eviction ---------------------------------------------------------------------------

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        sim, index = self.sim, self.sim.index
        nodes = index.nodes()
        used_before = {b for b in range(sim.pool.num_blocks) if sim.pool.ref_count(b) > 0}
        locked = [x for x in nodes if x.lock_ref > 0]
        freed = index.evict(n)
        became_free = {b for b in used_before if sim.pool.ref_count(b) == 0}
        assert freed == len(became_free)
        assert not any(x.evicted for x in locked)
        evicted = [x for x in nodes if x.evicted]
        assert all(x.lock_ref == 0 for x in evicted)
        survivors = [x for x in index.nodes() if not x.children and x.lock_ref == 0]
        if evicted and survivors:  # LRU: nothing evicted is more recent than a remaining candidate
            assert max(x.last_access for x in evicted) <= min(x.last_access for x in survivors)
        if freed < n:
            assert survivors == []  # stopped early only because nothing evictable is left
        else:
            assert n == 0 or evicted

    @rule()
    def evictable_count_matches_a_full_reset(self) -> None:
        clone = copy.deepcopy(self.sim.index)  # copies the pool too
        expected = clone.num_evictable_blocks
        free_before = clone.pool.num_free_blocks
        clone.reset()
        assert clone.pool.num_free_blocks - free_before == expected
        assert all(x.lock_ref > 0 for x in clone.nodes())

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def refs_add_up(self) -> None:
        if not hasattr(self, "sim"):
            return
        sim = self.sim
        tree = sim.index.tree_ref_counts()
        for b in range(sim.pool.num_blocks):
            rc = sim.pool.ref_count(b)
            assert rc >= 0 and sim.external[b] >= 0
            assert rc == tree[b] + sim.external[b], f"block {b}: pool {rc}, tree {tree[b]}, ext {sim.external[b]}"
        assert set(sim.pool.free_block_ids()).isdisjoint(tree)

    @invariant()
    def tree_is_well_formed_and_holds_the_right_kv(self) -> None:
        if not hasattr(self, "sim"):
            return
        sim, index, bs = self.sim, self.sim.index, self.sim.bs
        total = 0
        unlocked: Counter[int] = Counter()
        for node in index.nodes():
            parent = node.parent
            assert parent is not None and not node.evicted and node.tokens
            assert node.start == (0 if parent is index.root else parent.end)
            if parent is not index.root:
                assert node.extra_key == parent.extra_key
            assert len(node.blocks) == (node.end - 1) // bs - node.start // bs + 1
            assert node.lock_ref >= 0 and parent.lock_ref >= sum(c.lock_ref for c in parent.children.values())
            assert node.last_access <= parent.last_access or parent is index.root
            total += len(node.tokens)
            path = path_tokens(node)
            first = node.start // bs
            for p in range(node.start, node.end):
                assert sim.slots[(node.blocks[p // bs - first], p % bs)] == kv(node.extra_key, path, p)
            if node.lock_ref == 0:
                unlocked.update(node.blocks)
        assert index.num_cached_tokens == total
        assert index.num_evictable_blocks == sum(1 for b, c in unlocked.items() if sim.pool.ref_count(b) == c)
        for node in self.ext_locks + [r[3] for r in self.running]:
            assert not node.evicted and node.lock_ref > 0

    def teardown(self) -> None:
        if not hasattr(self, "sim"):
            return
        for _, _, table, node in self.running:
            self.sim.index.unlock(node)
            self.sim.release(table)
        for node in self.ext_locks:
            self.sim.index.unlock(node)
        assert all(x.lock_ref == 0 for x in self.sim.index.nodes()) and self.sim.index.root.lock_ref == 0
        self.sim.index.reset()
        assert self.sim.index.nodes() == [] and self.sim.index.num_cached_tokens == 0
        assert self.sim.pool.num_free_blocks == self.sim.pool.num_blocks


RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
