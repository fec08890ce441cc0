"""``kvfleet router``: command-line front end of the router."""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path
from typing import Any

import yaml

from kvfleet.router.app import RouterConfig, create_router_app
from kvfleet.router.discovery import Discovery, FileDiscovery, KubernetesDiscovery, StaticDiscovery
from kvfleet.router.filters import LoadBoundFilter
from kvfleet.router.picker import EndpointPicker, parse_weighted
from kvfleet.router.scorers import PROFILES, SCORERS, build_scorer

logger = logging.getLogger(__name__)

EXAMPLES = """examples:
  kvfleet router --endpoints http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8000
  kvfleet router --endpoints-file endpoints.yaml --policy round-robin
  kvfleet router --endpoints-file endpoints.yaml --scorer prefix:3 --scorer queue:2 --scorer kv-usage:2
  kvfleet router --k8s-selector app=kvfleet-engine --k8s-namespace llm --k8s-port 8000
  kvfleet router --prefill-endpoints http://127.0.0.1:8001 --decode-endpoints http://127.0.0.1:8002,http://127.0.0.1:8003
  kvfleet router --k8s-prefill-selector app=llm,role=prefill --k8s-decode-selector app=llm,role=decode

config file (--config, YAML; flags given on the command line win):
  policy: default            # or scorers:
  scorers: {prefix: 3, queue: 2, kv-usage: 2}
  endpoints: [http://127.0.0.1:8001, http://127.0.0.1:8002]
  session_header: x-session-id
  load_bound_factor: 1.5
  prefill_endpoints: [http://127.0.0.1:8003]   # a P/D split; 'endpoints' are then the decode pool

prefill/decode split: with a prefill source (--prefill-endpoints, --prefill-endpoints-file or
--k8s-prefill-selector) every request is first sent to a prefill endpoint with max_tokens 1, then
to a decode endpoint with kv_transfer_params naming the prefill endpoint (a kvfleet engine pulls
the prompt's KV from there). The decode pool is given by the --decode-* flags or the plain
endpoint flags.
"""


