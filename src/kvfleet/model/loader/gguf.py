"""GGUF reader: metadata -> :class:`ModelConfig`, tensors -> fp32 torch tensors with Hugging Face names.

GGUF is llama.cpp's single-file format (ggml): a header, typed key/value metadata, tensor
descriptors, then aligned tensor data. The file is read with the ``gguf`` package's
``GGUFReader`` (it builds a numpy view per array element, so a 262,144-token vocabulary such as
Gemma 3's takes tens of seconds to open; we accept that rather than keep a parser of our own).
Every tensor is dequantized to float32 with ``gguf.quants.dequantize``.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama-layout models (its
rotary pairs adjacent elements); the permutation is undone here so the model uses the Hugging
Face ``rotate_half`` layout, as transformers' GGUF loader does. For Gemma 3 the converter adds 1
to every RMSNorm weight (llama.cpp multiplies by the weight); it is subtracted again here, giving
the zero-centred Hugging Face convention that :class:`~kvfleet.model.layers.norm.GemmaRMSNorm` uses.
"""

from __future__ import annotations

import logging
import re
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfleet.model.config import SUPPORTED_ARCHITECTURES, ModelConfig

logger = logging.getLogger("kvfleet.model")

# Architectures whose q/k rows llama.cpp permutes on conversion (Qwen2 and Gemma use NeoX rope).
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
# Gemma 3 (llama.cpp LLM_ARCH_GEMMA3): sandwich norms and QK-norm; ffn_norm is the pre-MLP norm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# ---------------------------------------------------------------------------- file format


class _ReaderMetadata(Mapping):
    """Read-only ``{key: value}`` view of a ``gguf.GGUFReader``'s metadata; values are decoded
    on access (strings as ``str``, arrays as lists), so unused large arrays (the vocabulary)
    are never converted."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def __getitem__(self, key: str) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            raise KeyError(key)
        if hasattr(f, "contents"):
            return f.contents()
        # Older gguf versions: decode by hand.
        parts = [f.parts[i] for i in f.data]
        if len(parts) == 1:
            part = parts[0]
            return bytes(part).decode("utf-8") if part.dtype == np.uint8 else part.tolist()[0]
        return [bytes(x).decode("utf-8") if x.dtype == np.uint8 else x.tolist()[0] for x in parts]

    def __iter__(self):  # noqa: ANN204
        return iter(self._reader.fields)

    def __len__(self) -> int:
        return len(self._reader.fields)


def _open_reader(path: str | Path) -> Any:
    """``gguf.GGUFReader`` over ``path``; a file that is not GGUF raises ValueError."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None


