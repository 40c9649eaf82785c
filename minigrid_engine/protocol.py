"""The protocol model check: the admission and transfer protocol as a small state machine, explored.

The engine's prefill and decode roles (`prefill.py`, `decode.py`) are modelled here as pure-Python
actions over one global state, small enough to explore every interleaving with a breadth-first
search:

- each request has a prefill copy and a decode copy, each in a `request.State`; every move goes
  through `request.TRANSITIONS` (the engine's own table, so the model cannot drift from it);
- each role has a few pages, each with an owner and a last writer, a LIFO free list, and pages
  that are never zeroed unless `scrub-on-free` says so;
- messages in flight form a multiset: any of them may be delivered next (reordering), a bounded
  number may be lost or duplicated, and decode may time out on a transfer at any moment (a
  transfer slower than the release timeout);
- the same `Fixes` as the engine pick the named branches.

One unit is one page: a prompt of 3 pages over a prefill pool of 2 pages is the incident's over-long
prompt. Queues are modelled as sets (any admissible request may go next), a superset of the
engine's FIFO orders, so a safe verdict covers the engine's schedules too.

The invariant, checked on every state and every read: no page is held by two requests, and a
request never decodes over a page whose last writer is another tenant's request. Breadth-first
search returns the shortest counterexample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from minigrid_engine.errors import ConfigError, counted
from minigrid_engine.fixes import Fixes
from minigrid_engine.request import TRANSITIONS, IllegalTransition, State

NONE = -1  # no owner / never written (or scrubbed)
Page = tuple[int, int]  # (owner request index or NONE, last writer request index or NONE)


@dataclass(frozen=True)
class ReqSpec:
    """One request of a scenario: its name, tenant and prompt length in pages."""

    name: str
    tenant: str
    pages: int


@dataclass(frozen=True)
class Scenario:
    """The bounds of one exploration."""

    name: str
    requests: tuple[ReqSpec, ...]
    prefill_pages: int
    decode_pages: int
    context_pages: int  # the advertised context length, in pages
    timeouts: bool = False  # decode may give up on a transfer (and a late transfer may still land)
    losses: int = 0  # messages that may be lost
    duplicates: int = 0  # messages that may be delivered twice
    max_states: int = 2_000_000


# The incident: alice's prompt fits; bob's (3 pages) is longer than the prefill pool (2 pages);
# decode's pool (4 pages) holds it, so decode preallocates all 3, two of them alice's freed pages.
INCIDENT = Scenario(
    "incident",
    (ReqSpec("alice-1", "alice", 2), ReqSpec("bob-2", "bob", 3)),
    prefill_pages=2,
    decode_pages=4,
    context_pages=3,
)
# A transfer slower than the release timeout: decode gives up on alice, hands her pages to bob,
# and alice's transfer (or a duplicate of it) lands in them afterwards.
LATE_TRANSFER = Scenario(
    "late-transfer",
    (ReqSpec("alice-1", "alice", 2), ReqSpec("bob-2", "bob", 2)),
    prefill_pages=2,
    decode_pages=2,
    context_pages=2,
    timeouts=True,
    duplicates=1,
)
# Everything at once, for the fixed engine: stub, timeouts, one loss, one duplicate.
COMBINED = replace(INCIDENT, name="combined", timeouts=True, losses=1, duplicates=1)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (INCIDENT, LATE_TRANSFER, COMBINED)}
MAX_REQUESTS = 4  # each request multiplies the interleavings; 4 is already millions of states


def parse_requests(text: str) -> tuple[ReqSpec, ...]:
    """`TENANT:PAGES,TENANT:PAGES` (e.g. `alice:2,bob:3`) as the requests of a scenario, in order."""
    specs = []
    for i, item in enumerate((t.strip() for t in text.split(",") if t.strip()), 1):
        tenant, sep, pages = item.partition(":")
        if not sep or not tenant.isidentifier():
            raise ConfigError(f"request {item!r}: write TENANT:PAGES, e.g. alice:2")
        try:
            n = int(pages)
        except ValueError:
            raise ConfigError(f"request {item!r}: PAGES must be a whole number, got {pages!r}") from None
        specs.append(ReqSpec(f"{tenant}-{i}", tenant, n))
    if not specs:
        raise ConfigError(f"--requests {text!r}: give at least one TENANT:PAGES")
    return tuple(specs)


def make_scenario(base: Scenario, **bounds: object) -> Scenario:
    """`base` with the given bounds replaced (None leaves one as it is), checked for sense.

    Raises `ConfigError` naming the numbers: pools and prompts of at least one page, no prompt longer
    than the context (the router answers those 400 before any protocol runs), at most
    `MAX_REQUESTS` requests, losses and duplicates between 0 and 3.
    """
    changes = {k: v for k, v in bounds.items() if v is not None}
    if changes:
        changes.setdefault("name", f"{base.name} (custom bounds)")
    sc = replace(base, **changes)  # type: ignore[arg-type]
    for what in ("prefill_pages", "decode_pages", "context_pages"):
        if getattr(sc, what) < 1:
            raise ConfigError(f"{what.replace('_', ' ')} must be at least 1, got {getattr(sc, what)}")
    if not 1 <= len(sc.requests) <= MAX_REQUESTS:
        raise ConfigError(f"{len(sc.requests)} requests: the model checks 1 to {MAX_REQUESTS}")
    for r in sc.requests:
        if not 1 <= r.pages <= sc.context_pages:
            raise ConfigError(
                f"request {r.name}: {r.pages} pages; prompts run from 1 page to the context length "
                f"({sc.context_pages} pages): longer ones get 400 at the router, before the protocol"
            )
        if r.pages > sc.decode_pages:
            raise ConfigError(
                f"request {r.name}: {r.pages} pages, more than the whole decode pool "
                f"({counted(sc.decode_pages, 'page')}): the engine refuses it with a 400 before any "
                f"page, so nothing of it would be checked; give --decode-pages {r.pages} or more"
            )
    for what in ("losses", "duplicates"):
        if not 0 <= getattr(sc, what) <= 3:
            raise ConfigError(f"{what} must be between 0 and 3, got {getattr(sc, what)}")
    if sc.max_states < 1:
        raise ConfigError(f"max states must be at least 1, got {sc.max_states}")
    return sc


# -- messages (plain tuples, so states hash fast) ---------------------------------------------
# ("bootstrapped", r)                    prefill -> decode
# ("kv_bootstrap", r, pages)             decode  -> prefill: where r's K/V must land
# ("transfer", r, dst, written, sums)    prefill -> decode: page data + done (Success), in order
# ("abort", r, source)                   either way
# ("abort_ack", r)                       prefill -> decode (deferred-release)
Msg = tuple


@dataclass(frozen=True)
class World:
    """The global state: both roles' request states, pools, and the messages in flight."""

    pstate: tuple[State, ...]
    dstate: tuple[State, ...]
    stub: tuple[bool, ...]  # prefill copy replaced by a one-token stub with a pending 400
    ppages: tuple[Page, ...]
    pfree: tuple[int, ...]  # top of the stack = end
    pblock: tuple[tuple[int, ...], ...]
    kvb: tuple[tuple[int, ...] | None, ...]  # decode pages prefill was told about
    dpages: tuple[Page, ...]
    dfree: tuple[int, ...]
    dblock: tuple[tuple[int, ...], ...]
    quarantine: tuple[bool, ...]  # deferred-release: decode holds the pages of a failed request
    inflight: tuple[Msg, ...]  # sorted multiset
    losses: int
    duplicates: int