def add_router_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet router``."""
    from kvfleet.cli import (
        HelpFormatter,
        non_negative_float,
        non_negative_int,
        port_number,
        positive_float,
        positive_int,
    )

    p = sub.add_parser(
        "router", help="KV-cache-aware OpenAI-compatible router in front of engine replicas",
        description="An OpenAI-compatible proxy (chat, completions, models; streams passed through chunk by chunk) "
                    "that picks an engine replica per request: filters (healthy, not saturated), then scorers "
                    "(each 0..1) summed with weights, and the highest total wins (random tie-break), as in "
                    "llm-d's endpoint picker. Engines may be kvfleet, vLLM or SGLang servers.",
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    g = p.add_argument_group("endpoints (give at least one source)")
    g.add_argument("--endpoints", action="append", default=[], metavar="URL[,URL...]",
                   help="engine base URLs (repeatable)")
    g.add_argument("--endpoints-file", default=None, metavar="PATH",
                   help="YAML/JSON list (or one URL per line), re-read when it changes")
    g.add_argument("--k8s-selector", default=None, metavar="LABELS",
                   help="discover Kubernetes pods (or EndpointSlices) with these labels, e.g. app=engine")
    g.add_argument("--k8s-namespace", default="default", help="namespace for --k8s-selector")
    g.add_argument("--k8s-port", type=port_number, default=8000, help="engine port of discovered pods")
    g.add_argument("--k8s-kind", choices=("pods", "endpointslices"), default="pods", help="what to discover")
    g = p.add_argument_group("prefill/decode split (P/D disaggregation)")
    g.add_argument("--prefill-endpoints", action="append", default=[], metavar="URL[,URL...]",
                   help="prefill engine base URLs (repeatable): turns on the P/D split")
    g.add_argument("--prefill-endpoints-file", default=None, metavar="PATH",
                   help="prefill engines in a file like --endpoints-file (re-read when it changes)")
    g.add_argument("--k8s-prefill-selector", default=None, metavar="LABELS",
                   help="discover the prefill pods by label (namespace, port, kind as for --k8s-selector)")
    g.add_argument("--decode-endpoints", action="append", default=[], metavar="URL[,URL...]",
                   help="decode engine base URLs (or give the decode pool with the plain endpoint flags)")
    g.add_argument("--decode-endpoints-file", default=None, metavar="PATH", help="decode engines in a file")
    g.add_argument("--k8s-decode-selector", default=None, metavar="LABELS", help="discover the decode pods by label")
    g.add_argument("--pd-fallback", choices=("decode", "error"), default="decode",
                   help="when no prefill endpoint can serve a request: send it whole to a decode endpoint "
                        "(it computes the prompt itself), or answer the error")
    g = p.add_argument_group("routing")
    g.add_argument("--config", default=None, metavar="YAML", help="router config file (see below)")
    g.add_argument("--policy", choices=sorted(PROFILES), default=None,
                   help="a named profile: " + "; ".join(f"{k} = {', '.join(f'{n}:{w:g}' for n, w in v.items())}"
                                                        for k, v in PROFILES.items()) + " (default: default)")
    g.add_argument("--scorer", action="append", default=[], metavar="NAME[:WEIGHT]",
                   help=f"a scorer and its weight (repeatable; replaces --policy); known: {', '.join(SCORERS)}")
    g.add_argument("--session-header", default=None, help="session affinity header (default: x-session-id)")
    g.add_argument("--prefix-block-size", type=positive_int, default=None,
                   help="prefix scorer block: tokens with --tokenizer, else characters (default: 16 tokens / 64 chars)")
    g.add_argument("--prefix-index-capacity", type=positive_int, default=16384,
                   help="block hashes remembered per endpoint (bounds the router's memory)")
    g.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer the prefix scorer uses (GGUF, HF folder or packaged name); "
                        "without it prompts are hashed by characters")
    g.add_argument("--load-bound-factor", type=non_negative_float, default=None,
                   help="bounded-load filter: an endpoint stays a candidate while its in-flight requests stay "
                        "within this multiple of the mean (consistent hashing with bounded loads); 0 = off; "
                        "not applied with --policy round-robin (default: 1.5)")
    g.add_argument("--seed", type=int, default=None, help="seed of the random tie-break")
    g = p.add_argument_group("resilience and load")
    g.add_argument("--max-retries", type=non_negative_int, default=2,
                   help="re-sends of a request that failed before its first byte, each to another endpoint")
    g.add_argument("--max-inflight-per-endpoint", type=positive_int, default=256,
                   help="requests in flight after which an endpoint is saturated")
    g.add_argument("--max-queued-requests", type=non_negative_int, default=1024,
                   help="requests that may wait while every endpoint is saturated (then 429)")
    g.add_argument("--queue-timeout", type=positive_float, default=30.0,
                   help="seconds a queued request waits (then 429)")
    g.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds to wait for each response byte from an engine")
    g.add_argument("--hold-when-empty", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="with no healthy endpoint, hold requests this long for one to appear instead of an "
                        "immediate 503 (scale from zero; 0 = off)")
    g.add_argument("--health-interval", type=positive_float, default=2.0, help="seconds between /health checks")
    g.add_argument("--scrape-interval", type=positive_float, default=0.25, help="seconds between /metrics scrapes")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address")
    g.add_argument("--port", type=port_number, default=8000, help="bind port")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run_router)
    return p


def _load_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping at the top level")
    known = {"policy", "scorers", "endpoints", "session_header", "prefix_block_size", "prefix_index_capacity",
             "load_bound_factor", "prefill_endpoints"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    return data


def scorer_weights(args: argparse.Namespace, cfg: dict[str, Any]) -> tuple[str, list[tuple[str, float]]]:
    """The policy name and ``(scorer, weight)`` list from flags, then the config file, then the
    default profile.

    Raises:
        ValueError: an unknown policy or scorer, or a malformed weight.
    """
    if args.scorer:
        return "custom", [parse_weighted(s) for s in args.scorer]
    policy = args.policy or cfg.get("policy")
    if policy is None and cfg.get("scorers") is not None:
        sc = cfg["scorers"]
        if isinstance(sc, dict):
            return "custom", [parse_weighted(f"{k}:{v}") for k, v in sc.items()]
        if isinstance(sc, list):
            return "custom", [parse_weighted(s if isinstance(s, str) else f"{s.get('name')}:{s.get('weight', 1)}")
                              for s in sc]
        raise ValueError("config 'scorers' must be a mapping {name: weight} or a list")
    policy = policy or "default"
    if policy not in PROFILES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(sorted(PROFILES))})")
    return policy, list(PROFILES[policy].items())


def _source(args: argparse.Namespace, urls_flag: list[str], file: str | None, selector: str | None,
            cfg_urls: Any, names: str) -> Discovery | None:
    """One endpoint source from its three flags (or URLs from the config file); None when none
    is given.

    Raises:
        ValueError: more than one of the flags, or a bad URL / file.
    """
    urls = [u for spec in urls_flag for u in spec.split(",") if u.strip()]
    if sum(bool(x) for x in (urls, file, selector)) > 1:
        raise ValueError(f"give one endpoint source: {names}")
    if file:
        return FileDiscovery(file)
    if selector:
        return KubernetesDiscovery(selector, args.k8s_namespace, args.k8s_port, args.k8s_kind)
    urls = urls or [str(u) for u in cfg_urls or []]
    return StaticDiscovery(urls) if urls else None


def build_discovery(args: argparse.Namespace, cfg: dict[str, Any]) -> Discovery:
    """The endpoint source from the flags (or the config's ``endpoints``): the decode pool's
    with a P/D split (``--decode-*`` flags, or the plain ones).

    Raises:
        ValueError: no source, more than one, or a bad URL / file.
    """
    decode = _source(args, getattr(args, "decode_endpoints", []), getattr(args, "decode_endpoints_file", None),
                     getattr(args, "k8s_decode_selector", None), None,
                     "--decode-endpoints, --decode-endpoints-file or --k8s-decode-selector")
    plain = _source(args, args.endpoints, args.endpoints_file, args.k8s_selector,
                    None if decode is not None else cfg.get("endpoints"),
                    "--endpoints, --endpoints-file or --k8s-selector")
    if decode is not None and plain is not None:
        raise ValueError("give the decode pool once: --decode-* flags or the plain endpoint flags, not both")
    has_prefill = any((getattr(args, "prefill_endpoints", []), getattr(args, "prefill_endpoints_file", None),
                       getattr(args, "k8s_prefill_selector", None), cfg.get("prefill_endpoints")))
    if decode is not None and not has_prefill:
        raise ValueError("--decode-endpoints / --decode-endpoints-file / --k8s-decode-selector need a prefill pool "
                         "(--prefill-endpoints, --prefill-endpoints-file or --k8s-prefill-selector)")
    found = decode or plain
    if found is None:
        raise ValueError("no endpoints: give --endpoints, --endpoints-file, --k8s-selector or 'endpoints' in --config")
    return found


def build_prefill_discovery(args: argparse.Namespace, cfg: dict[str, Any]) -> Discovery | None:
    """The prefill pool's source (``--prefill-*`` flags or the config's ``prefill_endpoints``);
    None without a P/D split.

    Raises:
        ValueError: more than one prefill source, or a bad URL / file.
    """
    return _source(args, getattr(args, "prefill_endpoints", []), getattr(args, "prefill_endpoints_file", None),
                   getattr(args, "k8s_prefill_selector", None), cfg.get("prefill_endpoints"),
                   "--prefill-endpoints, --prefill-endpoints-file or --k8s-prefill-selector")


def build_router(args: argparse.Namespace):
    """``(app, policy, weights)`` from parsed ``kvfleet router`` arguments.

    Raises:
        ValueError: bad flags or config (a clear message, no traceback at the CLI).
        FileNotFoundError: the ``--tokenizer`` model cannot be found.
    """
    cfg = _load_config(args.config)
    policy, weights = scorer_weights(args, cfg)
    tokenizer = None
    if args.tokenizer:
        from kvfleet.bench.serve import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    block = args.prefix_block_size or cfg.get("prefix_block_size") or (16 if tokenizer is not None else 64)
    opts = dict(session_header=args.session_header or cfg.get("session_header") or "x-session-id",
                prefix_block_size=int(block),
                prefix_capacity=int(cfg.get("prefix_index_capacity") or args.prefix_index_capacity),
                tokenizer=tokenizer)
    factor = args.load_bound_factor
    if factor is None:
        factor = float(cfg.get("load_bound_factor", 1.5))
    if factor and factor <= 1:
        raise ValueError(f"--load-bound-factor must be 0 (off) or > 1, got {factor:g}")
    rng = random.Random(args.seed)

    def new_picker() -> EndpointPicker:
        filters = [LoadBoundFilter(factor)] if factor and policy != "round-robin" else []
        return EndpointPicker([(build_scorer(name, **opts), w) for name, w in weights], rng=rng, filters=filters)

    picker = new_picker()
    discovery = build_discovery(args, cfg)
    prefill_source = build_prefill_discovery(args, cfg)
    config = RouterConfig(policy=policy, max_retries=args.max_retries,
                          max_inflight_per_endpoint=args.max_inflight_per_endpoint,
                          max_queued_requests=args.max_queued_requests, queue_timeout_s=args.queue_timeout,
                          request_timeout_s=args.request_timeout, hold_when_empty_s=args.hold_when_empty)
    prefill = None
    pd = None
    if prefill_source is not None:
        from kvfleet.router.pd import PDConfig

        prefill = (prefill_source, new_picker())  # the prefill pool's own prefix index and load view
        pd = PDConfig(fallback=getattr(args, "pd_fallback", "decode"))
    app = create_router_app(discovery, picker, config, {"health_interval_s": args.health_interval,
                                                        "scrape_interval_s": args.scrape_interval},
                            prefill=prefill, pd=pd)
    return app, policy, weights


def run_router(args: argparse.Namespace) -> int:
    """``kvfleet router``: build the router and serve it with uvicorn until interrupted."""
    import sys

    import uvicorn

    try:
        app, policy, weights = build_router(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvfleet router: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # e.g. no kubeconfig for --k8s-selector
        print(f"kvfleet router: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    logger.info("router policy %s: %s; serving at http://%s:%d", policy,
                ", ".join(f"{n}:{w:g}" for n, w in weights), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
