"""The ``meshtrain`` command line: one subcommand per user task, handed to the module that does it.

Light by construction: this module imports only argparse and :mod:`.extras`, a subcommand's
parser is built only when that subcommand runs (:data:`COMMANDS`; ``--help`` lists them all from
one line each), and its module is imported when it runs, so ``meshtrain --help``, ``--version``
and ``validate`` import no torch, kopf or Kubernetes client (the base install has none).  A
subcommand that needs an extra that is not installed prints the ``pip install`` line and exits
with :data:`.extras.EXIT_CODE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.api import release
from meshtrain.cli import extras

if TYPE_CHECKING:
    from meshtrain.cli import plan
    from meshtrain.planner import search

    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _version(args: argparse.Namespace) -> int:
    print(f"meshtrain {release.VERSION}")
    return 0


def _run(args: argparse.Namespace) -> int:
    launch = importlib.import_module("meshtrain.trainer.launch")
    code: int = launch.run_local(
        args.job, steps=args.steps, log_dir=args.log_dir, overrides=args.set
    )
    return code


def _calibrator() -> plan.Calibrator:
    """``plan --calibrate``'s measurement: torch and processes, so it lives with the trainer."""
    extras.require("trainer", "meshtrain plan --calibrate")
    calibrator: plan.Calibrator = importlib.import_module(
        "meshtrain.trainer.calibration.measure"
    ).calibrate
    return calibrator


def _layout_measure() -> search.MeasureLayout:
    """``plan --search --calibrate``'s step-loop runs of the best grids: torch, so with the trainer."""
    extras.require("trainer", "meshtrain plan --search --calibrate")
    measure: search.MeasureLayout = importlib.import_module(
        "meshtrain.trainer.calibration.measure"
    ).measure_step_loop
    return measure


def _timeline(args: argparse.Namespace) -> int:
    code: int = importlib.import_module("meshtrain.trainer.telemetry.timeline").main(args)
    return code


def _report(args: argparse.Namespace) -> int:
    code: int = importlib.import_module("meshtrain.trainer.telemetry.report").main(args)
    return code


def _export(args: argparse.Namespace) -> int:
    code: int = importlib.import_module("meshtrain.trainer.interop.export").main(args)
    return code


def _prepare(args: argparse.Namespace) -> int:
    code: int = importlib.import_module("meshtrain.trainer.data.prepare").main(args)
    return code


def _crd(args: argparse.Namespace) -> int:
    code: int = importlib.import_module("meshtrain.api.crd").main()
    return code


def _configure_run(run: argparse.ArgumentParser) -> None:
    """``meshtrain run JOB``: train on this machine."""
    run.add_argument("job", help="TrainingJob YAML file")
    run.add_argument("--steps", type=int, default=None, help="override training.steps")
    run.add_argument(
        "--log-dir",
        default=None,
        help="where steps.jsonl, traces and checkpoints go "
        "(default: runs/<job>-<time>; reuse a directory to resume)",
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field, e.g. --set parallelism.microBatches=8 (repeatable)",
    )
    run.set_defaults(handler=_run)


def _configure_timeline(timeline: argparse.ArgumentParser) -> None:
    """``meshtrain timeline DIR``: one measured pipeline step as a PNG."""
    timeline.add_argument("log_dir", help="log directory of a run (holds trace/rank-N.jsonl)")
    timeline.add_argument("-o", "--output", default="timeline.png", help="PNG to write")
    timeline.add_argument(
        "--step", type=int, default=None, help="step to draw (default: the last one)"
    )
    timeline.set_defaults(handler=_timeline)


def _configure_report(report: argparse.ArgumentParser) -> None:
    """``meshtrain report DIR``: a run's pictures."""
    report.add_argument(
        "log_dir", help="log directory of a run (steps.jsonl and trace/rank-N.jsonl)"
    )
    report.add_argument(
        "-o",
        "--output",
        default="report.html",
        help="report.html (self-contained page) or a .png with every chart (default: %(default)s)",
    )
    report.set_defaults(handler=_report)


def _configure_export(export: argparse.ArgumentParser) -> None:
    """``meshtrain export CHECKPOINT``: a Hugging Face directory."""
    export.add_argument(
        "checkpoint", help="a step-NNNNNNNN checkpoint, or a checkpoint directory (its newest)"
    )
    export.add_argument("-o", "--output", required=True, help="Hugging Face directory to write")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file (e.g. 5GB, 500MB, 2GiB); more than one gets "
        "model.safetensors.index.json (default: %(default)s)",
    )
    export.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json copied into the export, whose begin/end-of-text and padding ids go into "
        "config.json (default: the fromHF directory's tokenizer files and the ids the checkpoint "
        "recorded from its data or that directory)",
    )
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="element type of the exported weights: float32 as trained, or bfloat16 (half the "
        "size, as Llama checkpoints ship; config.json's torch_dtype says which) (default: %(default)s)",
    )
    export.set_defaults(handler=_export)


