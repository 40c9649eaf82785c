"""The prefill role: admit prompts, compute their K/V, hand the pages to the transfer.

Three queues, as in SGLang's disaggregated prefill:

- **bootstrap queue**: the capacity check. A prompt longer than this role's pool is given a
  pending 400 (`pending_finish`) and replaced by a one-token stub, exactly as SGLang's
  `set_finish_with_abort` did. Then prefill tells decode the request is bootstrapped.
- **waiting queue**: requests wait here while the pool is full (queued, not failed), then are
  prefilled into pages of this pool.
- **in-flight queue**: prefilled requests wait for decode's page list (`KVBootstrap`), are sent,
  and release their pages once the transfer has gone out.

Every queue asks `_gone(req)`. In the faulty engine that is `req.finished()`, which does not see
a pending finish: the stub flows on, one page is written and sent, and the done message says
success. The `reject-before-transfer` fix is the other branch of that one function.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from minigrid_engine.config import ServeConfig
from minigrid_engine.faults import FAULTS, NORMAL_STEPS, STEPS, Fault, parse_faults, take
from minigrid_engine.messages import (
    Abort,
    Bootstrapped,
    GenerateRequest,
    KVBootstrap,
    RecentRooms,
    TransferBegin,
    TransferDone,
)
from minigrid_engine.model import Transformer
from minigrid_engine.pool import KVPool
from minigrid_engine.request import Outcome, Request, State
from minigrid_engine.runner import FIRST_TOKEN, ModelRunner, sample, sampling_generator
from minigrid_engine.transfer import page_checksums

STUB_TOKEN = 0  # SGLang's placeholder input ids: [0]
Outgoing = Literal["send", "cancelled", "late"]  # PrefillScheduler.outgoing: what the sender does
LATE = "transfer deadline passed before it started"  # the failed done message of a "late" job


@dataclass
class TransferJob:
    """One request's pages to send: prefill `src_pages` into decode `dst_pages`, then `done`."""

    room: int
    src_pages: list[int]
    begin: TransferBegin | None
    done: TransferDone | None
    deadline: float = float("inf")  # with `deferred-release`: not started after this, never sent
    delay_s: float = 0.0  # the sender holds the job this long (the scheduler holds injected delays)
    steps: tuple[str, ...] = NORMAL_STEPS  # "data" (begin + page data), "done"; faults change it
    ack_only: bool = False  # no data: send AbortAck(room) once everything before it has gone out

    @property
    def sends_data(self) -> bool:
        return "data" in self.steps


