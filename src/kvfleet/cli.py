"""The ``kvfleet`` command line.

``kvfleet serve [MODEL] [flags]`` loads a model into kvfleet's engine and serves the OpenAI API
(flag names follow vLLM's ``vllm serve``). Subcommands are registered in :data:`SUBCOMMANDS`;
each adds its own parser and handler, so more (``bench``, ``router``, ...) slot in beside ``serve``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from kvfleet.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig
from kvfleet.utils import parse_bytes

logger = logging.getLogger("kvfleet.cli")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to help lines that do not already state their default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


# --------------------------------------------------------------------------- argparse types


def _bounded(convert: Callable[[str], float], what: str, low: float | None = None, high: float | None = None
             ) -> Callable[[str], float]:
    """An argparse type converting with ``convert`` and checking ``low <= v <= high`` (finite)."""

    def parse(text: str) -> float:
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")) or (low is not None and v < low) or (
                high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    parse.__doc__ = f"argparse type: {what}."
    return parse


#: argparse types (each raises ``ArgumentTypeError`` with a one-line message).
positive_int = _bounded(int, "an integer >= 1", 1)
non_negative_int = _bounded(int, "an integer >= 0", 0)
non_negative_float = _bounded(float, "a finite number >= 0", 0)
port_number = _bounded(int, "a port number in [0, 65535] (0 = any free port)", 0, 65535)
any_int = _bounded(int, "an integer")
positive_float = _bounded(float, "a finite number > 0", 1e-300)
HelpFormatter = _HelpFormatter


def memory_size(text: str) -> int:
    """argparse type: a memory size such as ``2GiB`` or ``512MiB`` (> 0), in bytes."""
    try:
        v = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"memory size must be > 0, got {text!r}")
    return v


# --------------------------------------------------------------------------- serve


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet serve`` and its flags (units and defaults in every help line)."""
    p = sub.add_parser(
        "serve", help="serve a model over the OpenAI-compatible HTTP API",
        description="Load MODEL into kvfleet's paged-KV-cache engine and serve the OpenAI API "
                    "(/v1/chat/completions, /v1/completions, /v1/models), /health, /metrics, "
                    "/tokenize and /detokenize.",
        formatter_class=_HelpFormatter)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, metavar="MODEL",
                   help="GGUF file, Hugging Face model folder, or packaged model short name")
    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="interface to bind")
    net.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on")
    net.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: no auth)")
    net.add_argument("--served-model-name", default=None,
                     help="model name reported by the API and accepted in requests "
                          "(default: the model's short name or file stem)")
    net.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level")

    model = p.add_argument_group("model")
    model.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                       help="compute and KV cache dtype")
    model.add_argument("--seed", type=any_int, default=0, help="global seed for requests without their own")
    model.add_argument("--num-threads", type=positive_int, default=None,
                       help="torch intra-op CPU threads (default: torch's choice)")
    model.add_argument("--quantization", "-q", choices=("none", "int8"), default="none",
                       help="int8: every projection and the LM head in int8 with per-token dynamic int8 "
                            "activations (W8A8, fbgemm, CPU); 1.8-3x faster decoding than float32, perplexity "
                            "+11%% on SmolLM2, greedy text differs from float32's (BENCHMARKS.md); needs --dtype "
                            "float32")
    model.add_argument("--max-model-len", type=positive_int, default=None,
                       help="longest sequence (prompt + output) in tokens (default: the model's "
                            "context length, capped by the KV pool)")

    cache = p.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    cache.add_argument("--kv-cache-memory", type=memory_size, default=2 * 2**30, metavar="SIZE",
                       help="bytes for the KV pool of all layers, e.g. 2GiB, 512MiB, 1GB or a byte count "
                            "(default: 2GiB)")
    cache.add_argument("--num-kv-blocks", type=positive_int, default=None,
                       help="KV pool size in blocks; overrides --kv-cache-memory "
                            "(default: sized from --kv-cache-memory)")
    cache.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3", "fp8_e5m2"), default="auto",
                       help="KV cache storage dtype: auto = --dtype; fp8_e4m3 / fp8_e5m2 store K and V in "
                            "1 byte (per-tensor scale, dequantized for attention), so --kv-cache-memory "
                            "holds 4x the tokens of float32; e4m3 is the more accurate (default: auto)")

    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV of cached prompt prefixes (full blocks, by chained block hash or "
                            "radix tree); --no-enable-prefix-caching turns it off")
    cache.add_argument("--prefix-cache", choices=("hash", "radix"), default="hash",
                       help="prefix index: hash = chained block hashes with an LRU of freed cached blocks "
                            "(vLLM); radix = token-granular radix tree with LRU leaf eviction (SGLang's "
                            "RadixAttention); a partial-block match is reused by copying that block")
    cache.add_argument("--kv-eviction", choices=("none", "streaming"), default="none",
                       help="streaming = StreamingLLM (Xiao et al. 2024): keep the first --sink-tokens tokens "
                            "(attention sinks) and the last --streaming-window tokens, freeing the blocks in "
                            "between, so generation can run past --max-model-len in bounded memory")
    cache.add_argument("--sink-tokens", type=non_negative_int, default=4,
                       help="attention-sink tokens kept by --kv-eviction streaming")
    cache.add_argument("--streaming-window", type=positive_int, default=1024,
                       help="recent tokens attended by --kv-eviction streaming")
    cache.add_argument("--swap-space", type=non_negative_float, default=0.0, metavar="GIB",
                       help="host memory for the swap pool of --preemption-mode swap, in GiB (0 = none)")

    sched = p.add_argument_group("scheduler")
    sched.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                       help="when the KV pool runs out: recompute = drop the newest request's KV and "
                            "recompute it later; swap = move it to the host swap pool (--swap-space) and "
                            "back, falling back to recompute when the swap pool is full or the request made "
                            "no progress since its last swap-in")
    sched.add_argument("--scheduling-policy", choices=("fcfs", "lpm"), default="fcfs",
                       help="order of waiting requests: fcfs = first come first served; lpm = longest "
                            "prefix match first (SGLang), falling back to fcfs above 128 waiting requests")
    sched.add_argument("--max-num-seqs", type=positive_int, default=64,
                       help="most requests running in one engine step")
    sched.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                       help="token budget per engine step (prefill chunks plus decodes), in tokens")
    sched.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                       help="bound of the waiting queue; over it requests get HTTP 503 with Retry-After")
    sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="split long prompts into chunks that share a step with decodes")
    p.set_defaults(func=run_serve, _parser=p)
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the :class:`EngineConfig` of ``kvfleet serve``'s parsed flags.

    Raises:
        ValueError: a combination of values the config rejects.
    """
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        seed=args.seed,
        num_threads=args.num_threads,
        quantization=args.quantization,
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=args.enable_prefix_caching, prefix_cache=args.prefix_cache,
                          swap_space_bytes=int(args.swap_space * 2**30), kv_eviction=args.kv_eviction,
                          sink_tokens=args.sink_tokens, streaming_window=args.streaming_window),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting_requests=args.max_waiting_requests,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
            scheduling_policy=args.scheduling_policy,
        ),
    )


def run_serve(args: argparse.Namespace) -> int:
    """Run ``kvfleet serve``: build the engine, start it, serve HTTP until interrupted."""
    parser: argparse.ArgumentParser = args._parser
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    from kvfleet.model.registry import resolve_model_path

    try:
        resolve_model_path(config.model)
    except FileNotFoundError as e:
        parser.error(str(e))

    import uvicorn

    from kvfleet.engine.async_engine import AsyncLLM
    from kvfleet.server.app import create_app

    try:
        engine = AsyncLLM(config)
    except (FileNotFoundError, ValueError, OSError) as e:  # a bad model file or an impossible setting
        parser.exit(2, f"kvfleet serve: error: {config.model}: {e}\n")
    engine.start()
    try:
        names = [engine.model_name]
        app = create_app(engine, api_key=args.api_key, served_model_names=names)
        shown_host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("serving %r at http://%s:%d (OpenAI API under /v1)%s", engine.model_name, shown_host,
                    args.port, ", API key required" if args.api_key else "")
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


# --------------------------------------------------------------------------- entry point

def _lazy(module: str, function: str, what: str) -> Callable[[argparse._SubParsersAction], argparse.ArgumentParser]:
    """A registrar that imports ``module`` only when the parser is built and calls its
    ``function(subparsers)`` (``what`` names the subcommand in the docstring)."""

    def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        return getattr(importlib.import_module(module), function)(sub)

    register.__name__ = function
    register.__doc__ = f"Register ``kvfleet {what}`` (see :mod:`{module}`)."
    return register


add_bench_parser = _lazy("kvfleet.bench.cli", "add_bench_parser", "bench")
add_router_parser = _lazy("kvfleet.router.cli", "add_router_parser", "router")
add_sim_engine_parser = _lazy("kvfleet.sim.cli", "add_sim_engine_parser", "sim-engine")
add_render_parser = _lazy("kvfleet.control.cli", "add_render_parser", "render")
add_up_parser = _lazy("kvfleet.control.fleet_cli", "add_up_parser", "up")
add_status_parser = _lazy("kvfleet.control.fleet_cli", "add_status_parser", "status")
add_down_parser = _lazy("kvfleet.control.fleet_cli", "add_down_parser", "down")
add_operator_parser = _lazy("kvfleet.control.operator", "add_operator_parser", "operator")

#: subcommand registrars: each adds its parser (with ``func`` set) to the subparsers.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [
    add_serve_parser, add_bench_parser, add_router_parser, add_sim_engine_parser, add_render_parser,
    add_up_parser, add_status_parser, add_down_parser, add_operator_parser,
]


class ExampleHelpFormatter(_HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:data:`HelpFormatter` that keeps the line breaks of descriptions and epilogs (examples)."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level ``kvfleet`` parser with every subcommand in :data:`SUBCOMMANDS`."""
    from kvfleet import __version__

    parser = argparse.ArgumentParser(prog="kvfleet", description="kvfleet: LLM serving on a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"kvfleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfleet`` console script; returns the process exit status.

    argparse exits with status 2 on invalid flags (with a one-line error, no traceback).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
