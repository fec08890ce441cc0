"""`kvfleet bench` command line: help texts, clear errors for bad input, peers that are missing."""

from __future__ import annotations

import pytest

from kvfleet.cli import main


@pytest.mark.parametrize("sub", ["serve", "throughput", "compare", "plot"])
def test_help_states_units_and_defaults(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"kvfleet bench {sub}" in out
    assert "default" in out
    if sub in ("serve", "compare"):
        for text in ("req/s", "tokens", "--goodput", "--sweep", "--max-concurrency", "--burstiness",
                     "--reuse-prompts", "milliseconds", "seconds"):
            assert text in out, text


def test_bench_without_subcommand_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["bench", "serve", "--request-rate", "0"], "request rate must be > 0"),
    (["bench", "serve", "--request-rate", "fast"], "expected a request rate"),
    (["bench", "serve", "--sweep", "1,x"], "expected a request rate"),
    (["bench", "serve", "--goodput", "ttft"], "KEY:MILLISECONDS"),
    (["bench", "serve", "--goodput", "speed:5"], "not one of"),
    (["bench", "serve", "--num-prompts", "0"], "expected an integer >= 1"),
    (["bench", "serve", "--percentiles", "150"], "not in"),
    (["bench", "serve", "--burstiness", "-1"], "positive"),
    (["bench", "serve", "--range-ratio", "1.5"], r"\[0, 1\)"),
    (["bench", "serve", "--dataset", "sharegpt"], "needs --dataset-path"),
    (["bench", "serve", "--dataset", "multi-turn"], "chat/completions"),
    (["bench", "serve", "--dataset", "nope"], "invalid choice"),
    (["bench", "compare", "--engines", "kvfleet,tgi"], "subset of"),
    (["bench", "compare", "--engines", "kvfleet,kvfleet"], "twice"),
    (["bench", "compare", "--engine-args", "tgi=-x"], "ENGINE="),
    (["bench", "throughput", "--engines", "vllm"], "subset of"),
])
def test_bad_flags_exit_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re

    assert re.search(match, err), err


def test_missing_sharegpt_file_is_a_clear_error(tmp_path, capsys):
    rc = main(["bench", "throughput", "--dataset", "sharegpt", "--dataset-path", str(tmp_path / "none.json")])
    assert rc == 1
    assert "ShareGPT file not found" in capsys.readouterr().err


def test_unreachable_server_is_a_clear_error(capsys):
    from kvfleet.bench.compare import free_port

    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "kvfleet bench: error: cannot list models" in err and "Traceback" not in err


def test_unreachable_server_with_ready_timeout(capsys):
    from kvfleet.bench.compare import free_port

    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "1"])
    assert rc == 1
    assert "did not answer /v1/models" in capsys.readouterr().err


def test_missing_peers_are_reported(tmp_path):
    from kvfleet.bench.compare import PeerNotInstalledError, engine_launch

    with pytest.raises(PeerNotInstalledError, match="setup.sh vllm"):
        engine_launch("vllm", "smollm2-135m-instruct", 8000, 2, peers_dir=tmp_path)
    with pytest.raises(PeerNotInstalledError, match="setup.sh llamacpp"):
        engine_launch("llamacpp", "smollm2-135m-instruct", 8000, 2, peers_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown engine"):
        engine_launch("tgi", "smollm2-135m-instruct", 8000, 2, peers_dir=tmp_path)
    k = engine_launch("kvfleet", "smollm2-135m-instruct", 8123, 3, max_num_seqs=5, peers_dir=tmp_path)
    assert k.argv[1:4] == ["-m", "kvfleet", "serve"]
    assert "--num-threads" in k.argv and k.argv[k.argv.index("--num-threads") + 1] == "3"
    assert k.argv[k.argv.index("--max-num-seqs") + 1] == "5"
    assert k.base_url == "http://127.0.0.1:8123" and k.threads == 3 and "float32" in k.precision
    assert "kvfleet serve smollm2-135m-instruct" in k.command


def test_peer_launch_lines(tmp_path):
    from kvfleet.bench.compare import engine_launch

    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").write_text("")
    (tmp_path / "models" / "smollm2-135m-instruct-hf").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m-instruct-hf" / "config.json").write_text("{}")
    (tmp_path / "llama.cpp" / "bin").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "bin" / "llama-server").write_text("")
    v = engine_launch("vllm", "smollm2-135m-instruct", 9000, 2, max_num_seqs=8, max_model_len=1024,
                      peers_dir=tmp_path)
    assert "vllm.entrypoints.openai.api_server" in v.argv and v.env["HF_HUB_OFFLINE"] == "1"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert v.argv[v.argv.index("--dtype") + 1] == "float32"
    ll = engine_launch("llamacpp", "smollm2-135m-instruct", 9001, 2, max_num_seqs=8, max_model_len=1024,
                       peers_dir=tmp_path, extra_args=["-fa", "on"])
    assert ll.argv[ll.argv.index("-np") + 1] == "8" and ll.argv[ll.argv.index("-c") + 1] == str(8 * 1024)
    assert ll.argv[-2:] == ["-fa", "on"] and "Q4_1" in ll.precision
    assert ll.argv[ll.argv.index("-m") + 1].endswith(".gguf")


def test_compare_scenarios_override_the_command_flags():
    from kvfleet.bench.cli import _scenarios
    from kvfleet.cli import build_parser

    argv = ["bench", "compare", "--num-prompts", "3", "--output-len", "16", "--scenario", "sweep=--sweep 1,inf",
            "--scenario", "b1=--max-concurrency 1 --output-len 64",
            "--scenario", "sp=--dataset shared-prefix --shared-prefix-tenants 2 --request-rate 2"]
    args = build_parser().parse_args(argv)
    sc = _scenarios(args, args._parser)
    assert list(sc) == ["sweep", "b1", "sp"]
    assert sc["sweep"].request_rates == [1.0, float("inf")] and sc["sweep"].dataset.output_len == 16
    assert sc["b1"].max_concurrency == 1 and sc["b1"].dataset.output_len == 64 and sc["b1"].dataset.num_prompts == 3
    assert sc["sp"].dataset.name == "shared-prefix" and sc["sp"].dataset.tenants == 2
    assert sc["sp"].request_rates == [2.0]
    one = build_parser().parse_args(["bench", "compare", "--sweep", "2,4"])
    assert list(_scenarios(one, one._parser)) == ["default"]


@pytest.mark.parametrize("scenario,match", [
    ("noequals", "NAME='FLAGS'"), ("a b=--sweep 1", "NAME='FLAGS'"), ("x=--engines vllm", "workload and load"),
    ("x=--request-rate 0", "request rate"),
])
def test_bad_scenarios(scenario, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "compare", "--scenario", scenario])
    assert e.value.code == 2
    import re

    assert re.search(match, capsys.readouterr().err)
