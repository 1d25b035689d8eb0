"""The ``meshtrain`` command line: one subcommand per user task.

Each subcommand parses its arguments and calls into the package; the work
itself lives in the modules named in each handler.  This module holds no
training, placement or Kubernetes logic.
"""

from __future__ import annotations

import argparse
import sys

import meshtrain


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"meshtrain {meshtrain.__version__}")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from meshtrain.api import spec

    try:
        job = spec.load_spec_file(args.job)
    except spec.SpecError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"{args.job}: valid TrainingJob {job.parallelism.layout_string}, world size {job.world_size}, "
          f"{job.pods} pod(s) of {job.resources.gpus_per_node} GPU(s), global batch {job.global_batch}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtrain", description="Topology-aware 3D-parallel training on Kubernetes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    version = sub.add_parser("version", help="print the meshtrain version")
    version.set_defaults(handler=_cmd_version)

    validate = sub.add_parser("validate", help="check a TrainingJob YAML file against every rule")
    validate.add_argument("job", help="TrainingJob YAML file")
    validate.set_defaults(handler=_cmd_validate)

    crd = sub.add_parser("crd", help="print the TrainingJob CustomResourceDefinition generated from the spec model")
    crd.set_defaults(handler=lambda args: __import__("meshtrain.api.crd").api.crd.main())
    __import__("meshtrain.operator.command").operator.command.add_parser(sub)

    timeline = sub.add_parser("timeline", help="draw one measured pipeline step of a run as a PNG")
    timeline.add_argument("log_dir", help="log directory of a run (holds trace/rank-N.jsonl)")
    timeline.add_argument("-o", "--output", default="timeline.png", help="PNG to write")
    timeline.add_argument("--step", type=int, default=None, help="step to draw (default: the last one)")
    timeline.set_defaults(handler=lambda args: __import__("meshtrain.trainer.telemetry.timeline").trainer.telemetry.timeline.main(args))

    plan = sub.add_parser("plan", help="predict memory, communication and step time of a TrainingJob (and its placement)")
    __import__("meshtrain.planner.command").planner.command.configure(plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
