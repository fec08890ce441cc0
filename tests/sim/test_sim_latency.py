"""The simulator's latency model: step-time arithmetic, the least-squares fit, profiles, and the
work counted from real scheduler outputs."""

from __future__ import annotations

import json
import math

import pytest

from kvfleet.config import SchedulerConfig
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.request import Request
from kvfleet.sampling_params import SamplingParams
from kvfleet.sim.engine import step_work
from kvfleet.sim.latency import DEFAULT_LATENCY, LatencyModel, StepWork, fit_latency_model

M = LatencyModel(base_s=0.05, prefill_s_per_token=0.002, decode_s_per_seq=0.004, kv_read_s_per_token=1e-5,
                 single_token_base_s=0.03)


def test_step_time_arithmetic():
    assert M.step_time(StepWork()) == 0.0  # nothing to compute: no sleep
    assert M.step_time(StepWork(prefill_tokens=100)) == pytest.approx(0.05 + 0.2)
    assert M.step_time(StepWork(decode_seqs=8)) == pytest.approx(0.05 + 0.032)
    assert M.step_time(StepWork(100, 8, 2000)) == pytest.approx(0.05 + 0.2 + 0.032 + 0.02)
    # a step computing exactly one token has the one-token base
    assert M.step_time(StepWork(0, 1, 300)) == pytest.approx(0.03 + 0.004 + 0.003)
    assert M.step_time(StepWork(1, 0, 300)) == pytest.approx(0.03 + 0.002 + 0.003)
    assert M.step_time(StepWork(0, 2, 0)) == pytest.approx(0.05 + 0.008)
    # KV reads alone (no token computed) cost nothing: such a step does not exist.
    assert M.step_time(StepWork(0, 0, 500)) == 0.0
    with pytest.raises(ValueError):
        M.step_time(StepWork(-1, 0, 0))
    # without a one-token base, every step has base_s
    m = LatencyModel(base_s=0.05, prefill_s_per_token=0.0, decode_s_per_seq=0.0)
    assert m.single_token_base_s == 0.05 and m.step_time(StepWork(0, 1, 0)) == 0.05


def test_defaults_are_calibrated_numbers():
    d = DEFAULT_LATENCY
    assert d.base_s > 0 and d.prefill_s_per_token > 0 and d.decode_s_per_seq > 0 and d.kv_read_s_per_token > 0
    assert "calibrate_sim.py" in d.source
    # decode is memory-bound: one more decode sequence costs far less than a whole step, and a
    # one-token step (matrix-vector products) is cheaper than a batch
    assert d.decode_s_per_seq < d.base_s / 10
    assert d.single_token_base_s < d.base_s


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1"])
def test_bad_parameters_rejected(bad):
    with pytest.raises(ValueError):
        LatencyModel(base_s=bad, prefill_s_per_token=0.0, decode_s_per_seq=0.0)


def test_overrides_and_profiles(tmp_path):
    m = M.with_overrides(base_s=0.5, decode_s_per_seq=None)
    assert (m.base_s, m.decode_s_per_seq) == (0.5, M.decode_s_per_seq)
    assert "overridden: base_s" in m.source
    assert M.with_overrides() is M
    with pytest.raises(ValueError, match="unknown"):
        M.with_overrides(nope=1.0)

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**M.to_dict(), "samples": [1, 2]}))
    assert LatencyModel.load(path) == M
    path.write_text(json.dumps({"base_s": 0.1, "prefill_s_per_token": 0.0, "decode_s_per_seq": 0.0}))
    loaded = LatencyModel.load(path)  # optional parameters
    assert loaded.kv_read_s_per_token == 0.0 and loaded.single_token_base_s == 0.1
    path.write_text(json.dumps({"base_s": 0.1}))
    with pytest.raises(ValueError, match="lacks"):
        LatencyModel.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        LatencyModel.load(path)
    with pytest.raises(FileNotFoundError):
        LatencyModel.load(tmp_path / "missing.json")


def _samples(model: LatencyModel) -> list[tuple[StepWork, float]]:
    works = [StepWork(p, 0, 0) for p in (16, 64, 256, 1024)]  # (b = 1 decodes below: one-token steps)
    works += [StepWork(0, b, b * c) for b in (1, 2, 4, 8, 16) for c in (128, 1024)]
    return [(w, model.step_time(w)) for w in works]


def test_fit_recovers_exact_parameters():
    fit = fit_latency_model(_samples(M), source="synthetic")
    for name in ("base_s", "single_token_base_s", "prefill_s_per_token", "decode_s_per_seq", "kv_read_s_per_token"):
        assert getattr(fit, name) == pytest.approx(getattr(M, name), rel=1e-6)
    assert fit.source == "synthetic"


def test_fit_clamps_a_negative_parameter_to_zero():
    # Times that fall with the decode batch would need a negative slope: it is fixed at 0.
    samples = _samples(LatencyModel(0.05, 0.002, 0.0, 1e-5, single_token_base_s=0.03))
    samples = [(w, t - 0.001 * w.decode_seqs) for w, t in samples]
    fit = fit_latency_model(samples)
    assert fit.decode_s_per_seq == 0.0
    assert all(math.isfinite(v) and v >= 0 for v in (fit.base_s, fit.single_token_base_s, fit.prefill_s_per_token,
                                                      fit.kv_read_s_per_token))


def test_fit_rejects_underdetermined_samples():
    with pytest.raises(ValueError, match="at least"):
        fit_latency_model([(StepWork(1, 0, 0), 0.1)])
    only_prefill = [(StepWork(p, 0, 0), 0.1 + p * 1e-3) for p in (1, 2, 3, 4, 5)]
    with pytest.raises(ValueError, match="do not determine"):
        fit_latency_model(only_prefill)
    no_single_token_step = [(w, t) for w, t in _samples(M) if w.prefill_tokens + w.decode_seqs > 1]
    with pytest.raises(ValueError, match="do not determine"):
        fit_latency_model(no_single_token_step)
    with pytest.raises(ValueError, match="> 0"):
        fit_latency_model([(w, 0.0) for w, _ in _samples(M)])


def _req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def test_step_work_counts_prefill_decode_and_kv_reads_of_real_schedules():
    kv = KVCacheManager(64, 16, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=512)
    a = _req("a", list(range(100)))
    sched.add_request(a)
    # 100-token prompt with a 64-token budget: a fresh chunk (reads nothing), then a chunk that
    # reads its first 64 tokens back from the cache.
    assert step_work(sched.schedule()) == StepWork(64, 0, 0)
    out = sched.schedule()
    assert step_work(out) == StepWork(36, 0, 100)
    a.append_output_token(7)
    out = sched.schedule()  # decode at position 100: reads 101 tokens of context
    assert step_work(out) == StepWork(0, 1, 101)
    a.append_output_token(8)
    # Same prompt again: 96 tokens (6 blocks) hit the prefix cache; only 4 are computed, and they
    # read the whole 100-token context.
    b = _req("b", list(range(100)))
    sched.add_request(b)
    out = sched.schedule()
    assert step_work(out) == StepWork(4, 1, 102 + 100)
    assert b.num_cached_tokens == 96
