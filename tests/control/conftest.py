"""Fixtures of the control-plane tests: a manifest validator over the Kubernetes OpenAPI schema
(kubernetes-validate) and the upstream CRDs in ../shared/schemas/crds plus kvfleet's own CRDs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_CRDS = REPO.parent / "shared" / "schemas" / "crds"
#: the upstream CRDs rendered manifests use.
UPSTREAM = ("leaderworkerset.x-k8s.io_leaderworkersets.yaml", "keda.sh_scaledobjects.yaml",
            "gateway.networking.k8s.io_httproutes.yaml", "inference.networking.k8s.io_inferencepools.yaml")


@pytest.fixture(scope="session")
def validator():
    """A :class:`ManifestValidator` for Kubernetes 1.37 with the upstream CRDs and kvfleet's CRDs."""
    pytest.importorskip("kubernetes_validate")
    from kvfleet.control.api.crds import generate
    from kvfleet.control.validation import ManifestValidator

    missing = [f for f in UPSTREAM if not (SHARED_CRDS / f).is_file()]
    if missing:
        pytest.skip(f"upstream CRDs missing from {SHARED_CRDS}: {missing}")
    return ManifestValidator([*(SHARED_CRDS / f for f in UPSTREAM), *generate().values()], k8s_version="1.37")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 90.0, interval: float = 0.5) -> Any:
    """Poll ``check()`` until it returns something truthy (returned), failing the test after
    ``timeout`` seconds; for tests against a real API server, where objects appear asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
