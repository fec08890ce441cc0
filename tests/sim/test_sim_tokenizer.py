"""The simulated tokenizer: deterministic (across processes), prefix-stable, ~4 characters a token."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.sim.tokenizer import CHARS_PER_TOKEN, WORDS, SimTokenizer

TOK = SimTokenizer()


def test_known_ids_are_stable_across_versions_and_processes():
    # Fixed expected ids: a change of the hash (e.g. to Python's salted hash()) fails here.
    assert TOK.encode("Hello, world! kvfleet") == [28637, 18416, 34205, 14274, 36786, 6824]
    code = "from kvfleet.sim.tokenizer import SimTokenizer; print(SimTokenizer().encode('Hello, world! kvfleet'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"}).stdout
    assert out.strip() == "[28637, 18416, 34205, 14274, 36786, 6824]"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.text(max_size=50))
def test_prefix_stable_and_length(text, more):
    ids = TOK.encode(text)
    assert ids == TOK.encode(text)  # deterministic
    assert len(ids) == TOK.num_tokens(text) == -(-len(text) // CHARS_PER_TOKEN)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    # A longer text with the same start shares every full 4-character piece of it.
    full = len(text) // CHARS_PER_TOKEN
    assert TOK.encode(text + more)[:full] == ids[:full]


def test_about_four_characters_per_token_on_english():
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert len(TOK.encode(text)) == 225  # 900 characters / 4
    assert TOK.encode("") == []
    assert TOK.encode("\ud800 lone surrogate")  # never raises


def test_chat_rendering():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None}]
    assert TOK.render_chat(msgs) == "system: Be brief.\nuser: Hi\nassistant: \nassistant: "
    assert TOK.render_chat(msgs[:2], add_generation_prompt=False) == "system: Be brief.\nuser: Hi\n"
    # A conversation extended by a turn keeps the token prefix of the earlier turns.
    short = TOK.encode(TOK.render_chat(msgs[:2], add_generation_prompt=False))
    longer = TOK.encode(TOK.render_chat([*msgs[:2], {"role": "user", "content": "More"}]))
    assert longer[: len(short) - 1] == short[:-1]


def test_generated_tokens_are_deterministic_words():
    seed = TOK.prompt_seed([1, 2, 3])
    toks = [TOK.generated_token(seed, i) for i in range(50)]
    assert toks == [TOK.generated_token(seed, i) for i in range(50)]
    assert toks[:2] == [(30659, " part"), (40905, " to")]
    for tid, text in toks:
        assert text[0] == " " and text[1:] in WORDS and tid == TOK.piece_id(text)
    assert len({t for _, t in toks}) > 10  # not one repeated word
    other = [TOK.generated_token(TOK.prompt_seed([1, 2, 4]), i) for i in range(50)]
    assert other != toks  # another prompt, another completion
