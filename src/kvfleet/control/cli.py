"""``kvfleet render``: print the Kubernetes manifests of InferenceService specs, like
``helm template`` -- or the CRDs, or the built-in runtimes.

``kvfleet render -f service.yaml`` reads a multi-document YAML with one or more
InferenceServices and the BaseModel / ServingRuntime / FineTunedWeight documents they refer to
(the built-in ClusterServingRuntimes ``kvfleet``, ``vllm`` and ``sglang`` are always available)
and prints the manifests. A spec that does not validate exits with status 2 and a one-line error
naming the field (``spec.engine.maxReplicas: must be >= minReplicas (2), got 1``).
"""

from __future__ import annotations

import argparse
import json
import sys

EXAMPLES = """examples:
  kvfleet render -f examples/standard-smollm2.yaml
  kvfleet render -f examples/pd-disaggregated.yaml --namespace llm --gateway inference-gateway
  kvfleet render -f service.yaml --no-keda --kueue-queue team-a --image ghcr.io/me/kvfleet:dev | kubectl apply -f -
  kvfleet render --crds | kubectl apply -f -
"""


def add_render_option_flags(p: argparse.ArgumentParser) -> None:
    """The rendering flags shared by ``kvfleet render`` and ``kvfleet operator``: ``--gateway``,
    ``--no-keda``, ``--kueue-queue``, ``--kueue-priority``, ``--image``, ``--router-image``,
    ``--downloader-image`` and ``--prometheus-url``."""
    from kvfleet.control.render import DEFAULT_PROMETHEUS_URL

    p.add_argument("--gateway", default=None, metavar="NAME",
                   help="Gateway to attach an HTTPRoute and InferencePool to (overrides spec.gateway.name)")
    p.add_argument("--no-keda", dest="keda", action="store_false",
                   help="autoscale with HorizontalPodAutoscalers instead of KEDA ScaledObjects (the default); "
                        "no scale to zero")
    p.add_argument("--kueue-queue", default=None, metavar="QUEUE", help="Kueue LocalQueue of the engine pools")
    p.add_argument("--kueue-priority", default=None, metavar="CLASS", help="Kueue WorkloadPriorityClass")
    p.add_argument("--image", default=None, help="engine image (default: the runtime's)")
    p.add_argument("--router-image", default=None, help="router image (default: kvfleet's)")
    p.add_argument("--downloader-image", default=None, help="model download / verify image (default: kvfleet's)")
    p.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS_URL, help="Prometheus for KEDA triggers")


def add_render_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet render``."""
    from kvfleet.cli import ExampleHelpFormatter


    p = sub.add_parser(
        "render", help="print the Kubernetes manifests of InferenceService specs (like helm template)",
        description="Resolve InferenceServices against their BaseModel, ServingRuntime and FineTunedWeight "
                    "documents (plus the built-in kvfleet, vllm and sglang ClusterServingRuntimes) and print the "
                    "Deployments / LeaderWorkerSets, Services, router, autoscalers, PodDisruptionBudgets and "
                    "Gateway routes as multi-document YAML.",
        epilog=EXAMPLES, formatter_class=ExampleHelpFormatter)
    p.add_argument("-f", "--filename", action="append", default=None, metavar="FILE",
                   help="multi-document YAML of kvfleet.io/v1alpha1 resources ('-' = stdin; repeatable)")
    p.add_argument("-n", "--namespace", default="default", help="namespace of documents that name none")
    add_render_option_flags(p)
    p.add_argument("--verify", action="store_true",
                   help="check the sha256 of file:// and installed pypi:// sources before rendering")
    p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="output format")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--crds", action="store_true", help="print kvfleet's CustomResourceDefinitions instead")
    what.add_argument("--builtin-runtimes", action="store_true",
                      help="print the built-in ClusterServingRuntimes instead")
    p.set_defaults(func=run_render, _parser=p)
    return p


def read_spec_files(names: list[str]) -> str:
    """The files (``-`` = standard input) joined as one multi-document YAML text.

    Raises:
        OSError: a file cannot be read.
    """
    parts = []
    for name in names:
        if name == "-":
            parts.append(sys.stdin.read())
        else:
            with open(name, encoding="utf-8") as f:
                parts.append(f.read())
    return "\n---\n".join(parts)


def run_render(args: argparse.Namespace) -> int:
    """Run ``kvfleet render``; returns 0, or 2 with a one-line error on stderr."""
    from kvfleet.control.api import Catalog, SpecError, builtin_runtimes
    from kvfleet.control.api.crds import generate
    from kvfleet.control.render import RenderOptions, render_catalog
    from kvfleet.control.yamlio import dump_all

    try:
        if args.crds:
            docs = list(generate().values())
        elif args.builtin_runtimes:
            docs = [rt.to_dict() for rt in builtin_runtimes().values()]
        else:
            if not args.filename:
                raise SpecError("", "give -f FILE (or --crds / --builtin-runtimes)")
            catalog = Catalog.from_yaml(read_spec_files(args.filename), default_namespace=args.namespace)
            options = RenderOptions(gateway=args.gateway, keda=args.keda, kueue_queue=args.kueue_queue,
                                    kueue_priority=args.kueue_priority, image=args.image,
                                    router_image=args.router_image, downloader_image=args.downloader_image,
                                    prometheus_url=args.prometheus_url)
            docs = render_catalog(catalog, options, verify=args.verify)
    except (SpecError, OSError, UnicodeDecodeError) as e:
        print(f"kvfleet render: error: {e}", file=sys.stderr)
        return 2
    if args.output == "json":
        sys.stdout.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2) + "\n")
    else:
        sys.stdout.write(dump_all(docs))
    return 0