@dataclass(frozen=True)
class Step:
    """One action of a trace, as a learner reads it."""

    actor: str  # router, prefill, decode, network
    action: str
    request: str | None
    text: str

    def __str__(self) -> str:
        return f"{self.actor}: {self.text}"


@dataclass
class ModelCheckResult:
    """What the search found: states explored and, if any, the shortest violating trace."""

    scenario: str
    fixes: str
    states_explored: int
    transitions: int
    violation: list[Step] | None
    violation_kind: str | None = None  # "stale-read" or "double-owner"
    refused_to_start: bool = False  # capacity-check: the pool does not cover the context
    complete: bool = True  # False if max_states cut the search short
    edges: set[tuple[State, State]] = field(default_factory=set)
    violation_states: list[World] | None = None  # the state after each step of `violation`
    # requests stubbed (longer than the prefill pool) with no fix on the read's way: a verdict of
    # safe then owes to the pool's order for these requests, not to the protocol
    stubbed_unguarded: tuple[str, ...] = ()

    @property
    def safe(self) -> bool:
        """No violation in any reachable state: the whole search ran and found none."""
        return self.violation is None and self.complete

    @property
    def verdict(self) -> str:
        if self.refused_to_start:
            return "refuses to start"
        if self.violation is not None:
            return f"{self.violation_kind} in {len(self.violation)} steps"
        return "safe" if self.complete else "no verdict (cut short)"

    @property
    def observed(self) -> str:
        """'leak', 'safe' (refusing to start is safe: nothing runs) or 'no verdict' (cut short)."""
        if self.violation is not None:
            return "leak"
        return "safe" if self.complete else "no verdict"

    def to_dict(self) -> dict[str, object]:
        """The result as plain data (the trace as steps; the explored edges left out)."""
        return {
            "scenario": self.scenario,
            "fixes": self.fixes,
            "verdict": self.verdict,
            "safe": self.safe,
            "refused_to_start": self.refused_to_start,
            "complete": self.complete,
            "states_explored": self.states_explored,
            "transitions": self.transitions,
            "violation_kind": self.violation_kind,
            "stubbed_unguarded": list(self.stubbed_unguarded),
            "violation": None
            if self.violation is None
            else [
                {"actor": s.actor, "action": s.action, "request": s.request, "text": s.text}
                for s in self.violation
            ],
        }

    def format(self) -> str:
        head = f"protocol model check: scenario {self.scenario}, fixes {self.fixes}"
        if self.refused_to_start:
            why = "a KV pool smaller than the context length"
            return f"{head}\n  capacity-check: the engine refuses to start ({why})"
        lines = [head, f"  {self.states_explored} states explored, {self.transitions} transitions"]
        if not self.complete:
            lines.append("  search cut short at max_states: no verdict")
        if self.violation is None and self.complete:
            lines.append("  no violation: isolation holds in every reachable state")
            if self.stubbed_unguarded:
                lines.append(
                    f"  note: {', '.join(self.stubbed_unguarded)} took the stub path (more pages than the "
                    "prefill pool) with no fix in the way, yet no read found another tenant's page: with "
                    "these requests the pool's order (the last page freed is the first given) never hands "
                    "one over that the stub did not overwrite. Another mix of --requests may: this verdict "
                    "holds for these requests only."
                )
        elif self.violation is None:
            lines.append("  no violation in the states explored before the search stopped")
        else:
            lines.append(
                f"  VIOLATION ({self.violation_kind}), shortest trace of {len(self.violation)} steps:"
            )
            lines += [f"  {i:2d}. {s}" for i, s in enumerate(self.violation, 1)]
        return "\n".join(lines)


