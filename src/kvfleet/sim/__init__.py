"""kvfleet's SIMULATED engine (like llm-d's inference simulator), for router scale tests.

No model is loaded. Behind the real OpenAI-compatible API shapes sit kvfleet's real scheduler and
KV cache manager (prefix caching included), stepped by an asyncio task that sleeps a calibrated
step time instead of running a forward pass and emits fake tokens. Many engines fit in one
process on one event loop.

- :mod:`kvfleet.sim.latency`: the step-latency model and its least-squares fit.
- :mod:`kvfleet.sim.tokenizer`: the deterministic simulated tokenizer and fake text.
- :mod:`kvfleet.sim.engine`: :class:`SimEngine`, the async core loop.
- :mod:`kvfleet.sim.app`: the FastAPI app (``create_sim_app``).
- :mod:`kvfleet.sim.fleet`: N engines on N ports in one loop (:class:`SimFleet`, async) or on a
  background thread (:class:`SimFleetThread`, sync; what tests and benchmarks use).
- :mod:`kvfleet.sim.cli`: ``kvfleet sim-engine``.

Example::

    from kvfleet.sim import SimEngineConfig, SimFleetThread

    with SimFleetThread(8, SimEngineConfig(time_scale=0.1)) as fleet:
        print(fleet.urls)  # ['http://127.0.0.1:41235', ...]; OpenAI API under /v1
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.sim.engine import SimEngine, SimEngineConfig
    from kvfleet.sim.fleet import SimFleet, SimFleetThread
    from kvfleet.sim.latency import DEFAULT_LATENCY, LatencyModel
    from kvfleet.sim.tokenizer import SimTokenizer

_EXPORTS = {
    "SimEngine": "kvfleet.sim.engine", "SimEngineConfig": "kvfleet.sim.engine",
    "SimFleet": "kvfleet.sim.fleet", "SimFleetThread": "kvfleet.sim.fleet",
    "LatencyModel": "kvfleet.sim.latency", "DEFAULT_LATENCY": "kvfleet.sim.latency",
    "SimTokenizer": "kvfleet.sim.tokenizer",
}
__all__ = ["DEFAULT_LATENCY", "LatencyModel", "SimEngine", "SimEngineConfig", "SimFleet", "SimFleetThread",
           "SimTokenizer"]


def __getattr__(name: str) -> Any:
    """Import the public names lazily (``kvfleet --help`` should not load the web stack)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfleet.sim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
