"""Engine-level tests on the real SmolLM2 model: greedy parity with transformers under
continuous batching, preemption, chunked prefill and several block sizes; sampling features;
block accounting."""

from __future__ import annotations

import pytest
from tests.conftest import assert_pool_free, hf_greedy, make_engine, run_to_completion

from kvfleet.engine.request import RequestStatus
from kvfleet.errors import InvalidRequestError, RequestTooLongError
from kvfleet.sampling_params import SamplingParams

MAX_NEW = 24
EOS = 2

_TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each of them is prime.",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to French: The weather is nice today and I would like to go for a walk in the park.",
]


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """8 prompts of different lengths (2 .. ~330 tokens), as token ids."""
    ids = [hf_tokenizer.encode(t) for t in _TEXTS]
    long_text = " ".join(
        f"Paragraph {i}: the quick brown fox jumps over the lazy dog while counting to {i * 7}." for i in range(18)
    )
    ids.append(hf_tokenizer.encode(long_text + " Summarise the paragraphs above."))
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, MAX_NEW, eos_token_id=EOS) for p in prompts]


def _greedy_all(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = run_to_completion(engine)
    return [final[f"r{i}"][0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="default"),
        pytest.param({"block_size": 32}, id="block32"),
        pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 26, "max_num_batched_tokens": 128}, id="tiny-pool-preemption"),
    ],
)
def test_greedy_parity_with_transformers(smollm2_loaded, prompts, reference, overrides):
    engine = make_engine(smollm2_loaded, **overrides)
    preemptions = []
    engine.add_stat_logger(lambda s: preemptions.append(s.num_preemptions))
    got = _greedy_all(engine, prompts)
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"prompt {i} ({len(prompts[i])} tokens): ours {g} != transformers {r}"
    if "num_kv_blocks" in overrides:
        assert sum(preemptions) > 0, "the tiny pool was meant to force preemption"
    assert_pool_free(engine)


def test_offline_llm_api_generate_and_chat(smollm2_loaded, hf_model, hf_tokenizer):
    from kvfleet import LLM

    llm = LLM.__new__(LLM)  # reuse the loaded model instead of loading again
    import itertools

    llm.engine = make_engine(smollm2_loaded)
    llm._ids = itertools.count()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=20))
    ref_ids = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ref_ids = hf_tokenizer.encode(ref_ids, add_special_tokens=False)
    assert out[0].prompt_token_ids == ref_ids
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model, ref_ids, 20, eos_token_id=EOS)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
    outs = llm.generate(["Hello", "One two three"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_free(llm.engine)


def test_seed_reproducible_regardless_of_batch(smollm2_loaded):
    engine = make_engine(smollm2_loaded)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    engine.add_request("alone", "Tell me a story", p)
    alone = run_to_completion(engine)["alone"][0].token_ids
    for i in range(4):
        engine.add_request(f"other{i}", f"Noise request number {i}", SamplingParams(temperature=1.0, max_tokens=16))
    engine.add_request("batched", "Tell me a story", p)
    batched = run_to_completion(engine)["batched"][0].token_ids
    assert alone == batched
    engine.add_request("other-seed", "Tell me a story", SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                                        ignore_eos=True))
    assert run_to_completion(engine)["other-seed"][0].token_ids != alone
    assert_pool_free(engine)


def test_n_choices_stop_strings_and_logprobs(smollm2_loaded):
    engine = make_engine(smollm2_loaded)
    engine.add_request("n3", "Name a colour:", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                              logprobs=2))
    engine.add_request("stop", "Count: 1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=30, stop=[" 8"]))
    final = run_to_completion(engine)
    assert sorted(final["n3"]) == [0, 1, 2]
    for c in final["n3"].values():
        assert len(c.logprobs) == len(c.token_ids)
        for lp, tok in zip(c.logprobs, c.token_ids):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 2
            assert lp.top[0][1] >= lp.top[1][1]
    stop = final["stop"][0]
    assert stop.finish_reason == "stop" and stop.stop_reason == " 8"
    assert " 8" not in stop.text and stop.text.rstrip().endswith("7,")
    assert_pool_free(engine)


def test_abort_and_admission_errors_free_blocks(smollm2_loaded):
    engine = make_engine(smollm2_loaded, num_kv_blocks=64, max_model_len=512)
    engine.add_request("a", "Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "General Kenobi", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.num_blocks
    out = engine.abort_request("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None  # idempotent
    run_to_completion(engine)
    assert_pool_free(engine)
    with pytest.raises(RequestTooLongError):
        engine.add_request("long", [5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(RequestTooLongError):
        make_engine(smollm2_loaded, num_kv_blocks=4).add_request("x", [5] * 40, SamplingParams(max_tokens=40))
    with pytest.raises(InvalidRequestError):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request("oov", [10**9], SamplingParams())
    with pytest.raises(RequestTooLongError, match="characters"):  # refused before tokenizing
        engine.add_request("huge", "x" * 10_000_000, SamplingParams())
    with pytest.raises(InvalidRequestError, match="wizard"):
        engine.apply_chat_template([{"role": "wizard", "content": "hi"}])
    mutated = SamplingParams()
    mutated.max_tokens = 0
    with pytest.raises(InvalidRequestError):
        engine.add_request("mutated", "Hello", mutated)
    assert_pool_free(engine)
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
