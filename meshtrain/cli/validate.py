"""``meshtrain validate JOB...``: every rule of the spec, then the files it names on this machine.

Refuses (exit 2, one line per problem on stderr) what ``meshtrain run`` would refuse before
starting a process: the spec's fields and rules (:mod:`meshtrain.api.loading`), in-memory
checkpoints the pods cannot hold, and the local files (:mod:`meshtrain.api.local_files`): token
files, and a ``model.init.fromHF`` directory with ``run``'s own torch-free checks.  Several files
are checked one by one (exit 2 if any fails); a file of several YAML documents (``---``, as
``kubectl apply -f`` takes a claim and its job) has its TrainingJob checked and the rest noted;
several TrainingJobs in one file get ``meshtrain run``'s and ``plan``'s verdict (one per file).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshtrain.api import exitcodes, limits, loading, local_files, persistence
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import pod_template
from meshtrain.planner import snapshots


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``meshtrain validate``."""
    parser.add_argument(
        "jobs", nargs="+", metavar="job", help="TrainingJob YAML file(s); exit 2 if any fails"
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="the job is for meshtrain run on this machine: check absolute paths too (relative "
        "and ~ paths are always checked; an absolute one otherwise only where it exists here)",
    )


def main(args: argparse.Namespace) -> int:
    """Validate each of ``args.jobs``; 0 when all are valid, :data:`~meshtrain.api.exitcodes.SPEC`
    (2) when any is not."""
    if len(args.jobs) > limits.MAX_VALIDATE_FILES:
        print(
            f"meshtrain validate: {len(args.jobs)} files, more than {limits.MAX_VALIDATE_FILES}: "
            "validate them in batches",
            file=sys.stderr,
        )
        return exitcodes.SPEC
    return max(_validate_file(path, local=args.local) for path in args.jobs)


def _validate_file(path: str, *, local: bool) -> int:
    """Check one file: its one document, or the one TrainingJob among several (others noted)."""
    try:
        documents = loading.load_documents(path)
    except loading.SpecError as err:
        print(err, file=sys.stderr)
        return exitcodes.SPEC
    present = [(index, doc) for index, doc in enumerate(documents, 1) if doc is not None]
    if len(present) <= 1:
        return _validate_job(path, present[0][1] if present else None, local=local)
    jobs = [(index, doc) for index, doc in present if _kind(doc) == api_spec.KIND]
    if len(jobs) > 1:  # one TrainingJob per file, as meshtrain run and plan read it: their verdict
        return _validate_job(path, None, local=local, whole_file=True)
    if not jobs:
        print(
            f"{path}: none of its {len(present)} YAML documents is a TrainingJob "
            f"(kind: {api_spec.KIND}): nothing to validate",
            file=sys.stderr,
        )
        return exitcodes.SPEC
    for index, document in present:
        kind = _kind(document)
        if kind != api_spec.KIND:
            what = f"a {kind}" if kind else "a document without a kind"
            print(
                f"note: {path} (document {index}): {what}, not a TrainingJob: not checked",
                file=sys.stderr,
            )
    [(index, job)] = jobs
    return _validate_job(f"{path} (document {index})", job, local=local)


def _kind(document: Any) -> str | None:
    kind = document.get("kind") if isinstance(document, dict) else None
    return kind if isinstance(kind, str) else None


def _validate_job(source: str, document: Any, *, local: bool, whole_file: bool = False) -> int:
    """Check one TrainingJob document (or bare spec) read from ``source`` (``whole_file``: read
    ``source`` as ``meshtrain run`` does, one document)."""
    try:
        job = (
            loading.load_spec_file(source)
            if whole_file
            else loading.from_document(document, source)[1]
        )
    except loading.SpecError as err:
        print(err, file=sys.stderr)
        return exitcodes.SPEC
    verdict = local_files.check(job, local=local)
    if verdict.problems:
        print(loading.SpecError(verdict.problems, source), file=sys.stderr)
        return exitcodes.SPEC
    job = verdict.job
    refused = snapshots.snapshot_problems(job)  # in-memory checkpoints the pods cannot hold
    if refused:
        print(f"{source}: " + "\n".join(refused), file=sys.stderr)
        return exitcodes.SPEC
    for named in verdict.unchecked:
        print(
            f"note: {named.field} {named.path} is not on this machine: not checked (a path inside "
            "the pod); meshtrain validate --local checks it for meshtrain run",
            file=sys.stderr,
        )
    for warned in (
        None if local else persistence.short_warning(job),  # run keeps them on this disk
        pod_template.placement_warning(job.pod_template_override),
    ):
        if warned is not None:
            print(f"warning: {warned}", file=sys.stderr)
    if job.training.float8 is not None:  # the spec names no device: the trainer checks it at start
        print(
            "note: training.float8 needs GPUs of compute capability 8.9 or newer (H100, H200, L40S); "
            "validate cannot see the nodes' GPUs: the trainer refuses fp8 at job start on older "
            "ones and on CPUs (meshtrain plan --profile warns for a profile without float8)",
            file=sys.stderr,
        )
    print(
        f"{source}: valid TrainingJob {job.parallelism.layout_string}, world size {job.world_size}, "
        f"{job.pods} pod(s) of {job.resources.gpus_per_node} GPU(s), global batch {job.global_batch}"
    )
    return 0
