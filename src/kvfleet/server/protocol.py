"""OpenAI-compatible request / response models (pydantic v2).

The shapes follow the OpenAI REST API (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``) plus vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``) and vLLM's ``/tokenize`` and ``/detokenize`` endpoints.

Requests are validated in two layers: pydantic checks types and required fields (a failure
becomes an HTTP 400 through the app's validation handler), then
:meth:`ChatCompletionRequest.to_sampling_params` / :meth:`CompletionRequest.to_sampling_params`
build a :class:`~kvfleet.sampling_params.SamplingParams`, whose constructor checks ranges and
raises :class:`~kvfleet.errors.InvalidRequestError` naming the offending field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.errors import InvalidRequestError
from kvfleet.sampling_params import SamplingParams

# --------------------------------------------------------------------------- helpers


def random_id(prefix: str) -> str:
    """A fresh request id such as ``chatcmpl-3f2a...`` (32 hex chars after the prefix)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds (OpenAI's ``created``)."""
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    """Base of every request model: unknown fields are ignored (like OpenAI and vLLM); known
    fields are strictly typed (no ``"4"`` for 4, no ``true`` for 1, no ``"yes"`` for true)."""

    model_config = ConfigDict(extra="ignore", strict=True)


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# --------------------------------------------------------------------------- shared pieces


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices."""

    include_usage: bool | None = False


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens`` = prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token accounting of a request (tokens)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by chat and text completions (OpenAI + vLLM extras).

    ``None`` means "not given": the OpenAI default applies.
    """

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    cache_salt: str | None = None
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    early_stopping: bool | Literal["never"] | None = False
    # vLLM's P/D field: {"do_remote_decode": true} on the prefill engine; {"do_remote_prefill":
    # true, "remote_url": "http://prefill:port"} on the decode engine (kvfleet.engine.kv_transfer)
    kv_transfer_params: dict[str, Any] | None = None

    def _build_params(self, max_tokens: int | None, logprobs: int | None,
                      param_renames: dict[str, str] | None = None) -> SamplingParams:
        """Build and validate :class:`SamplingParams`.

        Raises:
            InvalidRequestError: a field is out of range; ``param`` is the request's field name.
        """
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens or 0,
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
                skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
                spaces_between_special_tokens=(
                    True if self.spaces_between_special_tokens is None else self.spaces_between_special_tokens
                ),
                use_beam_search=bool(self.use_beam_search),
                best_of=getattr(self, "best_of", None),
                length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
                early_stopping=False if self.early_stopping is None else self.early_stopping,
            )
        except InvalidRequestError as e:
            renames = param_renames or {}
            if e.param in renames:
                new = renames[e.param]
                raise InvalidRequestError(e.message.replace(e.param, new, 1), param=new) from None
            raise

    def _check_beam(self) -> None:
        """Beam search is not streamed (the best beams are only known at the end)."""
        if self.use_beam_search and self.stream:
            raise InvalidRequestError("use_beam_search does not support stream=true", param="stream")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")

    @property
    def include_usage(self) -> bool:
        """True when the stream must end with a usage-only chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


# --------------------------------------------------------------------------- chat


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``.

    ``messages`` are passed to the model's chat template; ``content`` may be a string or a list
    of ``{"type": "text", "text": ...}`` parts. ``max_tokens`` / ``max_completion_tokens``
    default to None, meaning "up to ``max_model_len``" (the engine resolves it).
    ``logprobs`` is a bool; ``top_logprobs`` (0..20) asks for alternatives and needs
    ``logprobs: true``.
    """

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        """The request's :class:`SamplingParams`.

        Raises:
            InvalidRequestError: out-of-range field, or ``top_logprobs`` without ``logprobs``.
        """
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self._check_beam()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        renames = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return self._build_params(max_tokens, logprobs, renames)

    def normalized_messages(self) -> list[dict[str, Any]]:
        """Messages with list-of-parts ``content`` flattened to a string.

        Raises:
            InvalidRequestError: no messages, a message without a string ``role``, a non-assistant
                message without ``content``, or a non-text content part.
        """
        if not self.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}].role must be a string", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str
                    ):
                        raise InvalidRequestError(
                            f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                            "are supported", param="messages")
                    texts.append(part["text"])
                m = {**m, "content": "".join(texts)}
            elif content is None and m["role"] != "assistant":
                # OpenAI allows a missing content only on assistant messages (tool calls)
                raise InvalidRequestError(f"messages[{i}].content is required for role {m['role']!r}",
                                          param="messages")
            elif content is not None and not isinstance(content, str):
                raise InvalidRequestError(
                    f"messages[{i}].content must be a string or a list of text parts", param="messages")
            out.append(m)
        return out


class ChatMessage(BaseModel):
    """An assistant message of a non-streamed chat choice."""

    role: str = "assistant"
    content: str | None = None


class TopLogprob(BaseModel):
    """One alternative token: its text, logprob (natural log) and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    """Logprob entry of one generated token with its ``top_logprobs`` alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of chat: ``{"content": [ChatLogprobToken, ...]}``."""

    content: list[ChatLogprobToken] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streamed chat completion (``object = "chat.completion"``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Incremental message of a streamed chat chunk."""

    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (``object = "chat.completion.chunk"``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``.

    ``prompt`` is a string, a list holding one string, a list of token ids, or a list holding
    one list of token ids (batches of several prompts are rejected). ``max_tokens`` defaults to
    16 like OpenAI's; ``logprobs`` is an int (0..20) of alternatives per token. ``echo``
    prepends the prompt text to the completion.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        """The request's :class:`SamplingParams`.

        Raises:
            InvalidRequestError: out-of-range field, ``best_of != n`` without beam search,
                ``suffix`` or ``echo`` with ``logprobs`` (not supported), beam search with
                ``stream``.
        """
        self._check_beam()
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported", param="echo")
        return self._build_params(self.max_tokens, self.logprobs)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request, as text or token ids.

        Raises:
            InvalidRequestError: empty prompt list or a batch of several prompts.
        """
        p = self.prompt
        if isinstance(p, str):
            return p
        if len(p) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) > 1:
            raise InvalidRequestError(
                f"batched prompts are not supported: got {len(p)} prompts; send one prompt per request",
                param="prompt")
        return p[0]  # type: ignore[return-value]


class CompletionLogprobs(BaseModel):
    """OpenAI legacy completion logprobs (parallel lists, one entry per generated token).

    ``text_offset`` is each token's character offset in the choice's ``text``.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Non-streamed text completion (``object = "text_completion"``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------------- models, tokenize


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; ``max_model_len`` in tokens (vLLM's extension)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvfleet"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /tokenize``: either ``prompt`` (text) or chat ``messages``.

    ``add_special_tokens`` applies to ``prompt`` only; ``add_generation_prompt`` to messages.
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /detokenize``: token ids to turn back into text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class KVExportRequest(OpenAIBaseModel):
    """Body of ``POST /kvfleet/v1/kv/export`` (P/D disaggregation, :mod:`kvfleet.engine.kv_transfer`):
    a decode engine asks a prefill engine for the KV of ``token_ids``' longest cached prefix.

    Attributes:
        token_ids: the prompt's token ids, as the decode engine tokenized it.
        cache_salt: the request's prefix-cache namespace.
        start_block: first block wanted (the decode engine has the ones before).
        layout: the decode engine's KV layout (:meth:`KVLayout.to_json`); a mismatch is
            refused with HTTP 400 before any KV is sent.
    """

    token_ids: list[int] = Field(min_length=1)
    cache_salt: str | None = None
    start_block: int = Field(default=0, ge=0)
    layout: dict[str, Any] | None = None
