"""Architecture hyper-parameters of a decoder-only model (Llama / Mistral / Qwen2 family, Gemma 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class ModelConfig:
    """What the model code needs to know about an architecture, independent of the file format.

    Attributes:
        architecture: ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"gemma3"``.
        vocab_size: rows of the embedding / columns of the logits.
        hidden_size: model width.
        intermediate_size: gated MLP width.
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
        layer_sliding_windows: per-layer attention windows in tokens (None entry = full causal
            attention on that layer), ``num_hidden_layers`` long; None = every layer uses
            :attr:`sliding_window`. Gemma 3 interleaves five local layers (window 512 for the
            270M model) with one global layer (Gemma Team 2025, "Gemma 3 Technical Report").
        rope_local_theta: rotary base of the windowed (local) layers when it differs from
            :attr:`rope_theta` (Gemma 3: 10,000 local, 1,000,000 global); None = :attr:`rope_theta`.
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
            (Gemma); None = ``head_dim`` (the usual ``1/sqrt(head_dim)``).
        hidden_activation: gate activation of the gated MLP: ``"silu"`` (SwiGLU, Llama) or
            ``"gelu_tanh"`` (GeGLU with the tanh approximation, Gemma).
        final_logit_softcapping: logits become ``cap * tanh(logits / cap)`` (Gemma 2); None = off.
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
    layer_sliding_windows: list[int | None] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_activation: str = "silu"
    final_logit_softcapping: float | None = None

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
        if self.layer_sliding_windows is not None:
            if len(self.layer_sliding_windows) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_sliding_windows has {len(self.layer_sliding_windows)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            if any(w is not None and w < 1 for w in self.layer_sliding_windows):
                raise ValueError(
                    f"layer_sliding_windows entries must be >= 1 or None, got {self.layer_sliding_windows}"
                )
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_activation {self.hidden_activation!r}; supported: {', '.join(HIDDEN_ACTIVATIONS)}"
            )
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")

    def layer_windows(self) -> list[int | None]:
        """The attention window of every layer, in tokens (None = full causal attention):
        :attr:`layer_sliding_windows` when set, else :attr:`sliding_window` repeated."""
        if self.layer_sliding_windows is not None:
            return list(self.layer_sliding_windows)
        return [self.sliding_window] * self.num_hidden_layers

    def layer_rope_theta(self, layer: int) -> float:
        """Rotary base of layer ``layer``: :attr:`rope_local_theta` on a windowed layer when it is
        set, else :attr:`rope_theta`."""
        if self.rope_local_theta is not None and self.layer_windows()[layer] is not None:
            return self.rope_local_theta
        return self.rope_theta

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x keys).

        Raises:
            ValueError: ``model_type`` is not llama / mistral / qwen2 / gemma3_text, or the config
                asks for something this implementation does not do (Qwen2 per-layer sliding
                windows, Gemma attention-logit soft-capping, rope scaling on Gemma).
        """
        arch = str(cfg.get("model_type", "")).lower()
        if arch == "gemma3" and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}  # multimodal wrapper: the text model
            arch = "gemma3_text"
        if arch == "gemma3_text":
            return cls._from_hf_gemma3(cfg)
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

    @classmethod
    def _from_hf_gemma3(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Gemma 3 text config (transformers ``Gemma3TextConfig``, 4.x or 5.x keys); defaults as
        transformers has them (window pattern 6, local rope base 10,000, global 1,000,000)."""
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma attention-logit soft-capping is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported")
        n_layers = int(cfg.get("num_hidden_layers", 26))
        window = cfg.get("sliding_window", 4096)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        windows = [int(window) if window and t == "sliding_attention" else None for t in layer_types]
        rope = cfg.get("rope_parameters") or {}
        full = rope.get("full_attention") or {}
        local = rope.get("sliding_attention") or {}
        for params in (full, local, cfg.get("rope_scaling") or {}):
            if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
                raise ValueError(f"unsupported rope scaling on Gemma 3: {params}")
        theta = float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
        local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
        heads = int(cfg.get("num_attention_heads", 8))
        eos = cfg.get("eos_token_id", 1)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 3 activation {act!r}")
        return cls(
            architecture="gemma3",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim", 256)),
            rope_theta=theta,
            rope_scaling=None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=int(window) if window and any(windows) else None,
            bos_token_id=cfg.get("bos_token_id", 2),
            eos_token_id=eos,
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            layer_sliding_windows=windows,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            hidden_activation="gelu_tanh",
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
