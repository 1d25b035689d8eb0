"""A plain PyTorch DDP program, as a researcher would write it, for `trainer.type: custom`.

It knows nothing of meshtrain: torchrun gives it its rank and world, and it trains a small
regression with DistributedDataParallel.  Rank 0 checkpoints to $MESHTRAIN_JOB_CHECKPOINT_DIR, the
job's own directory on its checkpoint volume (else $MESHTRAIN_CHECKPOINT_DIR), every
--checkpoint-every steps, after the last one and on SIGTERM, by renaming a temporary file over the
previous one, so a restarted gang resumes from the newest step and jobs sharing a claim keep apart.  With --progress-port (the spec's
trainer.progressPort), global rank 0 serves the operator's progress document there: its step, loss
and how many times torchrun restarted its worker group (``recovery_counts.torchrun``, torchrun's
own TORCHELASTIC_RESTART_COUNT), which the operator counts in status.recovery.byTier.torchrun.

    torchrun --nproc-per-node=2 -m meshtrain.examples.ddp --steps 20
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import pathlib
import signal
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STOPPED_BY_SIGNAL = 128 + signal.SIGTERM


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=int(os.environ.get("CHECKPOINT_EVERY", "10")),
        help="steps between checkpoints (0: only at the end and on SIGTERM)",
    )
    parser.add_argument(
        "--progress-port",
        type=int,
        default=0,
        help="port of rank 0's progress document (trainer.progressPort; 0: none)",
    )
    return parser.parse_args()


def _serve_progress(port: int, progress: dict[str, Any]) -> None:
    """Serve ``progress`` as JSON at ``GET /progress`` on ``port`` from a daemon thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(progress).encode()
            self.send_response(200 if self.path == "/progress" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
            return None

    server = http.server.ThreadingHTTPServer(("", port), Handler)
    threading.Thread(target=server.serve_forever, name="progress", daemon=True).start()


def _save(
    path: pathlib.Path,
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    step: int,
    why: str,
) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**state, "step": step}, tmp)
    tmp.replace(path)  # atomic: a kill mid-save leaves the previous checkpoint whole
    print(f"saved step {step} to {path} ({why})", flush=True)


def _leave_together() -> None:
    """Close the process group on every rank at once, after rank 0's last save.

    A rank that tears its group down while a peer is still saving leaves gloo's connection
    threads to be destroyed at interpreter exit, which can abort the process ("terminate called
    without an active exception") after a run that trained to the end.
    """
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = _arguments()
    stop_asked: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_asked.append(signum))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if rank == 0:
        layout = {k: os.environ.get(f"MESHTRAIN_{k}", "?") for k in ("DP", "PP", "TP")}
        print(f"ddp example: world {world}, meshtrain layout {layout}", flush=True)
    # torchrun's count of this agent's worker-group restarts after a failure (0 at the first start)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    progress: dict[str, Any] = {"step": 0, "recovery_counts": {"torchrun": restarts}}
    if rank == 0 and args.progress_port:
        _serve_progress(args.progress_port, progress)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    target = torch.arange(16, dtype=torch.float32, device=device) / 16

    folder = os.environ.get("MESHTRAIN_JOB_CHECKPOINT_DIR") or os.environ.get(
        "MESHTRAIN_CHECKPOINT_DIR", "/tmp"
    )
    checkpoint = pathlib.Path(folder) / "ddp-example.pt"
    if rank == 0:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {checkpoint} (step {start})", flush=True)

    generator = torch.Generator()
    loss = torch.tensor(0.0)
    stop = torch.zeros(1, device=device)
    for step in range(start, args.steps):
        generator.manual_seed(1_000_003 * step + rank)  # the same batches whether resumed or not
        x = torch.randn(args.batch, 16, generator=generator).to(device)
        y = (x @ target).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        progress["step"] = done
        if rank == 0 and (step % 10 == 0 or done == args.steps):
            progress["loss"] = loss.item()  # only here: each .item() waits for the device
            print(f"step {step} loss {progress['loss']:.5f}", flush=True)
        # Every rank stops after the same step, whichever of them got the signal first.
        stop.fill_(1.0 if stop_asked else 0.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            if rank == 0:
                _save(checkpoint, model, optimizer, done, "SIGTERM")
            _leave_together()
            return STOPPED_BY_SIGNAL
        periodic = args.checkpoint_every > 0 and done % args.checkpoint_every == 0
        if rank == 0 and periodic and done < args.steps:
            _save(checkpoint, model, optimizer, done, "periodic")
    if rank == 0 and start < args.steps:
        _save(checkpoint, model, optimizer, args.steps, "last step")
    _leave_together()
    return 0 if loss.item() < 1.0 else 1


def _exit_now(code: int) -> None:
    """Leave with ``code`` without the interpreter's teardown: after ``destroy_process_group`` a
    gloo rank can still abort while Python finalises ("terminate called without an active
    exception", SIGABRT), turning a finished run into exit 134; everything is saved by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
