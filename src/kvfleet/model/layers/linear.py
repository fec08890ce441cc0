"""Plain linear layers with uninitialised weights (the loader fills them) and the gated MLP
(SwiGLU / GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``[out_features, in_features]``.

    Unlike :class:`torch.nn.Linear` the parameters are left uninitialised (``torch.empty``):
    every weight is overwritten by a loader, so random init would only cost time.

    Shapes:
        x: ``[..., in_features]`` -> ``[..., out_features]``, in the parameter dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


#: gate activations of :class:`GatedMLP`, by :attr:`ModelConfig.hidden_activation` name.
GATE_ACTIVATIONS = {
    "silu": F.silu,  # SwiGLU (Llama, Mistral, Qwen2)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU (Gemma; Hendrycks & Gimpel 2016)
}


class GatedMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` (Shazeer 2020, "GLU Variants Improve
    Transformer"): SwiGLU with ``silu``, GeGLU with ``gelu_tanh``.

    The gate and up projections are fused into one matmul: ``gate_up_proj.weight`` is
    ``cat([gate.weight, up.weight])`` of shape ``[2 * intermediate_size, hidden_size]``.

    Shapes:
        x: ``[T, hidden_size]`` -> ``[T, hidden_size]``.

    Raises:
        ValueError: an activation not in :data:`GATE_ACTIVATIONS`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype = torch.float32,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {activation!r} (known: {', '.join(GATE_ACTIVATIONS)})")
        self.intermediate_size = intermediate_size
        self.act = GATE_ACTIVATIONS[activation]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


#: the Llama-family name of the SwiGLU MLP.
SwiGLUMLP = GatedMLP
