"""A placement pass spends a bounded time on tenant CEL: a selector shape of the largest cost the
compile-time bounds let through, on devices that differ in what it reads (no verdict remembered
for one serves another), would take minutes over a thousand nodes; the pass stops evaluating
once its budget (``limits.MAX_CEL_SECONDS_PER_PASS``) is spent and leaves the other nodes to
kube-scheduler, so the event loop is never held for long."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshtrain.api import limits, loading
from meshtrain.operator.policy import device_cel, devices
from tests.builders import JobBuilder
from tests.unit.test_operator_devices import CLASS, DRIVER, gpu, slice_of

NODES = 1_000
TERMS = 15
"""``uuid == ...`` terms of one selector: just under ``limits.MAX_EVALUATED_SELECTOR_LENGTH``."""


def _slow_selector(salt: int) -> str:
    """A selector that reads each device's uuid (unique per device) through a long ``||``
    chain, every term evaluated before the final ``true``."""
    terms = [f'device.attributes["{DRIVER}"].uuid == "GPU-{salt}{i:03d}"' for i in range(TERMS)]
    return " || ".join([*terms, "true"])


def _inventory() -> devices.Inventory:
    slices = []
    for node in range(NODES):
        gpus = [gpu(i) for i in range(8)]
        for index, found in enumerate(gpus):
            found["attributes"]["uuid"] = {"string": f"GPU-{node:05d}-{index}"}
        slices.append({**slice_of(f"n{node}", gpus), "metadata": {"name": f"n{node}"}})
    return devices.inventory(slices, [], [CLASS])


def test_the_slow_selector_shape_passes_the_compile_time_bounds():
    selectors = [_slow_selector(s) for s in range(4)]
    assert all(len(s) <= limits.MAX_EVALUATED_SELECTOR_LENGTH for s in selectors)
    assert sum(map(len, selectors)) <= limits.MAX_EVALUATED_SELECTORS_CHARS
    assert not any(
        isinstance(device_cel.compile_selector(s), device_cel.Unknown) for s in selectors
    )


@pytest.mark.alone  # a wall-time budget: beside another worker, one evaluation outlasts it
def test_a_pass_over_a_thousand_nodes_of_slow_selectors_stops_at_its_cel_budget():
    found = _inventory()
    job = JobBuilder().layout(data=8, gpus_per_node=8).resources(cpu="100m")
    job.dra(DRIVER, *(_slow_selector(s) for s in range(4)))
    ask = devices.ask_of(loading.parse_spec(job.raw()), found)
    gaps: list[float] = []

    async def run() -> list[devices.NodeDevices]:
        async def tick() -> None:  # what else the event loop runs (lease renewals, watches)
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        judged = [devices.judge(ask, f"n{node}", {}, {}) for node in range(NODES)]  # one pass
        await asyncio.sleep(0.05)
        ticker.cancel()
        return judged

    judged = asyncio.run(run())
    evaluated = [j for j in judged if j.slots is not None]
    left = [j for j in judged if j.slots is None]
    # the first nodes were judged (8 free devices, one pod each), the rest left to the scheduler
    assert evaluated and all(j.slots == 1 for j in evaluated)
    assert len(left) > NODES // 2, f"only {len(left)} of {NODES} nodes left to the scheduler"
    assert ask.budget.spent
    # one evaluation may start before the budget is spent: the pass ends soon after it; without
    # the budget it would run every node's 32 evaluations (minutes on this machine)
    assert max(gaps) < limits.MAX_CEL_SECONDS_PER_PASS + 5.0, max(gaps)
    # a new pass (a new ask) has its own budget
    again = devices.ask_of(loading.parse_spec(job.raw()), found)
    assert devices.judge(again, "n0", {}, {}).slots == 1
