"""The ``meshtrain plan`` subcommand: arguments, and the glue from files to the report.

:func:`configure` adds the subcommand's arguments to an
``argparse`` parser and sets its handler; :func:`run` reads the job, the
profile and (optionally) the cluster, calls :func:`.estimate.make_plan` and
prints :mod:`.plan_report`'s text or JSON.  Errors (bad job, unknown profile,
malformed cluster file, unreachable cluster) print one clear message and
exit with status 2.  The arithmetic is in the other planner modules.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import cluster, cost, estimate, memory, plan_report, profiles


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``meshtrain plan``'s arguments to ``parser``."""
    parser.add_argument("job", help="TrainingJob YAML file")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--cluster",
        metavar="CLUSTER.yaml",
        help="nodes to place the job on (list of name, gpus, labels; see docs/planner.md)",
    )
    source.add_argument(
        "--from-cluster",
        action="store_true",
        help="read the nodes from the current kubeconfig's cluster",
    )
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="PROFILE",
        help="device profile (h100-sxm, h200, a100-80g, a100-40g, l40s, cpu, or a user profile); "
        "default: cpu when the job's precision is fp32, else h100-sxm",
    )
    parser.add_argument(
        "--profiles-dir",
        action="append",
        default=[],
        metavar="DIR",
        help=f"extra directory of profile YAML files (also ${profiles.ENV_VAR})",
    )
    parser.add_argument(
        "--recipe",
        choices=memory.RECIPES,
        default="meshtrain",
        help="bf16 state accounting: meshtrain (fp32 master weights, 4+4+8 B/param, as the "
        "trainer runs) or mixed (16-bit weights and grads, 2+2+12 B/param)",
    )
    parser.add_argument(
        "--critical-batch-tokens",
        type=int,
        default=cost.DEFAULT_CRITICAL_BATCH_TOKENS,
        metavar="N",
        help="warn when the global batch has more tokens than this",
    )
    parser.add_argument(
        "--json", action="store_true", help=f"print the {plan_report.SCHEMA} JSON document"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="try a spec change without editing the file, e.g. --set "
        "training.activationCheckpointing=true (repeatable)",
    )
    parser.set_defaults(handler=run)


def _default_profile(job: api_spec.TrainingJobSpec) -> str:
    return "cpu" if job.training.precision == "fp32" else "h100-sxm"


def run(args: argparse.Namespace) -> int:
    """Handle ``meshtrain plan``; returns the exit status."""
    try:
        job = loading.load_spec_file(args.job)
        if args.set:
            job = loading.apply_overrides(job, args.set)
        profile = profiles.get(args.gpu or _default_profile(job), args.profiles_dir)
        nodes = None
        if args.cluster:
            nodes = cluster.load(args.cluster)
        elif args.from_cluster:
            from meshtrain.planner import cluster_live  # noqa: PLC0415 - pulls in the kubernetes client

            nodes = cluster_live.list_nodes(gpu_resource=job.resources.gpu_resource_name)
        if args.critical_batch_tokens < 1:
            raise ValueError(
                f"--critical-batch-tokens must be >= 1, got {args.critical_batch_tokens}"
            )
        plan = estimate.make_plan(
            job,
            profile,
            recipe=args.recipe,
            nodes=nodes,
            critical_batch_tokens=args.critical_batch_tokens,
        )
    except (
        loading.SpecError,
        profiles.ProfileError,
        cluster.ClusterError,
        ValueError,
        RuntimeError,
    ) as err:
        print(f"meshtrain plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_report.to_json(plan), indent=2, ensure_ascii=False))
    else:
        print(plan_report.to_text(plan))
    return 0
