"""PNG plots of serving benchmark results (matplotlib, headless ``Agg`` backend).

Input is ``{label: result}`` where each result is what
:func:`kvfleet.bench.serve.run_serving_benchmark` returns (one label for ``bench serve``, one per
engine for ``bench compare``). Three figures:

- ``<prefix>latency_cdf.png``: empirical CDFs of TTFT, TPOT and E2E latency (ms), one line per
  (label, rate);
- ``<prefix>latency_vs_rate.png``: TTFT and TPOT p50 (solid) and p99 (dashed) against request rate;
- ``<prefix>throughput_vs_rate.png``: output tokens/s against request rate.

Rates are drawn as categories (so ``inf`` has a place). Figures are small (≈ 100 dpi) so they can
be committed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["make_plots", "plot_latency_cdfs", "plot_latency_vs_rate", "plot_throughput_vs_rate"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _rate_key(r: Any) -> float:
    return math.inf if r in ("inf", math.inf) else float(r)


def _rate_label(r: Any) -> str:
    v = _rate_key(r)
    return "inf" if math.isinf(v) else f"{v:g}"


def _all_rates(results: dict[str, dict[str, Any]]) -> list[str]:
    rates = sorted({_rate_key(run["request_rate"]) for res in results.values() for run in res["runs"]})
    return [_rate_label(r) for r in rates]


def plot_latency_cdfs(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E (ms) of every successful request; returns ``path``.

    Raises:
        ValueError: no result has per-request timelines.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=90)
    drawn = 0
    for label, res in results.items():
        for run in res["runs"]:
            reqs = [r for r in run.get("requests", []) if r.get("success")]
            if not reqs:
                continue
            name = f"{label} @ {_rate_label(run['request_rate'])}/s"
            for ax, key in zip(axes, ("ttft", "tpot", "latency")):
                vals = sorted(r[key] * 1000.0 for r in reqs if r.get(key) is not None)
                if vals:
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step(vals, ys, where="post", label=name)
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError("no successful request timelines to plot")
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "E2E latency (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("Latency CDFs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_latency_vs_rate(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """TTFT and TPOT p50 (solid) / p99 (dashed) in ms against request rate; returns ``path``."""
    plt = _plt()
    rates = _all_rates(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
    for label, res in results.items():
        by_rate = {_rate_label(r["request_rate"]): r["metrics"] for r in res["runs"]}
        xs = [i for i, r in enumerate(rates) if r in by_rate]
        for ax, key in zip(axes, ("ttft", "tpot")):
            color = None
            for pct, style in (("p50", "-o"), ("p99", "--x")):
                ys = [by_rate[rates[i]].get(f"{pct}_{key}_ms") for i in xs]
                pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if pts:
                    line = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{label} {pct}",
                                   color=color)
                    color = line[0].get_color()
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if y and y > 0]
        if ys and max(ys) / min(ys) > 20:  # engines an order of magnitude apart: log scale
            ax.set_yscale("log")
            title += ", log scale"
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency against request rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_throughput_vs_rate(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Output tokens/s against request rate, one line per label; returns ``path``."""
    plt = _plt()
    rates = _all_rates(results)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for label, res in results.items():
        by_rate = {_rate_label(r["request_rate"]): r["metrics"] for r in res["runs"]}
        pts = [(i, by_rate[r]["output_throughput_tok_s"]) for i, r in enumerate(rates) if r in by_rate]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    ax.set_xticks(range(len(rates)), rates)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Throughput against request rate", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def make_plots(results: dict[str, dict[str, Any]], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Write the three figures into ``out_dir`` (created if needed); returns their paths.

    Raises:
        ValueError: no successful request in any result.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_cdfs(results, out / f"{prefix}latency_cdf.png"),
        plot_latency_vs_rate(results, out / f"{prefix}latency_vs_rate.png"),
        plot_throughput_vs_rate(results, out / f"{prefix}throughput_vs_rate.png"),
    ]
