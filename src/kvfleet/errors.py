"""Typed errors raised by kvfleet.

The server maps them to HTTP: :class:`InvalidRequestError` (and subclasses) -> 400 with an
OpenAI-style error body, :class:`QueueFullError` -> 503 with ``Retry-After``,
:class:`EngineDeadError` -> 500.
"""

from __future__ import annotations


class KVFleetError(Exception):
    """Base class of every error kvfleet raises on purpose."""


class InvalidRequestError(KVFleetError, ValueError):
    """A request (or sampling parameter) is invalid. Maps to HTTP 400.

    Attributes:
        param: name of the offending request field, when one is to blame (OpenAI's ``param``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """The prompt plus ``max_tokens`` can never fit: over ``max_model_len`` tokens, or more KV
    blocks than the whole block pool holds. Raised at admission, so the request never waits."""


class QueueFullError(KVFleetError):
    """The waiting queue is over ``--max-waiting-requests``. Maps to HTTP 503 + Retry-After."""


class EngineDeadError(KVFleetError):
    """The engine loop died (an unexpected exception in a step); no request can make progress."""