class _Violation(Exception):
    def __init__(self, kind: str, step: Step) -> None:
        super().__init__(step.text)
        self.kind = kind
        self.step = step


class Protocol:
    """The actions of both roles and the network over `World`, under one set of fixes."""

    def __init__(self, scenario: Scenario, fixes: Fixes) -> None:
        self.sc = scenario
        self.fixes = fixes
        self.reqs = scenario.requests
        self.edges: set[tuple[State, State]] = set()

    # -- helpers -------------------------------------------------------------------------
    def initial(self) -> World:
        n = len(self.reqs)
        return World(
            pstate=(State.WAITING,) * n,
            dstate=(State.WAITING,) * n,
            stub=(False,) * n,
            ppages=((NONE, NONE),) * self.sc.prefill_pages,
            pfree=tuple(range(self.sc.prefill_pages - 1, -1, -1)),
            pblock=((),) * n,
            kvb=(None,) * n,
            dpages=((NONE, NONE),) * self.sc.decode_pages,
            dfree=tuple(range(self.sc.decode_pages - 1, -1, -1)),
            dblock=((),) * n,
            quarantine=(False,) * n,
            inflight=(),
            losses=self.sc.losses,
            duplicates=self.sc.duplicates,
        )

    def _move(self, states: tuple[State, ...], r: int, new: State) -> tuple[State, ...]:
        old = states[r]
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"model: {self.reqs[r].name}: no edge {old.value} -> {new.value}")
        self.edges.add((old, new))
        return _set(states, r, new)

    def _name(self, i: int) -> str:
        return self.reqs[i].name if i != NONE else "nobody"

    def _prompt(self, w: World, r: int) -> int:
        return 1 if w.stub[r] else self.reqs[r].pages

    @staticmethod
    def _reserve(
        pages: tuple[Page, ...], free: tuple[int, ...], r: int, n: int
    ) -> tuple[tuple[Page, ...], tuple[int, ...], tuple[int, ...]]:
        """Pop `n` pages off the LIFO free list for `r` (last writers kept: never zeroed)."""
        got = tuple(free[len(free) - 1 - i] for i in range(n))
        new = list(pages)
        for p in got:
            new[p] = (r, new[p][1])
        return tuple(new), free[: len(free) - n], got

    def _release(
        self, pages: tuple[Page, ...], free: tuple[int, ...], block: tuple[int, ...]
    ) -> tuple[tuple[Page, ...], tuple[int, ...]]:
        """Push `block` back (reversed, as the pool does); zero it only under `scrub-on-free`."""
        new = list(pages)
        for p in block:
            writer = NONE if self.fixes.scrub_on_free else new[p][1]  # fix `scrub-on-free`
            new[p] = (NONE, writer)
        return tuple(new), free + tuple(reversed(block))

    def _send(self, w: World, *msgs: Msg) -> tuple[Msg, ...]:
        return tuple(sorted(w.inflight + msgs, key=repr))

    def _decode_release(self, w: World, r: int) -> World:
        pages, free = self._release(w.dpages, w.dfree, w.dblock[r])
        return replace(w, dpages=pages, dfree=free, dblock=_set(w.dblock, r, ()))

    def _decode_abort(self, w: World, r: int, release: bool = True) -> World:
        """Decode fails `r`: pages back (unless quarantined), Abort to prefill."""
        if release:
            w = self._decode_release(w, r)
        return replace(
            w,
            dstate=self._move(w.dstate, r, State.FINISHED),
            inflight=self._send(w, ("abort", r, "decode")),
        )

    # -- the actions ---------------------------------------------------------------------
    def actions(self, w: World) -> Iterator[tuple[World, Step]]:
        """Every action enabled in `w`, with the state it leads to."""
        for r in range(len(self.reqs)):
            yield from self._prefill_actions(w, r)
            yield from self._decode_actions(w, r)
        for i, msg in enumerate(w.inflight):
            if i and msg == w.inflight[i - 1]:
                continue  # the same message twice: one delivery is enough to explore
            rest = w.inflight[:i] + w.inflight[i + 1 :]
            yield self._deliver(replace(w, inflight=rest), msg)
            if w.losses:
                yield (
                    replace(w, inflight=rest, losses=w.losses - 1),
                    Step("network", "lose", self._name(msg[1]), f"loses {self._describe(msg)}"),
                )
            if w.duplicates:
                again = self._deliver(replace(w, duplicates=w.duplicates - 1), msg)
                yield (
                    again[0],
                    replace(again[1], text=f"(duplicate, the original still in flight) {again[1].text}"),
                )

    def _prefill_actions(self, w: World, r: int) -> Iterator[tuple[World, Step]]:
        spec = self.reqs[r]
        st = w.pstate[r]
        if st is State.WAITING and w.dstate[r] is State.WAITING and not w.pblock[r]:
            # The router sends GenerateRequest to both roles (same bootstrap room).
            yield (
                replace(
                    w,
                    pstate=self._move(w.pstate, r, State.BOOTSTRAPPING),
                    dstate=self._move(w.dstate, r, State.BOOTSTRAPPING),
                ),
                Step(
                    "router", "arrive", spec.name, f"{spec.name} ({spec.tenant}, {spec.pages} pages) arrives"
                ),
            )
        elif st is State.BOOTSTRAPPING:
            yield self._bootstrap(w, r)
        elif st is State.WAITING and w.pstate[r] is State.WAITING and w.dstate[r] is not State.WAITING:
            n = self._prompt(w, r)
            if n <= len(w.pfree):
                pages, free, got = self._reserve(w.ppages, w.pfree, r, n)
                pages = tuple((o, r) if i in got else (o, wr) for i, (o, wr) in enumerate(pages))
                pstate = self._move(w.pstate, r, State.PREFILLING)
                pstate = self._move(pstate, r, State.TRANSFERRING)
                yield (
                    replace(w, pstate=pstate, ppages=pages, pfree=free, pblock=_set(w.pblock, r, got)),
                    Step(
                        "prefill",
                        "prefill",
                        spec.name,
                        f"prefills {spec.name}: reserves and writes {n} page(s) {list(got)}",
                    ),
                )
        elif st is State.TRANSFERRING and w.kvb[r] is not None:
            yield self._send_transfer(w, r)

    def _bootstrap(self, w: World, r: int) -> tuple[World, Step]:
        """Prefill's bootstrap queue: the capacity check, the stub, and the one question `_gone`."""
        spec = self.reqs[r]
        stub = spec.pages > self.sc.prefill_pages
        if stub and self.fixes.reject_before_transfer:
            # Fix `reject-before-transfer`: the rejected request leaves the queue, decode is told.
            return replace(
                w,
                pstate=self._move(w.pstate, r, State.FINISHED),
                inflight=self._send(w, ("abort", r, "prefill")),
            ), Step(
                "prefill",
                "reject",
                spec.name,
                f"{spec.name} too long ({spec.pages} pages > pool {self.sc.prefill_pages}) -> rejected "
                f"(400 context_length_exceeded), Abort to decode",
            )
        # Bug-compatible: `finished()` is blind to the pending 400, so the stub flows on.
        w = replace(
            w,
            stub=_set(w.stub, r, stub),
            pstate=self._move(w.pstate, r, State.WAITING),
            inflight=self._send(w, ("bootstrapped", r)),
        )
        if stub:
            text = (
                f"{spec.name} too long ({spec.pages} pages > pool {self.sc.prefill_pages}) -> "
                f"stub of 1 token "
                f"(pending 400), still queued; Bootstrapped to decode"
            )
            return w, Step("prefill", "stub", spec.name, text)
        return w, Step("prefill", "bootstrap", spec.name, f"admits {spec.name}; Bootstrapped to decode")

    def _send_transfer(self, w: World, r: int) -> tuple[World, Step]:
        spec = self.reqs[r]
        src = w.pblock[r]
        boot = w.kvb[r] or ()
        dst = boot[: len(src)]
        written = checksums = None
        if self.fixes.coverage_check:  # fix `coverage-check`: the logical KV coverage
            written = len(src)
        if self.fixes.kv_checksum:  # fix `kv-checksum`: one digest per page sent (content = writer)
            checksums = tuple(w.ppages[p][1] for p in src)
        pages, free = self._release(w.ppages, w.pfree, src)
        w = replace(
            w,
            pstate=self._move(w.pstate, r, State.FINISHED),  # the success path (over a pending 400)
            ppages=pages,
            pfree=free,
            pblock=_set(w.pblock, r, ()),
            kvb=_set(w.kvb, r, None),
            inflight=self._send(w, ("transfer", r, dst, written, checksums)),
        )
        extra = "" if written is None else f", written {written}"
        extra += "" if checksums is None else ", checksums"
        return w, Step(
            "prefill",
            "send",
            spec.name,
            f"sends {len(src)} page(s) of {spec.name} into decode pages {list(dst)} of {list(boot)}, "
            f"then done: Success{extra}; frees its prefill pages",
        )

    def _decode_actions(self, w: World, r: int) -> Iterator[tuple[World, Step]]:
        spec = self.reqs[r]
        st = w.dstate[r]
        if st is State.PREALLOC and spec.pages <= len(w.dfree):
            pages, free, got = self._reserve(w.dpages, w.dfree, r, spec.pages)
            stale = [f"{p}<-{self._name(w.dpages[p][1])}" for p in got if w.dpages[p][1] != NONE]
            yield (
                replace(
                    w,
                    dstate=self._move(w.dstate, r, State.TRANSFERRING),
                    dpages=pages,
                    dfree=free,
                    dblock=_set(w.dblock, r, got),
                    inflight=self._send(w, ("kv_bootstrap", r, got)),
                ),
                Step(
                    "decode",
                    "prealloc",
                    spec.name,
                    f"preallocates {spec.pages} pages {list(got)} for {spec.name}"
                    + (f" (last written by: {', '.join(stale)})" if stale else "")
                    + "; KVBootstrap to prefill",
                ),
            )
        elif st is State.TRANSFERRING and self.sc.timeouts:
            if self.fixes.deferred_release:
                # Fix `deferred-release`: fail now, keep the pages until prefill acknowledges.
                q = self._decode_abort(replace(w, quarantine=_set(w.quarantine, r, True)), r, release=False)
                yield (
                    q,
                    Step(
                        "decode",
                        "timeout",
                        spec.name,
                        f"transfer of {spec.name} times out -> aborted, "
                        f"pages {list(w.dblock[r])} quarantined",
                    ),
                )
            else:
                yield (
                    self._decode_abort(w, r),
                    Step(
                        "decode",
                        "timeout",
                        spec.name,
                        f"transfer of {spec.name} times out -> aborted, "
                        f"pages {list(w.dblock[r])} freed at once",
                    ),
                )
        elif st is State.DECODING:
            yield self._read(w, r)
        if w.quarantine[r]:
            yield (
                replace(self._decode_release(w, r), quarantine=_set(w.quarantine, r, False)),
                Step("decode", "expire", spec.name, f"quarantine of {spec.name} expires: pages freed"),
            )

    def _read(self, w: World, r: int) -> tuple[World, Step]:
        """Decode attends over every page it preallocated for the prompt, then finishes."""
        spec = self.reqs[r]
        block = w.dblock[r][: spec.pages]
        writers = [w.dpages[p][1] for p in block]
        if self.fixes.owner_check and any(x != r for x in writers):
            # Fix `owner-check`: the read finds pages this request never wrote: abort, nothing read.
            bad = [p for p, x in zip(block, writers) if x != r]
            return self._decode_abort(w, r), Step(
                "decode", "owner-check", spec.name, f"owner check stops {spec.name}: pages {bad} not its own"
            )
        foreign = [
            (p, x)
            for p, x in zip(block, writers)
            if x not in (NONE, r) and self.reqs[x].tenant != spec.tenant
        ]
        desc = ", ".join(f"{p}<-{self._name(x)}" for p, x in zip(block, writers))
        if foreign:
            text = f"{spec.name} decodes over pages [{desc}]: reads " + ", ".join(
                f"page {p} of {self.reqs[x].name} ({self.reqs[x].tenant})" for p, x in foreign
            )
            raise _Violation("stale-read", Step("decode", "read", spec.name, text))
        done = self._decode_release(w, r)
        return replace(done, dstate=self._move(done.dstate, r, State.FINISHED)), Step(
            "decode", "decode", spec.name, f"{spec.name} decodes over pages [{desc}], finishes, frees them"
        )

    # -- delivery ------------------------------------------------------------------------
    def _describe(self, msg: Msg) -> str:
        kind, r = msg[0], self._name(msg[1])
        if kind == "kv_bootstrap":
            return f"KVBootstrap({r}, pages {list(msg[2])})"
        if kind == "transfer":
            return f"transfer({r} -> pages {list(msg[2])}, done)"
        if kind == "abort":
            return f"Abort({r}, from {msg[2]})"
        return f"{'Bootstrapped' if kind == 'bootstrapped' else 'AbortAck'}({r})"

    def _deliver(self, w: World, msg: Msg) -> tuple[World, Step]:
        kind, r = msg[0], msg[1]
        name = self.reqs[r].name
        if kind == "bootstrapped":
            if w.dstate[r] is State.BOOTSTRAPPING:
                return replace(w, dstate=self._move(w.dstate, r, State.PREALLOC)), Step(
                    "decode", "bootstrapped", name, f"Bootstrapped({name}) -> prealloc queue"
                )
            return w, Step("decode", "ignore", name, f"ignores Bootstrapped({name})")
        if kind == "kv_bootstrap":
            if w.pstate[r] is State.FINISHED:
                return w, Step("prefill", "ignore", name, f"ignores KVBootstrap({name}): request gone")
            return replace(w, kvb=_set(w.kvb, r, msg[2])), Step(
                "prefill", "kv_bootstrap", name, f"receives KVBootstrap({name}, decode pages {list(msg[2])})"
            )
        if kind == "abort":
            return self._deliver_abort(w, r, msg[2])
        if kind == "abort_ack":
            if w.quarantine[r]:
                w = replace(self._decode_release(w, r), quarantine=_set(w.quarantine, r, False))
                return w, Step("decode", "abort_ack", name, f"AbortAck({name}) -> quarantined pages freed")
            return w, Step("decode", "ignore", name, f"ignores AbortAck({name})")
        return self._deliver_transfer(w, msg)

    def _deliver_abort(self, w: World, r: int, source: str) -> tuple[World, Step]:
        name = self.reqs[r].name
        if source == "prefill":  # to decode
            if w.dstate[r] in (State.FINISHED, State.WAITING):
                return w, Step("decode", "ignore", name, f"ignores Abort({name})")
            w = self._decode_release(w, r)
            return replace(w, dstate=self._move(w.dstate, r, State.FINISHED)), Step(
                "decode", "abort", name, f"Abort({name}) from prefill -> finished, pages freed"
            )
        # to prefill
        acted = "nothing to cancel"
        if w.pstate[r] is not State.FINISHED:
            pages, free = self._release(w.ppages, w.pfree, w.pblock[r])
            w = replace(
                w,
                pstate=self._move(w.pstate, r, State.FINISHED),
                ppages=pages,
                pfree=free,
                pblock=_set(w.pblock, r, ()),
                kvb=_set(w.kvb, r, None),
            )
            acted = "aborted, prefill pages freed"
        if self.fixes.deferred_release:
            # Fix `deferred-release`: tell decode, behind every earlier message, nothing more comes.
            w = replace(w, inflight=self._send(w, ("abort_ack", r)))
            acted += "; AbortAck to decode"
        return w, Step("prefill", "abort", name, f"Abort({name}) from decode: {acted}")

    def _deliver_transfer(self, w: World, msg: Msg) -> tuple[World, Step]:
        _, r, dst, written, checksums = msg
        spec = self.reqs[r]
        holds = w.dstate[r] is State.TRANSFERRING or w.quarantine[r]
        notes: list[str] = []
        if self.fixes.deferred_release and not holds:
            # Fix `deferred-release`: data for a room that holds no pages here is dropped.
            notes.append("page data dropped (room holds no pages)")
        else:
            pages = list(w.dpages)
            owners = [self._name(pages[p][0]) for p in dst]
            for p in dst:
                pages[p] = (pages[p][0], r)
            w = replace(w, dpages=tuple(pages))
            notes.append(f"writes pages {list(dst)} (owned by {', '.join(owners)})")
        if w.dstate[r] is not State.TRANSFERRING:
            notes.append("done ignored (no such transfer)")
            return w, Step("decode", "late", spec.name, f"late transfer of {spec.name}: {'; '.join(notes)}")
        if self.fixes.coverage_check and written != spec.pages:
            # Fix `coverage-check`: prefill wrote fewer tokens of KV than decode preallocated.
            notes.append(f"coverage {written} != {spec.pages} preallocated -> aborted")
            return self._decode_abort(w, r), Step(
                "decode", "coverage", spec.name, f"{spec.name}: {'; '.join(notes)}"
            )
        if self.fixes.kv_checksum:
            block = w.dblock[r][: spec.pages]
            sent = checksums or ()
            bad = [p for i, p in enumerate(block) if i >= len(sent) or sent[i] != w.dpages[p][1]]
            if bad:
                notes.append(f"checksum mismatch on pages {bad} -> aborted")
                return self._decode_abort(w, r), Step(
                    "decode", "checksum", spec.name, f"{spec.name}: {'; '.join(notes)}"
                )
        notes.append(f"done: Success -> commits all {spec.pages} preallocated pages, decoding")
        return replace(w, dstate=self._move(w.dstate, r, State.DECODING)), Step(
            "decode", "commit", spec.name, f"transfer of {spec.name}: {'; '.join(notes)}"
        )

    # -- the invariant on states ---------------------------------------------------------
    def double_owner(self, w: World) -> str | None:
        """No page held by two requests, and the owner table agrees with the block tables."""
        for role, pages, free, blocks in (
            ("prefill", w.ppages, w.pfree, w.pblock),
            ("decode", w.dpages, w.dfree, w.dblock),
        ):
            held: dict[int, int] = {}
            for r, block in enumerate(blocks):
                for p in block:
                    if p in held or p in free:
                        return f"{role} page {p} held by {self._name(held.get(p, NONE))} and {self._name(r)}"
                    if pages[p][0] != r:
                        owner = self._name(pages[p][0])
                        return f"{role} page {p} in {self._name(r)}'s table, owner table says {owner}"
                    held[p] = r
            if len(held) + len(free) != len(pages):
                return f"{role}: {len(free)} free + {len(held)} held != {len(pages)} pages"
        return None


