"""Prefix-cache affinity: prefer the endpoint that already served the longest prefix of this
prompt (llm-d's prefix-cache scorer, approximate: the router tracks what it routed, it does not
read the engines' caches)."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.prefix_index import PrefixIndex, PromptHasher
from kvfleet.router.scorers.base import RoutingContext, Scorer


class PrefixCacheScorer(Scorer):
    """Score = leading prompt blocks the endpoint has seen / prompt blocks (0 for a prompt
    shorter than one block).

    Args:
        hasher: cuts prompts into chained block hashes (tokens or characters).
        index: the bounded per-endpoint LRU of routed block hashes.
    """

    name = "prefix"

    def __init__(self, hasher: PromptHasher | None = None, index: PrefixIndex | None = None) -> None:
        self.hasher = hasher or PromptHasher()
        self.index = index or PrefixIndex()

    def hashes(self, ctx: RoutingContext) -> list[bytes]:
        """The prompt's block hashes, computed once per request."""
        if "prefix_hashes" not in ctx.cache:
            ctx.cache["prefix_hashes"] = self.hasher.block_hashes(ctx.body)
        return ctx.cache["prefix_hashes"]

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        hashes = self.hashes(ctx)
        if not hashes:
            return [0.0] * len(endpoints)
        return [self.index.match(e.url, hashes) / len(hashes) for e in endpoints]

    def on_pick(self, ctx: RoutingContext, endpoint: Endpoint) -> None:
        self.index.add(endpoint.url, self.hashes(ctx))

    def on_remove(self, url: str) -> None:
        self.index.remove(url)
