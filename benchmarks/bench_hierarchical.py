"""Benchmark: flat vs hierarchical data-parallel all-reduce, 2 simulated nodes x 4 ranks, side by side.

On 8 local gloo ranks (pods of 4: ranks 0-3 are "node 0", 4-7 "node 1"), the
same gradient buckets (a GPT of 12 blocks, hidden 128, 25 MiB buckets) are
reduced by meshtrain's flat :class:`~meshtrain.trainer.parallel.reducer.GradReducer`
and by :class:`~meshtrain.trainer.parallel.hierarchical.HierarchicalGradReducer`,
interleaved step by step.  Bytes per rank per step come from the recorder,
split by level: a flat all-reduce's payload all crosses the node boundary
(its ring spans both nodes), the hierarchical one sends only the 1/4 shard
across nodes (``level=inter``).  Time is the median reduction time (wall,
``finish`` included).  On one machine there is no slow inter-node link, so
the time column shows the extra collectives' cost, not the fabric saving.

In a training step (forward, backward, ``finish``) of the same GPT on a
batch of ``BATCH`` sequences per rank, the exposed time is what remains
from the end of the last rank's backward to the end of the last rank's
``finish`` (``perf_counter`` is the host's monotonic clock, shared by the
processes): flat, hierarchical as the
trainer runs it (each bucket's chain issued on the exchange thread when the
bucket is final) and hierarchical after backward (every chain issued by
``finish``, the schedule before the exchanges were overlapped).

    python benchmarks/bench_hierarchical.py [--steps 20]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import machine, ranks
from meshtrain.api import layout
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import hierarchical, reducer
from meshtrain.trainer.telemetry import recording

CONFIG = gpt.GPTConfig(vocab=256, seq_len=32, layers=12, hidden=128, heads=4, ffn_hidden=512)
WORLD, PER_NODE = 8, 4
BATCH = 4
STEP_VARIANTS = ("flat", "hierarchical", "hierarchical after backward")


def _exposed(
    model: gpt.GPT, red: reducer.GradReducer, tokens: torch.Tensor, overlap: bool
) -> tuple[float, float]:
    """One step: (this rank's backward seconds, seconds from the last backward's end to the last ``finish``'s)."""
    red.zero_grad()
    red.set_sync(overlap)  # not final: the hooks issue nothing, finish issues every bucket
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    dist.barrier()
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    red.finish()
    ends = torch.tensor([backward_end, time.perf_counter()], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return backward_end - start, float(ends[1] - ends[0])


def _step_times(
    rank: int, world: int, intra: dist.ProcessGroup, inter: dist.ProcessGroup, steps: int
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    tokens = torch.randint(
        0, CONFIG.vocab, (BATCH, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(rank)
    )
    for name in STEP_VARIANTS:
        model = gpt.GPT(CONFIG, seed=0)
        common = dict(
            group=dist.group.WORLD,
            group_size=world,
            bucket_mb=0.25,  # several buckets: the overlap has something to hide
            recorder=recording.NullRecorder(),
        )
        red = (
            reducer.GradReducer(list(model.parameters()), **common)
            if name == "flat"
            else hierarchical.HierarchicalGradReducer(
                list(model.parameters()), intra=intra, inter=inter, **common
            )
        )
        times = [_exposed(model, red, tokens, name != STEP_VARIANTS[2]) for _ in range(steps + 2)]
        out[name] = {
            "backward_seconds": [b for b, _ in times[2:]],
            "exposed_seconds": [e for _, e in times[2:]],
            "buckets": [float(len(red.buckets))],
        }
        red.remove()
    return out


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    ranks.join(rank, world, port)
    flat = layout.ParallelLayout(data=world, pipeline=1, tensor=1)
    intra_lists, inter_lists = flat.dp_levels(PER_NODE)
    intra, _ = dist.new_subgroups_by_enumeration(intra_lists)
    inter, _ = dist.new_subgroups_by_enumeration(inter_lists)
    setups = {}
    for name in ("flat", "hierarchical"):
        params = [
            torch.nn.Parameter(p.detach().clone()) for p in gpt.GPT(CONFIG, seed=0).parameters()
        ]
        rec = recording.MemoryRecorder()
        common = dict(group=dist.group.WORLD, group_size=world, bucket_mb=25.0, recorder=rec)
        red = (
            hierarchical.HierarchicalGradReducer(params, intra=intra, inter=inter, **common)
            if name == "hierarchical"
            else reducer.GradReducer(params, **common)
        )
        setups[name] = (params, red, rec)
    times: dict[str, list[float]] = {n: [] for n in setups}
    bytes_by_level: dict[str, dict[str, int]] = {}
    same = True
    for step in range(steps + 3):
        torch.manual_seed(1000 * step + rank)
        grads = [torch.randn_like(p) for p in setups["flat"][0]]
        results = {}
        for name, (params, red, rec) in setups.items():
            red.zero_grad()
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            dist.barrier()
            rec.step_start(step, time.perf_counter())
            start = time.perf_counter()
            for bucket in red.buckets:
                red._launch(bucket)  # what the hooks do once a bucket is complete
            red.finish()
            elapsed = time.perf_counter() - start
            results[name] = torch.cat([p.grad.reshape(-1) for p in params])
            levels: dict[str, int] = {}
            for e in rec.events:
                if e.what == "collective":
                    levels[e.level] = levels.get(e.level, 0) + e.nbytes
            bytes_by_level[name] = levels
            if step >= 3:
                times[name].append(elapsed)
        same = same and torch.allclose(
            results["flat"], results["hierarchical"], rtol=1e-5, atol=1e-6
        )
    in_step = _step_times(rank, world, intra, inter, steps)
    if rank == 0:
        torch.save(
            {"times": times, "bytes": bytes_by_level, "same": same, "in_step": in_step},
            Path(out) / ranks.RESULT,
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    load_before = os.getloadavg()
    args, raw = ranks.spawn_from_command_line(
        _rank, __doc__.splitlines()[0], [*(argv or sys.argv[1:]), "--world", str(WORLD)]
    )
    flat_inter = raw["bytes"]["flat"].get(
        "flat", 0
    )  # a flat ring crosses nodes with the whole payload
    rows = []
    print(
        f"{WORLD} gloo ranks as 2 nodes x {PER_NODE}, {args.steps} timed steps (median), results equal: {raw['same']}"
    )
    print(
        f"{'variant':<13} {'intra-node B/rank':>18} {'inter-node B/rank':>18} {'reduce ms':>10} {'vs flat':>8}"
    )
    base = statistics.median(raw["times"]["flat"])
    for name in ("flat", "hierarchical"):
        levels = raw["bytes"][name]
        inter = flat_inter if name == "flat" else levels.get("inter", 0)
        intra = 0 if name == "flat" else levels.get("intra", 0)
        median = statistics.median(raw["times"][name])
        rows.append(
            {
                "variant": name,
                "intra_node_bytes_per_rank": intra,
                "inter_node_bytes_per_rank": inter,
                "median_reduce_seconds": median,
                "ratio_to_flat": median / base,
                "reduce_seconds": raw["times"][name],
            }
        )
        print(f"{name:<13} {intra:>18} {inter:>18} {median * 1e3:>10.1f} {median / base:>7.2f}x")
    cut = flat_inter / rows[1]["inter_node_bytes_per_rank"]
    print(f"inter-node bytes per rank cut by {cut:.2f}x (ranks per node: {PER_NODE})")
    step_rows = []
    print(f"in a step (rank 0, batch {BATCH}, median): {'backward ms':>12} {'exposed ms':>11}")
    for name, seen in raw["in_step"].items():
        backward = statistics.median(seen["backward_seconds"])
        exposed = statistics.median(seen["exposed_seconds"])
        step_rows.append(
            {
                "variant": name,
                "buckets": int(seen["buckets"][0]),
                "median_backward_seconds": backward,
                "median_exposed_seconds": exposed,
                "exposed_seconds": seen["exposed_seconds"],
            }
        )
        print(f"{name:<28} {backward * 1e3:>12.1f} {exposed * 1e3:>11.1f}")
    path = machine.write_results(
        "hierarchical",
        {
            "world": WORLD,
            "ranks_per_node": PER_NODE,
            "model": CONFIG.__dict__,
            "results_equal": raw["same"],
            "inter_node_bytes_cut": cut,
            "rows": rows,
            "in_step": step_rows,
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
