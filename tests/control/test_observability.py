"""The Grafana dashboard and Prometheus configs in ``deploy/``: every dashboard query names a metric
that kvfleet's server or router exports (names read from their Prometheus registries, so a renamed
metric breaks this test) and only labels those metrics or the scrape config give; the scrape
config, run through a small implementation of Prometheus' relabeling on the pods the renderer
produces, finds each serving engine and router pod once, with the labels the dashboard and the
KEDA triggers filter on."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.control.api import Catalog
from kvfleet.control.k8s.scaling import default_query
from kvfleet.control.render import render_service
from kvfleet.control.resolve import resolve
from tests.control import specs

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvfleet-dashboard.json"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS_LOCAL = REPO / "deploy" / "prometheus" / "prometheus-local.yml"
PODMONITOR = REPO / "deploy" / "prometheus" / "podmonitor.yaml"

# --------------------------------------------------------------------------- what we export


def _exported() -> dict[str, set[str]]:
    """Sample name -> label names of every series kvfleet's server and router export: each family's
    name plus ``_total`` (counters), ``_bucket`` / ``_sum`` / ``_count`` (histograms)."""
    from prometheus_client.metrics import MetricWrapperBase

    from kvfleet.router.metrics import RouterMetrics
    from kvfleet.server.metrics import ServerMetrics

    server, router = ServerMetrics("m", block_size=16, num_blocks=8), RouterMetrics()
    for owner in (server, router):  # give every labelled metric a child, so its labels show in samples
        for v in vars(owner).values():
            if isinstance(v, MetricWrapperBase) and v._labelnames and not v._labelvalues:
                v.labels(*("x" for _ in v._labelnames))
    out: dict[str, set[str]] = {}
    for reg in (server.registry, router.registry):
        for fam in reg.collect():
            names = {"counter": [f"{fam.name}_total"], "histogram": [f"{fam.name}_{s}" for s in
                                                                     ("bucket", "sum", "count")]}.get(fam.type,
                                                                                                      [fam.name])
            labels = {k for s in fam.samples for k in s.labels}
            for n in names:
                out.setdefault(n, set()).update(labels - ({"le"} if not n.endswith("_bucket") else set()))
    return out


EXPORTED = _exported()

# --------------------------------------------------------------------------- PromQL reading

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                "topk", "quantile", "limitk", "limit_ratio"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless",
            "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """``(metric names, label names)`` of a PromQL expression (a tokenizer, not a full parser:
    strings, label matchers, grouping clauses and range selectors are cut out, then every identifier
    that is not a function call, an aggregation or a keyword is a metric name).

    Raises:
        AssertionError: unbalanced brackets.
    """
    s = _STRING.sub('""', expr)
    for o, c in ("()", "{}", "[]"):
        depth = 0
        for ch in s:
            depth += (ch == o) - (ch == c)
            assert depth >= 0, f"unbalanced {o}{c} in {expr!r}"
        assert depth == 0, f"unbalanced {o}{c} in {expr!r}"
    labels: set[str] = set()
    for m in _MATCHERS.finditer(s):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(1)))
    s = _MATCHERS.sub(" ", s)
    for m in _GROUPING.finditer(s):
        labels |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    s = _GROUPING.sub(" ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    metrics = {m.group(1) for m in _IDENT.finditer(s)
               if not m.group(2) and m.group(1) not in AGGREGATIONS | KEYWORDS}
    return metrics, labels


def test_promql_reader():
    assert promql_names('histogram_quantile(0.99, sum by (le, pod) (rate(a:b_bucket{x="1",y=~"$v"}[5m])))') == (
        {"a:b_bucket"}, {"le", "pod", "x", "y"})
    assert promql_names("sum(rate(a_total[1m])) / sum without (z) (b) * 1e-3 > bool 0.5")[0] == {"a_total", "b"}
    with pytest.raises(AssertionError, match="unbalanced"):
        promql_names("sum(rate(x[1m])")


# --------------------------------------------------------------------------- dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def _queries(d: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every panel target and every query variable (``label_values(Q, L)``)."""
    out = [(p["title"], t["expr"]) for p in _panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)", v["definition"], re.S)
            assert m, v["definition"]
            out.append((f"variable {v['name']}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return out


def _target_labels() -> set[str]:
    """Labels the scrape configs put on every series (plus Prometheus' own ``job``, ``instance``)."""
    out = {"job", "instance"}
    for path in (PROMETHEUS, PROMETHEUS_LOCAL):
        for job in yaml.safe_load(path.read_text())["scrape_configs"]:
            out |= {r["target_label"] for r in job.get("relabel_configs", []) if "target_label" in r}
            for sc in job.get("static_configs", []):
                out |= set(sc.get("labels", {}))
    return {x for x in out if not x.startswith("__")}


def unexported(d: dict[str, Any], exported: dict[str, set[str]]) -> list[str]:
    """Every query naming a metric not in ``exported``, or a label neither its metrics nor the scrape
    config give (``where: name``)."""
    targets = _target_labels()
    bad = []
    for where, expr in _queries(d):
        metrics, labels = promql_names(expr)
        assert metrics, f"{where}: no metric in {expr!r}"
        for m in sorted(metrics - set(exported)):
            bad.append(f"{where}: metric {m}")
        known = targets.union(*(exported.get(m, set()) for m in metrics))
        for lab in sorted(labels - known):
            bad.append(f"{where}: label {lab}")
    for p in _panels(d):
        for t in p.get("targets", []):
            for lab in re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", t.get("legendFormat", "")):
                if lab not in promql_names(t["expr"])[1]:
                    bad.append(f"{p['title']}: legend {{{{{lab}}}}} is not a grouping label")
    return bad


def test_every_dashboard_query_names_an_exported_metric(dashboard):
    assert unexported(dashboard, EXPORTED) == []


def test_a_renamed_metric_is_caught(dashboard):
    renamed = dict(EXPORTED)
    renamed["vllm:kv_cache_usage_percent"] = renamed.pop("vllm:kv_cache_usage_perc")
    assert any("vllm:kv_cache_usage_perc" in b for b in unexported(dashboard, renamed))
    typo = copy.deepcopy(dashboard)
    panel = next(p for p in _panels(typo) if p.get("targets"))
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("vllm:", "vllm_", 1)
    assert unexported(typo, EXPORTED)


def test_dashboard_covers_the_serving_signals(dashboard):
    exprs = [e for _, e in _queries(dashboard)]
    used = set().union(*(promql_names(e)[0] for e in exprs))
    for m in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_waiting",
              "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
              "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total",
              "kvfleet_router_requests_total", "kvfleet_router_time_to_first_token_seconds_bucket",
              "kvfleet_router_healthy_endpoints", "kvfleet_router_rejected_total"):
        assert m in used, m
    per_pod = set().union(*(promql_names(e)[0] for e in exprs if "pod" in promql_names(e)[1] and " by (" in e))
    for m in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:generation_tokens_total", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert m in per_pod, f"no per-replica panel for {m}"
    hit_rate = [e for e in exprs if "prefix_cache_hits_total" in e]
    assert hit_rate and all("/" in e and "prefix_cache_queries_total" in e for e in hit_rate)
    assert any("histogram_quantile(0.99" in e and "time_to_first_token" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e and "inter_token_latency" in e for e in exprs)


def test_dashboard_is_well_formed(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "service", "model"} <= variables
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in _panels(dashboard):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var}"


