"""In-memory checkpoints: a restore from memory continues exactly as an unfaulted run, on every
parallel layout and ZeRO stage; a lost pod's shards come from its peer; without every shard, or
from another layout, the restore falls back to storage.

Each "pod" keeps its snapshots in a directory of its own (its /dev/shm).  The first processes
train, snapshot and exit; the test then removes what a lost node would take with it; new
processes restore from what the directories kept, and the weights after the last step are
compared with an unfaulted run's.  One launch of each for every case (start-up dominates).
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
from torch.distributed.tensor import DTensor

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
    """This rank's pod directory (its /dev/shm); each pod on a node of its own, named as the
    operator names it (every rank of this harness runs on one machine)."""
    per_pod = loading.parse_spec(raw).resources.gpus_per_node
    return _on_node(Path(base), dist.get_rank() // per_pod)


def _on_node(base: Path, pod: int) -> Path:
    os.environ[memory.NODE_ENV] = f"node-{pod}"
    return base / f"pod-{pod}"


def _weights(trainer: engine.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters as plain tensors (a ZeRO-3 DTensor's local shard)."""
    local = {
        n: p.to_local() if isinstance(p, DTensor) else p for n, p in trainer.model.named_params
    }
    return {name: p.detach().clone() for name, p in local.items()}


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


def _lose(base: Path, pod: int, rank: int | None = None) -> None:
    """A pod's snapshots gone (all of them, as when its node is lost, or only ``rank``'s)."""
    directory = base / f"pod-{pod}"
    if rank is None:
        shutil.rmtree(directory)
    else:
        for path in directory.glob(f"rank-{rank:05d}.*"):
            path.unlink()


PEER_ROOTS = ("lost-pod", "both", "other", "damaged")
"""dp2 on two pods: pod 1 lost (its shards come from pod 0's peer copies); both copies of rank 1
lost (storage, checkpointed at step 2); a tp2 engine on dp2's snapshots; a byte of rank 1's own
snapshot changed (its checksum refuses it: storage, checkpointed at step 2)."""
STORED = ("both", "damaged")
"""The cases with a storage checkpoint of step 2."""


def train_and_stop(root: str) -> dict:
    """The first processes: every unfaulted run, and every run that snapshots and stops."""
    out: dict = {"rank": dist.get_rank()}
    for name in LAYOUTS:
        raw = _raw(name)
        out[name] = _faulted(raw, f"{root}/{name}/shm", f"{root}/{name}/storage")
        out[name]["unfaulted"] = _unfaulted(raw)
    dp2 = _raw("dp2")
    for case in PEER_ROOTS:
        save_at = EVERY if case in STORED else None
        _faulted(dp2, f"{root}/{case}/shm", f"{root}/{case}/storage", save_at=save_at)
    out["no-room"] = no_room_case(dp2, f"{root}/no-room")
    return out


def start_again(root: str) -> dict:
    """The second processes: every restore, from what the pods' directories kept."""
    out: dict = {
        name: _resumed(_raw(name), f"{root}/{name}/shm", f"{root}/{name}/storage")
        for name in LAYOUTS
    }
    dp2 = _raw("dp2")
    for case in ("lost-pod", *STORED):
        out[case] = _resumed(dp2, f"{root}/{case}/shm", f"{root}/{case}/storage")
    tp2 = JobBuilder.cpu_run().layout(tensor=2).training(steps=STEPS)
    tp2_raw = tp2.checkpoint(inMemory={"intervalSteps": EVERY}).raw()
    trainer = _engine(tp2_raw)
    refused = memory.MemorySnapshots(
        trainer,
        loading.parse_spec(tp2_raw),
        root=_on_node(Path(f"{root}/other/shm"), dist.get_rank()),
    )
    saver = checkpointer.Checkpointer(trainer, root=f"{root}/other/storage")
    out["other-layout"] = recovery.restore(trainer, saver, refused)
    refused.close()
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
    "cp2": ({"context": 2, "gpus_per_node": 1}, {}),
    "pp2-interleaved": (
        {"pipeline": 2, "gpus_per_node": 1},
        {"schedule": "interleaved-1f1b", "virtualStages": 2, "microBatches": 4},
    ),
}


def _raw(name: str) -> dict:
    layout, parallelism = LAYOUTS[name]
    builder = JobBuilder.cpu_run().layout(**layout).parallelism(**parallelism)
    return builder.training(steps=STEPS).checkpoint(inMemory={"intervalSteps": EVERY}).raw()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], list[dict]]:
    """Two sets of processes: the pods' directories outlive the first, then nodes are lost."""
    root = tmp_path_factory.mktemp("memory")
    first = mt_harness.run_distributed(train_and_stop, 2, str(root))
    _lose(root / "lost-pod" / "shm", pod=1)
    _lose(root / "both" / "shm", pod=1, rank=1)
    _lose(root / "both" / "shm", pod=0, rank=1)
    damaged = root / "damaged" / "shm" / "pod-1" / snapshot_file.name(1, EVERY)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x01
    damaged.write_bytes(bytes(data))
    return root, first, mt_harness.run_distributed(start_again, 2, str(root))


Session = tuple[Path, list[dict], list[dict]]
"""The root, what each rank of the first processes returned, and of the second."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_restore_equals_an_unfaulted_run(session: Session, name: str) -> None:
    root, first, second = session
    for before, after in zip(first, second, strict=True):
        assert (after[name]["step"], after[name]["source"]) == (EVERY, "memory")
        assert _same(after[name]["weights"], before[name]["unfaulted"])  # bit for bit
        assert before[name]["last"] == EVERY
    # the planner's estimate (what validate checks /dev/shm against) is the largest rank's
    # tensors: its file is that and a header
    largest = max(r[name]["file_bytes"] for r in first)
    planned_bytes = first[0][name]["planned"]
    assert planned_bytes <= largest <= planned_bytes + snapshot_file.HEADER_SLACK
    assert store.latest(root / name / "storage", hashes=False) is None  # nothing to fall back on


@pytest.mark.slow
def test_a_lost_pods_shards_come_from_its_peer(session: Session) -> None:
    root, first, second = session
    for before, after in zip(first, second, strict=True):
        case = after["lost-pod"]
        assert (case["step"], case["source"]) == (EVERY, "memory")
        assert _same(case["weights"], before["dp2"]["unfaulted"])
    # the replaced pod holds its rank's snapshot again (sent by pod 0)
    assert (root / "lost-pod" / "shm" / "pod-1" / snapshot_file.name(1, EVERY)).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("case", STORED)
def test_both_copies_lost_or_a_damaged_snapshot_falls_back_to_storage(
    session: Session, case: str
) -> None:
    """Both copies of rank 1 gone, or its own copy's checksum refusing it: storage, exactly."""
    _, first, second = session
    for before, after in zip(first, second, strict=True):
        assert (after[case]["step"], after[case]["source"]) == (EVERY, "storage")
        assert _same(after[case]["weights"], before["dp2"]["unfaulted"])


@pytest.mark.slow
def test_a_snapshot_of_another_layout_is_refused(session: Session) -> None:
    for result in session[2]:
        assert result["other-layout"] == (None, "none")  # not loaded; no storage either


@pytest.mark.slow
def test_a_pod_without_room_leaves_no_snapshot_and_blocks_nobody(session: Session) -> None:
    for result in session[1]:  # rank 0's own copy is dropped: the step is incomplete
        assert result["no-room"] == {"last": None, "step": STOP, "pod-0": []}


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
