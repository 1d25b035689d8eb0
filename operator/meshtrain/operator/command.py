"""``meshtrain operator``: the command-line entry of the operator process.

Its flags (registered by ``meshtrain.cli.main``) and :func:`run`, which configures logging,
starts the metrics endpoint and runs kopf with the handlers of :mod:`handlers`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from meshtrain.operator import planning
from meshtrain.operator.policy import builders, capacity_queue, gang_backend, kueue_workload, naming
from meshtrain.planner import admission, profiles

if TYPE_CHECKING:
    from meshtrain.operator.cluster import leadership

DEFAULT_LEASE = "meshtrain-operator"
"""Name of the coordination.k8s.io Lease replicas use to elect the active one."""
MIN_LEASE_SECONDS = 3
"""Shortest Lease the election's timing allows (a retry of at least 1 s, renewal within 2/3)."""
DEFAULT_GPU_PROFILE = "h100-sxm"
"""Profile for nodes that do not name their GPU: the common training GPU, as ``meshtrain plan`` assumes for bf16."""
MAX_PLANNING_DEADLINE = 600.0
"""Largest ``--planning-deadline-seconds``: placements wait behind a plan, so it stays minutes at most."""
NO_PROFILE = "none"
"""``--gpu-profile`` value that admits jobs unchecked when no node names its GPU."""


def gpu_profile(name: str) -> profiles.Profile | None:
    """The ``--gpu-profile`` value as a profile (None for ``none``).

    Raises ProfileError for an unknown name, and for any profile file that
    does not load, whatever the name: nodes are judged by every profile, and
    a broken file found later would leave their jobs unchecked.
    """
    known = profiles.load_all()
    if name == NO_PROFILE:
        return None
    if name not in known:
        return profiles.get(name)  # raises, listing the known ones
    return known[name]


