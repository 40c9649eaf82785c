"""The incident scenario, runnable against any engine handle: alice's secrets, bob's long prompt.

1. alice sends a few prompts full of secret records, concurrently (her pages fill the decode pool);
2. bob sends one prompt longer than the prefill pool but within the context length;
3. the report says what bob's client saw (status, token count, text, TTFT), which of alice's
   secrets his answer holds, and whose pages his decode read.

Used by the tests, the labs and the benchmarks, with any numbers: the prompt lengths follow the
engine's configuration unless given.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from minigrid_engine.canary import CanaryHarness, Finding, TTFTFloor
from minigrid_engine.errors import MinigridError
from minigrid_engine.forensics import AffectedResponse, affected_responses, pages_read
from minigrid_engine.handle import Reply
from minigrid_engine.records import RECORD, record_prompt

CODE = re.compile(r"\b([A-Z0-9]{6,10});")
TIMING_PROMPT = "a short prompt, timed."  # 22 tokens, shorter than any victim prompt (32 or more)


def codes_in(text: str) -> set[str]:
    """Every code in `text` that ends a record (``...QZ7K2M9P;``), whole records or not."""
    return set(CODE.findall(text))


def record_codes(text: str, tenant: str | None = None) -> set[str]:
    """Codes of complete records in `text` (of one tenant, if given)."""
    return {c for name, _, c in RECORD.findall(text) if tenant is None or name == tenant.upper()}


class Handle(Protocol):
    def complete(self, tenant: str, prompt: str, max_tokens: int = 16, **body: Any) -> Reply: ...

    def trace(self, since: int = 0, tenant: str = "admin") -> dict[str, list[dict[str, Any]]]: ...


@dataclass
class LeakReport:
    victim: str
    attacker: str
    victim_prompts: list[str]
    victim_replies: list[Reply]
    attacker_prompt: str
    reply: Reply
    leaked_codes: set[str]
    longest_run: int  # longest run of the victim's prompt text in the answer
    pages: list[dict[str, Any]] = field(default_factory=list)  # decode pages the answer read
    baseline_ttft_s: float | None = None  # a real prefill of a victim prompt, alone
    finding: Finding | None = None  # what the canary harness and the TTFT floor say
    attempt: int = 1
    attempts: int = 1  # how many run_incident was allowed
    run_threshold: int = 24  # this many characters in a row of the victim's text are a leak
    ttft_floor_s: float | None = None  # the fastest a real prefill of the attacker's prompt can be

    @property
    def too_fast(self) -> bool:
        """The first token came faster than a real prefill of the prompt allows."""
        return self.finding is not None and self.finding.too_fast

    @property
    def leaked(self) -> bool:
        return bool(self.leaked_codes) or self.longest_run >= self.run_threshold

    def pages_by_tenant(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for p in self.pages:
            out[p["last_writer_tenant"]] = out.get(p["last_writer_tenant"], 0) + 1
        return out

    def content(self) -> str:
        """What a content test says of the answer: the victim's codes, or a run of her text."""
        if not self.reply.ok:
            return f"no answer to test (HTTP {self.reply.status})"
        if self.leaked_codes:
            return f"LEAK: {self.victim}'s codes {', '.join(sorted(self.leaked_codes))}"
        if self.leaked:
            return f"LEAK: {self.longest_run} characters in a row of {self.victim}'s text"
        return "clean"

    def ttft_check(self) -> str:
        r = self.reply
        if not r.ok or r.ttft_s is None:
            return f"no first token (HTTP {r.status}): nothing to time"
        if not self.ttft_floor_s:
            return "no real prefill was timed: no floor to compare with"
        said = "faster than a real prefill allows" if self.too_fast else "plausible"
        n = r.prompt_tokens or len(self.attacker_prompt)
        return (
            f"{said} (first token in {r.ttft_s * 1000:.1f} ms; a real prefill of {n:,} tokens "
            f"takes at least {self.ttft_floor_s * 1000:.1f} ms here)"
        )

    def attempts_line(self) -> str:
        """Which attempt this report is, and why there were more than one."""
        if not self.reply.ok:
            return f"attempt {self.attempt} of {self.attempts}: {self.attacker}'s request was refused"
        if self.leaked:
            if self.attempt == 1:
                return f"leaked on the first attempt (of {self.attempts} allowed)"
            return (
                f"leaked on attempt {self.attempt} of {self.attempts}: the earlier answers read "
                f"{self.victim}'s pages too, but the tiny model made no readable text of them"
            )
        return f"no readable leak in {self.attempts} attempt(s); the pages read are counted below"

    def summary(self) -> str:
        r = self.reply
        ttft = "none" if r.ttft_s is None else f"{r.ttft_s * 1000:.1f} ms"
        lines = [
            f"{self.attacker}'s request: HTTP {r.status}, prompt_tokens={r.prompt_tokens}, ttft={ttft}",
            f"answer: {r.text!r}" if r.ok else f"error: {r.error}",
            f"{self.victim}'s secrets in the answer: {sorted(self.leaked_codes) or 'none'}",
            f"longest run of {self.victim}'s text in the answer: {self.longest_run} characters",
            f"content test: {self.content()}",
            f"pages read, by last writer: {self.pages_by_tenant()}",
            f"TTFT check: {self.ttft_check()}",
        ]
        return "\n".join(lines)


