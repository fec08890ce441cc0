"""Llama-family decoder (Touvron et al. 2023, "LLaMA"), also Mistral (sliding window,
Jiang et al. 2023) and Qwen2 (bias on q/k/v), on a paged KV cache.

Forward works on a flat batch of tokens (no padding): ``input_ids [T]``, ``positions [T]`` and
an :class:`~kvfleet.model.layers.attention.AttentionMetadata`.

Parameter names (ours) per layer ``i``: ``layers.i.input_layernorm.weight``,
``layers.i.self_attn.qkv_proj.{weight,bias}`` (q, k, v rows fused),
``layers.i.self_attn.o_proj.{weight,bias}``, ``layers.i.post_attention_layernorm.weight``,
``layers.i.mlp.gate_up_proj.weight`` (gate, up rows fused), ``layers.i.mlp.down_proj.weight``;
plus ``embed_tokens.weight``, ``norm.weight`` and ``lm_head.weight`` (absent when tied).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.model.config import ModelConfig
from kvfleet.model.layers.attention import AttentionMetadata, paged_attention
from kvfleet.model.layers.linear import Linear, SwiGLUMLP
from kvfleet.model.layers.norm import RMSNorm
from kvfleet.model.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Multi-head / grouped-query self-attention with rotary embeddings over the paged cache.

    Shapes:
        x: ``[T, hidden]``; cos/sin ``[T, 1, head_dim]`` -> ``[T, hidden]``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.apply(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads:]
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head for the llama / mistral / qwen2 architectures.

    Args:
        config: the architecture.
        dtype: parameter and activation dtype (float32 on CPU; bfloat16 / float16 allowed).

    Parameters are uninitialised until :meth:`load_hf_weights` fills them.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                        requires_grad=False)
        #: an LM head module replacing ``lm_head`` / the tied embedding in :meth:`compute_logits`
        #: (set by :func:`kvfleet.model.layers.quantization.quantize_model`); None = float matmul.
        self.lm_head_linear: nn.Module | None = None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta,
                                      min(config.max_position_embeddings, 8192), config.rope_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder stack.

        Args:
            input_ids: int64 ``[T]``.
            positions: int64 ``[T]`` absolute positions.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.
            meta: attention metadata of the step.

        Returns:
            ``[T, hidden]`` hidden states *before* the final norm (see :meth:`compute_logits`).
        """
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv, meta.for_layer(i))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on selected rows: ``[N, hidden]`` -> float32 ``[N, vocab]``."""
        x = self.norm(hidden)
        if self.lm_head_linear is not None:
            return self.lm_head_linear(x).float()
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(x, w).float()

    # ------------------------------------------------------------------ weights
    _NORMS = ("input_layernorm", "post_attention_layernorm")

    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy weights given with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``, ...).

        q/k/v and gate/up are fused here. ``lm_head.weight`` is ignored when embeddings are tied;
        unknown names like ``rotary_emb.inv_freq`` are ignored.

        Raises:
            ValueError: a required weight is missing or has the wrong shape.
        """
        load_decoder_weights(self, weights, self._NORMS)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_decoder_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], norms: tuple[str, ...]) -> None:
    """Copy Hugging Face-named weights into a decoder with our fused layout: ``embed_tokens``,
    ``norm``, optional ``lm_head``, and ``layers[i]`` with ``self_attn.qkv_proj`` (q/k/v rows
    concatenated, optional bias), ``self_attn.o_proj``, ``mlp.gate_up_proj`` (gate then up),
    ``mlp.down_proj`` and the RMSNorms named in ``norms`` (submodule paths of a layer).
    Shared by the Llama-family and Gemma-3 models.

    Raises:
        ValueError: a required weight is missing or has the wrong shape.
    """
    n_layers = len(model.layers)
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
    top: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _LAYER_RE.match(name)
        if m:
            i = int(m.group(1))
            if i < n_layers:
                per_layer[i][m.group(2)] = t
        else:
            top[name] = t

    def need(d: dict[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
        if key not in d:
            raise ValueError(f"missing weight {where}{key}")
        return d[key]

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
        param.data.copy_(value.to(param.dtype))

    with torch.no_grad():
        put(model.embed_tokens, need(top, "model.embed_tokens.weight", ""), "model.embed_tokens.weight")
        put(model.norm.weight, need(top, "model.norm.weight", ""), "model.norm.weight")
        if model.lm_head is not None:
            put(model.lm_head, need(top, "lm_head.weight", ""), "lm_head.weight")
        for i, (layer, w) in enumerate(zip(model.layers, per_layer, strict=True)):
            pre = f"model.layers.{i}."
            a = layer.self_attn
            qkv = torch.cat([need(w, f"self_attn.{p}_proj.weight", pre) for p in "qkv"])
            put(a.qkv_proj.weight, qkv, pre + "self_attn.qkv_proj.weight")
            if a.qkv_proj.bias is not None:
                b = torch.cat([need(w, f"self_attn.{p}_proj.bias", pre) for p in "qkv"])
                put(a.qkv_proj.bias, b, pre + "self_attn.qkv_proj.bias")
            put(a.o_proj.weight, need(w, "self_attn.o_proj.weight", pre), pre + "self_attn.o_proj.weight")
            if a.o_proj.bias is not None:
                put(a.o_proj.bias, need(w, "self_attn.o_proj.bias", pre), pre + "self_attn.o_proj.bias")
            gu = torch.cat([need(w, "mlp.gate_proj.weight", pre), need(w, "mlp.up_proj.weight", pre)])
            put(layer.mlp.gate_up_proj.weight, gu, pre + "mlp.gate_up_proj.weight")
            put(layer.mlp.down_proj.weight, need(w, "mlp.down_proj.weight", pre), pre + "mlp.down_proj.weight")
            for norm in norms:
                put(layer.get_submodule(norm).weight, need(w, f"{norm}.weight", pre), f"{pre}{norm}.weight")
