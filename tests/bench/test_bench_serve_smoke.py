"""`kvfleet bench serve` against a real kvfleet server started as a subprocess (one per module)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from kvfleet.bench.compare import free_port, stop_engine
from kvfleet.bench.loadgen import ServerNotReadyError, wait_until_ready
from kvfleet.cli import main


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "serve", "smollm2-135m-instruct", "--host", "127.0.0.1",
             "--port", str(port), "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--log-level", "warning"],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_until_ready(url, timeout_s=540, proc=proc))
    except ServerNotReadyError as e:
        stop_engine(proc)
        pytest.fail(f"server did not start: {e}\n{log.read_text()[-2000:]}")
    yield url
    stop_engine(proc)


@pytest.fixture(scope="module")
def tokenizer_dir(hf_tokenizer, tmp_path_factory):
    """The session's tokenizer saved as a folder, so the CLI loads it in a moment."""
    d = tmp_path_factory.mktemp("tok")
    hf_tokenizer.save_pretrained(str(d))
    return str(d)


def test_bench_serve_sweep_writes_sane_json(server, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", server, "--tokenizer", tokenizer_dir, "--num-prompts", "3",
               "--input-len", "16", "--output-len", "6", "--sweep", "8,inf", "--num-warmups", "1",
               "--goodput", "ttft:600000", "tpot:600000", "--result-json", str(out), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "TTFT p50 ms" in table and "inf" in table
    res = json.loads(out.read_text())
    assert res["command"].startswith(f"kvfleet bench serve --base-url {server} ")
    assert "--sweep 8,inf" in res["command"]
    assert res["endpoint"]["model"] == "smollm2-135m-instruct"
    assert [r["request_rate"] for r in res["runs"]] == [8.0, "inf"]
    prompts = [{q["tag"]: q for q in r["requests"]} for r in res["runs"]]
    assert len(prompts[0]) == 3
    for run in res["runs"]:
        m = run["metrics"]
        assert m["completed"] == 3 and m["failed"] == 0 and m["errors"] == []
        assert m["usage_reported"] is True
        assert m["total_output_tokens"] == 3 * 6  # ignore_eos: exactly the asked length
        assert 3 * 14 <= m["total_input_tokens"] <= 3 * 18
        assert m["output_throughput_tok_s"] == pytest.approx(18 / m["duration_s"])
        assert m["goodput_req_s"] == pytest.approx(m["request_throughput_req_s"])  # huge SLOs: all good
        assert 0 < m["p50_ttft_ms"] <= m["p99_ttft_ms"] <= m["p50_e2el_ms"] * 10
        assert m["mean_tpot_ms"] > 0 and m["p50_itl_ms"] > 0
        for q in run["requests"]:
            assert q["success"] and 0 < q["ttft"] <= q["latency"]
            assert q["output_tokens"] == 6 and len(q["itl"]) <= 5
            assert q["tpot"] == pytest.approx((q["latency"] - q["ttft"]) / 5)


def test_bench_serve_multi_turn_resends_history(server, tokenizer_dir, tmp_path):
    out = tmp_path / "mt.json"
    rc = main(["bench", "serve", "--base-url", server, "--tokenizer", tokenizer_dir, "--model",
               "smollm2-135m-instruct", "--endpoint", "/v1/chat/completions", "--dataset", "multi-turn",
               "--multi-turn-conversations", "2", "--multi-turn-turns", "2", "--multi-turn-user-len", "8",
               "--output-len", "4", "--num-warmups", "0", "--max-concurrency", "2", "--result-json", str(out),
               "--no-progress"])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["metrics"]["completed"] == 4 and run["max_concurrency"] == 2
    by_tag = {q["tag"]: q for q in run["requests"]}
    for c in (0, 1):
        t0, t1 = by_tag[f"conv{c}/turn0"], by_tag[f"conv{c}/turn1"]
        # turn 1 carries turn 0's user message and the 4-token reply, plus its own user message
        assert t1["prompt_tokens"] >= t0["prompt_tokens"] + 4 + 8
        assert t1["start"] >= t0["start"] + t0["latency"]  # sent after the previous reply


def test_prefix_cache_counters_show_shared_prefix_hits(server, tokenizer_dir, tmp_path):
    from kvfleet.bench.compare import prefix_cache_delta, scrape_prefix_cache_counters

    before = scrape_prefix_cache_counters(server)
    assert before is not None and before["hits"] <= before["queries"]
    # 1 tenant x 64-token system prompt x 3 questions, one at a time: questions 2 and 3 reuse its blocks
    rc = main(["bench", "serve", "--base-url", server, "--tokenizer", tokenizer_dir, "--dataset", "shared-prefix",
               "--shared-prefix-tenants", "1", "--shared-prefix-len", "64", "--shared-prefix-questions", "3",
               "--shared-prefix-question-len", "8", "--output-len", "2", "--num-warmups", "0",
               "--max-concurrency", "1", "--result-json", str(tmp_path / "sp.json"), "--no-progress"])
    assert rc == 0
    delta = prefix_cache_delta(before, scrape_prefix_cache_counters(server))
    assert delta is not None
    assert 3 * 70 <= delta["queried_tokens"] <= 3 * 80
    assert delta["hit_tokens"] >= 2 * 48  # at least 3 full 16-token blocks of the prefix, twice
    assert 0 < delta["hit_rate"] < 1
    assert scrape_prefix_cache_counters("http://127.0.0.1:9") is None  # nothing listening
