"""Gemma 3 text decoder (Gemma Team 2025, "Gemma 3 Technical Report") on a paged KV cache.

What differs from :mod:`kvfleet.model.families.llama`:

- embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype);
- RMSNorm multiplies by ``1 + weight`` (:class:`~kvfleet.model.layers.norm.GemmaRMSNorm`);
- per-head RMSNorm on queries and keys before the rotary embedding ("QK-norm");
- "sandwich" norms: every attention and MLP block has a norm before *and* after it;
- GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))`` (Shazeer 2020);
- attention scores scaled by ``query_pre_attn_scalar ** -0.5``;
- interleaved local / global attention: windowed layers (``layer_sliding_windows``, window 512
  on five of every six layers of Gemma-3-270M) with their own rotary base (10,000), and global
  full-causal layers (rotary base 1,000,000).

Forward works on a flat batch of tokens (no padding): ``input_ids [T]``, ``positions [T]`` and
an :class:`~kvfleet.model.layers.attention.AttentionMetadata` that carries masks for every
distinct window of the model (see :class:`~kvfleet.model.runner.ModelRunner`).

Parameter names (ours) per layer ``i``: ``layers.i.input_layernorm.weight``,
``layers.i.self_attn.qkv_proj.weight`` (q, k, v rows fused), ``layers.i.self_attn.q_norm.weight``,
``layers.i.self_attn.k_norm.weight``, ``layers.i.self_attn.o_proj.weight``,
``layers.i.post_attention_layernorm.weight``, ``layers.i.pre_feedforward_layernorm.weight``,
``layers.i.mlp.gate_up_proj.weight`` (gate, up rows fused), ``layers.i.mlp.down_proj.weight``,
``layers.i.post_feedforward_layernorm.weight``; plus ``embed_tokens.weight``, ``norm.weight``
and ``lm_head.weight`` (absent when tied, as in every released Gemma 3). Norm weights are
zero-centred (Hugging Face convention; the GGUF loader subtracts the 1 llama.cpp adds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.model.config import ModelConfig
from kvfleet.model.families.llama import load_decoder_weights
from kvfleet.model.layers.attention import AttentionMetadata, paged_attention
from kvfleet.model.layers.linear import GatedMLP, Linear
from kvfleet.model.layers.norm import GemmaRMSNorm
from kvfleet.model.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class Gemma3Attention(nn.Module):
    """Grouped-query attention with QK-norm, per-layer window and rotary base, over the paged cache.

    Args:
        cfg: the architecture.
        layer: layer index (selects the window from :meth:`ModelConfig.layer_windows`).
        dtype: parameter dtype.

    Shapes:
        x: ``[T, hidden]``; cos/sin ``[T, 1, head_dim]`` (this layer's rotary base) -> ``[T, hidden]``.
    """

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.sliding_window: int | None = cfg.layer_windows()[layer]
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        # paged_attention scales by head_dim ** -0.5; Gemma wants query_pre_attn_scalar ** -0.5.
        scalar = cfg.query_pre_attn_scalar
        self.q_rescale = None if scalar is None or scalar == self.head_dim else math.sqrt(self.head_dim / scalar)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        H, KVH = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * KVH, self.head_dim)
        q = RotaryEmbedding.apply(self.q_norm(qkv[:, :H]), cos, sin)
        k = RotaryEmbedding.apply(self.k_norm(qkv[:, H:H + KVH]), cos, sin)
        v = qkv[:, H + KVH:]
        if self.q_rescale is not None:
            q = q * self.q_rescale
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: ``h = x + post_attn_norm(attn(input_norm(x)))``;
    ``out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))``."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.self_attn = Gemma3Attention(cfg, layer, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, activation=cfg.hidden_activation)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 decoder stack plus LM head (text-only; the same interface as
    :class:`~kvfleet.model.families.llama.LlamaForCausalLM`).

    Args:
        config: a ``gemma3`` :class:`ModelConfig`.
        dtype: parameter and activation dtype (float32 on CPU; bfloat16 / float16 allowed).

    Raises:
        ValueError: ``config.architecture`` is not ``gemma3``.

    Parameters are uninitialised (norms zero) until :meth:`load_hf_weights` fills them.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.architecture != "gemma3":
            raise ValueError(f"Gemma3ForCausalLM needs a gemma3 config, got {config.architecture!r}")
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                         requires_grad=False)
        # sqrt(hidden) rounded to the parameter dtype, as the reference multiplies by it.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).to(dtype),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                        requires_grad=False)
        #: an LM head module replacing ``lm_head`` / the tied embedding in :meth:`compute_logits`
        #: (set by :func:`kvfleet.model.layers.quantization.quantize_model`); None = float matmul.
        self.lm_head_linear: nn.Module | None = None
        table = min(config.max_position_embeddings, 8192)
        # One rotary table per distinct base (global and local layers), shared by the layers using it.
        self.layer_theta = [config.layer_rope_theta(i) for i in range(config.num_hidden_layers)]
        self.rotaries = {theta: RotaryEmbedding(config.head_dim, theta, table, None, dtype)
                         for theta in dict.fromkeys(self.layer_theta)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder stack.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]`` absolute positions.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.
            meta: attention metadata of the step, with masks for every window in
                :meth:`ModelConfig.layer_windows`, or one metadata per KV cache group
                (``meta.for_layer(i)`` gives layer ``i``'s).

        Returns:
            ``[T, hidden]`` hidden states *before* the final norm (see :meth:`compute_logits`).
        """
        x = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        cos_sin = {theta: rot.cos_sin(positions) for theta, rot in self.rotaries.items()}
        for i, (layer, kv, theta) in enumerate(zip(self.layers, kv_caches, self.layer_theta, strict=True)):
            cos, sin = cos_sin[theta]
            x = layer(x, cos, sin, kv, meta.for_layer(i))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ soft-capping when configured) on selected rows:
        ``[N, hidden]`` -> float32 ``[N, vocab]``."""
        x = self.norm(hidden)
        if self.lm_head_linear is not None:
            logits = self.lm_head_linear(x)
        else:
            w = self.embed_tokens if self.lm_head is None else self.lm_head
            logits = F.linear(x, w)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # ------------------------------------------------------------------ weights
    _NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy weights given with Hugging Face ``Gemma3ForCausalLM`` names
        (``model.layers.0.self_attn.q_proj.weight``, ``model.layers.0.self_attn.q_norm.weight`` ...),
        norm weights zero-centred. q/k/v and gate/up are fused here; ``lm_head.weight`` is ignored
        when embeddings are tied; other unknown names are ignored.

        Raises:
            ValueError: a required weight is missing or has the wrong shape.
        """
        load_decoder_weights(self, weights, self._NORMS)
