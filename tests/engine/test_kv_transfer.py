"""P/D KV transfer at the engine level (:mod:`kvfleet.engine.kv_transfer`): a prompt prefilled on
engine A, its KV exported, serialized, decoded and imported into engine B, which then computes
only the prompt's last block and generates exactly what transformers and a lone engine generate.
Also: the import API of the KV cache managers (hash, radix, KV cache groups) without a model;
locally cached blocks not sent again; mismatched or damaged data refused with clear errors and no
leaked block; a prefix evicted on the prefill side, or a full pool on the decode side, falling
back to computing the prompt (still correct); fp8 KV caches; a random tiny Gemma 3 with KV cache
groups (local and global layers) through the real scheduler."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest
import torch
from tests.conftest import assert_pool_free, hf_greedy, make_engine, run_to_completion

from kvfleet.engine import kv_transfer as kvt
from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.request import Request
from kvfleet.sampling_params import SamplingParams

TEXT = ("The keeper of the lighthouse climbed the spiral stairs every evening at dusk, carrying oil and a "
        "cloth for the great lens. Ships passing the headland relied on the beam to find the channel "
        "between the reefs, and in fifty years no vessel had been lost on his watch. One winter night")
MAX_NEW = 8
BS = 16


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def engine(loaded, **kw):
    return make_engine(loaded, **{"num_kv_blocks": 48, "block_size": BS, **kw})


def count_computed(eng) -> list[int]:
    """Wrap the runner: the list gets the tokens each step computes."""
    seen: list[int] = []
    run = eng.runner.execute

    def execute(sched):
        seen.append(sched.num_batched_tokens)
        return run(sched)

    eng.runner.execute = execute
    return seen


def prefill(eng, ids: list[int], rid: str = "p") -> None:
    """What the router's prefill step does: the prompt with max_tokens=1."""
    eng.add_request(rid, ids, greedy(1))
    run_to_completion(eng)


def retag(data: bytes, layout: dict | None = None, **top) -> bytes:
    """Rewrite an export body's JSON header (tests of tampered data)."""
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12:12 + hlen])
    header["layout"].update(layout or {})
    header.update(top)
    new = json.dumps(header).encode()
    return data[:8] + struct.pack("<I", len(new)) + new + data[12 + hlen:]


@pytest.fixture(scope="module")
def ids(smollm2_loaded) -> list[int]:
    out = smollm2_loaded.tokenizer.encode(TEXT)
    assert 40 < len(out) < 90 and len(out) % BS not in (0, 1)
    return out


@pytest.fixture(scope="module")
def reference(smollm2_loaded, hf_model, ids) -> list[int]:
    """transformers' greedy tokens, checked equal to a lone engine's."""
    want = hf_greedy(hf_model, ids, MAX_NEW)
    lone = engine(smollm2_loaded)
    lone.add_request("lone", ids, greedy())
    assert run_to_completion(lone)["lone"][0].token_ids == want
    return want


@pytest.fixture(scope="module")
def exported(smollm2_loaded, ids):
    """Engine A after prefilling ``ids``, and the encoded export of that prefix."""
    a = engine(smollm2_loaded)
    prefill(a, ids)
    blocks = kvt.export_kv(a, ids)
    assert blocks.num_blocks == kvt.usable_blocks(len(ids), BS) == (len(ids) - 1) // BS
    return a, kvt.encode_kv(blocks)


# ---------------------------------------------------------------------------- the real model


def test_imported_prefix_is_not_recomputed_and_output_matches(smollm2_loaded, ids, reference, exported):
    a, data = exported
    b = engine(smollm2_loaded)
    blocks = kvt.decode_kv(data, kvt.kv_layout(b))
    res = kvt.import_kv(b, blocks, ids, pin_for="b")
    usable = (len(ids) - 1) // BS
    assert (res.num_usable_blocks, res.num_local_blocks, res.num_imported_blocks, res.fallback) == \
        (usable, 0, usable, None)
    assert res.num_bytes == blocks.nbytes == 2 * 30 * usable * BS * 3 * 64 * 4  # SmolLM2: 30 layers, 3x64 KV, fp32
    assert b.kv_cache_manager.num_free_blocks == b.num_blocks - usable  # pinned until the request runs
    computed = count_computed(b)
    b.add_request("b", ids, greedy())
    out = run_to_completion(b)["b"][0]
    assert out.token_ids == reference
    assert computed[0] == len(ids) - usable * BS  # only the last, partial block of the prompt
    assert sum(computed) == len(ids) - usable * BS + MAX_NEW - 1
    assert b.kv_cache_manager.prefix_cache_hits == usable * BS  # vllm:prefix_cache_hits_total
    assert_pool_free(a)
    assert_pool_free(b)


