"""Incremental, UTF-8-safe detokenization of one request's output, with stop strings.

Byte-level BPE tokenizers (GPT-2 style, as SmolLM2 / Llama 3 / Qwen use) split multi-byte
characters such as emoji and CJK across tokens; decoding a prefix of the ids yields a trailing
U+FFFD until the character is complete. This module never emits such a partial character.

Two incremental back ends, both O(new tokens) per call:

* **DecodeStream** (Hugging Face ``tokenizers`` >= 0.21) on the fast tokenizer's Rust backend
  (``tokenizer._tokenizer`` / ``tokenizer.backend_tokenizer``), prefilled with the last few
  prompt ids so that leading-space rules (SentencePiece "▁") see the right context;
* the **prefix-offset / read-offset** method (as in vLLM / Hugging Face TGI's ``decode_token``)
  for any tokenizer with ``decode(ids, skip_special_tokens=...)``: decode a small window twice
  and emit the difference once it no longer ends with U+FFFD.

Stop strings are searched only in the tail that can contain a new match, and streamed deltas
hold back any suffix that could still grow into a stop string, so a stop string never leaks.
"""

from __future__ import annotations

from typing import Any

from kvfleet.sampling_params import SamplingParams

# Prompt ids fed to the decoder as context before the first output token (as vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


def _rust_backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer, or None."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (availability check)
    except ImportError:  # pragma: no cover - tokenizers is a hard dependency
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for attr in ("_tokenizer", "backend_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class _OffsetDecoder:
    """Prefix-offset / read-offset incremental decoding over ``tokenizer.decode``.

    ``ids[prefix:read]`` was already emitted and is re-decoded as context; ``ids[read:]`` is
    pending. Emits ``decode(ids[prefix:]) - decode(ids[prefix:read])`` once the former grows
    and does not end in U+FFFD. Work per call is O(window), independent of output length.
    """

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context_ids)
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            # Trim ids that will never be context again, so the list stays small.
            emitted = new_text[len(prefix_text) :]
            del self._ids[: self._read]
            self._prefix = 0
            self._read = len(self._ids)
            return emitted
        return None


class _StreamDecoder:
    """``tokenizers.decoders.DecodeStream`` wrapper with the same ``step`` contract."""

    def __init__(self, backend: Any, context_ids: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        try:
            self._stream = DecodeStream(context_ids, skip_special_tokens=skip_special_tokens)
        except TypeError:  # older tokenizers: no prefill argument
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._backend, token_id)


class IncrementalDetokenizer:
    """Incremental, UTF-8-safe detokenization of a request's output, with stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (fast ones use ``tokenizers.DecodeStream``; any
            object with ``decode(ids, skip_special_tokens=...)`` works through the
            prefix/read-offset method) or a raw ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt; its last few ids give the decoder context.
        params: ``stop``, ``include_stop_str_in_output`` and ``skip_special_tokens`` are used.

    Stop tokens and EOS are the engine's business: only the ids passed to :meth:`add_tokens`
    are decoded. Texts are Python ``str``; lengths below are in characters (code points).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._params = params
        self._stops: list[str] = list(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        backend = _rust_backend(tokenizer)
        self._decoder: _StreamDecoder | _OffsetDecoder
        if backend is not None:
            self._decoder = _StreamDecoder(backend, context, params.skip_special_tokens)
        else:
            self._decoder = _OffsetDecoder(tokenizer, context, params.skip_special_tokens)
        self._text = ""
        self._sent = 0  # characters of _text already returned by get_delta
        self._stop_str: str | None = None

    @property
    def output_text(self) -> str:
        """The full output text so far (cut at a matched stop string); never ends with a
        partial UTF-8 character."""
        return self._text

    @property
    def stop_str(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_str

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append newly generated ids and look for stop strings.

        Args:
            token_ids: ids generated since the previous call (usually one).

        Returns:
            The stop string that matched (earliest in the text; ties go to the first in
            ``params.stop``), after which :attr:`output_text` is cut before it (or after it with
            ``include_stop_str_in_output``); else None. Calls after a match are ignored
            (return None).
        """
        if self._stop_str is not None:
            return None
        old_len = len(self._text)
        pieces = []
        for tid in token_ids:
            piece = self._decoder.step(int(tid))
            if piece:
                pieces.append(piece)
        if not pieces:
            return None
        self._text += "".join(pieces)
        if self._stops:
            return self._find_stop(old_len)
        return None

    def _find_stop(self, old_len: int) -> str | None:
        """Search stops that end after ``old_len`` (earlier text was already searched)."""
        best_pos = -1
        best: str | None = None
        for s in self._stops:
            pos = self._text.find(s, max(0, old_len - len(s) + 1))
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best = pos, s
        if best is None:
            return None
        end = best_pos + len(best) if self._params.include_stop_str_in_output else best_pos
        self._text = self._text[:end]
        self._stop_str = best
        return best

    def _held_back(self) -> int:
        """Characters at the end of the text that could still be the start of a stop string:
        the longest suffix that is a proper prefix of some stop (at most max stop length - 1)."""
        if not self._stops or self._stop_str is not None:
            return 0
        text = self._text
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def get_delta(self, finished: bool = False) -> str:
        """Text added since the previous call that is safe to stream.

        Never contains a partial UTF-8 character; while not ``finished`` (and no stop matched)
        it holds back a trailing suffix that could still grow into a stop string. With
        ``finished=True`` everything left is flushed. The concatenation of all deltas of a
        request equals :attr:`output_text`.
        """
        end = len(self._text) if finished else len(self._text) - self._held_back()
        if end <= self._sent:
            return ""
        delta = self._text[self._sent : end]
        self._sent = end
        return delta
