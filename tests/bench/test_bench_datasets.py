"""Dataset generators: determinism, shapes, shared prefixes, multi-turn histories, ShareGPT files."""

from __future__ import annotations

import json

import pytest

from kvfleet.bench.datasets import (
    DatasetError,
    MultiTurnDataset,
    RandomDataset,
    SharedPrefixDataset,
    ShareGPTDataset,
    TokenTextMaker,
)


@pytest.fixture(scope="module")
def maker(hf_tokenizer):
    return TokenTextMaker(hf_tokenizer)


def test_token_text_has_the_asked_length(maker):
    import random

    rng = random.Random(0)
    for n in (1, 7, 64, 300):
        text = maker.make(rng, n)
        assert abs(maker.count(text) - n) <= 2, (n, maker.count(text))
    assert maker.make(rng, 0) == ""


def test_random_is_seeded_and_fresh_per_run(maker):
    ds = RandomDataset(input_len=48, output_len=16, range_ratio=0.5, seed=3)
    a = ds.sample(maker, 6, run_index=0)
    b = ds.sample(maker, 6, run_index=0)
    c = ds.sample(maker, 6, run_index=1)
    d = RandomDataset(input_len=48, output_len=16, range_ratio=0.5, seed=4).sample(maker, 6, run_index=0)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert not {r.prompt for r in a} & {r.prompt for r in c}  # fresh prompts in the next run
    assert [r.prompt for r in a] != [r.prompt for r in d]
    assert len(a) == 6
    for r in a:
        assert 24 <= r.output_len <= 24 or 8 <= r.output_len <= 24
        assert 24 - 2 <= r.prompt_len <= 72 + 2
        assert r.prompt_len == maker.count(r.prompt)
        assert r.messages == [{"role": "user", "content": r.prompt}]
    fixed = RandomDataset(input_len=32, output_len=5).sample(maker, 4)
    assert all(r.output_len == 5 and abs(r.prompt_len - 32) <= 2 for r in fixed)


def test_shared_prefix_is_really_shared(maker):
    ds = SharedPrefixDataset(num_tenants=3, system_prompt_len=64, questions_per_tenant=4, question_len=8,
                             output_len=4, seed=1)
    reqs = ds.sample(maker)
    assert len(reqs) == ds.num_requests == 12
    assert [r.prompt for r in reqs] == [r.prompt for r in ds.sample(maker)]
    by_tenant: dict[str, list] = {}
    for r in reqs:
        by_tenant.setdefault(r.tag.split("/")[0], []).append(r)
    assert len(by_tenant) == 3 and all(len(v) == 4 for v in by_tenant.values())
    systems = set()
    for rs in by_tenant.values():
        system = rs[0].messages[0]["content"]
        assert all(r.messages[0] == {"role": "system", "content": system} for r in rs)
        assert all(r.prompt.startswith(system) for r in rs)
        assert len({r.messages[1]["content"] for r in rs}) == 4  # distinct questions
        assert abs(maker.count(system) - 64) <= 2
        # the token ids of the shared prefix are identical across the tenant's prompts
        ids = [maker.tokenizer.encode(r.prompt, add_special_tokens=False) for r in rs]
        common = 0
        while all(len(x) > common and x[common] == ids[0][common] for x in ids):
            common += 1
        assert common >= 60
        systems.add(system)
    assert len(systems) == 3
    # interleaved: not all of one tenant first
    assert [r.tag.split("/")[0] for r in reqs][:4] != [reqs[0].tag.split("/")[0]] * 4


