"""The decode role: preallocate pages, receive the transfer, decode in continuous batches.

- **bootstrap**: a request waits until prefill says its bootstrap queue let it through.
- **prealloc queue**: reserves pages in this role's pool for the *original* prompt length plus
  the tokens to generate, and sends their ids to prefill (`KVBootstrap`).
- **transfer queue**: waits for prefill's page data and done message. In the faulty engine the
  done message carries only the room and a status: decode checks the room, commits, and attends
  over every page it reserved, however many prefill actually wrote.
- **running batch**: one decode step over all running requests at a time; finished requests
  release their pages (not zeroed) and their result goes to the router.

Messages that break the protocol (faults.py injects each): before a request commits, decode fails
it on any anomaly it can see (`coverage-check`: page data that came twice, named pages the room
does not hold, a done message before all its page data); after the commit, or for a room that no
longer waits for a transfer, it drops the message and traces it (`deferred-release` for page
data; a done message for such a room is always ignored).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from minigrid_engine.config import ServeConfig
from minigrid_engine.errors import counted
from minigrid_engine.messages import (
    Abort,
    AbortAck,
    Bootstrapped,
    GenerateRequest,
    KVBootstrap,
    RecentRooms,
    Result,
    Tokens,
    TransferBegin,
    TransferDone,
)
from minigrid_engine.model import Transformer
from minigrid_engine.pool import KVPool
from minigrid_engine.request import Outcome, Request, State
from minigrid_engine.runner import DECODE_STEPS, DecodeItem, ModelRunner, sample, sampling_generator
from minigrid_engine.trace import WRITE
from minigrid_engine.transfer import page_checksums, store_pages

log = logging.getLogger("minigrid.decode")


class DecodeScheduler:
    def __init__(
        self,
        cfg: ServeConfig,
        model: Transformer,
        pool: KVPool,
        send_router: Callable[[object], None],
        send_prefill: Callable[[object], None],
    ) -> None:
        self.cfg = cfg
        self.fixes = cfg.fixes
        self.pool = pool
        self.trace = pool.trace
        self.runner = ModelRunner(model, pool, owner_check=cfg.fixes.owner_check, attention=cfg.attention)
        self.send_router = send_router
        self.send_prefill = send_prefill
        self.bootstrapping: dict[int, Request] = {}
        self.prealloc: deque[Request] = deque()
        self.transfer: dict[int, Request] = {}
        self.running: list[Request] = []
        self._early: set[int] = set()  # Bootstrapped that arrived before the request
        self._early_aborts: RecentRooms[Abort] = RecentRooms()  # prefill's Abort that overtook the request
        self.transfer_since: dict[int, float] = {}
        self.rooms: RecentRooms[tuple[str, str]] = RecentRooms()
        self.quarantine: dict[int, tuple[Request, float]] = {}  # deferred-release: room -> (req, until)
        self.received: dict[int, list[int]] = {}  # room -> decode pages whose page data arrived
        self._generators: dict[int, torch.Generator] = {}
        self.counters = {
            "decoded_tokens": 0,
            "completed": 0,
            "aborted": 0,
            "checksum_mismatches": 0,
            "owner_check_violations": 0,
        }

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
            stop=msg.stop,
            stream=msg.stream,
        )
        req.advance(State.BOOTSTRAPPING, self.trace, role="decode")
        self.bootstrapping[msg.room] = req
        self.rooms[msg.room] = (req.request_id, req.tenant)
        if msg.room in self._early_aborts:  # prefill failed it first: no page is reserved
            self._early.discard(msg.room)
            self.on_abort(self._early_aborts.pop(msg.room))
            return
        if msg.room in self._early:
            self._early.discard(msg.room)
            self.on_bootstrapped(Bootstrapped(msg.room))

    def on_bootstrapped(self, msg: Bootstrapped) -> None:
        req = self.bootstrapping.pop(msg.room, None)
        if req is None:
            self._early.add(msg.room)
            return
        req.advance(State.PREALLOC, self.trace, role="decode")
        self.prealloc.append(req)

    def on_transfer_begin(self, msg: TransferBegin, data: torch.Tensor, peer: str | None = None) -> None:
        """Page data arrived for `msg.room` (from `peer`, WORKER@ADDRESS): write it where the
        message says."""
        req = self.transfer.get(msg.room)
        if self.fixes.deferred_release and req is None and msg.room not in self.quarantine:
            # Fix `deferred-release`: data for a room that holds no pages here is dropped.
            log.warning("decode: dropped late page data for room %d (no pages held)", msg.room)
            self._dropped(msg, "page data for a room that waits for no transfer (late or duplicate)")
            return
        if req is not None and self.fixes.coverage_check:
            # Fix `coverage-check`: a room's page data comes once, into the pages it reserved.
            owned = self.pool.reservation(req.request_id).pages
            if msg.room in self.received or not set(msg.dst_pages) <= set(owned):
                again = msg.room in self.received
                self._dropped(msg, "page data came twice" if again else "names pages the room does not hold")
                self._fail_transfer(
                    req,
                    f"KV transfer for {req.request_id} arrived twice (page data for decode pages "
                    f"{msg.dst_pages} came again)"
                    if again
                    else f"KV transfer for {req.request_id} named decode pages {msg.dst_pages}, not all "
                    f"of them reserved by it ({list(owned)})",
                    "kv_transfer_duplicate" if again else "kv_transfer_bad_pages",
                )
                return
        if req is not None:
            self.received[msg.room] = list(msg.dst_pages)
        store_pages(self.pool, msg.dst_pages, data)
        # The faulty engine writes into the named pages whoever holds them now; the trace says who.
        writer, tenant = self.rooms.get(msg.room, (f"room-{msg.room}", "?"))
        owners = [self.pool.pages[p].owner for p in msg.dst_pages]
        self.pool.note_write(writer, tenant, msg.dst_pages)
        where = {} if peer is None else {"peer": peer}
        self.trace.emit(
            WRITE, writer, tenant, msg.dst_pages, source="transfer", room=msg.room, owners=owners, **where
        )

    def on_transfer_done(self, msg: TransferDone) -> None:
        req = self.transfer.pop(msg.room, None)
        self.transfer_since.pop(msg.room, None)
        received = self.received.pop(msg.room, [])
        if req is None:  # no such room (aborted meanwhile, or a duplicate): nothing to commit
            writer, tenant = self.rooms.get(msg.room, (f"room-{msg.room}", "?"))
            self.trace.emit(
                "ignored",
                writer,
                tenant,
                (),
                message="done",
                room=msg.room,
                reason="a done message for a room that waits for no transfer (late or duplicate)",
            )
            return
        if not msg.success or msg.first_token is None:
            self._abort(req, f"prefill reported a failed transfer: {msg.error or 'no reason given'}")
            return
        # Fix `coverage-check` (SGLang #38704): compare the KV prefill says it wrote with what this
        # role preallocated and is about to attend over.
        if self.fixes.coverage_check and msg.written_tokens != req.prompt_len:
            wrote = (
                "states no KV length (its coverage-check is off)"
                if msg.written_tokens is None
                else f"wrote {counted(msg.written_tokens, 'token')} of KV"
            )
            self._abort(
                req,
                f"KV coverage mismatch for {req.request_id}: prefill {wrote}, decode preallocated "
                f"{req.prompt_len}",
                "kv_coverage_mismatch",
            )
            return
        need = self.pool.pages_for(req.prompt_len)
        if self.fixes.coverage_check and len(received) < need:
            # Fix `coverage-check`, on what arrived: the done message came before (or without)
            # the page data it vouches for. Data still on its way is kept out of reused pages.
            self._fail_transfer(
                req,
                f"KV coverage mismatch for {req.request_id}: prefill's done message says "
                f"{counted(req.prompt_len, 'token')} of KV were sent, but page data for only "
                f"{len(received)} of {need} prompt pages had arrived (lost, or overtaken by the done "
                "message)",
                "kv_coverage_mismatch",
            )
            return
        if self.fixes.kv_checksum:
            # Fix `kv-checksum` (SGLang #39500): verify every reserved prompt page before decoding.
            bad = self._bad_pages(req, msg.checksums)
            if bad:
                self.counters["checksum_mismatches"] += len(bad)
                self._abort(
                    req,
                    f"KV checksum mismatch for {req.request_id}: {len(bad)} of "
                    f"{self.pool.pages_for(req.prompt_len)} prompt pages missing or wrong "
                    f"(decode pages {bad})",
                    "kv_checksum_mismatch",
                )
                return
        # The faulty engine's commit: the room matched, so every reserved page is taken as written.
        req.output_ids.append(msg.first_token)
        req.first_token_at = time.time()
        req.advance(State.DECODING, self.trace, role="decode", kv_len=req.prompt_len)
        self.running.append(req)
        self._stream([req])
        self._retire()

    def _bad_pages(self, req: Request, checksums: list[int] | None) -> list[int]:
        pages = self.pool.reservation(req.request_id).pages[: self.pool.pages_for(req.prompt_len)]
        got = page_checksums(self.pool, pages)
        sent = checksums or []
        return [p for i, p in enumerate(pages) if i >= len(sent) or sent[i] != got[i]]

    def on_abort_ack(self, msg: AbortAck) -> None:
        """Prefill will send nothing more for the room: its quarantined pages may go back."""
        entry = self.quarantine.pop(msg.room, None)
        if entry is not None:
            self._release(entry[0])

    def _expire(self) -> None:
        """Give up on transfers that take longer than the release timeout."""
        now = time.time()
        timeout = self.cfg.release_timeout_s
        for room in [r for r, t in self.transfer_since.items() if now - t > timeout]:
            del self.transfer_since[room]
            req = self.transfer.pop(room, None)
            if req is None:
                continue
            reason = f"KV transfer for {req.request_id} did not complete within {timeout:g} s"
            self._fail_transfer(req, reason, "kv_transfer_timeout", status=504)
        for room in [r for r, (_, until) in self.quarantine.items() if now > until]:
            self._release(self.quarantine.pop(room)[0])

    def _fail_transfer(self, req: Request, reason: str, code: str, status: int = 502) -> None:
        """Fail a request whose transfer went wrong while more of its page data may still come."""
        room = req.room or 0
        self.transfer.pop(room, None)
        self.transfer_since.pop(room, None)
        self.received.pop(room, None)
        if self.fixes.deferred_release:
            # Fix `deferred-release`: fail the request now, but keep its pages reserved until
            # prefill acknowledges (nothing more is coming) or the timeout passes once more.
            self.quarantine[room] = (req, time.time() + self.cfg.release_timeout_s)
            self._abort(req, reason, code, status, release=False)
        else:
            # The faulty engine frees the pages at once; a late transfer can still land in them.
            self._abort(req, reason, code, status)

    def _dropped(self, msg: TransferBegin, reason: str) -> None:
        """Trace page data that was received but written nowhere."""
        writer, tenant = self.rooms.get(msg.room, (f"room-{msg.room}", "?"))
        self.trace.emit(
            "dropped", writer, tenant, msg.dst_pages, message="page data", room=msg.room, reason=reason
        )

    def tracked(self) -> set[str]:
        """The requests this role may hold pages for: awaiting their KV, decoding, or quarantined."""
        live = [*self.transfer.values(), *self.running, *(r for r, _ in self.quarantine.values())]
        return {r.request_id for r in live}

    def fail_all(self, reason: str) -> None:
        """Abort every request this role holds (after an internal error), pages back to the pool."""
        live = [*self.bootstrapping.values(), *self.prealloc, *self.transfer.values(), *self.running]
        self.bootstrapping.clear()
        self.prealloc.clear()
        self.transfer.clear()
        self.received.clear()
        self.running.clear()
        for req in live:
            if not req.finished():
                self._abort(req, reason, "internal_error")

    def on_abort(self, msg: Abort) -> None:
        self.received.pop(msg.room, None)
        req = self.bootstrapping.pop(msg.room, None) or self.transfer.pop(msg.room, None)
        if req is None:
            for r in [r for r in self.prealloc if r.room == msg.room]:
                self.prealloc.remove(r)
                req = r
        if req is None:  # the client left mid-decode: its transfer is done, its pages may go
            for r in [r for r in self.running if r.room == msg.room]:
                self.running.remove(r)
                self._generators.pop(msg.room, None)
                req = r
        if req is None:
            if msg.room not in self.rooms:  # it overtook the request itself: keep it for then
                self._early_aborts[msg.room] = msg
            return
        self._release(req)
        req.finish(Outcome.ABORTED, self.trace, msg.reason)

    # -- scheduling ----------------------------------------------------------------------
    def step(self) -> bool:
        self._expire()
        busy = self._preallocate()
        if self.running:
            self._decode()
            busy = True
        return busy

    def idle(self) -> bool:
        return not (self.bootstrapping or self.prealloc or self.transfer or self.running or self.quarantine)

    def _tokens(self, req: Request) -> int:
        return req.prompt_len + req.max_tokens

    def _preallocate(self) -> bool:
        moved = False
        while self.prealloc:
            req, need = self.prealloc[0], self._tokens(self.prealloc[0])
            if req.finished():
                self.prealloc.popleft()
                continue
            if need > self.pool.capacity_tokens:  # it would wait forever and block everyone behind it
                self.prealloc.popleft()
                self._too_large(req)
                moved = True
                continue
            if not self.pool.can_reserve(need):
                break
            self.prealloc.popleft()
            res = self.pool.reserve(req.request_id, req.tenant, self._tokens(req))
            req.advance(State.TRANSFERRING, self.trace, role="decode")
            self.transfer[req.room or 0] = req
            self.transfer_since[req.room or 0] = time.time()
            self.send_prefill(KVBootstrap(req.room or 0, list(res.pages), self._tokens(req)))
            moved = True
        return moved

    def _too_large(self, req: Request) -> None:
        """Refuse a request whose prompt and max_tokens together exceed the whole decode pool."""
        self._abort(
            req,
            f"This request needs {self._tokens(req)} tokens of decode KV ({req.prompt_len} prompt + "
            f"{req.max_tokens} max_tokens), more than the whole decode KV pool of "
            f"{self.pool.capacity_tokens} tokens; it was rejected before any decode page was reserved. "
            f"Lower max_tokens or the prompt, or raise --decode-pool-tokens.",
            "context_length_exceeded",
            400,
        )

    def _decode(self) -> None:
        batch = self.running[: self.cfg.max_batch]
        items = [DecodeItem.next_step(r, self.pool.reservation(r.request_id).pages) for r in batch]
        logits = self.runner.decode(items)
        for r in [r for r in batch if r.request_id in self.runner.violations]:
            # Fix `owner-check`: the attention read found pages this request never wrote.
            pages = self.runner.violations[r.request_id]
            self.counters["owner_check_violations"] += len(pages)
            self.running.remove(r)
            self._abort(
                r,
                f"owner check: {r.request_id} was about to read decode pages {pages}, last written by "
                f"other requests",
                "owner_check_violation",
            )
        for r, row in zip(batch, logits):
            if r.finished():
                continue
            try:
                r.output_ids.append(sample(row, r.temperature, self._generator(r)))
            except Exception as exc:  # this request fails; the rest of the batch goes on
                log.exception("decode: sampling %s failed", r.request_id)
                self.running.remove(r)
                self._abort(
                    r, f"sampling {r.request_id} failed: {type(exc).__name__}: {exc}", "internal_error"
                )
        self.counters["decoded_tokens"] += len(batch)
        self._stream(batch)
        self._retire()

    def _stream(self, batch: list[Request]) -> None:
        """Each streamed request's newest token goes to the router as it is made."""
        for r in batch:
            if r.stream and not r.finished():
                self.send_router(Tokens(r.room or 0, r.output_ids[-1:]))

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.temperature <= 0 or req.seed is None:  # greedy, or torch's global generator
            return None
        room = req.room or 0
        if room not in self._generators:
            self._generators[room] = sampling_generator(req.seed, DECODE_STEPS)
        return self._generators[room]

    def _retire(self) -> None:
        for r in list(self.running):
            outcome = r.completed()
            if outcome is None:
                continue
            self.running.remove(r)
            self._release(r)
            self._generators.pop(r.room or 0, None)
            r.finish(outcome, self.trace)
            self.counters["completed"] += 1
            self.send_router(
                Result(
                    r.room or 0,
                    r.request_id,
                    r.tenant,
                    200,
                    list(r.output_ids),
                    r.prompt_len,
                    outcome.value,
                    timings={
                        "ttft_s": (r.first_token_at or r.created_at) - r.created_at,
                        "latency_s": (r.finished_at or time.time()) - r.created_at,
                    },
                    completion_tokens=len(r.output_ids) + r.stop_tokens,
                )
            )

    def _abort(
        self,
        req: Request,
        reason: str,
        code: str = "kv_transfer_failed",
        status: int = 500,
        release: bool = True,
    ) -> None:
        log.warning("decode: aborting %s: %s", req.request_id, reason)
        if release:
            self._release(req)
        req.finish(Outcome.ABORTED, self.trace, reason)
        self.counters["aborted"] += 1
        self.send_router(
            Result(
                req.room or 0,
                req.request_id,
                req.tenant,
                status,
                [],
                req.prompt_len,
                "error",
                error=reason,
                code=code,
                error_type="invalid_request_error" if status < 500 else "server_error",
            )
        )
        self.send_prefill(Abort(req.room or 0, reason, status, code, "decode"))

    def _release(self, req: Request) -> None:
        if self.pool.holds(req.request_id):
            self.pool.release(req.request_id)
