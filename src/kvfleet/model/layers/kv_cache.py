"""KV cache storage: the model dtype (``--kv-cache-dtype auto``) or fp8 with a per-tensor scale.

fp8 KV cache (as vLLM's ``--kv-cache-dtype fp8_e4m3|fp8_e5m2``; formats from Micikevicius et
al. 2022, "FP8 Formats for Deep Learning"): K and V are stored as ``torch.float8_e4m3fn``
(4 exponent / 3 mantissa bits, max 448) or ``torch.float8_e5m2`` (5 / 2, max 57344), one byte
per element, so a pool of the same bytes holds 4x the tokens of fp32 (2x of bf16). A stored value
is ``q = saturate(x / scale)`` and reads back as ``q * scale`` in the compute dtype when K/V are
gathered for attention.

Why one static scale per tensor (per layer, one for K and one for V) and not per block:
fp8 is a *floating-point* format, so its relative rounding error (2^-4 for E4M3, 2^-3 for E5M2)
is the same at every magnitude inside its normal range (about 15 binades for E4M3). A scale only
has to keep values below the format's maximum and away from the subnormal range; it does not
buy precision the way it does for int8. Measured on SmolLM2-135M-Instruct (teacher-forced over
~480 positions of three real texts, all K/V quantized): E4M3 top-1 agreement with fp32 was 0.949
with a per-tensor scale of 1.0 vs 0.944 with per-block-per-kv-head power-of-two scales, mean
|logprob drift| 0.078 vs 0.074; E5M2 0.872 vs 0.878, 0.159 vs 0.159 — no measurable gain. The
model's K/V magnitudes peak around 21 and 14, far below 448. A per-tensor scale keeps the code
small and exact: no scale metadata per block (the pool is exactly 1/4 of fp32's bytes), block
copies and swaps move raw bytes only, and a token's stored value never depends on which other
tokens share its block or what the block held before (outputs do not depend on batch history or
chunking). The default scale is 1.0 (vLLM's default without calibrated ``k_scale``/``v_scale``);
values beyond ``±fp8_max * scale`` saturate instead of overflowing to inf/NaN.
"""

from __future__ import annotations

import numpy as np
import torch

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3", "fp8_e5m2")
"""Accepted ``--kv-cache-dtype`` values; ``auto`` = the model's compute dtype."""

_FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype K/V are stored in.

    Args:
        kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`.
        model_dtype: the compute dtype (returned for ``auto``).

    Raises:
        ValueError: unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _FP8_DTYPES[kv_cache_dtype]


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x / scale)`` cast to the fp8 ``dtype`` (any shape; computed in float32).

    Values beyond the format's largest finite value (448 for E4M3, 57344 for E5M2) are clamped to
    it (saturation, so no inf/NaN appear for finite input); round-to-nearest-even otherwise.
    Relative error of a value in the normal range is at most 2^-4 (E4M3) or 2^-3 (E5M2).

    Raises:
        ValueError: ``dtype`` is not a float8 dtype or ``scale`` is not a positive finite number.
    """
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"not an fp8 dtype: {dtype}")
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"fp8 scale must be a positive finite number, got {scale}")
    fmax = torch.finfo(dtype).max
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y / scale
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (any shape; ``q`` float8, the product computed in float32)."""
    y = q.to(torch.float32)
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


class FP8KVCache:
    """One layer's K (or V) pool stored as fp8 with one per-tensor scale (see the module docstring).

    Args:
        num_blocks, block_size, num_kv_heads, head_dim: pool layout.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: dequantization multiplier (stored value = x / scale).
        device: where the pool lives (default: torch's default device).

    Attributes:
        data: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float8 storage (zeros at start).
        scale: the per-tensor scale (float).

    Raises:
        ValueError: a non-fp8 ``dtype`` or a non-positive scale.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scale: float = 1.0, device: torch.device | str | None = None) -> None:
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"not an fp8 dtype: {dtype}")
        if not (scale > 0 and scale != float("inf")):
            raise ValueError(f"fp8 scale must be a positive finite number, got {scale}")
        self.data = zeros_lazy((num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
        self.scale = float(scale)

    @property
    def shape(self) -> torch.Size:
        """``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        """The float8 storage dtype."""
        return self.data.dtype

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Quantize ``x`` ``[T, kv_heads, head_dim]`` into the flat slots ``slot_mapping`` (int64
        ``[T]``); returns the dequantized stored values in ``x.dtype`` (what attention will read)."""
        q = quantize_fp8(x, self.scale, self.data.dtype)
        kvh, hd = self.data.shape[-2], self.data.shape[-1]
        # float8 has no CPU index_copy_ kernel; the byte view moves the same bits.
        self.data.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slot_mapping, q.view(torch.uint8))
        return dequantize_fp8(q, self.scale, x.dtype)

    def gather(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``block_ids`` (int64 ``[n]``) dequantized: ``[n, block_size, kv_heads, head_dim]`` in ``dtype``."""
        return dequantize_fp8(self.data.index_select(0, block_ids), self.scale, dtype)

    def __repr__(self) -> str:
        return f"FP8KVCache(shape={tuple(self.data.shape)}, dtype={self.data.dtype}, scale={self.scale})"


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str | None = None) -> torch.Tensor:
    """A zero-filled tensor; on the CPU its pages are zeroed lazily by the OS.

    ``torch.zeros`` writes every byte up front (3.4 s for SmolLM2's default 2 GiB pool on this
    2-core VM, most of the engine's startup after the weights). On the CPU this allocates through
    ``calloc`` (numpy's ``zeros``), which for large sizes maps fresh zero pages that the kernel
    fills on first touch, and views the bytes as ``dtype`` (any dtype, fp8 included). Other
    devices use ``torch.zeros``.
    """
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize
    for d in shape:
        n *= d
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)


LayerKV = torch.Tensor | FP8KVCache
"""One layer's K or V pool: a plain tensor in the model dtype, or an :class:`FP8KVCache`."""


def allocate_kv_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                     model_dtype: torch.dtype, device: torch.device | str | None = None) -> LayerKV:
    """A zeroed K or V pool ``[num_blocks, block_size, num_kv_heads, head_dim]`` for ``kv_cache_dtype``.

    Raises:
        ValueError: unknown ``kv_cache_dtype``.
    """
    storage = kv_storage_dtype(kv_cache_dtype, model_dtype)
    if kv_cache_dtype == "auto":
        return zeros_lazy((num_blocks, block_size, num_kv_heads, head_dim), storage, device)
    return FP8KVCache(num_blocks, block_size, num_kv_heads, head_dim, storage, device=device)


def write_slots(cache: LayerKV, slot_mapping: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Store new keys or values ``x`` ``[T, kv_heads, head_dim]`` at flat slots ``slot_mapping``
    (int64 ``[T]``); returns what the cache now holds for them, in ``x.dtype`` (``x`` itself when
    the pool is in the model dtype)."""
    if isinstance(cache, FP8KVCache):
        return cache.write(slot_mapping, x)
    kvh, hd = cache.shape[-2], cache.shape[-1]
    cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, x.to(cache.dtype))
    return x


def gather_blocks(cache: LayerKV, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids`` (int64 ``[n]``) as ``[n, block_size, kv_heads, head_dim]`` in ``dtype``
    (dequantized for fp8). Uses ``index_select`` (advanced indexing is far slower on CPU)."""
    if isinstance(cache, FP8KVCache):
        return cache.gather(block_ids, dtype)
    return cache.index_select(0, block_ids).to(dtype)


def block_storage(cache: LayerKV) -> torch.Tensor:
    """The raw ``[num_blocks, ...]`` storage of a pool for block copies and swaps: the tensor
    itself, or for fp8 a ``uint8`` view of the same bytes (float8 lacks CPU index_copy_)."""
    if isinstance(cache, FP8KVCache):
        return cache.data.view(torch.uint8)
    return cache
