"""Parity of our paged-KV model runner with transformers (the reference implementation).

Real SmolLM2-135M GGUF: greedy tokens and last-position logits, several sequences batched,
chunked prefill mixed with batched decodes, block sizes 16 / 32, shuffled block ids.
Random tiny Llama / Qwen2 (q/k/v bias) / Mistral (sliding window) models saved with
``save_pretrained`` and loaded through our safetensors loader: logits at every step and
greedy tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tests.conftest import hf_greedy

from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.request import Request
from kvfleet.model.loader import LoadedModel, load_model
from kvfleet.model.runner import ModelRunner
from kvfleet.sampling_params import SamplingParams


def argmax_sampler(logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
    return [SampleResult(int(t)) for t in logits.argmax(dim=-1)]


def drive(runner: ModelRunner, prompts: list[list[int]], max_new: int, chunk: int, seed: int = 0,
          use_execute: bool = False) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Hand-written scheduler loop: all sequences run concurrently; prompts are prefilled in
    chunks of ``chunk`` tokens (sharing steps with other sequences' decodes), then decoded one
    token per step. Each sequence owns blocks drawn from a shuffled pool.

    Returns per sequence the generated tokens and the float32 logits each sample came from.
    """
    bs = runner.block_size
    pool = list(range(runner.num_blocks))
    random.Random(seed).shuffle(pool)
    reqs, tables = [], []
    for i, p in enumerate(prompts):
        reqs.append(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_new)))
        need = -(-(len(p) + max_new) // bs)
        tables.append([pool.pop() for _ in range(need)])
    logits_seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(r.num_output_tokens < max_new for r in reqs):
        plan = []
        for r, bt in zip(reqs, tables):
            if r.num_output_tokens >= max_new:
                continue
            start = r.num_computed_tokens
            n = min(chunk, r.num_tokens - start)
            plan.append(ScheduledRequest(r, start, n, list(bt), needs_sample=start + n == r.num_tokens))
        sched = SchedulerOutput(plan)
        if use_execute:
            out = {k: v.token_id for k, v in runner.execute(sched).items()}
        else:
            lg = runner.compute_logits(sched)
            out = {}
            for i, r in enumerate(reqs):
                if r.request_id in lg:
                    logits_seen[i].append(lg[r.request_id])
                    out[r.request_id] = int(lg[r.request_id].argmax())
        for s in plan:  # the engine's bookkeeping, done here by hand
            s.request.num_computed_tokens += s.num_new_tokens
            if s.needs_sample:
                s.request.append_output_token(out[s.request.request_id])
            else:
                assert s.request.request_id not in out
    return [r.output_token_ids for r in reqs], logits_seen


# ---------------------------------------------------------------------------- SmolLM2 (real model)
@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> LoadedModel:
    return load_model(smollm2_path, load_tokenizer=False)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    short = hf_tokenizer.encode("The capital of France is")
    msgs = [{"role": "user", "content": "Write a short poem about the sea and the wind, please. "
                                        "Make it rhyme and keep it to four lines."}]
    chat = hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    mid = hf_tokenizer.encode(chat)
    text = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is not "
            "wasted on padding and sequences can share prefixes. ") * 20
    long = hf_tokenizer.encode(text)[:300] + hf_tokenizer.encode(" In summary,")
    assert len(short) == 5 and 30 <= len(mid) <= 60 and len(long) > 300
    return [short, mid, long]


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, 24) for p in prompts]


@pytest.mark.parametrize("block_size,chunk,use_execute", [(16, 128, False), (32, 64, True)])
def test_smollm2_greedy_matches_transformers(ours, hf_model, prompts, hf_reference, block_size, chunk,
                                             use_execute):
    runner = ModelRunner(ours, block_size=block_size, num_blocks=96, sampler=argmax_sampler)
    tokens, seen = drive(runner, prompts, 24, chunk=chunk, seed=block_size, use_execute=use_execute)
    assert tokens == hf_reference
    if use_execute:
        return
    # logits of every sampled position (after the chunked prefill, then each batched decode)
    for p, toks, lgs in zip(prompts, tokens, seen, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p + toks[:-1]])).logits[0].float()
        assert len(lgs) == len(toks)
        for j, lg in enumerate(lgs):
            assert lg.dtype == torch.float32 and lg.shape == (ours.config.vocab_size,)
            assert (lg - ref[len(p) - 1 + j]).abs().max().item() < 1e-3


def test_smollm2_default_sampler_greedy(ours, prompts, hf_reference):
    # sampler=None: the runner uses kvfleet.model.sampler.Sampler (greedy at temperature 0)
    runner = ModelRunner(ours, block_size=16, num_blocks=8)
    tokens, _ = drive(runner, prompts[:1], 6, chunk=512, use_execute=True)
    assert tokens == [hf_reference[0][:6]]


