"""The simulated engine's core loop (no HTTP): output lengths, prefix caching reducing the prefill
work, aborts, preemption and admission errors, on the real scheduler and KV cache manager."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestTooLongError
from kvfleet.sim.engine import SimEngine, SimEngineConfig
from kvfleet.sim.latency import LatencyModel

FAST = LatencyModel(base_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=1e-3, kv_read_s_per_token=1e-6)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _drain(stream) -> tuple[list[int], str, str]:
    ids: list[int] = []
    text = ""
    finish = None
    async for d in stream:
        ids += d.token_ids
        text += d.text
        finish = d.finish_reason
    return ids, text, finish


def _engine(**kw) -> SimEngine:
    kw.setdefault("latency", FAST)
    kw.setdefault("time_scale", 0.0)
    return SimEngine(SimEngineConfig(**kw))


def test_output_lengths_and_finish_reasons():
    async def main():
        e = _engine(default_max_tokens=5, max_model_len=64)
        e.start()
        ids = e.tokenize_prompt("x" * 40)  # 10 tokens
        out = await _drain(e.add_request("a", ids, max_tokens=7))
        assert len(out[0]) == 7 and out[2] == "length"
        out = await _drain(e.add_request("b", ids, max_tokens=7, ignore_eos=True))
        assert len(out[0]) == 7 and out[2] == "length"
        out = await _drain(e.add_request("c", ids))  # no max_tokens: the simulated EOS
        assert len(out[0]) == 5 and out[2] == "stop"
        out = await _drain(e.add_request("d", ids, ignore_eos=True))  # ... or up to max_model_len
        assert len(out[0]) == 64 - 10 and out[2] == "length"
        # same prompt, same completion
        again = await _drain(e.add_request("e", ids, max_tokens=7))
        first = await _drain(e.add_request("f", ids, max_tokens=7))
        assert again == first
        assert e.kv_cache_manager.num_free_blocks == e.num_blocks
        assert e.scheduler.num_running == e.scheduler.num_waiting == 0
        await e.close()
        assert not e.healthy

    run(main())


def test_prefix_cache_hit_skips_prefill_work():
    async def main():
        e = _engine(block_size=16)
        e.start()
        ids = e.tokenize_prompt("a long shared system prompt. " * 40)  # 290 tokens
        s1 = e.add_request("a", ids, max_tokens=2)
        await _drain(s1)
        work1, modelled1 = e.total_work, e.total_modelled_s
        s2 = e.add_request("b", ids, max_tokens=2)
        await _drain(s2)
        assert s1.num_cached_tokens == 0
        assert s2.num_cached_tokens == (len(ids) - 1) // 16 * 16 == 288
        # the second request computed only the uncached tail of its prompt, so its prefill step
        # (its time to first token) is modelled much shorter
        assert work1.prefill_tokens == len(ids)
        assert e.total_work.prefill_tokens - work1.prefill_tokens == len(ids) - 288
        assert (e.total_modelled_s - modelled1) < modelled1 / 2
        await e.close()

    run(main())


def test_abort_frees_blocks_and_ends_the_stream():
    async def main():
        e = _engine(time_scale=1.0)  # 10 ms steps: the request is still running when aborted
        e.start()
        s = e.add_request("a", e.tokenize_prompt("y" * 400), max_tokens=1000, ignore_eos=True)
        got = []
        async for d in s:
            got.append(d)
            if len(got) == 3:
                s.abort()
        assert got[-1].finish_reason == "abort" and got[-1].token_ids == []
        await asyncio.sleep(0.05)
        assert e.kv_cache_manager.num_free_blocks == e.num_blocks
        assert e.scheduler.num_running == 0
        aborted = {"model_name": e.model_name, "finished_reason": "abort"}
        assert e.metrics.registry.get_sample_value("vllm:request_success_total", aborted) == 1
        s.abort()  # idempotent
        await e.close()

    run(main())


def test_small_pool_preempts_and_still_finishes_everything():
    async def main():
        # 12 blocks of 16 tokens; each request may grow to 40 + 60 = 100 tokens (7 blocks)
        e = _engine(num_kv_blocks=12, block_size=16, max_num_seqs=8)
        e.start()
        streams = [e.add_request(f"r{i}", e.tokenize_prompt(f"{i} " * 80), max_tokens=60) for i in range(6)]
        outs = await asyncio.gather(*(_drain(s) for s in streams))
        assert all(len(o[0]) == 60 and o[2] == "length" for o in outs)
        assert e.scheduler.num_preemptions_total > 0
        assert e.total_work.prefill_tokens > 6 * 40  # recompute after preemption counts as prefill
        assert e.kv_cache_manager.num_free_blocks == e.num_blocks
        await e.close()

    run(main())


def test_admission_errors():
    async def main():
        e = _engine(max_model_len=100, num_kv_blocks=4, block_size=16, max_waiting_requests=2)
        with pytest.raises(EngineDeadError):
            e.add_request("x", [1, 2, 3])  # not started
        e.start()
        with pytest.raises(RequestTooLongError):
            e.tokenize_prompt("z" * 400)  # 100 tokens: no room to generate
        with pytest.raises(RequestTooLongError):
            e.add_request("x", [1] * 50, max_tokens=51)  # over max_model_len
        with pytest.raises(RequestTooLongError):
            e.add_request("x", [1] * 50, max_tokens=40)  # 90 tokens > the pool's 64
        with pytest.raises(InvalidRequestError):
            e.tokenize_prompt([1, 2, 10**9])
        with pytest.raises(InvalidRequestError):
            e.tokenize_prompt("")
        with pytest.raises(InvalidRequestError):
            e.add_request("x", [1, 2], max_tokens=0)
        e.add_request("q1", [1] * 10, max_tokens=5)
        with pytest.raises(InvalidRequestError):
            e.add_request("q1", [1] * 10, max_tokens=5)  # duplicate id
        e.add_request("q2", [2] * 10, max_tokens=5)
        with pytest.raises(QueueFullError):
            e.add_request("q3", [3] * 10, max_tokens=5)
        await e.close()

    run(main())


def test_config_validation():
    with pytest.raises(ValueError):
        SimEngineConfig(num_kv_blocks=0)
    with pytest.raises(ValueError):
        SimEngineConfig(time_scale=-1.0)
    with pytest.raises(ValueError):
        SimEngineConfig(model_name="")
    assert SimEngineConfig(num_kv_blocks=10, block_size=16).resolved_max_model_len == 160
    assert SimEngineConfig().resolved_max_model_len == 8192
