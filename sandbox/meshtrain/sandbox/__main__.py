"""``python -m meshtrain.sandbox up|down|status|run-example``: the sandbox's commands.

Argument parsing and printing; :mod:`.supervisor` runs the processes and :mod:`.example` applies
and follows a job.  Make calls these (``make sandbox-up`` ...).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

from meshtrain.cli import extras
from meshtrain.sandbox import dra, example, supervisor


def _print_ready(paths: supervisor.Paths, state: dict[str, Any]) -> None:
    print(
        f"sandbox ready in {state.get('up_seconds', state.get('timings', {}).get('up', '?'))}s "
        f"(state in {paths.root}); timings: {json.dumps(state.get('timings', {}))}"
    )
    nodes = ", ".join(
        f"{node.name} ({node.gpus} nvidia.com/gpu; {dra.GPUS_PER_NODE} {dra.DRIVER} devices)"
        for node in supervisor.NODES
    )
    print(
        f"kubelet nodes {nodes}, each with its containerd; the operator runs from its "
        "image as the chart's Deployment; kubectl logs/exec/describe work."
    )
    print(f"export KUBECONFIG={state['kubeconfig']}")
    print(f"Prometheus: {state['prometheus_url']}")


def _cmd_up(paths: supervisor.Paths, args: argparse.Namespace) -> int:
    try:
        state = supervisor.up(paths)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    _print_ready(paths, state)
    return 0


def _cmd_down(paths: supervisor.Paths, args: argparse.Namespace) -> int:
    started = time.monotonic()
    leftovers = supervisor.down(paths)
    if leftovers:
        print(
            f"sandbox down in {time.monotonic() - started:.1f}s; had to kill leftover processes {leftovers}"
        )
    else:
        print(f"sandbox down in {time.monotonic() - started:.1f}s; no process left behind")
    return 0


def _cmd_status(paths: supervisor.Paths, args: argparse.Namespace) -> int:
    state = supervisor.status(paths)
    shown: dict[str, Any] = {
        k: state.get(k)
        for k in ("status", "kubeconfig", "prometheus_url", "timings", "alive", "exited")
        if k in state
    }
    if state.get("status") == "ready":  # the DRA driver's devices, per node
        out = example.kubectl(paths, "get", "resourceslices", "-o", "json", check=False)
        shown["resourceSlices"] = dra.slice_summary(json.loads(out)["items"]) if out else {}
    print(json.dumps(shown, indent=2))
    return 0 if state.get("status") == "ready" else 3


def _cmd_run_example(paths: supervisor.Paths, args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        state = supervisor.up(paths)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    _print_ready(paths, state)
    namespace, name = example.apply(paths, pathlib.Path(args.example))
    print(f"applied {args.example}: TrainingJob {namespace}/{name}")
    final = example.follow(paths, namespace, name, timeout=args.timeout)
    phase = final["status"]["phase"]
    print(
        f"TrainingJob {namespace}/{name} {phase} after {time.monotonic() - started:.0f}s "
        f"(restarts {final['status'].get('restarts', 0)}, last checkpoint step {final['status'].get('lastCheckpointStep')})"
    )
    print(
        f"metrics: {state['prometheus_url']}/graph?g0.expr=meshtrain_step  "
        f'(e.g. max(rate(meshtrain_tokens_total{{namespace="{namespace}", trainingjob="{name}"}}[30s])))'
    )
    print(f"pod logs: kubectl logs -n {namespace} -l meshtrain.io/job={name}")
    picture = example.timeline(paths, namespace, name)
    claim = ((final.get("spec") or {}).get("checkpoint") or {}).get("claimName")
    searched = " or ".join(str(d) for d in example.log_dirs(paths, namespace, name, claim))
    print(
        f"timeline picture: {picture}"
        if picture
        else f"timeline picture: none (no traces in {searched})"
    )
    return 0 if phase == "Succeeded" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.sandbox", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--state-dir",
        type=pathlib.Path,
        default=None,
        help="default: $MESHTRAIN_SANDBOX_DIR or .sandbox/",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the sandbox (or show the running one)").set_defaults(
        handler=_cmd_up
    )
    sub.add_parser("down", help="stop everything; no process is left behind").set_defaults(
        handler=_cmd_down
    )
    sub.add_parser(
        "status", help="what runs, where the kubeconfig and Prometheus are"
    ).set_defaults(handler=_cmd_status)
    run = sub.add_parser(
        "run-example", help="up, apply an example TrainingJob, follow it to the end"
    )
    run.add_argument("example", nargs="?", default=str(example.DEFAULT_EXAMPLE))
    run.add_argument("--timeout", type=float, default=1800.0)
    run.set_defaults(handler=_cmd_run_example)
    serve = sub.add_parser("serve", help="(internal) the supervisor process that `up` starts")
    serve.set_defaults(handler=lambda paths, _args: supervisor.serve(paths))
    args = parser.parse_args(argv)
    if args.command in ("up", "run-example", "serve"):  # they start the control plane
        try:
            extras.require("sandbox", f"python -m meshtrain.sandbox {args.command}")
        except extras.MissingExtra as err:
            print(err, file=sys.stderr)
            return extras.EXIT_CODE
        if not (supervisor.REPO / "scripts" / "bootstrap.sh").is_file():
            print(
                f"python -m meshtrain.sandbox {args.command} runs from a checkout of meshtrain: "
                "it builds the cluster's binaries and the images with the checkout's scripts/ "
                f"(not found under {supervisor.REPO}). Clone the repository and run `make run` "
                "there (docs/sandbox.md)",
                file=sys.stderr,
            )
            return extras.EXIT_CODE
    paths = supervisor.Paths((args.state_dir or supervisor.default_state_dir()).resolve())
    paths.root.mkdir(parents=True, exist_ok=True)
    return int(args.handler(paths, args))


if __name__ == "__main__":
    sys.exit(main())
