"""The simulated engine's step-latency model, and its least-squares fit.

The simulator replaces the forward pass with a sleep whose length depends on the work the real
scheduler put into the step::

    step_time = (single_token_base_s if the step computes exactly 1 token else base_s)
              + prefill_s_per_token * (prefill tokens in the step)
              + decode_s_per_seq    * (decode sequences in the step)
              + kv_read_s_per_token * (context tokens read from the paged KV cache in the step)

- ``base_s``: the fixed cost of a step that computes two or more tokens: every weight streamed
  once through the CPU caches (a 135M-parameter fp32 model is ~540 MB), matrix-matrix products,
  the Python step loop, the scheduler, the sampler. Decoding is memory-bound, so this dominates.
- ``single_token_base_s``: the same for a step that computes exactly one token (a lone decode, or
  the last token of a prompt that is otherwise cached). One row makes every matmul a
  matrix-vector product, which on the calibration CPU takes about half the time of the
  matrix-matrix products of any larger batch: measured, one decode takes ~64 ms, two ~125 ms,
  and each sequence after that adds about 2 ms (plus its KV reads). This is the batch-size dependence
  of decode: a step from batch 1 to batch 2, then nearly flat. A model linear in the batch size
  from batch 1 (one base for all steps) was off by ~40% at batch 1 and ~20-30% at batch 2 in
  calibration runs; with the separate one-token base the fit's mean error is ~3%.
- ``prefill_s_per_token``: the marginal cost of one more prompt token. Prefill is compute-bound
  (matmuls over many tokens), so this is about the model's FLOPs per token over the machine's
  throughput.
- ``decode_s_per_seq``: the marginal cost of one more sequence in a decode batch (one more matmul
  row, its sampling and bookkeeping), apart from the KV it reads.
- ``kv_read_s_per_token``: attention reads the K/V of every context token of a sequence that
  attends over the cache: a decode at position ``p`` reads ``p + 1`` tokens, a prefill chunk that
  starts at ``s > 0`` (a later chunk, or the rest of a prompt after a prefix-cache hit) reads
  ``s + n``. kvfleet's CPU attention gathers those blocks into a contiguous copy, so the cost is
  linear in the tokens read (on a GPU decode attention is bound by the same KV reads). A fresh
  prompt chunk (``s = 0``) attends over its own new K/V and reads nothing. Measured, this is
  what makes a large decode batch expensive: 16 decodes at 1024 tokens of context take twice as
  long as 16 at 128 (324 vs 164 ms).

``benchmarks/calibrate_sim.py`` fits the five constants to real engine steps (prefills of 16..1024
tokens, decodes at batch sizes 1, 2, 4, 8, 16 and two context lengths) and prints every residual
plus checks outside the fit (mixed prefill + decode steps, a second prefill chunk). Left out: the
quadratic part of causal attention inside a long fresh prompt (a few percent at 1024 tokens for
SmolLM2-135M).

Simulators such as llm-d's inference simulator and Vidur (Agrawal et al., MLSys 2024) likewise
replace the forward pass with a latency model; Vidur predicts each operator from profiles, this
one fits five constants to whole measured steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

#: parameter names of :class:`LatencyModel`, in fit order (the JSON keys of a latency profile).
PARAMS = ("base_s", "single_token_base_s", "prefill_s_per_token", "decode_s_per_seq", "kv_read_s_per_token")
#: parameters a latency profile may leave out: ``single_token_base_s`` defaults to ``base_s``,
#: ``kv_read_s_per_token`` to 0.
OPTIONAL_PARAMS = ("single_token_base_s", "kv_read_s_per_token")


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes, the inputs of :meth:`LatencyModel.step_time`.

    Attributes:
        prefill_tokens: prompt tokens computed (all prefill chunks together, recomputation after a
            preemption included).
        decode_seqs: sequences that compute one generated token.
        kv_read_tokens: context tokens read from the paged KV cache: ``start_pos + num_new_tokens``
            summed over the scheduled requests with ``start_pos > 0``.
    """

    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_read_tokens: int = 0


