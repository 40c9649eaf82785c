"""The fault campaign: inject each fault into a live engine and check that the engine survives it.

    minigrid faults                          # every fault and control, a table; exit 0 when all hold
    minigrid faults --only drop-done,kill-decode --json --out bench/results/faults.json

For each case an engine starts (small pools, fast on a CPU) with the fault aimed at one tenant
(``NAME@carol``). alice, the victim, sends requests with canary records before and during the
fault; carol's request is the one the fault hits. A fault is *survived* when

1. carol's request fails with a clear error (an HTTP status, an error code and a message), or is
   served its own answer where the protocol shows the fault was harmless (a duplicate done
   message after the commit, a transfer overtaken by the next one);
2. no reply holds another tenant's codes, and the decode trace shows no page data written into a
   page another request held, and no read of a page another tenant wrote;
3. every page comes back (`minigrid_kv_pages_in_use` of both roles is 0 once idle) and
   `/v1/minigrid/integrity` is ok;
4. `/health` answers 200 "ok" (after a killed worker: within `restart_wait_s`, which needs the
   router to restart it), and a next request of alice and of carol is served 200.

`kill-prefill-during-transfer` holds a transfer with ``delay-transfer=3@dave`` and kills prefill
meanwhile: dave is the target there because a restarted prefill reads the same configuration and
would hold carol's next transfer too.

Controls run a fault with `--fixes none`, where the campaign must see the harm (another tenant's
data written or read): proof that the checks can fail. The campaign starts its own engines on
loopback and never touches a running one, so it needs no ``MINIGRID_FAULT_INJECTION`` of its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from minigrid_engine.config import ServeConfig, corrected_preset
from minigrid_engine.errors import ConfigError
from minigrid_engine.faults import parse_fault
from minigrid_engine.forensics import reads_by_request
from minigrid_engine.handle import Engine, Reply
from minigrid_engine.records import record_prompt
from minigrid_engine.scenario import codes_in, record_codes

VICTIM, TARGET = "alice", "carol"
BYSTANDER = "dave"  # a kill case's target: a restarted worker re-arms its injection (its config)


@dataclass(frozen=True)
class FaultCase:
    """One row of the campaign."""

    name: str
    inject: str = ""  # a faults.py spec, aimed at `target`; "" for the kills
    target: str = TARGET  # the tenant whose request the fault hits
    fixes: str = "all"
    control: bool = False  # run with the fixes off: the checks must see the harm
    concurrent: bool = False  # alice's request starts while carol's is in flight
    kill: str | None = None  # "prefill" or "decode": os.kill that worker during carol's request
    may_serve: bool = False  # carol may be served her own answer (the fault is harmless)
    what: str = ""


CASES: tuple[FaultCase, ...] = (
    FaultCase("delay-transfer", "delay-transfer=1.6", what="a transfer slower than the release timeout"),
    FaultCase("delay-done", "delay-done=1.6", what="a done message slower than the release timeout"),
    FaultCase("drop-transfer", "drop-transfer", what="the page data is never sent"),
    FaultCase("drop-done", "drop-done", what="the done message is never sent"),
    FaultCase("duplicate-transfer", "duplicate-transfer", what="the page data arrives twice"),
    FaultCase("duplicate-done", "duplicate-done", may_serve=True, what="the done message arrives twice"),
    FaultCase(
        "reorder-transfer",
        "reorder-transfer",
        concurrent=True,
        may_serve=True,
        what="the transfer is overtaken by the next one",
    ),
    FaultCase("reorder-done", "reorder-done", what="the done message overtakes its page data"),
    FaultCase("prefill-error", "prefill-error", what="prefill raises while computing the request"),
    FaultCase(
        "kill-prefill-during-transfer",
        "delay-transfer=3",
        kill="prefill",
        target=BYSTANDER,
        what="the prefill worker is killed while dave's transfer is held",
    ),
    FaultCase("kill-decode", kill="decode", what="the decode worker is killed while carol decodes"),
    FaultCase(
        "control:delay-transfer",
        "delay-transfer=1.2",  # 0.2 s past the timeout: inside alice's next request (0.25-0.5 s of decode)
        fixes="none",
        control=True,
        what="fixes none: the late transfer lands in pages alice was given",
    ),
    FaultCase(
        "control:drop-transfer",
        "drop-transfer",
        fixes="none",
        control=True,
        what="fixes none: decode commits without the data and reads stale pages",
    ),
    FaultCase(
        "control:reorder-done",
        "reorder-done",
        fixes="none",
        control=True,
        what="fixes none: decode commits before the data and reads stale pages",
    ),
)
NAMES = tuple(c.name for c in CASES)


def campaign_config(**changes: Any) -> ServeConfig:
    """Small pools, a short release timeout: a case takes seconds on two CPU cores."""
    base: dict[str, Any] = {
        "context_length": 256,
        "page_size": 32,
        "prefill_pool_tokens": 512,
        "decode_pool_tokens": 1024,
        "release_timeout_s": 1.0,
        "tenants": {VICTIM: "sk-alice", TARGET: "sk-carol", BYSTANDER: "sk-dave"},
    }
    return corrected_preset(**{**base, **changes})


@dataclass
class Outcome:
    """What the campaign saw for one case (the table's row, the JSON's object)."""

    name: str
    control: bool
    what: str
    affected: str = "-"  # carol's request: "504 kv_transfer_timeout", or "200"
    message: str = ""  # the error message carol's client got
    clear_error: bool = False  # failed with status, code and message, or served as allowed
    foreign_data: list[str] = field(default_factory=list)  # what leaked, in words
    pages_back: bool = False
    integrity: bool = False
    health: str = "-"
    served_again: bool = False
    note: str = ""

    @property
    def survived(self) -> bool:
        return (
            self.clear_error
            and not self.foreign_data
            and self.pages_back
            and self.integrity
            and self.health == "ok"
            and self.served_again
        )

    @property
    def as_expected(self) -> bool:
        """A fault must be survived; a control must show its harm."""
        return bool(self.foreign_data) if self.control else self.survived

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "survived": self.survived, "as_expected": self.as_expected}


class _Tenants:
    """Prompts with canary records, and every code each tenant has planted so far."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.codes: dict[str, set[str]] = {VICTIM: set(), TARGET: set(), BYSTANDER: set()}

    def prompt(self, tenant: str, n_tokens: int) -> str:
        text = record_prompt(tenant, n_tokens, self.rng, 6)
        self.codes[tenant] |= record_codes(text, tenant)
        return text

    def foreign(self, tenant: str, reply: Reply) -> set[str]:
        others = set().union(*(c for t, c in self.codes.items() if t != tenant))
        return codes_in(reply.text) & others if reply.ok else set()