def run_incident(
    engine: Handle,
    *,
    context_length: int,
    prefill_pool_tokens: int,
    victim: str = "alice",
    attacker: str = "bob",
    victim_prompts: int = 2,
    victim_len: int | None = None,
    attacker_len: int | None = None,
    max_tokens: int = 48,
    seed: int = 0,
    attempts: int = 1,
    victim_shape: str = "records",
) -> LeakReport:
    """Run the scenario; with `attempts` > 1, run it again (new prompts, next seed) until the answer
    shows the victim's text. Every attempt reads the victim's pages; whether a 0.6 M-parameter
    model turns them into readable secrets within a few tokens is a matter of luck (`python
    bench/leak_text.py` measures how often, for each shape). `victim_shape`: the victim's secrets
    as records (``ALICE card QZ7K2M9P; ``) or as a ``letter``, ``code`` or ``chat`` transcript."""
    _check_sizes(engine, context_length=context_length, prefill_pool_tokens=prefill_pool_tokens)
    report = None
    for i in range(attempts):
        report = _incident_once(
            engine,
            context_length,
            prefill_pool_tokens,
            victim,
            attacker,
            victim_prompts,
            victim_len,
            attacker_len,
            max_tokens,
            seed + i,
            victim_shape,
        )
        report.attempt, report.attempts = i + 1, attempts
        if report.leaked or not report.reply.ok:
            break
    assert report is not None
    return report


def _check_sizes(engine: Handle, **given: int) -> None:
    """The sizes a scenario's prompts are cut to, against those the engine states (a handle with
    `config()`): numbers that disagree make prompts that test nothing, or a 400 that looks like a fix."""
    read = getattr(engine, "config", None)
    try:
        stated = read() if callable(read) else {}
    except MinigridError:  # a view this key may not open: nothing to compare with
        return
    wrong = [f"{k}={v:,} (the engine has {stated[k]:,})" for k, v in given.items() if stated.get(k, v) != v]
    if wrong:
        raise MinigridError(
            "the scenario was given " + ", ".join(wrong) + ": pass the engine's own numbers "
            "(engine.config() states them)"
        )


def _held_at_once(engine: Handle, replies: list[Reply]) -> bool:
    """Whether the victim's requests held their decode pages at the same time (no page of one pool
    reserved by two of them). They do when the first is still decoding as the next is admitted;
    on a stalled machine the first may finish before, the next then takes the same pages back, and
    the attacker's reservation reaches pages nobody wrote: a different scene from the incident's."""
    ids = {r.request_id for r in replies if r.request_id}
    held: dict[str, set[tuple[Any, int]]] = {}
    for e in engine.trace()["decode"]:
        if e["kind"] == "reserve" and e.get("request") in ids:
            held[e["request"]] = {(e.get("worker"), p) for p in e["pages"]}
    sets = list(held.values())
    return all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :])


