"""The router's endpoint pool: membership from discovery, health checks with ejection and
re-probing, and periodic ``/metrics`` scraping of each endpoint's load."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from kvfleet.router.discovery import Discovery
from kvfleet.router.endpoint import Endpoint, parse_engine_load
from kvfleet.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class EndpointPool:
    """Endpoints known to the router and their health and load.

    An endpoint is *ejected* (``healthy = False``) after a failed health check or a failed
    request; it is probed again after a back-off (``eject_s * 2**(failures - 1)``, at most
    ``max_eject_s``) and returns at the first successful ``/health``.

    Args:
        discovery: where the endpoint URLs come from.
        client: the shared HTTP client.
        metrics: router metrics (endpoint gauges are kept current).
        health_interval_s: seconds between health checks of each endpoint.
        scrape_interval_s: seconds between ``/metrics`` scrapes of each healthy endpoint.
        discovery_interval_s: seconds between discovery refreshes.
        eject_s, max_eject_s: back-off before an ejected endpoint is probed again.
        probe_timeout_s: timeout of one health check or scrape.

    Raises:
        ValueError: a non-positive interval or timeout.
    """

    def __init__(self, discovery: Discovery, client: httpx.AsyncClient, metrics: RouterMetrics | None = None, *,
                 health_interval_s: float = 2.0, scrape_interval_s: float = 0.25, discovery_interval_s: float = 1.0,
                 eject_s: float = 1.0, max_eject_s: float = 30.0, probe_timeout_s: float = 2.0) -> None:
        for name, v in (("health_interval_s", health_interval_s), ("scrape_interval_s", scrape_interval_s),
                        ("discovery_interval_s", discovery_interval_s), ("eject_s", eject_s),
                        ("max_eject_s", max_eject_s), ("probe_timeout_s", probe_timeout_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.discovery = discovery
        self.client = client
        self.metrics = metrics or RouterMetrics()
        self.health_interval_s = health_interval_s
        self.scrape_interval_s = scrape_interval_s
        self.discovery_interval_s = discovery_interval_s
        self.eject_s, self.max_eject_s = eject_s, max_eject_s
        self.probe_timeout_s = probe_timeout_s
        self.endpoints: dict[str, Endpoint] = {}
        self.on_remove: list = []  # callables(url) told when an endpoint leaves
        self.changed = asyncio.Event()  # set when health or load changes (wakes queued requests)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ membership
    async def refresh(self) -> None:
        """Sync the endpoints with the discovery source (new ones start healthy)."""
        try:
            urls = await self.discovery.list_endpoints()
        except Exception as e:  # keep the last membership when the source fails
            logger.warning("endpoint discovery failed (%s): %s", self.discovery.describe(), e)
            return
        for url in urls:
            if url not in self.endpoints:
                self.endpoints[url] = Endpoint(url)
                logger.info("endpoint added: %s", url)
        for url in [u for u in self.endpoints if u not in set(urls)]:
            del self.endpoints[url]
            for fn in self.on_remove:
                fn(url)
            try:
                self.metrics.in_flight.remove(url)
            except KeyError:
                pass
            logger.info("endpoint removed: %s", url)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.endpoints.set(len(self.endpoints))
        self.metrics.healthy.set(sum(e.healthy for e in self.endpoints.values()))

    def healthy(self) -> list[Endpoint]:
        """Healthy endpoints, in URL order."""
        return [e for _, e in sorted(self.endpoints.items()) if e.healthy]

    # ------------------------------------------------------------------ health
    def report_failure(self, ep: Endpoint, reason: str) -> None:
        """Eject ``ep`` after a failed request or health check."""
        ep.consecutive_failures += 1
        delay = min(self.max_eject_s, self.eject_s * 2 ** (ep.consecutive_failures - 1))
        ep.ejected_until = time.monotonic() + delay
        if ep.healthy:
            logger.warning("endpoint %s ejected for %.1f s: %s", ep.url, delay, reason)
        ep.healthy = False
        self._update_gauges()
        self.changed.set()

    def report_success(self, ep: Endpoint) -> None:
        """Mark ``ep`` healthy again."""
        if not ep.healthy:
            logger.info("endpoint %s is back", ep.url)
        ep.healthy = True
        ep.consecutive_failures = 0
        self._update_gauges()
        self.changed.set()

    async def check(self, ep: Endpoint) -> bool:
        """One ``GET /health``; updates the endpoint; True if it answered 200."""
        try:
            r = await self.client.get(ep.url + "/health", timeout=self.probe_timeout_s)
            ok = r.status_code == 200
            reason = f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            self.report_success(ep)
        else:
            self.report_failure(ep, reason)
        return ok

    async def scrape(self, ep: Endpoint) -> None:
        """One ``GET /metrics``; stores the load signals (kept as they were on failure)."""
        try:
            r = await self.client.get(ep.url + "/metrics", timeout=self.probe_timeout_s)
            if r.status_code == 200:
                ep.load = parse_engine_load(r.text)
                self.changed.set()
        except (httpx.HTTPError, ValueError):
            pass

    # ------------------------------------------------------------------ loops
    async def _every(self, interval: float, fn) -> None:
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("router background task failed")
            await asyncio.sleep(interval)

    async def _health_round(self) -> None:
        now = time.monotonic()
        due = [e for e in self.endpoints.values() if e.healthy or e.ejected_until <= now]
        await asyncio.gather(*(self.check(e) for e in due))

    async def _scrape_round(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.healthy()))

    async def start(self) -> None:
        """Discover and health-check once, then run the background loops."""
        await self.refresh()
        await self._health_round()
        self._tasks = [asyncio.create_task(self._every(self.discovery_interval_s, self.refresh)),
                       asyncio.create_task(self._every(self.health_interval_s, self._health_round)),
                       asyncio.create_task(self._every(self.scrape_interval_s, self._scrape_round))]

    async def stop(self) -> None:
        """Cancel the background loops."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
