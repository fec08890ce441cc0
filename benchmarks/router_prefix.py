"""Prefix-aware routing against round-robin on a multi-tenant shared-prefix workload.

For each routing policy: start the engines (simulated engines in-process, fresh caches per
policy; or real `kvfleet serve` replicas, started once, with fresh system prompts per policy so
no policy inherits another's cache), put a `kvfleet router` app with that policy in front, and
run `kvfleet bench serve`'s shared-prefix workload (T tenants, each with its own L-token system
prompt, Q questions each, Poisson arrivals) against the router. Reports TTFT p50 / p99, the
engines' prefix-cache hit rate (from their `/metrics`), and the load per replica (requests the
router sent to each; max / mean).

    python benchmarks/router_prefix.py --engines sim --num-engines 64 --request-rate 20
    python benchmarks/router_prefix.py --engines real --num-engines 3 --request-rate 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvfleet.bench.compare import free_port, scrape_prefix_cache_counters, stop_engine
from kvfleet.bench.loadgen import EndpointConfig, wait_until_ready
from kvfleet.bench.serve import DatasetSpec, ServeBenchConfig, load_tokenizer, run_serving_benchmark
from kvfleet.router.scorers import PROFILES

MODEL = "smollm2-135m-instruct"


def start_process(args: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "kvfleet", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


class Router:
    """`kvfleet router` as a subprocess (its own CPU time, like a real deployment)."""

    def __init__(self, urls: list[str], policy: str, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        bound = args.load_bound_factor if policy != "round-robin" else 0
        self.proc = start_process(["router", "--endpoints", ",".join(urls), "--policy", policy, "--port",
                                   str(self.port), "--scrape-interval", str(args.scrape_interval),
                                   "--load-bound-factor", str(bound), "--seed", "0", "--log-level", "warning"], log)

    def __enter__(self) -> Router:
        asyncio.run(wait_until_ready(self.url, timeout_s=120, proc=self.proc))
        return self

    def __exit__(self, *exc: object) -> None:
        stop_engine(self.proc)


class SimEngines:
    """`kvfleet sim-engine --num-engines N` as one subprocess on ports the OS picks."""

    def __init__(self, n: int, time_scale: float, log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.n = n
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "sim-engine", "--port", "0", "--num-engines", str(n), "--model", MODEL,
             "--time-scale", str(time_scale), "--log-level", "warning", "--print-urls"],
            stdout=subprocess.PIPE, stderr=open(log, "wb"), stdin=subprocess.DEVNULL, start_new_session=True,
            text=True)
        self.urls: list[str] = []

    def __enter__(self) -> SimEngines:
        assert self.proc.stdout is not None
        while len(self.urls) < self.n:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvfleet sim-engine exited with status {self.proc.wait()}")
            self.urls.append(line.strip())
        return self

    def __exit__(self, *exc: object) -> None:
        stop_engine(self.proc)


class RealReplicas:
    """`kvfleet serve` subprocesses, one compute thread each."""

    def __init__(self, n: int, log_dir: Path, extra: list[str]) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs = [start_process(["serve", MODEL, "--host", "127.0.0.1", "--port", str(p), "--num-threads", "1",
                                     "--log-level", "warning", *extra], log_dir / f"replica{i}.log")
                      for i, p in enumerate(self.ports)]

    def __enter__(self) -> RealReplicas:
        for u, p in zip(self.urls, self.procs, strict=True):
            asyncio.run(wait_until_ready(u, timeout_s=900, proc=p))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            stop_engine(p)


def cache_counters(urls: list[str]) -> dict[str, float]:
    tot = {"queries": 0.0, "hits": 0.0}
    for u in urls:
        c = scrape_prefix_cache_counters(u) or {"queries": 0.0, "hits": 0.0}
        for k in tot:
            tot[k] += c[k]
    return tot


def router_requests(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name == "kvfleet_router_requests":
            out.update({s.labels["endpoint"]: s.value for s in fam.samples if s.name.endswith("_total")})
    return out


def run_policy(policy: str, urls: list[str], args: argparse.Namespace, tokenizer: Any, seed: int,
               model: str) -> dict[str, Any]:
    before = cache_counters(urls)
    with Router(urls, policy, args, Path(args.out).with_suffix(".logs") / f"router-{policy}.log") as router:
        cfg = ServeBenchConfig(
            endpoint=EndpointConfig(base_url=router.url, model=model),
            dataset=DatasetSpec(name="shared-prefix", tenants=args.tenants, system_prompt_len=args.system_prompt_len,
                                questions=args.questions, question_len=args.question_len,
                                output_len=args.output_len, seed=seed),
            request_rates=[args.request_rate], num_warmups=0, progress=False, keep_requests=False, label=policy)
        res = run_serving_benchmark(cfg, tokenizer, command=" ".join(sys.argv))
        per_ep = router_requests(router.url)
    after = cache_counters(urls)
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    loads = [per_ep.get(u, 0.0) for u in urls]
    mean = statistics.mean(loads)
    m = res["runs"][0]["metrics"]
    return {"policy": policy, "scorers": PROFILES[policy], "metrics": m,
            "load_bound_factor": args.load_bound_factor if policy != "round-robin" else None,
            "prefix_hit_rate": h / q if q else None,
            "requests_per_endpoint": loads, "max_over_mean_load": max(loads) / mean if mean else None,
            "endpoints_used": sum(1 for x in loads if x > 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", choices=("sim", "real"), default="sim")
    ap.add_argument("--num-engines", type=int, default=64)
    ap.add_argument("--policies", default="round-robin,default", help="comma-separated profile names")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=16, help="questions per tenant")
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=20.0)
    ap.add_argument("--scrape-interval", type=float, default=0.25)
    ap.add_argument("--load-bound-factor", type=float, default=1.5,
                    help="bounded-load filter of the non-round-robin policies (0 = off), as `kvfleet router`")
    ap.add_argument("--time-scale", type=float, default=1.0, help="simulated engines: factor on modelled time")
    ap.add_argument("--engine-args", default="--max-model-len 2048",
                    help="real engines: extra `kvfleet serve` flags")
    ap.add_argument("--out", default="bench-router.json")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in PROFILES:
            ap.error(f"unknown policy {p!r} (known: {', '.join(PROFILES)})")
    tokenizer = load_tokenizer(MODEL)
    results = []
    t0 = time.time()
    if args.engines == "sim":
        for i, policy in enumerate(policies):  # fresh engines (empty caches) per policy
            log = Path(args.out).with_suffix(".logs") / f"sim-{policy}.log"
            with SimEngines(args.num_engines, args.time_scale, log) as f:
                results.append(run_policy(policy, f.urls, args, tokenizer, seed=1000 + i, model=MODEL))
    else:
        with RealReplicas(args.num_engines, Path(args.out).with_suffix(".logs"), args.engine_args.split()) as r:
            for i, policy in enumerate(policies):
                results.append(run_policy(policy, r.urls, args, tokenizer, seed=1000 + i, model=MODEL))
    print(f"\n{args.engines} engines x {args.num_engines}, {args.tenants} tenants x {args.system_prompt_len}-token "
          f"system prompt x {args.questions} questions of {args.question_len} -> {args.output_len} tokens, "
          f"Poisson {args.request_rate:g} req/s ({time.time() - t0:.0f} s)")
    head = f"{'policy':<12} {'ok':>5} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'E2E p50 ms':>11} " \
           f"{'out tok/s':>10} {'hit %':>6} {'max/mean load':>14} {'endpoints used':>15}"
    print(head)
    for r in results:
        m = r["metrics"]
        hit = "-" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}"
        print(f"{r['policy']:<12} {m['completed']:>5} {m['p50_ttft_ms']:>12,.0f} {m['p99_ttft_ms']:>12,.0f} "
              f"{m['p50_e2el_ms']:>11,.0f} {m['output_throughput_tok_s']:>10.1f} {hit:>6} "
              f"{r['max_over_mean_load']:>14.2f} {r['endpoints_used']:>15}")
    base = next((r for r in results if r["policy"] == "round-robin"), None)
    if base:
        for r in results:
            if r is not base and r["metrics"]["p50_ttft_ms"]:
                print(f"TTFT p50 round-robin / {r['policy']}: "
                      f"{base['metrics']['p50_ttft_ms'] / r['metrics']['p50_ttft_ms']:.2f}x")
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                          "args": vars(args), "results": results},
                                         indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o)
                                         else str(o)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