def _dequantize(t: Any) -> torch.Tensor:
    """One reader tensor dequantized with ``gguf.quants.dequantize``: float32, torch shape order."""
    from gguf.quants import dequantize

    # a plain ndarray view: numpy.memmap slicing makes dequantize several times slower
    arr = dequantize(t.data.view(np.ndarray), t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:  # F32 tensors come back as read-only views of the memmap
        arr = arr.copy()
    return torch.from_numpy(arr).reshape(shape)


# ---------------------------------------------------------------------------- config
def gguf_config(metadata: Mapping[str, Any], tensor_names: set[str]) -> ModelConfig:
    """Read the architecture from GGUF metadata (``{arch}.block_count``, ``{arch}.embedding_length`` ...).

    Gemma 3 (``general.architecture == "gemma3"``): windowed layers from
    ``gemma3.attention.sliding_window`` with llama.cpp's pattern (every 6th layer global, or a
    per-layer ``attention.sliding_window_pattern`` bool array when present); local rotary base
    ``rope.freq_base_swa`` (default 10,000, as transformers); query scale ``1/sqrt(head_dim)``
    (``1/sqrt(hidden/heads)`` for the 62-layer 27B, as llama.cpp).

    Raises:
        ValueError: ``general.architecture`` is not llama / mistral / qwen2 / gemma3, or a
            required key is missing.
    """
    arch = str(metadata.get("general.architecture", "")).lower()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = ...) -> Any:
        v = metadata.get(f"{arch}.{name}")
        if v is None:
            if default is ...:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return default
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    n_layers = int(key("block_count"))
    vocab = key("vocab_size", None)
    if vocab is None:
        toks = metadata.get("tokenizer.ggml.tokens")
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
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        pattern = key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            is_local = [bool(p) for p in pattern]
            if len(is_local) != n_layers:
                raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(is_local)} entries "
                                 f"for {n_layers} layers")
        else:
            is_local = [bool((i + 1) % int(pattern)) for i in range(n_layers)]
        windows = [int(sliding) if sliding and local else None for local in is_local]
        extra = dict(
            layer_sliding_windows=windows,
            rope_local_theta=float(key("rope.freq_base_swa", 10_000.0)),
            query_pre_attn_scalar=float(hidden // heads if n_layers == 62 else head_dim),
            hidden_activation="gelu_tanh",
            final_logit_softcapping=_opt_float(key("final_logit_softcapping", None)),
        )
        if not any(windows):
            sliding = None
        if key("attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma attention-logit soft-capping is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=n_layers,
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
        bos_token_id=_opt_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(metadata.get("tokenizer.ggml.eos_token_id")),
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        **extra,
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], str | None]:
    """Read a GGUF file.

    Returns:
        ``(config, weights, chat_template)``: weights are float32 tensors keyed by Hugging Face
        names (``model.layers.0.self_attn.q_proj.weight`` ...), torch shape order
        (``[out, in]``; ggml lists dimensions reversed), q/k un-permuted (Llama layouts), Gemma
        norm weights zero-centred.

    Raises:
        ValueError: not a GGUF file, unsupported architecture, missing metadata, or a tensor name
            we cannot map.
    """
    t0 = time.monotonic()
    reader = _open_reader(path)
    metadata = _ReaderMetadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(metadata, names)
    t1 = time.monotonic()
    layer_names = _GEMMA3_LAYER_NAMES if cfg.architecture == "gemma3" else _LAYER_NAMES
    weights: dict[str, torch.Tensor] = {}
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = _dequantize(t)
            continue
        kind = None
        if t.name in _TOP_NAMES:
            hf_name = _TOP_NAMES[t.name]
        else:
            m = _BLK_RE.match(t.name)
            if not m or m.group(2) not in layer_names:
                raise ValueError(f"cannot map GGUF tensor {t.name!r} for architecture {cfg.architecture}")
            kind = m.group(2)
            hf_name = f"model.layers.{int(m.group(1))}.{layer_names[kind]}.{m.group(3)}"
        tensor = _dequantize(t)
        if cfg.architecture in _PERMUTED_ARCHS and kind in ("attn_q", "attn_k"):
            n = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            tensor = reverse_permute_qk(tensor, n)
        if cfg.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            tensor -= 1.0  # llama.cpp stored 1 + weight
        weights[hf_name] = tensor
    if freq_factors is not None:
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": freq_factors.flatten().tolist()}
    template = metadata.get("tokenizer.chat_template")
    logger.debug("GGUF %s: metadata %.2fs, tensors %.2fs", path, t1 - t0, time.monotonic() - t1)
    return cfg, weights, (str(template) if template is not None else None)


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


# ---------------------------------------------------------------------------- tokenizer
# Tokenizer classes by GGUF architecture, where transformers' AutoTokenizer would otherwise read
# the whole file with gguf.GGUFReader only to find the class (about a minute for Gemma 3).
_TOKENIZER_CLASSES = {"gemma3": "GemmaTokenizer"}


def load_gguf_tokenizer(path: str | Path, *, cache_dir: str | Path | None = None,
                        architecture: str | None = None) -> Any:
    """transformers tokenizer built from the GGUF's ``tokenizer.ggml.*`` metadata.

    Building takes seconds (SmolLM2) to tens of seconds (Gemma 3's 262,144 tokens: transformers
    derives the BPE merges from the vocabulary). With ``architecture`` given (``gemma3``), the
    tokenizer class is chosen directly instead of through ``AutoTokenizer``. With ``cache_dir``
    the built tokenizer is saved there once (``save_pretrained``, written to a temporary folder
    and renamed, so concurrent processes never see a half-written one) and loaded from there
    afterwards; the caller keys the folder by the file's sha256.

    Raises:
        OSError / ValueError: transformers cannot build a tokenizer from the file.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    if cache_dir is not None:
        cache = Path(cache_dir)
        if (cache / "tokenizer_config.json").exists():
            try:
                return AutoTokenizer.from_pretrained(str(cache))
            except (OSError, ValueError) as e:  # a damaged cache: rebuild it below
                logger.warning("ignoring tokenizer cache %s: %s", cache, e)
                import shutil

                shutil.rmtree(cache, ignore_errors=True)
    t0 = time.monotonic()
    cls_name = _TOKENIZER_CLASSES.get(architecture or "")
    if cls_name is not None:
        import transformers

        tok = getattr(transformers, cls_name).from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    logger.info("built tokenizer from %s in %.1fs", p, time.monotonic() - t0)
    if cache_dir is not None:
        _save_tokenizer(tok, Path(cache_dir))
    return tok


def _save_tokenizer(tok: Any, cache: Path) -> None:
    import os
    import shutil
    import tempfile

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only cache location only costs time
        logger.warning("could not cache the tokenizer in %s: %s", cache, e)