def test_request_metrics_show_the_hit_and_pins_last_until_scheduled(smollm2_loaded, ids, reference, exported):
    _, data = exported
    b = engine(smollm2_loaded)
    usable = (len(ids) - 1) // BS
    # the imported blocks are pinned: other requests' allocations cannot evict them meanwhile
    kvt.import_kv(b, kvt.decode_kv(data), ids, pin_for="late")
    hog = b.kv_cache_manager.pool.allocate(b.kv_cache_manager.num_free_blocks)  # everything else
    assert b.kv_cache_manager.num_free_blocks == 0
    b.kv_cache_manager.pool.free(hog)
    b.add_request("late", ids, greedy())
    outs = []
    while b.has_unfinished_requests():
        outs += b.step()
    final = [o for o in outs if o.finished][0]
    assert final.num_cached_tokens == usable * BS  # usage.prompt_tokens_details.cached_tokens
    assert final.outputs[0].token_ids == reference
    assert_pool_free(b)
    # a pin whose request never arrives is released by the next step
    b.kv_cache_manager.reset_prefix_cache()
    kvt.import_kv(b, kvt.decode_kv(data), ids, pin_for="never")
    assert b.kv_cache_manager.num_free_blocks < b.num_blocks
    b.step()
    assert_pool_free(b)


def test_locally_cached_blocks_are_not_fetched_again(smollm2_loaded, ids, reference, exported):
    a, _ = exported
    b = engine(smollm2_loaded)
    prefill(b, ids[:2 * BS + 3], "warm")  # B holds the first 2 blocks already
    assert kvt.local_hint(b, ids) == 2
    blocks = kvt.decode_kv(kvt.encode_kv(kvt.export_kv(a, ids, start_block=2)), kvt.kv_layout(b))
    usable = (len(ids) - 1) // BS
    assert (blocks.start_block, blocks.num_blocks) == (2, usable - 2)
    res = kvt.import_kv(b, blocks, ids)
    assert (res.num_local_blocks, res.num_imported_blocks, res.fallback) == (2, usable - 2, None)
    computed = count_computed(b)
    b.add_request("b", ids, greedy())
    assert run_to_completion(b)["b"][0].token_ids == reference
    assert computed[0] == len(ids) - usable * BS
    assert_pool_free(b)


def test_bad_or_mismatched_data_is_refused_without_leaks(smollm2_loaded, ids, exported):
    _, data = exported
    b = engine(smollm2_loaded)
    lay = kvt.kv_layout(b)
    cases = [
        (b"NOTKVFL!" + data[8:], "bad magic"),
        (data[:-100], "truncated KV transfer body"),
        (data[:20], "truncated KV transfer body"),
        (data + b"\0" * 16, "oversized"),
        (retag(data, {"model_sha256": "0" * 64}), "model \\(weights sha256\\) differs"),
        (retag(data, {"num_kv_heads": 4}), "KV heads differs"),
        (retag(data, {"block_size": 32}), "block size differs"),
        (retag(data, {"kv_dtype": "bfloat16"}), "KV dtype differs"),
        (retag(data, {"kv_dtype": "no_such_dtype"}), "unknown KV dtype"),
        (retag(data, {"quantization": "int8"}), "weight quantization differs"),
        (retag(data, {"compute_dtype": "bfloat16"}), "compute dtype differs"),
        (retag(data, {"num_layers": "30"}), "malformed KV layout"),
        (retag(data, num_blocks=2), "block count, start block and hashes disagree"),
        (retag(data, byteorder="big" if __import__("sys").byteorder == "little" else "little"), "endian"),
    ]
    for body, msg in cases:
        with pytest.raises(kvt.KVTransferError, match=msg):
            kvt.decode_kv(body, lay)
    good = kvt.decode_kv(data, lay)
    with pytest.raises(kvt.KVTransferError, match="hashes are not those of this prompt"):
        kvt.import_kv(b, good, ids[:-1] + [ids[-1] + 1] if len(ids) % BS == 0 else [ids[0] + 1] + ids[1:])
    with pytest.raises(kvt.KVTransferError, match="hashes are not those of this prompt"):
        kvt.import_kv(b, good, ids, cache_salt="other-tenant")
    # an engine of another block size or KV dtype refuses before touching its pool
    for other, msg in ((engine(smollm2_loaded, block_size=32), "block size differs"),
                       (engine(smollm2_loaded, kv_cache_dtype="fp8_e4m3"), "KV dtype differs")):
        with pytest.raises(kvt.KVTransferError, match=msg):
            kvt.import_kv(other, good, ids)
        with pytest.raises(kvt.KVTransferError, match=msg):
            kvt.decode_kv(data, kvt.kv_layout(other))
        assert_pool_free(other)
    assert_pool_free(b)
    assert b.kv_cache_manager.pool.num_cached_blocks == 0  # nothing half-imported stays cached


