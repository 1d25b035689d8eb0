"""The ``meshtrain plan`` subcommand: its arguments (a table), and the glue from files to the report.

:func:`run` reads the job, the profile and (optionally) the cluster, calls
:func:`meshtrain.planner.estimate.make_plan` and prints :mod:`meshtrain.planner.report`'s text or
JSON.  A bad job, an unknown profile, a malformed cluster file or an unreachable cluster prints
one message and exits with status 2; a job that does not fit in device memory exits with 3
(:mod:`meshtrain.cli.exitcodes` lists every code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from meshtrain import placement
from meshtrain.api import limits, loading
from meshtrain.api import spec as api_spec
from meshtrain.cli import cluster_objects, exitcodes, extras
from meshtrain.planner import (
    cluster,
    default_plan,
    estimate,
    failures,
    host_model,
    precision,
    profiles,
    report,
    search,
    validation,
)


class Calibrator(Protocol):
    """``meshtrain.trainer.calibration.measure.calibrate``: measures this machine (torch), handed in by the CLI."""

    def __call__(
        self, job: api_spec.TrainingJobSpec, base: profiles.Profile, name: str, *, budget: float
    ) -> profiles.Profile: ...


DEFAULT_CALIBRATION_DIR = "profiles"
"""Where ``--calibrate`` writes without ``--profiles-dir``."""


CLUSTER_SOURCES: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--cluster",
        {
            "metavar": "CLUSTER.yaml",
            "help": "nodes to place the job on (list of name, gpus, labels; or kubectl get "
            "nodes,resourceslices,deviceclasses -o yaml; see docs/planner.md)",
        },
    ),
    (
        "--from-cluster",
        {"action": "store_true", "help": "read the nodes from the current kubeconfig's cluster"},
    ),
)
"""Where the nodes come from (one at most): the flag and its ``add_argument`` options."""

OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--gpu",
        {
            "default": None,
            "metavar": "PROFILE",
            "help": "device profile (h100-sxm, h200, a100-80g, a100-40g, l40s, cpu, or a user "
            "profile); default: cpu when the job's precision is fp32, else h100-sxm",
        },
    ),
    (
        "--profiles-dir",
        {
            "action": "append",
            "default": [],
            "metavar": "DIR",
            "help": f"extra directory of profile YAML files (also ${profiles.ENV_VAR})",
        },
    ),
    (
        "--recipe",
        {
            "choices": precision.RECIPES,
            "default": "meshtrain",
            "help": "bf16 state accounting: meshtrain (fp32 master weights, 4+4+8 B/param, as the "
            "trainer runs) or mixed (16-bit weights and grads, 2+2+12 B/param)",
        },
    ),
    (
        "--critical-batch-tokens",
        {
            "type": int,
            "default": estimate.DEFAULT_CRITICAL_BATCH_TOKENS,
            "metavar": "N",
            "help": "warn when the global batch has more tokens than this",
        },
    ),
    ("--json", {"action": "store_true", "help": f"print the {report.SCHEMA} JSON document"}),
    (
        "--calibrate",
        {
            "action": "store_true",
            "help": "first measure this machine at the job's shapes, precision, backend and group "
            "sizes (matmul FLOP/s, per-op overhead, collective latency and bandwidth) and write a "
            "profile file into the first --profiles-dir (default ./profiles); then plan with it "
            "(with --search: also measure the step loop of the three best dp/pp/tp grids before "
            "ranking)",
        },
    ),
    (
        "--search",
        {
            "action": "store_true",
            "help": "list the fastest valid layouts (dp/pp/tp, schedule, microBatches, microBatch, "
            "zeroStage) for --world ranks that fit in memory (and, with a cluster, can be placed), "
            "ranked by predicted step time; the job's model and global batch are kept",
        },
    ),
    (
        "--world",
        {
            "type": int,
            "default": None,
            "metavar": "N",
            "help": "world size for --search (default: the job's)",
        },
    ),
    (
        "--top",
        {
            "type": int,
            "default": 10,
            "metavar": "K",
            "help": "how many layouts --search lists (default 10)",
        },
    ),
    (
        "--calibration-seconds",
        {
            "type": float,
            "default": 0.5,
            "metavar": "S",
            "help": "how long --calibrate times each measurement (default 0.5; longer is steadier "
            "on a busy host)",
        },
    ),
    (
        "--profile-name",
        {
            "default": None,
            "metavar": "NAME",
            "help": "name of the profile --calibrate writes (default: <base profile>-<host>)",
        },
    ),
    (
        "--failure-rate",
        {
            "type": float,
            "default": failures.DEFAULT_FAILURE_RATE,
            "metavar": "RATE",
            "help": "failures per GPU-hour (default %(default).3g: 419 unexpected interruptions "
            "in 54 days on 16,384 H100s, Meta's Llama 3 paper, scaled linearly per GPU)",
        },
    ),
    (
        "--save-seconds",
        {
            "type": float,
            "default": None,
            "metavar": "S",
            "help": "measured seconds a storage checkpoint blocks training (default: predicted from "
            "the state bytes and --storage-bandwidth)",
        },
    ),
    (
        "--storage-bandwidth",
        {
            "type": float,
            "default": failures.DEFAULT_STORAGE_BANDWIDTH,
            "metavar": "BYTES_PER_S",
            "help": "bytes/s a checkpoint is written at, all ranks together (default %(default).3g)",
        },
    ),
    (
        "--restart-seconds",
        {
            "type": float,
            "default": failures.DEFAULT_RESTART_SECONDS,
            "metavar": "S",
            "help": "seconds from a failure to training again after a gang rebuild, before the "
            "storage reload (default %(default)g: measured in the sandbox)",
        },
    ),
    (
        "--in-place-restart-seconds",
        {
            "type": float,
            "default": failures.IN_PLACE_RESTART_SECONDS,
            "metavar": "S",
            "help": "the same for an in-place recovery, before the reload from host memory "
            "(default %(default)g: benchmarks/results/recovery-vm.json)",
        },
    ),
    (
        "--memory-share",
        {
            "type": float,
            "default": None,
            "metavar": "P",
            "help": f"share of failures an in-memory checkpoint recovers (default "
            f"{failures.MEMORY_SHARE_WITH_PEER:g} with a peer pod, "
            f"{failures.MEMORY_SHARE_ALONE:g} with one pod; docs/planner.md)",
        },
    ),
    (
        "--set",
        {
            "action": "append",
            "default": [],
            "metavar": "PATH=VALUE",
            "help": "try a spec change without editing the file, e.g. --set "
            "training.activationCheckpointing=true (repeatable)",
        },
    ),
)
"""``meshtrain plan``'s options after the job and the cluster source, in the order ``--help`` lists them."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``meshtrain plan``'s arguments to ``parser``."""
    parser.add_argument("job", help="TrainingJob YAML file")
    source = parser.add_mutually_exclusive_group()
    for flag, options in CLUSTER_SOURCES:
        source.add_argument(flag, **options)
    for flag, options in OPTIONS:
        parser.add_argument(flag, **options)
    parser.set_defaults(handler=run)


def _measured_noise_scale(path: str) -> float | None:
    """status.progress.gradientNoiseScale of a TrainingJob file (``kubectl get tj NAME -o yaml``), if any."""
    try:
        documents = loading.load_documents(path)  # bounded: MAX_DOCUMENT_BYTES
        document = documents[0] if len(documents) == 1 else None
    except (OSError, ValueError):  # a SpecError is a ValueError
        return None
    progress = ((document or {}).get("status") or {}).get("progress") or {}
    value = progress.get("gradientNoiseScale") if isinstance(progress, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _calibrate(
    job: api_spec.TrainingJobSpec, base: profiles.Profile, args: argparse.Namespace
) -> profiles.Profile:
    name = args.profile_name or f"{base.name}-{socket.gethostname()}"
    directory = args.profiles_dir[0] if args.profiles_dir else DEFAULT_CALIBRATION_DIR
    print(
        f"calibrating {name} for {job.parallelism.layout_string} on this machine ...",
        file=sys.stderr,
    )
    if args.calibration_seconds <= 0:
        raise ValueError(f"--calibration-seconds must be > 0, got {args.calibration_seconds}")
    measure: Calibrator = args.calibrator()
    measured = measure(job, base, name, budget=args.calibration_seconds)
    path = profiles.write(measured, directory)
    print(f"wrote {path}; plan with --gpu {name} --profiles-dir {directory}", file=sys.stderr)
    return profiles.load_file(path)


def _search(
    job: api_spec.TrainingJobSpec,
    profile: profiles.Profile,
    nodes: Sequence[placement.Node] | None,
    args: argparse.Namespace,
) -> int:
    world = args.world or job.world_size
    if not 1 <= world <= limits.MAX_WORLD_SIZE:
        raise ValueError(f"--world must be between 1 and {limits.MAX_WORLD_SIZE}, got {world}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.calibrate and profile.cpu_time_model:
        print(
            f"measuring the step loop of the {search.MEASURED_GRIDS} best dp/pp/tp grids ...",
            file=sys.stderr,
        )
    found = search.search(
        job,
        profile,
        world=world,
        nodes=nodes,
        limit=args.top,
        recipe=args.recipe,
        measure=args.layout_measure() if args.calibrate else None,
    )
    stated = validation.confidence(profile, socket.gethostname(), validation.load_band())
    if args.json:
        print(json.dumps(report.search_json(found, world, stated), indent=2, ensure_ascii=False))
    else:
        print(report.search_text(found, world, profile, stated, placed=nodes is not None))
    if not found:
        print(
            f"meshtrain plan: no layout of {world} ranks passes the rules and fits "
            f"(exit {exitcodes.NO_LAYOUT})",
            file=sys.stderr,
        )
        return exitcodes.NO_LAYOUT
    return exitcodes.OK


def run(args: argparse.Namespace) -> int:
    """Handle ``meshtrain plan``; returns the exit status."""
    try:
        job = loading.load_spec_file(args.job)
        if args.set:
            job = loading.apply_overrides(job, args.set)
        if args.calibrate and args.profiles_dir:  # where the calibration goes may not exist yet
            Path(args.profiles_dir[0]).mkdir(parents=True, exist_ok=True)
        profile = profiles.get(args.gpu or default_plan.profile_name(job), args.profiles_dir)
        if args.calibrate:
            profile = _calibrate(job, profile, args)
        nodes = None
        if args.cluster:
            nodes = cluster_objects.load(args.cluster, job)
        elif args.from_cluster:
            extras.require("operator", "meshtrain plan --from-cluster")  # the Kubernetes client
            from meshtrain.cli import cluster_nodes  # noqa: PLC0415 - pulls in the kubernetes client

            nodes = cluster_nodes.list_nodes(gpu_resource=job.resources.gpu_resource_name, job=job)
        if nodes is None:  # the ranks run here (meshtrain run): they share this host's cores
            profile = host_model.on_host(profile, host_model.host_cores())
        if args.critical_batch_tokens < 1:
            raise ValueError(
                f"--critical-batch-tokens must be >= 1, got {args.critical_batch_tokens}"
            )
        if args.search:
            return _search(job, profile, nodes, args)
        plan = estimate.make_plan(
            job,
            profile,
            recipe=args.recipe,
            nodes=nodes,
            critical_batch_tokens=args.critical_batch_tokens,
            noise_scale=_measured_noise_scale(args.job),
            failure=failures.Assumptions(
                failure_rate=args.failure_rate,
                restart_seconds=args.restart_seconds,
                in_place_restart_seconds=args.in_place_restart_seconds,
                memory_share=args.memory_share,
                save_seconds=args.save_seconds,
                storage_bandwidth=args.storage_bandwidth,
            ),
        )
    except (
        loading.SpecError,
        profiles.ProfileError,
        cluster.ClusterError,
        ValueError,
        RuntimeError,
    ) as err:
        print(f"meshtrain plan: {err}", file=sys.stderr)
        return exitcodes.INVALID
    plan = dataclasses.replace(
        plan,
        confidence=validation.confidence(
            profile, socket.gethostname(), validation.load_band(), job.parallelism.layout_string
        ),
    )
    if args.json:
        print(json.dumps(report.to_json(plan), indent=2, ensure_ascii=False))
    else:
        print(report.to_text(plan))
    if not plan.memory.fits:
        print(
            f"meshtrain plan: the job does not fit (exit {exitcodes.DOES_NOT_FIT}): {plan.warnings[0]}",
            file=sys.stderr,
        )
        return exitcodes.DOES_NOT_FIT
    if plan.placement is not None and plan.placement.unschedulable_reason:
        print(
            f"meshtrain plan: the gang cannot be placed on these nodes (exit "
            f"{exitcodes.UNSCHEDULABLE}): {plan.placement.unschedulable_reason}",
            file=sys.stderr,
        )
        return exitcodes.UNSCHEDULABLE
    return exitcodes.OK
