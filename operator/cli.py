"""Run the LLMService operator (kopf) against the current kubeconfig context, or in cluster with the
pod's service account:

    llumnix operator --namespace default
    llumnix operator --all-namespaces --peering llumnix     # several replicas: one acts at a time

Needs the CRD installed (`helm install llumnix charts/llumnix`, or `kubectl apply -f
charts/llumnix/crds/`)."""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time

from llumnix_operator.http_endpoint import OperatorEndpoint
from llumnix_operator.logs import configure_operator_logging
from llumnix_operator.metrics import OPERATOR_METRICS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; default: the kubeconfig's, or all with --all-namespaces)",
    )
    where.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object shared by the operator's replicas, so only the one with "
        "the highest priority acts (default: standalone, no peering)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="this replica's peering priority (default: by seniority, the replica started first acts; "
        "kopf pauses every replica that sees another with the same priority)",
    )
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        metavar="SECONDS",
        help="how long a replica's peering entry outlives its last keep-alive: how soon a standby "
        "takes over from a replica that died without leaving the peering (default %(default)s)",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        metavar="PORT",
        help="serve /metrics (Prometheus) and /readyz on this port (0: do not serve; default %(default)s)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="JSON logs on stderr",
    )


def _current_namespace() -> str:
    import kubernetes

    try:
        _, context = kubernetes.config.list_kube_config_contexts()
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    return (context or {}).get("context", {}).get("namespace", "default")


def seniority_priority(now_ns: int | None = None) -> int:
    """A peering priority that ranks a replica started earlier above one started later (minus the
    start time in microseconds). The chart's replicas share their arguments, and kopf pauses all
    replicas of equal priority, so a fixed default would leave none acting; by seniority, a restarted
    or newly added replica stands by instead of taking over from the one acting."""
    return -((time.time_ns() if now_ns is None else now_ns) // 1000)


def run(args: argparse.Namespace) -> int:
    try:
        kopf = importlib.import_module("kopf")
    except ImportError:
        print(
            "llumnix operator: kopf and kubernetes are not installed (pip install 'llumnix-k8s[dev]')",
            file=sys.stderr,
        )
        return 2
    configure_operator_logging(args.log_level)
    handlers = importlib.import_module("llumnix_operator.handlers")  # registers the handlers with kopf
    kubernetes = importlib.import_module("kubernetes")
    try:
        handlers.api_client()
    except (kubernetes.config.ConfigException, OSError) as exc:
        print(
            f"llumnix operator: no Kubernetes credentials (in-cluster service account or kubeconfig): {exc}",
            file=sys.stderr,
        )
        return 2
    namespaces = args.namespace or ([] if args.all_namespaces else [_current_namespace()])
    ready = threading.Event()
    endpoint = None
    if args.metrics_port:
        endpoint = OperatorEndpoint(args.metrics_host, args.metrics_port, OPERATOR_METRICS, ready)
        endpoint.start()
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    try:
        kopf.run(
            settings=settings,
            clusterwide=args.all_namespaces,
            namespaces=namespaces,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=args.priority if args.priority is not None else seniority_priority(),
            liveness_endpoint=args.liveness,
            ready_flag=ready,
        )
    except kopf.LoginError as exc:
        print(f"llumnix operator: cannot log in to the Kubernetes API: {exc}", file=sys.stderr)
        return 1
    finally:
        if endpoint is not None:
            endpoint.stop()
    return 0