def test_prefix_evicted_on_the_prefill_side_falls_back_and_stays_correct(smollm2_loaded, ids, reference):
    usable = (len(ids) - 1) // BS
    a = engine(smollm2_loaded, num_kv_blocks=8)
    prefill(a, ids)
    other = smollm2_loaded.tokenizer.encode("A completely different text about gardens and roses. " * 16)[:6 * BS]
    assert len(other) == 6 * BS
    prefill(a, other, "other")  # takes 6 of 8 blocks: evicts the tail of the first prompt's blocks
    blocks = kvt.export_kv(a, ids)
    assert 0 < blocks.num_blocks < usable
    b = engine(smollm2_loaded)
    res = kvt.import_kv(b, kvt.decode_kv(kvt.encode_kv(blocks)), ids, pin_for="b")
    assert (res.num_imported_blocks, res.fallback) == (blocks.num_blocks, "prefix_missing")
    computed = count_computed(b)
    b.add_request("b", ids, greedy())
    assert run_to_completion(b)["b"][0].token_ids == reference
    assert computed[0] == len(ids) - blocks.num_blocks * BS
    # nothing cached at all: an empty export, the whole prompt computed
    a.kv_cache_manager.reset_prefix_cache()
    empty = kvt.export_kv(a, ids)
    assert empty.num_blocks == 0 and empty.nbytes == 0
    b.kv_cache_manager.reset_prefix_cache()
    res = kvt.import_kv(b, kvt.decode_kv(kvt.encode_kv(empty)), ids)
    assert (res.num_imported_blocks, res.fallback) == (0, "prefix_missing")
    assert_pool_free(a)
    assert_pool_free(b)


def test_full_decode_pool_falls_back(smollm2_loaded, ids, reference, exported):
    _, data = exported
    b = engine(smollm2_loaded)
    kv = b.kv_cache_manager
    hog = kv.pool.allocate(kv.num_free_blocks - 2)  # room for 2 of the prompt's blocks only
    res = kvt.import_kv(b, kvt.decode_kv(data), ids)
    assert (res.num_imported_blocks, res.fallback) == (0, "pool_full")
    assert kv.num_free_blocks == 2 and kv.pool.num_cached_blocks == 0
    kv.pool.free(hog)
    b.add_request("b", ids, greedy())
    assert run_to_completion(b)["b"][0].token_ids == reference
    assert_pool_free(b)


def test_radix_prefix_cache_on_both_sides(smollm2_loaded, ids, reference):
    a = engine(smollm2_loaded, prefix_cache="radix")
    prefill(a, ids)
    blocks = kvt.export_kv(a, ids)
    usable = (len(ids) - 1) // BS
    assert blocks.num_blocks == usable
    b = engine(smollm2_loaded, prefix_cache="radix")
    res = kvt.import_kv(b, kvt.decode_kv(kvt.encode_kv(blocks), kvt.kv_layout(b)), ids, pin_for="b")
    assert (res.num_imported_blocks, res.fallback) == (usable, None)
    computed = count_computed(b)
    b.add_request("b", ids, greedy())
    assert run_to_completion(b)["b"][0].token_ids == reference
    assert computed[0] == len(ids) - usable * BS
    assert_pool_free(a)
    assert_pool_free(b)


