"""Resolve an InferenceService against its references: the model, the runtime (named, or
auto-selected from the model's format and architecture as KServe/OME do), the LoRA adapters, the
deployment mode and each pool's replica bounds, with the cross-resource checks that a single
document cannot make (unknown runtime, a runtime that cannot serve the mode or the format, an
engine arg the runtime has no flag for, an adapter for another base model, a sha256 that does not
match). Rendering (:mod:`kvfleet.control.render`) and the local supervisor both start from the
:class:`ResolvedService` this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfleet.control.api.basemodel import AnyBaseModel
from kvfleet.control.api.catalog import Catalog
from kvfleet.control.api.components import DeploymentMode, PoolSpec, RouterSpec
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.finetuned import FineTunedWeight
from kvfleet.control.api.inference_service import InferenceService
from kvfleet.control.api.runtime import AnyServingRuntime
from kvfleet.control.api.source import ModelSource, fingerprint


@dataclass(frozen=True)
class ResolvedPool:
    """One engine pool with its defaults applied.

    Attributes:
        role: ``engine``, ``prefill`` or ``decode``.
        field: the spec path of the pool (``spec.engine``), for messages.
        spec: the pool spec as written (``PoolSpec()`` when omitted).
        min_replicas, max_replicas: replica bounds (a replica is ``group_size`` pods).
        group_size: pods per replica (1, or the LeaderWorkerSet size for MultiNode).
    """

    role: str
    field: str
    spec: PoolSpec
    min_replicas: int
    max_replicas: int
    group_size: int = 1

    @property
    def autoscaled(self) -> bool:
        """True when the replica count may vary (``maxReplicas > minReplicas``)."""
        return self.max_replicas > self.min_replicas


@dataclass(frozen=True)
class ResolvedService:
    """An InferenceService with its references resolved and validated.

    Attributes:
        service: the InferenceService.
        namespace: its namespace.
        model: the BaseModel or ClusterBaseModel.
        runtime: the ServingRuntime or ClusterServingRuntime (named or auto-selected).
        adapters: the FineTunedWeights, in spec order.
        mode: the deployment mode (given or derived).
        pools: the engine pools (``engine``; or ``prefill`` then ``decode``).
        served_model_name: the model name clients send.
    """

    service: InferenceService
    namespace: str
    model: AnyBaseModel
    runtime: AnyServingRuntime
    adapters: tuple[FineTunedWeight, ...]
    mode: DeploymentMode
    pools: tuple[ResolvedPool, ...]
    served_model_name: str

    @property
    def name(self) -> str:
        """The InferenceService's name."""
        return self.service.metadata.name

    @property
    def router(self) -> RouterSpec:
        """The router spec."""
        return self.service.spec.router

    @property
    def runtime_ref(self) -> str:
        """``Kind/name`` of the runtime (for ``status.runtime``)."""
        return f"{self.runtime.KIND}/{self.runtime.metadata.name}"


def _pools(svc: InferenceService, mode: DeploymentMode) -> tuple[ResolvedPool, ...]:
    spec = svc.spec
    roles = ("prefill", "decode") if mode == "PrefillDecodeDisaggregated" else ("engine",)
    out = []
    for role in roles:
        pool: PoolSpec = getattr(spec, role) or PoolSpec()
        low = pool.min_replicas if pool.min_replicas is not None else (0 if mode == "Serverless" else 1)
        high = pool.max_replicas if pool.max_replicas is not None else max(low, 1)
        size = pool.multi_node.size if (mode == "MultiNode" and pool.multi_node) else 1
        out.append(ResolvedPool(role, f"spec.{role}", pool, low, high, size))
    return tuple(out)


def _select_runtime(svc: InferenceService, model: AnyBaseModel, mode: DeploymentMode,
                    catalog: Catalog, namespace: str) -> AnyServingRuntime:
    fmt, arch = model.spec.format, model.spec.architecture
    what = f"{fmt} models" + (f" of architecture {arch}" if arch else "")
    ref = svc.spec.runtime
    if ref is not None:
        rt = catalog.runtime(ref, namespace)
        if rt.spec.supports(fmt, arch) is None:
            raise SpecError("spec.runtime.name", f"runtime {rt.metadata.name!r} does not serve {what} "
                                                 f"(model {model.metadata.name!r})")
        if mode not in rt.spec.supported_deployment_modes:
            field = "spec.deploymentMode" if svc.spec.deployment_mode else _mode_field(mode)
            raise SpecError(field, f"runtime {rt.metadata.name!r} does not support {mode} (it supports "
                                   f"{', '.join(rt.spec.supported_deployment_modes)})")
        return rt
    best: tuple[int, int, AnyServingRuntime] | None = None
    for order, rt in enumerate(catalog.runtimes(namespace)):
        entry = rt.spec.supports(fmt, arch)
        if entry is None or not entry.auto_select or mode not in rt.spec.supported_deployment_modes:
            continue
        if best is None or entry.priority > best[0]:
            best = (entry.priority, order, rt)
    if best is None:
        raise SpecError("spec.runtime", f"no auto-selectable runtime serves {what} in {mode} mode; "
                                        "name one in spec.runtime")
    return best[2]


