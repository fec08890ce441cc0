"""GGUF reader: metadata -> :class:`ModelConfig`, tensors -> fp32 torch tensors with Hugging Face names.

GGUF is llama.cpp's single-file format (ggml). Every tensor is dequantized to float32 with
``gguf.quants.dequantize``. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k``
of Llama-layout models (its rotary pairs adjacent elements); the permutation is undone here
so the model uses the Hugging Face ``rotate_half`` layout, as transformers' GGUF loader does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfleet.model.config import SUPPORTED_ARCHITECTURES, ModelConfig

# Architectures whose q/k rows llama.cpp permutes on conversion (Qwen2 uses NeoX rope: no permutation).
_PERMUTED_ARCHS = ("llama", "mistral")

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _field_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):
        return f.contents()
    # Older gguf versions: decode by hand.
    parts = [f.parts[i] for i in f.data]
    if len(parts) == 1:
        p = parts[0]
        return bytes(p).decode("utf-8") if p.dtype == np.uint8 else p.tolist()[0]
    return [bytes(p).decode("utf-8") if p.dtype == np.uint8 else p.tolist()[0] for p in parts]


def reverse_permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores, per head, the rows as interleaved pairs ``(0, d/2), (1, d/2+1), ...``;
    this restores ``[first half | second half]`` per head.

    Args:
        w: ``[n_heads * head_dim, in]`` weight or ``[n_heads * head_dim]`` bias.
        n_heads: heads of this projection (query heads for q, kv heads for k).
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_config(reader: Any, tensor_names: set[str]) -> ModelConfig:
    """Read the architecture from GGUF metadata (``{arch}.block_count``, ``{arch}.embedding_length`` ...).

    Raises:
        ValueError: ``general.architecture`` is not llama / mistral / qwen2, or a required key is missing.
    """
    arch = str(_field_value(reader, "general.architecture", "")).lower()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = ...) -> Any:
        v = _field_value(reader, f"{arch}.{name}", None)
        if v is None:
            if default is ...:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return default
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    vocab = key("vocab_size", None)
    if vocab is None:
        toks = _field_value(reader, "tokenizer.ggml.tokens", None)
        if toks is None:
            raise ValueError("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
        vocab = len(toks)
    scaling = None
    stype = key("rope.scaling.type", None)
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {stype!r}")
    sliding = key("attention.sliding_window", None)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=_opt_int(_field_value(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(_field_value(reader, "tokenizer.ggml.eos_token_id")),
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], str | None]:
    """Read a GGUF file.

    Returns:
        ``(config, weights, chat_template)``: weights are float32 tensors keyed by Hugging Face
        names (``model.layers.0.self_attn.q_proj.weight`` ...), torch shape order
        (``[out, in]``; ggml lists dimensions reversed), q/k un-permuted.

    Raises:
        ValueError: unsupported architecture, missing metadata, or a tensor name we cannot map.
    """
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(reader, names)
    weights: dict[str, torch.Tensor] = {}
    freq_factors = None
    for t in reader.tensors:
        # a plain ndarray view: numpy.memmap slicing makes dequantize several times slower
        arr = dequantize(t.data.view(np.ndarray), t.tensor_type)
        # dequantize returns numpy in torch order already ([out, in]); make sure of the element count.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as read-only views of the memmap
            arr = arr.copy()
        tensor = torch.from_numpy(arr).reshape(shape)
        if t.name == "rope_freqs.weight":
            freq_factors = tensor
            continue
        if t.name in _TOP_NAMES:
            weights[_TOP_NAMES[t.name]] = tensor
            continue
        m = _BLK_RE.match(t.name)
        if not m or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"cannot map GGUF tensor {t.name!r} for architecture {cfg.architecture}")
        layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
        if cfg.architecture in _PERMUTED_ARCHS and kind in ("attn_q", "attn_k"):
            n = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            tensor = reverse_permute_qk(tensor, n)
        weights[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"] = tensor
    if freq_factors is not None:
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": freq_factors.flatten().tolist()}
    template = _field_value(reader, "tokenizer.chat_template", None)
    return cfg, weights, (str(template) if template is not None else None)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """transformers tokenizer built from the GGUF's ``tokenizer.ggml.*`` metadata (takes seconds)."""
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
