"""Terminal tables and JSON files of benchmark results."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_compare_table", "format_serve_table", "format_table", "format_throughput_table", "write_json"]


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:,.{digits}f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned; floats to ``digits``
    places, None as ``-``."""
    cells = [[_fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def join(row: Sequence[str]) -> str:  # first column left-aligned, the rest right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    line = join(headers)
    sep = "  ".join("-" * w for w in widths)
    body = [join(r) for r in cells]
    return "\n".join([line, sep, *body])


def _rate(run: dict[str, Any]) -> str:
    r = run.get("request_rate")
    return "inf" if r in ("inf", math.inf) else f"{float(r):g}"


SERVE_HEADERS = ("rate req/s", "ok", "fail", "req/s", "out tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 ms", "E2E p99 ms", "goodput req/s")


def _serve_row(run: dict[str, Any]) -> list[Any]:
    m = run["metrics"]
    return [_rate(run), m["completed"], m["failed"], m["request_throughput_req_s"], m["output_throughput_tok_s"],
            m["total_throughput_tok_s"], m.get("p50_ttft_ms"), m.get("p99_ttft_ms"), m.get("p50_tpot_ms"),
            m.get("p99_tpot_ms"), m.get("p50_itl_ms"), m.get("p99_itl_ms"), m.get("p50_e2el_ms"),
            m.get("p99_e2el_ms"), m.get("goodput_req_s")]


def format_serve_table(result: dict[str, Any]) -> str:
    """One row per request rate of a ``bench serve`` result, then any errors."""
    text = format_table(SERVE_HEADERS, [_serve_row(r) for r in result["runs"]])
    errs = [e for r in result["runs"] for e in r["metrics"].get("errors", [])]
    if errs:
        text += "\nerrors (first of each kind):\n" + "\n".join(f"  {e}" for e in dict.fromkeys(errs))
    return text


def format_compare_table(results: dict[str, dict[str, Any]], baseline: str = "kvfleet") -> str:
    """One row per (engine, rate) of a ``bench compare``; ``x kvfleet`` columns give the engine's
    output throughput and p50 TTFT / TPOT divided by the baseline's at the same rate (throughput
    > 1 and latency < 1 mean better than the baseline); ``prefix hit %`` is the share of prompt
    tokens the engine served from its prefix cache over the whole scenario (all its rates), where
    it exports the counters."""
    base_runs = {_rate(r): r["metrics"] for r in results.get(baseline, {}).get("runs", [])}
    headers = ("engine", "precision", "threads", *SERVE_HEADERS, "tok/s x base", "TTFT p50 x base",
               "TPOT p50 x base", "prefix hit %")
    rows = []
    for name, res in results.items():
        info = res.get("engine", {})
        for run in res.get("runs", []):
            m, b = run["metrics"], base_runs.get(_rate(run))

            def ratio(key: str, m=m, b=b) -> float | None:
                if not b or not m.get(key) or not b.get(key):
                    return None
                return m[key] / b[key]

            pc = res.get("prefix_cache") or {}
            hit = None if pc.get("hit_rate") is None else 100.0 * pc["hit_rate"]
            rows.append([name, info.get("precision", "?"), info.get("threads", "?"), *_serve_row(run),
                         ratio("output_throughput_tok_s"), ratio("p50_ttft_ms"), ratio("p50_tpot_ms"), hit])
    return format_table(headers, rows, digits=1)


def format_throughput_table(result: dict[str, Any]) -> str:
    """One row per engine of a ``bench throughput`` result."""
    rows = []
    base = None
    for e in result["engines"]:
        if base is None:
            base = e["output_throughput_tok_s"]
        rows.append([e["engine"], e["precision"], e["threads"], e["num_requests"], e["elapsed_s"],
                     e["request_throughput_req_s"], e["output_throughput_tok_s"], e["total_throughput_tok_s"],
                     e["output_throughput_tok_s"] / base if base else None])
    headers = ("engine", "precision", "threads", "requests", "elapsed s", "req/s", "out tok/s", "total tok/s",
               f"out x {result['engines'][0]['engine']}")
    return format_table(headers, rows, digits=2)


def write_json(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``result`` as indented JSON (``inf`` written as the string ``"inf"``); returns the path."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)

    def clean(o: Any) -> Any:
        if isinstance(o, float) and math.isinf(o):
            return "inf" if o > 0 else "-inf"
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    p.write_text(json.dumps(clean(result), indent=1) + "\n")
    return p