def test_fp8_kv_cache_moves_raw_fp8_bytes(smollm2_loaded, ids):
    a = engine(smollm2_loaded, kv_cache_dtype="fp8_e4m3")
    lone = engine(smollm2_loaded, kv_cache_dtype="fp8_e4m3")
    lone.add_request("lone", ids, greedy(4))
    want = run_to_completion(lone)["lone"][0].token_ids
    prefill(a, ids)
    blocks = kvt.export_kv(a, ids)
    assert blocks.layout.kv_dtype == "float8_e4m3fn" and blocks.layout.fp8_scales[0] == (1.0, 1.0)
    assert blocks.nbytes == 2 * 30 * blocks.num_blocks * BS * 3 * 64  # one byte per element
    b = engine(smollm2_loaded, kv_cache_dtype="fp8_e4m3")
    kvt.import_kv(b, kvt.decode_kv(kvt.encode_kv(blocks), kvt.kv_layout(b)), ids, pin_for="b")
    b.add_request("b", ids, greedy(4))
    assert run_to_completion(b)["b"][0].token_ids == want
    for layer in (0, 29):  # the blocks hold the very bytes engine A computed
        ka = a.runner.kv_caches[layer][0].data
        kb = b.runner.kv_caches[layer][0].data
        blocks_a = a.kv_cache_manager.cached_prefix_blocks(kvt._placeholder(a, ids, None, "t"))
        blocks_b = b.kv_cache_manager.cached_prefix_blocks(kvt._placeholder(b, ids, None, "t"))
        assert torch.equal(ka[blocks_a].view(torch.uint8), kb[blocks_b].view(torch.uint8))
    # a different per-tensor scale is a different layout
    b.runner.kv_caches[3][1].scale = 2.0
    with pytest.raises(kvt.KVTransferError, match="fp8 KV scales differ"):
        kvt.import_kv(b, blocks, ids)
    b.runner.kv_caches[3][1].scale = 1.0


def test_streaming_llm_engines_cannot_transfer(smollm2_loaded, ids):
    from kvfleet.config import CacheConfig, EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    e = LLMEngine(EngineConfig(cache=CacheConfig(num_kv_blocks=48, kv_eviction="streaming", streaming_window=64)),
                  loaded=smollm2_loaded)
    with pytest.raises(kvt.KVTransferError, match="kv-eviction streaming"):
        kvt.export_kv(e, ids)
    off = engine(smollm2_loaded, enable_prefix_caching=False)
    with pytest.raises(kvt.KVTransferError, match="needs prefix caching"):
        kvt.export_kv(off, ids)


# ---------------------------------------------------------------------------- managers, no model


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    r.cache_salt = salt
    return r


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_manager_import_api(mode):
    kv = KVCacheManager(16, 4, enable_prefix_caching=True, prefix_cache=mode)
    toks = list(range(100, 118))  # 18 tokens: 4 usable full blocks
    # warm: the first block is cached by an earlier request
    warm = _req("warm", toks[:5])
    assert kv.allocate_slots(warm, 5)
    warm.num_computed_tokens = 5
    kv.free(warm)
    imp = _req("imp", toks)
    assert kv.begin_import(imp, 16) == 1  # block 0 reused, blocks 1..3 to write
    table = list(kv.get_block_table("imp"))
    assert len(table) == 4 and kv.pool.ref_count(table[0]) >= 1
    probe = _req("probe", toks)
    assert len(kv.cached_prefix_blocks(probe)) == 1  # not registered before commit
    kv.commit_import(imp, 16)
    assert kv.cached_prefix_blocks(probe) == table
    kv.free(imp)
    assert kv.num_free_blocks == 16
    assert kv.cached_prefix_blocks(probe) == table  # cached after release
    # abort: nothing registered, nothing leaked
    other = _req("other", list(range(300, 318)))
    assert kv.begin_import(other, 12) == 0
    kv.abort_import(other)
    assert kv.num_free_blocks == 16 and kv.cached_prefix_blocks(_req("p2", list(range(300, 318)))) == []
    # short pool: None, nothing changed
    hog = kv.pool.allocate(kv.pool.num_free_blocks - 2) if mode == "hash" else None
    if hog is not None:
        assert kv.begin_import(_req("big", list(range(500, 518))), 16) is None
        assert kv.pool.num_free_blocks == 2
        kv.pool.free(hog)
    with pytest.raises(ValueError, match="multiple of the block size"):
        kv.begin_import(_req("x", toks), 6)
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(8, 4).begin_import(_req("y", toks), 4)


def test_hybrid_manager_import_is_all_or_nothing():
    kv = HybridKVCacheManager(12, 4, [None, 6, 6], enable_prefix_caching=True)
    toks = list(range(50, 63))  # 3 usable blocks in each of 3 groups = 9 pages
    r = _req("imp", toks)
    assert kv.begin_import(r, 12) == [0, 0, 0]
    kv.commit_import(r, 12)
    kv.free(r)
    assert [len(b) for b in kv.cached_prefix_blocks(_req("p", toks))] == [3, 3, 3]
    assert kv.num_free_blocks == 12
    kv2 = HybridKVCacheManager(8, 4, [None, 6, 6], enable_prefix_caching=True)  # 8 pages < 9
    assert kv2.begin_import(_req("imp", toks), 12) is None
    assert kv2.num_free_blocks == 8 and kv2.pool.num_cached_blocks == 0


