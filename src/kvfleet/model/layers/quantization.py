"""Int8 linear layers for CPU decoding: W8A8 with per-token dynamic activation quantization.

Decoding a small model on a CPU is bound by the bytes of weights read per step (batch 1) and by
the float32 GEMM speed of small batches (a few to tens of rows). ``--quantization int8`` replaces
every projection (q/k/v, o, gate/up, down) and the LM head by :class:`Int8DynamicLinear`:

- weights: int8, symmetric, one scale per output channel (``scale = max|w_row| / 127``), packed
  once at load time for fbgemm (``torch.ops.quantized.linear_prepack``);
- activations: quantized on the fly, one scale per token (row), as in ZeroQuant's token-wise
  quantization (Yao et al. 2022) and SGLang's ``w8a8_int8``; int32 accumulation, float32 output.
  fbgemm's dynamic kernel (``torch.ops.quantized.linear_dynamic``, the one behind PyTorch's
  ``quantize_dynamic``) picks a single range for its whole input, so each row is first divided by
  its own ``max |x|``, one extra row ``[1, -1, 0, ...]`` pins the range to exactly [-1, 1], and the
  output rows are multiplied back. Besides accuracy, this makes the layer's result for a token
  independent of the other tokens of the step (the int32 accumulation is exact; prefill logits
  are bit-identical batched or alone). Decode attention over a padded batch is not bit-identical
  to a lone sequence's, though, and int8 rounding turns such last-bit differences into different
  quantized values now and then, so long greedy outputs do depend on the batch.

The activation range is 7 bits (``reduce_range=True``): without AVX512-VNNI, fbgemm's int8 dot
products add pairs of u8*s8 products in saturating int16, which 8-bit activations can overflow.
The embedding table stays float32 (one row read per token); with tied embeddings only the LM
head's copy is quantized.

Accuracy on SmolLM2-135M (teacher-forced, ``benchmarks/quantization.py``): perplexity on 1,024
tokens of the GPL-3 text 19.30 -> 21.49 (+11 %; +3 % on the paragraph of the tests); with one
range per call instead of per token it was 34.0, and 26.4 with only ``down_proj`` quantized (its
input ``act(gate) * up`` has a few huge channels). Speed and greedy agreement: BENCHMARKS.md.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from kvfleet.model.layers.linear import Linear

#: ``--quantization`` methods (vLLM's flag name): ``none`` keeps the model dtype.
QUANTIZATION_METHODS = ("none", "int8")


def _pack(weight: torch.Tensor) -> object:
    """fbgemm-packed int8 per-channel weight ``[out, in]`` (scales inside the packed object)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensor types are deprecated upstream, the kernels are not
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None)


class Int8DynamicLinear(nn.Module):
    """``y ≈ x @ weight.T + bias`` with int8 per-channel weights and per-token dynamically
    quantized activations (see the module docstring).

    Args:
        weight: float ``[out_features, in_features]`` (not kept: only the packed int8 copy).
        bias: float ``[out_features]`` or None (kept in float32, added after the product).

    Shapes:
        x: float ``[..., in_features]`` -> float32 ``[..., out_features]``.

    Raises:
        ValueError: ``weight`` is not 2-D, ``bias`` does not have ``out_features`` entries, or
            (forward) ``x``'s last dimension is not ``in_features``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self._packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().float().clone()
        self._range_row = torch.zeros(1, self.in_features)
        self._range_row[0, 0] = 1.0
        if self.in_features > 1:
            self._range_row[0, 1] = -1.0

    @classmethod
    def from_linear(cls, linear: Linear | nn.Linear) -> Int8DynamicLinear:
        """Quantize an existing linear layer."""
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected [..., {self.in_features}] input, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).float()
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
        # The extra last row [1, -1, 0, ...] pins fbgemm's range to exactly [-1, 1] whatever the
        # other rows hold, so every row is quantized the same way alone or in any batch.
        xn = torch.cat([x / row_max, self._range_row])
        y = torch.ops.quantized.linear_dynamic(xn, self._packed, True)[:-1]
        y.mul_(row_max)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, W8A8 per-token dynamic (fbgemm)")


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the model's projections and LM head in place for ``method``.

    ``int8``: every :class:`~kvfleet.model.layers.linear.Linear` becomes an
    :class:`Int8DynamicLinear`, and ``model.lm_head_linear`` (read by ``compute_logits``) is set to
    one of the LM head (the tied embedding's copy when tied; the embedding itself stays float32).
    ``none`` changes nothing.

    Args:
        model: a kvfleet model (:class:`~kvfleet.model.families.llama.LlamaForCausalLM` or
            :class:`~kvfleet.model.families.gemma3.Gemma3ForCausalLM`) with float32 weights.
        method: one of :data:`QUANTIZATION_METHODS`.

    Returns:
        The number of layers replaced (LM head included).

    Raises:
        ValueError: unknown ``method``, or ``int8`` on a model that is not float32 (fbgemm's
            dynamic int8 kernels take float32 activations).
        RuntimeError: no x86 / fbgemm quantized engine in this PyTorch build.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r} (choose from {', '.join(QUANTIZATION_METHODS)})")
    if method == "none":
        return 0
    dtype = getattr(model, "dtype", torch.float32)
    if dtype != torch.float32:
        raise ValueError(f"--quantization int8 needs --dtype float32 (fbgemm computes on float32 "
                         f"activations), got {dtype}")
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm")):
        raise RuntimeError(f"--quantization int8 needs PyTorch's x86/fbgemm quantized engine; this build has "
                           f"{engines}")
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, child_name, Int8DynamicLinear.from_linear(child))
                replaced += 1
    untied = getattr(model, "lm_head", None) is not None
    model.lm_head_linear = Int8DynamicLinear(model.lm_head if untied else model.embed_tokens)
    if untied:
        model.lm_head = None  # only the quantized copy is used from now on
    return replaced + 1
