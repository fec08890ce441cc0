"""KV-cache management on the real model (SmolLM2): every feature's output is compared with
the same requests run with the feature off (greedy or seeded), and the pool is read to show
the feature did its work (hits, copies, swaps, freed blocks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.conftest import assert_pool_free, make_engine, run_to_completion

from kvfleet.sampling_params import SamplingParams

SYSTEM = ("You are a careful assistant for a hardware store. Answer briefly and politely, name the aisle "
          "where the item is found, and never invent products. The store sells paint, tools, garden "
          "supplies, lumber, plumbing parts, electrical parts, and seasonal decorations. ")
QUESTIONS = ["Where are the hammers?", "Do you sell rose bushes?", "What paint is good for a bathroom?",
             "Where can I find copper pipe fittings?", "Do you have extension cords?"]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def ref_engine(smollm2_loaded):
    """The reference: prefix caching off, a roomy pool, no preemption."""
    return make_engine(smollm2_loaded, enable_prefix_caching=False)


def prompt_ids(engine, q: str) -> list[int]:
    return engine.tokenizer.encode(SYSTEM + q)


def reference(ref_engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(prompts):
        ref_engine.add_request(f"ref{i}", p, params)
    out = run_to_completion(ref_engine)
    assert_pool_free(ref_engine)
    return [out[f"ref{i}"][0].token_ids for i in range(len(prompts))]


def test_prefix_hit_in_the_middle_of_a_running_batch(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16)
    prompts = [prompt_ids(eng, q) for q in QUESTIONS[:3]]
    want = reference(ref_engine, prompts, greedy())
    eng.add_request("a", prompts[0], greedy())
    final = {}
    for step in range(200):
        if step == 3:  # "a" is decoding; its prompt blocks are cached by now
            eng.add_request("b", prompts[1], greedy())
            eng.add_request("c", prompts[2], greedy())
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert [final[r].outputs[0].token_ids for r in "abc"] == want
    full_blocks = (len(eng.tokenizer.encode(SYSTEM)) - 1) // 16 * 16
    assert final["a"].num_cached_tokens == 0
    assert final["b"].num_cached_tokens >= full_blocks > 0 and final["c"].num_cached_tokens >= full_blocks
    kv = eng.kv_cache_manager
    assert kv.prefix_cache_hits >= 2 * full_blocks
    assert kv.prefix_cache_queries == sum(len(p) for p in prompts)
    assert_pool_free(eng)


def test_hit_on_a_block_that_was_evicted_and_refilled(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16, num_kv_blocks=16)
    a = prompt_ids(eng, QUESTIONS[0])
    other = eng.tokenizer.encode("Tell me a long story about a lighthouse keeper and a storm. " * 20)[:220]
    assert len(other) == 220
    want_a, want_o = reference(ref_engine, [a, other], greedy(8))

    def run(rid, p):
        eng.add_request(rid, p, greedy(8))
        out = run_to_completion(eng)[rid][0].token_ids
        assert_pool_free(eng)
        return out

    kv = eng.kv_cache_manager
    assert run("a1", a) == want_a
    assert run("a2", a) == want_a and kv.prefix_cache_hits > 0  # served from cache
    cached = kv.get_computed_blocks(_probe(eng, a))[1]
    assert cached >= 16
    assert run("o", other) == want_o and kv.pool.num_evictions > 0  # 15 blocks: evicts a's prefix
    assert kv.get_computed_blocks(_probe(eng, a))[1] < cached
    assert run("a3", a) == want_a  # refilled after eviction
    hits = kv.prefix_cache_hits
    assert run("a4", a) == want_a and kv.prefix_cache_hits > hits  # and hit again


def _probe(eng, tokens):
    from kvfleet.engine.request import Request

    return Request("probe", tokens, greedy(1), max_tokens=1)


def test_shared_prefix_requests_with_one_aborted(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16)
    prompts = [prompt_ids(eng, q) for q in QUESTIONS[:3]]
    want = reference(ref_engine, prompts, greedy(16))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(16))
    final = {}
    for step in range(300):
        if step == 4:
            final["r1"] = eng.abort_request("r1")
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final["r0"].outputs[0].token_ids == want[0] and final["r2"].outputs[0].token_ids == want[2]
    assert final["r1"].outputs[0].finish_reason == "abort"
    assert_pool_free(eng)


def test_preempted_request_with_a_cached_prefix(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16, num_kv_blocks=7, max_num_batched_tokens=64)
    prompts = [prompt_ids(eng, q) for q in QUESTIONS[:3]]
    want = reference(ref_engine, prompts, greedy(20))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(20))
    out = run_to_completion(eng)
    assert [out[f"r{i}"][0].token_ids for i in range(3)] == want
    assert eng.scheduler.num_preemptions_total > 0 and eng.kv_cache_manager.prefix_cache_hits > 0
    assert_pool_free(eng)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_n_greater_than_1_with_seeds_equals_independent_requests(smollm2_loaded, ref_engine, preemption):
    kw = dict(preemption_mode="swap", swap_space_bytes=64 * 2**20) if preemption == "swap" else {}
    eng = make_engine(smollm2_loaded, block_size=16, num_kv_blocks=9, **kw)  # forces preemption
    p = prompt_ids(eng, QUESTIONS[1])
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=123, max_tokens=24, ignore_eos=True)
    for i in range(4):
        ref_engine.add_request(f"ind{i}", p, dataclasses.replace(params, n=1, seed=123 + i))
    ref = run_to_completion(ref_engine)
    want = [ref[f"ind{i}"][0].token_ids for i in range(4)]
    assert len({tuple(w) for w in want}) > 1  # the seeds really differ
    eng.add_request("n4", p, params)
    got = run_to_completion(eng)["n4"]
    assert [got[i].token_ids for i in range(4)] == want
    kv = eng.kv_cache_manager
    assert kv.num_cow_copies > 0 or len(p) % 16 == 1
    assert eng.scheduler.num_preemptions_total > 0
    if preemption == "swap":
        assert eng.scheduler.num_swap_outs > 0
    assert_pool_free(eng)


def test_n8_on_a_1000_token_prompt_shares_blocks(smollm2_loaded, ref_engine):
    bs, max_tokens = 16, 8
    eng = make_engine(smollm2_loaded, block_size=bs, enable_prefix_caching=False)
    text = " ".join(f"item {i} costs {i * 7 % 100} dollars;" for i in range(400))
    p = eng.tokenizer.encode(text)[:1000]
    assert len(p) == 1000
    want = reference(ref_engine, [p], greedy(max_tokens))[0]
    eng.add_request("n8", p, SamplingParams(n=8, temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    peak, final = 0, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                final[c.index] = c
        peak = max(peak, eng.kv_cache_manager.pool.num_used_blocks)
    independent = 8 * -(-(1000 + max_tokens) // bs)
    assert peak <= independent // 4, (peak, independent)
    assert all(final[i].token_ids == want for i in range(8))
    assert_pool_free(eng)


def test_swap_preemption_output_equals_no_preemption(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16, num_kv_blocks=18, max_num_batched_tokens=64,
                      enable_prefix_caching=False, preemption_mode="swap", swap_space_bytes=64 * 2**20)
    prompts = [prompt_ids(eng, q) for q in QUESTIONS[:4]]
    want = reference(ref_engine, prompts, greedy(40))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(40))
    out = run_to_completion(eng)
    assert [out[f"r{i}"][0].token_ids for i in range(4)] == want
    s = eng.scheduler
    assert s.num_swap_outs > 0 and s.num_swap_ins == s.num_swap_outs
    assert eng.kv_cache_manager.host_pool.num_free_blocks == eng.kv_cache_manager.host_pool.num_blocks
    assert_pool_free(eng)


def test_beam_search_matches_transformers(smollm2_loaded, hf_model):
    eng = make_engine(smollm2_loaded, block_size=16)
    p = eng.apply_chat_template([{"role": "user", "content": "Name a primary color."}])
    width, n, max_new = 4, 2, 12
    eng.add_request("beam", p, SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0,
                                              max_tokens=max_new))
    got = run_to_completion(eng)["beam"]
    assert_pool_free(eng)
    eos = eng.eos_token_id
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_new,
                                length_penalty=1.0, early_stopping=False, eos_token_id=eos, pad_token_id=eos)
    for i in range(n):
        seq = ref[i, len(p):].tolist()
        if eos in seq:
            seq = seq[: seq.index(eos) + 1]
        assert got[i].token_ids == seq, (i, got[i].token_ids, seq)
    assert got[0].cumulative_logprob >= got[1].cumulative_logprob - 1e-6 or got[0].finish_reason != got[1].finish_reason


def test_beam_search_rejects_bad_params():
    from kvfleet.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(use_beam_search=True, n=2, temperature=1.0)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(use_beam_search=True, n=2, best_of=1, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=1, best_of=3)
    with pytest.raises(InvalidRequestError, match="beams"):
        SamplingParams(use_beam_search=True, best_of=11, temperature=0.0)


def test_sliding_window_frees_blocks_and_matches_transformers(smollm2_loaded, hf_model):
    """SmolLM2's weights run unchanged as a Mistral-style model with a sliding window; the
    transformers Mistral model with the same weights and window is the reference."""
    import transformers

    from kvfleet.model.families.llama import LlamaForCausalLM

    window, bs = 64, 16
    cfg = dataclasses.replace(smollm2_loaded.config, sliding_window=window, architecture="mistral")
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(smollm2_loaded.model.state_dict())
    loaded = dataclasses.replace(smollm2_loaded, config=cfg, model=model)
    eng = make_engine(loaded, block_size=bs, enable_prefix_caching=False)
    p = eng.tokenizer.encode("The history of the printing press begins in the fifteenth century. " * 8)[:100]
    max_new = 120
    eng.add_request("w", p, greedy(max_new))
    peak = 0
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
        peak = max(peak, eng.kv_cache_manager.pool.num_used_blocks)
    assert peak <= -(-(window + 1) // bs) + 2 < -(-(len(p) + max_new) // bs)
    hcfg = hf_model.config.to_dict()
    hcfg.update(sliding_window=window, model_type="mistral")
    for k in ("architectures", "_name_or_path", "transformers_version"):
        hcfg.pop(k, None)
    mcfg = transformers.MistralConfig(**hcfg)
    mcfg._attn_implementation = "eager"
    ref = transformers.MistralForCausalLM(mcfg).eval()
    ref.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new)
    assert final.outputs[0].token_ids == out[0, len(p):].tolist()
    assert_pool_free(eng)


def test_radix_prefix_cache_and_lpm_match_feature_off(smollm2_loaded, ref_engine):
    eng = make_engine(smollm2_loaded, block_size=16, prefix_cache="radix", scheduling_policy="lpm")
    prompts = [prompt_ids(eng, q) for q in QUESTIONS]
    want = reference(ref_engine, prompts, greedy(10))
    eng.add_request("first", prompts[0], greedy(10))
    first = run_to_completion(eng)["first"][0].token_ids
    for i, p in enumerate(prompts[1:], 1):
        eng.add_request(f"r{i}", p, greedy(10))
    out = run_to_completion(eng)
    assert [first] + [out[f"r{i}"][0].token_ids for i in range(1, len(prompts))] == want
    kv = eng.kv_cache_manager
    system_len = len(eng.tokenizer.encode(SYSTEM))
    # token-granular: every later request matched (about) the whole system prompt, not just
    # its full blocks (the last system token may merge with the question's first)
    common = system_len - 2
    assert kv.prefix_cache_hits >= (len(prompts) - 1) * common
    assert common % 16 == 0 or kv.prefix_cache_hits > (len(prompts) - 1) * (common // 16 * 16)
    assert kv.radix.num_cached_tokens > system_len
    assert_pool_free(eng)