def test_multi_turn_resends_history(maker):
    ds = MultiTurnDataset(num_conversations=2, num_turns=3, user_len=12, output_len=4, seed=0)
    convs = ds.sample(maker)
    assert len(convs) == 2 and ds.num_requests == 6
    c = convs[0]
    r0 = c.next_request()
    assert r0.messages == [{"role": "user", "content": c.user_turns[0]}] and r0.tag == "conv0/turn0"
    c.record_reply("first reply")
    r1 = c.next_request()
    assert r1.messages == [{"role": "user", "content": c.user_turns[0]},
                           {"role": "assistant", "content": "first reply"},
                           {"role": "user", "content": c.user_turns[1]}]
    assert r1.prompt_len > r0.prompt_len
    assert "first reply" in r1.prompt
    c.record_reply("second reply")
    r2 = c.next_request()
    assert len(r2.messages) == 5 and r2.messages[3]["content"] == "second reply"
    c.record_reply("third")
    with pytest.raises(DatasetError, match="no turn"):
        c.next_request()
    with pytest.raises(DatasetError, match="no turn is waiting"):
        c.record_reply("x")
    # seeded: the same user turns again
    assert [x.user_turns for x in ds.sample(maker)] == [x.user_turns for x in convs]
    assert convs[0].user_turns != convs[1].user_turns


def _write(tmp_path, obj, name="sg.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_sharegpt_parsing(tmp_path, maker):
    long_q = "Explain how a paged KV cache works in a language model server, in detail please."
    long_a = "A paged KV cache stores keys and values in fixed-size blocks addressed through block tables."
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": long_q}, {"from": "gpt", "value": long_a}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}]},  # one turn: skipped
        {"id": "c", "conversations": [{"from": "gpt", "value": long_a}, {"from": "human", "value": long_q}]},
        {"id": "d", "conversations": [{"from": "user", "value": long_q + " Again."},
                                      {"from": "assistant", "value": long_a + " Again."}]},
        {"id": "e", "conversations": [{"from": "human", "value": "ok"}, {"from": "gpt", "value": "ok"}]},  # short
        "junk",
    ]
    ds = ShareGPTDataset(_write(tmp_path, data), seed=0)
    assert len(ds.records) == 3  # a, d, e parse; e is filtered by length at sampling
    reqs = ds.sample(maker, 10)
    assert sorted(r.prompt for r in reqs) == sorted([long_q, long_q + " Again."])
    for r in reqs:
        assert r.output_len == maker.count(long_a if r.prompt == long_q else long_a + " Again.")
        assert r.prompt_len == maker.count(r.prompt)
    assert len(ds.sample(maker, 1)) == 1
    fixed = ShareGPTDataset(_write(tmp_path, data), output_len=7).sample(maker, 10)
    assert {r.output_len for r in fixed} == {7}


def test_sharegpt_bad_files(tmp_path, maker):
    with pytest.raises(DatasetError, match="not found"):
        ShareGPTDataset(str(tmp_path / "missing.json"))
    with pytest.raises(DatasetError, match="not valid JSON"):
        ShareGPTDataset(_write(tmp_path, "{not json"))
    with pytest.raises(DatasetError, match="JSON list"):
        ShareGPTDataset(_write(tmp_path, {"conversations": []}))
    with pytest.raises(DatasetError, match="no record"):
        ShareGPTDataset(_write(tmp_path, [{"conversations": [{"from": "human", "value": "x"}]}]))
    tiny = [{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}]
    with pytest.raises(DatasetError, match="fits the limits"):
        ShareGPTDataset(_write(tmp_path, tiny)).sample(maker, 3)


@pytest.mark.parametrize("factory", [
    lambda: RandomDataset(input_len=0),
    lambda: RandomDataset(range_ratio=1.0),
    lambda: SharedPrefixDataset(num_tenants=0),
    lambda: SharedPrefixDataset(system_prompt_len=-5),
    lambda: MultiTurnDataset(num_turns=0),
    lambda: ShareGPTDataset("x.json", output_len=0),
])
def test_bad_parameters(factory):
    with pytest.raises(DatasetError):
        factory()


def test_bad_num_prompts(maker):
    with pytest.raises(DatasetError, match="number of prompts"):
        RandomDataset().sample(maker, 0)
