"""`minigrid probe --url URL --tenants A:KEY,B:KEY`: the canary test, from outside, against any
OpenAI-compatible deployment (a minigrid engine, SGLang, vLLM, a gateway in front of them).

It is the content test INCIDENT.md says the launch lacked, run the way Cloudflare verified its fix:
two or more accounts take turns sending prompts made of their own canaries (`canary.py`), at
lengths spread up to the context, and every answer is searched for another account's canaries. An
answer holding one was built from another customer's KV pages; so was one holding 6 characters in a
row of one (an answer that stops, or a stale page that starts, inside a record cuts its code short).
A 400 for an over-long prompt is the correct answer and counts as such; a 200 is only as good as its
content.

Nothing here reads the engine's internals: only `/v1/models` (the model and its `max_model_len`)
and the completions the accounts get. Prompt lengths are set in the server's own tokens: two
calibration prompts measure its characters per token and its template's overhead from `usage`.

Answers are streamed, so each has its time to first token: the incident's one visible symptom was
an answer faster than a real prefill allows. A prefill takes longer the longer the prompt, so a
prompt at least twice the shortest length whose first token came in under half the shortest
prompts' median time was not prefilled whole: it is flagged too fast, and fails the probe too
(every unique prompt here starts with a fresh canary, so no prefix cache explains it).

`concurrency` above 1 keeps that many prompts in flight at once, as a busy deployment runs them:
pages are then freed and reused while other requests are being prefilled, transferred and decoded,
which is where a late transfer or a release race shows; and a long probe of a slow deployment
finishes sooner. Queueing then sets the times to first token, so that run gives no timing verdict.

Exit status: 0 no answer held another account's canaries, 1 one did, 2 the probe could not run
(or no prompt got an answer, which tests nothing).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm  # a widget bar in a notebook, text in a terminal

from minigrid_engine.canary import CanaryHarness
from minigrid_engine.errors import MinigridError, error_message

DEFAULT_FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0)  # of the room a prompt has below the context
TOO_FAST = 0.5  # a first token under this share of the shortest prompts' median time
FRAGMENT = 6  # characters in a row of another account's canary that count as a leak
SHORT_ANSWER = 24  # max_tokens below this: fewer characters than one record holds ("NAME pin CODE; ")
SHOWN = 5  # leaks (and answers too fast) listed one by one


@dataclass(frozen=True)
class ProbeConfig:
    url: str  # the deployment's base URL, with or without /v1
    tenants: dict[str, str]  # account name -> API key; two at least
    model: str | None = None  # None: the first model /v1/models lists
    prompt_tokens: tuple[int, ...] = ()  # () : spread over the context
    context_length: int | None = None  # None: /v1/models' max_model_len
    rounds: int = 3  # each round, every account sends one prompt of every length
    max_tokens: int = 48
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    seed: int = 0
    timeout_s: float = 600.0  # per request: a full-context prefill on a real deployment is slow
    concurrency: int = 1  # prompts in flight at once (above 1: no timing verdict)

    def __post_init__(self) -> None:
        if len(self.tenants) < 2:
            raise MinigridError(
                f"--tenants names {len(self.tenants)} account(s): a leak is one account's data in "
                "another's answer, so give two at least (NAME:KEY,NAME:KEY)"
            )
        if len(set(self.tenants.values())) < len(self.tenants):
            raise MinigridError("--tenants: two accounts share one key; give each its own")
        if self.rounds < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise MinigridError(
                f"rounds {self.rounds}, max_tokens {self.max_tokens} and concurrency {self.concurrency} "
                "must each be at least 1"
            )


@dataclass
class ProbeShot:
    """One prompt an account sent, and what it got back."""

    round: int
    tenant: str
    target_tokens: int
    prompt_chars: int
    status: int | None = None  # None: no answer (the connection failed)
    code: str | None = None  # the error body's code, for a 4xx or 5xx
    prompt_tokens: int | None = None  # usage.prompt_tokens, as the server counted
    seconds: float = 0.0  # the whole answer
    ttft_s: float | None = None  # the first token (None: the server did not stream)
    too_fast: bool = False
    foreign: dict[str, list[str]] = field(default_factory=dict)  # owner -> its canaries in the answer
    partial: list[str] = field(default_factory=list)  # of those, the ones only part of which is there
    answer: str = ""

    @property
    def leaked(self) -> bool:
        return bool(self.foreign)


@dataclass
class ProbeReport:
    url: str
    model: str
    context_length: int | None
    chars_per_token: float
    overhead_tokens: float
    shots: list[ProbeShot] = field(default_factory=list)
    concurrency: int = 1  # prompts in flight at once
    max_tokens: int = 48  # each answer's length

    @property
    def leaks(self) -> list[ProbeShot]:
        return [s for s in self.shots if s.leaked]

    @property
    def answered(self) -> int:
        return sum(s.status == 200 for s in self.shots)

    @property
    def too_fast(self) -> list[ProbeShot]:
        return [s for s in self.shots if s.too_fast]

    @property
    def ok(self) -> bool:
        return not self.leaks and not self.too_fast

    def judge_timing(self) -> float | None:
        """Flag the answers too fast for their prompt; the shortest prompts' median TTFT, or None
        when too few of them streamed to judge by, or when prompts ran at once (queueing, not
        prefill, then sets the time to first token)."""
        if self.concurrency > 1:
            return None
        shortest = min((s.target_tokens for s in self.shots), default=0)
        base = sorted(
            s.ttft_s for s in self.shots if s.target_tokens == shortest and s.ttft_s and s.status == 200
        )
        if len(base) < 2:
            return None
        median = base[len(base) // 2]
        for s in self.shots:
            s.too_fast = (
                s.status == 200
                and s.ttft_s is not None
                and s.target_tokens >= 2 * shortest
                and s.ttft_s < TOO_FAST * median
            )
        return median

    def by_length(self) -> list[tuple[int, Counter[str]]]:
        rows: dict[int, Counter[str]] = {}
        for s in self.shots:
            c = rows.setdefault(s.target_tokens, Counter())
            c["sent"] += 1
            c["200"] += s.status == 200
            c["4xx"] += s.status is not None and 400 <= s.status < 500
            c["5xx / none"] += s.status is None or s.status >= 500
            c["leaked"] += s.leaked
            c["too fast"] += s.too_fast
        return sorted(rows.items())

    def text(self) -> str:
        lines = [
            f"minigrid probe {self.url}: model {self.model!r}, context "
            f"{self.context_length if self.context_length else 'not stated'}, "
            f"{len({s.tenant for s in self.shots})} accounts, {self.chars_per_token:.2f} characters a token"
            + (
                f", {self.concurrency} prompts in flight at once (no timing verdict)"
                if self.concurrency > 1
                else ""
            ),
            f"  {'prompt tokens':>13}  {'sent':>5}  {'200':>5}  {'4xx':>5}  {'5xx/none':>8}  {'leaked':>6}"
            f"  {'too fast':>8}  {'median TTFT':>11}",
        ]
        for target, c in self.by_length():
            ttfts = sorted(s.ttft_s for s in self.shots if s.target_tokens == target and s.ttft_s)
            median = f"{ttfts[len(ttfts) // 2] * 1000:.0f} ms" if ttfts else "-"
            lines.append(
                f"  {target:>13,}  {c['sent']:>5}  {c['200']:>5}  {c['4xx']:>5}  {c['5xx / none']:>8}"
                f"  {c['leaked']:>6}  {c['too fast']:>8}  {median:>11}"
            )
        for s in self.leaks[:SHOWN]:
            owners = "; ".join(
                f"{o}'s " + ", ".join(f"{c} (in part)" if c in s.partial else c for c in m)
                for o, m in s.foreign.items()
            )
            counted = f"{s.prompt_tokens:,}" if s.prompt_tokens is not None else "?"
            lines.append(
                f"  leak: round {s.round}, {s.tenant}'s {counted}-token prompt got HTTP {s.status} "
                f"with {owners}: {s.answer[:60]!r}"
            )
        lines += _more(self.leaks, "leaks")
        quick = [s for s in self.too_fast if not s.leaked]
        for s in quick[:SHOWN]:
            lines.append(
                f"  too fast: round {s.round}, {s.tenant}'s {s.target_tokens:,}-token prompt had its first "
                f"token after {(s.ttft_s or 0) * 1000:.0f} ms"
            )
        lines += _more(quick, "answers too fast")
        if self.max_tokens < SHORT_ANSWER:
            lines.append(
                f"  note: answers of {self.max_tokens} tokens are shorter than one record of a prompt: "
                f"a leak then shows as a fragment ({FRAGMENT} characters of a canary at least) or not "
                f"at all; --max-tokens 48 (the default) gives it room"
            )
        if not self.answered:
            lines.append("NOTHING TESTED: no prompt got an answer (HTTP 200)")
        elif self.ok:
            lines.append(
                f"PASS: none of {self.answered} answers held another account's canaries or came "
                "faster than its prompt could be prefilled"
            )
        else:
            faults = []
            if self.leaks:
                faults.append(
                    f"{len(self.leaks)} answer{'s' * (len(self.leaks) != 1)} held another account's "
                    "canaries: they were built from "
                    "other customers' KV pages"
                )
            if quick:
                faults.append(
                    f"{len(quick)} more came faster than a real prefill of their prompt allows "
                    f"(first token under {TOO_FAST:.0%} of the shortest prompts' median)"
                )
            lines.append("FAIL: " + "; ".join(faults))
        return "\n".join(lines)

    def to_json(self) -> str:
        extra = {
            "ok": self.ok,
            "answered": self.answered,
            "leaked_answers": len(self.leaks),
            "too_fast_answers": len(self.too_fast),
        }
        return json.dumps({**asdict(self), **extra}, indent=2)


def _said(r: httpx.Response) -> str:
    """What a non-answer said: its OpenAI error message, or the start of its body."""
    message = error_message(r.text)
    if message is not None:
        return f"its error: {message[:300]}"
    body = " ".join(r.text.split())[:120]
    return f"{r.headers.get('content-type', 'no content type')}: {body!r}" if body else "an empty body"


def _more(shots: list[ProbeShot], what: str) -> list[str]:
    return (
        [f"  ... and {len(shots) - SHOWN} more {what} (--json lists every answer)"]
        if len(shots) > SHOWN
        else []
    )


def _v1(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class Probe:
    """The accounts' client: discovery, calibration, then the rounds."""

    def __init__(self, cfg: ProbeConfig, client: httpx.Client) -> None:
        self.cfg, self.client = cfg, client
        self.base = _v1(cfg.url)
        self.harness = CanaryHarness(cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.stated_context: int | None = None  # /v1/models' max_model_len, read by discover()

    def _request(self, method: str, path: str, tenant: str, **kw: Any) -> httpx.Response:
        target = self.base + path
        headers = {"Authorization": f"Bearer {self.cfg.tenants[tenant]}"}
        try:
            return self.client.request(method, target, headers=headers, **kw)
        except httpx.InvalidURL as exc:
            raise MinigridError(f"{self.cfg.url!r} is not a URL the probe can read: {exc}") from None
        except httpx.HTTPError as exc:
            raise MinigridError(f"cannot reach {target}: {exc}") from None

    def discover(self) -> tuple[str, int | None]:
        """The model to ask and the context it advertises (the flags win over /v1/models)."""
        for tenant in reversed(self.cfg.tenants):  # every key is tried; the first account's answer is read
            r = self._request("GET", "/models", tenant)
            if r.status_code in (401, 403):
                raise MinigridError(f"{self.base}/models answered HTTP {r.status_code} to {tenant}'s key")
        cards: list[dict[str, Any]] = []
        if r.status_code == 200:
            try:
                data = r.json().get("data")
            except (ValueError, AttributeError):
                data = None
            cards = [c for c in data or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        model = self.cfg.model or (cards[0]["id"] if cards else None)
        if model is None:
            said = "" if r.status_code == 200 else f": HTTP {r.status_code}, {_said(r)}"
            raise MinigridError(
                f"{self.base}/models lists no model{said}; is it an OpenAI-compatible server? "
                "If it is, give the model with --model"
            )
        card = next((c for c in cards if c["id"] == model), {})
        stated = card.get("max_model_len")
        self.stated_context = stated if isinstance(stated, int) and stated > 0 else None
        return model, self.cfg.context_length or self.stated_context

    def _body(self, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if self.cfg.chat:
            return "/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
        return "/completions", body | {"prompt": prompt}

    def send(self, model: str, tenant: str, prompt: str, max_tokens: int) -> httpx.Response:
        """One completion, not streamed (calibration reads its usage)."""
        path, body = self._body(model, prompt, max_tokens)
        return self._request("POST", path, tenant, json=body)

    def ask(self, model: str, shot: ProbeShot, prompt: str) -> None:
        """Stream one answer into `shot`: status, text, usage, time to first token. A server that
        answers with JSON instead is read whole; an answer cut off keeps what came, canaries and all."""
        path, body = self._body(model, prompt, self.cfg.max_tokens)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {self.cfg.tenants[shot.tenant]}"}
        t0 = time.perf_counter()
        try:
            with self.client.stream("POST", self.base + path, json=body, headers=headers) as r:
                if r.status_code in (401, 403):  # a key /models took but completions refuse
                    raise MinigridError(
                        f"{self.base}{path} answered HTTP {r.status_code} to {shot.tenant}'s key"
                    )
                shot.status = r.status_code
                if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                    self._read_stream(shot, r, t0)
                else:
                    r.read()
                    self._read(shot, r)
        except httpx.HTTPError as exc:  # no answer, or one that broke off: counted, not fatal
            shot.status, shot.code = None, type(exc).__name__
        shot.seconds = time.perf_counter() - t0
        finding = self.harness.check(shot.tenant, shot.answer, runs=False, fragment=FRAGMENT)
        shot.foreign = {o: sorted(m) for o, m in finding.foreign_canaries.items()}
        shot.partial = sorted(finding.partial)

    def _read_stream(self, shot: ProbeShot, r: httpx.Response, t0: float) -> None:
        """The events as they come; the text kept piece by piece, so a stream cut off keeps its part."""
        for line in r.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else None
            if data == "[DONE]":
                break
            try:
                event = json.loads(data) if data else None
            except ValueError:
                event = None
            if not isinstance(event, dict):
                continue
            if "error" in event:  # the server gave up mid-answer
                error = event["error"]
                shot.status = None
                shot.code = error.get("code") if isinstance(error, dict) else "stream_error"
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                shot.prompt_tokens = usage["prompt_tokens"]
            for choice in event.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                piece = (choice.get("delta") or {}).get("content") if self.cfg.chat else choice.get("text")
                if isinstance(piece, str) and piece:
                    if shot.ttft_s is None:
                        shot.ttft_s = time.perf_counter() - t0
                    shot.answer += piece

    def calibrate(self, model: str, context: int | None) -> tuple[float, float]:
        """Characters per token and the template's overhead, from two prompts' usage.prompt_tokens."""
        tenant = next(iter(self.cfg.tenants))
        # within what the server states too: a --context-length above it is probed, not calibrated at
        room = min(c for c in (context, self.stated_context, 4096) if c) - 1
        sizes = (max(16, min(256, room // 4)), max(32, min(1024, room // 2)))
        path = self._body(model, "", 1)[0]
        counted = []
        for n in sizes:
            r = self.send(model, tenant, self.harness.prompt(tenant, n, 4), 1)
            try:
                tokens = r.json()["usage"]["prompt_tokens"]
            except (ValueError, KeyError, TypeError):
                raise MinigridError(
                    f"calibration: POST {self.base}{path} with a {n}-character prompt answered HTTP "
                    f"{r.status_code} without usage.prompt_tokens ({_said(r)}): the probe needs an "
                    "OpenAI-compatible server that counts a prompt's tokens"
                ) from None
            counted.append(int(tokens))
        slope = (counted[1] - counted[0]) / (sizes[1] - sizes[0])  # tokens per character
        if slope <= 0:
            raise MinigridError(
                f"calibration: prompts of {sizes[0]} and {sizes[1]} characters were counted as "
                f"{counted[0]} and {counted[1]} tokens: usage.prompt_tokens does not grow with the prompt "
                f"(does something in front of {self.base} rewrite usage?), so prompt lengths cannot be "
                "set in the server's tokens: point the probe at the server itself"
            )
        return 1 / slope, counted[0] - sizes[0] * slope

    def targets(self, context: int | None) -> list[int]:
        if self.cfg.prompt_tokens:
            room = None if context is None else context - self.cfg.max_tokens
            over = [n for n in self.cfg.prompt_tokens if room is not None and n > room]
            if over:  # the server refuses them whatever its pools: they would test nothing
                raise MinigridError(
                    f"--prompt-tokens {','.join(map(str, sorted(set(over))))} with --max-tokens "
                    f"{self.cfg.max_tokens} exceed the context of {context} tokens, so the server refuses "
                    f"them before any KV page: give prompts of at most {room} "
                    "tokens, or a smaller --max-tokens"
                )
            return sorted(set(self.cfg.prompt_tokens))
        if context is None:
            raise MinigridError(
                f"{self.base}/models states no max_model_len: give --context-length N or --prompt-tokens N,N"
            )
        room = context - self.cfg.max_tokens
        if room < 8:
            raise MinigridError(
                f"--max-tokens {self.cfg.max_tokens} leaves {max(room, 0)} of the context's {context} "
                f"tokens for a prompt: give --max-tokens {max(1, context - 8)} at most"
            )
        return sorted({max(8, int(room * f)) for f in DEFAULT_FRACTIONS})

    def run(self, progress: bool = False) -> ProbeReport:
        model, context = self.discover()
        targets = self.targets(context)  # before calibration: a --max-tokens over the context is named
        cpt, overhead = self.calibrate(model, context)
        report = ProbeReport(
            self.cfg.url,
            model,
            context,
            cpt,
            overhead,
            concurrency=self.cfg.concurrency,
            max_tokens=self.cfg.max_tokens,
        )
        names = list(self.cfg.tenants)
        plan = [
            (rnd, names[(i + rnd) % len(names)], target)  # each round, the accounts take turns
            for rnd in range(1, self.cfg.rounds + 1)
            for target in targets
            for i in range(len(names))
        ]
        prompts = []  # made up front, in plan order: the canaries do not depend on the timing
        for rnd, tenant, target in plan:
            chars = max(8, round((target - overhead) * cpt))
            prompt = self.harness.prompt(tenant, chars, self.rng.randint(4, 10))
            report.shots.append(ProbeShot(rnd, tenant, target, chars))
            prompts.append(prompt)
        bar = tqdm(total=len(plan), desc="probe", unit="req", disable=not progress, leave=False)
        pool = ThreadPoolExecutor(self.cfg.concurrency)  # 1: strictly one after another, in plan order
        try:
            jobs = [pool.submit(self.ask, model, shot, prompt) for shot, prompt in zip(report.shots, prompts)]
            for done in as_completed(jobs):
                done.result()  # a key refused at completions stops the probe (MinigridError)
                bar.update()
        finally:
            pool.shutdown(cancel_futures=True)  # what was not sent yet is not sent
            bar.close()
        report.judge_timing()
        return report

    def _read(self, shot: ProbeShot, r: httpx.Response) -> None:
        try:
            data = r.json()
        except ValueError:
            shot.code = "not_json"
            return
        if not isinstance(data, dict):
            shot.code = "not_json"
            return
        if r.status_code != 200:
            error = data.get("error")
            shot.code = error.get("code") if isinstance(error, dict) else None
            return
        usage = data.get("usage") or {}
        shot.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        text = (choice.get("message") or {}).get("content") if self.cfg.chat else choice.get("text")
        shot.answer = text if isinstance(text, str) else ""


def probe(cfg: ProbeConfig, progress: bool = False) -> ProbeReport:
    with httpx.Client(timeout=cfg.timeout_s) as client:
        return Probe(cfg, client).run(progress)
