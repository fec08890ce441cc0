"""``kvfleet sim-engine``: its help and flags, and N engines in one subprocess stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from kvfleet.cli import build_parser, main
from kvfleet.sim.cli import sim_config_from_args
from kvfleet.sim.latency import DEFAULT_LATENCY


def test_help_says_simulator_and_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim-engine", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "no model" in out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["sim-engine"]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
    assert "simulated" in parser.format_help()


def test_flags_build_the_config(tmp_path):
    args = build_parser().parse_args(["sim-engine", "--num-kv-blocks", "100", "--block-size", "8", "--max-num-seqs",
                                      "3", "--time-scale", "0.5", "--base-s", "0.2", "--no-enable-prefix-caching",
                                      "--model", "m"])
    cfg = sim_config_from_args(args)
    assert (cfg.num_kv_blocks, cfg.block_size, cfg.max_num_seqs, cfg.time_scale, cfg.model_name) == (
        100, 8, 3, 0.5, "m")
    assert not cfg.enable_prefix_caching
    assert cfg.latency.base_s == 0.2 and cfg.latency.prefill_s_per_token == DEFAULT_LATENCY.prefill_s_per_token

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"base_s": 0.01, "prefill_s_per_token": 0.001, "decode_s_per_seq": 0.002,
                                   "kv_read_s_per_token": 0.0, "source": "test"}))
    args = build_parser().parse_args(["sim-engine", "--latency-profile", str(profile), "--decode-s-per-seq", "0.5"])
    lat = sim_config_from_args(args).latency
    assert (lat.base_s, lat.prefill_s_per_token, lat.decode_s_per_seq) == (0.01, 0.001, 0.5)


@pytest.mark.parametrize("argv", [
    ["--time-scale", "-1"], ["--num-engines", "0"], ["--port", "70000"], ["--base-s", "nan"],
    ["--port", "65530", "--num-engines", "10"], ["--latency-profile", "/nonexistent/profile.json"],
])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim-engine", *argv])
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def _read_lines(stream, n: int, timeout: float) -> list[str]:
    lines: list[str] = []

    def read():
        while len(lines) < n:
            line = stream.readline()
            if not line:
                return
            lines.append(line.strip())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return lines


def test_three_engines_in_one_process_stop_cleanly_on_sigterm():
    cmd = [sys.executable, "-m", "kvfleet", "sim-engine", "--port", "0", "--num-engines", "3", "--print-urls",
           "--time-scale", "0.01", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        urls = _read_lines(proc.stdout, 3, timeout=60)
        assert len(urls) == 3, (urls, proc.poll())
        assert len({u.rsplit(":", 1)[1] for u in urls}) == 3
        for i, url in enumerate(urls):
            r = httpx.get(url + "/health")
            assert r.status_code == 200 and r.headers["x-kvfleet-sim-engine"] == f"sim-{i}"
            r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
        with pytest.raises(httpx.ConnectError):
            httpx.get(urls[0] + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_in_use_is_a_clean_error(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "kvfleet", "sim-engine", "--port", str(port), "--log-level",
                            "warning"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert f"cannot bind 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    finally:
        s.close()
