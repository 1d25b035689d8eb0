"""In-memory checkpoints: a restore from memory continues exactly as an unfaulted run, on every
parallel layout and ZeRO stage; a lost pod's shards come from its peer; without every shard, or
from another layout, the restore falls back to storage.

Each "pod" keeps its snapshots in a directory of its own (its /dev/shm), which outlives the
engines: a restart here drops the engine and its snapshot object and builds both afresh, as an
in-place restart of the process does, and reads only what the directories hold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mt_harness
import pytest
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.planner import snapshots as planned
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer, memory, recovery, snapshot_file, store
from meshtrain.trainer.guards import faults
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import steplog
from tests.builders import JobBuilder

STEPS, EVERY, STOP = 5, 2, 3
"""Train STEPS; snapshot every EVERY steps; the fault comes after step STOP (so the snapshot of
step 2 is the newest, and step 3 is recomputed)."""


def _engine(raw: dict) -> engine.Engine:
    job = loading.parse_spec(raw)
    return engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))


def _pod_root(base: str, raw: dict) -> Path:
    """This rank's pod directory (its /dev/shm)."""
    per_pod = loading.parse_spec(raw).resources.gpus_per_node
    return Path(base) / f"pod-{dist.get_rank() // per_pod}"


def _weights(trainer: engine.Engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_params}


def _snapshots(trainer: engine.Engine, raw: dict, base: str) -> memory.MemorySnapshots:
    return memory.MemorySnapshots(trainer, loading.parse_spec(raw), root=_pod_root(base, raw))


def _faulted(raw: dict, base: str, storage: str, *, save_at: int | None = None) -> dict:
    """Train to STOP with snapshots (a storage checkpoint only at ``save_at``), then stop."""
    first = _engine(raw)
    snaps = _snapshots(first, raw, base)
    for step in range(1, STOP + 1):
        first.train_step()
        if step == save_at:
            checkpointer.Checkpointer(first, root=storage).save()
        snaps.after_step(step)
    snaps.close()
    timing = snaps.timings[-1]
    return {
        "last": snaps.last,
        "file_bytes": timing.bytes,
        "planned": planned.snapshot_bytes(loading.parse_spec(raw)),
    }


def _resumed(raw: dict, base: str, storage: str) -> dict:
    """A fresh engine: restore (memory, else storage), train to STEPS; where it came from and the weights."""
    second = _engine(raw)
    snaps = _snapshots(second, raw, base)
    saver = checkpointer.Checkpointer(second, root=storage)
    step, source = recovery.restore(second, saver, snaps)
    while second.step < STEPS:
        second.train_step()
    snaps.close()
    return {"step": step, "source": source, "weights": _weights(second)}


def _unfaulted(raw: dict) -> dict[str, torch.Tensor]:
    straight = _engine(raw)
    for _ in range(STEPS):
        straight.train_step()
    return _weights(straight)


def _lose(base: str, pod: int, rank: int | None = None) -> None:
    """Rank 0 removes a pod's snapshots (all of them, or only ``rank``'s), between barriers."""
    dist.barrier()
    if dist.get_rank() == 0:
        directory = Path(base) / f"pod-{pod}"
        if rank is None:
            shutil.rmtree(directory)
        else:
            for path in directory.glob(f"rank-{rank:05d}.*"):
                path.unlink()
    dist.barrier()


def layout_case(raw: dict, root: str) -> dict:
    """Snapshots, a stop, a fresh start from memory: the weights of an unfaulted run."""
    faulted = _faulted(raw, f"{root}/shm", f"{root}/storage")
    resumed = _resumed(raw, f"{root}/shm", f"{root}/storage")
    return faulted | resumed | {"exact": _same(resumed["weights"], _unfaulted(raw))}


def peer_cases(raw: dict, root: str) -> dict:
    """dp2 on two pods: pod 1 lost (its shards come from pod 0's peer copies); then both copies
    of rank 1 lost (storage, checkpointed at step 2); then a tp2 engine on dp2's snapshots."""
    reference = _unfaulted(raw)
    out = {}
    _faulted(raw, f"{root}/lost-pod/shm", f"{root}/lost-pod/storage")
    _lose(f"{root}/lost-pod/shm", pod=1)
    lost_pod = _resumed(raw, f"{root}/lost-pod/shm", f"{root}/lost-pod/storage")
    out["lost-pod"] = lost_pod | {"exact": _same(lost_pod["weights"], reference)}
    out["lost-pod-files"] = sorted(p.name for p in Path(f"{root}/lost-pod/shm/pod-1").iterdir())
    base, storage = f"{root}/both/shm", f"{root}/both/storage"
    _faulted(raw, base, storage, save_at=EVERY)
    _lose(base, pod=1, rank=1)
    _lose(base, pod=0, rank=1)
    both = _resumed(raw, base, storage)
    out["both-copies-lost"] = both | {"exact": _same(both["weights"], reference)}
    other = JobBuilder.cpu_run().layout(tensor=2)
    tp2 = other.training(steps=STEPS).checkpoint(inMemory={"intervalSteps": EVERY}).raw()
    _faulted(raw, f"{root}/other/shm", f"{root}/other/storage")
    trainer = _engine(tp2)
    refused = memory.MemorySnapshots(
        trainer, loading.parse_spec(tp2), root=Path(f"{root}/other/shm/pod-{dist.get_rank()}")
    )
    saver = checkpointer.Checkpointer(trainer, root=f"{root}/other/storage")
    out["other-layout"] = recovery.restore(trainer, saver, refused)
    refused.close()
    out["no-room"] = no_room_case(raw, f"{root}/no-room")
    return out


