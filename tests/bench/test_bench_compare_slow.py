"""`kvfleet bench compare` end to end with kvfleet as the only engine (slow: starts a server)."""

from __future__ import annotations

import json

import pytest

from kvfleet.cli import main

pytestmark = pytest.mark.slow


def test_compare_kvfleet_two_scenarios(hf_tokenizer, tmp_path, capsys):
    tok = tmp_path / "tok"
    hf_tokenizer.save_pretrained(str(tok))
    out = tmp_path / "out"
    rc = main(["bench", "compare", "--engines", "kvfleet,vllm", "--peers-dir", str(tmp_path / "nopeers"),
               "--tokenizer", str(tok), "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
               "--num-warmups", "0", "--max-num-seqs", "4", "--max-model-len", "256", "--no-progress",
               "--scenario", "sweep=--sweep 4,inf", "--scenario", "b1=--max-concurrency 1", "--out-dir", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "== scenario sweep" in text and "== scenario b1" in text
    assert "vllm: precision ?, ? threads; NOT RUN: vLLM is not set up" in text
    res = json.loads((out / "compare.json").read_text())
    assert res["command"].startswith("kvfleet bench compare --engines kvfleet,vllm")
    info = res["engines"]["kvfleet"]
    assert "kvfleet serve smollm2-135m-instruct" in info["command"] and info["startup_s"] > 0
    assert "error" in res["engines"]["vllm"]
    assert set(res["scenarios"]) == {"sweep", "b1"}
    sweep = res["scenarios"]["sweep"]["kvfleet"]
    assert [r["request_rate"] for r in sweep["runs"]] == [4.0, "inf"]
    for scen in ("sweep", "b1"):
        for run in res["scenarios"][scen]["kvfleet"]["runs"]:
            assert run["metrics"]["completed"] == 2 and run["metrics"]["total_output_tokens"] == 8
    assert res["scenarios"]["b1"]["kvfleet"]["runs"][0]["max_concurrency"] == 1
    assert sorted(p.name for p in out.glob("*.png")) == sorted(
        f"{s}_{k}.png" for s in ("sweep", "b1") for k in ("latency_cdf", "latency_vs_rate", "throughput_vs_rate"))
    assert (out / "kvfleet.log").exists()
    assert main(["bench", "plot", str(out / "compare.json"), "--plot-dir", str(tmp_path / "p")]) == 0
    assert len(list((tmp_path / "p").glob("*.png"))) == 6
