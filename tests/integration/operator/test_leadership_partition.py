"""A leader cut off from the API server stops acting within its renew deadline.

The operator talks to the real kube-apiserver through a TCP relay that this test
can freeze: connections stay open but no byte passes (a network partition that
drops packets, not one that resets connections).  A candidate may take the
Lease ``lease_seconds`` after it last saw it renewed, so the partitioned leader
must have stopped before then; a renewal request that simply hangs must not
keep it leading.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import yaml

from meshtrain.operator.cluster import kube, leadership


class _Relay:
    """TCP relay to the API server that can be frozen (nothing passes, nothing is closed)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.flowing.wait()
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        for task in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            started = asyncio.ensure_future(task)
            self._tasks.add(started)
            started.add_done_callback(self._tasks.discard)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.flowing.set()
        for task in list(self._tasks):
            task.cancel()
        self._server.close()


def test_a_partitioned_leader_stops_leading_before_a_standby_may_take_over(
    control_plane, kube_api, tmp_path
):
    config = yaml.safe_load(control_plane.kubeconfig_path.read_text())
    server = config["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    election = leadership.Election(
        lease=f"partition-{uuid.uuid4().hex[:6]}",
        namespace="default",
        identity="partitioned",
        lease_seconds=6,
        renew_deadline=4.0,
        retry=1.0,
    )

    async def scenario() -> float | None:
        relay = _Relay(host, int(port))
        local = await relay.start()
        config["clusters"][0]["cluster"]["server"] = f"https://{host}:{local}"
        kubeconfig = tmp_path / "relayed.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        client = await kube.Client.connect(kubeconfig=str(kubeconfig))
        leading = asyncio.Event()
        elector = asyncio.create_task(
            leadership.run(client, election, leading, leadership.Tenure())
        )
        try:
            await asyncio.wait_for(leading.wait(), timeout=30)
            await asyncio.sleep(election.retry * 1.5)  # at least one renewal through the relay
            relay.flowing.clear()
            cut = time.monotonic()
            while leading.is_set() and time.monotonic() - cut < election.lease_seconds + 10:
                await asyncio.sleep(0.05)
            return None if leading.is_set() else time.monotonic() - cut
        finally:
            elector.cancel()
            await relay.stop()
            await asyncio.gather(elector, return_exceptions=True)
            await client.close()

    stopped_after = asyncio.run(scenario())
    assert stopped_after is not None, (
        f"the leader still held 'leading' {election.lease_seconds + 10} s after it was cut off "
        "from the API server: a standby takes the Lease after "
        f"{election.lease_seconds} s, so two replicas would act at once"
    )
    # It last renewed at most one retry before the cut; a standby may start lease_seconds after that.
    assert stopped_after < election.lease_seconds - election.retry, (
        f"the partitioned leader stopped {stopped_after:.1f} s after the cut; "
        f"a standby may take over {election.lease_seconds - election.retry:.1f} s after it"
    )


def test_two_operators_outside_pods_never_lead_at_once(control_plane, kube_api, monkeypatch):
    """Two ``meshtrain operator`` processes on one host (no $POD_NAME) default their identity
    from the host name; with the same identity each renewed the other's Lease as its own."""
    monkeypatch.delenv("POD_NAME", raising=False)
    lease = f"twins-{uuid.uuid4().hex[:6]}"
    elections = [
        leadership.Election(
            lease=lease,
            namespace="default",
            identity=leadership.default_identity(),
            lease_seconds=3,
            renew_deadline=2.0,
            retry=1.0,
        )
        for _ in range(2)
    ]

    async def scenario() -> int:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        flags = [asyncio.Event(), asyncio.Event()]
        electors = [
            asyncio.create_task(leadership.run(client, e, f, leadership.Tenure()))
            for e, f in zip(elections, flags, strict=True)
        ]
        both = 0
        try:
            await asyncio.wait_for(
                asyncio.wait(
                    [asyncio.ensure_future(f.wait()) for f in flags],
                    return_when=asyncio.FIRST_COMPLETED,
                ),
                timeout=30,
            )
            until = time.monotonic() + 8
            while time.monotonic() < until:
                both += all(f.is_set() for f in flags)
                await asyncio.sleep(0.05)
        finally:
            for elector in electors:
                elector.cancel()
            await asyncio.gather(*electors, return_exceptions=True)
            await client.close()
        return both

    both = asyncio.run(scenario())
    assert both == 0, f"both operators held 'leading' at {both} of the samples over 8 s"
