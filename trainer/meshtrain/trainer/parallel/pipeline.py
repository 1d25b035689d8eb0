"""Pipeline parallelism: splitting the model into stages and running a schedule.

:func:`split_model` cuts the model into this rank's chunks; :class:`PipelineExecutor` walks the
:mod:`.schedules` action list of one step, reporting every forward, backward and wait.  Sends and
receives go through ``batch_isend_irecv`` on two process groups (one per direction, each its own
FIFO) and no send is waited for until the step ends, so a valid schedule cannot deadlock
(docs/trainer.md, "Pipeline parallel", also on why not ``torch.distributed.pipelining``).  A sent
tensor is dropped as soon as its send is seen complete (polled, never waited, before each action),
so sent activations and input gradients no longer pile up over the micro-batches of a step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtrain.trainer.models import documents as documents_mod
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import schedules
from meshtrain.trainer.telemetry import clocks, recording

COMPUTE_RANGES = ("meshtrain.forward", "meshtrain.backward")
"""``record_function`` names of a forward and a backward, as timed for the recorder (what a
``torch.profiler`` trace is checked against: ``benchmarks/bench_mfu.py --profile``)."""


def split_layers(layers: int, parts: int) -> list[range]:
    """Balanced contiguous block ranges for ``parts`` virtual stages (extras go to the middle)."""
    base, extra = divmod(layers, parts)
    # The first part carries the embeddings and the last the head: give any
    # extra layers to the parts in between first.
    order = list(range(1, parts - 1)) + [parts - 1, 0] if parts > 2 else list(range(parts))
    sizes = [base] * parts
    for i in order[:extra]:
        sizes[i] += 1
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [range(starts[i], starts[i] + sizes[i]) for i in range(parts)]


def split_model(
    model: gpt.GPT, *, stage: int, stages: int, virtual_stages: int = 1
) -> list[gpt.GPT]:
    """This stage's chunks, chunk ``c`` being virtual stage ``c * stages + stage``.

    With one chunk the model is pruned in place; with several, each chunk is a
    pruned copy (the caller drops the full model afterwards).
    """
    parts = stages * virtual_stages
    ranges = split_layers(model.config.layers, parts)
    chunks = []
    for chunk in range(virtual_stages):
        j = schedules.virtual_stage(stage, chunk, stages)
        part = model if virtual_stages == 1 else copy.deepcopy(model)
        for name in list(part.blocks.keys()):
            if int(name) not in ranges[j]:
                del part.blocks[name]
        if j != 0:
            part.tok_emb = part.pos_emb = None
        if j != parts - 1:
            part.norm = part.head = None
        chunks.append(part)
    return chunks


@dataclasses.dataclass
class PipelineContext:
    """This rank's place in its pipeline."""

    stage: int
    """Pipeline stage index."""
    stages: int
    """Pipeline degree p."""
    ranks: list[int]
    """Global rank of each stage of this pipeline."""
    forward_group: dist.ProcessGroup | None
    """Group carrying activations (None when stages == 1)."""
    backward_group: dist.ProcessGroup | None
    """Group carrying gradients (None when stages == 1)."""


