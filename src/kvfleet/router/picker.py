"""The endpoint picker: filter the candidates, score them with weighted scorers, pick the
highest total with a random tie-break (the shape of llm-d's endpoint picker)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.filters import Filter
from kvfleet.router.scorers import RoutingContext, Scorer


@dataclass
class Decision:
    """One routing decision.

    Attributes:
        endpoint: the chosen endpoint.
        totals: the weighted score of every candidate, by URL.
        scores: each scorer's raw scores, ``{scorer name: {url: score}}``.
    """

    endpoint: Endpoint
    totals: dict[str, float]
    scores: dict[str, dict[str, float]]


def parse_weighted(spec: str) -> tuple[str, float]:
    """``"prefix:3"`` -> ``("prefix", 3.0)``; a bare name has weight 1.

    Raises:
        ValueError: an empty name, a weight that is not a number, or a negative weight.
    """
    name, _, weight = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"scorer spec {spec!r} has no name (use NAME or NAME:WEIGHT)")
    try:
        w = float(weight) if weight.strip() else 1.0
    except ValueError:
        raise ValueError(f"scorer spec {spec!r}: weight {weight!r} is not a number") from None
    if not w >= 0 or w == float("inf"):
        raise ValueError(f"scorer spec {spec!r}: weight must be a finite number >= 0")
    return name, w


class EndpointPicker:
    """Weighted-sum endpoint picker.

    Args:
        scorers: ``(scorer, weight)`` pairs; weights >= 0.
        rng: random source for tie-breaks (seedable in tests).
        filters: applied in order before scoring (e.g. :class:`~kvfleet.router.filters.LoadBoundFilter`).

    Raises:
        ValueError: no scorers, or a negative weight.
    """

    def __init__(self, scorers: Sequence[tuple[Scorer, float]], rng: random.Random | None = None,
                 filters: Sequence[Filter] = ()) -> None:
        if not scorers:
            raise ValueError("the endpoint picker needs at least one scorer")
        if any(w < 0 for _, w in scorers):
            raise ValueError("scorer weights must be >= 0")
        self.scorers = list(scorers)
        self.filters = list(filters)
        self.rng = rng or random.Random()

    def pick(self, ctx: RoutingContext, candidates: Sequence[Endpoint]) -> Decision:
        """Filter the candidates, score the rest and choose one (the highest weighted sum; ties
        broken at random); then tell every scorer (:meth:`Scorer.on_pick`).

        Raises:
            ValueError: no candidates.
        """
        if not candidates:
            raise ValueError("no candidate endpoints")
        for f in self.filters:
            candidates = f.filter(ctx, candidates)
        totals = [0.0] * len(candidates)
        scores: dict[str, dict[str, float]] = {}
        for scorer, weight in self.scorers:
            vals = scorer.score(ctx, candidates)
            scores[scorer.name] = {e.url: v for e, v in zip(candidates, vals, strict=True)}
            for i, v in enumerate(vals):
                totals[i] += weight * v
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t >= best - 1e-12]
        chosen = candidates[self.rng.choice(tied)]
        for scorer, _ in self.scorers:
            scorer.on_pick(ctx, chosen)
        return Decision(chosen, {e.url: t for e, t in zip(candidates, totals, strict=True)}, scores)

    def remove_endpoint(self, url: str) -> None:
        """Let the scorers forget an endpoint that left the pool."""
        for scorer, _ in self.scorers:
            scorer.on_remove(url)
