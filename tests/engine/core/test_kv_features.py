"""KV cache manager features without a model: prefix caching (chained block hashes, LRU of
freed cached blocks), copy-on-write forks, swap to a host pool, sliding-window block freeing;
and a property-based state machine over random allocate / append / fork / free / evict / swap
sequences that checks the pool's invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfleet.config import SchedulerConfig
from kvfleet.engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, hash_block_tokens
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def compute(kv: KVCacheManager, r: Request, n: int | None = None) -> None:
    """Admit-or-extend ``r`` by ``n`` tokens (default: all it has) as the scheduler would."""
    blocks, cached = kv.get_computed_blocks(r)
    n = r.num_tokens - r.num_computed_tokens - cached if n is None else n
    assert kv.allocate_slots(r, n, blocks, cached, admission=r.num_computed_tokens == 0)
    r.num_computed_tokens += cached + n


# ---------------------------------------------------------------------------- prefix caching


def test_hash_is_chained_and_keyed() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4]) and len(a) == 32
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])  # depends on the parent
    assert hash_block_tokens(None, [1, 2, 3, 4], (None, "salt")) != a
    assert hash_block_tokens(None, [1, 2, 3, 4], (7, None)) != hash_block_tokens(None, [1, 2, 3, 4], (8, None))


def test_prefix_hit_shares_full_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))
    compute(kv, a)
    ta = kv.get_block_table("a")
    assert kv.pool.num_cached_blocks == 2  # positions 0..7 are two full blocks
    b = req("b", list(range(9)) + [99, 98])
    blocks, cached = kv.get_computed_blocks(b)
    assert blocks == ta[:2] and cached == 8
    compute(kv, b)
    tb = kv.get_block_table("b")
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [kv.pool.ref_count(x) for x in ta[:2]] == [2, 2]
    assert b.num_computed_tokens == 11
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8


def test_at_most_num_tokens_minus_one_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    compute(kv, req("a", list(range(8))))
    _, cached = kv.get_computed_blocks(req("b", list(range(8))))
    assert cached == 4  # the 8th token must be computed to get logits: only block 0 is reused


def test_cache_salt_isolates() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    a.cache_salt = "tenant-1"
    compute(kv, a)
    b = req("b", list(range(9)))
    assert kv.get_computed_blocks(b)[1] == 0
    b.cache_salt = "tenant-1"
    b.block_hashes = []
    assert kv.get_computed_blocks(b)[1] == 8


def test_freed_cached_blocks_are_revived_then_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    compute(kv, a)
    ta = list(kv.get_block_table("a"))
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2  # free but still cached
    b = req("b", list(range(9)))
    blocks, cached = kv.get_computed_blocks(b)
    assert blocks == ta[:2] and cached == 8
    compute(kv, b)
    assert kv.get_block_table("b")[:2] == ta[:2]
    kv.free(b)
    # New content takes free blocks oldest-freed first; the tail block (freed first) before
    # the shared beginning, so block 0 of the prefix survives longest.
    c = req("c", list(range(100, 112)))
    compute(kv, c, 4)
    assert kv.get_computed_blocks(req("d", list(range(9))))[1] == 8
    compute(kv, c, 8)
    assert kv.get_computed_blocks(req("e", list(range(9))))[1] < 8
    assert kv.pool.num_evictions >= 1


def test_refilled_block_after_eviction_hits_again() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(9)))
    compute(kv, a)
    kv.free(a)
    c = req("c", list(range(50, 62)))
    compute(kv, c)  # takes all 3 blocks: the cached prefix is evicted
    assert kv.pool.num_cached_blocks == 3 - 0 and kv.get_computed_blocks(req("x", list(range(9))))[1] == 0
    kv.free(c)
    a2 = req("a2", list(range(9)))
    compute(kv, a2)  # recomputed and cached again
    kv.free(a2)
    assert kv.get_computed_blocks(req("a3", list(range(9))))[1] == 8


# ---------------------------------------------------------------------------- copy-on-write


def test_fork_shares_blocks_and_copies_only_the_partial_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    p = req("p", list(range(10)))
    compute(kv, p)
    c = req("c", list(range(10)))
    kv.fork(p, c, 9)
    c.num_computed_tokens = 9
    tp, tc = kv.get_block_table("p"), kv.get_block_table("c")
    assert tc == tp[:3] and all(kv.pool.ref_count(b) == 2 for b in tp)
    assert kv.allocate_slots(c, 1)  # writes position 9, in the shared block 2
    copies = kv.take_block_copies()
    assert copies == [(tp[2], tc[2])] and tc[2] != tp[2]
    assert tc[:2] == tp[:2] and kv.pool.ref_count(tp[2]) == 1 and kv.pool.ref_count(tc[2]) == 1
    assert kv.take_block_copies() == []
    kv.free(p)
    kv.free(c)
    assert kv.num_free_blocks == 16


def test_fork_at_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    p = req("p", list(range(9)))
    compute(kv, p)
    c = req("c", list(range(9)))
    kv.fork(p, c, 8)
    c.num_computed_tokens = 8
    assert kv.allocate_slots(c, 1)
    assert kv.take_block_copies() == []
    assert kv.get_block_table("c")[:2] == kv.get_block_table("p")[:2]


def test_n8_on_1000_token_prompt_holds_under_a_quarter_of_independent_blocks() -> None:
    bs, prompt, out = 16, 1000, 16
    kv = KVCacheManager(num_blocks=1024, block_size=bs)
    toks = list(range(prompt))
    children = [req(f"c{i}", toks, out) for i in range(8)]
    compute(kv, children[0])
    for c in children[1:]:
        kv.fork(children[0], c, prompt - 1)
        c.num_computed_tokens = prompt - 1
        assert kv.allocate_slots(c, 1)
        c.num_computed_tokens = prompt
    for step in range(out):
        for i, c in enumerate(children):
            c.append_output_token(1000 + i * 100 + step)
            assert kv.allocate_slots(c, 1)
            c.num_computed_tokens += 1
    shared = kv.pool.num_used_blocks
    independent = 8 * kv.num_blocks_for(prompt + out)
    assert shared <= independent // 4, (shared, independent)
    for c in children:
        kv.free(c)
    assert kv.num_free_blocks == 1024


def test_reassign_moves_tables_like_beam_search() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = req("a", list(range(6))), req("b", list(range(6)))
    compute(kv, a)
    compute(kv, b)
    ta = list(kv.get_block_table("a"))
    kv.reassign([(a, b), (b, a)], 6)  # swap them: each now shares the other's old blocks
    assert kv.get_block_table("b") == ta
    kv.reassign([(b, a)], 6)  # both point at the same blocks now
    assert kv.get_block_table("a") == kv.get_block_table("b")
    assert all(kv.pool.ref_count(x) == 2 for x in kv.get_block_table("a"))
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16


# ---------------------------------------------------------------------------- swap


def test_swap_out_and_in_round_trip() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    a = req("a", list(range(10)))
    compute(kv, a)
    ta = list(kv.get_block_table("a"))
    pairs = kv.swap_out(a)
    assert [d for d, _ in pairs] == ta and a.swapped_out and kv.num_free_blocks == 8
    assert kv.host_pool.num_free_blocks == 1 and kv.is_swapped_out("a")
    assert kv.num_blocks_to_swap_in(a) == 3
    back = kv.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert [d for _, d in back] == kv.get_block_table("a") and not a.swapped_out
    assert kv.host_pool.num_free_blocks == 4
    b = req("b", list(range(20)))
    compute(kv, b)
    assert kv.swap_out(b) is None  # 5 blocks, host pool holds 4: nothing changes
    assert kv.get_block_table("b") and not b.swapped_out
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_swap_needs_a_host_pool() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(5)))
    compute(kv, a)
    assert kv.swap_out(a) is None


# ---------------------------------------------------------------------------- sliding window


def test_sliding_window_frees_blocks_and_bounds_usage() -> None:
    bs, window = 4, 8
    kv = KVCacheManager(num_blocks=64, block_size=bs, sliding_window=window)
    r = req("r", list(range(5)), max_tokens=200)
    compute(kv, r)
    peak = 0
    for t in range(200):
        r.append_output_token(t)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        peak = max(peak, kv.num_request_blocks("r"))
        table = kv.get_block_table("r")
        first_live = r.num_computed_tokens - 1 - window + 1
        for k, b in enumerate(table):  # dead blocks are freed, live ones are held
            assert (b == NULL_BLOCK) == ((k + 1) * bs <= first_live)
    assert peak <= kv.max_blocks_held(r.num_tokens, 1) <= 4
    assert kv.pool.num_used_blocks == kv.num_request_blocks("r")
    kv.free(r)
    assert kv.num_free_blocks == 64


def test_sliding_window_admission_bound() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=8)
    assert not kv.can_ever_fit(4000)
    assert kv.can_ever_fit(4000, max_step_tokens=8)  # 8 window + 8 per step -> at most 5 blocks


# ---------------------------------------------------------------------------- scheduler: swap mode


def _run(sched: Scheduler, reqs: list[Request], max_steps: int = 500) -> list[int]:
    for r in reqs:
        sched.add_request(r)
    swaps = 0
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        swaps += len(out.swap_out)
        for s in out.scheduled:
            if s.needs_sample:
                r = s.request
                r.append_output_token(1000 + r.num_tokens)  # deterministic in the position
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished()
    return [swaps]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_preemption_modes_finish_everything(mode: str) -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode=mode)
    kv = KVCacheManager(num_blocks=12, block_size=4, num_host_blocks=32)
    sched = Scheduler(cfg, kv, 1000)
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=14) for i in range(4)]
    _run(sched, reqs)
    assert all(r.num_output_tokens == 14 for r in reqs)
    assert all(r.output_token_ids == [1000 + r.num_prompt_tokens + k for k in range(14)] for r in reqs)
    assert sched.num_preemptions_total > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0 and sched.num_swap_ins == sched.num_swap_outs
    assert kv.num_free_blocks == 12 and kv.host_pool.num_free_blocks == 32


def test_swap_falls_back_to_recompute_when_host_pool_is_full() -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode="swap")
    kv = KVCacheManager(num_blocks=12, block_size=4, num_host_blocks=1)
    sched = Scheduler(cfg, kv, 1000)
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=14) for i in range(4)]
    _run(sched, reqs)
    assert sched.num_swap_fallbacks > 0 and sched.num_swap_outs == 0
    assert kv.num_free_blocks == 12


def test_anti_thrash_guard_recomputes_a_request_without_progress() -> None:
    cfg = SchedulerConfig(preemption_mode="swap")
    kv = KVCacheManager(num_blocks=12, block_size=4, num_host_blocks=12)
    sched = Scheduler(cfg, kv, 1000)
    r = req("r", list(range(6)))
    sched.add_request(r)
    sched.schedule()
    r.progress_at_swap_in = r.num_computed_tokens  # just swapped in, nothing computed since
    assert not sched._may_swap_out(r)
    from kvfleet.engine.core.scheduler_output import SchedulerOutput

    out = SchedulerOutput()
    sched.running.remove(r)
    sched._preempt(r, out)
    assert out.swap_out == [] and r.num_computed_tokens == 0 and sched.num_swap_fallbacks == 1


# ---------------------------------------------------------------------------- property-based


class KVMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / evict / swap over a small pool with prefix
    caching; after every rule the pool is consistent with the block tables (and the radix
    tree's own refs)."""

    prefix_cache = "hash"

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=3, enable_prefix_caching=True, num_host_blocks=6,
                                 prefix_cache=self.prefix_cache)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 10))
    def add(self, prefix: int, length: int) -> None:
        self.n += 1
        r = req(f"r{self.n}", [prefix * 100 + i for i in range(length)])
        blocks, cached = self.kv.get_computed_blocks(r)
        if self.kv.allocate_slots(r, r.num_tokens - cached, blocks, cached, admission=True):
            r.num_computed_tokens = r.num_tokens
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 5))
    def append(self, data: st.DataObject, tok: int) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if r.swapped_out:
            return
        r.append_output_token(tok)
        if self.kv.allocate_slots(r, 1):
            r.num_computed_tokens += 1
        else:
            r.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        p = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if p.swapped_out or p.num_tokens < 2:
            return
        self.n += 1
        c = req(f"r{self.n}", p.all_token_ids)
        self.kv.fork(p, c, p.num_tokens - 1)
        c.num_computed_tokens = p.num_tokens - 1
        self.live[c.request_id] = c
        if self.kv.allocate_slots(c, 1):
            c.num_computed_tokens += 1
        else:
            self.kv.free(c)
            del self.live[c.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap(self, data: st.DataObject) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if r.swapped_out:
            self.kv.swap_in(r)
        else:
            self.kv.swap_out(r)

    @rule()
    def evict(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        kv = self.kv
        refs = [0] * kv.pool.num_blocks
        if kv.radix is not None:
            for b, c in kv.radix.tree_ref_counts().items():
                refs[b] += c
        for rid in kv.request_ids():
            for b in kv.get_block_table(rid):
                if b != NULL_BLOCK:
                    refs[b] += 1
        for b in range(kv.pool.num_blocks):
            assert kv.pool.ref_count(b) == refs[b] >= 0
        free = set(kv.pool.free_block_ids())
        assert all((refs[b] == 0) == (b in free) for b in range(kv.pool.num_blocks))
        host_used = sum(kv.num_blocks_to_swap_in(r) for r in self.live.values() if r.swapped_out)
        assert kv.host_pool.num_used_blocks == host_used
        for r in self.live.values():  # every live request's KV is somewhere
            assert r.swapped_out or len(kv.get_block_table(r.request_id)) == kv.num_blocks_for(r.num_computed_tokens)

    def teardown(self) -> None:
        for r in self.live.values():
            self.kv.free(r)
        self.kv.take_block_copies()
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        self.kv.reset_prefix_cache()
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        assert self.kv.host_pool.num_free_blocks == self.kv.host_pool.num_blocks


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class RadixKVMachine(KVMachine):
    prefix_cache = "radix"


TestRadixKVMachine = RadixKVMachine.TestCase
TestRadixKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- radix prefix cache


def test_radix_partial_block_match_copies_the_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True, prefix_cache="radix")
    a = req("a", list(range(10)))
    compute(kv, a)
    ta = list(kv.get_block_table("a"))
    kv.free(a)  # inserted into the tree: 10 tokens, blocks ta
    assert kv.radix.num_cached_tokens == 10 and kv.num_free_blocks == 16
    b = req("b", list(range(7)) + [50, 51, 52])
    blocks, cached = kv.get_computed_blocks(b)
    assert cached == 7 and blocks == ta[:2]  # token-granular: 7 tokens, ending inside block 1
    assert kv.allocate_slots(b, b.num_tokens - cached, blocks, cached, admission=True)
    tb = kv.get_block_table("b")
    assert tb[0] == ta[0] and tb[1] != ta[1]
    assert kv.take_block_copies() == [(ta[1], tb[1])]  # the partial block is copied, not shared
    assert kv.prefix_cache_hits == 7
    b.num_computed_tokens = b.num_tokens
    kv.free(b)
    c = req("c", list(range(7)) + [50, 51, 52, 53])
    assert kv.get_computed_blocks(c)[1] == 10  # b's continuation was inserted too
    kv.reset_prefix_cache()
    assert kv.pool.num_free_blocks == 16


def test_radix_evicts_lru_leaves_when_the_pool_is_short_but_not_locked_ones() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True, prefix_cache="radix")
    for i, base in enumerate((0, 100)):
        r = req(f"r{i}", list(range(base, base + 8)))
        compute(kv, r)
        kv.free(r)
    assert kv.pool.num_free_blocks == 2 and kv.num_free_blocks == 6
    hold = req("hold", list(range(100, 108)) + [1])  # matches r1's 8 tokens, locks that node
    compute(kv, hold)
    big = req("big", list(range(500, 512)))  # needs 3 blocks, 1 is free: r0's leaf must go, not r1's
    compute(kv, big)
    assert kv.radix.match_len(list(range(0, 8))) == 0
    assert kv.radix.match_len(list(range(100, 108))) == 8


