"""Prompt block hashes and a bounded per-endpoint index of the prefixes routed there
(the router-side approximation of each engine's prefix cache, as in llm-d's prefix-cache scorer).

A prompt is cut into blocks: ``block_size`` tokens when the router has the model's tokenizer,
``block_size`` characters otherwise. Block ``k``'s hash covers block ``k - 1``'s hash and the
block's content, so equal hashes mean equal prefixes (the chained hashing of vLLM's prefix
cache). Each endpoint keeps the hashes of the blocks routed to it in an LRU of bounded size
(``capacity`` blocks), so the router's memory is bounded however many distinct prompts pass
(unlike an unbounded trie); an evicted block only makes the score more conservative.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any


def chat_text(messages: Iterable[Any]) -> str:
    """A stable text rendering of chat messages for character-based hashing: one
    ``role: content`` line per message (list-of-parts content joined); non-dict entries skipped."""
    lines = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}")
    return "\n".join(lines)


class PromptHasher:
    """Chained block hashes of prompts.

    Args:
        block_size: tokens (with a tokenizer) or characters (without) per block, >= 1.
        tokenizer: a transformers tokenizer of the served model, or None for characters.

    Raises:
        ValueError: ``block_size < 1``.
    """

    def __init__(self, block_size: int = 64, tokenizer: Any = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.tokenizer = tokenizer

    @property
    def unit(self) -> str:
        """``tokens`` or ``chars``: what a block counts."""
        return "tokens" if self.tokenizer is not None else "chars"

    def units(self, body: dict[str, Any]) -> Sequence[Any]:
        """The prompt of an OpenAI request body as tokens (with a tokenizer) or a string.

        ``/v1/completions`` bodies use ``prompt`` (a string, a token-id list, or a list whose first
        element is used); chat bodies use ``messages`` (the chat template when the tokenizer has
        one, else :func:`chat_text`). Anything else is an empty prompt.
        """
        prompt: Any = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]
        messages = body.get("messages")
        tok = self.tokenizer
        if prompt is None and isinstance(messages, list):
            if tok is not None and getattr(tok, "chat_template", None):
                try:
                    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                    return list(ids if isinstance(ids, list) else ids["input_ids"])  # list or BatchEncoding
                except Exception:  # a malformed conversation: hash its text instead
                    pass
            prompt = chat_text(messages)
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int)]
        if not isinstance(prompt, str):
            return ""
        if tok is not None:
            return list(tok.encode(prompt, add_special_tokens=False))
        return prompt

    def block_hashes(self, body: dict[str, Any]) -> list[bytes]:
        """Chained 8-byte BLAKE2b hashes of the prompt's full blocks (a trailing partial block
        is not hashed: engines cache full blocks only)."""
        units = self.units(body)
        bs = self.block_size
        out: list[bytes] = []
        parent = b""
        for k in range(len(units) // bs):
            chunk = units[k * bs:(k + 1) * bs]
            data = chunk.encode() if isinstance(chunk, str) else b"".join(
                int(t).to_bytes(8, "little", signed=True) for t in chunk)
            parent = hashlib.blake2b(parent + data, digest_size=8).digest()
            out.append(parent)
        return out


class PrefixIndex:
    """Per-endpoint LRU sets of block hashes routed there.

    Args:
        capacity: most block hashes remembered per endpoint (>= 1); the least recently routed
            are forgotten first. Memory is about ``capacity * endpoints * 100`` bytes.

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int = 16384) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, url: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` the endpoint has seen (a chain breaks at the first miss)."""
        seen = self._lru.get(url)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def add(self, url: str, hashes: Sequence[bytes]) -> None:
        """Record that a prompt with these blocks was routed to ``url`` (refreshing their LRU
        position), evicting the endpoint's least recently routed blocks beyond capacity."""
        seen = self._lru.setdefault(url, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def remove(self, url: str) -> None:
        """Forget an endpoint (it left the pool)."""
        self._lru.pop(url, None)

    def size(self, url: str) -> int:
        """Block hashes remembered for ``url``."""
        return len(self._lru.get(url, ()))