def _set(t: tuple, i: int, value: object) -> tuple:
    return (*t[:i], value, *t[i + 1 :])


def check_protocol(scenario: Scenario = INCIDENT, fixes: Fixes | None = None) -> ModelCheckResult:
    """Explore every reachable state of `scenario` under `fixes` breadth-first; return the verdict.

    The first violation found is on a shortest trace from the initial state.
    """
    fixes = Fixes.none() if fixes is None else fixes
    model = Protocol(scenario, fixes)
    result = ModelCheckResult(scenario.name, str(fixes), 0, 0, None, edges=model.edges)
    if fixes.capacity_check and min(scenario.prefill_pages, scenario.decode_pages) < scenario.context_pages:
        result.refused_to_start = True  # fix `capacity-check`: nothing runs, nothing leaks
        return result
    start = model.initial()
    parent: dict[World, tuple[World, Step] | None] = {start: None}
    frontier: deque[World] = deque([start])

    def trace(w: World, last: Step, after: World) -> tuple[list[Step], list[World]]:
        steps, worlds = [last], [after]
        while (entry := parent[w]) is not None:
            worlds.append(w)
            w, step = entry
            steps.append(step)
        return steps[::-1], worlds[::-1]

    try:
        while frontier:
            w = frontier.popleft()
            try:
                for nxt, step in model.actions(w):
                    result.transitions += 1
                    if nxt in parent:
                        continue
                    broken = model.double_owner(nxt)
                    if broken is not None:
                        bad = Step("model", "invariant", step.request, broken)
                        steps, worlds = trace(w, step, nxt)
                        result.violation, result.violation_kind = [*steps, bad], "double-owner"
                        result.violation_states = [*worlds, nxt]
                        return result
                    if len(parent) >= scenario.max_states:  # a new state past the bound: no verdict
                        result.complete = False
                        return result
                    parent[nxt] = (w, step)
                    frontier.append(nxt)
            except _Violation as v:
                result.violation, result.violation_states = trace(w, v.step, w)  # a read moves no page
                result.violation_kind = v.kind
                return result
        return result
    finally:
        result.states_explored = len(parent)  # however the search ended
        if result.safe and not (
            fixes.reject_before_transfer
            or fixes.coverage_check
            or fixes.kv_checksum
            or fixes.scrub_on_free
            or fixes.owner_check
        ):
            result.stubbed_unguarded = tuple(
                r.name for r in scenario.requests if r.pages > scenario.prefill_pages
            )


