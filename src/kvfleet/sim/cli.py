"""``kvfleet sim-engine``: serve one or many SIMULATED engines (no model) for router scale tests.

Registered in :data:`kvfleet.cli.SUBCOMMANDS` by :func:`kvfleet.cli.add_sim_engine_parser`.
Bad flag values end with argparse's one-line error and exit status 2; a port that cannot be
bound ends with ``kvfleet sim-engine: error: ...`` and status 1. SIGINT / SIGTERM stop every
engine cleanly (status 0); a second SIGINT drops open connections at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvfleet.cli import (
    LOG_LEVELS,
    ExampleHelpFormatter,
    non_negative_float,
    port_number,
    positive_int,
)
from kvfleet.config import DEFAULT_MODEL

logger = logging.getLogger("kvfleet.sim")

DESCRIPTION = """\
Serve SIMULATED LLM engines: kvfleet's real scheduler (continuous batching, chunked prefill,
preemption) and real paged KV cache manager (prefix caching by block hash), but no model: each
step sleeps a modelled time (a base, smaller for a one-token step, + per prefill token + per
decode sequence + per KV token read; calibrated from the real engine on SmolLM2-135M) and emits
fake tokens. Same HTTP API as `kvfleet serve` (/v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics with vLLM metric names). Use it to test routers against many endpoints on one
machine: --num-engines N runs N independent engines on ports PORT..PORT+N-1 in one process.
Prompts are tokenized by a simulated tokenizer (one token per 4 characters); the generated text is
meaningless. A request with max_tokens gets exactly max_tokens tokens (ignore_eos or not); without
max_tokens it stops after --default-max-tokens. n > 1, logprobs, echo and beam search are rejected
with HTTP 400."""


def add_sim_engine_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet sim-engine`` and its flags (units and defaults in every help line)."""
    from kvfleet.sim.engine import DEFAULT_NUM_KV_BLOCKS
    from kvfleet.sim.latency import DEFAULT_LATENCY

    p = sub.add_parser("sim-engine", help="serve simulated engines (no model; real scheduler + KV cache, "
                                          "modelled latency) for router scale tests",
                       description=DESCRIPTION, formatter_class=ExampleHelpFormatter)
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="interface to bind")
    net.add_argument("--port", type=port_number, default=9000,
                     help="port of the first simulated engine; engine i listens on PORT+i (0 = free ports "
                          "chosen by the OS, printed at start)")
    net.add_argument("--num-engines", type=positive_int, default=1,
                     help="independent simulated engines to run in this one process (each its own port, "
                          "scheduler, KV pool and metrics)")
    net.add_argument("--model", "--served-model-name", dest="model", default=DEFAULT_MODEL,
                     help="model name to serve and report (nothing is loaded: the simulator only uses the name)")
    net.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level")

    cache = p.add_argument_group("KV cache (simulated pool, real block manager)")
    cache.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    cache.add_argument("--num-kv-blocks", type=positive_int, default=DEFAULT_NUM_KV_BLOCKS,
                       help="KV pool size in blocks per engine (default: %(default)s, what `kvfleet serve`'s "
                            "2GiB default pool holds for SmolLM2-135M in fp32)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse cached prompt prefixes (full blocks, by chained block hash); "
                            "--no-enable-prefix-caching turns it off")

    sched = p.add_argument_group("scheduler (the real one)")
    sched.add_argument("--max-num-seqs", type=positive_int, default=64, help="most requests running in one step")
    sched.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                       help="token budget per step (prefill chunks plus decodes), in tokens")
    sched.add_argument("--max-model-len", type=positive_int, default=None,
                       help="longest sequence (prompt + output) in tokens; longer requests get HTTP 400 "
                            "(default: min(8192, pool tokens))")
    sched.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                       help="bound of the waiting queue; over it requests get HTTP 503 with Retry-After")
    sched.add_argument("--default-max-tokens", type=positive_int, default=256,
                       help="output tokens of a request that sets no max_tokens (it then ends with "
                            "finish_reason 'stop', as if the model emitted EOS)")

    lat = p.add_argument_group(
        "latency model",
        "step time = base (single-token-base for a step of one token)\n"
        "                 + prefill-per-token x prefill tokens in the step\n"
        "                 + decode-per-seq x decode sequences in the step\n"
        "                 + kv-read-per-token x context tokens read from the KV cache in the step,\n"
        "            all x --time-scale.\n"
        f"Defaults calibrated from the real engine: {DEFAULT_LATENCY.source}.")
    lat.add_argument("--latency-profile", metavar="FILE.json", default=None,
                     help="load the latency parameters from a JSON file written by benchmarks/calibrate_sim.py "
                          "(default: the built-in calibration)")
    lat.add_argument("--base-s", type=non_negative_float, default=None, metavar="SECONDS",
                     help="override: fixed cost of a step that computes two or more tokens, seconds "
                          f"(built-in: {DEFAULT_LATENCY.base_s:.6g})")
    lat.add_argument("--single-token-base-s", type=non_negative_float, default=None, metavar="SECONDS",
                     help="override: fixed cost of a step that computes exactly one token (a lone decode), "
                          f"seconds (built-in: {DEFAULT_LATENCY.single_token_base_s:.6g})")
    lat.add_argument("--prefill-s-per-token", type=non_negative_float, default=None, metavar="SECONDS",
                     help="override: added cost per prefill token, seconds "
                          f"(built-in: {DEFAULT_LATENCY.prefill_s_per_token:.6g})")
    lat.add_argument("--decode-s-per-seq", type=non_negative_float, default=None, metavar="SECONDS",
                     help="override: added cost per decoding sequence, seconds "
                          f"(built-in: {DEFAULT_LATENCY.decode_s_per_seq:.6g})")
    lat.add_argument("--kv-read-s-per-token", type=non_negative_float, default=None, metavar="SECONDS",
                     help="override: added cost per context token read from the KV cache (decodes, later "
                          f"prefill chunks), seconds (built-in: {DEFAULT_LATENCY.kv_read_s_per_token:.6g})")
    lat.add_argument("--time-scale", type=non_negative_float, default=1.0,
                     help="multiply every modelled sleep (0.1 = 10x faster than the real engine, "
                          "0 = no sleeping); metrics report the scaled wall-clock times")
    p.add_argument("--print-urls", action="store_true",
                   help="print each engine's base URL on stdout (one per line) once all accept connections")
    p.set_defaults(func=run_sim_engine, _parser=p)
    return p


