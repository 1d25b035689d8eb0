"""A checkpoint's hashing split comes from rank 0's one listing: no other rank lists the save.

Three gloo ranks (dp3) save a checkpoint through :class:`.checkpointer.Checkpointer`, each with
``os.scandir`` and ``os.listdir`` counted (every listing ``pathlib`` makes goes through them).
Ranks 1 and 2 see a lagging directory, as an NFS attribute cache shows it: their listing of the
save in progress lacks one file.  Were the split computed from each rank's own listing, their
shares would shift and a file would go unhashed (or be hashed twice).  Expected, from the files
on disk: ranks 1 and 2 list no save directory; the files the ranks hashed are disjoint, cover
every data file of the published checkpoint, and are what its marker lists.  ``make test`` tier.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mt_harness
import pytest
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer, store
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder

WORLD = 3


def _save_counting_listings(raw: dict, root: str) -> dict[str, Any]:
    """Save once on this rank; the save directories it listed and the files it hashed."""
    rank = dist.get_rank()
    listed: list[str] = []
    hashed: list[str] = []
    real_scandir, real_listdir, real_describe = os.scandir, os.listdir, store.describe_files

    def saving(path: Any) -> bool:
        return store.TMP_PREFIX in os.fspath(path)

    def scandir(path: Any = ".") -> Any:
        listed.extend([os.fspath(path)] if saving(path) else [])
        if rank and saving(path):  # a lagging view of the save: its last data file not yet seen
            entries = list(real_scandir(path))
            shown = sorted(e.name for e in entries if e.name != store.MARKER)[:-1]
            return _Listing([e for e in entries if e.name in shown])
        return real_scandir(path)

    def listdir(path: Any = ".") -> list[str]:
        listed.extend([os.fspath(path)] if saving(path) else [])
        return real_listdir(path)

    def describe(directory: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
        found = real_describe(directory, **kwargs)
        hashed.extend(found)
        return found

    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    eng.train_step()
    os.scandir, os.listdir, store.describe_files = scandir, listdir, describe  # type: ignore[assignment]
    try:
        published = checkpointer.Checkpointer(eng, root=root).save()
    finally:
        os.scandir, os.listdir, store.describe_files = real_scandir, real_listdir, real_describe
    return {"listed": listed, "hashed": hashed, "published": str(published)}


class _Listing(list[Any]):
    """A listing ``os.scandir`` returns, as a context manager and iterator."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def close(self) -> None:
        return None


@pytest.mark.slow
def test_only_rank_0_lists_the_save_and_every_rank_splits_its_listing(tmp_path: Path) -> None:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=WORLD)
        .training(globalBatch=6)
        .checkpoint(asyncSave=False)
        .raw()
    )
    results = mt_harness.run_distributed(_save_counting_listings, WORLD, raw, str(tmp_path))

    assert results[0]["listed"], "rank 0 lists the save once for the split"
    for rank in range(1, WORLD):
        assert results[rank]["listed"] == [], f"rank {rank} listed {results[rank]['listed']}"

    published = Path(results[0]["published"])
    on_disk = store.data_files(published)
    assert len(on_disk) > WORLD, "more files than ranks: every rank hashes some"
    shares = [result["hashed"] for result in results]
    assert all(shares), "every rank hashed its share"
    every = [name for share in shares for name in share]
    assert sorted(every) == on_disk, "each data file hashed once, by one rank"
    assert sorted(store.read_marker(published).files) == on_disk
