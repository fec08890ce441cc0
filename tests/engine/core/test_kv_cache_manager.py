"""KVCacheManager: block tables grow on demand, all-or-nothing, free is idempotent;
random allocate / append / finish / abort sequences keep the pool consistent."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.request import Request
from kvfleet.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def test_num_blocks_for_and_can_ever_fit() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert [kv.num_blocks_for(t) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert kv.can_ever_fit(12) and not kv.can_ever_fit(13)
    assert kv.capacity_tokens == 12
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=3, block_size=0)


def test_allocate_slots_grows_table_on_demand() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = make_request("a", 6)
    assert kv.get_block_table("a") == []
    assert kv.allocate_slots(r, 6)
    table = kv.get_block_table("a")
    assert len(table) == 2 and kv.num_free_blocks == 2
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2)  # 8 slots: still 2 blocks
    assert len(table) == 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1)  # 9th token opens a third block
    assert kv.get_block_table("a") is table and len(table) == 3
    assert kv.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        kv.allocate_slots(r, -1)


def test_allocate_slots_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a, b = make_request("a", 4), make_request("b", 4)
    assert kv.allocate_slots(a, 4)
    assert not kv.allocate_slots(b, 4)  # needs 2, 1 free
    assert kv.get_block_table("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 2)
    assert kv.num_free_blocks == 0


def test_free_is_idempotent_and_returns_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=1)
    r = make_request("a", 3)
    assert kv.allocate_slots(r, 3)
    table = list(kv.get_block_table("a"))
    kv.free(r)
    kv.free(r)
    assert kv.num_free_blocks == 4 and kv.get_block_table("a") == []
    assert kv.pool.free_block_ids()[-3:] == table[::-1]


class KVCacheMachine(RuleBasedStateMachine):
    """Requests are created, extended (prefill chunks / decodes), finished and aborted at random."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.gone: list[Request] = []
        self.next_id = 0

    @precondition(lambda self: self.kv is None)
    @rule(num_blocks=st.integers(1, 10), block_size=st.integers(1, 4))
    def create(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)

    def _extend(self, req: Request, n: int) -> None:
        assert self.kv is not None
        kv = self.kv
        before = list(kv.get_block_table(req.request_id))
        need = kv.num_blocks_for(req.num_computed_tokens + n) - len(before)
        free_before = kv.num_free_blocks
        ok = kv.allocate_slots(req, n)
        after = kv.get_block_table(req.request_id)
        assert ok == (need <= free_before)
        if ok:
            req.num_computed_tokens += n
            assert after[: len(before)] == before  # existing blocks never move
            assert len(after) == kv.num_blocks_for(req.num_computed_tokens)
        else:
            assert after == before and kv.num_free_blocks == free_before

    @precondition(lambda self: self.kv is not None)
    @rule(prompt_len=st.integers(1, 12))
    def new_request(self, prompt_len: int) -> None:
        req = make_request(f"r{self.next_id}", prompt_len)
        self.next_id += 1
        self.live[req.request_id] = req
        self._extend(req, prompt_len)

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(data=st.data(), n=st.integers(0, 5))
    def append(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._extend(self.live[rid], n)

    @precondition(lambda self: self.kv is not None and self.live)
    @rule(data=st.data(), twice=st.booleans())
    def finish_or_abort(self, data: st.DataObject, twice: bool) -> None:
        assert self.kv is not None
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.kv.free(req)
        if twice:
            self.kv.free(req)
        self.gone.append(req)
        assert self.kv.get_block_table(rid) == []

    @invariant()
    def no_block_owned_twice(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        owned: list[int] = []
        for rid, req in self.live.items():
            table = kv.get_block_table(rid)
            assert len(table) >= kv.num_blocks_for(req.num_computed_tokens)
            owned.extend(table)
        assert len(owned) == len(set(owned))
        for b in range(kv.pool.num_blocks):
            assert kv.pool.ref_count(b) == (1 if b in owned else 0)
        assert set(kv.request_ids()) <= set(self.live)
        assert kv.num_free_blocks + len(owned) == kv.pool.num_blocks
        assert kv.usage == pytest.approx(len(owned) / kv.pool.num_blocks)

    def teardown(self) -> None:
        if self.kv is None:
            return
        for req in self.live.values():
            self.kv.free(req)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        assert self.kv.request_ids() == []


KVCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