def sim_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - SimEngineConfig (lazy import)
    """Build the :class:`~kvfleet.sim.engine.SimEngineConfig` of ``kvfleet sim-engine``'s flags.

    Raises:
        ValueError: a bad latency profile or a combination the config rejects.
        FileNotFoundError: the latency profile does not exist.
    """
    from kvfleet.sim.engine import SimEngineConfig
    from kvfleet.sim.latency import DEFAULT_LATENCY, LatencyModel

    latency = LatencyModel.load(args.latency_profile) if args.latency_profile else DEFAULT_LATENCY
    latency = latency.with_overrides(base_s=args.base_s, single_token_base_s=args.single_token_base_s,
                                     prefill_s_per_token=args.prefill_s_per_token,
                                     decode_s_per_seq=args.decode_s_per_seq,
                                     kv_read_s_per_token=args.kv_read_s_per_token)
    return SimEngineConfig(
        model_name=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests, default_max_tokens=args.default_max_tokens,
        latency=latency, time_scale=args.time_scale)


async def _serve(args: argparse.Namespace, config) -> int:  # noqa: ANN001
    from kvfleet.sim.fleet import SimFleet

    fleet = SimFleet(args.num_engines, config, host=args.host, port=args.port,
                     uvicorn_log_level="debug" if args.log_level == "debug" else "warning")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("second %s: dropping open connections", sig.name)
            fleet.force_exit()
            return
        logger.info("%s: stopping %d simulated engine(s)", sig.name, args.num_engines)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        try:
            urls = await fleet.start()
        except (OSError, RuntimeError) as e:
            print(f"kvfleet sim-engine: error: {e}", file=sys.stderr)
            return 1
        lat = config.latency
        logger.info("SIMULATED engines (no model): model name %r, %d blocks x %d tokens each, max_model_len %d, "
                    "step = %.4g ms (%.4g ms for one token) + %.4g ms/prefill token + %.4g ms/decode seq + "
                    "%.4g ms/KV token read, time scale %g", config.model_name, config.num_kv_blocks,
                    config.block_size, fleet.engines[0].max_model_len, lat.base_s * 1e3,
                    lat.single_token_base_s * 1e3, lat.prefill_s_per_token * 1e3,
                    lat.decode_s_per_seq * 1e3, lat.kv_read_s_per_token * 1e3, config.time_scale)
        if args.print_urls:
            print("\n".join(urls), flush=True)
        await stop.wait()
        await fleet.stop()
        logger.info("all simulated engines stopped")
        return 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_sim_engine(args: argparse.Namespace) -> int:
    """Run ``kvfleet sim-engine``: start the engines, serve until SIGINT / SIGTERM."""
    parser: argparse.ArgumentParser = args._parser
    if args.port and args.port + args.num_engines - 1 > 65535:
        parser.error(f"--port {args.port} with --num-engines {args.num_engines} goes past port 65535")
    try:
        config = sim_config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return asyncio.run(_serve(args, config))
