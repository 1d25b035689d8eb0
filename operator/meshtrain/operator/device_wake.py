"""Which waiting jobs a change of devices on some nodes could admit.

A slice published, a claim deallocated or deleted, wakes only the waiting jobs whose devices
could come from those nodes: a DRA job whose claim one of them now serves (or whose verdict is
left to kube-scheduler there), and an extended-resource job a KEP-5004 DeviceClass serves there;
then the queue's own rule (:meth:`waiting.Queue.wake`) applies.  A job the change cannot help
stays asleep: its last plan saw every other node as it still is.
"""

from __future__ import annotations

import dataclasses

from meshtrain.operator import waiting
from meshtrain.operator.policy import device_cel, devices, feasibility

MAX_NODES = 256
"""Changed nodes judged one by one per wake-up; more, and every waiting job is asked as for any
capacity change (a bound on the work per wake-up)."""


def admitted(
    queue: waiting.Queue, keys: list[waiting.Key], nodes: frozenset[str]
) -> list[waiting.Key]:
    """Of the waiting jobs ``keys``, those a device change on ``nodes`` could admit."""
    if len(nodes) > MAX_NODES:
        return queue.wake(keys)
    inventory = queue.cache.inventory()
    budget = device_cel.Budget()  # one pass's CEL time for all the jobs: past it, all are woken
    kept = [key for key in keys if _could_use(queue, key, nodes, inventory, budget)]
    return queue.wake(kept) if kept else []


def _could_use(
    queue: waiting.Queue,
    key: waiting.Key,
    nodes: frozenset[str],
    found: devices.Inventory,
    budget: device_cel.Budget,
) -> bool:
    """Whether a pod of the waiting job ``key`` may now take devices on one of ``nodes``."""
    spec = queue.specs.get(queue.uid_of(key) or "")
    if spec is None:
        return True  # not known here: asked as before
    ask = dataclasses.replace(devices.ask_of(spec, found), budget=budget)
    for node in sorted(nodes):
        obj = queue.cache.nodes.get(("", node))
        if obj is None:
            continue
        used = queue.cache.node_usage(node) or feasibility.Usage()
        judged = devices.judge(ask, node, feasibility.allocatable(obj), used.requested)
        if judged.slots is None and ask.request is not None:
            return True  # the scheduler's verdict, not the operator's: it may fit
        if judged.slots is not None and judged.slots > 0:
            return True
    return False
