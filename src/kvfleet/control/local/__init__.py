"""The local fleet: ``kvfleet up`` runs an InferenceService as processes on this machine (engine
replicas per pool, the router in front, a supervisor that restarts, autoscales and drains),
``kvfleet status`` reports on it and ``kvfleet down`` stops it.

- :mod:`~kvfleet.control.local.models`: find / fetch the weights and check their sha256;
- :mod:`~kvfleet.control.local.plan`: the command lines (from the runtime's template);
- :mod:`~kvfleet.control.local.supervisor`: the supervision loop;
- :mod:`~kvfleet.control.local.state`: the state folder ``kvfleet status`` / ``down`` read;
- :mod:`~kvfleet.control.local.probe` and :mod:`~kvfleet.control.local.status`: metrics and the report.
"""

from kvfleet.control.local.models import fetch_pypi, local_model_path
from kvfleet.control.local.plan import FleetPlan, PoolPlan, local_argv, plan_fleet
from kvfleet.control.local.probe import EngineSample, RouterSample, parse_engine_sample, parse_router_sample
from kvfleet.control.local.state import FleetError, fleet_dir, fleets_root, list_fleets, read_state
from kvfleet.control.local.status import format_status, live_status
from kvfleet.control.local.supervisor import (
    Replica,
    Supervisor,
    SupervisorOptions,
    describe_exit,
    popen_spawner,
    restart_delay,
)

__all__ = [
    "EngineSample", "FleetError", "FleetPlan", "PoolPlan", "Replica", "RouterSample", "Supervisor",
    "SupervisorOptions", "describe_exit", "fetch_pypi", "fleet_dir", "fleets_root", "format_status", "list_fleets",
    "live_status", "local_argv", "local_model_path", "parse_engine_sample", "parse_router_sample", "plan_fleet",
    "popen_spawner", "read_state", "restart_delay",
]
