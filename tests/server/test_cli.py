"""`kvfleet` CLI: flags -> EngineConfig, help text, argparse errors (no model is loaded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.cli import build_parser, engine_config_from_args, main


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults():
    cfg = engine_config_from_args(_serve_args())
    assert cfg.model == "smollm2-135m-instruct"
    assert cfg.dtype == "float32"
    assert cfg.cache.block_size == 16
    assert cfg.cache.kv_cache_memory_bytes == 2 * 2**30
    assert cfg.cache.num_kv_blocks is None
    assert cfg.scheduler.enable_chunked_prefill is True
    args = _serve_args()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)


def test_all_flags_reach_the_config():
    args = _serve_args("some.gguf", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k",
                       "--served-model-name", "m", "--dtype", "bfloat16", "--seed", "7", "--num-threads", "2",
                       "--block-size", "32", "--kv-cache-memory", "512MiB", "--num-kv-blocks", "99",
                       "--max-num-seqs", "3", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
                       "--max-waiting-requests", "5", "--no-enable-chunked-prefill", "--log-level", "debug")
    cfg = engine_config_from_args(args)
    assert (args.host, args.port, args.api_key, args.log_level) == ("0.0.0.0", 9001, "k", "debug")
    assert (cfg.model, cfg.served_model_name, cfg.dtype, cfg.seed, cfg.num_threads) == (
        "some.gguf", "m", "bfloat16", 7, 2)
    assert (cfg.cache.block_size, cfg.cache.kv_cache_memory_bytes, cfg.cache.num_kv_blocks) == (32, 512 * 2**20, 99)
    s = cfg.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.max_waiting_requests) == (3, 256, 1024, 5)
    assert s.enable_chunked_prefill is False


@pytest.mark.parametrize("argv, needle", [
    (["--block-size", "0"], "--block-size"),
    (["--port", "70000"], "--port"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--max-num-seqs", "-1"], "--max-num-seqs"),
    (["--dtype", "int3"], "--dtype"),
    (["--log-level", "loud"], "--log-level"),
    (["/no/such/model.gguf"], "neither an existing GGUF file"),
    (["--swap-space", "-1"], "--swap-space"),
    (["--preemption-mode", "swap"], "--swap-space"),
    (["--prefix-cache", "trie"], "--prefix-cache"),
    (["--scheduling-policy", "random"], "--scheduling-policy"),
    (["--sink-tokens", "-1"], "--sink-tokens"),
    (["--streaming-window", "0"], "--streaming-window"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
])
def test_invalid_values_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err


def test_help_documents_flags():
    out = subprocess.run([sys.executable, "-m", "kvfleet", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--dtype", "--seed", "--num-threads",
                 "--block-size", "--kv-cache-memory", "--num-kv-blocks", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--max-waiting-requests",
                 "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--log-level"):
        assert flag in out.stdout, flag
    assert "default: 2GiB" in out.stdout and "default: 16" in out.stdout
    top = subprocess.run([sys.executable, "-m", "kvfleet", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "serve" in top.stdout


def test_kv_cache_flags_map_to_config():
    from kvfleet.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args([
        "serve", "--no-enable-prefix-caching", "--prefix-cache", "radix", "--preemption-mode", "swap",
        "--swap-space", "0.5", "--scheduling-policy", "lpm", "--kv-eviction", "streaming", "--sink-tokens", "8",
        "--streaming-window", "256", "--kv-cache-dtype", "fp8_e5m2"])
    cfg = engine_config_from_args(args)
    c, s = cfg.cache, cfg.scheduler
    assert (c.enable_prefix_caching, c.prefix_cache, c.swap_space_bytes) == (False, "radix", 2**29)
    assert (c.kv_eviction, c.sink_tokens, c.streaming_window, c.kv_cache_dtype) == ("streaming", 8, 256, "fp8_e5m2")
    assert (s.preemption_mode, s.scheduling_policy) == ("swap", "lpm")
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults.cache.enable_prefix_caching and defaults.cache.prefix_cache == "hash"
    assert defaults.scheduler.preemption_mode == "recompute" and defaults.cache.kv_eviction == "none"