@dataclass(frozen=True)
class LatencyModel:
    """Step latency of the simulated engine (all times in seconds; see the module docstring).

    Attributes:
        base_s: fixed cost of a step computing two or more tokens, seconds.
        prefill_s_per_token: added cost of each prompt (prefill) token in the step, seconds/token.
        decode_s_per_seq: added cost of each decoding sequence in the step, seconds/sequence.
        kv_read_s_per_token: added cost of each context token read from the KV cache, seconds/token.
        single_token_base_s: fixed cost of a step computing exactly one token, seconds; None (the
            default) = ``base_s``.
        source: where the numbers come from (free text, e.g. the calibration command and machine).

    Raises:
        ValueError: a parameter that is negative or not finite.
    """

    base_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    kv_read_s_per_token: float = 0.0
    single_token_base_s: float | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.single_token_base_s is None:
            object.__setattr__(self, "single_token_base_s", self.base_s)
        for name in PARAMS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"latency parameter {name} must be a finite number >= 0 seconds, got {v!r}")

    def step_time(self, work: StepWork) -> float:
        """Seconds one engine step takes.

        Args:
            work: the step's :class:`StepWork` (token and sequence counts).

        Returns:
            ``B + prefill_s_per_token * prefill_tokens + decode_s_per_seq * decode_seqs +
            kv_read_s_per_token * kv_read_tokens`` with ``B = single_token_base_s`` when the step
            computes exactly one token (``prefill_tokens + decode_seqs == 1``), else ``base_s``;
            0.0 for an empty step (nothing to compute).

        Raises:
            ValueError: a negative count.
        """
        p, d, k = work.prefill_tokens, work.decode_seqs, work.kv_read_tokens
        if p < 0 or d < 0 or k < 0:
            raise ValueError(f"step work counts must be >= 0, got {work}")
        if p + d == 0:
            return 0.0
        base = self.single_token_base_s if p + d == 1 else self.base_s
        assert base is not None
        return base + self.prefill_s_per_token * p + self.decode_s_per_seq * d + self.kv_read_s_per_token * k

    def with_overrides(self, **values: float | None) -> LatencyModel:
        """A copy with the given parameters replaced (``None`` values are ignored).

        Raises:
            ValueError: an unknown parameter name or a bad value.
        """
        unknown = set(values) - set(PARAMS)
        if unknown:
            raise ValueError(f"unknown latency parameters {sorted(unknown)}; known: {', '.join(PARAMS)}")
        given = {k: float(v) for k, v in values.items() if v is not None}
        if not given:
            return self
        return replace(self, **given, source=f"{self.source} (overridden: {', '.join(sorted(given))})".strip())

    def to_dict(self) -> dict[str, Any]:
        """The parameters (and ``source``) as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyModel:
        """Build from a dict holding the keys of :data:`PARAMS` (those in :data:`OPTIONAL_PARAMS`
        may be missing; other keys are ignored, so a calibration report with its samples loads as
        is).

        Raises:
            ValueError: a missing key or a bad value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a latency profile must be a JSON object, got {type(data).__name__}")
        missing = [k for k in PARAMS if k not in data and k not in OPTIONAL_PARAMS]
        if missing:
            raise ValueError(f"latency profile lacks {', '.join(missing)} (needs {', '.join(PARAMS)})")
        return cls(**{k: data[k] for k in PARAMS if k in data}, source=str(data.get("source", "")))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        """Read a latency profile JSON file (as written by ``benchmarks/calibrate_sim.py``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not JSON, or not a valid profile.
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


#: Defaults, measured on the real engine: SmolLM2-135M-Instruct GGUF, fp32, torch's default thread count
#: (2), by ``python benchmarks/calibrate_sim.py`` (5 rounds, 161 s) on the project's 2-core AMD EPYC
#: VM (x86_64 Linux, no GPU) on 2026-11-30; mean |relative error| of the fit 3.1%. The samples,
#: residuals and checks are in ``benchmarks/results/sim_latency_smollm2.json``.
DEFAULT_LATENCY = LatencyModel(
    base_s=0.1114,
    single_token_base_s=0.0605,
    prefill_s_per_token=0.001846,
    decode_s_per_seq=0.001854,
    kv_read_s_per_token=1.173e-05,
    source="benchmarks/calibrate_sim.py, SmolLM2-135M-Instruct fp32, 2 threads, 2-core AMD EPYC VM, 2026-11-30",
)


def fit_latency_model(samples: Sequence[tuple[StepWork, float]], source: str = "") -> LatencyModel:
    """Least-squares fit of :class:`LatencyModel` to measured steps, in relative error.

    Minimizes ``sum(((model(w) - t) / t) ** 2)`` (numpy ``lstsq`` on rows scaled by ``1 / t``), so a
    100 ms decode step weighs as much as a 3 s prefill. The unknowns are ``single_token_base_s``,
    ``base_s - single_token_base_s`` (the extra fixed cost of a multi-token step) and the three
    slopes; one that comes out negative (noise when it is tiny) is fixed at 0 and the others are
    refitted.

    Args:
        samples: ``(StepWork, seconds)`` per measured step: single-token steps (batch-1 decodes),
            prefill-only steps of several sizes, and decode-only steps of several batch sizes at
            two context lengths (to tell ``kv_read_s_per_token`` from ``decode_s_per_seq``).
        source: provenance text stored in the result.

    Returns:
        The fitted model.

    Raises:
        ValueError: fewer samples than unknowns, samples that cannot determine them all
            (rank < 5), or a time that is not finite and > 0.
    """
    import numpy as np

    n = len(PARAMS)
    if len(samples) < n:
        raise ValueError(f"need at least {n} samples to fit {n} parameters, got {len(samples)}")
    a = np.array([[1.0, float(w.prefill_tokens + w.decode_seqs >= 2), w.prefill_tokens, w.decode_seqs,
                   w.kv_read_tokens] for w, _ in samples], dtype=np.float64)
    t = np.array([s for _, s in samples], dtype=np.float64)
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("step times must be finite and > 0 seconds")
    if np.linalg.matrix_rank(a) < n:
        raise ValueError("samples do not determine the model: measure batch-1 decode steps, prefill-only steps "
                         "of several sizes and decode-only steps of several batch sizes at two context lengths")
    a, t_rel = a / t[:, None], np.ones_like(t)
    active = list(range(n))
    x = np.zeros(n)
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], t_rel, rcond=None)
        if np.all(sol >= 0):
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    single, extra, prefill, decode, kv = (float(v) for v in x)
    return LatencyModel(base_s=single + extra, prefill_s_per_token=prefill, decode_s_per_seq=decode,
                        kv_read_s_per_token=kv, single_token_base_s=single, source=source)
