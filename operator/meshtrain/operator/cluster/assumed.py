"""Pods assumed before they exist: :class:`Assumed`, the operator's assume cache.

Once a gang's plan is chosen under the placement lock, its pods' requests are charged to their
planned nodes (as kube-scheduler assumes a pod on its node before the binding is written), so
the next plan sees those GPUs taken while the pods are still being created outside the lock.
An assumption ends when its pod appears in the informer (which then counts the pod itself),
when its creation fails or its job leaves, and after :data:`ASSUME_SECONDS` at the latest.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping

from meshtrain.operator.cluster import metrics

Key = tuple[str, str]
"""(namespace, name) of a pod."""
Charge = Callable[[str, Mapping[str, int], int], None]
"""Adds (sign 1) or removes (sign -1) one pod's requests on a node of the usage counts."""
ASSUME_SECONDS = 60.0
"""Longest an assumption lives past its gang's last sign of progress: it is renewed while the
gang's pods are being created (``creating.create``) and once more when that ends, so this
bounds only the informer's lag in showing a created pod; past it the pod is counted only once
it exists (the check of the planned nodes before the gates are lifted still catches a node
taken twice)."""


@dataclasses.dataclass(frozen=True)
class Assumption:
    """A pod charged to its planned node before it exists."""

    job: str
    """UID of the job whose gang it belongs to."""
    node: str
    """The node its plan chose."""
    charged: Mapping[str, int]
    """What it is charged there (its requests, as the informer would count the pod)."""
    until: float
    """Monotonic time at which the assumption ends unless the pod appeared before."""


class Assumed:
    """Assumed pods by key, charged through ``charge`` while they last."""

    def __init__(self, charge: Charge) -> None:
        self._charge = charge
        self.pods: dict[Key, Assumption] = {}
        """Assumed pods by (namespace, name)."""
        self._by_job: dict[str, set[Key]] = {}
        """Job UID -> the keys of its assumed pods."""
        self._expiry: collections.deque[tuple[float, Key]] = collections.deque()
        """(until, key) in the order assumed: ``until`` never decreases along it."""
        self.expired = 0
        """Assumptions that ran out before their pod appeared (the metric's source)."""
        self.changes = 0
        """Assumptions made or ended so far (what was computed on them is current while equal)."""

    def assume(
        self, job: str, pods: Iterable[tuple[Key, str, Mapping[str, int]]], now: float
    ) -> int:
        """Charge each (key, node, requests) of job ``job`` until ``now`` + :data:`ASSUME_SECONDS`;
        returns how many were assumed (a key assumed already is charged once)."""
        until, count = now + ASSUME_SECONDS, 0
        for key, node, charged in pods:
            self._end(key)
            self.pods[key] = Assumption(job, node, dict(charged), until)
            self._by_job.setdefault(job, set()).add(key)
            self._expiry.append((until, key))
            self._charge(node, charged, 1)
            self.changes += 1
            count += 1
        return count

    def renew(self, job: str, now: float) -> None:
        """Let job ``job``'s assumptions live until ``now`` + :data:`ASSUME_SECONDS` (its pods are
        still being created, or were just created and are yet to be seen)."""
        until = now + ASSUME_SECONDS
        for key in self._by_job.get(job, ()):
            self.pods[key] = dataclasses.replace(self.pods[key], until=until)
            self._expiry.append((until, key))

    def seen(self, key: Key) -> None:
        """The pod ``key`` appeared in the informer: it is counted as itself from now on."""
        if key in self.pods:
            self._end(key)

    def release(self, job: str) -> int:
        """End every assumption of job ``job`` (its creation failed, or it left); how many ended."""
        keys = self._by_job.pop(job, set())
        for key in keys:
            self._end(key)
        return len(keys)

    def expire(self, now: float) -> None:
        """End the assumptions past their time (cheap when none is: the oldest is looked at)."""
        while self._expiry and self._expiry[0][0] <= now:
            until, key = self._expiry.popleft()
            found = self.pods.get(key)
            if found is not None and found.until == until:
                self.expired += 1
                metrics.ASSUMPTIONS_EXPIRED.inc()
                self._end(key)

    def _end(self, key: Key) -> None:
        found = self.pods.pop(key, None)
        if found is None:
            return
        self.changes += 1
        self._charge(found.node, found.charged, -1)
        keys = self._by_job.get(found.job)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_job[found.job]
