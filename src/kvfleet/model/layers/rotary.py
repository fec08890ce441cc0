"""Rotary position embedding (Su et al. 2021, "RoFormer"), Hugging Face ``rotate_half`` layout."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``1 / theta^(2i / head_dim)`` for ``i < head_dim / 2``, float32 ``[head_dim // 2]``.

    ``scaling`` (see :class:`~kvfleet.model.config.ModelConfig`): ``linear`` divides every
    frequency by ``factor``; ``llama3`` applies Llama 3.1's band-wise rescaling (Meta 2024);
    ``freq_factors`` divides by per-frequency factors (llama.cpp's ``rope_freqs`` tensor).

    Raises:
        ValueError: an unknown ``rope_type``.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":
        return inv / torch.as_tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding:
    """Precomputed cos/sin tables and their application to query/key heads.

    Tables are float32 ``[max_positions, head_dim]`` computed once (grown on demand when a
    position is past the end) and cast to the compute dtype.

    Args:
        head_dim: rotary dimension (the whole head).
        theta: base.
        max_positions: initial table length in tokens.
        scaling: optional rope scaling dict (:func:`rope_inv_freq`).
        dtype: dtype of the cached tables (the model's compute dtype).
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.dtype = dtype
        self._build(max(int(max_positions), 1))

    def _build(self, n: int) -> None:
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for ``positions`` (int64 ``[T]``), each ``[T, 1, head_dim]``."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(max(int(positions.max()) + 1, 2 * self.cos.shape[0]))
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` with ``cos``/``sin`` ``[T, 1, head_dim]`` (rotate_half layout)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat([-x2, x1], dim=-1)
        return x * cos + rotated * sin
