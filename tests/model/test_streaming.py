"""StreamingLLM attention sinks (Xiao et al. 2024; ``--kv-eviction streaming``).

(b) the attention math against a reference that literally re-assigns cache positions and applies
RoPE from scratch; (a) before any eviction the model's output equals normal attention; (c) an
engine run far past max_model_len in a bounded number of blocks; (d) bad flags give clear errors;
plus prefill-chunk / decode consistency of the runner's streaming path.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.conftest import assert_pool_free

from kvfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler_output import ScheduledRequest
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.request import Request
from kvfleet.model.layers.rotary import RotaryEmbedding
from kvfleet.model.layers.streaming import build_streaming_metadata, streaming_attention
from kvfleet.model.runner import ModelRunner
from kvfleet.sampling_params import SamplingParams

# ---------------------------------------------------------------------------- (b) unit check

D, H, KVH, BS = 16, 4, 2, 4
ROT = RotaryEmbedding(D, 10000.0, 64)


def _reference(q0: torch.Tensor, k0: torch.Tensor, v: torch.Tensor, qpos: int, S: int, N: int,
               reassign: bool = True) -> torch.Tensor:
    """One query at absolute ``qpos`` (unrotated ``q0`` ``[H, D]``) over unrotated keys ``k0`` /
    values ``v`` ``[L, KVH, D]``: StreamingLLM's cache positions assigned literally (sinks at
    ``0..S-1``, window at ``S..``, the query the newest entry), RoPE applied from scratch."""
    c = S + N - 1
    if qpos <= c:
        keys = list(range(qpos + 1))
        kcache = keys
        qcache = qpos
    else:
        window = list(range(qpos - N + 1, qpos + 1))
        keys = list(range(S)) + window
        kcache = list(range(S)) + [S + i for i in range(N)]
        qcache = c
        if not reassign:  # negative control: sinks at their absolute distance
            kcache = list(range(S)) + window
            qcache = qpos
    kc, ks = ROT.cos_sin(torch.tensor(kcache))
    qc, qs = ROT.cos_sin(torch.tensor([qcache]))
    kr = RotaryEmbedding.apply(k0[keys], kc, ks).double()  # [K, KVH, D]
    qr = RotaryEmbedding.apply(q0[None], qc, qs)[0].double()  # [H, D]
    G = H // KVH
    out = torch.empty(H, D, dtype=torch.float64)
    for h in range(H):
        s = kr[:, h // G] @ qr[h] / math.sqrt(D)
        out[h] = torch.softmax(s, 0) @ v[keys, h // G].double()
    return out.float()


def _paged_setup(L: int, S: int, N: int, seed: int):
    """Random unrotated q/k/v for positions ``0..L-1``; a pool filled with large garbage; a
    shuffled block table (block 0, where freed entries point, never in it)."""
    g = torch.Generator().manual_seed(seed)
    q0 = torch.randn(L, H, D, generator=g)
    k0 = torch.randn(L, KVH, D, generator=g)
    v = torch.randn(L, KVH, D, generator=g)
    nblk = -(-L // BS)
    kc = torch.randn(2 * nblk + 1, BS, KVH, D, generator=g) * 30
    vc = torch.randn(2 * nblk + 1, BS, KVH, D, generator=g) * 30
    table = (torch.randperm(2 * nblk, generator=g)[:nblk] + 1).tolist()
    return q0, k0, v, kc, vc, table


def _rot(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    c, s = ROT.cos_sin(pos)
    return RotaryEmbedding.apply(x, c, s)


def _free_like_manager(table: list[int], num_computed: int, S: int, N: int) -> list[int]:
    """The KV cache manager's rule: blocks without sink positions wholly before
    ``num_computed - N + 1`` become -1."""
    nsb = -(-S // BS)
    return [-1 if (b >= nsb and (b + 1) * BS <= num_computed - N + 1) else t for b, t in enumerate(table)]


@pytest.mark.parametrize("S,N", [(3, 10), (4, 8), (0, 9), (6, 5)])
def test_sink_rotation_matches_reassigned_cache_positions(S: int, N: int) -> None:
    L = 41
    q0, k0, v, kc, vc, table = _paged_setup(L, S, N, seed=S * 100 + N)
    pos = torch.arange(L)
    qr, kr = _rot(q0, pos), _rot(k0, pos)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(L)])
    # Decodes of three sequences sharing this table at different positions: before, at and far
    # past the first eviction (positions < qpos are already in the cache).
    for qpos in (5, S + N - 1, S + N, L - 1):
        kcache, vcache = kc.clone(), vc.clone()
        kcache.view(-1, KVH, D)[slots[:qpos]] = kr[:qpos]
        vcache.view(-1, KVH, D)[slots[:qpos]] = v[:qpos]
        t = _free_like_manager(table, qpos, S, N)
        meta = build_streaming_metadata(torch.tensor([qpos]), [(qpos, t, "r")], [], BS, S, N, ROT)
        out = streaming_attention(qr[qpos:qpos + 1], kr[qpos:qpos + 1], v[qpos:qpos + 1], kcache, vcache,
                                  slots[qpos:qpos + 1], meta)
        torch.testing.assert_close(out[0], _reference(q0[qpos], k0, v, qpos, S, N), rtol=0, atol=1e-5)
    # A batch of decodes at different positions in one group.
    kcache, vcache = kc.clone(), vc.clone()
    kcache.view(-1, KVH, D)[slots[:L - 1]] = kr[:L - 1]
    vcache.view(-1, KVH, D)[slots[:L - 1]] = v[:L - 1]
    qs = [3, 12, 20, L - 1]  # (the new K/V of the last one is written in the call)
    t = _free_like_manager(table, L - 1, S, N)
    meta = build_streaming_metadata(torch.tensor(qs), [(p, table if p < L - 1 else t, f"r{p}") for p in qs], [],
                                    BS, S, N, ROT)
    out = streaming_attention(qr[qs], kr[qs], v[qs], kcache, vcache, slots[qs], meta)
    for i, p in enumerate(qs):
        torch.testing.assert_close(out[i], _reference(q0[p], k0, v, p, S, N), rtol=0, atol=1e-5)
    # A prefill chunk (positions 17..40) over cached 0..16, and one from position 0.
    for start in (17, 0):
        kcache, vcache = kc.clone(), vc.clone()
        kcache.view(-1, KVH, D)[slots[:start]] = kr[:start]
        vcache.view(-1, KVH, D)[slots[:start]] = v[:start]
        t = _free_like_manager(table, start, S, N)
        meta = build_streaming_metadata(pos[start:], [], [(0, start, L - start, t, "p")], BS, S, N, ROT)
        out = streaming_attention(qr[start:], kr[start:], v[start:], kcache, vcache, slots[start:], meta)
        want = torch.stack([_reference(q0[p], k0, v, p, S, N) for p in range(start, L)])
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_reference_is_sensitive_to_the_sink_positions() -> None:
    """Negative control: the sinks' re-assigned positions matter (the check above can fail)."""
    S, N, L = 4, 8, 41
    q0, k0, v, *_ = _paged_setup(L, S, N, seed=1)
    diff = (_reference(q0[L - 1], k0, v, L - 1, S, N) - _reference(q0[L - 1], k0, v, L - 1, S, N, False)).abs()
    assert diff.max() > 1e-3


