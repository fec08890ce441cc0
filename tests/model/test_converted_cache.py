"""The converted-GGUF cache (fast restarts) and lazily zeroed KV pools."""

from __future__ import annotations

import pytest
import torch

from kvfleet.model.layers.kv_cache import allocate_kv_pool, zeros_lazy
from kvfleet.model.loader import converted_cache_dir, load_model


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVFLEET_CONVERTED_CACHE", raising=False)
    return tmp_path


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_converted_cache_round_trip_and_repair(private_cache, smollm2_loaded):
    first = load_model("smollm2-135m-instruct", load_tokenizer=False)
    cache = converted_cache_dir(first.sha256, torch.float32)
    assert cache is not None and cache.is_relative_to(private_cache)
    assert (cache / "model.safetensors").is_file() and (cache / ".complete").is_file()
    second = load_model("smollm2-135m-instruct", load_tokenizer=False)  # read back from the cache
    assert second.config == first.config == smollm2_loaded.config
    assert second.chat_template == first.chat_template
    assert _same_weights(second.model, smollm2_loaded.model)
    # a damaged cache is converted again
    (cache / "model.safetensors").write_bytes(b"not safetensors")
    again = load_model("smollm2-135m-instruct", load_tokenizer=False)
    assert _same_weights(again.model, smollm2_loaded.model)
    assert (cache / ".complete").is_file() and (cache / "model.safetensors").stat().st_size > 10**6


def test_cache_can_be_turned_off(monkeypatch):
    for off in ("0", "false", "off"):
        monkeypatch.setenv("KVFLEET_CONVERTED_CACHE", off)
        assert converted_cache_dir("ab" * 32, torch.float32) is None
    monkeypatch.setenv("KVFLEET_CONVERTED_CACHE", "1")
    assert converted_cache_dir("ab" * 32, torch.bfloat16).name == "ab" * 32 + "-v1-bfloat16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zeros_lazy(dtype):
    t = zeros_lazy((3, 16, 2, 8), dtype)
    assert t.dtype == dtype and t.shape == (3, 16, 2, 8) and t.is_contiguous()
    assert float(t.float().abs().sum()) == 0.0
    t[1, 2] = 1  # writable, no aliasing between calls
    assert float(zeros_lazy((3, 16, 2, 8), dtype).float().abs().sum()) == 0.0


def test_kv_pool_is_zeroed():
    pool = allocate_kv_pool(64, 16, 3, 64, "auto", torch.float32)
    assert pool.shape == (64, 16, 3, 64) and float(pool.abs().sum()) == 0.0
