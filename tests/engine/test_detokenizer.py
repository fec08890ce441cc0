"""IncrementalDetokenizer with the real SmolLM2 tokenizer: UTF-8 safety, stop strings, streaming."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.sampling_params import SamplingParams

TEXTS = [
    "Family: 👨‍👩‍👧‍👦 and 👩🏽‍💻 coding, 🏳️‍🌈 flag",
    "Flags 🇯🇵🇫🇷🇧🇷 and 🇺🇸!",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Crème brûlée, naïve façade, Ångström, São Paulo, Øresund, żółć",
    "Mixed: café ☕ 你好 🙂 Ωμέγα — “quotes” … done\n\ttabs  and  spaces",
    "e\u0301 combining, \u00a0nbsp, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math, 🫠🥹",
]


class SlowTokenizer:
    """Only ``decode``: forces the prefix/read-offset back end; records decode window sizes."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[int]:
    return hf_tokenizer.encode("User asked: please write something.", add_special_tokens=False)


@pytest.fixture(params=["fast", "offset"])
def tokenizer(request, hf_tokenizer):
    return hf_tokenizer if request.param == "fast" else SlowTokenizer(hf_tokenizer)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ``ids`` ``chunk`` at a time, collecting a delta after each call; flush at the end."""
    deltas = []
    stop = None
    for i in range(0, len(ids), chunk):
        stop = detok.add_tokens(ids[i : i + chunk])
        assert "\ufffd" not in detok.output_text
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_reassembles_exactly(hf_tokenizer, tokenizer, prompt_ids, text, chunk):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # multi-byte chars really are split across tokens
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    deltas, stop = stream(d, ids, chunk)
    assert stop is None
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == d.output_text == hf_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_partial_utf8_is_held(hf_tokenizer, prompt_ids):
    ids = hf_tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(hf_tokenizer, prompt_ids, SamplingParams())
    d.add_tokens(ids[:1])
    assert d.output_text == "" and d.get_delta(finished=True) == ""
    d.add_tokens(ids[1:])
    assert d.output_text == "🙂" and d.get_delta() == "🙂"


def test_offset_backend_is_incremental(hf_tokenizer, prompt_ids):
    text = " ".join(["The quick brown fox 🦊 jumps over 日本語 the lazy dog."] * 20)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    slow = SlowTokenizer(hf_tokenizer)
    d = IncrementalDetokenizer(slow, prompt_ids, SamplingParams())
    stream(d, ids)
    assert d.output_text == text
    assert len(ids) > 300
    assert max(slow.window_sizes) <= 12  # a small window, not the whole output


def test_special_tokens(hf_tokenizer, prompt_ids):
    ids = hf_tokenizer.encode("Hello", add_special_tokens=False)
    special = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    seq = ids + [special] + hf_tokenizer.encode(" world", add_special_tokens=False)
    for tok in (hf_tokenizer, SlowTokenizer(hf_tokenizer)):
        skip = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
        stream(skip, seq)
        assert skip.output_text == "Hello world"
        keep = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=False))
        stream(keep, seq)
        assert keep.output_text == "Hello<|im_end|> world"


def _split_stop_case(hf_tokenizer, text: str, stop: str) -> list[int]:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    pieces = [hf_tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "stop must span several tokens for this test"
    return ids


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_split_across_tokens(hf_tokenizer, tokenizer, prompt_ids, chunk):
    text = "Sure! The answer is forty-two. ###END### trailing text"
    stop = "###END###"
    ids = _split_stop_case(hf_tokenizer, text, stop)
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[stop]))
    deltas, matched = stream(d, ids, chunk)
    assert matched == stop and d.stop_str == stop
    assert d.output_text == "Sure! The answer is forty-two. "
    assert "".join(deltas) == d.output_text
    assert not any("#" in x for x in deltas)  # not even a prefix of the stop string leaked
    # later calls are ignored
    assert d.add_tokens(ids[-2:]) is None and d.output_text == "Sure! The answer is forty-two. "


def test_include_stop_str_in_output(hf_tokenizer, tokenizer, prompt_ids):
    text = "Sure! The answer is forty-two. ###END### trailing text"
    stop = "###END###"
    ids = _split_stop_case(hf_tokenizer, text, stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    d = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, matched = stream(d, ids)
    assert matched == stop
    assert d.output_text == "Sure! The answer is forty-two. ###END###"
    assert "".join(deltas) == d.output_text


def test_stop_string_in_multibyte_text(hf_tokenizer, prompt_ids):
    text = "今日は良い天気ですね。🙂明日も晴れ"
    stop = "🙂明"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(hf_tokenizer, prompt_ids, SamplingParams(stop=[stop]))
    deltas, matched = stream(d, ids)
    assert matched == stop
    assert d.output_text == "今日は良い天気ですね。"
    assert "".join(deltas) == d.output_text
    assert all("🙂" not in x for x in deltas)


def test_several_stops_earliest_wins(hf_tokenizer, tokenizer, prompt_ids):
    text = "alpha beta gamma delta"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    # all at once: both "gamma" and "beta" are complete; "beta" starts first although listed second
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["gamma", "beta"]))
    assert d.add_tokens(ids) == "beta"
    assert d.output_text == "alpha "
    assert d.get_delta() == "alpha "
    # token by token: same result, and the list order does not matter
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["delta", "gamma", "beta"]))
    deltas, matched = stream(d, ids)
    assert matched == "beta" and d.output_text == "alpha " == "".join(deltas)


def test_stop_at_start_and_hold_back_flush(hf_tokenizer, prompt_ids):
    ids = hf_tokenizer.encode("STOP now", add_special_tokens=False)
    d = IncrementalDetokenizer(hf_tokenizer, prompt_ids, SamplingParams(stop=["STOP"]))
    deltas, matched = stream(d, ids)
    assert matched == "STOP"
    assert d.output_text == ""
    assert deltas == ["", ""]
    # a text that ends with a stop-string prefix: held while streaming, flushed when finished
    ids = hf_tokenizer.encode("The end is ST", add_special_tokens=False)
    d = IncrementalDetokenizer(hf_tokenizer, prompt_ids, SamplingParams(stop=["STOP"]))
    for i in ids:
        assert d.add_tokens([i]) is None
    streamed = d.get_delta()
    assert streamed == "The end is "
    assert d.get_delta(finished=True) == "ST"
    assert d.output_text == "The end is ST"


ALPHABET = "ab é日🙂\n"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=ALPHABET, min_size=0, max_size=40),
    stop=st.text(alphabet=ALPHABET, min_size=1, max_size=4),
    include=st.booleans(),
)
def test_stream_property(hf_tokenizer, prompt_ids, text, stop, include):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    full = hf_tokenizer.decode(ids, skip_special_tokens=True)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    d = IncrementalDetokenizer(hf_tokenizer, prompt_ids, params)
    deltas, matched = stream(d, ids)
    pos = full.find(stop)
    if pos == -1:
        assert matched is None and d.output_text == full
    else:
        assert matched == stop
        assert d.output_text == (full[: pos + len(stop)] if include else full[:pos])
    assert "".join(deltas) == d.output_text
    streamed_before_stop = "".join(deltas[:-2]) if matched else "".join(deltas[:-1])
    assert stop not in streamed_before_stop
    assert all("\ufffd" not in x for x in deltas)