def test_freed_block_needed_by_the_window_is_an_error() -> None:
    table = [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="freed"):
        build_streaming_metadata(torch.tensor([20]), [(20, [1, 2, 3, -1, 5, 6], "r")], [], BS, 4, 8, ROT)
    with pytest.raises(ValueError, match="too short"):
        build_streaming_metadata(torch.tensor([30]), [(30, table, "r")], [], BS, 4, 8, ROT)
    with pytest.raises(ValueError, match="sink_tokens"):
        build_streaming_metadata(torch.tensor([3]), [(3, table, "r")], [], BS, -1, 8, ROT)


# ---------------------------------------------------------------------------- real model

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
        "trimmed the wick, and polished the great lens until it shone. Ships passing the rocky point "
        "relied on the beam to find the harbour entrance. In winter the storms were fierce, and the "
        "waves broke over the gallery rail, but the light never failed. One night a small boat drifted "
        "toward the reef with its sail torn and its engine silent. The keeper saw it, rang the bell, and "
        "rowed out through the swell with a lantern and a coil of rope.")


def streaming_engine(loaded, S: int = 4, N: int = 64, **sched) -> LLMEngine:
    cache = CacheConfig(kv_cache_memory_bytes=64 * 2**20, block_size=16, kv_eviction="streaming", sink_tokens=S,
                        streaming_window=N)
    return LLMEngine(EngineConfig(cache=cache, scheduler=SchedulerConfig(**sched)), loaded=loaded)


