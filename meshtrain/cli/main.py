"""The ``meshtrain`` command line: one subcommand per user task, handed to the module that does it.

Those modules are imported when their subcommand runs, so that ``meshtrain --help`` and
``meshtrain validate`` do not pay for importing torch, kopf or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from meshtrain.api import release
from meshtrain.cli import plan
from meshtrain.cli import validate as cli_validate
from meshtrain.operator import command as operator_command
from meshtrain.planner import search


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
    calibrator: plan.Calibrator = importlib.import_module(
        "meshtrain.trainer.calibration.measure"
    ).calibrate
    return calibrator


def _layout_measure() -> search.MeasureLayout:
    """``plan --search --calibrate``'s step-loop runs of the best grids: torch, so with the trainer."""
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


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``meshtrain run JOB``: train on this machine."""
    run = sub.add_parser(
        "run", help="train a TrainingJob on this machine with local processes (no cluster)"
    )
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


def _add_timeline(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``meshtrain timeline DIR``: one measured pipeline step as a PNG."""
    timeline = sub.add_parser("timeline", help="draw one measured pipeline step of a run as a PNG")
    timeline.add_argument("log_dir", help="log directory of a run (holds trace/rank-N.jsonl)")
    timeline.add_argument("-o", "--output", default="timeline.png", help="PNG to write")
    timeline.add_argument(
        "--step", type=int, default=None, help="step to draw (default: the last one)"
    )
    timeline.set_defaults(handler=_timeline)


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``meshtrain report DIR``: a run's pictures."""
    report = sub.add_parser(
        "report",
        help="draw a run (loss, tokens/s, MFU, step time split, all-reduce, per rank) as HTML or PNG",
    )
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


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``meshtrain export CHECKPOINT``: a Hugging Face directory."""
    export = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (config.json + safetensors)",
    )
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


def _add_data(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``meshtrain data prepare``: tokenise text into a token file."""
    data = sub.add_parser("data", help="prepare training data")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshtrain", description="Topology-aware 3D-parallel training on Kubernetes."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sub.add_parser("version", help="print the meshtrain version").set_defaults(handler=_version)

    validate_parser = sub.add_parser(
        "validate", help="check a TrainingJob YAML file against every rule"
    )
    cli_validate.configure(validate_parser)
    validate_parser.set_defaults(handler=cli_validate.main)

    _add_run(sub)

    plan_parser = sub.add_parser(
        "plan",
        help="predict memory, communication and step time of a TrainingJob (and its placement)",
    )
    plan.configure(plan_parser)
    plan_parser.set_defaults(calibrator=_calibrator, layout_measure=_layout_measure)

    _add_timeline(sub)
    _add_report(sub)
    _add_export(sub)
    _add_data(sub)
    operator_command.add_parser(sub)

    sub.add_parser(
        "crd", help="print the TrainingJob CustomResourceDefinition generated from the spec model"
    ).set_defaults(handler=_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
