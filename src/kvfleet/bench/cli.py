"""``kvfleet bench {serve,throughput,compare,plot}``: argparse parsers and handlers.

Registered in :data:`kvfleet.cli.SUBCOMMANDS` by :func:`add_bench_parser`. Bad flag values end
with argparse's one-line error and exit status 2; a server that cannot be reached or a bad
dataset file ends with ``kvfleet bench: error: ...`` and status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from typing import Any

from kvfleet.bench.datasets import DATASET_NAMES, DatasetError
from kvfleet.bench.metrics import parse_goodput, parse_percentiles
from kvfleet.cli import non_negative_int, positive_int

DEFAULT_TOKENIZER = "smollm2-135m-instruct"


class _Fmt(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults (unless the help already states one) and keeps description line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS) or action.nargs == 0:
            return text  # flags (store_true/false) and empty defaults read better without "(default: ...)"
        return super()._get_help_string(action) or text


# --------------------------------------------------------------------------- argparse types


_pos_int = positive_int
_nonneg_int = non_negative_int


def _rate(text: str) -> float:
    t = text.strip().lower()
    if t in ("inf", "infinity"):
        return math.inf
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a request rate in req/s (> 0) or 'inf', got {text!r}") from None
    if not v > 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"request rate must be > 0 req/s (or 'inf'), got {text!r}")
    return v


def _rates(text: str) -> list[float]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated request rates, e.g. 1,2,4,inf")
    return [_rate(p) for p in parts]


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return v


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        return parse_percentiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo(text: str) -> str:
    try:
        parse_goodput([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _engines(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [p.strip().lower() for p in text.split(",") if p.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"engines must be a comma-separated subset of {','.join(known)}, "
                                             f"got {text!r}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"an engine is listed twice in {text!r}")
        return names

    return parse


# --------------------------------------------------------------------------- shared flags


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset (all lengths in tokens)")
    g.add_argument("--dataset", choices=DATASET_NAMES, default="random",
                   help="random: random-token prompts; shared-prefix: T tenants x system prompt x Q questions; "
                        "multi-turn: conversations resending their history (chat endpoint); sharegpt: a JSON file")
    g.add_argument("--num-prompts", type=_pos_int, default=64, help="requests (random and sharegpt datasets)")
    g.add_argument("--input-len", type=_pos_int, default=128, help="random: mean prompt length")
    g.add_argument("--output-len", type=_pos_int, default=128,
                   help="tokens generated per request (random mean; shared-prefix and multi-turn per request)")
    g.add_argument("--range-ratio", type=_ratio, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--shared-prefix-tenants", type=_pos_int, default=4, help="shared-prefix: tenants T")
    g.add_argument("--shared-prefix-len", type=_pos_int, default=512, help="shared-prefix: system prompt length L")
    g.add_argument("--shared-prefix-questions", type=_pos_int, default=8, help="shared-prefix: questions per tenant Q")
    g.add_argument("--shared-prefix-question-len", type=_pos_int, default=32, help="shared-prefix: question length")
    g.add_argument("--multi-turn-conversations", type=_pos_int, default=8, help="multi-turn: conversations C")
    g.add_argument("--multi-turn-turns", type=_pos_int, default=4, help="multi-turn: turns per conversation K")
    g.add_argument("--multi-turn-user-len", type=_pos_int, default=64, help="multi-turn: user message length")
    g.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    g.add_argument("--sharegpt-output-len", type=_pos_int, default=None,
                   help="sharegpt: fixed output length (default: each reply's length)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrival gaps")
    g.add_argument("--tokenizer", default=None,
                   help=f"model whose tokenizer sizes the prompts (default: --model if it is a local model, "
                        f"else {DEFAULT_TOKENIZER})")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"), default="/v1/completions",
                   help="API route (multi-turn needs /v1/chat/completions)")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="arrivals per second, or 'inf' to send all at once")
    g.add_argument("--sweep", type=_rates, default=None, metavar="RATES",
                   help="comma-separated request rates (req/s, 'inf' allowed), one run each; overrides "
                        "--request-rate (default: one run at --request-rate)")
    g.add_argument("--burstiness", type=_pos_float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=_pos_int, default=None,
                   help="most requests in flight; with rate inf this is a closed loop (default: no cap)")
    g.add_argument("--reuse-prompts", action="store_true",
                   help="send the same prompts at every rate of a sweep (default: fresh prompts per run, so no "
                        "prefix cache sees a prompt twice)")
    g.add_argument("--num-warmups", type=_nonneg_int, default=2, help="unmeasured short requests sent first")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: send ignore_eos so each makes exactly its length)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--request-timeout", type=_pos_float, default=600.0, help="per-request timeout, seconds")
    g.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (keys ttft, tpot, e2el; milliseconds)")
    g.add_argument("--percentiles", type=_percentiles, default=(50.0, 90.0, 99.0),
                   help="comma-separated latency percentiles to report, default 50,90,99")


def _add_output_args(p: argparse.ArgumentParser, plot_help: str = "write PNG plots here (default: no plots)") -> None:
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None,
                   help="write the full result (every request's timeline) here (compare default: OUT_DIR/compare.json)")
    g.add_argument("--plot-dir", default=None, help=plot_help)
    g.add_argument("--plot-prefix", default="", help="file name prefix of the plots")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def _dataset_spec(args: argparse.Namespace):
    from kvfleet.bench.serve import DatasetSpec

    return DatasetSpec(
        name=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, tenants=args.shared_prefix_tenants, system_prompt_len=args.shared_prefix_len,
        questions=args.shared_prefix_questions, question_len=args.shared_prefix_question_len,
        conversations=args.multi_turn_conversations, turns=args.multi_turn_turns, user_len=args.multi_turn_user_len,
        path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len, seed=args.seed)


def _check_dataset_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """argparse errors for flag combinations; returns the error of a bad dataset file (None if fine)."""
    if args.dataset == "sharegpt" and not args.dataset_path:
        parser.error("--dataset sharegpt needs --dataset-path FILE.json")
    if args.dataset_path and args.dataset != "sharegpt":
        parser.error("--dataset-path is only used with --dataset sharegpt")
    if getattr(args, "endpoint", None) == "/v1/completions" and args.dataset == "multi-turn":
        parser.error("--dataset multi-turn resends chat history: use --endpoint /v1/chat/completions")
    try:
        _dataset_spec(args).make()  # a bad file fails here, before any tokenizer or server is loaded
    except DatasetError as e:
        return str(e)
    return None


class _RecordingParser(argparse.ArgumentParser):
    """Records the exact command line of a ``kvfleet bench`` subcommand in ``namespace._command``."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, rest = super().parse_known_args(args, namespace)
        words = list(sys.argv[1:] if args is None else args)
        ns._command = shlex.join([*self.prog.split(), *words])
        return ns, rest


