"""``kvfleet status``: a local fleet's pools and replicas from its ``state.json``, with each
replica's health, running / waiting requests, KV cache usage and prefix-cache hit rate read live
from its ``/health`` and ``/metrics``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvfleet.control.local.probe import parse_engine_sample
from kvfleet.control.local.state import pid_alive


def _probe(url: str | None, timeout: float, health_path: str = "/health",
           metrics_path: str = "/metrics") -> dict[str, Any]:
    out: dict[str, Any] = {"health": "-", "running": None, "waiting": None, "kv_usage": None, "hit_rate": None,
                           "kv_exported_blocks": None, "kv_imported_blocks": None, "kv_transfer_fallbacks": None}
    if not url:
        return out
    with httpx.Client(trust_env=False, timeout=timeout) as c:
        try:
            out["health"] = "ok" if c.get(url + health_path).status_code == 200 else "failing"
        except httpx.HTTPError:
            out["health"] = "down"
            return out
        try:
            r = c.get(url + metrics_path)
            s = parse_engine_sample(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            s = None
    if s is not None:
        out.update(running=s.running, waiting=s.waiting, kv_usage=s.kv_usage, hit_rate=s.hit_rate,
                   kv_exported_blocks=s.kv_exported_blocks, kv_imported_blocks=s.kv_imported_blocks,
                   kv_transfer_fallbacks=s.kv_transfer_fallbacks)
    return out


def live_status(state: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    """``state`` (a fleet's ``state.json``) with live fields added: ``supervisor.alive``,
    ``router.health`` (``ok`` / ``no replica`` / ``down``) and, per replica, ``health``,
    ``running``, ``waiting``, ``kv_usage`` (fraction), ``hit_rate`` (fraction of queried prompt
    tokens found in the prefix cache, since the replica started) and the P/D KV transfer counters
    ``kv_exported_blocks``, ``kv_imported_blocks``, ``kv_transfer_fallbacks`` (None when the
    engine does not export them)."""
    out = dict(state)
    out["supervisor"] = {**state.get("supervisor", {}), "alive": pid_alive(state.get("supervisor", {}).get("pid"))}
    reps = [(r, p) for p in state.get("pools", []) for r in p.get("replicas", [])]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(reps) + 1))) as ex:
        router_f = ex.submit(_router_health, state.get("url"), timeout)
        futs = [ex.submit(_probe, r.get("url") if r.get("pid") else None, timeout, p.get("health_path", "/health"),
                          p.get("metrics_path", "/metrics")) for r, p in reps]
        live = [f.result() for f in futs]
        out["router"] = {**state.get("router", {}), "health": router_f.result()}
    it = iter(live)
    out["pools"] = [{**p, "replicas": [{**r, **next(it)} for r in p.get("replicas", [])]}
                    for p in state.get("pools", [])]
    return out


def _router_health(url: str | None, timeout: float) -> str:
    if not url:
        return "-"
    try:
        with httpx.Client(trust_env=False, timeout=timeout) as c:
            code = c.get(url + "/health").status_code
    except httpx.HTTPError:
        return "down"
    return "ok" if code == 200 else "no replica"


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:g}"


def _kv_summary(replicas: list[dict[str, Any]]) -> str:
    """``; KV transfer: N blocks exported, M imported, F fallbacks`` over a pool's replicas, or
    ``""`` when none of them moved KV."""
    def total(key: str) -> float:
        return sum(r.get(key) or 0.0 for r in replicas)

    exp, imp, fb = total("kv_exported_blocks"), total("kv_imported_blocks"), total("kv_transfer_fallbacks")
    if not (exp or imp or fb):
        return ""
    return f"; KV transfer: {exp:g} blocks exported, {imp:g} imported, {fb:g} fallbacks"


def format_status(st: dict[str, Any]) -> str:
    """The human-readable report of :func:`live_status`'s result: a header (router URL and
    health, supervisor), one line per pool and a table of replicas, then notes and recent events."""
    sup = st.get("supervisor", {})
    lines = [f"fleet {st.get('name')} ({st.get('mode')}, model {st.get('model')}): {st.get('url')}/v1",
             f"  router: {st.get('router', {}).get('health', '-')} (pid {st.get('router', {}).get('pid')}); "
             f"supervisor pid {sup.get('pid')} {'running' if sup.get('alive') else 'NOT RUNNING'}; "
             f"state updated {max(0.0, time.time() - st.get('updated_at', time.time())):.0f} s ago"]
    if st.get("prefill_endpoints_file"):
        lines.append("  prefill/decode split: the router sends each prompt to the prefill pool, then the request "
                     "to the decode pool, which pulls the prompt's KV from the prefill replica")
    header = ("POOL", "REPLICA", "STATE", "PID", "PORT", "HEALTH", "RUNNING", "WAITING", "KV USAGE", "HIT RATE",
              "RESTARTS")
    rows: list[tuple[str, ...]] = []
    for p in st.get("pools", []):
        lines.append(f"  pool {p['role']}: {len(p['replicas'])} replicas, desired {p.get('desired')} "
                     f"(min {p['min_replicas']}, max {p['max_replicas']}; scales on {p.get('metric')} "
                     f"target {p.get('target'):g} per replica)" + _kv_summary(p["replicas"]))
        for r in p["replicas"]:
            rows.append((p["role"], r["name"], r["state"], str(r.get("pid") or "-"), str(r.get("port") or "-"),
                         r.get("health", "-"), _fmt(r.get("running")), _fmt(r.get("waiting")),
                         _fmt(r.get("kv_usage"), True), _fmt(r.get("hit_rate"), True), str(r.get("restarts", 0))))
    if rows:
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines.append("")
        for row in (header, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    else:
        lines.append("  (no replica running: scaled to zero; the router holds requests and starts one)")
    for note in st.get("notes", []):
        lines.append(f"note: {note}")
    events = st.get("events", [])[-8:]
    if events:
        lines.append("recent events:")
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['message']}" for e in events]
    return "\n".join(lines)
