"""What other tenants left of this host's cores while a benchmark's child processes ran.

A background thread samples, every ``interval`` seconds, the host's busy CPU
ticks (``/proc/stat``: user, nice, system, irq, softirq, steal), the CPU ticks
of this process's descendants (``/proc/PID/stat`` utime + stime) and the
1-minute load average.  Over any window, the cores the job could use are the
host's cores less what everything else kept busy:
``cores - (busy - job) / (HZ x seconds)``.  Linux only.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from types import TracebackType

HZ = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True)
class Sample:
    time: float
    """time.time() of the sample (the step log's clock)."""
    busy_ticks: int
    """Host-wide busy CPU ticks since boot."""
    job_ticks: int
    """CPU ticks of this process's live descendants."""
    load: float
    """1-minute load average."""


def _busy_ticks() -> int:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def _descendant_ticks(root: int) -> int:
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    total = 0
    for pid in ticks:
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        if ancestor == root:
            total += ticks[pid]
    return total


class Sampler:
    """Samples in a daemon thread while used as a context manager."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.samples.append(
            Sample(
                time=time.time(),
                busy_ticks=_busy_ticks(),
                job_ticks=_descendant_ticks(os.getpid()),
                load=os.getloadavg()[0],
            )
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> Sampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _at(self, moment: float) -> tuple[float, float]:
        """Host busy and job CPU seconds at ``moment``, linear between the samples around it."""
        before = [s for s in self.samples if s.time <= moment]
        after = [s for s in self.samples if s.time >= moment]
        if not before or not after:
            raise ValueError(f"{moment} is outside the sampled span")
        low, high = before[-1], after[0]
        share = (moment - low.time) / (high.time - low.time) if high.time > low.time else 0.0

        def between(a: int, b: int) -> float:
            return (a + share * (b - a)) / HZ

        return between(low.busy_ticks, high.busy_ticks), between(low.job_ticks, high.job_ticks)

    def spans(self, spans: list[tuple[float, float]], cores: int) -> dict[str, float]:
        """Cores left to the job and the job's CPU seconds over the union of ``spans`` (start, end).

        For spans shorter than the sampling interval (single steps): the
        counters are interpolated at each span's ends.
        """
        seconds = others = job = 0.0
        for start, end in spans:
            busy_start, job_start = self._at(start)
            busy_end, job_end = self._at(end)
            seconds += end - start
            job += job_end - job_start
            others += (busy_end - busy_start) - (job_end - job_start)
        if seconds <= 0:
            raise ValueError("spans cover no time")
        return {
            "seconds": seconds,
            "available_cores": min(float(cores), max(0.05, cores - others / seconds)),
            "others_cores": others / seconds,
            "job_cpu_seconds": job,
        }

    def window(self, start: float, end: float, cores: int) -> dict[str, float]:
        """Cores left to the job, the job's CPU seconds and the load between ``start`` and ``end``."""
        inside = [s for s in self.samples if start <= s.time <= end]
        if len(inside) < 2:
            raise ValueError(f"fewer than two samples between {start} and {end}")
        first, last = inside[0], inside[-1]
        seconds = last.time - first.time
        job = (last.job_ticks - first.job_ticks) / HZ
        others = (last.busy_ticks - first.busy_ticks) / HZ - job
        return {
            "seconds": seconds,
            "available_cores": min(float(cores), max(0.05, cores - others / seconds)),
            "others_cores": others / seconds,
            "job_cpu_seconds": job,
            "load_min": min(s.load for s in inside),
            "load_max": max(s.load for s in inside),
        }
