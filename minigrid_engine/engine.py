"""Single-process generation: admit, prefill into pages, decode in continuous batches, release.

This is the engine with nothing disaggregated about it, one pool for both phases: the reference
every disaggregated run is compared with, and the place the paged-cache mechanics are taught.

    engine = Engine()
    [done] = engine.generate("alice", ["ALICE card QZ7K2M9P; ALICE card QZ7K2M9P; "], max_tokens=20)
    done.text
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minigrid_engine.errors import BadInput, ConfigError, counted
from minigrid_engine.model import Transformer, load_model
from minigrid_engine.pool import KVPool, PoolConfig
from minigrid_engine.request import (
    Outcome,
    Request,
    State,
    check_max_tokens,
    check_seed,
    check_temperature,
)
from minigrid_engine.runner import (
    DECODE_STEPS,
    FIRST_TOKEN,
    DecodeItem,
    ModelRunner,
    sample,
    sampling_generator,
)
from minigrid_engine.tokenizer import ByteTokenizer
from minigrid_engine.trace import Trace

DEFAULT_CONTEXT_LENGTH = 1024


@dataclass(frozen=True)
class Completion:
    """What a client gets back for one request."""

    request_id: str
    tenant: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    outcome: Outcome
    error: str | None
    ttft_s: float | None
    latency_s: float | None

    @classmethod
    def of(cls, req: Request, tokenizer: ByteTokenizer) -> Completion:
        return cls(
            req.request_id,
            req.tenant,
            req.prompt_len,
            list(req.output_ids),
            tokenizer.decode(req.output_ids),
            req.outcome or Outcome.ABORTED,
            req.error,
            None if req.first_token_at is None else req.first_token_at - req.created_at,
            None if req.finished_at is None else req.finished_at - req.created_at,
        )


class Engine:
    """Prefill and decode in one process over one KV pool, with continuous batching."""

    def __init__(
        self,
        model: Transformer | None = None,
        pool: PoolConfig | None = None,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
        device: str | torch.device = "cpu",
        trace: Trace | None = None,
        max_batch: int = 64,
        attention: str = "torch",
    ) -> None:
        if context_length < 1:
            raise ConfigError(f"context length must be at least 1 token, got {context_length}")
        self.model = model if model is not None else load_model(device=device)
        self.tokenizer = ByteTokenizer()
        self.context_length = context_length
        self.trace = trace if trace is not None else Trace("engine")
        self.pool = KVPool(
            pool or PoolConfig(max(2 * context_length, PoolConfig.page_size)),
            self.model.cfg,
            "engine",
            self.trace,
            device,
        )
        self.runner = ModelRunner(self.model, self.pool, attention=attention)  # torch | triton
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator] = {}

    # -- requests --------------------------------------------------------------------------
    def submit(
        self,
        tenant: str,
        prompt: str | bytes | list[int],
        max_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Request:
        """Queue a request; too long for the context or the pool: finished at once as rejected.

        `stop`: texts that end the answer when it ends with one (left out of it, as the server
        does)."""
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise BadInput("prompt is empty: send at least one token")
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BadInput(
                    f"prompt holds {t!r} at index {i}: token ids are whole numbers from 0 to {vocab - 1}"
                )
        if any(s == "" for s in stop):
            raise BadInput("a stop sequence is empty: give at least one character")
        req = Request(
            f"req-{next(self._ids)}",
            tenant,
            ids,
            check_max_tokens(max_tokens),
            check_temperature(temperature),
            check_seed(seed),
            stop=tuple(tuple(self.tokenizer.encode(s, "a stop sequence")) for s in stop),
        )
        need = req.prompt_len + req.max_tokens
        if need > self.context_length or need > self.pool.capacity_tokens:
            req.finish(
                Outcome.REJECTED,
                self.trace,
                f"prompt of {counted(req.prompt_len, 'token')} + max_tokens {req.max_tokens} = {need} "
                "exceeds "
                + (
                    f"the context length of {counted(self.context_length, 'token')}"
                    if need > self.context_length
                    else f"the KV pool of {counted(self.pool.capacity_tokens, 'token')}"
                ),
            )
            return req
        self.waiting.append(req)
        return req

    def step(self) -> list[Request]:
        """Admit what fits, prefill it, run one decode step over every running request."""
        done: list[Request] = []
        while (
            self.waiting
            and len(self.running) < self.max_batch
            and self.pool.can_reserve(self._tokens(self.waiting[0]))
        ):
            req = self.waiting.popleft()
            res = self.pool.reserve(req.request_id, req.tenant, self._tokens(req))
            req.advance(State.PREFILLING, self.trace)
            try:
                logits = self.runner.prefill(req.request_id, req.tenant, req.prompt_ids, res.pages)
                self._emit_token(req, logits)
            except BaseException:  # the request is in no queue now: its pages go back, then the error
                self.pool.release(req.request_id)
                self._generators.pop(req.request_id, None)
                req.finish(Outcome.ABORTED, self.trace, "prefill failed")
                raise
            req.advance(State.DECODING, self.trace)
            self.running.append(req)
            done += self._retire()
        if self.running:
            items = [DecodeItem.next_step(r, self.pool.reservation(r.request_id).pages) for r in self.running]
            logits = self.runner.decode(items)
            for r, row in zip(self.running, logits):
                self._emit_token(r, row)
            done += self._retire()
        return done

    def run(self) -> None:
        """Step until nothing is waiting or running."""
        while self.waiting or self.running:
            self.step()

    def generate(
        self,
        tenant: str,
        prompts: list[str],
        max_tokens: int = 16,
        temperature: float = 0.0,
        stop: Sequence[str] = (),
    ) -> list[Completion]:
        """Submit `prompts` as `tenant`, run to completion, return their completions in order."""
        reqs = [self.submit(tenant, p, max_tokens, temperature, stop=stop) for p in prompts]
        self.run()
        return [Completion.of(r, self.tokenizer) for r in reqs]

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _tokens(req: Request) -> int:
        return req.prompt_len + req.max_tokens

    def _emit_token(self, req: Request, logits: torch.Tensor) -> None:
        gen = None
        if req.temperature > 0:  # the streams and seeds of the disaggregated engine, so a seed agrees
            seed = req.seed if req.seed is not None else 0
            if not req.output_ids:
                gen = sampling_generator(seed, FIRST_TOKEN)
            elif (gen := self._generators.get(req.request_id)) is None:
                gen = self._generators[req.request_id] = sampling_generator(seed, DECODE_STEPS)
        req.output_ids.append(sample(logits, req.temperature, gen))
        if req.first_token_at is None:
            req.first_token_at = time.time()

    def _retire(self) -> list[Request]:
        done = []
        for r in list(self.running):
            outcome = r.completed()
            if outcome is None:
                continue
            self.running.remove(r)
            self.pool.release(r.request_id)
            self._generators.pop(r.request_id, None)
            r.finish(outcome, self.trace)
            done.append(r)
        return done