# --------------------------------------------------------------------------- scrape config


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' ``relabel_configs`` (actions replace, keep, drop; fully anchored regexes;
    ``;`` separator); ``None`` when the target is dropped."""
    out = dict(labels)
    for c in configs:
        action = c.get("action", "replace")
        value = c.get("separator", ";").join(out.get(s, "") for s in c.get("source_labels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), value)
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            repl = re.sub(r"\$\{?(\d+)\}?", r"\\\1", c.get("replacement", "$1"))
            new = m.expand(repl)
            if new:
                out[c["target_label"]] = new
            else:
                out.pop(c["target_label"], None)
        assert action in ("replace", "keep", "drop"), action
    return out


def sd_targets(template: dict[str, Any], namespace: str, pod: str) -> list[dict[str, str]]:
    """Kubernetes SD (``role: pod``) targets of one pod: one per declared container port, one per
    container without ports, with the ``__meta_kubernetes_*`` labels Prometheus sets."""
    meta, spec = template["metadata"], template["spec"]
    base = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": pod,
            "__meta_kubernetes_pod_phase": "Running", "__metrics_path__": "/metrics"}
    base |= {f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in meta.get("labels", {}).items()}
    base |= {f"__meta_kubernetes_pod_annotation_{_sanitize(k)}": v for k, v in meta.get("annotations", {}).items()}
    out = []
    for c in spec["containers"]:
        ports = c.get("ports") or [None]
        for p in ports:
            t = {**base, "__meta_kubernetes_pod_container_name": c["name"], "__address__": "10.0.0.7"}
            if p is not None:
                t |= {"__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                      "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                      "__address__": f"10.0.0.7:{p['containerPort']}"}
            out.append(t)
    return out


def _templates(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for m in manifests:
        if m["kind"] in ("Deployment", "Job"):
            out.append((m["metadata"]["name"], m["spec"]["template"]))
        elif m["kind"] == "LeaderWorkerSet":
            t = m["spec"]["leaderWorkerTemplate"]
            out += [(m["metadata"]["name"], t["leaderTemplate"]), (m["metadata"]["name"] + "-w", t["workerTemplate"])]
    return out


CASES = [("Standard", "kvfleet"), ("PrefillDecodeDisaggregated", "vllm"), ("MultiNode", "vllm"),
         ("Serverless", "sglang")]


@pytest.mark.parametrize("mode,runtime", CASES)
def test_scrape_config_finds_each_engine_and_router_pod_once(mode, runtime):
    jobs = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    assert {j["job_name"] for j in jobs} == {"kvfleet-engines", "kvfleet-router"}
    pvc = {"type": "PersistentVolumeClaim"}
    catalog: Catalog = specs.catalog(specs.service("svc", mode, runtime, modelStorage=pvc))
    svc = catalog.inference_services()[0]
    rs = resolve(svc, catalog)
    manifests = render_service(svc, catalog)
    kinds = {m["kind"] for m in manifests}
    assert "Job" in kinds and ("LeaderWorkerSet" in kinds) == (mode == "MultiNode")
    for workload, tpl in _templates(manifests):
        labels = tpl["metadata"]["labels"]
        pod = f"{workload}-7d9f8-x2x4q"
        found = {j["job_name"]: [t for t in (relabel(x, j["relabel_configs"])
                                             for x in sd_targets(tpl, "llm", pod)) if t is not None] for j in jobs}
        component = labels["kvfleet.io/component"]
        if labels.get("kvfleet.io/serving") == "true":
            expect, path = "kvfleet-engines", rs.runtime.spec.metrics_path
        elif component == "router":
            expect, path = "kvfleet-router", "/metrics"
        else:  # LWS workers, the download Job: no metrics
            assert found == {"kvfleet-engines": [], "kvfleet-router": []}, workload
            continue
        assert len(found.pop(expect)) == 1 and all(not v for v in found.values()), workload
        (t,) = [x for x in (relabel(y, next(j for j in jobs if j["job_name"] == expect)["relabel_configs"])
                            for y in sd_targets(tpl, "llm", pod)) if x is not None]
        assert t["namespace"] == "llm" and t["pod"] == pod and t["inference_service"] == "svc"
        assert t["component"] == component and t["__metrics_path__"] == path
        assert t["__address__"].endswith(f":{tpl['spec']['containers'][0]['ports'][0]['containerPort']}")
        if expect == "kvfleet-engines":
            assert t["runtime"] == runtime
            # the KEDA trigger's selector uses labels this job produces
            for pool in rs.pools:
                q = default_query(rs, pool)
                assert set(promql_names(q)[1]) <= set(t), q


def test_local_scrape_config_labels_like_kubernetes():
    k8s_labels = {r["target_label"] for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
                  for r in j["relabel_configs"] if "target_label" in r and not r["target_label"].startswith("__")}
    jobs = yaml.safe_load(PROMETHEUS_LOCAL.read_text())["scrape_configs"]
    for job in jobs:
        for sc in job["static_configs"]:
            for addr in sc["targets"]:
                assert re.fullmatch(r"[\w.-]+:\d+", addr)
                t = relabel({"__address__": addr, **sc["labels"]}, job.get("relabel_configs", []))
                assert t["pod"] == addr and t["component"] in ("engine", "router")
                assert k8s_labels - {"runtime"} <= set(t), job["job_name"]


def test_podmonitors_match_the_rendered_pods():
    monitors = {d["metadata"]["name"]: d for d in yaml.safe_load_all(PODMONITOR.read_text())}
    jobs = {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    catalog = specs.catalog(specs.service("svc", "Standard", "kvfleet"))
    svc = catalog.inference_services()[0]
    templates = [t for _, t in _templates(render_service(svc, catalog))]
    for name, mon in monitors.items():
        assert mon["apiVersion"] == "monitoring.coreos.com/v1" and mon["kind"] == "PodMonitor"
        sel = mon["spec"]["selector"]["matchLabels"]
        matched = [t for t in templates if sel.items() <= t["metadata"]["labels"].items()]
        assert matched, name
        (ep,) = mon["spec"]["podMetricsEndpoints"]
        for t in matched:
            assert ep["port"] in {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        want = {r["target_label"] for r in jobs[name]["relabel_configs"] if "target_label" in r}
        assert {r["targetLabel"] for r in ep["relabelings"]} == want, name