class PrefillScheduler:
    def __init__(
        self,
        cfg: ServeConfig,
        model: Transformer,
        pool: KVPool,
        send_router: Callable[[object], None],
        send_decode: Callable[[object], None],
    ) -> None:
        self.cfg = cfg
        self.fixes = cfg.fixes
        self.pool = pool
        self.trace = pool.trace
        self.runner = ModelRunner(model, pool, attention=cfg.attention)
        self.send_router = send_router
        self.send_decode = send_decode
        self.bootstrap_queue: deque[Request] = deque()
        self.waiting: deque[Request] = deque()
        self.inflight: dict[int, tuple[Request, int]] = {}  # room -> (request, first token)
        self.decode_pages: dict[int, KVBootstrap] = {}
        self.transfers: deque[TransferJob] = deque()  # drained by the worker's sender
        self.sending: dict[int, Request] = {}
        self.counters = {"prefilled": 0, "stubbed": 0, "rejected": 0, "transfers": 0, "aborted": 0}
        self.faults = list(parse_faults(cfg.inject, tenants=cfg.tenants))
        self.cancelled: set[int] = set()  # rooms decode gave up on (read by the sender thread)
        self.ended: RecentRooms[None] = RecentRooms()  # rooms failed here (prefill-error)
        # Injected faults hold jobs here, not in the sender, so an abort can still take them back.
        self.held: list[tuple[float, TransferJob]] = []  # (due, job): delay-transfer, delay-done
        self.overtaken: tuple[float, TransferJob] | None = None  # reorder-transfer: (latest, job)

    # -- messages ------------------------------------------------------------------------
    def on_generate(self, msg: GenerateRequest) -> None:
        req = Request(
            msg.request_id,
            msg.tenant,
            list(msg.prompt_ids),
            msg.max_tokens,
            msg.temperature,
            msg.seed,
            room=msg.room,
        )
        req.advance(State.BOOTSTRAPPING, self.trace, role="prefill")
        self.bootstrap_queue.append(req)

    def on_kv_bootstrap(self, msg: KVBootstrap) -> None:
        if msg.room in self.ended:  # the room failed here before decode's page list came
            return
        self.decode_pages[msg.room] = msg

    def on_abort(self, msg: Abort) -> None:
        for queue in (self.bootstrap_queue, self.waiting):
            for req in [r for r in queue if r.room == msg.room]:
                queue.remove(req)
                req.finish(Outcome.ABORTED, self.trace, msg.reason)
        if msg.room in self.inflight:
            req, _ = self.inflight.pop(msg.room)
            self._release(req)
            req.finish(Outcome.ABORTED, self.trace, msg.reason)
        self.decode_pages.pop(msg.room, None)
        if self.fixes.deferred_release and msg.source == "decode":
            # Fix `deferred-release`: cancel whatever is still queued for the room, then tell decode,
            # behind every earlier message, that nothing more will come: it may free the pages.
            self.cancelled.add(msg.room)
            self._drop_held(msg.room, msg.reason)
            self.transfers.append(TransferJob(msg.room, [], None, None, ack_only=True))

    def fail_all(self, reason: str) -> None:
        """Abort every request this role holds (after an internal error), pages back to the pool."""
        live = [*self.bootstrap_queue, *self.waiting, *(r for r, _ in self.inflight.values())]
        self.bootstrap_queue.clear()
        self.waiting.clear()
        self.inflight.clear()
        self.decode_pages.clear()
        for req in live:
            self._release(req)
            if not req.finished():
                req.finish(Outcome.ABORTED, self.trace, reason)
            abort = Abort(req.room or 0, reason, 500, "internal_error", "prefill")
            self.send_decode(abort)
            self.send_router(abort)

    def tracked(self) -> set[str]:
        """The requests this role may hold pages for: prefilled and waiting to send, or sending."""
        return {r.request_id for r, _ in self.inflight.values()} | {
            r.request_id for r in self.sending.values()
        }

    def outgoing(self, job: TransferJob, now: float) -> Outgoing:
        """What the sender (the worker's sender thread, or the in-process cluster) does with `job`
        at `now`: "send" it; with `deferred-release`, "cancelled" once decode gave up on the room
        (nothing goes out), or "late" once the job missed its deadline (a failed done message
        goes out instead of the data)."""
        if job.room in self.cancelled:
            return "cancelled"
        if now > job.deadline:
            # Fix `deferred-release`: a transfer that cannot start within the timeout decode applies
            # is not started, so its data can never land in pages decode has since handed on.
            return "late"
        return "send"

    def on_transfer_sent(self, room: int) -> None:
        """The sender has pushed a request's pages and done message out: free its pages."""
        req = self.sending.pop(room, None)
        if req is None:
            return
        self._release(req)
        if not req.finished():
            # The faulty engine's success path: this overwrites a pending 400 (SGLang #33507).
            req.finish(Outcome.LENGTH, self.trace)

    # -- the one question every queue asks ------------------------------------------------
    def _gone(self, req: Request) -> bool:
        """Should a queue drop `req`? The heart of the bug."""
        if self.fixes.reject_before_transfer:
            # Fix `reject-before-transfer` (SGLang #38704, #36988, #38935): a rejected request
            # leaves the queue here, before any page is reserved or any byte transferred.
            if req.rejected() and not req.finished():
                self._reject(req)
            return req.finished()
        # Bug-compatible: like SGLang's queues, ask only `finished()`, blind to a pending 400.
        return req.finished()

    def _reject(self, req: Request) -> None:
        n = req.stubbed_from or req.prompt_len
        message = (
            f"This prompt of {n} tokens does not fit the prefill KV pool of {self.pool.capacity_tokens} "
            f"tokens (context length {self.cfg.context_length} tokens); it was rejected before any "
            f"KV page was reserved."
        )
        req.finish(Outcome.REJECTED, self.trace, message)
        self.counters["rejected"] += 1
        abort = Abort(req.room or 0, message, 400, "context_length_exceeded", "prefill")
        self.send_decode(abort)
        self.send_router(abort)

    # -- scheduling ----------------------------------------------------------------------
    def step(self) -> bool:
        """Advance every queue once; returns whether anything happened."""
        busy = self._bootstrap()
        busy |= self._prefill()
        busy |= self._send()
        busy |= self._release_held()
        return busy

    def idle(self) -> bool:
        return not (
            self.bootstrap_queue
            or self.waiting
            or self.inflight
            or self.sending
            or self.held
            or self.overtaken
        )

    def _bootstrap(self) -> bool:
        moved = False
        while self.bootstrap_queue:
            req = self.bootstrap_queue.popleft()
            moved = True
            if req.prompt_len > self.pool.capacity_tokens:
                self._stub(req)
            if self._gone(req):
                continue
            if req.stubbed_from is not None:  # the incident's path: the stub goes on as if alive
                self.counters["stubbed"] += 1
            req.advance(State.WAITING, self.trace, role="prefill")
            self.waiting.append(req)
            self.send_decode(Bootstrapped(req.room or 0))
        return moved

    def _stub(self, req: Request) -> None:
        """SGLang's `set_finish_with_abort`: a pending 400 and a one-token placeholder prompt."""
        req.pending_finish = Outcome.REJECTED
        req.error = (
            f"prompt of {req.prompt_len} tokens does not fit the prefill KV pool of "
            f"{self.pool.capacity_tokens} tokens (context length {self.cfg.context_length})"
        )
        req.stubbed_from = req.prompt_len
        req.prompt_ids = [STUB_TOKEN]
        self.trace.emit(
            "stub",
            req.request_id,
            req.tenant,
            prompt_tokens=req.stubbed_from,
            stub_tokens=1,
            pool_tokens=self.pool.capacity_tokens,
        )

    def _prefill(self) -> bool:
        done = False
        while self.waiting and self.pool.can_reserve(self.waiting[0].prompt_len):
            req = self.waiting.popleft()
            if self._gone(req):
                continue
            res = self.pool.reserve(req.request_id, req.tenant, req.prompt_len)
            req.advance(State.PREFILLING, self.trace, role="prefill")
            try:
                fault = take(self.faults, req.tenant, ["prefill-error"])
                if fault is not None:
                    self.trace.emit("fault", req.request_id, req.tenant, (), fault=str(fault), room=req.room)
                    raise RuntimeError(f"injected fault {fault}")
                logits = self.runner.prefill(req.request_id, req.tenant, req.prompt_ids, res.pages)
                gen = None if req.seed is None else sampling_generator(req.seed, FIRST_TOKEN)
                first = sample(logits, req.temperature, gen)
            except Exception as exc:  # this request fails; the worker and every other request go on
                self._fail(
                    req, f"prefill failed while computing {req.request_id}: {type(exc).__name__}: {exc}"
                )
                done = True
                continue
            req.output_ids.append(first)
            req.advance(State.TRANSFERRING, self.trace, role="prefill")
            self.inflight[req.room or 0] = (req, first)
            self.counters["prefilled"] += 1
            done = True
        return done

    def _send(self) -> bool:
        sent = False
        for room in [r for r in self.inflight if r in self.decode_pages]:
            req, first = self.inflight.pop(room)
            boot = self.decode_pages.pop(room)
            if self._gone(req):
                self._release(req)
                continue
            src = self.pool.reservation(req.request_id).pages
            dst = boot.decode_pages[: len(src)]
            # The faulty engine's done message: room and status only; no length, no digest.
            written = checksums = None
            if self.fixes.coverage_check:  # fix `coverage-check`: the logical KV coverage (#38704)
                written = req.prompt_len
            if self.fixes.kv_checksum:  # fix `kv-checksum`: one digest per page sent (#39500)
                checksums = page_checksums(self.pool, src)
            done = TransferDone(room, True, first, written_tokens=written, checksums=checksums)
            job = TransferJob(room, src, TransferBegin(room, dst), done)
            if self.fixes.deferred_release:
                # Fix `deferred-release`: a transfer is bounded: it starts within the release
                # timeout decode applies, or not at all.
                job.deadline = time.time() + self.cfg.release_timeout_s
            self.sending[room] = req
            self._queue(job, req.tenant)
            self.counters["transfers"] += 1
            sent = True
        return sent

    # -- injected faults (faults.py) -----------------------------------------------------
    def _queue(self, job: TransferJob, tenant: str) -> None:
        """Hand `job` to the sender, after applying the next injected fault that hits `tenant`."""
        fault = take(self.faults, tenant, (f for f in FAULTS if f != "prefill-error"))
        if fault is not None:
            self.trace.emit("fault", None, tenant, (), fault=str(fault), room=job.room)
            if self._apply(fault, job):
                return
        self.transfers.append(job)
        if self.overtaken is not None:  # reorder-transfer: the held job goes out after this one
            self.transfers.append(self.overtaken[1])
            self.overtaken = None

    def _apply(self, fault: Fault, job: TransferJob) -> bool:
        """Change `job` as `fault` says; True when the fault holds the job back for now."""
        now = time.time()
        if fault.name == "delay-transfer":
            self.held.append((now + fault.seconds, job))
            return True
        if fault.name == "delay-done":  # the data now, the done message alone later
            assert job.done is not None
            later = TransferJob(job.room, [], job.begin, job.done, job.deadline, steps=("done",))
            self.held.append((now + fault.seconds, later))
            job.steps = ("data",)
        elif fault.name == "reorder-transfer":
            # Held until the next transfer has gone first; alone, for half the release timeout.
            self.overtaken = (now + self.cfg.release_timeout_s / 2, job)
            return True
        else:
            job.steps = STEPS[fault.name]
        return False

    def _release_held(self) -> bool:
        """Send what an injected delay held back, once it is due."""
        now = time.time()
        due = [job for when, job in self.held if when <= now]
        self.held = [(when, job) for when, job in self.held if when > now]
        if self.overtaken is not None and self.overtaken[0] <= now:
            due.append(self.overtaken[1])
            self.overtaken = None
        self.transfers.extend(due)
        return bool(due)

    def _drop_held(self, room: int, reason: str) -> None:
        """The room was aborted: a job the faults still hold never reaches the sender, and the
        pages it would have sent from come back here (the sender never saw them)."""
        jobs = [job for _, job in self.held if job.room == room]
        self.held = [(when, job) for when, job in self.held if job.room != room]
        if self.overtaken is not None and self.overtaken[1].room == room:
            jobs.append(self.overtaken[1])
            self.overtaken = None
        if any(job.sends_data for job in jobs):
            req = self.sending.pop(room, None)
            if req is not None:
                self._release(req)
                if not req.finished():
                    req.finish(Outcome.ABORTED, self.trace, reason)

    def _fail(self, req: Request, reason: str) -> None:
        """One request failed inside this role: its pages back, decode and the client told."""
        self._release(req)
        req.finish(Outcome.ABORTED, self.trace, reason)
        self.counters["aborted"] += 1
        self.ended[req.room or 0] = None
        self.decode_pages.pop(req.room or 0, None)
        abort = Abort(req.room or 0, reason, 500, "prefill_failed", "prefill")
        self.send_decode(abort)
        self.send_router(abort)

    def _release(self, req: Request) -> None:
        if self.pool.holds(req.request_id):
            self.pool.release(req.request_id)
