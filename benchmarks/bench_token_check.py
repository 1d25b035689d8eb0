"""Throughput of the whole-file token check a dataset runs when it is opened.

Writes a token file of ``--gib`` GiB per element type (uint16, uint32), then
times :func:`meshtrain.trainer.data.token_files.first_out_of_vocab` over all of it:
once right after writing (the file in the page cache, as on a rank whose
node just read it) and reports GB/s.  A second pass with a bad id in the
last token checks that the scan really reads to the end.  Then it opens the
file as a job does (:func:`meshtrain.trainer.data.token_files.open_token_file`) twice:
the first open scans and records the result (:mod:`meshtrain.trainer.data.vocab_scan`),
the second, a restart on the unchanged file, reads the record instead.

Run: ``python benchmarks/bench_token_check.py [--gib 1]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.trainer.data import token_files


def _write(path: Path, dtype: np.dtype, count: int, vocab: int) -> None:
    block = (np.arange(1 << 22, dtype=np.int64) % vocab).astype(dtype)
    with open(path, "wb") as out:
        for start in range(0, count, len(block)):
            out.write(block[: min(len(block), count - start)].tobytes())


def _time_scan(path: Path, dtype: str, vocab: int) -> tuple[float, tuple[int, int] | None]:
    ids = np.memmap(path, dtype=token_files.DTYPES[dtype], mode="r")
    start = time.perf_counter()
    found = token_files.first_out_of_vocab(ids, vocab)
    return time.perf_counter() - start, found


def _time_open(path: Path, dtype: str, vocab: int) -> float:
    start = time.perf_counter()
    token_files.open_token_file(path, dtype=dtype, vocab=vocab, seq_len=8, field="benchmark")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0, help="file size per dtype in GiB")
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt-token-check-") as tmp:
        for dtype, vocab in (("uint16", 50_304), ("uint32", 128_256)):
            np_dtype = token_files.DTYPES[dtype]
            count = nbytes // np_dtype.itemsize
            path = Path(tmp) / f"{dtype}.bin"
            _write(path, np_dtype, count, vocab)
            seconds, found = _time_scan(path, dtype, vocab)
            assert found is None
            with open(path, "r+b") as out:  # one bad id, in the very last token
                out.seek((count - 1) * np_dtype.itemsize)
                out.write(np.array([vocab], dtype=np_dtype).tobytes())
            bad_seconds, bad = _time_scan(path, dtype, vocab)
            assert bad == (count - 1, vocab), bad
            for sidecar in path.parent.glob(path.name + ".*"):
                sidecar.unlink()
            _write(path, np_dtype, count, vocab)
            first_open = _time_open(path, dtype, vocab)
            restart_open = _time_open(path, dtype, vocab)
            rows.append(
                {
                    "dtype": dtype,
                    "bytes": nbytes,
                    "tokens": count,
                    "seconds": seconds,
                    "gb_per_second": nbytes / seconds / 1e9,
                    "seconds_bad_last_token": bad_seconds,
                    "open_seconds_scanned": first_open,
                    "open_seconds_recorded": restart_open,
                }
            )
            path.unlink()
    print(
        f"{'dtype':<8} {'GiB':>5} {'seconds':>8} {'GB/s':>7} {'open scanned':>13} {'open recorded':>14}"
    )
    for row in rows:
        print(
            f"{row['dtype']:<8} {row['bytes'] / 2**30:>5.2f} {row['seconds']:>8.3f} "
            f"{row['gb_per_second']:>7.2f} {row['open_seconds_scanned']:>13.4f} "
            f"{row['open_seconds_recorded']:>14.4f}"
        )
    path = machine.write_results("token_check", rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