class SendReaper:
    """Sends in flight, each tensor dropped as soon as its send is seen complete.

    The schedule never waits for a send mid-step (the deadlock freedom above), so
    completion is learnt without blocking it: NCCL's works answer ``is_completed``
    (polled before each action); gloo's point-to-point works report completion only
    once waited for, so a thread of the step waits for them in send order (a send
    waits for its peer's receive, which the peer posts in its own time).
    """

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        """Whether a thread waits for the sends (gloo), rather than polling them (NCCL)."""
        self._polled: list[tuple[list[dist.Work], torch.Tensor]] = []
        self._queue: queue.Queue[tuple[list[dist.Work], torch.Tensor] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def add(self, works: list[dist.Work], tensor: torch.Tensor) -> None:
        """Keep ``tensor`` alive until ``works`` (its send) are done."""
        if not self.threaded:
            self._polled.append((works, tensor))
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._wait_each, name="pipeline-sends", daemon=True
            )  # daemon: a step that fails midway must not hold the interpreter at exit
            self._thread.start()
        self._queue.put((works, tensor))

    def poll(self) -> None:
        """Drop the sends seen complete (never blocks)."""
        self._polled = [
            (works, t) for works, t in self._polled if not all(w.is_completed() for w in works)
        ]

    def drain(self) -> None:
        """Wait until every send is done (the step's end)."""
        for works, _ in self._polled:
            for work in works:
                work.wait()
        self._polled = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._errors:
            raise self._errors.pop()

    def _wait_each(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                for work in item[0]:
                    work.wait()
            except BaseException as error:  # noqa: BLE001 - re-raised on the schedule's thread
                self._errors.append(error)
            item = None  # the works and the tensor die here, not at the next send


@dataclasses.dataclass
class _Posted:
    """A receive in flight: the works of its batch and the buffer it fills."""

    works: list[dist.Work]
    buffer: torch.Tensor


class PipelineExecutor:
    """Runs one stage's schedule for one optimizer step."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        ctx: PipelineContext,
        *,
        schedule: str,
        micro_batches: int,
        activation_shape: tuple[int, ...],
        activation_dtype: torch.dtype,
        wire_dtype: torch.dtype | None = None,
        device: torch.device,
        loss_fn: Callable[..., torch.Tensor],
        recorder: recording.StepRecorder,
        clock: clocks.Clock,
        grad_sync: Callable[[bool], None] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.chunks = chunks
        self.ctx = ctx
        self.virtual_stages = len(chunks)
        self.micro_batches = micro_batches
        self.actions = schedules.actions(
            schedule, ctx.stages, micro_batches, ctx.stage, self.virtual_stages
        )
        self.last_backward = schedules.last_backward(self.actions)
        self.activation_shape = activation_shape
        self.activation_dtype = activation_dtype
        self.wire_dtype = wire_dtype or activation_dtype
        """Element type of activations and gradients between stages (bf16 under autocast)."""
        self.device = device
        self.loss_fn = loss_fn
        self.recorder = recorder
        self.clock = clock
        self.grad_sync = grad_sync
        self.autocast = autocast
        self.last_virtual = ctx.stages * self.virtual_stages - 1
        self.sends = SendReaper(threaded=self._gloo())
        """Sends in flight, each freed when done."""
        for group in (ctx.forward_group, ctx.backward_group):
            if group is not None and dist.get_backend(group) != "gloo":
                # NCCL creates a communicator on its first call, which every member must join:
                # make that a collective, not a batched p2p between two of the stages.
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    @property
    def holds_loss(self) -> bool:
        """Whether this stage computes the loss (it holds the last virtual stage)."""
        return self.ctx.stage == self.ctx.stages - 1

    @property
    def needs_inputs(self) -> bool:
        """Whether this stage reads token ids (it holds virtual stage 0)."""
        return self.ctx.stage == 0

    def _compute(
        self,
        chunk: int,
        x: torch.Tensor,
        target: torch.Tensor | None,
        documents: documents_mod.Documents | None,
    ) -> torch.Tensor:
        """Chunk ``chunk`` on ``x``: its loss on ``target`` on the last virtual stage, else its output.

        ``documents`` (``training.documentMask``) is rebuilt by every stage from the micro-batch's
        token ids, which every stage's sampler reads: nothing extra travels between stages.
        """
        kwargs = {} if documents is None else {"documents": documents}
        if target is not None:
            return self.loss_fn(self.chunks[chunk], x, target, **kwargs)
        out: torch.Tensor = self.chunks[chunk](x, **kwargs)
        return out

    def _peer(self, j: int) -> int:
        return self.ctx.ranks[j % self.ctx.stages]

    def _recv_op(self, index: int) -> dist.P2POp | None:
        """The receive action ``index`` needs (None: it needs none, or it is out of range)."""
        if index >= len(self.actions):
            return None
        action = self.actions[index]
        j = schedules.virtual_stage(self.ctx.stage, action.chunk, self.ctx.stages)
        if action.kind == "forward" and j > 0:
            src, group = j - 1, self.ctx.forward_group
        elif action.kind == "backward" and j < self.last_virtual:
            src, group = j + 1, self.ctx.backward_group
        else:
            return None
        buffer = torch.empty(self.activation_shape, dtype=self.wire_dtype, device=self.device)
        return dist.P2POp(dist.irecv, buffer, peer=self._peer(src), group=group)

    def _post_recv(self, index: int) -> _Posted | None:
        """Post the receive action ``index`` needs, alone in its batch."""
        op = self._recv_op(index)
        return None if op is None else _Posted(dist.batch_isend_irecv([op]), op.tensor)

    def _send(
        self, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, next_index: int | None
    ) -> tuple[list[dist.Work], _Posted | None]:
        """Send ``tensor``, batched with action ``next_index``'s receive when that uses the same group.

        Returns the send's works (to wait for when the step ends) and the posted receive, if batched.
        """
        ops = [dist.P2POp(dist.isend, tensor, peer=peer, group=group)]
        recv = self._recv_op(next_index) if next_index is not None else None
        if recv is not None and recv.group == group:
            ops.append(recv)
        works = dist.batch_isend_irecv(ops)
        if len(ops) == 1:
            return works, None
        if len(works) == len(ops):
            # gloo: one work per op, each waited once (a gloo receive waited twice waits for a
            # second message); the receive must not wait for the send either (that waits for
            # the peer's matching receive, which may come later).
            return works[:1], _Posted(works[1:], recv.tensor)
        return works, _Posted(works, recv.tensor)  # NCCL: one work for the batch, stream-side

    def _wait_recv(self, posted: _Posted) -> torch.Tensor:
        start = self.clock.now()
        for work in posted.works:
            work.wait()
        self.recorder.wait("recv", start, self.clock.now())
        return posted.buffer.to(self.activation_dtype)

    def _prefetch(self) -> bool:
        """Whether to post the next action's receive before this action computes.

        gloo matches a send with its receive only once the receive is posted
        and then copies the data: a receive posted when its data is needed puts
        that hand-over (milliseconds for a few hundred KiB) on the critical path
        of every micro-batch.  gloo runs point-to-point operations
        independently, so posting early reorders nothing.  NCCL queues a
        communicator's operations on one stream, where an early receive would
        hold back this rank's next send on the same group; there (and with the
        interleaved schedule, whose p = 2 sends both ways on one group) the
        receive is posted when needed.
        """
        return self.virtual_stages == 1 and self._gloo()

    def _gloo(self) -> bool:
        """Whether this pipeline's traffic runs over gloo (False without a pipeline)."""
        if self.ctx.forward_group is None:
            return False
        return all(
            dist.get_backend(g) == "gloo" for g in (self.ctx.forward_group, self.ctx.backward_group)
        )

    @torch.no_grad()
    def forward_only(
        self,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        documents: Callable[[int], documents_mod.Documents] | None = None,
    ) -> torch.Tensor:
        """Evaluation: every micro-batch forward through every chunk, no backward; returns the summed loss/m.

        Micro-batch by micro-batch, chunk by chunk, in the same order on every
        stage, so each pair of stages exchanges activations in one order.
        """
        m, p = self.micro_batches, self.ctx.stages
        loss_sum = torch.zeros((), device=self.device)
        for microbatch in range(m):
            for chunk in range(self.virtual_stages):
                self.sends.poll()
                j = schedules.virtual_stage(self.ctx.stage, chunk, p)
                if j == 0:
                    x = inputs[microbatch].to(self.device)
                else:
                    x = torch.empty(
                        self.activation_shape, dtype=self.wire_dtype, device=self.device
                    )
                    recv = dist.P2POp(dist.irecv, x, self._peer(j - 1), self.ctx.forward_group)
                    for work in dist.batch_isend_irecv([recv]):
                        work.wait()
                    x = x.to(self.activation_dtype)
                docs = documents(microbatch) if documents is not None else None
                with self.autocast():
                    if j == self.last_virtual:
                        target = targets[microbatch].to(self.device)
                        loss_sum += self._compute(chunk, x, target, docs) / m
                    else:
                        out = self._compute(chunk, x, None, docs)
                if j != self.last_virtual:
                    sent = out.to(self.wire_dtype).contiguous()
                    send = dist.P2POp(dist.isend, sent, self._peer(j + 1), self.ctx.forward_group)
                    self.sends.add(dist.batch_isend_irecv([send]), sent)
                    del sent
        self.sends.drain()
        return loss_sum

    def run(
        self,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        documents: Callable[[int], documents_mod.Documents] | None = None,
    ) -> torch.Tensor:
        """One step: every forward and backward of this stage; returns the summed loss/m (0 off the last stage).

        ``inputs`` are needed on the first stage and ``targets`` on the last
        (each a list of (micro_batch, seq_len) tensors); ``documents`` (``training.documentMask``)
        builds a micro-batch's mask on every stage when its forward runs, so only the masks of
        micro-batches in flight (autograd keeps them for backward) are alive.  Gradients are left
        accumulated in the parameters (the reducer syncs them).
        """
        m, p = self.micro_batches, self.ctx.stages
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        sending = False  # whether this step sent anything (waited for at its end)
        loss_sum = torch.zeros((), device=self.device)
        prefetch = self._prefetch()
        posted: dict[int, _Posted | None] = {}  # action index -> its receive
        for index, action in enumerate(self.actions):
            self.sends.poll()
            j = schedules.virtual_stage(self.ctx.stage, action.chunk, p)
            key = (action.microbatch, action.chunk)
            recv = posted.pop(index) if index in posted else self._post_recv(index)
            if prefetch:  # each group's receives are still posted in schedule order
                posted[index + 1] = self._post_recv(index + 1)
            batch_with = None if prefetch else index + 1  # the next receive, if not posted yet
            if action.kind == "forward":
                if j == 0:
                    x = inputs[action.microbatch].to(self.device)
                else:
                    x = self._wait_recv(recv).requires_grad_()
                with torch.profiler.record_function(COMPUTE_RANGES[0]):
                    start = self.clock.now()
                    docs = documents(action.microbatch) if documents is not None else None
                    with self.autocast():
                        if j == self.last_virtual:
                            target = targets[action.microbatch].to(self.device)
                            out = self._compute(action.chunk, x, target, docs) / m
                        else:
                            out = self._compute(action.chunk, x, None, docs)
                    end = self.clock.now()
                self.recorder.compute("forward", action.microbatch, action.chunk, start, end)
                saved[key] = (x if j > 0 else None, out)
                if j == self.last_virtual:
                    loss_sum += out.detach()
                else:
                    sent = out.detach().to(self.wire_dtype).contiguous()
                    works, batched = self._send(
                        sent, self._peer(j + 1), self.ctx.forward_group, batch_with
                    )
                    self.sends.add(works, sent)
                    sending = True
                    del sent, works
                    if batched is not None:
                        posted[index + 1] = batched
                del x, out, recv  # saved keeps what backward needs
            else:
                x, out = saved.pop(key)
                grad = None if j == self.last_virtual else self._wait_recv(recv).to(out.dtype)
                if self.grad_sync is not None:
                    self.grad_sync(self.last_backward[action.chunk] == action)
                with torch.profiler.record_function(COMPUTE_RANGES[1]):
                    start = self.clock.now()
                    torch.autograd.backward(out, grad)
                    end = self.clock.now()
                self.recorder.compute("backward", action.microbatch, action.chunk, start, end)
                if x is not None:
                    sent = x.grad.to(self.wire_dtype).contiguous()
                    works, batched = self._send(
                        sent, self._peer(j - 1), self.ctx.backward_group, batch_with
                    )
                    self.sends.add(works, sent)
                    sending = True
                    del sent, works
                    if batched is not None:
                        posted[index + 1] = batched
                del x, out, grad, recv  # the received gradient and the input die with the backward
        if sending:
            start = self.clock.now()
            self.sends.drain()
            self.recorder.wait("send", start, self.clock.now())
        return loss_sum
