"""Filters of the endpoint picker: they narrow the candidates before scoring (llm-d's filter
stage). A filter never empties a non-empty candidate list: when it would drop every endpoint it
returns them all."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.scorers.base import RoutingContext


class Filter:
    """Narrows the candidate endpoints of one request."""

    name: str = ""

    def filter(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints that stay candidates (a non-empty input gives a non-empty output)."""
        raise NotImplementedError


class LoadBoundFilter(Filter):
    """Bounded loads (Mirrokni, Thorup and Zadimoghaddam 2018, "Consistent Hashing with Bounded
    Loads"): an endpoint stays a candidate only while taking this request keeps its in-flight
    count within ``factor`` times the mean, ``in_flight + 1 <= max(1, ceil(factor * (total + 1) / n))``
    over the ``n`` candidates. Affinity scorers (prefix, session) then pick the best endpoint
    among those with room, so a popular prefix spreads to a few replicas instead of piling onto
    one, and no replica carries more than about ``factor`` times the mean load.

    Args:
        factor: the bound's multiple of the mean load, > 1 (1.25–2 is typical).

    Raises:
        ValueError: ``factor <= 1``.
    """

    name = "load-bound"

    def __init__(self, factor: float = 2.0) -> None:
        if not factor > 1 or math.isinf(factor):
            raise ValueError(f"load bound factor must be a finite number > 1, got {factor}")
        self.factor = factor

    def bound(self, endpoints: Sequence[Endpoint]) -> int:
        """The most requests in flight an endpoint may hold after taking this one."""
        total = sum(e.in_flight for e in endpoints)
        return max(1, math.ceil(self.factor * (total + 1) / len(endpoints)))

    def filter(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if not endpoints:
            return []
        b = self.bound(endpoints)
        return [e for e in endpoints if e.in_flight + 1 <= b] or list(endpoints)