def election(args: argparse.Namespace) -> leadership.Election:
    """The Lease settings of the flags: renew within 2/3 of the lease, retry 7.5 times per lease."""
    from meshtrain.operator.cluster import leadership  # noqa: PLC0415 - kubernetes_asyncio only for `operator`

    return leadership.Election(
        lease=args.lease,
        namespace=args.lease_namespace or leadership.default_namespace(),
        identity=args.identity or leadership.default_identity(),
        lease_seconds=args.lease_seconds,
        renew_deadline=args.lease_seconds * 2 / 3,
        retry=max(1.0, args.lease_seconds / 7.5),
    )


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``meshtrain operator`` and its flags on ``sub``."""
    parser = sub.add_parser("operator", help="run the TrainingJob operator (kopf)")
    configure(parser)
    return parser


def configure(parser: argparse.ArgumentParser) -> None:
    """Give ``meshtrain operator``'s parser its flags and handler (the CLI builds the parser)."""
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable); default: --all-namespaces",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)"
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="kopf liveness endpoint; empty disables it (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9090, help="Prometheus /metrics port; 0 disables it"
    )
    _add_election_flags(parser)
    _add_job_flags(parser)
    parser.add_argument(
        "--log-format", choices=["json", "text"], default="json", help="log format (default: json)"
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    parser.set_defaults(handler=run)


def _add_election_flags(parser: argparse.ArgumentParser) -> None:
    """The Lease that elects the one replica that acts."""
    parser.add_argument(
        "--lease",
        default=DEFAULT_LEASE,
        metavar="NAME",
        help="Lease that elects the one replica that acts (default: %(default)s)",
    )
    parser.add_argument(
        "--lease-namespace",
        metavar="NS",
        help="namespace of the Lease (default: $POD_NAMESPACE, the pod's own, else default)",
    )
    parser.add_argument(
        "--lease-seconds",
        type=int,
        default=15,
        help="a standby takes over after the Lease went unrenewed this long (default: %(default)s)",
    )
    parser.add_argument(
        "--identity",
        help="this replica's Lease holder name; must survive a container restart "
        "(default: $POD_NAME, else the host name)",
    )
    parser.add_argument(
        "--standalone", action="store_true", help="no leader election (a single replica)"
    )


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    """What the operator does for every job: resyncs, progress polls, the default profile and image."""
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=float(os.environ.get("MESHTRAIN_RESYNC_SECONDS", 30)),
        help="longest wait between two reconciles of a job (env MESHTRAIN_RESYNC_SECONDS)",
    )
    parser.add_argument(
        "--reserve-after-seconds",
        type=float,
        default=float(
            os.environ.get("MESHTRAIN_RESERVE_AFTER_SECONDS", capacity_queue.RESERVE_AFTER_SECONDS)
        ),
        help="seconds a job waits for GPUs before nodes may be reserved for it (env "
        "MESHTRAIN_RESERVE_AFTER_SECONDS)",
    )
    parser.add_argument(
        "--progress-seconds",
        type=float,
        default=float(os.environ.get("MESHTRAIN_PROGRESS_SECONDS", 10)),
        help="interval of /progress polls of running jobs (env MESHTRAIN_PROGRESS_SECONDS)",
    )
    parser.add_argument(
        "--gpu-profile",
        default=os.environ.get("MESHTRAIN_GPU_PROFILE", DEFAULT_GPU_PROFILE),
        metavar="PROFILE",
        help="device profile a job's memory plan is judged by when no candidate node names its GPU "
        f"({admission.PRODUCT_LABEL}): a profile of `meshtrain plan --gpu`, or 'none' to admit "
        "such jobs unchecked (env MESHTRAIN_GPU_PROFILE; default: %(default)s)",
    )
    parser.add_argument(
        "--planning-deadline-seconds",
        type=float,
        default=float(
            os.environ.get("MESHTRAIN_PLANNING_DEADLINE_SECONDS", planning.DEFAULT_DEADLINE_SECONDS)
        ),
        metavar="SECONDS",
        help="most CPU time a job's placement plan may take in the planning worker (a child process, off "
        "the event loop); a job whose plan uses more is refused with PlanningDeadlineExceeded "
        "(env MESHTRAIN_PLANNING_DEADLINE_SECONDS; default: %(default)s)",
    )
    parser.add_argument(
        "--trainer-image",
        default=os.environ.get("MESHTRAIN_TRAINER_IMAGE", naming.DEFAULT_TRAINER_IMAGE),
        metavar="IMAGE",
        help="trainer image of jobs whose spec.image is empty (env MESHTRAIN_TRAINER_IMAGE; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--container-restart-rules",
        choices=tuple(RESTART_RULES),
        default=os.environ.get("MESHTRAIN_CONTAINER_RESTART_RULES", "auto"),
        help="give trainer containers restartPolicyRules (the kubelet restarts a dead container in "
        "place): 'auto' asks the API server's version once (1.35 or newer: on), 'on' or 'off' "
        "decide (env MESHTRAIN_CONTAINER_RESTART_RULES; default: %(default)s)",
    )
    parser.add_argument(
        "--restart-all-containers",
        choices=("auto", "on", "off"),
        default=os.environ.get("MESHTRAIN_RESTART_ALL_CONTAINERS", "auto"),
        help="give the pods of custom trainers that opt in (runPolicy.recovery.torchrunElastic) the "
        "RestartAllContainers rule (KEP-5532: the kubelet restarts the whole pod in place when "
        "torchrun is killed): 'auto' where the API server is 1.36 or newer and every node of the "
        "gang declares RestartAllContainersOnContainerExits in status.declaredFeatures, 'on' "
        "always (the server and every kubelet must serve it), 'off' never "
        "(env MESHTRAIN_RESTART_ALL_CONTAINERS; default: %(default)s)",
    )
    parser.add_argument(
        "--default-queue",
        default=os.environ.get("MESHTRAIN_DEFAULT_QUEUE") or None,
        metavar="LOCALQUEUE",
        help="label every TrainingJob that names no Kueue LocalQueue (kueue.x-k8s.io/queue-name) "
        "with this one, so that Kueue admits every job; Kueue's convention is 'default' "
        "(env MESHTRAIN_DEFAULT_QUEUE; default: none, such jobs bypass Kueue)",
    )
    parser.add_argument(
        "--gang-network-policy-namespace",
        action="append",
        default=[
            n
            for n in os.environ.get("MESHTRAIN_GANG_NETWORK_POLICY_NAMESPACES", "").split(",")
            if n
        ],
        metavar="NAMESPACE",
        help="give each gang of this namespace a NetworkPolicy admitting only its own pods "
        "(repeatable; the chart names the namespaces its trainer policy admits the operator and "
        "Prometheus in; env MESHTRAIN_GANG_NETWORK_POLICY_NAMESPACES, comma-separated; "
        "default: none)",
    )
    _add_gang_flags(parser)
    for kind, who in (("operator", "the operator's pods"), ("metrics", "Prometheus")):
        parser.add_argument(
            f"--gang-network-policy-{kind}-peers",
            default=os.environ.get(f"MESHTRAIN_GANG_NETWORK_POLICY_{kind.upper()}_PEERS", "[]"),
            metavar="JSON",
            help=f"NetworkPolicyPeers of {who}, a JSON list, that each gang's NetworkPolicy admits "
            f"on the job's {'progress port' if kind == 'operator' else 'exporter ports'} (env "
            f"MESHTRAIN_GANG_NETWORK_POLICY_{kind.upper()}_PEERS; default: none)",
        )