def no_room_case(raw: dict, base: str) -> dict:
    """Pod 1's /dev/shm takes no file (its directory is a file here): no snapshot is complete,
    no rank waits on another, training goes on."""
    if dist.get_rank() == 0:
        Path(base).mkdir(parents=True)
        (Path(base) / "pod-1").write_text("")
    dist.barrier()
    trainer = _engine(raw)
    snaps = _snapshots(trainer, raw, base)
    for step in range(1, STOP + 1):
        trainer.train_step()
        snaps.after_step(step)
    snaps.close()
    return {"last": snaps.last, "step": trainer.step, "pod-0": sorted(os.listdir(f"{base}/pod-0"))}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


LAYOUTS = {
    "dp2": ({"data": 2, "gpus_per_node": 1}, {}),
    "pp2": ({"pipeline": 2, "gpus_per_node": 1}, {"microBatches": 2}),
    "tp2": ({"tensor": 2}, {}),
    "zero1": ({"data": 2, "gpus_per_node": 1}, {"zeroStage": 1}),
    "zero2": ({"data": 2, "gpus_per_node": 1}, {"zeroStage": 2}),
    "zero3": ({"data": 2, "gpus_per_node": 1}, {"zeroStage": 3}),
}


def _raw(name: str) -> dict:
    layout, parallelism = LAYOUTS[name]
    builder = JobBuilder.cpu_run().layout(**layout).parallelism(**parallelism)
    return builder.training(steps=STEPS).checkpoint(inMemory={"intervalSteps": EVERY}).raw()


def scenarios(root: str) -> dict:
    """Every case of this module in one 2-rank session (process start-up dominates on small machines)."""
    out = {name: layout_case(_raw(name), f"{root}/{name}") for name in LAYOUTS}
    out["peer"] = peer_cases(_raw("dp2"), f"{root}/peer")
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("memory")
    return root, mt_harness.run_distributed(scenarios, 2, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_restore_equals_an_unfaulted_run(
    session: tuple[Path, list[dict]], name: str
) -> None:
    root, results = session
    for result in results:
        case = result[name]
        assert (case["step"], case["source"]) == (EVERY, "memory")  # no storage checkpoint exists
        assert case["exact"]  # bit-for-bit the weights of the run that never stopped
        assert case["last"] == EVERY
    # the planner's estimate (what validate checks /dev/shm against) is the largest rank's
    # tensors: its file is that and a header
    largest, planned_bytes = (
        max(r[name]["file_bytes"] for r in results),
        results[0][name]["planned"],
    )
    assert planned_bytes <= largest <= planned_bytes + snapshot_file.HEADER_SLACK
    assert store.latest(root / name / "storage", hashes=False) is None


@pytest.mark.slow
def test_a_lost_pods_shards_come_from_its_peer(session: tuple[Path, list[dict]]) -> None:
    for result in session[1]:
        case = result["peer"]["lost-pod"]
        assert (case["step"], case["source"]) == (EVERY, "memory") and case["exact"]
    # the replaced pod holds its rank's snapshot again (sent by pod 0)
    assert snapshot_file.name(1, EVERY) in session[1][0]["peer"]["lost-pod-files"]


@pytest.mark.slow
def test_both_copies_of_a_shard_lost_falls_back_to_storage(
    session: tuple[Path, list[dict]],
) -> None:
    for result in session[1]:
        case = result["peer"]["both-copies-lost"]
        assert (case["step"], case["source"]) == (EVERY, "storage") and case["exact"]


@pytest.mark.slow
def test_a_snapshot_of_another_layout_is_refused(session: tuple[Path, list[dict]]) -> None:
    for result in session[1]:
        assert result["peer"]["other-layout"] == (None, "none")  # not loaded; no storage either


LAUNCH = (
    "import sys; from meshtrain.trainer import launch; "
    "sys.exit(launch.run_local(sys.argv[1], log_dir=sys.argv[2]))"
)


@pytest.mark.slow
def test_the_worker_resumes_from_memory_after_a_rank_dies(tmp_path: Path) -> None:
    """``meshtrain run``'s ranks: rank 1 dies before step 6; the rerun restores step 4 from the
    snapshots (storage has no checkpoint: it saves only the last step) and recomputes step 5
    exactly as the first run did."""
    raw = _raw("dp2") | {"checkpoint": {"intervalSteps": 0, "inMemory": {"intervalSteps": 4}}}
    raw["training"]["steps"] = 6
    spec = mt_harness.write_job(tmp_path, raw)
    env = {**os.environ, memory.ROOT_ENV: str(tmp_path / "shm")}

    def run(log_dir: Path, **extra: str) -> subprocess.CompletedProcess[bytes]:
        command = [sys.executable, "-c", LAUNCH, str(spec), str(log_dir)]
        return subprocess.run(command, env=env | extra, capture_output=True, timeout=300)

    first = run(tmp_path / "first", **{faults.ENV: "1:6"})
    assert first.returncode != 0
    second = run(tmp_path / "second")
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-3000:]
    assert "restored step 4 from memory" in (tmp_path / "second" / "rank-0.log").read_text()
    before = {r["step"]: r["loss"] for r in steplog.read(tmp_path / "first" / steplog.FILENAME)}
    after = {r["step"]: r["loss"] for r in steplog.read(tmp_path / "second" / steplog.FILENAME)}
    assert max(before) == 5 and min(after) == 5
    assert after[5] == before[5]  # bit-for-bit: the state of step 4 came back whole


@pytest.mark.slow
def test_a_pod_without_room_leaves_no_snapshot_and_blocks_nobody(
    session: tuple[Path, list[dict]],
) -> None:
    for result in session[1]:
        case = result["peer"]["no-room"]
        assert case == {"last": None, "step": STOP, "pod-0": []}  # rank 0's own copy is dropped
