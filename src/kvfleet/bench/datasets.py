"""Benchmark workloads: seeded generators of requests for ``kvfleet bench``.

Four datasets, each deterministic given its seed (and, for the random one, a run index):

- :class:`RandomDataset` — prompts of random vocabulary tokens, lengths uniform in a range
  around ``input_len`` / ``output_len`` (vLLM's ``random`` dataset does the same). Each run index
  draws fresh prompts, so no server's prefix cache is flattered by text it saw in an earlier run.
- :class:`SharedPrefixDataset` — T tenants, each with a system prompt of L tokens, and Q
  questions per tenant (the workload of SGLang's ``generated-shared-prefix`` benchmark): measures
  what prefix caching saves on TTFT.
- :class:`MultiTurnDataset` — C conversations of K turns; turn k resends the whole history
  (every earlier user turn and the server's replies), as a chat client does.
- :class:`ShareGPTDataset` — a ShareGPT-format JSON file (a list of ``{"conversations":
  [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``); the first human turn is the
  prompt and the length of the reply that follows is the output length.

A request is a :class:`BenchRequest`; multi-turn workloads yield :class:`Conversation` objects
whose next request is built from the previous reply. Bad parameters and bad files raise
:class:`DatasetError` (a ``ValueError``) with a message that says what to fix.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DATASET_NAMES",
    "BenchRequest",
    "Conversation",
    "DatasetError",
    "MultiTurnDataset",
    "RandomDataset",
    "ShareGPTDataset",
    "SharedPrefixDataset",
    "TokenTextMaker",
]

DATASET_NAMES = ("random", "shared-prefix", "multi-turn", "sharegpt")


class DatasetError(ValueError):
    """A dataset cannot be built: bad parameters, or a missing / malformed dataset file."""


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt: the prompt text for ``/v1/completions`` (the chat messages flattened when the
            workload is chat-native).
        messages: OpenAI chat messages for ``/v1/chat/completions``.
        prompt_len: prompt length in tokens by the benchmark's tokenizer (the server's own
            ``usage.prompt_tokens`` replaces it when the stream reports usage).
        output_len: tokens to generate (sent as ``max_tokens``).
        tag: where the request comes from (``tenant3/q1``, ``conv2/turn0``, ``sharegpt#17``).
    """

    prompt: str
    messages: list[dict[str, str]]
    prompt_len: int
    output_len: int
    tag: str = ""