def _incident_once(
    engine: Handle,
    context_length: int,
    prefill_pool_tokens: int,
    victim: str,
    attacker: str,
    victim_prompts: int,
    victim_len: int | None,
    attacker_len: int | None,
    max_tokens: int,
    seed: int,
    victim_shape: str = "records",
) -> LeakReport:
    rng = random.Random(seed)
    # Every code in every prompt is its tenant's canary, and a run of 24 characters of the victim's
    # text is a leak too. Records carry a canary every 20 characters; a letter or code carries few,
    # so for those, a run of half the answer (12 to 24 characters) counts (bob's prompt is records).
    run = 24 if victim_shape == "records" else min(24, max(12, max_tokens // 2))
    canaries = CanaryHarness(seed, run_threshold=run)
    # Victim prompts fit the prefill pool; the attacker's does not, but fits the context.
    vlen = victim_len or max(32, int(min(prefill_pool_tokens, context_length) * 0.9) - max_tokens)
    alen = attacker_len or (context_length - max_tokens)
    vprompts = [
        canaries.prompt(victim, vlen, rng.randint(6, 10))
        if victim_shape == "records"
        else canaries.shaped(victim, victim_shape, vlen)
        for _ in range(victim_prompts)
    ]
    # Real prefills, alone, for the TTFT floor: short prompts time the trip's fixed cost (each takes
    # the page the victim's baseline overwrites next, so the pool's state is as without them),
    # one of the victim's prompts the cost per token.
    floor = TTFTFloor()
    for _ in range(3):
        short = engine.complete(victim, TIMING_PROMPT, max_tokens=1)
        if short.ok and short.ttft_s:
            floor.observe(short.prompt_tokens or len(TIMING_PROMPT), short.ttft_s)
    baseline = engine.complete(victim, vprompts[0], max_tokens=4)
    if baseline.ok and baseline.ttft_s:
        floor.observe(len(vprompts[0]), baseline.ttft_s)
    for _ in range(3):  # at most twice more when a stalled machine ran them one after the other
        with ThreadPoolExecutor(len(vprompts)) as pool:  # concurrent, in a fixed order of arrival
            futures = []
            for p in vprompts:
                futures.append(pool.submit(engine.complete, victim, p, max_tokens=max_tokens))
                time.sleep(0.05)
            vreplies = [f.result() for f in futures]
        if not all(r.ok for r in vreplies) or _held_at_once(engine, vreplies):
            break
    aprompt = canaries.prompt(attacker, alen, 10)
    reply = engine.complete(attacker, aprompt, max_tokens=max_tokens)
    finding = canaries.check(attacker, reply.text) if reply.ok else Finding(attacker)
    finding.too_fast = reply.ok and floor.too_fast(alen, reply.ttft_s)
    pages: list[dict[str, Any]] = []
    if reply.request_id is not None:
        pages = list(pages_read(engine.trace()["decode"], reply.request_id))
    return LeakReport(
        victim,
        attacker,
        vprompts,
        vreplies,
        aprompt,
        reply,
        finding.foreign_canaries.get(victim, set()),
        finding.longest_foreign_run,
        pages,
        baseline.ttft_s,
        finding=finding,
        run_threshold=canaries.run_threshold,
        ttft_floor_s=floor.floor_s(alen) or None,
    )


@dataclass
class LateTransferReport:
    """A transfer slower than the release timeout, and the tenant whose pages it then landed in."""

    slow_tenant: str
    victim: str
    slow_reply: Reply
    reply: Reply  # the victim's answer
    foreign_codes: set[str]  # the slow tenant's codes in the victim's answer
    foreign_writes: list[dict[str, Any]]  # late page data written into pages another request held
    replies: list[Reply] = field(default_factory=list)  # every victim answer (`victims` > 1)

    @property
    def leaked(self) -> bool:
        """The slow tenant's K/V landed in pages the victim held (and perhaps in its text)."""
        return bool(self.foreign_writes) or bool(self.foreign_codes)


def run_late_transfer(
    engine: Handle,
    *,
    context_length: int,
    slow_tenant: str = "carol",
    victim: str = "alice",
    slow_len: int | None = None,
    victim_len: int | None = None,
    seed: int = 0,
    victims: int = 1,
) -> LateTransferReport:
    """The engine must run with ``inject=("delay-transfer=D",)`` and a release timeout below D.

    1. `slow_tenant`'s transfer is held past decode's release timeout: decode gives up (an error);
    2. right after, `victim` sends a prompt (`victims` at once: with several decode workers, one
       per worker) and decodes for a long time;
    3. the late transfer lands in the pages decode gave back, if they were given back.
    """
    _check_sizes(engine, context_length=context_length)
    rng = random.Random(seed)
    slow_prompt = record_prompt(slow_tenant, slow_len or context_length // 2 + 64, rng, 6)
    vlen = victim_len or context_length // 2
    victim_prompts = [record_prompt(victim, vlen, rng, 6) for _ in range(victims)]
    slow_reply = engine.complete(slow_tenant, slow_prompt, max_tokens=8)
    budget = context_length - vlen - 8
    with ThreadPoolExecutor(victims) as pool:
        replies = list(pool.map(lambda p: engine.complete(victim, p, max_tokens=budget), victim_prompts))
    slow_codes = record_codes(slow_prompt, slow_tenant)
    foreign = {c for r in replies if r.ok for c in codes_in(r.text) & slow_codes}
    writes = [
        e
        for e in engine.trace()["decode"]
        if e["kind"] == "write"
        and e["tenant"] == slow_tenant
        and any(o is not None and o != e["request"] for o in e["detail"].get("owners", []))
    ]
    return LateTransferReport(slow_tenant, victim, slow_reply, replies[0], foreign, writes, replies)


@dataclass
class DayRequest:
    tenant: str
    prompt_tokens: int
    reply: Reply
    finding: Finding


@dataclass
class DayReport:
    """A replayed day of traffic and its affected responses: those that read another tenant's
    pages, found from the trace page by page (INCIDENT.md's 155 are responses that "carried data
    from other customers' requests"; it does not say how they were counted)."""

    requests: list[DayRequest]
    affected: list[AffectedResponse]  # read another tenant's pages (forensics, from the trace)
    threshold_tokens: int  # the prefill pool: only prompts longer than this can be affected

    def _by_id(self) -> dict[str, DayRequest]:
        return {r.reply.request_id: r for r in self.requests if r.reply.request_id}

    @property
    def served(self) -> int:
        return sum(r.reply.ok for r in self.requests)

    @property
    def over_threshold(self) -> int:
        return sum(r.prompt_tokens > self.threshold_tokens for r in self.requests)

    @property
    def affected_served(self) -> list[DayRequest]:
        """Affected responses the client received with HTTP 200: those that carried the data out."""
        by_id = self._by_id()
        return [by_id[a.request] for a in self.affected if a.request in by_id and by_id[a.request].reply.ok]

    @property
    def with_foreign_canaries(self) -> int:
        """Responses whose text holds another tenant's canary: the part a reader can see."""
        return sum(r.finding.leak for r in self.requests)

    def shortest_affected_prompt(self) -> int | None:
        return min((r.prompt_tokens for r in self.affected_served), default=None)

    def table(self) -> str:
        short = self.shortest_affected_prompt()
        return "\n".join(
            [
                f"requests replayed           {len(self.requests):>5}",
                f"answered HTTP 200           {self.served:>5}",
                f"prompts over {self.threshold_tokens} tokens      {self.over_threshold:>5}",
                f"affected responses (200)    {len(self.affected_served):>5}   read another tenant's pages",
                f"  with foreign canaries     {self.with_foreign_canaries:>5}   the secrets are in the text",
                f"shortest affected prompt    {short if short is not None else '-':>5}   tokens",
            ]
        )


def replay_day(
    engine: Handle,
    *,
    context_length: int,
    prefill_pool_tokens: int,
    tenants: tuple[str, ...] = ("alice", "bob"),
    requests: int = 40,
    long_share: float = 0.15,
    max_tokens: int = 16,
    concurrency: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> DayReport:
    """Replay a day of ordinary traffic: most prompts fit the prefill pool, `long_share` of them
    are longer than the pool yet within the context. Each response is then checked two ways: the
    canary harness reads its text; the forensics read the decode trace for foreign pages."""
    from tqdm.auto import tqdm

    if requests < 1 or not 0 <= long_share <= 1:
        raise ValueError(f"a day needs requests >= 1 and 0 <= long_share <= 1 (got {requests}, {long_share})")
    _check_sizes(engine, context_length=context_length, prefill_pool_tokens=prefill_pool_tokens)
    rng = random.Random(seed)
    canaries = CanaryHarness(seed)
    longest = context_length - max_tokens  # the longest prompt the API accepts with its answer
    fits = min(prefill_pool_tokens, longest)
    plan = []
    for _ in range(requests):
        tenant = rng.choice(tenants)
        if rng.random() < long_share and prefill_pool_tokens < longest:  # none is longer otherwise
            n = rng.randint(prefill_pool_tokens + 1, longest)
        else:
            n = rng.randint(48, max(49, int(fits * 0.9) - max_tokens))
        plan.append((tenant, n, canaries.prompt(tenant, n, rng.randint(4, 10))))
    done: list[DayRequest] = []
    bar = tqdm(total=requests, desc="replaying the day", unit="req", disable=not progress)
    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(0, requests, concurrency):
            wave = plan[i : i + concurrency]
            futures = [pool.submit(engine.complete, t, p, max_tokens=max_tokens) for t, _, p in wave]
            for (tenant, n, _), f in zip(wave, futures):
                reply = f.result()
                finding = canaries.check(tenant, reply.text) if reply.ok else Finding(tenant)
                done.append(DayRequest(tenant, n, reply, finding))
                bar.update(1)
    bar.close()
    affected = affected_responses(engine.trace()["decode"])
    return DayReport(done, affected, prefill_pool_tokens)


@dataclass
class FixVerdict:
    """The incident rerun under one set of fixes: what bob's client saw, and whether it leaked."""

    fixes: str
    started: bool
    refusal: str | None = None  # why the engine would not start (capacity-check)
    report: LeakReport | None = None

    @property
    def foreign_pages(self) -> int:
        if self.report is None:
            return 0
        return sum(
            n for t, n in self.report.pages_by_tenant().items() if t not in (None, self.report.attacker)
        )

    @property
    def leaked(self) -> bool:
        return (
            self.report is not None
            and self.report.reply.ok
            and (self.report.leaked or self.foreign_pages > 0)
        )

    @property
    def client_saw(self) -> str:
        """'no engine', '400', 'error', '200 leak' or '200 clean'."""
        if not self.started or self.report is None:
            return "no engine"
        r = self.report.reply
        if r.status == 400:
            return "400"
        if not r.ok:
            return "error"
        return "200 leak" if self.leaked else "200 clean"

    def describe(self) -> str:
        if self.report is None:
            return f"{self.fixes}: the engine refused to start: {self.refusal}"
        r = self.report.reply
        err = r.error or {}
        said = f"error {r.status} {err.get('code', '')}: {err.get('message', '')}"
        return (
            f"{self.fixes}: bob's client saw {self.client_saw}; "
            + (f"answer {r.text!r}" if r.ok else said)
            + f"; foreign pages read: {self.foreign_pages}"
        )


def verify_fix(
    fixes: str,
    cfg: Any = None,
    *,
    attempts: int = 3,
    attacker_len: int | None = None,
    max_tokens: int = 24,
) -> FixVerdict:
    """Start an engine with `fixes` on `cfg` (default: the incident's numbers), rerun the identical
    scenario, stop it. The fix is verified by the canary harness and the forensics, not by hope."""
    from minigrid_engine.config import incident_preset
    from minigrid_engine.handle import Engine, EngineRefusedToStart

    cfg = cfg or incident_preset()
    try:
        eng = Engine.start(cfg, fixes=fixes)
    except EngineRefusedToStart as exc:
        return FixVerdict(fixes, False, exc.reason)
    try:
        report = run_incident(
            eng,
            context_length=cfg.context_length,
            prefill_pool_tokens=cfg.prefill_pool_tokens,
            attacker_len=attacker_len,
            max_tokens=max_tokens,
            attempts=attempts,
        )
    finally:
        eng.stop()
    return FixVerdict(fixes, True, None, report)
