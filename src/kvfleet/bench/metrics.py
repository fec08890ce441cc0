"""Serving metrics of a benchmark run, from each request's streamed timeline.

Definitions (as in vLLM's ``benchmark_serving`` and the DistServe paper's goodput):

- **TTFT** (time to first token): first streamed chunk with generated text − request sent.
- **ITL** (inter-token latency): gaps between successive chunks with generated text (a chunk
  that carries several tokens counts once, so ITL is per chunk).
- **TPOT** (time per output token): ``(E2E − TTFT) / (output_tokens − 1)``, defined for requests
  with at least two output tokens.
- **E2E** (end-to-end latency): last byte of the stream − request sent.
- **goodput** (DistServe, Zhong et al., OSDI 2024): completed requests per second that meet every
  SLO given (``ttft``, ``tpot``, ``e2el`` in milliseconds).
- throughput: completed requests, output tokens and prompt + output tokens per second of the
  run's wall time (first request sent → last response done).

Percentiles use linear interpolation between order statistics (``numpy.percentile``'s default).
All times are in seconds inside; the summary reports milliseconds (``*_ms``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["DEFAULT_PERCENTILES", "SLO_KEYS", "RequestResult", "compute_metrics", "parse_goodput",
           "parse_percentiles"]

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request's stream gave.

    Attributes:
        success: the stream finished without an error.
        start: when the request was sent, seconds (``time.perf_counter``).
        ttft: time to the first chunk with text, seconds (0 when none arrived).
        itl: gaps between successive text chunks, seconds.
        latency: end-to-end latency, seconds.
        prompt_tokens: prompt length (server's usage when reported, else the dataset's count).
        output_tokens: tokens generated (server's usage when reported, else the number of text chunks).
        usage_reported: the server sent a usage object.
        error: error text of a failed request.
        generated_text: the streamed text (kept for multi-turn histories).
        tag: the dataset's tag of the request.
    """

    success: bool = False
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str = ""
    generated_text: str = ""
    tag: str = ""

    @property
    def tpot(self) -> float | None:
        """``(E2E − TTFT) / (output_tokens − 1)`` seconds, or None with fewer than 2 output tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (times in seconds), with ``tpot`` added."""
        d = asdict(self)
        d["tpot"] = self.tpot
        if not keep_text:
            d.pop("generated_text")
        return d


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """Parse ``--goodput ttft:MS tpot:MS e2el:MS`` into ``{"ttft": MS, ...}`` (milliseconds).

    Raises:
        ValueError: an item is not ``KEY:VALUE``, the key is not ttft/tpot/e2el, a key repeats,
            or a value is not a positive number.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"goodput SLO {item!r} must be KEY:MILLISECONDS, e.g. ttft:500")
        if key not in SLO_KEYS:
            raise ValueError(f"goodput SLO key {key!r} is not one of {', '.join(SLO_KEYS)}")
        if key in slos:
            raise ValueError(f"goodput SLO {key!r} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"goodput SLO {item!r}: milliseconds must be a positive finite number")
        slos[key] = ms
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """Parse ``"50,90,99"`` into ``(50.0, 90.0, 99.0)``.

    Raises:
        ValueError: an item is not a number in (0, 100], or the list is empty.
    """
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            p = float(part)
        except ValueError:
            raise ValueError(f"percentile {part!r} is not a number") from None
        if not 0 < p <= 100:
            raise ValueError(f"percentile {p} is not in (0, 100]")
        out.append(p)
    if not out:
        raise ValueError("no percentile given")
    return tuple(out)


def _pct_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}".replace(".", "_")


def _stats(prefix: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float | None]:
    """mean / median / std / percentiles of ``values_s`` (seconds) as milliseconds."""
    out: dict[str, float | None] = {}
    if values_s:
        arr = np.asarray(values_s, dtype=np.float64) * 1000.0
        out[f"mean_{prefix}_ms"] = float(arr.mean())
        out[f"median_{prefix}_ms"] = float(np.median(arr))
        out[f"std_{prefix}_ms"] = float(arr.std())
        for p in percentiles:
            out[f"{_pct_name(p)}_{prefix}_ms"] = float(np.percentile(arr, p))
    else:
        for k in ("mean", "median", "std", *(_pct_name(p) for p in percentiles)):
            out[f"{k}_{prefix}_ms"] = None
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, goodput_slos: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """Summarize a run.

    Args:
        results: one :class:`RequestResult` per request sent.
        duration_s: wall time of the run, seconds (> 0).
        goodput_slos: ``{"ttft"|"tpot"|"e2el": milliseconds}``; a request is good when it succeeded
            and meets every SLO given (a request with one output token has no TPOT and passes a
            TPOT SLO). Without SLOs ``goodput_req_s`` is None.
        percentiles: which percentiles to report, in (0, 100].

    Returns:
        a flat dict: ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``,
        ``duration_s``, ``request_throughput_req_s``, ``output_throughput_tok_s``,
        ``total_throughput_tok_s``, ``goodput_req_s``, and for ``ttft``, ``tpot``, ``itl``, ``e2el``:
        ``mean_*_ms``, ``median_*_ms``, ``std_*_ms``, ``p50_*_ms``, ``p90_*_ms``, ``p99_*_ms`` (None
        when no request has the value), plus ``errors`` (up to 5 distinct messages).

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration_s!r}")
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = None
    if goodput_slos:
        n_good = 0
        for r in ok:
            t = r.tpot
            if "ttft" in goodput_slos and r.ttft * 1000.0 > goodput_slos["ttft"]:
                continue
            if "tpot" in goodput_slos and t is not None and t * 1000.0 > goodput_slos["tpot"]:
                continue
            if "e2el" in goodput_slos and r.latency * 1000.0 > goodput_slos["e2el"]:
                continue
            n_good += 1
        good = n_good / duration_s
    errors: list[str] = []
    for r in failed:
        if r.error and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        "duration_s": duration_s,
        "request_throughput_req_s": len(ok) / duration_s,
        "output_throughput_tok_s": n_out / duration_s,
        "total_throughput_tok_s": (n_in + n_out) / duration_s,
        "goodput_req_s": good,
        "goodput_slos_ms": dict(goodput_slos or {}),
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, vals, percentiles))
    m["errors"] = errors
    return m