def test_compute_logits_only_for_sampled(ours):
    runner = ModelRunner(ours, block_size=16, num_blocks=8, sampler=argmax_sampler)
    r1 = Request("a", list(range(10, 30)), SamplingParams(temperature=0))
    r2 = Request("b", list(range(40, 45)), SamplingParams(temperature=0))
    sched = SchedulerOutput([ScheduledRequest(r1, 0, 16, [3, 5], needs_sample=False),
                             ScheduledRequest(r2, 0, 5, [1], needs_sample=True)])
    out = runner.execute(sched)
    assert list(out) == ["b"] and isinstance(out["b"], SampleResult)
    assert r1.output_token_ids == [] and r1.num_computed_tokens == 0  # requests untouched
    # KV was written only to the blocks the tables name
    k0 = runner.kv_caches[0][0]
    assert k0[3].abs().sum() > 0 and k0[1, :5].abs().sum() > 0
    assert k0[1, 5:].abs().sum() == 0 and k0[5].abs().sum() == 0 and k0[0].abs().sum() == 0
    bad = SchedulerOutput([ScheduledRequest(r1, 0, 20, [3], needs_sample=True)])
    with pytest.raises(ValueError, match="block table too short"):
        runner.execute(bad)
    assert runner.execute(SchedulerOutput()) == {}


# ---------------------------------------------------------------------------- random tiny models
def _tiny_hf(kind: str, tmp_path: Path, hf_tokenizer, sliding_window: int | None = None):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        # full-size vocab so the SmolLM2 tokenizer can be saved alongside; rope_theta not default
        common.update(vocab_size=49152, tie_word_embeddings=True, rope_theta=50000.0)
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=sliding_window, head_dim=16)
        cls = transformers.MistralForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(1234)
    model = cls(cfg).eval()
    if kind == "qwen2":  # random biases are zero-initialised; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    folder = tmp_path / kind
    model.save_pretrained(folder)
    if kind == "llama":
        hf_tokenizer.save_pretrained(folder)
    model.config._attn_implementation = "eager"
    return model, folder


def _check_against_hf(hf, loaded: LoadedModel, prompts, max_new, chunk, block_size):
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=64, sampler=argmax_sampler)
    tokens, seen = drive(runner, prompts, max_new, chunk=chunk, seed=block_size)
    for p, toks, lgs in zip(prompts, tokens, seen, strict=True):
        full = torch.tensor([p + toks[:-1]])
        with torch.no_grad():
            ref = hf(full).logits[0].float()
        for j, lg in enumerate(lgs):
            torch.testing.assert_close(lg, ref[len(p) - 1 + j], atol=2e-4, rtol=1e-4)
        assert toks == hf_greedy(hf, p, max_new)
    return tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_random_llama_qwen2_match_transformers(kind, tmp_path, hf_tokenizer):
    hf, folder = _tiny_hf(kind, tmp_path, hf_tokenizer)
    loaded = load_model(folder, load_tokenizer=(kind == "llama"))
    assert loaded.format == "safetensors" and loaded.name == kind and len(loaded.sha256) == 64
    assert loaded.config.architecture == kind
    assert loaded.config.attention_bias == (kind == "qwen2")
    if kind == "llama":
        assert loaded.config.tie_word_embeddings and loaded.config.rope_theta == 50000.0
        assert loaded.tokenizer.encode("hello world") == hf_tokenizer.encode("hello world")
    g = torch.Generator().manual_seed(0)
    v = loaded.config.vocab_size
    prompts = [torch.randint(3, v, (n,), generator=g).tolist() for n in (7, 33, 1)]
    _check_against_hf(hf, loaded, prompts, max_new=12, chunk=16, block_size=8)


def test_random_mistral_sliding_window_matches_transformers(tmp_path, hf_tokenizer):
    window = 8
    hf, folder = _tiny_hf("mistral", tmp_path, hf_tokenizer, sliding_window=window)
    loaded = load_model(folder, load_tokenizer=False)
    assert loaded.config.sliding_window == window and loaded.config.head_dim == 16
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (30, 11)]
    # the reference really applies the window: without it the logits differ
    with torch.no_grad():
        x = torch.tensor([prompts[0]])
        windowed = hf(x).logits[0, -1]
        hf.config.sliding_window = None
        full = hf(x).logits[0, -1]
        hf.config.sliding_window = window
    assert (windowed - full).abs().max() > 1e-2
    # whole-prompt prefill (window mask from position 0) and chunked prefill (offset mask)
    _check_against_hf(hf, loaded, prompts, max_new=20, chunk=64, block_size=4)
    _check_against_hf(hf, loaded, prompts, max_new=20, chunk=7, block_size=16)
