"""Architecture hyper-parameters of a decoder-only model (Llama / Mistral / Qwen2 family)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    """What the model code needs to know about an architecture, independent of the file format.

    Attributes:
        architecture: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        vocab_size: rows of the embedding / columns of the logits.
        hidden_size: model width.
        intermediate_size: SwiGLU MLP width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: K/V heads (grouped-query attention when fewer than query heads,
            Ainslie et al. 2023, "GQA").
        head_dim: width of one head.
        rope_theta: rotary base (Su et al. 2021, "RoFormer").
        rope_scaling: None, or a dict with ``rope_type`` in ``"default"``, ``"linear"``
            (``factor``), ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``) or ``"freq_factors"`` (``factors``: one divisor
            per rotary frequency, as llama.cpp stores them in ``rope_freqs.weight``).
        rms_norm_eps: epsilon of RMSNorm.
        max_position_embeddings: context length the model was trained for, in tokens.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: bias on the q/k/v projections (Qwen2; Llama's ``attention_bias`` also
            puts one on o_proj, see :attr:`o_proj_bias`).
        sliding_window: Mistral-style window in tokens: a query at position ``i`` sees keys ``j``
            with ``i - window < j <= i`` (the edge transformers uses); None = full causal.
        bos_token_id, eos_token_id: special token ids (None when unknown).
        o_proj_bias: bias on the attention output projection (Llama with ``attention_bias``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    o_proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x keys).

        Raises:
            ValueError: ``model_type`` is not llama / mistral / qwen2, or the config asks for
                something this implementation does not do (Qwen2 per-layer sliding windows).
        """
        arch = str(cfg.get("model_type", "")).lower()
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {cfg.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads
        # transformers 5 keeps rope settings in ``rope_parameters``; 4.x in rope_theta + rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params:
            rt = rope_params.get("rope_type", "default")
            if rt not in (None, "default"):
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
            elif scaling["rope_type"] not in ("linear", "llama3"):
                raise ValueError(f"unsupported rope scaling {scaling['rope_type']!r}")
        sliding = cfg.get("sliding_window")
        if arch == "qwen2":
            if cfg.get("use_sliding_window"):
                raise ValueError("Qwen2 with use_sliding_window=True is not supported")
            sliding = None
        attn_bias = bool(cfg.get("attention_bias", False)) or arch == "qwen2"
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            o_proj_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
        )
