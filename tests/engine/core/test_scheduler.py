"""Scheduler: admission control, chunked prefill, preemption by recompute, aborts, and a
property-based simulation driven by a fake engine loop (random arrivals, tiny pools, small budgets)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvfleet.config import SchedulerConfig
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import SchedulerOutput
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from kvfleet.sampling_params import SamplingParams

FAKE_TOKEN = 7


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def make_scheduler(num_blocks: int, block_size: int, max_num_seqs: int = 8, max_batched: int = 64,
                   chunked: bool = True, max_model_len: int = 1000,
                   max_waiting: int | None = None) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                          max_waiting_requests=max_waiting, enable_chunked_prefill=chunked)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), max_model_len)


def fake_engine_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """What the engine does after the model ran: append a token where one is sampled, and
    finish requests that reached max_tokens. Returns the requests finished this step."""
    done = []
    for sr in out.scheduled:
        if sr.needs_sample:
            sr.request.append_output_token(FAKE_TOKEN)
            if sr.request.num_output_tokens >= sr.request.max_tokens:
                sched.finish_request(sr.request, RequestStatus.FINISHED_LENGTH)
                done.append(sr.request)
    return done


def assert_pool_matches(sched: Scheduler) -> None:
    """Running requests own disjoint blocks covering their computed tokens; nobody else owns any."""
    kv = sched.kv_cache_manager
    owned: list[int] = []
    for r in sched.running:
        table = kv.get_block_table(r.request_id)
        assert len(table) == kv.num_blocks_for(r.num_computed_tokens)
        owned.extend(table)
    for r in sched.waiting:
        assert kv.get_block_table(r.request_id) == []
        assert r.num_computed_tokens == 0
    assert len(owned) == len(set(owned))
    assert kv.num_free_blocks + len(owned) == kv.pool.num_blocks
    assert all(kv.pool.ref_count(b) == 1 for b in owned)


# ---------------------------------------------------------------------------- admission


def test_admission_too_long_for_max_model_len() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_model_len=20)
    with pytest.raises(RequestTooLongError, match=r"15 tokens.*max_tokens \(6\).*21 tokens.*max_model_len \(20"):
        sched.add_request(make_request("a", 15, 6))
    sched.add_request(make_request("b", 15, 5))  # exactly 20 is fine
    assert sched.num_waiting == 1


def test_admission_too_long_for_pool() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    with pytest.raises(RequestTooLongError, match=r"13 tokens needs 4 KV blocks.*3 blocks \(12 tokens\)") as e:
        sched.add_request(make_request("a", 10, 3))
    assert isinstance(e.value, InvalidRequestError)
    sched.add_request(make_request("b", 10, 2))
    assert sched.get_request("a") is None and sched.get_request("b") is not None


def test_admission_prompt_over_budget_without_chunked_prefill() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_batched=8, chunked=False)
    with pytest.raises(RequestTooLongError, match=r"9 tokens exceeds max_num_batched_tokens \(8"):
        sched.add_request(make_request("a", 9, 1))
    sched.add_request(make_request("b", 8, 1))
    chunked = make_scheduler(num_blocks=100, block_size=4, max_batched=8, chunked=True)
    chunked.add_request(make_request("a", 9, 1))


def test_admission_queue_full() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_waiting=2)
    sched.add_request(make_request("a", 3, 1))
    sched.add_request(make_request("b", 3, 1))
    with pytest.raises(QueueFullError, match=r"2 requests waiting, max_waiting_requests=2"):
        sched.add_request(make_request("c", 3, 1))
    assert sched.num_waiting == 2
    sched.schedule()  # both start running: the queue has room again
    sched.add_request(make_request("c", 3, 1))


def test_admission_rejects_empty_prompt_and_duplicate_id() -> None:
    sched = make_scheduler(num_blocks=10, block_size=4)
    with pytest.raises(InvalidRequestError):
        sched.add_request(make_request("a", 0, 1))
    sched.add_request(make_request("a", 2, 1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("a", 2, 1))


# ---------------------------------------------------------------------------- scheduling


def test_chunked_prefill_shares_steps_with_decode() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_batched=4)
    a = make_request("a", 2, 3)
    sched.add_request(a)
    out = sched.schedule()
    assert [(s.start_pos, s.num_new_tokens, s.needs_sample) for s in out.scheduled] == [(0, 2, True)]
    assert a.status is RequestStatus.RUNNING and a.first_scheduled_time is not None
    assert out.scheduled[0].token_ids == [100, 101]
    fake_engine_step(sched, out)

    b = make_request("b", 10, 1)
    sched.add_request(b)
    plan = []
    for _ in range(4):
        out = sched.schedule()
        plan.append([(s.request.request_id, s.start_pos, s.num_new_tokens, s.needs_sample) for s in out.scheduled])
        assert out.num_batched_tokens <= 4
        fake_engine_step(sched, out)
    assert plan == [
        [("a", 2, 1, True), ("b", 0, 3, False)],  # decode + first chunk
        [("a", 3, 1, True), ("b", 3, 3, False)],  # a finishes (3 tokens)
        [("b", 6, 4, True)],                      # last chunk samples; b finishes
        [],
    ]
    assert a.output_token_ids == [FAKE_TOKEN] * 3 and b.num_output_tokens == 1
    assert not sched.has_unfinished()
    assert sched.kv_cache_manager.num_free_blocks == 100


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_batched=6, chunked=False)
    a, b = make_request("a", 3, 5), make_request("b", 6, 1)
    sched.add_request(a)
    fake_engine_step(sched, sched.schedule())
    sched.add_request(b)
    out = sched.schedule()  # a's decode uses 1 token, b's 6 do not fit in the 5 left
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    fake_engine_step(sched, out)
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.needs_sample) for s in out.scheduled] == [("b", 6, True)]


def test_max_num_seqs_and_fcfs_order() -> None:
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_seqs=2)
    reqs = [make_request(f"r{i}", 2, 2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1 and list(sched.waiting) == [reqs[2]]


def test_preemption_newest_first_to_front_of_waiting() -> None:
    # block_size 1, 6 blocks: three 2-token prompts fill 6 blocks; the first decode needs a 7th.
    sched = make_scheduler(num_blocks=6, block_size=1)
    a, b, c = (make_request(x, 2, 3) for x in "abc")
    d = make_request("d", 1, 1)
    for r in (a, b, c, d):
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [a, b, c] and list(sched.waiting) == [d]
    fake_engine_step(sched, out)
    out = sched.schedule()
    assert out.preempted == [c]
    assert c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1 and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c, d]  # preempted goes to the FRONT
    assert [s.request for s in out.scheduled] == [a, b]  # nothing admitted after a preemption
    assert sched.kv_cache_manager.get_block_table("c") == []
    assert_pool_matches(sched)
    fake_engine_step(sched, out)
    # c resumes by recomputing prompt + its 1 output token, and samples its 2nd token then.
    while c.status is not RequestStatus.RUNNING:
        fake_engine_step(sched, sched.schedule())
    assert c.num_output_tokens == 2
    for _ in range(20):
        if not sched.has_unfinished():
            break
        fake_engine_step(sched, sched.schedule())
    assert not sched.has_unfinished()
    assert [r.num_output_tokens for r in (a, b, c, d)] == [3, 3, 3, 1]
    assert sched.num_preemptions_total >= 1
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_current_request_preempts_itself_when_newest() -> None:
    sched = make_scheduler(num_blocks=5, block_size=1)
    a, b = make_request("a", 2, 3), make_request("b", 2, 3)
    sched.add_request(a)
    sched.add_request(b)
    fake_engine_step(sched, sched.schedule())  # 4 of 5 blocks used
    out = sched.schedule()  # a takes the last block; b (the newest) must preempt itself
    assert out.preempted == [b] and [s.request for s in out.scheduled] == [a]
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert sched.kv_cache_manager.num_free_blocks == 2


def test_head_of_queue_is_not_skipped() -> None:
    sched = make_scheduler(num_blocks=5, block_size=1)
    a = make_request("a", 3, 2)
    big, small = make_request("big", 4, 1), make_request("small", 1, 1)
    for r in (a, big, small):
        sched.add_request(r)
    out = sched.schedule()
    # a takes 3 blocks; big needs 4 of the 2 left: small must not jump ahead of it.
    assert [s.request for s in out.scheduled] == [a] and list(sched.waiting) == [big, small]


# ---------------------------------------------------------------------------- aborts


def test_abort_waiting_running_and_preempted() -> None:
    sched = make_scheduler(num_blocks=5, block_size=1)
    a, b, w = make_request("a", 2, 3), make_request("b", 2, 3), make_request("w", 3, 1)
    for r in (a, b, w):
        sched.add_request(r)
    fake_engine_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [b]
    fake_engine_step(sched, out)
    # w waits, b is preempted (waiting at the front), a runs.
    assert list(sched.waiting) == [b, w] and sched.running == [a]
    for r in (w, b, a):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)  # idempotent
        assert r.status is RequestStatus.FINISHED_ABORTED
        assert sched.get_request(r.request_id) is None
        assert_pool_matches(sched)
    assert not sched.has_unfinished() and sched.num_running == sched.num_waiting == 0
    assert sched.kv_cache_manager.num_free_blocks == 5
    assert sched.schedule().is_empty
    # a finished status is kept; a non-finished status is refused
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert a.status is RequestStatus.FINISHED_ABORTED
    with pytest.raises(ValueError):
        sched.finish_request(a, RequestStatus.RUNNING)


# ---------------------------------------------------------------------------- simulation


@dataclass
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    abort_after: int | None  # abort this many steps after arrival (None = never)


arrivals_st = st.lists(
    st.builds(Arrival, st.integers(0, 8), st.integers(1, 12), st.integers(1, 8),
              st.one_of(st.none(), st.none(), st.integers(0, 15))),
    min_size=1, max_size=14,
)


def run_simulation(arrivals: list[Arrival], num_blocks: int, block_size: int, max_num_seqs: int,
                   max_batched: int, chunked: bool, max_model_len: int) -> tuple[Scheduler, dict[str, Request]]:
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, max_batched, chunked, max_model_len)
    kv = sched.kv_cache_manager
    admitted: dict[str, Request] = {}
    abort_at: dict[int, list[Request]] = {}
    pending = sorted(enumerate(arrivals), key=lambda x: x[1].step)
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][1].step <= step:
            i, arr = pending.pop(0)
            req = make_request(f"r{i}", arr.prompt_len, arr.max_tokens)
            total = arr.prompt_len + arr.max_tokens
            too_long = (total > max_model_len or kv.num_blocks_for(total) > num_blocks
                        or (not chunked and arr.prompt_len > max_batched))
            if too_long:
                with pytest.raises(RequestTooLongError):
                    sched.add_request(req)
                continue
            sched.add_request(req)
            admitted[req.request_id] = req
            if arr.abort_after is not None:
                abort_at.setdefault(step + arr.abort_after, []).append(req)
        for req in abort_at.pop(step, []):
            sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
            assert_pool_matches(sched)

        had_work = sched.has_unfinished()
        computed_before = {rid: r.num_computed_tokens for rid, r in admitted.items()}
        running_before = list(sched.running)
        out = sched.schedule()

        # budgets
        assert out.num_batched_tokens <= max_batched
        assert len(out.scheduled) <= max_num_seqs and sched.num_running <= max_num_seqs
        # progress: never an empty step while requests are unfinished
        assert not had_work or out.scheduled
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        tables: list[int] = []
        for s in out.scheduled:
            r = s.request
            assert s.num_new_tokens >= 1
            assert s.start_pos == computed_before[r.request_id]
            assert r.num_computed_tokens == s.start_pos + s.num_new_tokens <= r.num_tokens
            assert s.needs_sample == (r.num_computed_tokens == r.num_tokens)
            assert len(s.token_ids) == s.num_new_tokens
            assert len(s.block_table) * block_size >= s.start_pos + s.num_new_tokens
            assert r.status is RequestStatus.RUNNING and r in sched.running
            if not chunked and s.start_pos == 0 and r.num_preemptions == 0:
                assert s.needs_sample  # a fresh prompt is never split without chunked prefill
            tables.extend(s.block_table)
        assert len(tables) == len(set(tables))
        for r in out.preempted:
            assert r.status is RequestStatus.PREEMPTED and r in sched.waiting and r not in ids
        if out.preempted:
            # victims are the newest running requests, newest first; nothing new is admitted
            assert out.preempted == running_before[::-1][: len(out.preempted)]
            assert all(s.request in running_before for s in out.scheduled)
        assert_pool_matches(sched)

        fake_engine_step(sched, out)
        step += 1
        assert step < 5000, "simulation did not terminate"
    return sched, admitted


@settings(max_examples=150, deadline=None)
@given(
    arrivals=arrivals_st,
    num_blocks=st.integers(3, 20),
    block_size=st.integers(1, 3),
    max_num_seqs=st.integers(1, 6),
    max_batched=st.integers(1, 16),
    chunked=st.booleans(),
    max_model_len=st.integers(12, 64),
)
def test_simulation_every_request_finishes(arrivals: list[Arrival], num_blocks: int, block_size: int,
                                           max_num_seqs: int, max_batched: int, chunked: bool,
                                           max_model_len: int) -> None:
    sched, admitted = run_simulation(arrivals, num_blocks, block_size, max_num_seqs, max_batched,
                                     chunked, max_model_len)
    event(f"admitted {min(len(admitted), 5)}+ requests" if admitted else "nothing admitted")
    if sched.num_preemptions_total:
        event("preempted")
    for r in admitted.values():
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.output_token_ids == [FAKE_TOKEN] * r.max_tokens
        else:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens <= r.max_tokens
        assert sched.get_request(r.request_id) is None
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.usage == 0.0
    assert kv.request_ids() == []
    assert not sched.waiting and not sched.running


def test_simulation_tiny_pool_preempts_and_still_finishes() -> None:
    arrivals = [Arrival(0, 6, 8, None) for _ in range(4)] + [Arrival(2, 3, 5, None) for _ in range(3)]
    sched, admitted = run_simulation(arrivals, num_blocks=8, block_size=2, max_num_seqs=4, max_batched=8,
                                     chunked=True, max_model_len=64)
    assert sched.num_preemptions_total > 0
    assert any(r.num_preemptions > 0 for r in admitted.values())
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
               for r in admitted.values())
    assert sched.kv_cache_manager.num_free_blocks == 8


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(st.builds(Arrival, st.integers(0, 6), st.integers(1, 12), st.integers(1, 8), st.none()),
                      min_size=2, max_size=10),
    block_size=st.integers(1, 3),
    slack_blocks=st.integers(0, 4),
    max_num_seqs=st.integers(2, 6),
    max_batched=st.integers(1, 24),
    chunked=st.booleans(),
)
def test_simulation_under_memory_pressure(arrivals: list[Arrival], block_size: int, slack_blocks: int,
                                          max_num_seqs: int, max_batched: int, chunked: bool) -> None:
    """The pool holds the largest request plus a few blocks: every request is admitted, many
    steps preempt, and still every request ends with exactly max_tokens outputs."""
    if not chunked:
        max_batched = max(max_batched, max(a.prompt_len for a in arrivals))
    need = max(-(-(a.prompt_len + a.max_tokens) // block_size) for a in arrivals)
    sched, admitted = run_simulation(arrivals, need + slack_blocks, block_size, max_num_seqs, max_batched,
                                     chunked, max_model_len=64)
    assert len(admitted) == len(arrivals)
    if sched.num_preemptions_total:
        event("preempted")
    for r in admitted.values():
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [FAKE_TOKEN] * r.max_tokens
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.pool.num_blocks