def _add_gang_flags(parser: argparse.ArgumentParser) -> None:
    """Who binds each gang all or nothing (``gang_backend``; docs/operator.md, "Gang backends")."""
    parser.add_argument(
        "--gang-backend",
        choices=gang_backend.KINDS,
        default=os.environ.get("MESHTRAIN_GANG_BACKEND") or "auto",
        help="who binds a gang whole once its gates are lifted: 'auto' the native Workload API "
        "where the API server serves it, else nobody; 'native' that API; 'coscheduling' "
        "scheduler-plugins' Coscheduling plugin in the second scheduler --gang-scheduler-name; "
        "'none' nobody (half a gang can bind); 'volcano' is refused (untested) "
        "(env MESHTRAIN_GANG_BACKEND; default: %(default)s)",
    )
    parser.add_argument(
        "--gang-scheduler-name",
        default=os.environ.get("MESHTRAIN_GANG_SCHEDULER_NAME")
        or gang_backend.DEFAULT_SCHEDULER_NAME,
        metavar="NAME",
        help="schedulerName of every pod under --gang-backend coscheduling: the second scheduler "
        "running the Coscheduling plugin (env MESHTRAIN_GANG_SCHEDULER_NAME; default: %(default)s)",
    )
    parser.add_argument(
        "--gang-schedule-timeout-seconds",
        type=int,
        default=int(
            os.environ.get("MESHTRAIN_GANG_SCHEDULE_TIMEOUT_SECONDS")
            or gang_backend.DEFAULT_SCHEDULE_TIMEOUT_SECONDS
        ),
        metavar="SECONDS",
        help="scheduleTimeoutSeconds of each coscheduling PodGroup: how long a gang's pods wait in "
        "the scheduler for their siblings (env MESHTRAIN_GANG_SCHEDULE_TIMEOUT_SECONDS; "
        "default: %(default)s)",
    )


def gang(args: argparse.Namespace) -> gang_backend.GangBackend:
    """The gang backend of the flags (checked with ``gang_backend.invalid``)."""
    return gang_backend.GangBackend(
        kind=args.gang_backend,
        scheduler_name=args.gang_scheduler_name,
        schedule_timeout_seconds=args.gang_schedule_timeout_seconds,
    )


RESTART_RULES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``--container-restart-rules`` -> ``reconciler.Settings.container_restart_rules``."""

MAX_PEERS = 32
"""Most NetworkPolicyPeers one ``--gang-network-policy-*-peers`` flag may name."""

_PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


def parse_peers(flag: str, text: str) -> tuple[dict[str, object], ...]:
    """The NetworkPolicyPeers of ``flag``'s JSON list; ValueError naming the flag and the fix."""
    try:
        peers = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{flag} is not JSON ({err}): give a list of NetworkPolicyPeers") from err
    if not isinstance(peers, list) or len(peers) > MAX_PEERS:
        raise ValueError(f"{flag} must be a JSON list of at most {MAX_PEERS} NetworkPolicyPeers")
    for index, peer in enumerate(peers):
        if not isinstance(peer, dict) or not peer or not set(peer) <= _PEER_KEYS:
            raise ValueError(
                f"{flag}[{index}] must be an object with some of {', '.join(sorted(_PEER_KEYS))}"
            )
    return tuple(peers)


