"""Session affinity by a consistent hash ring (Karger et al. 1997) on a request header."""

from __future__ import annotations

from collections.abc import Sequence

from uhashring import HashRing

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.scorers.base import RoutingContext, Scorer


class SessionAffinityScorer(Scorer):
    """1 for the endpoint that owns the request's session on a consistent hash ring over the
    candidates, 0 for the others; all 0 for a request without the header (neutral).

    The ring (``uhashring``, ketama-style with virtual nodes) is rebuilt only when the candidate
    set changes; when an endpoint joins or leaves, only the sessions on its arcs (about 1/N)
    move.

    Args:
        header: the session header, matched case-insensitively (default ``x-session-id``).
    """

    name = "session"

    def __init__(self, header: str = "x-session-id") -> None:
        self.header = header.lower()
        self._ring: HashRing | None = None
        self._nodes: frozenset[str] = frozenset()

    def owner(self, session: str, urls: Sequence[str]) -> str:
        """The URL owning ``session`` on the ring over ``urls`` (non-empty)."""
        nodes = frozenset(urls)
        if self._ring is None or nodes != self._nodes:
            self._ring = HashRing(nodes=sorted(nodes))
            self._nodes = nodes
        return self._ring.get_node(session)

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        session = ctx.headers.get(self.header)
        if not session:
            return [0.0] * len(endpoints)
        owner = self.owner(session, [e.url for e in endpoints])
        return [1.0 if e.url == owner else 0.0 for e in endpoints]
