"""``meshtrain validate JOB``: every rule of the spec, then the files it names on this machine.

Refuses (exit 2, one line per problem on stderr) what ``meshtrain run`` would refuse before
starting a process: the spec's fields and rules (:mod:`meshtrain.api.loading`), in-memory
checkpoints the pods cannot hold, and the local files (:mod:`meshtrain.api.local_files`): token
files, and a ``model.init.fromHF`` directory with ``run``'s own torch-free checks.
"""

from __future__ import annotations

import argparse
import sys

from meshtrain.api import exitcodes, loading, local_files, persistence
from meshtrain.api.spec import pod_template
from meshtrain.planner import snapshots


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``meshtrain validate``."""
    parser.add_argument("job", help="TrainingJob YAML file")
    parser.add_argument(
        "--local",
        action="store_true",
        help="the job is for meshtrain run on this machine: check absolute paths too (relative "
        "and ~ paths are always checked; an absolute one otherwise only where it exists here)",
    )


def main(args: argparse.Namespace) -> int:
    """Validate ``args.job``; 0 when valid, :data:`~meshtrain.api.exitcodes.SPEC` (2) when not."""
    try:
        job = loading.load_spec_file(args.job)
    except loading.SpecError as err:
        print(err, file=sys.stderr)
        return exitcodes.SPEC
    verdict = local_files.check(job, local=args.local)
    if verdict.problems:
        print(loading.SpecError(verdict.problems, args.job), file=sys.stderr)
        return exitcodes.SPEC
    job = verdict.job
    refused = snapshots.snapshot_problems(job)  # in-memory checkpoints the pods cannot hold
    if refused:
        print(f"{args.job}: " + "\n".join(refused), file=sys.stderr)
        return exitcodes.SPEC
    for named in verdict.unchecked:
        print(
            f"note: {named.field} {named.path} is not on this machine: not checked (a path inside "
            "the pod); meshtrain validate --local checks it for meshtrain run",
            file=sys.stderr,
        )
    for warned in (
        None if args.local else persistence.short_warning(job),  # run keeps them on this disk
        pod_template.placement_warning(job.pod_template_override),
    ):
        if warned is not None:
            print(f"warning: {warned}", file=sys.stderr)
    print(
        f"{args.job}: valid TrainingJob {job.parallelism.layout_string}, world size {job.world_size}, "
        f"{job.pods} pod(s) of {job.resources.gpus_per_node} GPU(s), global batch {job.global_batch}"
    )
    return 0
