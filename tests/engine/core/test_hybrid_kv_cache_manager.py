"""KV cache groups (Gemma 3's interleaved local / global layers) without a model: grouping,
block freeing in the windowed groups, prefix hits common to every group, all-or-nothing
allocation, swap and forks over the shared pool, the scheduler on top, and a property-based
state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant
from tests.engine.core.test_kv_features import KVMachine, _run, compute, req

from kvfleet.config import SchedulerConfig
from kvfleet.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec, kv_cache_groups
from kvfleet.engine.core.kv_cache_manager import NULL_BLOCK
from kvfleet.engine.core.scheduler import Scheduler

GEMMA3_270M_WINDOWS = ([512] * 5 + [None]) * 3


def test_gemma3_270m_groups() -> None:
    groups = kv_cache_groups(GEMMA3_270M_WINDOWS)
    assert groups[0] == KVCacheGroupSpec(None, (5, 11, 17))
    assert [g.layers for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert all(g.sliding_window == 512 for g in groups[1:])


def test_groups_of_uneven_counts_and_single_window() -> None:
    # Gemma-3-1B style: 26 layers, every 6th global -> 4 global, 22 local in groups of 4 (last one of 2)
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    groups = kv_cache_groups(windows)
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(la for g in groups for la in g.layers) == list(range(26))
    assert kv_cache_groups([7, 7, 7]) == [KVCacheGroupSpec(7, (0, 1, 2))]
    assert kv_cache_groups([None, None]) == [KVCacheGroupSpec(None, (0, 1))]
    with pytest.raises(ValueError):
        kv_cache_groups([])


def test_4k_token_generation_holds_bounded_local_blocks() -> None:
    """Issue 3's check at the pool level: decoding 4,096 tokens with window 512 (Gemma-3-270M's
    groups, block size 16) keeps every local group at the window's blocks; only the global group
    grows with the context, and every page returns at the end."""
    bs, windows = 16, [g.sliding_window for g in kv_cache_groups(GEMMA3_270M_WINDOWS)]
    kv = HybridKVCacheManager(num_blocks=1024, block_size=bs, group_windows=windows, max_step_tokens=256)
    r = req("long", list(range(100)), max_tokens=4096)
    compute(kv, r)
    peak_local = 0
    for t in range(4096):
        r.append_output_token(t % 50)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        per_group = kv.num_group_blocks("long")
        peak_local = max(peak_local, *per_group[1:])
        assert per_group[0] == kv.num_blocks_for(r.num_computed_tokens)
    bound = kv.groups[1].max_blocks_held(r.num_tokens, 1)
    assert peak_local <= bound == 512 // bs + 1  # the window (+ the new token) spans at most 33 blocks
    held = kv.num_request_blocks("long")
    # 428 pages instead of the 6 x 263 = 1,578 that one table for all layers would hold
    assert held == kv.num_blocks_for(4196) + 5 * peak_local < 6 * kv.num_blocks_for(4196) // 3
    kv.free(r)
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_prefix_hit_is_common_to_all_groups_and_groups_never_share_blocks() -> None:
    kv = HybridKVCacheManager(num_blocks=64, block_size=4, group_windows=[None, 6, 6], enable_prefix_caching=True)
    a = req("a", list(range(17)))
    compute(kv, a)
    before = [list(t) for t in kv.get_block_tables("a")]
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1)  # the next step frees what left the window
    a.num_computed_tokens += 1
    tables_a = [list(t) for t in kv.get_block_tables("a")]
    live = [b for t in tables_a for b in t if b != NULL_BLOCK]
    assert len(live) == len(set(live))  # a page belongs to one group
    # 17 tokens computed, window 6: keys below 12 are dead, so local blocks 0..2 are freed
    assert tables_a[1][:4] == [NULL_BLOCK] * 3 + [before[1][3]] and tables_a[0][:4] == before[0][:4]
    kv.free(a)
    b = req("b", list(range(17)))
    blocks, cached = kv.get_computed_blocks(b)
    # the local groups' first block was freed but is still cached, so all 4 full blocks hit
    assert cached == 16 and [len(x) for x in blocks] == [4, 4, 4]
    assert blocks[0] == before[0][:4] and blocks[1] == before[1][:4] and blocks[2] == before[2][:4]
    compute(kv, b)
    assert kv.prefix_cache_hits == 16 and kv.prefix_cache_queries == 34
    kv.free(b)
    # evict a local group's cached blocks only: the common hit shrinks to what every group has
    kv.reset_prefix_cache()
    c = req("c", list(range(17)))
    assert kv.get_computed_blocks(c) == ([[], [], []], 0)


def test_allocation_is_all_or_nothing_across_groups() -> None:
    kv = HybridKVCacheManager(num_blocks=5, block_size=4, group_windows=[None, 8])
    a = req("a", list(range(8)))
    compute(kv, a)  # 2 + 2 pages
    assert kv.num_free_blocks == 1
    b = req("b", list(range(100, 104)))
    assert not kv.allocate_slots(b, 4)  # needs one page per group
    assert kv.get_block_tables("b") == [[], []] and kv.num_free_blocks == 1
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, [[1], []], 4)


def test_swap_and_fork_act_on_every_group() -> None:
    kv = HybridKVCacheManager(num_blocks=32, block_size=4, group_windows=[None, 4], num_host_blocks=16)
    a = req("a", list(range(10)))
    compute(kv, a)
    before = kv.num_group_blocks("a")
    pairs = kv.swap_out(a)
    assert pairs is not None and len(pairs) == sum(before) and a.swapped_out
    assert kv.num_free_blocks == 32 and kv.num_blocks_to_swap_in(a) == sum(before)
    back = kv.swap_in(a)
    assert back is not None and len(back) == sum(before) and not a.swapped_out
    assert kv.num_group_blocks("a") == before
    c = req("c", a.all_token_ids)
    kv.fork(a, c, 9)
    c.num_computed_tokens = 9
    assert kv.allocate_slots(c, 1)
    copies = kv.take_block_copies()
    assert len(copies) == 2  # the shared last block, once per group
    kv.free(a)
    kv.free(c)
    assert kv.num_free_blocks == 32 and kv.host_pool.num_free_blocks == 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_on_hybrid_groups_finishes_everything(mode: str) -> None:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, preemption_mode=mode)
    kv = HybridKVCacheManager(num_blocks=16, block_size=4, group_windows=[None, 6], num_host_blocks=32,
                              enable_prefix_caching=True)
    sched = Scheduler(cfg, kv, 1000)
    reqs = [req(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=14) for i in range(4)]
    _run(sched, reqs)
    assert all(r.output_token_ids == [1000 + r.num_prompt_tokens + k for k in range(14)] for r in reqs)
    assert sched.num_preemptions_total > 0
    assert kv.num_free_blocks == 16 and kv.host_pool.num_free_blocks == 32


def test_radix_is_refused_for_hybrid_groups() -> None:
    with pytest.raises(ValueError, match="radix"):
        HybridKVCacheManager(8, 4, [None, 4], enable_prefix_caching=True, prefix_cache="radix")
    with pytest.raises(ValueError):
        HybridKVCacheManager(8, 4, [None])


class HybridKVMachine(KVMachine):
    """The random allocate / append / fork / free / swap / evict machine over three KV cache
    groups (one full, two with window 4) sharing one pool."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(num_blocks=30, block_size=3, group_windows=[None, 4, 4],
                                       enable_prefix_caching=True, num_host_blocks=15)

    @invariant()
    def consistent(self) -> None:
        kv = self.kv
        refs = [0] * kv.pool.num_blocks
        for rid in kv.request_ids():
            for table in kv.get_block_tables(rid):
                for b in table:
                    if b != NULL_BLOCK:
                        refs[b] += 1
        for b in range(kv.pool.num_blocks):
            assert kv.pool.ref_count(b) == refs[b] >= 0
        free = set(kv.pool.free_block_ids())
        assert all((refs[b] == 0) == (b in free) for b in range(kv.pool.num_blocks))
        host_used = sum(kv.num_blocks_to_swap_in(r) for r in self.live.values() if r.swapped_out)
        assert kv.host_pool.num_used_blocks == host_used
        for r in self.live.values():
            if not r.swapped_out:
                tables = kv.get_block_tables(r.request_id)
                assert all(len(t) == kv.num_blocks_for(r.num_computed_tokens) for t in tables)


TestHybridKVMachine = HybridKVMachine.TestCase
TestHybridKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