def plain_engine(loaded, **sched) -> LLMEngine:
    cache = CacheConfig(kv_cache_memory_bytes=64 * 2**20, block_size=16)
    return LLMEngine(EngineConfig(cache=cache, scheduler=SchedulerConfig(**sched)), loaded=loaded)


def greedy_tokens(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert_pool_free(engine)
    return [final[str(i)] for i in range(len(prompts))]


def teacher_forced_logits(runner: ModelRunner, ids: list[int], chunks: int | list[int], window: int | None,
                          sinks: int, block_size: int = 16) -> torch.Tensor:
    """float32 ``[len(ids), vocab]`` logits of ``ids`` fed through ``runner`` in chunks (all of
    size ``chunks``, or the sizes listed), blocks managed (and evicted) by a real
    :class:`KVCacheManager`."""
    mgr = KVCacheManager(runner.num_blocks, block_size, sliding_window=window, sink_tokens=sinks)
    req = Request("tf", ids, SamplingParams(max_tokens=1))
    rows = []
    sizes = chunks if isinstance(chunks, list) else [chunks] * -(-len(ids) // chunks)
    assert sum(sizes) >= len(ids)
    start = 0
    for size in sizes:
        n = min(size, len(ids) - start)
        assert mgr.allocate_slots(req, n)
        rows.append(runner.compute_token_logits(
            ScheduledRequest(req, start, n, list(mgr.get_block_table("tf")), False)))
        req.num_computed_tokens += n
        start += n
    mgr.free(req)
    assert mgr.num_free_blocks == runner.num_blocks
    return torch.cat(rows)


def test_streaming_equals_normal_attention_before_eviction(smollm2_loaded) -> None:
    """(a) While every position is < S + N nothing is evicted and the sinks sit at their own
    positions: greedy tokens and all-position logits equal normal attention."""
    prompts = ["The capital of France is", "Write a haiku about autumn leaves."]
    want = greedy_tokens(plain_engine(smollm2_loaded), prompts, 10)
    got = greedy_tokens(streaming_engine(smollm2_loaded, S=4, N=64), prompts, 10)
    assert got == want
    ids = smollm2_loaded.tokenizer.encode(TEXT)[:60]
    plain = ModelRunner(smollm2_loaded, 16, 8)
    stream = ModelRunner(smollm2_loaded, 16, 8, streaming=(4, 60))  # S + N - 1 >= every position
    a = teacher_forced_logits(plain, ids, 25, None, 0)
    b = teacher_forced_logits(stream, ids, 25, 60, 4)
    torch.testing.assert_close(b, a, rtol=0, atol=2e-4)


def test_streaming_prefill_chunks_equal_decodes_past_eviction(smollm2_loaded) -> None:
    """Past the first eviction, a long prefill chunk, small chunks and one-token decodes all give
    the same logits (queries in one chunk have different windows and sink rotations); and they
    differ from full attention there (the window really is applied)."""
    ids = smollm2_loaded.tokenizer.encode(TEXT)[:48]
    S, N = 4, 16
    runner = ModelRunner(smollm2_loaded, 8, 40, streaming=(S, N))
    one = teacher_forced_logits(runner, ids, 48, N, S, 8)
    chunked = teacher_forced_logits(runner, ids, 13, N, S, 8)
    decoded = teacher_forced_logits(runner, ids, [18] + [1] * 30, N, S, 8)  # decodes from position 18
    torch.testing.assert_close(chunked, one, rtol=0, atol=2e-4)
    torch.testing.assert_close(decoded, one, rtol=0, atol=2e-4)
    full = teacher_forced_logits(ModelRunner(smollm2_loaded, 8, 40), ids, 48, None, 0, 8)
    torch.testing.assert_close(one[:S + N], full[:S + N], rtol=0, atol=2e-4)
    assert (one[S + N:] - full[S + N:]).abs().max() > 0.1


@pytest.mark.parametrize("max_model_len,N,max_tokens", [
    (48, 16, 120),
    pytest.param(256, 64, 600, marks=pytest.mark.slow),
])
def test_generation_far_past_max_model_len_in_bounded_blocks(smollm2_loaded, max_model_len: int, N: int,
                                                             max_tokens: int) -> None:
    """(c) e.g. max_model_len 256, window 64, 4 sinks: 600 generated tokens; the pool never holds
    more than the sinks' block + the window's blocks + the partial block at the window's start;
    the text stays varied."""
    eng = streaming_engine(smollm2_loaded, S=4, N=N, max_model_len=max_model_len)
    prompt = "Tell me a long story about a dragon who loves cooking."
    eng.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    used = []
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out.outputs[0]
        used.append(eng.kv_cache_manager.pool.num_used_blocks)
    assert final is not None and len(final.token_ids) == max_tokens
    n_prompt = len(eng.tokenizer.encode(prompt))
    assert n_prompt + max_tokens > 2 * max_model_len
    bound = 1 + -(-N // 16) + 1  # sink block + window blocks + the partial block at its start
    assert max(used) <= bound, max(used)
    assert max(used) < -(-(n_prompt + max_tokens) // 16)
    assert_pool_free(eng)
    tail = final.token_ids[-max_tokens // 3:]
    # Greedy decoding of a 135M model ends up looping over a sentence (with the full cache too); this
    # only guards against collapse (1-2 tokens repeated) or garbage; quality is checked by perplexity.
    assert len(set(tail)) >= 10, eng.tokenizer.decode(tail)
    words = final.text.split()
    assert len(words) > max_tokens // 4 and sum(w.strip(".,!?;:'\"").isalpha() for w in words) > 0.7 * len(words), \
        final.text[-500:]


def test_bad_streaming_flags_give_clear_errors(smollm2_loaded) -> None:
    """(d)"""
    with pytest.raises(ValueError, match="sink_tokens"):
        CacheConfig(kv_eviction="streaming", sink_tokens=-1)
    with pytest.raises(ValueError, match="streaming_window"):
        CacheConfig(kv_eviction="streaming", streaming_window=0)
    with pytest.raises(ValueError, match="kv_eviction"):
        CacheConfig(kv_eviction="h2o")
    with pytest.raises(ValueError, match="sink_tokens"):
        ModelRunner(smollm2_loaded, 16, 4, streaming=(-1, 8))
    with pytest.raises(ValueError, match="window"):
        ModelRunner(smollm2_loaded, 16, 4, streaming=(4, 0))
    with pytest.raises(ValueError, match="pair"):
        ModelRunner(smollm2_loaded, 16, 4, streaming=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int"):
        ModelRunner(smollm2_loaded, 16, 4, streaming=(4.0, 8))  # type: ignore[arg-type]


def test_streaming_on_a_sliding_window_model_is_refused(smollm2_loaded) -> None:
    import dataclasses

    windowed = dataclasses.replace(smollm2_loaded, config=dataclasses.replace(smollm2_loaded.config,
                                                                               sliding_window=128))
    with pytest.raises(ValueError, match="sliding"):
        ModelRunner(windowed, 16, 4, streaming=(4, 64))
    with pytest.raises(ValueError, match="sliding window"):
        streaming_engine(windowed)


def test_cli_flags_reach_the_engine() -> None:
    from kvfleet.cli import build_parser, engine_config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "smollm2-135m-instruct", "--kv-eviction", "streaming", "--sink-tokens", "2",
                              "--streaming-window", "128"])
    cc = engine_config_from_args(args).cache
    assert (cc.kv_eviction, cc.sink_tokens, cc.streaming_window) == ("streaming", 2, 128)
    for bad in (["--sink-tokens", "-1"], ["--streaming-window", "0"], ["--kv-eviction", "lru"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "smollm2-135m-instruct", *bad])


@pytest.mark.slow
def test_streaming_perplexity_within_ten_percent_of_full_cache(smollm2_loaded) -> None:
    """Quality check (benchmarks/streaming_ppl.py): 2,048 tokens of a real text, 4 sinks + a
    256-token window: whole-text perplexity within 10 % of the full cache's; the same window
    without sinks is clearly worse (StreamingLLM's finding)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "streaming_ppl.py"
    spec = importlib.util.spec_from_file_location("streaming_ppl", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.run(num_tokens=2048, windows=(256,), sinks=4, loaded=smollm2_loaded)
    print(bench.format_table(res))
    full, sinks, no_sinks = res["rows"]
    assert (sinks["sinks"], no_sinks["sinks"]) == (4, 0)
    assert sinks["ratio_all"] <= 1.10, res
    assert no_sinks["ppl_all"] > 1.2 * sinks["ppl_all"], res
    assert sinks["peak_blocks"] < full["peak_blocks"] / 4
    assert res["accepted"]
