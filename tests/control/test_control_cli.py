"""``kvfleet render``: prints manifests like ``helm template``; bad specs exit 2 with one line
naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kvfleet.cli import main
from tests.control.specs import GGUF_MODEL, service

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _write(tmp_path: Path, *docs) -> str:
    p = tmp_path / "service.yaml"
    p.write_text("".join("---\n" + yaml.safe_dump(d) for d in docs))
    return str(p)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_render_examples(path, capsys, validator):
    assert main(["render", "-f", str(path), "--namespace", "demo"]) == 0
    out, err = capsys.readouterr()
    docs = list(yaml.safe_load_all(out))
    assert err == "" and len(docs) >= 8
    for d in docs:
        validator.validate(d)
        assert d["metadata"]["namespace"] == "demo"


def test_examples_cover_every_mode():
    modes = set()
    for path in EXAMPLES:
        for d in yaml.safe_load_all(path.read_text()):
            if d["kind"] == "InferenceService":
                from kvfleet.control.api import parse_resource

                modes.add(parse_resource(d).spec.effective_mode())
    assert modes == {"Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless"}


def test_flags(tmp_path, capsys):
    f = _write(tmp_path, GGUF_MODEL, service("chat", "Standard", "kvfleet", uid=None))
    assert main(["render", "-f", f, "--gateway", "gw", "--no-keda", "--kueue-queue", "q", "--kueue-priority", "p",
                 "--image", "me/engine:dev", "-o", "json"]) == 0
    items = json.loads(capsys.readouterr().out)["items"]
    kinds = [d["kind"] for d in items]
    assert "HorizontalPodAutoscaler" in kinds and "ScaledObject" not in kinds
    assert "HTTPRoute" in kinds and "InferencePool" in kinds
    engine = next(d for d in items if d["kind"] == "Deployment" and d["metadata"]["name"] == "chat-engine")
    assert engine["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q"
    assert engine["spec"]["template"]["spec"]["containers"][0]["image"] == "me/engine:dev"
    assert all(d["metadata"]["namespace"] == "default" for d in items)


def test_stdin(monkeypatch, capsys):
    import io

    text = yaml.safe_dump_all([GGUF_MODEL, service("chat", "Standard", "kvfleet")])
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(["render", "-f", "-"]) == 0
    assert "kind: Deployment" in capsys.readouterr().out


def test_crds_and_builtin_runtimes(capsys):
    assert main(["render", "--crds"]) == 0
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == ["CustomResourceDefinition"] * 6
    assert main(["render", "--builtin-runtimes"]) == 0
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)] == ["kvfleet", "vllm",
                                                                                             "sglang"]


def _fails(capsys, *argv) -> str:
    assert main(["render", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvfleet render: error: ")
    return err


@pytest.mark.parametrize("change,field", [
    (lambda d: d["spec"]["engine"].update(minReplicas=3, maxReplicas=1), "spec.engine.maxReplicas"),
    (lambda d: d["spec"].update(runtime={"name": "tgi"}), "spec.runtime.name"),
    (lambda d: d["spec"].update(deploymentMode="MultiNode", engine={"multiNode": {"size": 2}}), "spec.deploymentMode"),
    (lambda d: d["spec"]["engine"]["engineArgs"].update(gpuMemoryUtilization=0.9),
     "spec.engine.engineArgs.gpuMemoryUtilization"),
])
def test_bad_service_exits_2_naming_the_field(tmp_path, capsys, change, field):
    doc = service("chat", "Standard", "kvfleet")
    change(doc)
    err = _fails(capsys, "-f", _write(tmp_path, GGUF_MODEL, doc))
    assert f" {field}: " in err


def test_pd_without_decode_and_malformed_sha256(tmp_path, capsys):
    pd = service("chat", "PrefillDecodeDisaggregated", "kvfleet")
    del pd["spec"]["decode"]
    assert " spec.decode: " in _fails(capsys, "-f", _write(tmp_path, GGUF_MODEL, pd))
    bad = copy.deepcopy(GGUF_MODEL)
    bad["spec"]["sha256"] = "123"
    assert "BaseModel/smollm2: spec.sha256: " in _fails(capsys, "-f", _write(tmp_path, bad,
                                                                            service("c", "Standard", "kvfleet")))


def test_verify_catches_a_sha256_that_does_not_match(tmp_path, capsys):
    weights = tmp_path / "tiny.gguf"
    weights.write_bytes(b"GGUF not the real weights")
    model = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny"},
             "spec": {"source": f"file://{weights}", "format": "gguf", "sha256": "0" * 64}}
    f = _write(tmp_path, model, service("chat", "Standard", "kvfleet", model="tiny", args={}))
    assert main(["render", "-f", f]) == 0  # without --verify the weights are not read
    capsys.readouterr()
    assert "BaseModel/default/tiny: spec.sha256: " in _fails(capsys, "-f", f, "--verify")


def test_unreadable_or_empty_input(tmp_path, capsys):
    assert "No such file" in _fails(capsys, "-f", str(tmp_path / "missing.yaml"))
    assert "no InferenceService" in _fails(capsys, "-f", _write(tmp_path, GGUF_MODEL))
    p = tmp_path / "broken.yaml"
    p.write_text("kind: [unclosed\n")
    assert "invalid YAML" in _fails(capsys, "-f", str(p))
    assert "give -f FILE" in _fails(capsys)