def gang_peers(args: argparse.Namespace) -> builders.GangPeers:
    """The peers each gang's NetworkPolicy admits besides its own pods (ValueError: a bad flag)."""
    return builders.GangPeers(
        operator=parse_peers(
            "--gang-network-policy-operator-peers", args.gang_network_policy_operator_peers
        ),
        metrics=parse_peers(
            "--gang-network-policy-metrics-peers", args.gang_network_policy_metrics_peers
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Run the operator until it is interrupted (exit status 2 at once for an unknown ``--gpu-profile``)."""
    if not 0 < args.planning_deadline_seconds <= MAX_PLANNING_DEADLINE:
        print(
            "meshtrain operator: --planning-deadline-seconds must be above 0 and at most "
            f"{MAX_PLANNING_DEADLINE:g} (a plan holds every other job's placement while it runs)",
            file=sys.stderr,
        )
        return 2
    if not args.reserve_after_seconds >= 0:
        print("meshtrain operator: --reserve-after-seconds must be 0 or more", file=sys.stderr)
        return 2
    if args.lease_seconds < MIN_LEASE_SECONDS:
        print(
            f"meshtrain operator: --lease-seconds must be at least {MIN_LEASE_SECONDS}",
            file=sys.stderr,
        )
        return 2
    queue = kueue_workload.Queue(args.default_queue, None) if args.default_queue else None
    if queue is not None and kueue_workload.invalid_queue_name(queue) is not None:
        print(
            f"meshtrain operator: --default-queue {args.default_queue!r} cannot name a LocalQueue "
            "(an RFC 1123 subdomain of at most 253 characters: lower-case letters, digits, '-', '.')",
            file=sys.stderr,
        )
        return 2
    backend = gang(args)
    if (refused := gang_backend.invalid(backend)) is not None:
        print(f"meshtrain operator: {refused}", file=sys.stderr)
        return 2
    try:
        peers = gang_peers(args)
    except ValueError as err:
        print(f"meshtrain operator: {err}", file=sys.stderr)
        return 2
    try:
        default_profile = gpu_profile(args.gpu_profile)
    except profiles.ProfileError as err:  # names the flag's value or the file and key
        print(f"meshtrain operator: --gpu-profile {args.gpu_profile}: {err}", file=sys.stderr)
        return 2
    import kopf  # noqa: PLC0415 - heavy; only the operator subcommand needs it

    from meshtrain.operator import handlers, reconciler  # noqa: F401,PLC0415 - registers the handlers
    from meshtrain.operator.cluster import metrics  # noqa: PLC0415

    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
    )
    if not args.verbose:  # kopf logs every handler call at INFO; keep the operator's own lines
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    memo = kopf.Memo(
        kubeconfig=os.path.abspath(args.kubeconfig) if args.kubeconfig else None,
        namespaces=list(args.namespace),
        election=None if args.standalone else election(args),
        settings=reconciler.Settings(
            resync_seconds=args.resync_seconds,
            progress_seconds=args.progress_seconds,
            gpu_profile=default_profile,
            trainer_image=args.trainer_image,
            planning_deadline_seconds=args.planning_deadline_seconds,
            default_queue=args.default_queue,
            isolated_namespaces=frozenset(args.gang_network_policy_namespace),
            gang_peers=peers,
            container_restart_rules=RESTART_RULES[args.container_restart_rules],
            restart_all_containers=args.restart_all_containers,
            gang=backend,
            reserve_after_seconds=args.reserve_after_seconds,
        ),
    )
    clusterwide = not args.namespace
    kopf.run(
        clusterwide=clusterwide,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        standalone=True,  # no kopf peering: the Lease elects (see leadership)
        memo=memo,
        loop=asyncio.new_event_loop(),
    )
    return 0
