"""BlockPool: allocation, ref counts, free queue order, and random operation sequences."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfleet.engine.core.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_free_roundtrip() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.allocate(3)
    assert len(set(a)) == 3 and all(0 <= b < 4 for b in a)
    assert all(pool.ref_count(b) == 1 for b in a)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert all(pool.ref_count(b) == 0 for b in range(4))


def test_allocate_too_many_allocates_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, only 1"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert issubclass(NoFreeBlocksError, RuntimeError)
    assert pool.allocate(0) == []


def test_free_queue_is_fifo() -> None:
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free([a[2]])
    pool.free([a[0], a[3]])
    assert pool.free_block_ids() == [a[2], a[0], a[3]]
    assert pool.allocate(2) == [a[2], a[0]]


def test_incref_shares_until_last_free() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 2


def test_incref_revives_free_block() -> None:
    pool = BlockPool(3)
    pool.incref([1])
    assert pool.ref_count(1) == 1
    assert 1 not in pool.free_block_ids()
    assert sorted(pool.allocate(2)) == [0, 2]


def test_bad_frees_raise_and_change_nothing() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="ref count is 0"):
        pool.free([a[0], 2])  # 2 is free: nothing is freed, a[0] included
    assert pool.ref_count(a[0]) == 1
    with pytest.raises(ValueError, match="freed 2 time"):
        pool.free([a[1], a[1]])
    assert pool.ref_count(a[1]) == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.free([3])
    with pytest.raises(ValueError, match="out of range"):
        pool.incref([-1])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free sequences against a dict model of ref counts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.refs: Counter[int] = Counter()  # model: block id -> ref count held by "owners"

    @precondition(lambda self: self.pool is None)
    @rule(n=st.integers(1, 12))
    def create(self, n: int) -> None:
        self.pool = BlockPool(n)

    @precondition(lambda self: self.pool is not None)
    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        assert self.pool is not None
        free_before = self.pool.free_block_ids()
        if n > len(free_before):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            assert self.pool.free_block_ids() == free_before
            return
        got = self.pool.allocate(n)
        assert got == free_before[:n]  # oldest freed first
        for b in got:
            assert self.refs[b] == 0
            self.refs[b] = 1

    @precondition(lambda self: self.pool is not None and +self.refs)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        assert self.pool is not None
        held = sorted(+self.refs)
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=3))
        self.pool.incref(ids)
        self.refs.update(ids)

    @precondition(lambda self: self.pool is not None and +self.refs)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        assert self.pool is not None
        held = list((+self.refs).elements())
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=4))
        over = any(c > self.refs[b] for b, c in Counter(ids).items())
        if over:
            with pytest.raises(ValueError):
                self.pool.free(ids)
            return
        self.pool.free(ids)
        self.refs.subtract(ids)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def free_a_free_block(self, data: st.DataObject) -> None:
        assert self.pool is not None
        free = [b for b in range(self.pool.num_blocks) if self.refs[b] == 0]
        if free:
            with pytest.raises(ValueError):
                self.pool.free([data.draw(st.sampled_from(free))])

    @invariant()
    def consistent(self) -> None:
        if self.pool is None:
            return
        pool = self.pool
        free_ids = pool.free_block_ids()
        assert len(free_ids) == len(set(free_ids))
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == self.refs[b]
            assert (b in free_ids) == (self.refs[b] == 0)
        used = sum(1 for b in range(pool.num_blocks) if self.refs[b] > 0)
        assert pool.num_free_blocks + used == pool.num_blocks
        assert pool.usage == pytest.approx(used / pool.num_blocks)
        assert 0.0 <= pool.usage <= 1.0

    def teardown(self) -> None:
        if self.pool is not None:
            self.pool.free(list((+self.refs).elements()))
            assert self.pool.num_free_blocks == self.pool.num_blocks


BlockPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
