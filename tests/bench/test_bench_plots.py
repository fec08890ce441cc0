"""Plots: the three PNG figures from serve / compare results, and `kvfleet bench plot`."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from kvfleet.bench.metrics import RequestResult, compute_metrics  # noqa: E402
from kvfleet.bench.plots import make_plots  # noqa: E402
from kvfleet.bench.report import format_compare_table, format_serve_table, write_json  # noqa: E402


def _result(label: str, scale: float) -> dict:
    runs = []
    for rate in (1.0, 4.0, "inf"):
        reqs = [RequestResult(success=True, ttft=scale * (0.05 + 0.01 * i), latency=scale * (1 + 0.1 * i),
                              output_tokens=16, prompt_tokens=32, itl=[scale * 0.06] * 15) for i in range(8)]
        runs.append({"request_rate": rate, "metrics": compute_metrics(reqs, 4.0 * scale),
                     "requests": [r.to_json() for r in reqs]})
    return {"kind": "serve", "label": label, "runs": runs, "engine": {"precision": "fp32", "threads": 2}}


def test_make_plots_writes_small_pngs(tmp_path):
    results = {"kvfleet": _result("kvfleet", 1.0), "peer": _result("peer", 2.0)}
    paths = make_plots(results, tmp_path / "plots", prefix="t_")
    assert [p.name for p in paths] == ["t_latency_cdf.png", "t_latency_vs_rate.png", "t_throughput_vs_rate.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert 5_000 < len(data) < 200_000


def test_plots_need_successful_requests(tmp_path):
    res = {"x": {"runs": [{"request_rate": 1.0, "metrics": compute_metrics([RequestResult(error="e")], 1.0),
                           "requests": [RequestResult(error="e").to_json()]}]}}
    with pytest.raises(ValueError, match="no successful"):
        make_plots(res, tmp_path)


def test_tables_and_plot_command(tmp_path, capsys):
    from kvfleet.cli import main

    a, b = _result("kvfleet", 1.0), _result("peer", 2.0)
    text = format_serve_table(a)
    assert "TTFT p50 ms" in text and "inf" in text and len(text.splitlines()) == 5
    table = format_compare_table({"kvfleet": a, "peer": b})
    peer_rows = [line for line in table.splitlines() if line.startswith("peer")]
    assert len(peer_rows) == 3
    # the peer is 2x slower everywhere: throughput ratio 0.5, TTFT ratio 2.0; no prefix-cache counters: "-"
    assert peer_rows[0].split()[-4:] == ["0.5", "2.0", "2.0", "-"]
    b["prefix_cache"] = {"queried_tokens": 400.0, "hit_tokens": 100.0, "hit_rate": 0.25}
    table = format_compare_table({"kvfleet": a, "peer": b})
    assert [ln for ln in table.splitlines() if ln.startswith("peer")][0].split()[-1] == "25.0"
    path = write_json({**a, "command": "kvfleet bench serve ..."}, tmp_path / "r.json")
    assert main(["bench", "plot", str(path), "--plot-dir", str(tmp_path / "p")]) == 0
    assert len(list((tmp_path / "p").glob("*.png"))) == 3
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "plot", str(bad), "--plot-dir", str(tmp_path / "q")]) == 1
    assert "not a `kvfleet bench serve`" in capsys.readouterr().err
