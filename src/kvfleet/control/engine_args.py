"""Engine command lines from a runtime's template and a pool's engine args.

The same function serves Kubernetes containers (model path under ``/models``) and the local
supervisor (a path on this machine). See :mod:`kvfleet.control.api.runtime` for the template
mechanism: placeholders in ``args``, ``engineArgFlags`` per common engine arg, role args for
prefill/decode pools and LeaderWorkerSet leaders/workers.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet.control.api.components import EngineArgs
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.quantity import quantity_bytes
from kvfleet.control.api.runtime import PLACEHOLDERS, ServingRuntimeSpec

_PH = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: roles a container can play.
ROLES = ("engine", "prefill", "decode", "leader", "worker")
#: engine args whose value is a Kubernetes quantity, passed as a byte count.
_BYTE_ARGS = {"kvCacheMemory"}


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as the engine sees it: served ``name``, folder ``path``, LoRA ``rank``."""

    name: str
    path: str
    rank: int


@dataclass(frozen=True)
class ContainerCommand:
    """A container's ``command`` and ``args`` (Kubernetes semantics: args follow command)."""

    command: list[str]
    args: list[str]

    @property
    def argv(self) -> list[str]:
        """``command + args``."""
        return [*self.command, *self.args]


def substitute(text: str, values: dict[str, Any], extra: Sequence[str] = ()) -> str:
    """Replace ``{name}`` placeholders of :data:`PLACEHOLDERS` (and ``extra``) in ``text``.

    Raises:
        ValueError: an identifier placeholder that is not known.
    """

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in PLACEHOLDERS and name not in extra:
            raise ValueError(f"unknown placeholder {{{name}}} in {text!r}")
        return str(values[name])

    return _PH.sub(repl, text)


def _format(value: Any, alias: str) -> str:
    if alias in _BYTE_ARGS:
        return str(quantity_bytes(value))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def engine_arg_flags(runtime: ServingRuntimeSpec, args: EngineArgs, adapters: Sequence[Adapter] = (),
                     field: str = "spec.engine.engineArgs", runtime_name: str = "runtime") -> list[str]:
    """The flags of the set engine args (in :class:`EngineArgs` field order), then LoRA flags.

    Raises:
        SpecError: a set arg (or LoRA adapters) the runtime has no flag for.
    """
    values: list[tuple[str, Any]] = []
    for name, f in type(args).model_fields.items():
        v = getattr(args, name)
        if name != "extra_args" and v is not None:
            values.append((f.alias or name, v))
    if adapters:
        values += [("enableLora", True), ("loraModules", [f"{a.name}={a.path}" for a in adapters]),
                   ("maxLoraRank", max(a.rank for a in adapters))]
    out: list[str] = []
    for alias, v in values:
        rule = runtime.engine_arg_flags.get(alias)
        if rule is None:
            if alias == "enableLora":  # an engine that serves adapters without a switch
                continue
            where = "spec.fineTunedWeights" if alias in ("loraModules", "maxLoraRank") else f"{field}.{alias}"
            raise SpecError(where, f"{runtime_name} (engine {runtime.engine}) has no flag for it")
        if isinstance(v, bool):
            out += (rule.if_true or []) if v else (rule.if_false or [])
        elif rule.flag is None:
            raise SpecError(f"{field}.{alias}", f"{runtime_name} maps it to a switch, not a valued flag")
        elif isinstance(v, list):
            out += [rule.flag, *(str(x) for x in v)]
        else:
            out += [rule.flag, _format(v, alias)]
    return out


def engine_command(runtime: ServingRuntimeSpec, *, model_path: str, served_model_name: str,
                   engine_args: EngineArgs | None = None, role: str = "engine", adapters: Sequence[Adapter] = (),
                   group_size: int = 1, port: int | None = None, field: str = "spec.engine.engineArgs",
                   runtime_name: str = "runtime") -> ContainerCommand:
    """The container command of one engine process.

    Order: ``runtime.command``, the ``args`` template, the role's args (``prefillArgs`` /
    ``decodeArgs`` / ``leaderArgs`` / ``workerArgs``), the mapped engine args, LoRA flags, then
    ``extraArgs`` -- so a flag the user sets wins over a template default in engines whose
    parsers keep the last value. A leader or worker with its own ``leaderCommand`` /
    ``workerCommand`` runs that instead (``{engineCommand}`` = the engine command line, quoted).

    Args:
        runtime: the runtime spec.
        model_path: where the weights are, as the process sees them.
        served_model_name: the model name clients send.
        engine_args: the pool's engine args.
        role: one of :data:`ROLES`.
        adapters: LoRA adapters to serve.
        group_size: pods per replica (``{groupSize}``).
        port: HTTP port (default: the runtime's).
        field, runtime_name: for error messages.

    Raises:
        ValueError: an unknown role.
        SpecError: an engine arg the runtime has no flag for.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    engine_args = engine_args or EngineArgs()
    values = {"modelPath": model_path, "port": port or runtime.port, "servedModelName": served_model_name,
              "groupSize": group_size}
    pd, mn = runtime.prefill_decode, runtime.multi_node
    role_args = {"prefill": pd.prefill_args if pd else [], "decode": pd.decode_args if pd else [],
                 "leader": mn.leader_args if mn else [], "worker": mn.worker_args if mn else []}.get(role, [])
    args = [substitute(a, values) for a in [*runtime.args, *role_args]]
    args += engine_arg_flags(runtime, engine_args, adapters, field, runtime_name)
    args += list(engine_args.extra_args)
    cmd = ContainerCommand(list(runtime.command), args)
    wrapper = (mn.leader_command if role == "leader" else mn.worker_command if role == "worker" else None) if mn \
        else None
    if wrapper:
        values = {**values, "engineCommand": shlex.join(cmd.argv)}
        return ContainerCommand([substitute(a, values, extra=("engineCommand",)) for a in wrapper], [])
    return cmd
