"""Request models -> SamplingParams, prompt and message normalization (no model)."""

from __future__ import annotations

import pytest

from kvfleet.errors import InvalidRequestError
from kvfleet.server.protocol import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_extras():
    p = ChatCompletionRequest(messages=MSG).to_sampling_params()
    assert p.max_tokens is None and p.temperature == 1.0 and p.n == 1 and p.logprobs is None
    p = ChatCompletionRequest(messages=MSG, max_tokens=5, max_completion_tokens=7, temperature=0, top_k=3,
                              min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                              stop="x", stop_token_ids=[5], include_stop_str_in_output=True,
                              logprobs=True, top_logprobs=4, seed=3).to_sampling_params()
    assert p.max_tokens == 7 and p.greedy and p.top_k == 3 and p.min_p == 0.1
    assert p.repetition_penalty == 1.2 and p.min_tokens == 2 and p.ignore_eos
    assert p.stop == ["x"] and p.stop_token_ids == [5] and p.include_stop_str_in_output
    assert p.logprobs == 4 and p.seed == 3
    assert ChatCompletionRequest(messages=MSG, logprobs=True).to_sampling_params().logprobs == 0


def test_completion_defaults():
    p = CompletionRequest(prompt="a").to_sampling_params()
    assert p.max_tokens == 16 and p.logprobs is None
    assert CompletionRequest(prompt="a", logprobs=2).to_sampling_params().logprobs == 2


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_invalid_params_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        ChatCompletionRequest(messages=MSG, **kw).to_sampling_params()
    assert e.value.param == param
    assert param in e.value.message


def test_single_prompt():
    assert CompletionRequest(prompt="x").single_prompt() == "x"
    assert CompletionRequest(prompt=["x"]).single_prompt() == "x"
    assert CompletionRequest(prompt=[1, 2]).single_prompt() == [1, 2]
    assert CompletionRequest(prompt=[[1, 2]]).single_prompt() == [1, 2]
    for bad in ([], ["a", "b"], [[1], [2]]):
        with pytest.raises(InvalidRequestError) as e:
            CompletionRequest(prompt=bad).single_prompt()
        assert e.value.param == "prompt"


def test_messages_normalization():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}])
    assert req.normalized_messages() == [{"role": "user", "content": "ab"}]
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "user", "content": 5}], [{"role": "user"}], [{"role": "system", "content": None}]):
        with pytest.raises(InvalidRequestError):
            ChatCompletionRequest(messages=bad).normalized_messages()
    # an assistant turn without content (tool calls) is allowed, as in OpenAI's API
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    assert ChatCompletionRequest(messages=msgs).normalized_messages() == msgs


def test_kv_transfer_params_types():
    from kvfleet.engine.kv_transfer import KVTransferError, remote_prefill_url

    assert remote_prefill_url(None) is None and remote_prefill_url({"do_remote_decode": True}) is None
    assert remote_prefill_url({"do_remote_prefill": True, "remote_url": "http://p:8000/"}) == "http://p:8000"
    for bad in ({"do_remote_prefill": "yes", "remote_url": "http://p:8000"}, {"remote_url": 5},
                {"do_remote_prefill": True, "remote_url": [1]}, {"do_remote_prefill": True, "remote_url": "not a url"}):
        with pytest.raises(KVTransferError):
            remote_prefill_url(bad)
