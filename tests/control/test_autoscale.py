"""The autoscaling policy (kvfleet.control.autoscale) on synthetic timelines -- no clocks, no
processes -- and its agreement with the KEDA / HPA objects the renderer writes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.control.api import Catalog
from kvfleet.control.autoscale import (
    SCALE_DOWN_WINDOW_S,
    AutoscaleConfig,
    AutoscaleState,
    Observation,
    decide,
    recommend,
)
from kvfleet.control.k8s import scaling
from kvfleet.control.resolve import resolve
from tests.control.specs import GGUF_MODEL, service


def run(config: AutoscaleConfig, timeline: list[tuple[float, float, float, bool]], start: int) -> list[int]:
    """Feed ``(t, metric_total, queued, busy)`` observations, applying each decision at once;
    returns the replica count after each step."""
    state, replicas, out = AutoscaleState(), start, []
    for t, metric, queued, busy in timeline:
        d = decide(config, state, Observation(t, replicas, metric, queued, busy))
        state, replicas = d.state, d.desired
        out.append(replicas)
    return out


def test_recommendation_is_ceil_of_total_over_target_within_bounds():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, target=4)
    assert recommend(cfg, 1, 0) == 0
    assert recommend(cfg, 1, 1) == 1
    assert recommend(cfg, 1, 9) == 3
    assert recommend(cfg, 1, 100) == 4  # capped at max
    assert recommend(cfg, 2, 8.5) == 2  # 8.5 / (2 * 4) = 1.06: within the 10% tolerance, no change
    assert recommend(cfg, 2, 9.5) == 3  # 1.19: outside it


def test_burst_scales_up_at_once_and_down_only_after_the_window():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, target=2, scale_down_window_s=30)
    # recommendations: 1, ceil(7/2)=4, 4 (capped), ceil(3/2)=2, then 1 while quiet
    timeline = [(0, 0, 0, False), (1, 7, 0, True), (2, 12, 0, True), (3, 3, 0, True)]
    timeline += [(t, 0, 0, False) for t in (10, 20, 31, 32, 33, 34)]
    got = run(cfg, timeline, start=1)
    assert got[:4] == [1, 4, 4, 4]  # up in one evaluation, to the top
    # down to the highest recommendation of the last 30 s: 4 until t=1 and t=2 leave the window
    # (at 31 and 32 they are exactly 30 s old), then 2 (from t=3), then the floor
    assert got[4:] == [4, 4, 4, 4, 2, 1]


def test_scale_down_follows_the_window_maximum():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=10, target=1, scale_down_window_s=10, tolerance=0)
    # recommendations 6, 3, 2, 1, 1 ... at t = 0, 4, 8, 12, 16, 20
    timeline = [(0, 6, 0, True), (4, 3, 0, True), (8, 2, 0, True), (12, 0, 0, False), (16, 0, 0, False),
                (20, 0, 0, False), (30, 0, 0, False)]
    assert run(cfg, timeline, start=6) == [6, 6, 6, 3, 2, 1, 1]


def test_min_replicas_floor_and_fixed_bounds():
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=3, target=5, scale_down_window_s=0)
    assert run(cfg, [(0, 0, 0, False), (1, 0, 0, False)], start=2) == [2, 2]
    assert run(cfg, [(0, 0, 0, False)], start=0) == [2]  # below the floor: back to min
    assert run(cfg, [(0, 1000, 0, True)], start=2) == [3]


def test_scale_from_zero_on_a_held_request_and_back_after_the_idle_timeout():
    cfg = AutoscaleConfig(min_replicas=0, max_replicas=3, target=4, idle_timeout_s=60, scale_down_window_s=300)
    timeline = [(0, 0, 0, False), (5, 0, 0, False),  # idle at zero
                (6, 0, 1, False),                     # the router holds one request: activation
                (7, 0, 1, False),                     # the replica is starting, still held
                (20, 0, 0, True),                     # served
                (30, 0, 0, False), (79, 0, 0, False),  # idle for 49 s: keep one (floor 1, not min 0)
                (90, 0, 0, False),                    # idle for 60 s: scale to zero (KEDA cooldownPeriod)
                (95, 0, 0, False)]
    assert run(cfg, timeline, start=0) == [0, 0, 1, 1, 1, 1, 1, 0, 0]


def test_scale_from_zero_with_a_burst_of_held_requests_starts_enough_replicas():
    cfg = AutoscaleConfig(min_replicas=0, max_replicas=3, target=4)
    assert run(cfg, [(0, 0, 9, False)], start=0) == [3]
    assert run(cfg, [(0, 0, 2, False)], start=0) == [1]


def test_activity_without_queue_keeps_a_serverless_pool_alive():
    cfg = AutoscaleConfig(min_replicas=0, max_replicas=2, target=4, idle_timeout_s=10)
    # requests keep running (busy) but never queue: the pool stays at one replica
    timeline = [(0, 0, 1, False)] + [(t, 0, 0, True) for t in range(5, 60, 5)] + [(70, 0, 0, False)]
    got = run(cfg, timeline, start=0)
    assert got[:-1] == [1] * (len(timeline) - 1) and got[-1] == 0


def test_decide_is_pure_and_rejects_time_going_backwards():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, target=2)
    s0 = AutoscaleState()
    a = decide(cfg, s0, Observation(10, 1, 5))
    b = decide(cfg, s0, Observation(10, 1, 5))
    assert a == b and s0 == AutoscaleState()
    with pytest.raises(ValueError, match="earlier"):
        decide(cfg, a.state, Observation(9, 3, 0))
    with pytest.raises(ValueError, match="negative"):
        decide(cfg, a.state, Observation(11, -1, 0))


@pytest.mark.parametrize("kwargs", [dict(target=0), dict(min_replicas=3, max_replicas=2), dict(max_replicas=0),
                                    dict(idle_timeout_s=-1)])
def test_bad_config(kwargs):
    base = dict(min_replicas=1, max_replicas=4, target=2)
    with pytest.raises(ValueError):
        AutoscaleConfig(**{**base, **kwargs})


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(1, 6), st.floats(0.5, 10),
       st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50), st.booleans()), min_size=1, max_size=30))
def test_decisions_stay_within_bounds(low, extra, target, steps):
    cfg = AutoscaleConfig(min_replicas=low, max_replicas=low + extra, target=target, scale_down_window_s=5,
                          idle_timeout_s=3)
    timeline = [(float(i), m, q, b) for i, (m, q, b) in enumerate(steps)]
    for n in run(cfg, timeline, start=low):
        assert low <= n <= low + extra


def test_config_from_the_spec_matches_the_rendered_scaled_object():
    docs = [GGUF_MODEL, service("chat", "Standard", "kvfleet", autoscaling={"target": 3, "idleTimeoutSeconds": 90})]
    catalog = Catalog.from_documents(docs)
    rs = resolve(catalog.inference_services()[0], catalog)
    pool = rs.pools[0]
    cfg = AutoscaleConfig.for_pool(rs, pool)
    so = scaling.scaled_object(rs, pool, "http://prom:9090")["spec"]
    assert (cfg.min_replicas, cfg.max_replicas) == (so["minReplicaCount"], so["maxReplicaCount"])
    trigger = so["triggers"][0]["metadata"]
    assert float(trigger["threshold"]) == cfg.target == 3
    assert cfg.metric in trigger["query"]
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == cfg.scale_down_window_s == SCALE_DOWN_WINDOW_S
    hpa = scaling.hpa(rs, pool)["spec"]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == cfg.scale_down_window_s

    serverless = [GGUF_MODEL, service("sl", "Serverless", "kvfleet", autoscaling={"idleTimeoutSeconds": 90})]
    catalog = Catalog.from_documents(serverless)
    rs = resolve(catalog.inference_services()[0], catalog)
    cfg = AutoscaleConfig.for_pool(rs, rs.pools[0], scale_down_window_s=20)
    so = scaling.scaled_object(rs, rs.pools[0], "http://prom:9090")["spec"]
    assert so["minReplicaCount"] == cfg.min_replicas == 0
    assert so["cooldownPeriod"] == cfg.idle_timeout_s == 90
    assert cfg.scale_down_window_s == 20  # a local override leaves the rest as rendered


def test_sglang_metric_name_is_translated():
    from tests.control.specs import HF_MODEL

    catalog = Catalog.from_documents([HF_MODEL, service("s", "Standard", "sglang")])
    rs = resolve(catalog.inference_services()[0], catalog)
    assert AutoscaleConfig.for_pool(rs, rs.pools[0]).metric == "sglang:num_queue_reqs"
