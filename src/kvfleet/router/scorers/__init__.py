"""Scorer plugins, by name, and the routing profiles built from them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet.router.prefix_index import PrefixIndex, PromptHasher
from kvfleet.router.scorers.base import RoutingContext, Scorer
from kvfleet.router.scorers.load import InFlightScorer, KVUsageScorer, QueueScorer
from kvfleet.router.scorers.prefix import PrefixCacheScorer
from kvfleet.router.scorers.round_robin import RoundRobinScorer
from kvfleet.router.scorers.session import SessionAffinityScorer

#: ``--policy`` name -> scorer weights. ``default`` is llm-d's default profile (prefix 3,
#: queue 2, KV usage 2); ``kv-aware`` uses the load signals only.
PROFILES: dict[str, dict[str, float]] = {
    "default": {"prefix": 3.0, "queue": 2.0, "kv-usage": 2.0},
    "round-robin": {"round-robin": 1.0},
    "session": {"session": 1.0},
    "prefix": {"prefix": 1.0},
    "kv-aware": {"queue": 1.0, "kv-usage": 1.0, "in-flight": 1.0},
}


def build_scorer(name: str, *, session_header: str = "x-session-id", prefix_block_size: int = 64,
                 prefix_capacity: int = 16384, tokenizer: Any = None) -> Scorer:
    """A new scorer by name (see :data:`SCORERS`).

    Raises:
        ValueError: an unknown name or bad options.
    """
    factories: dict[str, Callable[[], Scorer]] = {
        "round-robin": RoundRobinScorer,
        "session": lambda: SessionAffinityScorer(session_header),
        "prefix": lambda: PrefixCacheScorer(PromptHasher(prefix_block_size, tokenizer), PrefixIndex(prefix_capacity)),
        "queue": QueueScorer,
        "kv-usage": KVUsageScorer,
        "in-flight": InFlightScorer,
    }
    if name not in factories:
        raise ValueError(f"unknown scorer {name!r} (known: {', '.join(SCORERS)})")
    return factories[name]()


#: scorer names accepted by :func:`build_scorer`.
SCORERS = ("round-robin", "session", "prefix", "queue", "kv-usage", "in-flight")

__all__ = ["PROFILES", "SCORERS", "RoutingContext", "Scorer", "build_scorer", "InFlightScorer", "KVUsageScorer",
           "PrefixCacheScorer", "QueueScorer", "RoundRobinScorer", "SessionAffinityScorer"]