def test_lpm_policy_orders_by_cached_prefix() -> None:
    cfg = SchedulerConfig(scheduling_policy="lpm", max_num_seqs=1)
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(cfg, kv, 1000)
    warm = req("warm", list(range(100, 120)), max_tokens=1)
    sched.add_request(warm)
    sched.schedule()
    sched.finish_request(warm, RequestStatus.FINISHED_LENGTH)
    cold = req("cold", list(range(300, 320)))
    hot = req("hot", list(range(100, 120)) + [7])
    sched.add_request(cold)
    sched.add_request(hot)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["hot"]  # longest match first
    fcfs = Scheduler(SchedulerConfig(scheduling_policy="lpm", lpm_max_queue=1, max_num_seqs=1), kv, 1000)
    c2, h2 = req("c2", list(range(300, 320))), req("h2", list(range(100, 120)) + [7])
    fcfs.add_request(c2)
    fcfs.add_request(h2)
    assert [s.request.request_id for s in fcfs.schedule().scheduled] == ["c2"]  # long queue: FCFS


def test_scheduler_forks_choices_only_after_the_prompt_kv_exists() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, 1000)
    parent = req("g-0", list(range(10)), max_tokens=3)
    kids = [req(f"g-{i}", list(range(10)), max_tokens=3) for i in (1, 2)]
    for k in kids:
        k.fork_of = parent
    for r in (parent, *kids):
        sched.add_request(r)
    out = sched.schedule()  # the parent's prompt is computed in this step: nothing to fork yet
    assert [s.request for s in out.scheduled] == [parent] and out.block_copies == []
    parent.append_output_token(5)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [parent, *kids]
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]  # each child computes the last prompt token
    tp = kv.get_block_table("g-0")
    for k in kids:  # prompt blocks shared, the partial block copied from the parent's
        assert kv.get_block_table(k.request_id)[:2] == tp[:2]
    assert sorted(src for src, _ in out.block_copies) == [tp[2], tp[2]]
    assert kv.pool.ref_count(tp[0]) == 3
    for r in (parent, *kids):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 32