def _check_pos(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DatasetError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_ratio(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise DatasetError(f"{name} must be in [0, 1), got {value!r}")


def _derive_seed(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (stable across processes, unlike ``hash``)."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


class TokenTextMaker:
    """Builds text that tokenizes to (about) an exact number of tokens, from random vocabulary ids.

    Random ids are decoded to text, re-encoded, cut to the wanted length and decoded again, so
    the text a server receives re-tokenizes to that length (±1 at the boundary with a template).

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``, ``vocab_size``,
            ``all_special_ids``).

    Raises:
        DatasetError: the tokenizer has too small a vocabulary.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
        # Skip the first ids (bytes/special tokens in most BPE vocabularies) and any special id.
        lo = min(256, vocab // 4)
        self._ids = [i for i in range(lo, vocab) if i not in special]
        if len(self._ids) < 16:
            raise DatasetError(f"tokenizer vocabulary too small for random prompts ({vocab} ids)")

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def make(self, rng: random.Random, num_tokens: int) -> str:
        """Text of ``num_tokens`` random tokens (0 gives ``""``)."""
        if num_tokens <= 0:
            return ""
        ids = [rng.choice(self._ids) for _ in range(num_tokens + 8)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < num_tokens:  # decoding merged tokens; top up
            text += self.tokenizer.decode([rng.choice(self._ids) for _ in range(num_tokens)],
                                          skip_special_tokens=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens], skip_special_tokens=True)


def _lens(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


@dataclass
class RandomDataset:
    """Random-token prompts of seeded lengths.

    Args:
        input_len: mean prompt length, tokens.
        output_len: mean output length, tokens.
        range_ratio: lengths are uniform in ``[len * (1 - r), len * (1 + r)]``; 0 = fixed lengths.
        seed: base seed.

    Raises:
        DatasetError: a non-positive length or a ratio outside [0, 1).
    """

    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_pos("random input length", self.input_len)
        _check_pos("random output length", self.output_len)
        _check_ratio("random range ratio", self.range_ratio)

    def sample(self, maker: TokenTextMaker, num_prompts: int, run_index: int = 0) -> list[BenchRequest]:
        """``num_prompts`` requests; the same ``(seed, run_index)`` gives the same requests and a new
        ``run_index`` gives fresh prompts (pass the same index to reuse prompts)."""
        _check_pos("number of prompts", num_prompts)
        rng = random.Random(_derive_seed("random", self.seed, run_index))
        ins = _lens(rng, self.input_len, self.range_ratio, num_prompts)
        outs = _lens(rng, self.output_len, self.range_ratio, num_prompts)
        reqs = []
        for i, (n_in, n_out) in enumerate(zip(ins, outs)):
            text = maker.make(rng, n_in)
            reqs.append(BenchRequest(prompt=text, messages=[{"role": "user", "content": text}],
                                     prompt_len=maker.count(text), output_len=n_out, tag=f"random#{i}"))
        return reqs


@dataclass
class SharedPrefixDataset:
    """T tenants × a system prompt of L tokens × Q questions per tenant.

    Every request of tenant t starts with the same system prompt (``messages[0]`` is the system
    message; ``prompt`` is that text, a blank line, then the question), so a server with prefix
    caching computes it once per tenant. Requests are interleaved across tenants in a seeded
    shuffle so that tenants compete for the cache.

    Args:
        num_tenants: T.
        system_prompt_len: L, tokens.
        questions_per_tenant: Q.
        question_len: tokens of each question.
        output_len: tokens to generate per request.
        seed: base seed.

    Raises:
        DatasetError: a non-positive parameter.
    """

    num_tenants: int = 4
    system_prompt_len: int = 512
    questions_per_tenant: int = 8
    question_len: int = 32
    output_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        _check_pos("shared-prefix tenants", self.num_tenants)
        _check_pos("shared-prefix system prompt length", self.system_prompt_len)
        _check_pos("shared-prefix questions per tenant", self.questions_per_tenant)
        _check_pos("shared-prefix question length", self.question_len)
        _check_pos("shared-prefix output length", self.output_len)

    @property
    def num_requests(self) -> int:
        """T × Q."""
        return self.num_tenants * self.questions_per_tenant

    def sample(self, maker: TokenTextMaker, run_index: int = 0) -> list[BenchRequest]:
        """All T × Q requests, in a seeded interleaved order."""
        rng = random.Random(_derive_seed("shared-prefix", self.seed, run_index))
        reqs = []
        for t in range(self.num_tenants):
            system = maker.make(rng, self.system_prompt_len)
            for q in range(self.questions_per_tenant):
                question = maker.make(rng, self.question_len)
                prompt = f"{system}\n\n{question}"
                reqs.append(BenchRequest(
                    prompt=prompt,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    prompt_len=maker.count(prompt), output_len=self.output_len, tag=f"tenant{t}/q{q}"))
        rng.shuffle(reqs)
        return reqs


@dataclass
class Conversation:
    """One multi-turn conversation: user turns fixed in advance, replies filled in as they arrive.

    Attributes:
        conv_id: index of the conversation.
        user_turns: the user message of each turn.
        output_len: tokens to generate per turn.
        history: messages so far (user and assistant alternating).
    """

    conv_id: int
    user_turns: list[str]
    output_len: int
    history: list[dict[str, str]] = field(default_factory=list)
    _maker: Any = field(default=None, repr=False)

    @property
    def num_turns(self) -> int:
        """K."""
        return len(self.user_turns)

    @property
    def turns_done(self) -> int:
        """Turns whose reply has been recorded."""
        return len(self.history) // 2

    def next_request(self) -> BenchRequest:
        """The request of the next turn: the whole history plus the next user message.

        Raises:
            DatasetError: every turn is done, or the previous turn's reply was not recorded.
        """
        if len(self.history) % 2:
            raise DatasetError(f"conversation {self.conv_id}: record the reply of turn {self.turns_done} first")
        k = self.turns_done
        if k >= self.num_turns:
            raise DatasetError(f"conversation {self.conv_id} has no turn {k} (it has {self.num_turns})")
        messages = [*self.history, {"role": "user", "content": self.user_turns[k]}]
        prompt = "\n\n".join(m["content"] for m in messages)
        plen = self._maker.count(prompt) if self._maker is not None else 0
        return BenchRequest(prompt=prompt, messages=messages, prompt_len=plen, output_len=self.output_len,
                            tag=f"conv{self.conv_id}/turn{k}")

    def record_reply(self, reply: str) -> None:
        """Append the user message of the current turn and the server's ``reply`` to the history."""
        if len(self.history) % 2 or self.turns_done >= self.num_turns:
            raise DatasetError(f"conversation {self.conv_id}: no turn is waiting for a reply")
        k = self.turns_done
        self.history += [{"role": "user", "content": self.user_turns[k]}, {"role": "assistant", "content": reply}]


@dataclass
class MultiTurnDataset:
    """C conversations × K turns; each turn resends the history (user turns and replies).

    Args:
        num_conversations: C.
        num_turns: K.
        user_len: tokens of each user message.
        output_len: tokens generated per turn.
        seed: base seed.

    Raises:
        DatasetError: a non-positive parameter.
    """

    num_conversations: int = 8
    num_turns: int = 4
    user_len: int = 64
    output_len: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        _check_pos("multi-turn conversations", self.num_conversations)
        _check_pos("multi-turn turns", self.num_turns)
        _check_pos("multi-turn user message length", self.user_len)
        _check_pos("multi-turn output length", self.output_len)

    @property
    def num_requests(self) -> int:
        """C × K."""
        return self.num_conversations * self.num_turns

    def sample(self, maker: TokenTextMaker, run_index: int = 0) -> list[Conversation]:
        """C fresh conversations (no replies yet)."""
        rng = random.Random(_derive_seed("multi-turn", self.seed, run_index))
        return [Conversation(conv_id=c, user_turns=[maker.make(rng, self.user_len) for _ in range(self.num_turns)],
                             output_len=self.output_len, _maker=maker)
                for c in range(self.num_conversations)]


@dataclass
class ShareGPTDataset:
    """Prompts from a ShareGPT-format JSON file.

    The file is a JSON list of records ``{"conversations": [{"from": "human"|"user", "value":
    str}, {"from": "gpt"|"assistant", "value": str}, ...]}``. Each record gives one request: its
    first human turn is the prompt and the token length of the reply after it is the output
    length (``output_len`` overrides it). Records with fewer than two turns, or whose prompt or
    reply is shorter than 4 tokens or longer than ``max_len``, are skipped (vLLM filters alike).
    Requests are drawn in a seeded order.

    Args:
        path: the JSON file.
        output_len: fixed output length in tokens, or None to use each reply's length.
        max_len: longest prompt (and prompt + reply) kept, tokens.
        seed: base seed for the order.

    Raises:
        DatasetError: the file is missing, is not JSON, is not a list of conversation records,
            or has no usable record.
    """

    path: str
    output_len: int | None = None
    max_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.output_len is not None:
            _check_pos("sharegpt output length", self.output_len)
        _check_pos("sharegpt max length", self.max_len, 8)
        self.records = self._load()

    def _load(self) -> list[tuple[str, str]]:
        p = Path(self.path).expanduser()
        if not p.is_file():
            raise DatasetError(f"ShareGPT file not found: {self.path}")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatasetError(f"ShareGPT file {self.path} is not valid JSON: {e}") from None
        if not isinstance(data, list):
            raise DatasetError(f"ShareGPT file {self.path} must hold a JSON list of records, "
                               f"got {type(data).__name__}")
        pairs = []
        for rec in data:
            conv = rec.get("conversations") if isinstance(rec, dict) else None
            if not isinstance(conv, list) or len(conv) < 2:
                continue
            first, second = conv[0], conv[1]
            if not (isinstance(first, dict) and isinstance(second, dict)):
                continue
            if first.get("from") not in ("human", "user") or second.get("from") not in ("gpt", "assistant", "chatgpt"):
                continue
            q, a = first.get("value"), second.get("value")
            if isinstance(q, str) and isinstance(a, str) and q.strip() and a.strip():
                pairs.append((q, a))
        if not pairs:
            raise DatasetError(f"ShareGPT file {self.path} has no record with a human turn followed by a reply "
                               "(expected [{\"conversations\": [{\"from\": \"human\", \"value\": ...}, "
                               "{\"from\": \"gpt\", \"value\": ...}]}, ...])")
        return pairs

    def sample(self, maker: TokenTextMaker, num_prompts: int, run_index: int = 0) -> list[BenchRequest]:
        """Up to ``num_prompts`` requests (fewer when the file has fewer usable records).

        Raises:
            DatasetError: no record is within the length limits.
        """
        _check_pos("number of prompts", num_prompts)
        rng = random.Random(_derive_seed("sharegpt", self.seed, run_index))
        order = list(range(len(self.records)))
        rng.shuffle(order)
        reqs: list[BenchRequest] = []
        for i in order:
            if len(reqs) >= num_prompts:
                break
            q, a = self.records[i]
            n_in = maker.count(q)
            n_reply = maker.count(a)
            n_out = self.output_len if self.output_len is not None else n_reply
            if n_in < 4 or (self.output_len is None and n_reply < 4) or n_in > self.max_len \
                    or n_in + n_out > self.max_len:
                continue
            reqs.append(BenchRequest(prompt=q, messages=[{"role": "user", "content": q}], prompt_len=n_in,
                                     output_len=n_out, tag=f"sharegpt#{i}"))
        if not reqs:
            raise DatasetError(f"no ShareGPT record of {self.path} fits the limits "
                               f"(prompt and reply >= 4 tokens, prompt + output <= {self.max_len} tokens)")
        return reqs
