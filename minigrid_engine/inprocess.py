"""Both roles in one process, messages passed by hand: the disaggregated protocol without sockets.

The same `PrefillScheduler` and `DecodeScheduler` that run in the worker processes, wired with
in-memory mailboxes and a loopback transport. Tests use it to check the protocol quickly; the
real thing (`minigrid serve`, `minigrid_engine.handle`) runs them as separate processes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import torch

from minigrid_engine.config import ServeConfig
from minigrid_engine.decode import DecodeScheduler
from minigrid_engine.messages import (
    Abort,
    AbortAck,
    Bootstrapped,
    GenerateRequest,
    KVBootstrap,
    Result,
    TransferBegin,
    TransferDone,
)
from minigrid_engine.model import Transformer, load_model
from minigrid_engine.pool import KVPool, PoolConfig
from minigrid_engine.prefill import LATE, PrefillScheduler
from minigrid_engine.tokenizer import ByteTokenizer
from minigrid_engine.trace import Trace
from minigrid_engine.transfer import LoopbackTransport, page_data

WAIT_STEP_S = 0.001  # how long `run` sleeps while only a clock is pending


class InProcessCluster:
    def __init__(self, cfg: ServeConfig, model: Transformer | None = None) -> None:
        self.cfg = cfg
        self.model = model if model is not None else load_model(device=cfg.device)
        self.tokenizer = ByteTokenizer()
        mc = self.model.cfg
        self.prefill_pool = KVPool(
            PoolConfig(cfg.prefill_pool_tokens, cfg.page_size),
            mc,
            "prefill",
            Trace("prefill"),
            cfg.device,  # where the workers would keep it: `--device`
            scrub_on_free=cfg.fixes.scrub_on_free,
        )
        self.decode_pool = KVPool(
            PoolConfig(cfg.decode_pool_tokens, cfg.page_size),
            mc,
            "decode",
            Trace("decode"),
            cfg.device,
            scrub_on_free=cfg.fixes.scrub_on_free,
        )
        self.to_prefill: deque[object] = deque()
        self.to_decode: deque[object] = deque()
        self.results: dict[int, Result] = {}
        self.prefill = PrefillScheduler(
            cfg, self.model, self.prefill_pool, self._to_router, self.to_decode.append
        )
        self.decode = DecodeScheduler(
            cfg, self.model, self.decode_pool, self._to_router, self.to_prefill.append
        )
        self.transport = LoopbackTransport()
        self._rooms = itertools.count(1)
        # What the wire does to page data on its way to decode (tests: a page lost, pages named
        # wrong): given the begin message and the data, it returns what arrives, or None (nothing).
        self.on_the_wire: Callable[[TransferBegin, torch.Tensor], tuple[TransferBegin, torch.Tensor] | None]
        self.on_the_wire = lambda begin, data: (begin, data)

    def _to_router(self, msg: object) -> None:
        if isinstance(msg, Result):
            self.results[msg.room] = msg
        elif isinstance(msg, Abort):
            self.results[msg.room] = Result(
                msg.room, "", "", msg.status, error=msg.reason, code=msg.code, finish_reason="error"
            )

    def submit(
        self,
        tenant: str,
        prompt: str,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> int:
        room = next(self._rooms)
        ids = self.tokenizer.encode(prompt)
        msg = GenerateRequest(room, f"{tenant}-{room}", tenant, ids, max_tokens, temperature, seed)
        self.prefill.on_generate(msg)
        self.decode.on_generate(msg)
        return room

    def _deliver(self) -> bool:
        moved = False
        while self.to_decode:
            msg = self.to_decode.popleft()
            moved = True
            if isinstance(msg, Bootstrapped):
                self.decode.on_bootstrapped(msg)
            elif isinstance(msg, Abort):
                self.decode.on_abort(msg)
        while self.to_prefill:
            msg = self.to_prefill.popleft()
            moved = True
            if isinstance(msg, KVBootstrap):
                self.prefill.on_kv_bootstrap(msg)
            elif isinstance(msg, Abort):
                self.prefill.on_abort(msg)
        while self.prefill.transfers:
            job = self.prefill.transfers.popleft()
            moved = True
            if job.ack_only:
                self.decode.on_abort_ack(AbortAck(job.room))
                continue
            verdict = self.prefill.outgoing(job, time.time())  # as the worker's sender asks
            if verdict == "send":
                assert job.begin is not None and job.done is not None
                data = page_data(self.prefill_pool, job.src_pages)
                self.transport.send(data)
                arrived = self.on_the_wire(job.begin, self.transport.recv(data))
                if arrived is not None:
                    self.decode.on_transfer_begin(*arrived)
                self._done(job.done)
            elif verdict == "late":
                self._done(TransferDone(job.room, False, error=LATE))
            self.prefill.on_transfer_sent(job.room)  # its pages go back, sent or not (as the worker's)
        return moved

    def _done(self, msg: TransferDone) -> None:
        self.decode.on_transfer_done(msg)

    def run(self, max_steps: int = 100_000, max_wait_s: float = 60.0) -> None:
        """Deliver and step both roles until both are idle. `max_steps` bounds the steps in which
        something moved (a livelock fails); while nothing moves but something waits on the clock
        (a held transfer, a release timeout), the loop sleeps, `max_wait_s` at most in all."""
        steps, waited = 0, 0.0
        while True:
            busy = self._deliver()
            busy |= self.prefill.step()
            busy |= self.decode.step()
            busy |= self._deliver()
            if busy:
                steps += 1
                if steps >= max_steps:
                    raise RuntimeError(f"in-process cluster still busy after {max_steps} steps")
            elif self.prefill.idle() and self.decode.idle():
                return
            elif waited >= max_wait_s:
                raise RuntimeError(f"in-process cluster still waiting after {max_wait_s:g} s")
            else:
                time.sleep(WAIT_STEP_S)
                waited += WAIT_STEP_S

    def complete(
        self,
        tenant: str,
        prompt: str,
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Result:
        room = self.submit(tenant, prompt, max_tokens, temperature, seed)
        self.run()
        return self.results[room]

    def text(self, result: Result) -> str:
        return self.tokenizer.decode(result.output_ids)
