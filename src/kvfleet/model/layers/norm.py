"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Statistics are computed in float32 and the result cast back to the input dtype, as
    Llama's reference implementation does.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        dtype: parameter dtype.

    Shapes:
        x: ``[..., hidden_size]`` any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (1 + weight)`` over the last dimension.

    The weight is stored zero-centred (Hugging Face convention: a freshly initialised norm is the
    identity), and the product is taken in float32 before casting back, as Gemma's reference
    implementation does (unlike Llama, which casts before multiplying). Arguments and shapes as
    :class:`RMSNorm`.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
