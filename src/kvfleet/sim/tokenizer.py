"""The simulated engine's tokenizer and its fake generated text.

No model vocabulary is loaded. Text becomes token ids by cutting it into pieces of
:data:`CHARS_PER_TOKEN` (4) characters from its start and hashing each piece (CRC-32 of its UTF-8
bytes) into a vocabulary of ``vocab_size`` ids:

- about one token per 4 characters, the rate real BPE tokenizers reach on English text, so prompt
  lengths in tokens (and the prefill work they cost) are realistic;
- deterministic across processes and runs (CRC-32, not Python's salted ``hash``): the same text
  always gives the same ids, so a repeated prompt hits the prefix cache on any engine;
- prefix-stable: two texts sharing their first ``c`` characters share their first ``c // 4``
  token ids, so a shared system prompt or document prefix gives shared KV blocks.

Chat messages are rendered as ``"{role}: {content}\\n"`` lines (plus ``"assistant: "`` when a
generation prompt is asked for) and tokenized like plain text.

Generated tokens are fake words (:meth:`SimTokenizer.generated_token`), a deterministic function
of the prompt and the position, so the same prompt always gets the same completion (like greedy
decoding of a real model).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence
from typing import Any

#: characters per prompt token.
CHARS_PER_TOKEN = 4
#: default vocabulary size (SmolLM2's).
DEFAULT_VOCAB_SIZE = 49152

#: words of the fake completions (each generated token is one of them, with a leading space).
WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was", "at", "by",
    "this", "from", "or", "an", "be", "are", "which", "one", "all", "their", "there", "has", "more", "when",
    "model", "token", "cache", "block", "prefix", "engine", "request", "batch", "step", "router", "fleet",
    "simulated", "answer", "question", "time", "way", "data", "first", "new", "system", "part", "value",
)


class SimTokenizer:
    """Deterministic tokenizer of the simulated engine (see the module docstring).

    Args:
        vocab_size: number of token ids; ids are in ``[0, vocab_size)``.

    Raises:
        ValueError: ``vocab_size < 2``.
    """

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self._word_ids = [self.piece_id(" " + w) for w in WORDS]

    def __len__(self) -> int:
        return self.vocab_size

    def piece_id(self, piece: str) -> int:
        """Token id of one text piece: CRC-32 of its UTF-8 bytes (lone surrogates passed through)
        modulo ``vocab_size``."""
        return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % self.vocab_size

    @staticmethod
    def num_tokens(text: str) -> int:
        """Tokens :meth:`encode` makes of ``text``: ``ceil(len(text) / 4)``, without tokenizing."""
        return -(-len(text) // CHARS_PER_TOKEN)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: one per 4-character piece, from the start (the last piece may be
        shorter). ``""`` gives ``[]``."""
        pid = self.piece_id
        return [pid(text[i:i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)]

    @staticmethod
    def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The simulator's chat template: one ``"{role}: {content}\\n"`` line per message, then
        ``"assistant: "`` when ``add_generation_prompt``. ``content`` must already be a string
        (or None, rendered as empty)."""
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return text + "assistant: " if add_generation_prompt else text

    @staticmethod
    def prompt_seed(prompt_token_ids: Sequence[int]) -> int:
        """A 32-bit seed of a prompt (CRC-32 of its ids as int64), for :meth:`generated_token`."""
        return zlib.crc32(array("q", prompt_token_ids).tobytes())

    def generated_token(self, seed: int, index: int) -> tuple[int, str]:
        """The fake token at output position ``index`` (0-based) of a prompt with this ``seed``.

        Returns:
            ``(token_id, text)``; ``text`` is a word with a leading space, ``token_id`` its
            :meth:`piece_id`.
        """
        w = zlib.crc32(index.to_bytes(8, "little", signed=True), seed & 0xFFFFFFFF) % len(WORDS)
        return self._word_ids[w], " " + WORDS[w]
