"""Where the router's endpoints come from: a static list, a file watched for changes, or
Kubernetes pods / EndpointSlices selected by label (through the ``kubernetes`` client).

Each source answers :meth:`Discovery.list_endpoints` with base URLs; the endpoint pool calls it
periodically and adds or removes endpoints to match.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port``.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    u = url.strip()
    if "://" not in u:
        u = "http://" + u
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ValueError(f"endpoint {url!r} has an invalid port") from None
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


class Discovery:
    """A source of endpoint URLs."""

    async def list_endpoints(self) -> list[str]:
        """The current endpoint base URLs (normalised, de-duplicated, in a stable order)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for logs."""
        return type(self).__name__


class StaticDiscovery(Discovery):
    """A fixed list of URLs.

    Raises:
        ValueError: a URL that :func:`normalize_url` rejects.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(dict.fromkeys(normalize_url(u) for u in urls))

    async def list_endpoints(self) -> list[str]:
        return list(self.urls)

    def describe(self) -> str:
        return f"static: {', '.join(self.urls)}"


def parse_endpoints_file(text: str) -> list[str]:
    """Endpoint URLs from a file's text: YAML or JSON (a list of URLs, or a mapping with an
    ``endpoints`` list; list items may be strings or mappings with ``url``), or one URL per line
    (``#`` comments allowed).

    Raises:
        ValueError: malformed content or a bad URL.
    """
    lines = [ln for ln in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if ln]
    plain = lines and all(" " not in ln and not ln.startswith(("-", "{", "[")) and not ln.endswith(":")
                          for ln in lines)
    if plain:  # one URL per line
        data: Any = lines
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"endpoints file is not valid YAML/JSON: {e}") from None
    if data is None:
        return []
    if isinstance(data, dict):
        data = data.get("endpoints")
    if not isinstance(data, list):
        raise ValueError("endpoints file must hold a list of URLs or a mapping with an 'endpoints' list")
    urls = []
    for item in data:
        if isinstance(item, dict):
            item = item.get("url")
        if not isinstance(item, str):
            raise ValueError(f"endpoints file: {item!r} is not a URL")
        urls.append(normalize_url(item))
    return list(dict.fromkeys(urls))


class FileDiscovery(Discovery):
    """Endpoints listed in a file (see :func:`parse_endpoints_file`), re-read when its
    modification time or size changes. While the file is missing or malformed the last good
    list is kept (and the error is in :attr:`last_error`).

    Args:
        path: the file.

    Raises:
        ValueError: the file does not exist or is malformed at construction (fail fast).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._stamp: tuple[float, int] | None = None
        self._urls: list[str] = []
        self.last_error: str | None = None
        if not self.path.is_file():
            raise ValueError(f"endpoints file {self.path} does not exist")
        self._reload()
        if self.last_error:
            raise ValueError(self.last_error)

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime, st.st_size)
            if stamp == self._stamp:
                return
            urls = parse_endpoints_file(self.path.read_text())
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self.last_error = f"endpoints file {self.path}: {e}"
            return
        self._stamp, self._urls, self.last_error = stamp, urls, None

    async def list_endpoints(self) -> list[str]:
        self._reload()
        return list(self._urls)

    def describe(self) -> str:
        return f"file: {self.path}"


class KubernetesDiscovery(Discovery):
    """Ready pods, or ready EndpointSlice addresses, selected by label, through the
    ``kubernetes`` client (kubeconfig, or the in-cluster service account).

    Args:
        label_selector: e.g. ``app=kvfleet-engine``.
        namespace: the namespace to watch.
        port: the engines' HTTP port (pods; for EndpointSlices the slice's port named
            ``port_name`` is used when present, else this port).
        kind: ``pods`` or ``endpointslices``.
        port_name: EndpointSlice port name to prefer (default ``http``).
        scheme: ``http`` or ``https``.

    Raises:
        ValueError: an unknown ``kind``; ``kubernetes.config.ConfigException`` when no
            cluster configuration is found.
    """

    def __init__(self, label_selector: str, namespace: str = "default", port: int = 8000, kind: str = "pods",
                 port_name: str = "http", scheme: str = "http") -> None:
        if kind not in ("pods", "endpointslices"):
            raise ValueError(f"kind must be 'pods' or 'endpointslices', got {kind!r}")
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.label_selector, self.namespace, self.port, self.kind = label_selector, namespace, port, kind
        self.port_name, self.scheme = port_name, scheme
        self._core = client.CoreV1Api()
        self._discovery = client.DiscoveryV1Api()

    def _list(self) -> list[str]:
        if self.kind == "pods":
            pods = self._core.list_namespaced_pod(self.namespace, label_selector=self.label_selector)
            return urls_from_pods(pods.items, self.port, self.scheme)
        slices = self._discovery.list_namespaced_endpoint_slice(self.namespace, label_selector=self.label_selector)
        return urls_from_endpoint_slices(slices.items, self.port, self.port_name, self.scheme)

    async def list_endpoints(self) -> list[str]:
        return await asyncio.to_thread(self._list)

    def describe(self) -> str:
        return f"kubernetes {self.kind} in {self.namespace} with labels {self.label_selector}"


def urls_from_pods(pods: Sequence[Any], port: int, scheme: str = "http") -> list[str]:
    """URLs of the running, Ready, not-terminating pods with an IP (``V1Pod`` objects)."""
    urls = []
    for p in pods:
        st = p.status
        if p.metadata.deletion_timestamp is not None or st is None or st.phase != "Running" or not st.pod_ip:
            continue
        ready = any(c.type == "Ready" and c.status == "True" for c in (st.conditions or []))
        if ready:
            host = f"[{st.pod_ip}]" if ":" in st.pod_ip else st.pod_ip
            urls.append(f"{scheme}://{host}:{port}")
    return sorted(set(urls))


def urls_from_endpoint_slices(slices: Sequence[Any], port: int, port_name: str = "http",
                              scheme: str = "http") -> list[str]:
    """URLs of the ready addresses of ``V1EndpointSlice`` objects (a missing ``ready``
    condition counts as ready, as the API defines)."""
    urls = []
    for s in slices:
        p = next((x.port for x in (s.ports or []) if x.name == port_name and x.port), None)
        p = p or port
        for ep in s.endpoints or []:
            cond = ep.conditions
            if cond is not None and cond.ready is False:
                continue
            for addr in ep.addresses or []:
                host = f"[{addr}]" if ":" in addr else addr
                urls.append(f"{scheme}://{host}:{p}")
    return sorted(set(urls))
