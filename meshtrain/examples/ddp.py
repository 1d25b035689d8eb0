"""A plain PyTorch DDP program, as a researcher would write it, for `trainer.type: custom`.

It knows nothing of meshtrain: `torchrun` gives it RANK, LOCAL_RANK and WORLD_SIZE (the gang
comes from the PET_* variables the operator sets), and it trains a small regression with
DistributedDataParallel, checkpointing to $CHECKPOINT_DIR (defaults to the job's volume) so a
restarted gang resumes.  meshtrain's layout variables (MESHTRAIN_DP/PP/TP) are printed to show
what a 3D-parallel program would read.

    torchrun --nproc-per-node=2 -m meshtrain.examples.ddp --steps 20
"""

from __future__ import annotations

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def main() -> int:
    args = _arguments()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if rank == 0:
        layout = {k: os.environ.get(f"MESHTRAIN_{k}", "?") for k in ("DP", "PP", "TP")}
        print(f"ddp example: world {world}, meshtrain layout {layout}", flush=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    target = torch.arange(16, dtype=torch.float32, device=device) / 16

    checkpoint = pathlib.Path(os.environ.get("MESHTRAIN_CHECKPOINT_DIR", "/tmp")) / "ddp-example.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    generator = torch.Generator().manual_seed(1000 + rank)
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        x = torch.randn(args.batch, 16, generator=generator).to(device)
        y = (x @ target).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    if rank == 0:
        tmp = checkpoint.with_suffix(".tmp")
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "step": args.steps}, tmp)
        tmp.replace(checkpoint)
    dist.destroy_process_group()
    return 0 if loss.item() < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