def test_block_pool_unchanged_by_reads():
    # cached_prefix_blocks only reads: no ref count, no LRU change
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    r = _req("a", list(range(9)))
    kv.allocate_slots(r, 9)
    r.num_computed_tokens = 9
    kv.free(r)
    order = kv.pool.free_block_ids()
    assert len(kv.cached_prefix_blocks(_req("b", list(range(9))))) == 2
    assert kv.pool.free_block_ids() == order and isinstance(kv.pool, BlockPool)


# ---------------------------------------------------------------------------- KV cache groups (Gemma 3)


def test_kv_cache_groups_transfer_on_a_tiny_gemma3(tmp_path):
    """Random tiny Gemma 3 (local window 6 and global layers, block size 4): the prompt's KV of
    every group moves from one runner + hybrid manager to another; the receiving scheduler
    computes only the last block and the tokens equal transformers'."""
    from tests.model.test_gemma3 import _tiny_gemma
    from tests.model.test_parity import argmax_sampler

    from kvfleet.config import SchedulerConfig
    from kvfleet.engine.core.hybrid_kv_cache_manager import kv_cache_groups
    from kvfleet.engine.core.scheduler import Scheduler
    from kvfleet.engine.request import RequestStatus
    from kvfleet.model.loader import load_model
    from kvfleet.model.runner import ModelRunner

    hf, folder = _tiny_gemma(tmp_path, ["sliding_attention", "sliding_attention", "full_attention"] * 2, window=6)
    loaded = load_model(folder, load_tokenizer=False)
    groups = kv_cache_groups(loaded.config.layer_windows())
    bs, max_new = 4, 10

    def side():
        runner = ModelRunner(loaded, block_size=bs, num_blocks=48, sampler=argmax_sampler, kv_cache_groups=groups)
        kv = HybridKVCacheManager(48, bs, [g.sliding_window for g in groups], enable_prefix_caching=True,
                                  max_step_tokens=10)
        eng = SimpleNamespace(runner=runner, kv_cache_manager=kv, kv_cache_groups=groups, block_size=bs,
                              model_config=loaded.config, loaded=loaded, streaming=False)
        return eng, Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv, 256)

    def run(eng, sched, req):
        sched.add_request(req)
        first = None
        while sched.has_unfinished():
            out = sched.schedule()
            first = first if first is not None else out.scheduled[0].num_new_tokens
            res = eng.runner.execute(out)
            for s in out.scheduled:
                if s.needs_sample:
                    s.request.append_output_token(res[s.request.request_id].token_id)
                    if s.request.num_output_tokens >= s.request.max_tokens:
                        sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
        return first

    prompt = torch.randint(3, 512, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    a, sa = side()
    run(a, sa, Request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), max_tokens=1))
    blocks = kvt.export_kv(a, prompt)
    assert blocks.num_blocks == 5 and [g[1] for g in blocks.layout.groups] == [(2, 5), (0, 1), (3, 4)]
    b, sb = side()
    res = kvt.import_kv(b, kvt.decode_kv(kvt.encode_kv(blocks), kvt.kv_layout(b)), prompt)
    assert (res.num_imported_blocks, res.fallback) == (15, None)  # 5 blocks in each of 3 groups
    req = Request("d", prompt, SamplingParams(temperature=0.0, max_tokens=max_new), max_tokens=max_new)
    assert run(b, sb, req) == 23 - 20  # the prompt's last 3 tokens only
    assert req.output_token_ids == hf_greedy(hf, prompt, max_new)
    assert b.kv_cache_manager.num_free_blocks == 48 and a.kv_cache_manager.num_free_blocks == 48


def test_run_in_engine_between_steps_and_after_shutdown(smollm2_loaded, ids):
    import asyncio

    from kvfleet.engine.async_engine import AsyncLLM
    from kvfleet.errors import EngineDeadError

    llm = AsyncLLM(engine=engine(smollm2_loaded))
    llm.start()

    async def go() -> None:
        stream = llm.add_request("r", ids, greedy(4))
        seen = await llm.run_in_engine(lambda e: (e.block_size, e.has_unfinished_requests()))
        assert seen[0] == BS
        async for out in stream:
            last = out
        assert last.finished and len(last.outputs[0].token_ids) == 4
        with pytest.raises(ZeroDivisionError):
            await llm.run_in_engine(lambda e: 1 / 0)
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.run_in_engine(lambda e: 1), 5)

    asyncio.run(go())
