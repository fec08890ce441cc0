"""The local fleet's model fetching (kvfleet.control.local.models) against real servers:

- hf://: the real ``huggingface_hub`` client against a local server that speaks the hub's API
  (tests/control/hub_server.py; ``HF_ENDPOINT``), for files, whole repositories, revisions,
  private and gated repositories, offline mode and a concurrent fetch by two processes;
- s3://: boto3 against a moto S3 server process (``AWS_ENDPOINT_URL_S3``), for objects, prefixes,
  missing objects and buckets, denied access (moto's IAM checks switched on) and no credentials;
- pvc://: claims as local folders (``KVFLEET_PVC_ROOT``, ``kvfleet up --pvc-root``).

Every fetch checks the fingerprint before the download is kept; a mismatch names both digests and
leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvfleet.cli import main
from kvfleet.control.api import Catalog, SpecError
from kvfleet.control.api.source import ModelSource, fingerprint
from kvfleet.control.local import plan_fleet
from kvfleet.control.local.models import (
    COMPLETE_MARKER,
    PVC_ROOT_ENV,
    hf_folder,
    local_model_path,
    models_cache,
    pvc_path,
    s3_folder,
)
from kvfleet.control.resolve import resolve
from tests.control.hub_server import FakeHub, Repo
from tests.control.specs import service

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUF = b"GGUF" + hashlib.sha256(b"weights").digest() * 64  # 2 KiB: an "LFS" file on the fake hub
FOLDER = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": b"\0" * 1500,
          "tokenizer/tokenizer.json": b'{"model": {}}', "adapter/adapter_config.json": b'{"r": 8}'}
AUTH_ENV = ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", PVC_ROOT_ENV)


def _model(source: str, fmt: str = "gguf", sha256: str | None = None, name: str = "m"):
    spec = {"source": source, "format": fmt}
    if sha256:
        spec["sha256"] = sha256
    doc = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": name}, "spec": spec}
    return Catalog.from_documents([doc]).get("BaseModel", name, "default")


def _adapter(source: str, sha256: str | None = None):
    doc = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "FineTunedWeight", "metadata": {"name": "sql"},
           "spec": {"baseModel": {"name": "m"}, "source": source, "rank": 8, **({"sha256": sha256} if sha256 else {})}}
    return Catalog.from_documents([doc]).get("FineTunedWeight", "sql", "default")


def _tree_fingerprint(tmp: Path, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    return fingerprint(tmp)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in AUTH_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


# --------------------------------------------------------------------------- hf://


@pytest.fixture(scope="module")
def hub():
    repos = {"org/tiny": Repo({"model.gguf": GGUF, **FOLDER}),
             "org/private": Repo({"model.gguf": GGUF}, token="hf_secret"),
             "org/gated": Repo({"model.gguf": GGUF}, gated=True)}
    with FakeHub(repos) as h:
        yield h


@pytest.fixture
def hf(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent/hf-cache")  # never the user's cache
    hub.requests.clear()
    return hub


def test_hf_file_is_fetched_once_verified_and_reused(hf, tmp_path):
    sha = hashlib.sha256(GGUF).hexdigest()
    model = _model("hf://org/tiny#model.gguf", sha256=sha)
    path = local_model_path(model, tmp_path)
    folder = hf_folder(ModelSource.parse(model.spec.source), tmp_path)
    assert path == folder / "model.gguf" and path.read_bytes() == GGUF
    assert folder.parent == models_cache(tmp_path) / "hf" and folder.name.startswith("org--tiny-")
    assert (folder / COMPLETE_MARKER).read_text() == sha
    assert [r for r in hf.requests if "/resolve/" in r[1]] == [("HEAD", "/org/tiny/resolve/main/model.gguf"),
                                                              ("GET", "/org/tiny/resolve/main/model.gguf")]
    assert not [p for p in folder.parent.iterdir() if ".partial-" in p.name]
    hf.requests.clear()
    assert local_model_path(model, tmp_path) == path  # cached: the hub is not asked again
    assert hf.requests == []


def test_hf_whole_repository_and_folder_fingerprint(hf, tmp_path):
    files = {"model.gguf": GGUF, **FOLDER}
    sha = _tree_fingerprint(tmp_path / "expected", files)
    path = local_model_path(_model("hf://org/tiny", "safetensors", sha), tmp_path / "cache")
    got = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*")
           if p.is_file() and ".cache" not in p.parts and p.name != COMPLETE_MARKER}
    assert got == files
    assert (path / ".cache" / "huggingface").is_dir()  # huggingface_hub's metadata: not in the fingerprint
    # a folder of the repository, here as an adapter (always a folder)
    sub = local_model_path(_adapter("hf://org/tiny#adapter"), tmp_path / "cache")
    assert sub.name == "adapter" and (sub / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert not (sub.parent / "model.gguf").exists()  # only the folder was fetched


def test_hf_revision_pins_the_commit_and_unknown_ones_are_refused(hf, tmp_path):
    commit = hf.repos["org/tiny"].commit
    path = local_model_path(_model(f"hf://org/tiny@{commit}#model.gguf"), tmp_path)
    assert path.read_bytes() == GGUF and ("GET", f"/org/tiny/resolve/{commit}/model.gguf") in hf.requests
    with pytest.raises(SpecError, match=r"BaseModel/default/m: spec.source: revision 'v9' of org/tiny not found"):
        local_model_path(_model("hf://org/tiny@v9#model.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"revision 'v9' of org/tiny not found"):
        local_model_path(_model("hf://org/tiny@v9", "safetensors"), tmp_path)


def test_hf_missing_repository_and_file(hf, tmp_path):
    with pytest.raises(SpecError, match=r"spec.source: repository org/absent not found on http://127.0.0.1:\d+ "
                                        r"\(HTTP 404\)"):
        local_model_path(_model("hf://org/absent#model.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"spec.source: org/tiny@main on .* has no file 'other.gguf'"):
        local_model_path(_model("hf://org/tiny#other.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"spec.source: hf://org/tiny#nothing has no 'nothing'"):
        local_model_path(_adapter("hf://org/tiny#nothing"), tmp_path)  # a folder no file matches
    assert not list((models_cache(tmp_path) / "hf").glob("*/" + COMPLETE_MARKER))  # nothing kept


def test_hf_private_repository_needs_hf_token_and_gated_says_so(hf, tmp_path, monkeypatch):
    model = _model("hf://org/private#model.gguf")
    with pytest.raises(SpecError, match=r"repository org/private not found .*\(HTTP 401\); if it is private, set "
                                        r"HF_TOKEN .*\(HF_TOKEN is not set\)"):
        local_model_path(model, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(SpecError, match=r"\(HF_TOKEN is set\)"):
        local_model_path(model, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert local_model_path(model, tmp_path).read_bytes() == GGUF
    with pytest.raises(SpecError, match=r"org/gated on .* is gated: accept its terms on the hub and set HF_TOKEN"):
        local_model_path(_model("hf://org/gated#model.gguf"), tmp_path)


def test_hf_sha256_mismatch_names_both_digests_and_keeps_nothing(hf, tmp_path):
    wrong = "0" * 64
    with pytest.raises(SpecError) as e:
        local_model_path(_model("hf://org/tiny#model.gguf", sha256=wrong), tmp_path)
    assert e.value.field == "spec.sha256" and e.value.resource == "BaseModel/default/m"
    assert f"has sha256 {hashlib.sha256(GGUF).hexdigest()}, expected {wrong}" in str(e.value)
    assert "download was removed" in str(e.value)
    root = models_cache(tmp_path) / "hf"
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == []


def test_hf_cached_copy_that_no_longer_matches_is_removed(hf, tmp_path):
    sha = hashlib.sha256(GGUF).hexdigest()
    model = _model("hf://org/tiny#model.gguf", sha256=sha)
    path = local_model_path(model, tmp_path)
    path.write_bytes(b"GGUF corrupted")
    with pytest.raises(SpecError, match=r"spec.sha256: .* expected [0-9a-f]{64}; the cached download .* was "
                                        r"removed, the next run fetches it again"):
        local_model_path(model, tmp_path)
    assert not path.parent.exists()
    assert local_model_path(model, tmp_path).read_bytes() == GGUF  # and it does


def test_hf_offline_uses_the_hugging_face_cache_or_says_what_is_missing(hf, tmp_path, monkeypatch):
    import huggingface_hub

    hf_cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _model("hf://org/tiny#model.gguf")
    with pytest.raises(SpecError, match=r"spec.source: HF_HUB_OFFLINE is set and hf://org/tiny#model.gguf is not "
                                        r"in the Hugging Face cache"):
        local_model_path(model, tmp_path / "kv")
    assert hf.requests == []
    # what `hf download` leaves in the Hugging Face cache (fetched online, as a user would have)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.hf_hub_download("org/tiny", "model.gguf", cache_dir=hf_cache, endpoint=hf.url)
    huggingface_hub.snapshot_download("org/tiny", cache_dir=hf_cache, endpoint=hf.url)
    hf.requests.clear()
    assert local_model_path(model, tmp_path / "kv").read_bytes() == GGUF
    folder = local_model_path(_model("hf://org/tiny", "safetensors"), tmp_path / "kv")
    assert (folder / "tokenizer" / "tokenizer.json").read_bytes() == FOLDER["tokenizer/tokenizer.json"]
    assert not (folder / "tokenizer" / "tokenizer.json").is_symlink()  # a copy, not a link into the HF cache
    assert hf.requests == []


@pytest.mark.slow
def test_hf_unreachable_hub_falls_back_to_the_cache_or_fails_clearly(hf, tmp_path, monkeypatch):
    """Slow: huggingface_hub retries a refused connection with back-off (~25 s per attempt)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.hf_hub_download("org/tiny", "model.gguf", cache_dir=tmp_path / "hf-cache", endpoint=hf.url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens once closed
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    assert local_model_path(_model("hf://org/tiny#model.gguf"), tmp_path / "kv").read_bytes() == GGUF
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    with pytest.raises(SpecError, match=rf"spec.source: cannot reach {dead} and hf://org/tiny#model.gguf is not in "
                                        r"the Hugging Face cache"):
        local_model_path(_model("hf://org/tiny#model.gguf"), tmp_path / "kv2")


_FETCH = """
import sys, time
from kvfleet.control.api import Catalog
from kvfleet.control.local.models import local_model_path
doc = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "m"},
       "spec": {"source": "hf://org/tiny#model.gguf", "format": "gguf", "sha256": sys.argv[2]}}
print(local_model_path(Catalog.from_documents([doc]).get("BaseModel", "m", "default"), sys.argv[1]))
"""


def test_two_processes_fetching_the_same_source_download_it_once(hf, tmp_path):
    hf.repos["org/tiny"].delay_s = 1.0  # keep the first download in flight while the second starts
    try:
        sha = hashlib.sha256(GGUF).hexdigest()
        env = {**os.environ, "HF_ENDPOINT": hf.url, "HF_HUB_CACHE": "/nonexistent/hf-cache"}
        procs = [subprocess.Popen([sys.executable, "-c", _FETCH, str(tmp_path), sha], env=env, cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hf.repos["org/tiny"].delay_s = 0.0
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and Path(paths.pop()).read_bytes() == GGUF
    assert [r for r in hf.requests if r[0] == "GET" and "/resolve/" in r[1]] == [
        ("GET", "/org/tiny/resolve/main/model.gguf")]


def test_hf_service_plans_a_local_fleet_on_the_fetched_file(hf, tmp_path):
    """An InferenceService whose BaseModel is on the hub: kvfleet up's plan serves the fetched file."""
    sha = hashlib.sha256(GGUF).hexdigest()
    docs = [{"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "smollm2"},
             "spec": {"source": "hf://org/tiny#model.gguf", "format": "gguf", "sha256": sha,
                      "architecture": "LlamaForCausalLM"}},
            service("chat", "Standard", "kvfleet")]
    catalog = Catalog.from_documents(docs)
    plan = plan_fleet(resolve(catalog.inference_services()[0], catalog), cache=tmp_path)
    assert plan.model_path == hf_folder(ModelSource.parse("hf://org/tiny#model.gguf"), tmp_path) / "model.gguf"
    argv = plan.pools[0].argv(40000)
    assert argv[argv.index("serve") + 1] == str(plan.model_path)


def test_hf_fetches_the_real_smollm2_gguf(hub, tmp_path, monkeypatch):
    """The packaged SmolLM2-135M GGUF (~100 MB) served by the local hub and fetched with its pinned sha256."""
    from kvfleet.control.api.source import packaged_source
    from kvfleet.model.registry import resolve_model_path

    _, sha = packaged_source("smollm2-135m-instruct")
    real = Path(resolve_model_path("smollm2-135m-instruct"))
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    hub.repos[repo] = Repo({real.name: real.read_bytes()})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    try:
        path = local_model_path(_model(f"hf://{repo}#{real.name}", sha256=sha), tmp_path)
    finally:
        del hub.repos[repo]
    assert path.stat().st_size == real.stat().st_size and fingerprint(path) == sha


# --------------------------------------------------------------------------- s3://


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server process on a free port; yields its URL."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=2)
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start: {proc.communicate()[1][-2000:]!r}")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3(moto_s3, monkeypatch):
    """boto3 pointed at the moto server (AWS_ENDPOINT_URL_S3) with a bucket ``models``."""
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION":
                 "us-east-1", "AWS_ENDPOINT_URL_S3": moto_s3, "AWS_MAX_ATTEMPTS": "1",
                 "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket="models")
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="models"):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket="models", Key=obj["Key"])
    client.delete_bucket(Bucket="models")


def test_s3_object_is_fetched_verified_and_reused(s3, tmp_path):
    s3.put_object(Bucket="models", Key="gguf/tiny.gguf", Body=GGUF)
    sha = hashlib.sha256(GGUF).hexdigest()
    model = _model("s3://models/gguf/tiny.gguf", sha256=sha)
    path = local_model_path(model, tmp_path)
    assert path == s3_folder(ModelSource.parse(model.spec.source), tmp_path) / "tiny.gguf"
    assert path.read_bytes() == GGUF and (path.parent / COMPLETE_MARKER).read_text() == sha
    s3.delete_object(Bucket="models", Key="gguf/tiny.gguf")
    assert local_model_path(model, tmp_path) == path  # from the cache: S3 is not asked again


def test_s3_prefix_is_a_folder_model(s3, tmp_path):
    for rel, data in FOLDER.items():
        s3.put_object(Bucket="models", Key=f"llama/v1/{rel}", Body=data)
    s3.put_object(Bucket="models", Key="llama/v1/empty-dir/", Body=b"")  # a console "folder" placeholder
    s3.put_object(Bucket="models", Key="llama/v10/other.json", Body=b"not ours")  # same prefix, other folder
    sha = _tree_fingerprint(tmp_path / "expected", FOLDER)
    path = local_model_path(_model("s3://models/llama/v1/", "safetensors", sha), tmp_path / "cache")
    got = {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*")
           if p.is_file() and p.name != COMPLETE_MARKER}
    assert got == FOLDER


def test_s3_errors_name_the_problem(s3, tmp_path):
    s3.put_object(Bucket="models", Key="one.gguf", Body=GGUF)
    s3.put_object(Bucket="models", Key="dir.gguf/a.gguf", Body=GGUF)
    with pytest.raises(SpecError, match=r"spec.source: s3://models/absent.gguf: no such object on http://127"):
        local_model_path(_model("s3://models/absent.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"s3://nobucket/x.gguf: bucket 'nobucket' does not exist"):
        local_model_path(_model("s3://nobucket/x.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"s3://models/dir.gguf is a folder \(objects under dir.gguf/\), but this "
                                        r"model is one file"):
        local_model_path(_model("s3://models/dir.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"s3://models/one.gguf is one object, but this model is a folder"):
        local_model_path(_adapter("s3://models/one.gguf"), tmp_path)
    with pytest.raises(SpecError, match=r"s3://models/nothing: no objects under nothing/"):
        local_model_path(_adapter("s3://models/nothing"), tmp_path)
    assert not list((models_cache(tmp_path) / "s3").glob("*/" + COMPLETE_MARKER))


def test_s3_denied_and_missing_credentials(s3, tmp_path, moto_s3, monkeypatch):
    s3.put_object(Bucket="models", Key="one.gguf", Body=GGUF)
    model = _model("s3://models/one.gguf")
    httpx.post(f"{moto_s3}/moto-api/reset-auth", content=b"0").raise_for_status()  # moto checks IAM from now
    try:
        with pytest.raises(SpecError, match=r"spec.source: access to s3://models/one.gguf denied by http://127.*"
                                            r"\(403\): check the AWS credentials"):
            local_model_path(model, tmp_path)
    finally:
        httpx.post(f"{moto_s3}/moto-api/reset-auth", content=b"inf").raise_for_status()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(SpecError, match=r"spec.source: no AWS credentials for s3://models/one.gguf: set "
                                        r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        local_model_path(model, tmp_path)


def test_s3_sha256_mismatch_keeps_nothing(s3, tmp_path):
    s3.put_object(Bucket="models", Key="one.gguf", Body=GGUF)
    with pytest.raises(SpecError, match=rf"spec.sha256: s3://models/one.gguf has sha256 "
                                        rf"{hashlib.sha256(GGUF).hexdigest()}, expected {'1' * 64}"):
        local_model_path(_model("s3://models/one.gguf", sha256="1" * 64), tmp_path)
    assert [p.name for p in (models_cache(tmp_path) / "s3").iterdir() if not p.name.endswith(".lock")] == []


def test_s3_without_boto3_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    with pytest.raises(SpecError, match=r"spec.source: s3:// sources need boto3: pip install 'kvfleet\[s3\]'"):
        local_model_path(_model("s3://models/one.gguf"), tmp_path)


# --------------------------------------------------------------------------- pvc://


def test_pvc_claims_are_local_folders(tmp_path, monkeypatch):
    payload = b"GGUF on a claim"
    sha = hashlib.sha256(payload).hexdigest()
    model = _model("pvc://model-store/llama/m.gguf", sha256=sha)
    default = tmp_path / "pvc" / "model-store"
    with pytest.raises(SpecError, match=rf"spec.source: pvc://model-store/llama/m.gguf: no folder {default} for "
                                        r"claim 'model-store' on this machine; each claim is a folder under .*"
                                        rf"\(set {PVC_ROOT_ENV} or kvfleet up --pvc-root DIR"):
        local_model_path(model, tmp_path)
    (default / "llama").mkdir(parents=True)
    with pytest.raises(SpecError, match=rf"{default}/llama/m.gguf does not exist"):
        local_model_path(model, tmp_path)
    (default / "llama" / "m.gguf").write_bytes(payload)
    assert local_model_path(model, tmp_path) == default / "llama" / "m.gguf"
    # KVFLEET_PVC_ROOT moves the claims; an explicit root wins over it
    other = tmp_path / "claims"
    (other / "model-store" / "llama").mkdir(parents=True)
    (other / "model-store" / "llama" / "m.gguf").write_bytes(b"tampered")
    monkeypatch.setenv(PVC_ROOT_ENV, str(other))
    with pytest.raises(SpecError, match=rf"spec.sha256: {other}/model-store/llama/m.gguf has sha256 [0-9a-f]{{64}}, "
                                        rf"expected {sha}$"):
        local_model_path(model, tmp_path)
    assert (other / "model-store" / "llama" / "m.gguf").exists()  # a claim is never deleted
    assert local_model_path(model, tmp_path, pvc_root=tmp_path / "pvc") == default / "llama" / "m.gguf"
    assert pvc_path(ModelSource.parse("pvc://model-store"), root=other) == other / "model-store"


def test_kvfleet_up_pvc_root_flag(tmp_path, capsys, monkeypatch):
    spec = tmp_path / "fleet.yaml"
    docs = [{"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "smollm2"},
             "spec": {"source": "pvc://models/m.gguf", "format": "gguf", "architecture": "LlamaForCausalLM"}},
            service("chat", "Standard", "kvfleet")]
    spec.write_text(yaml.safe_dump_all(docs))
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(PVC_ROOT_ENV, "/elsewhere")  # run_up sets it: monkeypatch puts it back afterwards
    assert main(["up", "-f", str(spec), "--pvc-root", str(tmp_path / "claims"), "--port", "0",
                 "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err
    assert f"no folder {tmp_path / 'claims' / 'models'} for claim 'models'" in err