def _describe(reply: Reply) -> str:
    if reply.ok:
        return "200"
    return f"{reply.status} {(reply.error or {}).get('code', '?')}"


def _clear_error(reply: Reply) -> bool:
    err = reply.error or {}
    return reply.status >= 400 and bool(err.get("code")) and bool(err.get("message"))


def _foreign_trace(events: list[dict[str, Any]]) -> list[str]:
    """Page data written into a page another request held; pages read that another tenant wrote."""
    found = []
    for e in events:
        if e["kind"] == "write" and e["detail"].get("source") == "transfer":
            owners = [o for o in e["detail"].get("owners", []) if o is not None and o != e["request"]]
            if owners:
                found.append(
                    f"{e['request']}'s page data written into pages held by {', '.join(sorted(set(owners)))}"
                )
    for request, rows in reads_by_request(events).items():
        tenant = request.rpartition("-")[0]
        other = {r["last_writer_tenant"] for r in rows} - {None, tenant}
        if other:
            found.append(f"{request} read pages last written by {', '.join(sorted(other))}")
    return found


def _wait_idle(eng: Engine, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        m = eng.metrics()
        if all(m.get(f'minigrid_kv_pages_in_use{{role="{r}"}}', 1) == 0 for r in ("prefill", "decode")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _wait_health(eng: Engine, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            code, body = eng.health()
            status = str(body.get("status", code))
        except Exception as exc:  # the router itself gone: say so
            status = f"unreachable ({type(exc).__name__})"
        if status == "ok" or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def _wait_unhealthy(eng: Engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if eng.health()[1].get("status") != "ok":
                return
        except Exception:
            return
        time.sleep(0.05)


def _integrity(eng: Engine) -> bool:
    r = eng.http.get("/v1/minigrid/integrity", headers={"Authorization": f"Bearer {eng.admin_key}"})
    return r.status_code == 200 and bool(r.json().get("ok"))


def run_case(case: FaultCase, restart_wait_s: float = 60.0, seed: int = 0) -> Outcome:
    """Start an engine with `case`'s fault aimed at carol, run the requests, check, stop it."""
    out = Outcome(case.name, case.control, case.what)
    inject = (f"{case.inject}@{case.target}",) if case.inject else ()
    cfg = campaign_config(inject=inject)
    ctx = cfg.context_length
    tenants = _Tenants(seed)
    with Engine.start(cfg, fixes=case.fixes) as eng:
        replies: list[tuple[str, Reply]] = []

        def send(tenant: str, n_tokens: int, max_tokens: int) -> Reply:
            reply = eng.complete(tenant, tenants.prompt(tenant, n_tokens), max_tokens=max_tokens)
            replies.append((tenant, reply))
            return reply

        # Before: alice's pages fill with her records, then go back to the pool (not zeroed).
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda n: send(VICTIM, n, 8), (96, 128)))
        # The fault: carol's request; alice's comes with it or right after (decoding long).
        target_len, victim_len = 160, 96
        victim_budget = ctx - victim_len - 8
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            if case.kill == "decode":  # a long decode, so that she is decoding when it dies
                target = pool.submit(send, case.target, 64, ctx - 64 - 8)
            else:
                target = pool.submit(send, case.target, target_len, 8)
            if case.kill == "decode":  # kill as soon as she decodes (a quiet machine ends it in 0.5 s)
                _wait_decoding(eng, case.target, 10.0)
            elif case.kill is not None:
                time.sleep(0.5)  # carol's transfer is held by prefill
            if case.kill is not None:
                os.kill(eng.worker_pids()[case.kill], signal.SIGKILL)
                affected = target.result()
                _wait_unhealthy(eng, 10.0)  # the router has seen the death before we ask again
            elif case.concurrent:
                time.sleep(0.1)
                pool.submit(send, VICTIM, victim_len, victim_budget).result()
                affected = target.result()
            else:
                affected = target.result()
                # alice decodes, request after request, until whatever the fault held has landed
                until = started + (parse_fault(case.inject).seconds if case.inject else 0) + 1.0
                while True:
                    send(VICTIM, victim_len, victim_budget)
                    if time.monotonic() > until:
                        break
        out.affected = _describe(affected)
        out.message = str((affected.error or {}).get("message", ""))
        out.clear_error = _clear_error(affected) or (
            case.may_serve and affected.ok and not tenants.foreign(case.target, affected)
        )
        # After: the engine comes back (or says it cannot), every page comes back.
        out.health = _wait_health(eng, restart_wait_s if case.kill else 5.0)
        if out.health != "ok":
            out.note = "not survived: engine did not come back" if case.kill else "not healthy"
        else:
            out.pages_back = _wait_idle(eng, 2 * cfg.release_timeout_s + 5)
            out.integrity = _integrity(eng)
            again = [send(VICTIM, 64, 8), send(TARGET, 64, 8)]
            out.served_again = all(r.ok for r in again)
            if not out.served_again:
                out.note = "not served again: " + "; ".join(
                    f"{_describe(r)} {(r.error or {}).get('message', '')}" for r in again if not r.ok
                )
        for tenant, reply in replies:
            leaked = tenants.foreign(tenant, reply)
            if leaked:
                out.foreign_data.append(f"{tenant}'s reply holds {', '.join(sorted(leaked))}")
        if out.health == "ok" or case.kill is None:
            try:
                out.foreign_data += _foreign_trace(eng.trace()["decode"])
            except Exception as exc:
                out.note = (out.note + "; " if out.note else "") + f"no trace: {exc}"
    return out


def _wait_decoding(eng: Engine, tenant: str, timeout_s: float) -> None:
    """Until the decode trace shows `tenant`'s request entering the decoding state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in eng.trace()["decode"]:
            if e["kind"] == "state" and e["tenant"] == tenant and e["detail"].get("to") == "decoding":
                return
        time.sleep(0.01)


@dataclass
class CampaignReport:
    outcomes: list[Outcome]
    wall_s: float = 0.0  # the whole campaign, engines' starts included

    @property
    def faults(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.control]

    @property
    def survived(self) -> int:
        return sum(o.survived for o in self.faults)

    @property
    def ok(self) -> bool:
        return all(o.as_expected for o in self.outcomes)

    def summary(self) -> str:
        controls = [o for o in self.outcomes if o.control]
        line = f"faults survived: {self.survived} of {len(self.faults)}"
        if controls:
            harm = sum(bool(o.foreign_data) for o in controls)
            line += f"; controls (fixes none) showing the harm: {harm} of {len(controls)}"
        return line

    def table(self) -> str:
        head = (
            "fault",
            "affected request",
            "foreign data",
            "pages back",
            "health",
            "served again",
            "survived",
        )
        rows = [head]
        for o in self.outcomes:
            if o.control:
                verdict = "harm shown (control)" if o.foreign_data else "NO HARM SEEN (control)"
            else:
                verdict = "yes" if o.survived else f"no{': ' + o.note if o.note else ''}"
            rows.append(
                (
                    o.name,
                    o.affected,
                    "yes" if o.foreign_data else "none",
                    "yes" if o.pages_back and o.integrity else "no",
                    o.health,
                    "yes" if o.served_again else "no",
                    verdict,
                )
            )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        details = [f"  {o.name}: {d}" for o in self.outcomes for d in o.foreign_data[:3]]
        return "\n".join([*lines, "", self.summary(), *(["foreign data seen:", *details] if details else [])])

    def to_json(self) -> str:
        return json.dumps(
            {
                "summary": self.summary(),
                "survived": self.survived,
                "faults": len(self.faults),
                "ok": self.ok,
                "wall_s": round(self.wall_s, 1),
                "cases": [o.to_dict() for o in self.outcomes],
            },
            indent=2,
        )


def select(only: str | None) -> list[FaultCase]:
    """The cases named in `only` (comma-separated), or all; unknown names are a `ConfigError`."""
    if only is None:
        return list(CASES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--only {only!r} names no case; choose from {', '.join(NAMES)}")
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ConfigError(
            f"--only {only!r}: unknown case {', '.join(unknown)}; choose from {', '.join(NAMES)}"
        )
    return [c for c in CASES if c.name in names]


def run_campaign(
    cases: list[FaultCase],
    progress: bool = True,
    restart_wait_s: float = 60.0,
    on_case: Callable[[Outcome], None] | None = None,
) -> CampaignReport:
    """Run every case, one engine each, with a progress bar."""
    from tqdm import tqdm

    outcomes = []
    started = time.monotonic()
    bar = tqdm(cases, desc="faults", unit="fault", disable=not progress)
    for case in bar:
        bar.set_postfix_str(case.name)
        outcome = run_case(case, restart_wait_s)
        outcomes.append(outcome)
        if on_case is not None:
            on_case(outcome)
    bar.close()
    return CampaignReport(outcomes, time.monotonic() - started)
