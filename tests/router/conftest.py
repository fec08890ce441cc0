"""Shared router test helpers: a router app served in-process on a free port."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.bench.compare import free_port


class InProcessRouter:
    """``create_router_app`` served by uvicorn on a background thread (a context manager).

    Args:
        discovery: a :class:`~kvfleet.router.discovery.Discovery` or a list of URLs.
        policy: a profile name from :data:`~kvfleet.router.scorers.PROFILES`, used when
            ``picker`` is None.
        picker: an :class:`~kvfleet.router.picker.EndpointPicker`.
        config: :class:`~kvfleet.router.app.RouterConfig` keyword arguments.
        pool: :class:`~kvfleet.router.pool.EndpointPool` keyword arguments.
        scorer_options: :func:`~kvfleet.router.scorers.build_scorer` keyword arguments.
    """

    def __init__(self, discovery: Any, policy: str = "default", picker: Any = None, config: dict | None = None,
                 pool: dict | None = None, scorer_options: dict | None = None) -> None:
        import uvicorn

        from kvfleet.router.app import RouterConfig, create_router_app
        from kvfleet.router.discovery import StaticDiscovery
        from kvfleet.router.picker import EndpointPicker
        from kvfleet.router.scorers import PROFILES, build_scorer

        if isinstance(discovery, list):
            discovery = StaticDiscovery(discovery)
        if picker is None:
            picker = EndpointPicker([(build_scorer(n, **(scorer_options or {})), w)
                                     for n, w in PROFILES[policy].items()])
        self.app = create_router_app(discovery, picker, RouterConfig(policy=policy, **(config or {})),
                                     {"health_interval_s": 0.3, "scrape_interval_s": 0.1, **(pool or {})})
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def router(self):  # noqa: ANN201 - kvfleet.router.app.Router
        return self.app.state.router

    def __enter__(self) -> InProcessRouter:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-process router did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def prom_samples(url: str, family: str) -> dict[tuple, float]:
    """``{label values tuple: value}`` of a counter's ``_total`` (or a gauge's) samples at ``url/metrics``."""
    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == family:
            for s in fam.samples:
                if s.name in (family, family + "_total"):
                    out[tuple(s.labels.values())] = s.value
    return out


def router_counts(url: str) -> dict[str, float]:
    """Requests the router sent to each endpoint (``kvfleet_router_requests_total``)."""
    return {k[0]: v for k, v in prom_samples(url, "kvfleet_router_requests").items()}
