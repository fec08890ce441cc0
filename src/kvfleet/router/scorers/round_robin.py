"""Round-robin as a scorer: 1 for the next endpoint in turn, 0 for the others."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.scorers.base import RoutingContext, Scorer


class RoundRobinScorer(Scorer):
    """Cycles over the candidates in URL order, one step per routed request."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        order = sorted(range(len(endpoints)), key=lambda i: endpoints[i].url)
        turn = order[self._next % len(order)]
        self._next += 1
        return [1.0 if i == turn else 0.0 for i in range(len(endpoints))]