def _configure_data(data: argparse.ArgumentParser) -> None:
    """``meshtrain data prepare``: tokenise text into a token file."""
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    data_sub.required = True
    prepare = data_sub.add_parser(
        "prepare", help="tokenise text or JSONL with a tokenizer.json into a token file"
    )
    prepare.add_argument(
        "inputs", nargs="+", type=Path, help="text files, or .jsonl (one document per line)"
    )
    prepare.add_argument(
        "--tokenizer", required=True, type=Path, help="tokenizer.json (Hugging Face tokenizers)"
    )
    prepare.add_argument("-o", "--output", required=True, type=Path, help="token file to write")
    prepare.add_argument(
        "--dtype",
        choices=["auto", "uint16", "uint32"],
        default="auto",
        help="id type (auto: the smallest that holds the vocabulary)",
    )
    prepare.add_argument(
        "--text-field", default="text", help="JSONL field holding the text (default: text)"
    )
    vocab = prepare.add_mutually_exclusive_group()
    vocab.add_argument(
        "--job", type=Path, help="TrainingJob YAML whose model.vocab the tokenizer must fit"
    )
    vocab.add_argument("--model-vocab", type=int, help="model vocabulary the tokenizer must fit")
    prepare.set_defaults(handler=_prepare)


def _configure_version(version: argparse.ArgumentParser) -> None:
    version.set_defaults(handler=_version)


def _configure_validate(validate: argparse.ArgumentParser) -> None:
    from meshtrain.cli import validate as cli_validate  # noqa: PLC0415 - the loader only when validate runs

    cli_validate.configure(validate)
    validate.set_defaults(handler=cli_validate.main)


def _configure_plan(parser: argparse.ArgumentParser) -> None:
    from meshtrain.cli import plan  # noqa: PLC0415 - the planner only when plan runs

    plan.configure(parser)
    parser.set_defaults(calibrator=_calibrator, layout_measure=_layout_measure)


def _configure_operator(parser: argparse.ArgumentParser) -> None:
    extras.require("operator", "meshtrain operator")  # its flags' defaults come from kopf's side
    importlib.import_module("meshtrain.operator.command").configure(parser)


def _configure_crd(crd: argparse.ArgumentParser) -> None:
    crd.set_defaults(handler=_crd)


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand as ``meshtrain --help`` lists it, and what builds its parser when it runs."""

    name: str
    """The subcommand (``meshtrain NAME``)."""
    help: str
    """Its line in ``meshtrain --help``."""
    configure: Callable[[argparse.ArgumentParser], None]
    """Adds its arguments and handler to its parser; called only when it is the one that runs."""
    extra: str | None = None
    """The extra (pyproject's optional dependencies) it needs; checked before its handler runs."""


COMMANDS: tuple[Command, ...] = (
    Command("version", "print the meshtrain version", _configure_version),
    Command("validate", "check a TrainingJob YAML file against every rule", _configure_validate),
    Command(
        "run",
        "train a TrainingJob on this machine with local processes (no cluster)",
        _configure_run,
        "trainer",
    ),
    Command(
        "plan",
        "predict memory, communication and step time of a TrainingJob (and its placement)",
        _configure_plan,
    ),
    Command("timeline", "draw one measured pipeline step of a run as a PNG", _configure_timeline),
    Command(
        "report",
        "draw a run (loss, tokens/s, MFU, step time split, all-reduce, per rank) as HTML or PNG",
        _configure_report,
    ),
    Command(
        "export",
        "write a checkpoint as a Hugging Face model directory (config.json + safetensors)",
        _configure_export,
        "trainer",
    ),
    Command("data", "prepare training data", _configure_data, "hf"),
    Command("operator", "run the TrainingJob operator (kopf)", _configure_operator, "operator"),
    Command(
        "crd",
        "print the TrainingJob CustomResourceDefinition generated from the spec model",
        _configure_crd,
    ),
)
"""Every subcommand, in ``meshtrain --help``'s order."""

EPILOG = (
    "A command marked [EXTRA] needs that extra: pip install 'meshtrain[EXTRA]'; without it the "
    f"command says so and exits {extras.EXIT_CODE}."
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``only``, the arguments of that subcommand alone (the others listed).

    ``only=None`` builds every subcommand (which imports the planner and the operator's flags).
    Raises :class:`.extras.MissingExtra` when ``only``'s arguments need a missing extra.
    """
    parser = argparse.ArgumentParser(
        prog="meshtrain",
        description="Topology-aware 3D-parallel training on Kubernetes.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"meshtrain {release.VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        marked = f"{command.help} [{command.extra}]" if command.extra else command.help
        built = sub.add_parser(command.name, help=marked, description=command.help)
        if only is None or only == command.name:
            command.configure(built)
    return parser


def chosen(argv: Sequence[str]) -> str:
    """The subcommand ``argv`` runs: its first word that is not an option ("" for none).

    The top-level options (``--help``, ``--version``) take no value, so that word is the command.
    """
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = chosen(argv)
    try:
        args = build_parser(name).parse_args(argv)
        command = next(c for c in COMMANDS if c.name == args.command)
        if command.extra is not None:
            extras.require(command.extra, f"meshtrain {command.name}")
        code: int = args.handler(args)
    except extras.MissingExtra as err:
        print(err, file=sys.stderr)
        return extras.EXIT_CODE
    return code


if __name__ == "__main__":
    sys.exit(main())
