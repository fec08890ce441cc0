"""The scorer plugin interface of the endpoint picker (llm-d's filter → scorers → picker)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvfleet.router.endpoint import Endpoint


@dataclass
class RoutingContext:
    """One request being routed.

    Attributes:
        path: the API path, e.g. ``/v1/chat/completions``.
        body: the parsed JSON request body.
        headers: request headers, keys lower-cased.
        cache: per-request scratch space scorers share (e.g. the prompt's block hashes).
    """

    path: str
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)


class Scorer:
    """A scorer returns one value in [0, 1] per candidate endpoint (higher = better); the
    picker multiplies it by the scorer's weight and sums over scorers.

    Subclasses set :attr:`name` (the name used in ``--scorer NAME:WEIGHT`` and YAML) and
    implement :meth:`score`; :meth:`on_pick` lets a stateful scorer learn the decision.
    """

    name: ClassVar[str] = ""

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        """Scores in [0, 1], aligned with ``endpoints`` (never empty)."""
        raise NotImplementedError

    def on_pick(self, ctx: RoutingContext, endpoint: Endpoint) -> None:
        """Called once the request is sent to ``endpoint``."""

    def on_remove(self, url: str) -> None:
        """Called when an endpoint leaves the pool."""


def min_max_inverted(values: Sequence[float]) -> list[float]:
    """``(max - v) / (max - min)`` per value: 1 for the least loaded, 0 for the most; all 1 when
    the values are equal (llm-d's queue scorer normalisation)."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]
