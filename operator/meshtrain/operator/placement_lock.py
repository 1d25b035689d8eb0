"""The process-wide placement lock, with a fast lane: :class:`PlacementLock`.

Every job plans under one lock so two jobs never plan onto the same free GPUs.  Under churn
hundreds of waiting jobs queue for it, and a gang whose pods exist and only wait for their gates
to be lifted would queue behind all of their plans (a minute at 1,000 nodes on two cores).
Releasing a placed gang starts GPUs that are already held, so it goes first: :meth:`urgent`
waiters are served before every ordinary one, each lane in arrival order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class PlacementLock:
    """An asyncio lock whose :meth:`urgent` waiters go before the ordinary (``async with``) ones."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ordinary: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self._held

    async def acquire(self, *, urgent: bool = False) -> None:
        if not self._held:
            self._held = True
            return
        lane = self._urgent if urgent else self._ordinary
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the lock as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    lane.remove(waiter)
            raise

    def release(self) -> None:
        """Hand the lock to the first urgent waiter, else the first ordinary one, else free it."""
        for lane in (self._urgent, self._ordinary):
            while lane:
                waiter = lane.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the lock stays held: it changes hands
                    return
        self._held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    @contextlib.asynccontextmanager
    async def urgent(self) -> AsyncIterator[None]:
        """Hold the lock, ahead of every ordinary waiter."""
        await self.acquire(urgent=True)
        try:
            yield
        finally:
            self.release()