SINGLE_FIXES: tuple[str, ...] = (
    "capacity-check",
    "reject-before-transfer",
    "coverage-check",
    "kv-checksum",
    "scrub-on-free",
    "owner-check",
    "deferred-release",
)


def fix_settings() -> dict[str, Fixes]:
    """none, each single fix, and all: the rows of a fix table."""
    settings = {"none": Fixes.none(), **{n: Fixes(**{n.replace("-", "_"): True}) for n in SINGLE_FIXES}}
    settings["all"] = Fixes.all()
    # capacity-check refuses a pool shorter than the context: the rest still has to hold on its own
    settings["all-but-capacity-check"] = replace(Fixes.all(), capacity_check=False)
    return settings


def fix_table(scenario: Scenario = INCIDENT) -> dict[str, ModelCheckResult]:
    """none, each single fix, and all, on one scenario."""
    return {name: check_protocol(scenario, f) for name, f in fix_settings().items()}


def describe(sc: Scenario) -> str:
    """The bounds of a scenario in one line."""
    reqs = ", ".join(f"{r.name} {r.pages}p" for r in sc.requests)
    extras = [x for x, on in (("timeouts", sc.timeouts),) if on]
    extras += [f"{n} {what}" for what, n in (("loss(es)", sc.losses), ("duplicate(s)", sc.duplicates)) if n]
    return (
        f"{sc.name}: {reqs}; prefill pool {sc.prefill_pages}p, decode pool {sc.decode_pages}p, "
        f"context {sc.context_pages}p" + (f"; {', '.join(extras)}" if extras else "")
    )


def format_table(sc: Scenario, rows: list[tuple[str, ModelCheckResult]]) -> str:
    """A fix table as text: setting, verdict, states explored."""
    width = max(len(name) for name, _ in rows)
    lines = [describe(sc), f"  {'fixes':<{width}}  {'states':>8}  verdict"]
    lines += [f"  {name:<{width}}  {r.states_explored:>8,}  {r.verdict}" for name, r in rows]
    return "\n".join(lines)
