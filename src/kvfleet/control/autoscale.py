"""The autoscaling policy of engine pools, shared by the local supervisor (``kvfleet up``) and the
Kubernetes rendering (KEDA ScaledObject / HPA in :mod:`kvfleet.control.k8s.scaling`).

What KEDA and the HorizontalPodAutoscaler do with the rendered objects, as one pure function
(:func:`decide`) that the local supervisor calls with what it scrapes:

- **metric**: the pool's total of ``spec.autoscaling.metric`` (``vllm:num_requests_waiting`` by
  default) over its ready replicas, plus the requests the router holds for want of an endpoint.
- **recommendation**: ``ceil(total / target)`` replicas, as an HPA computes for an
  ``AverageValue`` target (KEDA's ``threshold``), kept at the current count while
  ``total / (replicas * target)`` is within :data:`TOLERANCE` of 1 (the HPA's tolerance), and
  clamped to ``[minReplicas, maxReplicas]``.
- **stabilization**: scale up at once (window :data:`SCALE_UP_WINDOW_S` = 0: the lowest
  recommendation of the window), scale down to the highest recommendation of the last
  :data:`SCALE_DOWN_WINDOW_S` seconds (the HPA's default ``scaleDown.stabilizationWindowSeconds``,
  which the rendering writes too), so a pool grows within one evaluation of a burst and shrinks
  only after demand has stayed low for the whole window.
- **scale to zero** (``minReplicas: 0``, Serverless): KEDA's activation. A pool at zero gets
  replicas as soon as there is demand (the router holds requests: ``--hold-when-empty``); a pool
  with replicas keeps at least one while there is activity and goes to zero after
  ``idleTimeoutSeconds`` without any (KEDA's ``cooldownPeriod``, rendered from the same field).

The configuration is read from the same spec fields by :meth:`AutoscaleConfig.for_pool` as the
rendering reads them, and ``tests/control/test_autoscale.py`` checks that a rendered
ScaledObject carries the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.control.resolve import ResolvedPool, ResolvedService

#: HPA default: scale-down stabilization window, seconds (rendered into ScaledObjects and HPAs).
SCALE_DOWN_WINDOW_S = 300
#: HPA default: scale-up stabilization window, seconds (0 = scale up at once).
SCALE_UP_WINDOW_S = 0
#: HPA default ``--horizontal-pod-autoscaler-tolerance``: no change while the usage ratio is
#: within this fraction of 1.
TOLERANCE = 0.1


@dataclass(frozen=True)
class AutoscaleConfig:
    """The policy's parameters for one pool.

    Attributes:
        min_replicas, max_replicas: replica bounds (``minReplicas`` 0 = scale to zero).
        target: metric value per replica the pool is sized for (KEDA ``threshold``); > 0.
        metric: the engine metric summed over the pool's replicas (this runtime's name).
        idle_timeout_s: with ``min_replicas == 0``, seconds without activity before the last
            replica goes (KEDA ``cooldownPeriod``).
        scale_down_window_s: scale-down stabilization window, seconds.
        scale_up_window_s: scale-up stabilization window, seconds.
        tolerance: HPA tolerance of the usage ratio (fraction).

    Raises:
        ValueError: ``target <= 0``, negative windows or bounds, or ``max_replicas < max(min_replicas, 1)``.
    """

    min_replicas: int
    max_replicas: int
    target: float
    metric: str = "vllm:num_requests_waiting"
    idle_timeout_s: float = 300.0
    scale_down_window_s: float = SCALE_DOWN_WINDOW_S
    scale_up_window_s: float = SCALE_UP_WINDOW_S
    tolerance: float = TOLERANCE

    def __post_init__(self) -> None:
        if not self.target > 0:
            raise ValueError(f"target must be > 0, got {self.target}")
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        for name in ("idle_timeout_s", "scale_down_window_s", "scale_up_window_s", "tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def for_pool(cls, rs: ResolvedService, pool: ResolvedPool, **overrides: float) -> AutoscaleConfig:
        """The configuration of ``pool`` from ``spec.autoscaling`` and the pool's bounds: the
        fields the KEDA ScaledObject is rendered from (``target`` -> ``threshold``,
        ``idleTimeoutSeconds`` -> ``cooldownPeriod``, the runtime's name of ``metric``).

        Args:
            rs: the resolved service.
            pool: one of ``rs.pools``.
            overrides: e.g. ``scale_down_window_s=30`` for a local fleet.
        """
        auto = rs.service.spec.autoscaling
        base = cls(min_replicas=pool.min_replicas, max_replicas=pool.max_replicas, target=float(auto.target),
                   metric=rs.runtime.spec.metric(auto.metric), idle_timeout_s=float(auto.idle_timeout_seconds))
        return replace(base, **overrides)


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw at one evaluation.

    Attributes:
        now: time of the observation, seconds (any monotonic clock).
        replicas: the pool's current replicas (starting, ready or waiting to restart; not those
            draining away).
        metric_total: the pool's total of the metric over its ready replicas (requests).
        queued: requests the router holds (no endpoint yet, or all saturated).
        busy: any request in flight in the pool (running in an engine or sent by the router),
            or routed since the last observation.
    """

    now: float
    replicas: int
    metric_total: float = 0.0
    queued: float = 0.0
    busy: bool = False


@dataclass(frozen=True)
class AutoscaleState:
    """What the policy remembers between evaluations (start with ``AutoscaleState()``).

    Attributes:
        history: ``(time, recommendation)`` of the evaluations inside the longest window.
        last_active: time of the last observation with demand or activity, or ``None``.
    """

    history: tuple[tuple[float, int], ...] = field(default_factory=tuple)
    last_active: float | None = None


@dataclass(frozen=True)
class Decision:
    """The result of :func:`decide`.

    Attributes:
        desired: replicas the pool should have.
        recommendation: the raw (unstabilized, clamped) recommendation of this observation.
        state: the state to pass to the next call.
        reason: one line on why (for logs).
    """

    desired: int
    recommendation: int
    state: AutoscaleState
    reason: str


def recommend(config: AutoscaleConfig, replicas: int, demand: float) -> int:
    """The HPA recommendation for ``demand`` (metric total) with ``replicas`` running, before
    the replica floor and stabilization: ``ceil(demand / target)``, or ``replicas`` while the
    usage ratio is within the tolerance; at most ``max_replicas``."""
    if demand <= 0:
        return 0
    if replicas > 0 and abs(demand / (replicas * config.target) - 1.0) <= config.tolerance:
        return min(replicas, config.max_replicas)
    return min(math.ceil(demand / config.target - 1e-9), config.max_replicas)


def decide(config: AutoscaleConfig, state: AutoscaleState, obs: Observation) -> Decision:
    """One evaluation of the policy (see the module docstring). Pure: same inputs, same output.

    Args:
        config: the pool's parameters.
        state: what the previous call returned (``AutoscaleState()`` at first).
        obs: the observation; ``obs.now`` must not go backwards between calls.

    Returns:
        The desired replica count, in ``[0, max_replicas]`` and at least ``min_replicas``.

    Raises:
        ValueError: ``obs.now`` earlier than the last observation, or a negative count.
    """
    if state.history and obs.now < state.history[-1][0]:
        raise ValueError(f"observation at {obs.now} is earlier than the last one ({state.history[-1][0]})")
    if obs.replicas < 0 or obs.metric_total < 0 or obs.queued < 0:
        raise ValueError(f"negative observation: {obs}")
    demand = obs.metric_total + obs.queued
    active = demand > 0 or obs.busy
    last_active = obs.now if active else state.last_active
    raw = recommend(config, obs.replicas, demand)

    if config.min_replicas == 0:
        idle_for = math.inf if last_active is None else obs.now - last_active
        if obs.replicas == 0:
            if not active:
                return Decision(0, 0, AutoscaleState((), last_active), "idle at zero")
            desired = max(1, raw)
            return Decision(desired, desired, AutoscaleState(((obs.now, desired),), last_active),
                            f"activation: demand {demand:g} with no replica")
        if idle_for >= config.idle_timeout_s:
            return Decision(0, 0, AutoscaleState((), last_active),
                            f"no activity for {config.idle_timeout_s:g} s: scale to zero")
        floor = 1
    else:
        floor = config.min_replicas
    rec = max(floor, min(raw, config.max_replicas))

    horizon = max(config.scale_down_window_s, config.scale_up_window_s)
    history = tuple((t, r) for t, r in state.history if obs.now - t <= horizon) + ((obs.now, rec),)
    new_state = AutoscaleState(history, last_active)
    current = obs.replicas
    why = f"demand {demand:g} / target {config.target:g} -> {rec}"
    if rec > current:
        up = min(r for t, r in history if obs.now - t <= config.scale_up_window_s)
        return Decision(max(current, up), rec, new_state, why)
    if rec < current:
        down = max(r for t, r in history if obs.now - t <= config.scale_down_window_s)
        return Decision(max(min(current, down), floor), rec, new_state,
                        why + (f" (held at {min(current, down)} by the {config.scale_down_window_s:g} s "
                               "scale-down window)" if down > rec else ""))
    return Decision(current, rec, new_state, why)