def _command_line(args: argparse.Namespace) -> str:
    return getattr(args, "_command", None) or shlex.join(["kvfleet", *sys.argv[1:]])


def _tokenizer_for(args: argparse.Namespace, model: str | None):
    from kvfleet.bench.serve import load_tokenizer

    name = args.tokenizer
    if name is None:
        from kvfleet.model.registry import resolve_model_path

        name = DEFAULT_TOKENIZER
        if model:
            try:
                resolve_model_path(model)
                name = model
            except FileNotFoundError:
                pass
    return load_tokenizer(name)


def _fail(msg: str) -> int:
    print(f"kvfleet bench: error: {msg}", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- serve


def _run_serve(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    if (err := _check_dataset_args(parser, args)) is not None:
        return _fail(err)
    from kvfleet.bench.loadgen import EndpointConfig, ServerNotReadyError
    from kvfleet.bench.report import format_serve_table, write_json
    from kvfleet.bench.serve import ServeBenchConfig, run_serving_benchmark

    try:
        endpoint = EndpointConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model or "",
                                  api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
                                  request_timeout_s=args.request_timeout)
    except ValueError as e:
        parser.error(str(e))
    try:
        if not endpoint.model:
            endpoint.model = _served_model(endpoint, args.ready_timeout)
        tokenizer = _tokenizer_for(args, endpoint.model)
        cfg = ServeBenchConfig(
            endpoint=endpoint, dataset=_dataset_spec(args), request_rates=args.sweep or [args.request_rate],
            burstiness=args.burstiness, max_concurrency=args.max_concurrency, reuse_prompts=args.reuse_prompts,
            num_warmups=args.num_warmups, goodput_slos=parse_goodput(args.goodput), percentiles=args.percentiles,
            ready_timeout_s=args.ready_timeout, progress=args.progress, label=args.label or endpoint.model)
        result = run_serving_benchmark(cfg, tokenizer, command=_command_line(args))
    except (DatasetError, ServerNotReadyError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    print(format_serve_table(result))
    if args.result_json:
        print(f"result: {write_json(result, args.result_json)}", file=sys.stderr)
    if args.plot_dir:
        from kvfleet.bench.plots import make_plots

        try:
            for p in make_plots({cfg.label: result}, args.plot_dir, args.plot_prefix):
                print(f"plot: {p}", file=sys.stderr)
        except ValueError as e:
            return _fail(f"no plots: {e}")
    return 0 if all(r["metrics"]["completed"] for r in result["runs"]) else 1


def _served_model(endpoint: Any, ready_timeout: float) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        ServerNotReadyError: the server cannot be reached.
    """
    import asyncio

    import httpx

    from kvfleet.bench.loadgen import ServerNotReadyError, wait_until_ready

    if ready_timeout > 0:
        asyncio.run(wait_until_ready(endpoint.base_url, ready_timeout, api_key=endpoint.api_key))
    try:
        r = httpx.get(endpoint.base_url + "/v1/models", headers=endpoint.headers(), timeout=10)
        data = r.json().get("data") or []
        if r.status_code == 200 and data:
            return str(data[0]["id"])
        raise ServerNotReadyError(f"{endpoint.base_url}/v1/models answered {r.status_code} without a model; "
                                  "pass --model")
    except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
        raise ServerNotReadyError(f"cannot list models at {endpoint.base_url}/v1/models ({e}); is the server up? "
                                  "(pass --model to skip the lookup)") from None


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput, goodput)",
        formatter_class=_Fmt,
        description="Stream a workload to any OpenAI-compatible server (kvfleet, vLLM, llama.cpp, a router) and "
                    "report per-request TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request and "
                    "token throughput, goodput under SLOs, and errors.\n\n"
                    "example:\n  kvfleet bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 "
                    "--input-len 128 --output-len 64 --sweep 1,2,4 --result-json r.json --plot-dir plots")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    g.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token (default: none)")
    g.add_argument("--ready-timeout", type=float, default=0.0,
                   help="seconds to wait for the server to answer /v1/models first (0 = do not wait)")
    g.add_argument("--label", default=None, help="name of this server in tables and plots (default: the model)")
    _add_dataset_args(p)
    _add_load_args(p)
    _add_output_args(p)
    p.set_defaults(func=_run_serve, _parser=p)


# --------------------------------------------------------------------------- throughput


def _run_throughput(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    if (err := _check_dataset_args(parser, args)) is not None:
        return _fail(err)
    from kvfleet.bench.report import format_throughput_table, write_json
    from kvfleet.bench.throughput import ThroughputConfig, run_throughput

    try:
        cfg = ThroughputConfig(model=args.model, engines=tuple(args.engines), dataset=_dataset_spec(args),
                               dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens, hf_batch_size=args.hf_batch_size,
                               quantization=args.quantization)
        tokenizer = _tokenizer_for(args, args.model)
        result = run_throughput(cfg, tokenizer, command=_command_line(args))
    except (DatasetError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    print(format_throughput_table(result))
    if args.result_json:
        print(f"result: {write_json(result, args.result_json)}", file=sys.stderr)
    return 0


def _add_throughput(sub: argparse._SubParsersAction) -> None:
    from kvfleet.bench.throughput import THROUGHPUT_ENGINES

    p = sub.add_parser(
        "throughput", help="offline generation throughput (no HTTP): kvfleet LLM vs transformers generate",
        formatter_class=_Fmt,
        description="Generate the dataset's requests offline (every request queued at once) and report requests/s "
                    "and output and total tokens/s of the generation wall time. Each request makes exactly its "
                    "output length (ignore_eos, greedy).\n\n"
                    "example:\n  kvfleet bench throughput --engines kvfleet,hf --num-prompts 64 --input-len 128 "
                    "--output-len 128")
    p.add_argument("--model", default=DEFAULT_TOKENIZER, help="GGUF file, HF folder or packaged short name")
    p.add_argument("--engines", type=_engines(THROUGHPUT_ENGINES), default=["kvfleet"],
                   help="comma-separated: kvfleet (LLM.generate), hf (transformers generate, static batches)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--num-threads", type=_pos_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-num-seqs", type=_pos_int, default=64, help="kvfleet: most running requests per step")
    p.add_argument("--max-num-batched-tokens", type=_pos_int, default=2048, help="kvfleet: tokens per step")
    p.add_argument("--hf-batch-size", type=_pos_int, default=16, help="hf: static batch size")
    p.add_argument("--quantization", choices=("none", "int8"), default="none",
                   help="kvfleet: int8 = W8A8 dynamic int8 projections and LM head (needs --dtype float32)")
    _add_dataset_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--result-json", default=None, help="write the result here")
    p.set_defaults(func=_run_throughput, _parser=p)


# --------------------------------------------------------------------------- compare


def _engine_args(items: list[str] | None, parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    from kvfleet.bench.compare import COMPARE_ENGINES

    out: dict[str, list[str]] = {}
    for item in items or []:
        name, sep, rest = item.partition("=")
        if not sep or name not in COMPARE_ENGINES:
            parser.error(f"--engine-args {item!r} must be ENGINE='ARGS' with ENGINE in {','.join(COMPARE_ENGINES)}")
        out.setdefault(name, []).extend(shlex.split(rest))
    return out


def _serve_cfg(args: argparse.Namespace):
    from kvfleet.bench.loadgen import EndpointConfig
    from kvfleet.bench.serve import ServeBenchConfig

    return ServeBenchConfig(
        endpoint=EndpointConfig(base_url="http://127.0.0.1:1", endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                                temperature=args.temperature, request_timeout_s=args.request_timeout),
        dataset=_dataset_spec(args), request_rates=args.sweep or [args.request_rate], burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, reuse_prompts=args.reuse_prompts, num_warmups=args.num_warmups,
        goodput_slos=parse_goodput(args.goodput), percentiles=args.percentiles, progress=args.progress)


def _scenarios(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``{name: ServeBenchConfig}``: the command's own workload, or one per ``--scenario NAME=FLAGS``
    (the command's flags with FLAGS appended, so FLAGS override them)."""
    if not args.scenario:
        if (err := _check_dataset_args(parser, args)) is not None:
            parser.error(err)
        return {"default": _serve_cfg(args)}
    base = shlex.split(args._command)[len(parser.prog.split()):]
    out: dict[str, Any] = {}
    for item in args.scenario:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            parser.error(f"--scenario {item!r} must be NAME='FLAGS' with a NAME of letters, digits, - and _")
        if name in out:
            parser.error(f"--scenario {name!r} given twice")
        words = shlex.split(flags)
        if any(w.startswith(("--scenario", "--engines", "--model", "--out-dir")) for w in words):
            parser.error(f"--scenario {name}: FLAGS may set workload and load flags only")
        sub = parser.parse_args([*base, *words])
        if (err := _check_dataset_args(parser, sub)) is not None:
            parser.error(f"--scenario {name}: {err}")
        out[name] = _serve_cfg(sub)
    return out


def _run_compare(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    extra = _engine_args(args.engine_args, parser)
    scenarios = _scenarios(args, parser)
    from kvfleet.bench.compare import run_compare
    from kvfleet.bench.plots import make_plots
    from kvfleet.bench.report import format_compare_table, write_json

    try:
        tokenizer = _tokenizer_for(args, args.model)
        threads = args.threads or os.cpu_count() or 1
        result = run_compare(args.engines, args.model, scenarios, tokenizer, args.out_dir, threads=threads,
                             max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                             peers_dir=args.peers_dir, dtype=args.dtype, startup_timeout_s=args.startup_timeout,
                             extra_args=extra, command=_command_line(args))
    except (DatasetError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    tables = {}
    for scen, by_engine in result["scenarios"].items():
        tables[scen] = format_compare_table(by_engine, baseline=args.engines[0])
        if len(scenarios) > 1:
            print(f"\n== scenario {scen}")
        print(tables[scen])
    result["tables"] = tables
    print()
    for name, info in result["engines"].items():
        line = f"{name}: precision {info.get('precision', '?')}, {info.get('threads', '?')} threads"
        if "error" in info:
            line += f"; NOT RUN: {info['error'].splitlines()[0]}"
        else:
            line += f", startup {info.get('startup_s')} s, load average before {info.get('load_average_before')}"
        print(line)
    json_path = args.result_json or os.path.join(args.out_dir, "compare.json")
    print(f"result: {write_json(result, json_path)}", file=sys.stderr)
    ran_any = False
    for scen, by_engine in result["scenarios"].items():
        ran = {k: v for k, v in by_engine.items() if v.get("runs")}
        if not ran:
            continue
        ran_any = True
        prefix = args.plot_prefix + (f"{scen}_" if len(scenarios) > 1 else "")
        try:
            for p in make_plots(ran, args.plot_dir or args.out_dir, prefix):
                print(f"plot: {p}", file=sys.stderr)
        except ValueError as e:
            print(f"kvfleet bench: no plots for {scen}: {e}", file=sys.stderr)
    return 0 if ran_any else 1


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from kvfleet.bench.compare import COMPARE_ENGINES

    p = sub.add_parser(
        "compare", help="run the same serving workload against kvfleet, vLLM, llama.cpp and transformers in turn",
        formatter_class=_Fmt,
        description="Start each engine as a server on 127.0.0.1 on the same model (one at a time), run the workload "
                    "against it, stop it; then print one table with ratios to the first engine and write one JSON "
                    "file and one set of plots. Peers come from benchmarks/peers/setup.sh (their own venvs and "
                    "binaries under --peers-dir); a missing peer is reported and skipped.\n\n"
                    "example:\n  kvfleet bench compare --engines kvfleet,vllm,llamacpp --num-prompts 32 "
                    "--input-len 128 --output-len 64 --sweep 1,4,inf --out-dir bench-out")
    p.add_argument("--engines", type=_engines(COMPARE_ENGINES), default=["kvfleet", "vllm", "llamacpp"],
                   help="comma-separated, run in this order; the first is the ratio baseline "
                        f"(known: {','.join(COMPARE_ENGINES)}; default: kvfleet,vllm,llamacpp)")
    p.add_argument("--model", default=DEFAULT_TOKENIZER, help="GGUF file or packaged short name")
    p.add_argument("--threads", type=_pos_int, default=None, help="CPU threads of every engine (default: all cores)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="kvfleet's, vLLM's and transformers' dtype (llama.cpp runs the GGUF's Q4_1)")
    p.add_argument("--max-num-seqs", type=_pos_int, default=64,
                   help="most running requests of every engine (llama.cpp: slots)")
    p.add_argument("--max-model-len", type=_pos_int, default=2048, help="context per request, tokens")
    p.add_argument("--peers-dir", default=None,
                   help="where benchmarks/peers/setup.sh put the peers (default: $KVFLEET_PEERS_DIR or "
                        "~/.cache/kvfleet/peers)")
    p.add_argument("--startup-timeout", type=_pos_float, default=900.0,
                   help="seconds to wait for each server (vLLM compiles its model on first start: minutes)")
    p.add_argument("--engine-args", action="append", default=None, metavar="ENGINE=ARGS",
                   help="extra command-line arguments of one engine, e.g. --engine-args \"llamacpp=-fa on\" "
                        "(repeatable)")
    p.add_argument("--scenario", action="append", default=None, metavar="NAME=FLAGS",
                   help="a named workload: the command's workload and load flags with FLAGS appended, e.g. "
                        "--scenario \"b1=--max-concurrency 1 --output-len 64\"; repeatable; each engine starts "
                        "once and runs every scenario (default: one scenario from the command's flags)")
    p.add_argument("--out-dir", default="bench-out", help="JSON, server logs and plots go here")
    _add_dataset_args(p)
    _add_load_args(p)
    _add_output_args(p, plot_help="write PNG plots here (default: --out-dir)")
    p.set_defaults(func=_run_compare, _parser=p)


# --------------------------------------------------------------------------- plot


def _run_plot(args: argparse.Namespace) -> int:
    import json

    from kvfleet.bench.plots import make_plots

    results: dict[str, Any] = {}
    scenarios: dict[str, dict[str, Any]] = {}  # compare files, merged by scenario name
    for path in args.results:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            return _fail(f"cannot read result {path}: {e}")
        if not isinstance(data, dict):
            return _fail(f"{path} is not a `kvfleet bench serve` or `bench compare` result")
        if data.get("kind") == "compare":
            for scen, by_engine in data.get("scenarios", {}).items():
                scenarios.setdefault(scen, {}).update({k: v for k, v in by_engine.items() if v.get("runs")})
        elif data.get("kind") == "serve":
            results[data.get("label") or path] = data
        else:
            return _fail(f"{path} is not a `kvfleet bench serve` or `bench compare` result")
    jobs = [(args.plot_prefix, results)] if results else []
    jobs += [(f"{args.plot_prefix}{scen}_", ran) for scen, ran in scenarios.items() if ran]
    try:
        for prefix, res in jobs:
            for p in make_plots(res, args.plot_dir, prefix):
                print(f"plot: {p}", file=sys.stderr)
    except ValueError as e:
        return _fail(str(e))
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw the plots of saved serve / compare result files", formatter_class=_Fmt,
                       description="Read JSON results of `bench serve` or `bench compare` and draw latency CDFs, "
                                   "latency against rate and throughput against rate into --plot-dir. Compare "
                                   "results are merged by scenario (one set of plots per scenario, engines from "
                                   "all files together).")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--plot-dir", default="bench-plots", help="output folder")
    p.add_argument("--plot-prefix", default="", help="file name prefix")
    p.set_defaults(func=_run_plot, _parser=p)


# --------------------------------------------------------------------------- registration


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet bench`` and its subcommands ``serve``, ``throughput``, ``compare``, ``plot``."""
    p = sub.add_parser("bench", help="benchmarks: serving load tests, offline throughput, peers side by side",
                       description="Benchmarks of kvfleet and other OpenAI-compatible servers.")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", title="bench commands",
                            parser_class=_RecordingParser)
    for add in (_add_serve, _add_throughput, _add_compare, _add_plot):
        add(bsub)
    for child in bsub.choices.values():
        child.set_defaults(log_level="warning")  # no per-request httpx log lines
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1], _parser=p, log_level="warning")
    return p