def _mode_field(mode: DeploymentMode) -> str:
    return {"MultiNode": "spec.engine.multiNode", "Serverless": "spec.engine.minReplicas",
            "PrefillDecodeDisaggregated": "spec.prefill"}.get(mode, "spec.deploymentMode")


def _check_engine_args(pools: tuple[ResolvedPool, ...], rt: AnyServingRuntime, model: AnyBaseModel) -> None:
    flags = rt.spec.engine_arg_flags
    for pool in pools:
        args = pool.spec.engine_args
        for name, f in type(args).model_fields.items():
            alias = f.alias or name
            if name == "extra_args" or getattr(args, name) is None:
                continue
            if alias not in flags:
                raise SpecError(f"{pool.field}.engineArgs.{alias}",
                                f"runtime {rt.metadata.name!r} (engine {rt.spec.engine}) has no flag for it")
        ctx = model.spec.context_length
        if args.max_model_len is not None and ctx is not None and args.max_model_len > ctx:
            raise SpecError(f"{pool.field}.engineArgs.maxModelLen",
                            f"{args.max_model_len} exceeds the model's contextLength {ctx}")


def _check_router(router: RouterSpec) -> None:
    from kvfleet.router.scorers import PROFILES, SCORERS

    if router.policy is not None and router.policy not in PROFILES:
        known = ", ".join(sorted(PROFILES))
        raise SpecError("spec.router.policy", f"unknown policy {router.policy!r} (known: {known})")
    for name in router.scorers or {}:
        if name not in SCORERS:
            raise SpecError(f"spec.router.scorers.{name}", f"unknown scorer (known: {', '.join(SCORERS)})")


def verify_source(obj: AnyBaseModel | FineTunedWeight) -> Path | None:
    """Check the sha256 of a model's or adapter's content when it is on this machine (file://, or
    an installed pypi:// package).

    Returns:
        The local path that was checked, or ``None`` when the source is remote (hf, s3, pvc) or
        no sha256 is given.

    Raises:
        SpecError: the content's fingerprint differs from ``spec.sha256`` (field ``spec.sha256``),
            or a file:// / pypi:// source is missing (field ``spec.source``).
    """
    src = ModelSource.parse(obj.spec.source)
    if obj.spec.sha256 is None or src.scheme not in ("file", "pypi"):
        return None
    try:
        path = src.local_path()
    except FileNotFoundError as e:
        raise SpecError("spec.source", f"cannot verify: {e}", obj.ref) from None
    actual = fingerprint(path)
    if actual != obj.spec.sha256:
        raise SpecError("spec.sha256", f"{path} has sha256 {actual}, expected {obj.spec.sha256}", obj.ref)
    return path


def resolve(service: InferenceService, catalog: Catalog, *, verify: bool = False) -> ResolvedService:
    """Resolve ``service``'s references in ``catalog`` and check them together.

    Args:
        service: the InferenceService (already validated on its own).
        catalog: the resources it may refer to (built-in runtimes included).
        verify: also check the sha256 of local model and adapter sources (hashes the files).

    Raises:
        SpecError: naming the field and the InferenceService (or, for a sha256 mismatch, the
            BaseModel / FineTunedWeight) at fault.
    """
    ns = service.metadata.namespace or "default"
    try:
        spec = service.spec
        mode = spec.effective_mode()
        model = catalog.model(spec.model, ns)
        runtime = _select_runtime(service, model, mode, catalog, ns)
        pools = _pools(service, mode)
        _check_engine_args(pools, runtime, model)
        _check_router(spec.router)
        adapters = []
        for i, name in enumerate(spec.fine_tuned_weights):
            field = f"spec.fineTunedWeights[{i}]"
            ftw = catalog.fine_tuned_weight(name, ns, field)
            try:
                base = catalog.model(ftw.spec.base_model, ns)
            except SpecError:
                base = None
            if base is None or (base.KIND, base.metadata.name) != (model.KIND, model.metadata.name):
                raise SpecError(field, f"adapter {name!r} is for base model {ftw.spec.base_model.name!r}, "
                                       f"not {model.metadata.name!r}")
            if "loraModules" not in runtime.spec.engine_arg_flags:
                raise SpecError(field, f"runtime {runtime.metadata.name!r} (engine {runtime.spec.engine}) cannot "
                                       "serve LoRA adapters")
            adapters.append(ftw)
    except SpecError as e:
        raise e.with_resource(service.ref) from None
    if verify:
        for obj in (model, *adapters):
            verify_source(obj)
    return ResolvedService(service=service, namespace=ns, model=model, runtime=runtime, adapters=tuple(adapters),
                           mode=mode, pools=pools, served_model_name=spec.served_model_name or model.metadata.name)
