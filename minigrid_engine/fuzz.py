"""Isolation fuzzing: a randomized multi-tenant campaign, then the engine's own evidence.

Several tenants send concurrent requests whose prompt lengths straddle the page size, the prefill
pool and the context length; some clients hang up mid-flight. Every prompt is made of canaries
(`canary.py`). Then the campaign judges three ways, from what a client saw and from the engine:

- **answers**: a response holding another tenant's canary or a long run of its text is leaked;
- **the trace, replayed**: a page read whose last writer was another request is a foreign read;
  a page reserved while another request holds it is double-owned;
- **the pools at rest**: pages in use return to zero, and each pool's `check_integrity()` passes.

    minigrid fuzz --requests 200 --fixes all      # corrected pool; isolation holds: exit 0
    minigrid fuzz --requests 200 --fixes none     # the incident's numbers: leaks found, exit 1
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from minigrid_engine.canary import CanaryHarness, Finding
from minigrid_engine.config import ServeConfig
from minigrid_engine.errors import ConfigError
from minigrid_engine.handle import Engine

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
MAX_TENANTS = 1000  # each is a key on the engine's command line
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class FuzzConfig:
    """The shape of a campaign (the engine's numbers come from its `ServeConfig`)."""

    requests: int = 200
    seed: int = 0
    tenants: int = 3
    concurrency: int = 8
    abort_rate: float = 0.1  # share of clients that hang up mid-flight
    max_tokens: int = 32  # most tokens an ordinary request asks for
    timeout_s: float = 120.0  # per request
    settle_s: float = 30.0  # how long pages may take to come back once the campaign is over

    def __post_init__(self) -> None:
        bounds = (
            ("requests", self.requests, 1, None),
            ("tenants", self.tenants, 2, MAX_TENANTS),
            ("concurrency", self.concurrency, 1, None),
            ("max-tokens", self.max_tokens, 1, None),
        )
        for flag, value, least, most in bounds:
            if value < least or (most is not None and value > most):
                within = f"from {least} to {most:,}" if most is not None else f"at least {least}"
                raise ConfigError(f"--{flag} {value}: a campaign needs {within}")
        if not 0 <= self.abort_rate <= 1:
            raise ConfigError(f"--abort-rate {self.abort_rate} must be between 0 and 1")


@dataclass(frozen=True)
class Shot:
    """One planned request."""

    index: int
    tenant: str
    prompt: str
    max_tokens: int
    abort_after_s: float | None  # the client hangs up after this long (None: it waits)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.encode())


@dataclass
class Outcome:
    """What the client of one shot saw."""

    shot: Shot
    status: int | None  # None: the client hung up first
    code: str | None = None
    text: str = ""
    finding: Finding | None = None
    request_id: str | None = None


@dataclass
class Replay:
    """What the trace of one role says about page ownership, replayed event by event."""

    foreign_reads: set[tuple[str, int, str]] = field(default_factory=set)  # (reader, page, writer)
    # (reader, page) -> the tenant who wrote it, where that is not the reader's tenant
    foreign_tenant_reads: dict[tuple[str, int], str | None] = field(default_factory=dict)
    double_owned: list[str] = field(default_factory=list)
    still_held: dict[int, str] = field(default_factory=dict)


def replay(events: list[dict[str, Any]]) -> Replay:
    """Replay one role's trace (oldest first): who wrote and who holds each page at every read."""
    out = Replay()
    writer: dict[int, tuple[str | None, str | None]] = {}
    holder: dict[int, str] = {}
    for e in events:
        kind, req, pages = e["kind"], e["request"], e["pages"]
        if kind == "write":
            for p in pages:
                writer[p] = (req, e["tenant"])
        elif kind == "scrub":  # zeroed: written by nobody
            for p in pages:
                writer[p] = (None, None)
        elif kind == "reserve":
            for p in pages:
                if p in holder:
                    out.double_owned.append(f"page {p} reserved by {req} while {holder[p]} holds it")
                holder[p] = req
        elif kind == "release":
            for p in pages:
                if holder.get(p) != req:
                    out.double_owned.append(f"page {p} released by {req}, held by {holder.get(p)}")
                holder.pop(p, None)
        elif kind == "read":
            for p in pages:
                w, tenant = writer.get(p, (None, None))
                if w is not None and w != req:
                    out.foreign_reads.add((req, p, w))
                    if tenant != e["tenant"]:
                        out.foreign_tenant_reads[(req, p)] = tenant
    out.still_held = holder
    return out


@dataclass
class FuzzReport:
    """The campaign's figures; `isolated` is the verdict."""

    fixes: str
    numbers: dict[str, int]
    requests: int = 0
    ok: int = 0
    rejected: int = 0  # 4xx
    errors: int = 0  # 5xx
    aborted: int = 0  # the client hung up first
    oversized_accepted: int = 0  # longer than the prefill pool, yet 200: the incident's symptom
    leaked_responses: int = 0  # answers built on another tenant's pages, or showing its text
    readable_leaks: int = 0  # of those, answers whose text holds another tenant's canaries or text
    leaks: Counter[str] = field(default_factory=Counter)  # "reader <- owner": responses
    foreign_pages: int = 0  # (request, page) reads of a page another request wrote last
    foreign_tenant_pages: int = 0  # of those, another tenant's
    double_owned: int = 0
    pages_in_use: dict[str, int] = field(default_factory=dict)
    integrity: dict[str, str] = field(default_factory=dict)
    trace_complete: bool = True
    unexpected: list[str] = field(default_factory=list)  # statuses the fixes do not allow
    examples: list[str] = field(default_factory=list)  # the first few leaks, explained
    seconds: float = 0.0

    @property
    def isolated(self) -> bool:
        """No foreign content, no foreign or double-owned page, every page back, pools intact."""
        return (
            self.leaked_responses == 0
            and self.foreign_pages == 0
            and self.double_owned == 0
            and not any(self.pages_in_use.values())
            and all(v == "ok" for v in self.integrity.values())
        )

    def table(self) -> str:
        n = self.numbers
        rows = [
            ("requests", self.requests),
            ("ok (200)", self.ok),
            ("rejected (4xx)", self.rejected),
            ("errors (5xx)", self.errors),
            ("aborted by the client", self.aborted),
            ("oversized, answered 200", self.oversized_accepted),
            (
                "leaked responses",
                f"{self.leaked_responses} ({self.readable_leaks} with another tenant's text)",
            ),
            ("foreign pages read", f"{self.foreign_pages} ({self.foreign_tenant_pages} another tenant's)"),
            ("double-owned pages", self.double_owned),
            ("pages in use after", ", ".join(f"{r} {v}" for r, v in self.pages_in_use.items())),
            ("integrity", ", ".join(f"{r} {v}" for r, v in self.integrity.items())),
            ("unexpected statuses", len(self.unexpected)),
        ]
        lines = [
            f"minigrid fuzz: fixes {self.fixes}; context {n['context_length']}, prefill pool "
            f"{n['prefill_pool_tokens']}, decode pool {n['decode_pool_tokens']}, page {n['page_size']}; "
            f"{self.seconds:.1f} s",
            *(f"  {name:<26}{value}" for name, value in rows),
        ]
        if not self.trace_complete:
            lines.append("  the trace dropped events: the page checks cover part of the campaign only")
        lines += [f"  leak: {x}" for x in self.examples]
        lines += [f"  unexpected: {x}" for x in self.unexpected[:5]]
        lines.append("verdict: " + ("ISOLATED" if self.isolated else "ISOLATION BROKEN"))
        return "\n".join(lines)

    def to_json(self) -> str:
        # asdict() would rebuild the Counter from its (key, count) pairs, counting the pairs
        return json.dumps({**asdict(self), "leaks": dict(self.leaks), "isolated": self.isolated}, indent=2)


def tenant_keys(k: int, rng: random.Random) -> dict[str, str]:
    """`k` tenants with random keys."""
    names = [NAMES[i] if i < len(NAMES) else f"tenant{i}" for i in range(k)]
    return {name: f"sk-{name}-{rng.getrandbits(64):016x}" for name in names}


def plan(cfg: ServeConfig, fuzz: FuzzConfig, tenants: list[str], harness: CanaryHarness) -> list[Shot]:
    """The campaign's requests: lengths at the edges of pages, of the prefill pool, of the context."""
    rng = random.Random(fuzz.seed)
    ctx, page = cfg.context_length, cfg.page_size
    pages = [page * k + d for k in range(1, cfg.pages_per_context + 1) for d in (-1, 0, 1)]
    shots = []
    for i in range(fuzz.requests):
        max_tokens = rng.randint(1, fuzz.max_tokens)
        pick = rng.random()
        if pick < 0.25:
            n = rng.choice(pages)
        elif pick < 0.5:
            # the pool's edge, where it falls inside the context (the corrected pool's does not)
            n = min(cfg.prefill_pool_tokens, ctx - max_tokens) + rng.randint(-8, 8)
        elif pick < 0.65:
            n = ctx - max_tokens + rng.randint(-2, 2)  # just fits, or just does not
        else:
            n = rng.randint(1, ctx - max_tokens)
        n = max(1, n)
        if rng.random() < 0.05:  # now and then, far past the context with the completion alone
            max_tokens = ctx + rng.randint(0, 64)
        tenant = rng.choice(tenants)
        prompt = harness.prompt(tenant, n, rng.randint(3, 8))
        abort = rng.uniform(0.005, 0.4) if rng.random() < fuzz.abort_rate else None
        shots.append(Shot(i, tenant, prompt, max_tokens, abort))
    return shots


def expected_status(shot: Shot, cfg: ServeConfig) -> tuple[int, str | None] | None:
    """What the engine must answer, or None where the faulty path decides (counted, not judged)."""
    if shot.prompt_tokens + shot.max_tokens > cfg.context_length:
        return 400, "context_length_exceeded"
    if shot.prompt_tokens > cfg.prefill_pool_tokens:
        if cfg.fixes.reject_before_transfer:
            return 400, "context_length_exceeded"
        return None
    return 200, None


class Campaign:
    """Runs the shots against `engine` (which must hold an admin key) and gathers the evidence."""

    def __init__(self, engine: Engine, cfg: ServeConfig, fuzz: FuzzConfig, progress: bool = False):
        if engine.admin_key is None:
            raise ConfigError("the campaign reads pools and the whole trace: the engine needs an admin key")
        self.engine, self.cfg, self.fuzz, self.progress = engine, cfg, fuzz, progress
        self.harness = CanaryHarness(fuzz.seed)
        self.admin = {"Authorization": f"Bearer {engine.admin_key}"}
        self.events: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
        self.trace_complete = True

    async def run(self) -> FuzzReport:
        t0 = time.perf_counter()
        shots = plan(self.cfg, self.fuzz, sorted(self.engine.tenants), self.harness)
        limits = httpx.Limits(max_connections=self.fuzz.concurrency + 4)
        async with httpx.AsyncClient(
            base_url=self.engine.url, timeout=self.fuzz.timeout_s, limits=limits
        ) as c:
            gate = asyncio.Semaphore(self.fuzz.concurrency)
            bar = tqdm(total=len(shots), desc="fuzz", unit="req", disable=not self.progress, leave=False)
            stop = asyncio.Event()
            poller = asyncio.create_task(self._poll_trace(c, stop))

            async def one(shot: Shot) -> Outcome:
                async with gate:
                    out = await self._send(c, shot)
                bar.update()
                return out

            outcomes = await asyncio.gather(*(one(s) for s in shots))
            bar.close()
            pages = await self._settle(c)
            stop.set()
            await poller
            await self._fetch_trace(c)  # whatever came after the last poll
            r = await c.get("/v1/minigrid/integrity", headers=self.admin)
            bad = {"ok": False, "error": f"no integrity report (HTTP {r.status_code})"}
            integrity = r.json() if r.status_code == 200 else {role: bad for role in ROLES}
        report = self._judge(outcomes, pages, integrity)
        report.seconds = time.perf_counter() - t0
        return report

    async def _send(self, c: httpx.AsyncClient, shot: Shot) -> Outcome:
        key = self.engine.tenants[shot.tenant]
        post = c.post(
            "/v1/completions",
            json={"prompt": shot.prompt, "max_tokens": shot.max_tokens},
            headers={"Authorization": f"Bearer {key}"},
        )
        try:
            r = await (post if shot.abort_after_s is None else asyncio.wait_for(post, shot.abort_after_s))
        except asyncio.TimeoutError:  # our own hang-up, not the engine's failure
            return Outcome(shot, None)
        except httpx.HTTPError as exc:  # the engine's: no answer at all
            return Outcome(shot, 0, type(exc).__name__)
        try:
            data = r.json()
        except ValueError:
            return Outcome(shot, r.status_code, "not_json")
        if r.status_code != 200:
            return Outcome(shot, r.status_code, (data.get("error") or {}).get("code"))
        text = data["choices"][0]["text"]
        finding = self.harness.check(shot.tenant, text)
        return Outcome(shot, 200, None, text, finding, data.get("minigrid", {}).get("request_id"))

    async def _fetch_trace(self, c: httpx.AsyncClient) -> None:
        for role in ROLES:
            since = self.events[role][-1]["seq"] + 1 if self.events[role] else 0
            r = await c.get("/v1/minigrid/trace", params={"since": since, "role": role}, headers=self.admin)
            new = r.json()[role]
            if new and new[0]["seq"] != since:  # the engine's bounded trace dropped some
                self.trace_complete = False
            self.events[role] += new

    async def _poll_trace(self, c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """Read the trace as it grows, before its bounded log drops the oldest events."""
        while not stop.is_set():
            await self._fetch_trace(c)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _settle(self, c: httpx.AsyncClient) -> dict[str, int]:
        """Pages in use per role, once they are back to zero or `settle_s` has passed."""
        deadline = time.monotonic() + self.fuzz.settle_s
        while True:
            text = (await c.get("/metrics")).text
            pages = {
                role: int(float(line.rsplit(" ", 1)[1]))
                for role in ROLES
                for line in text.splitlines()
                if line.startswith(f'minigrid_kv_pages_in_use{{role="{role}"}}')
            }
            if not any(pages.values()) or time.monotonic() > deadline:
                return pages
            await asyncio.sleep(0.2)

    def _judge(self, outcomes: list[Outcome], pages: dict[str, int], integrity: dict[str, Any]) -> FuzzReport:
        cfg = self.cfg
        rep = FuzzReport(
            str(cfg.fixes),
            {
                "context_length": cfg.context_length,
                "page_size": cfg.page_size,
                "prefill_pool_tokens": cfg.prefill_pool_tokens,
                "decode_pool_tokens": cfg.decode_pool_tokens,
            },
            requests=len(outcomes),
            pages_in_use=pages,
            integrity={r: "ok" if integrity[r]["ok"] else integrity[r]["error"] for r in ROLES},
            trace_complete=self.trace_complete,
        )
        read_from: dict[str, set[str | None]] = {}  # request -> tenants whose pages it read
        for role in ROLES:
            r = replay(self.events[role])
            rep.foreign_pages += len(r.foreign_reads)
            rep.foreign_tenant_pages += len(r.foreign_tenant_reads)
            rep.double_owned += len(r.double_owned)
            for (reader, _), owner in r.foreign_tenant_reads.items():
                read_from.setdefault(reader, set()).add(owner)
        for o in outcomes:
            s = o.shot
            if o.status is None:
                rep.aborted += 1
                continue
            rep.ok += o.status == 200
            rep.rejected += 400 <= o.status < 500
            rep.errors += o.status >= 500 or o.status == 0  # 0: no answer at all
            rep.oversized_accepted += o.status == 200 and s.prompt_tokens > cfg.prefill_pool_tokens
            want = expected_status(s, cfg)
            if want is not None and (o.status, o.code) != want:
                rep.unexpected.append(
                    f"request {s.index} ({s.prompt_tokens} + {s.max_tokens} tokens): "
                    f"expected {_said(*want)}, got {_said(o.status, o.code)}"
                )
            if o.status != 200:
                continue
            # A leaked response, as in the incident: built on another tenant's KV, or showing it.
            owners = set(read_from.get(o.request_id or "", set()))
            readable = o.finding is not None and o.finding.leak
            if readable and o.finding is not None:
                owners |= set(o.finding.foreign_canaries)
            if not owners:
                continue
            rep.leaked_responses += 1
            rep.readable_leaks += readable
            for owner in owners:
                rep.leaks[f"{s.tenant} <- {owner}"] += 1
            if readable and o.finding is not None and len(rep.examples) < 3:
                rep.examples.append(f"request {s.index}, {s.prompt_tokens} tokens: {o.finding.explain()}")
        return rep


def _said(status: int, code: str | None) -> str:
    """A status as the campaign reports it: "400 context_length_exceeded", "200", "0 ConnectError"."""
    return f"{status} {code}" if code else str(status)


def fuzz(cfg: ServeConfig, campaign: FuzzConfig | None = None, progress: bool = False) -> FuzzReport:
    """Start an engine on `cfg` with the campaign's tenants, run the campaign, stop the engine."""
    campaign = campaign or FuzzConfig()
    if campaign.max_tokens >= cfg.context_length:
        raise ConfigError(
            f"--max-tokens {campaign.max_tokens} leaves no room for a prompt in a context of "
            f"{cfg.context_length} tokens (--context-length): give --max-tokens "
            f"{max(1, cfg.context_length - 1)} at most"
        )
    tenants = tenant_keys(campaign.tenants, random.Random(campaign.seed))
    with Engine.start(cfg.with_(tenants=tenants)) as eng:
        return asyncio.run(Campaign(eng, eng.cfg or cfg, campaign, progress).run())
