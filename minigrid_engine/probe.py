"""`minigrid probe --url URL --tenants A:KEY,B:KEY`: the canary test, from outside, against any
OpenAI-compatible deployment (a minigrid engine, SGLang, vLLM, a gateway in front of them).

It is the content test INCIDENT.md says the launch lacked, run the way Cloudflare verified its fix:
two or more accounts take turns sending prompts made of their own canaries (`canary.py`), at
lengths spread up to the context, and every answer is searched for another account's canaries. An
answer holding one was built from another customer's KV pages. A 400 for an over-long prompt is
the correct answer and counts as such; a 200 is only as good as its content.

Nothing here reads the engine's internals: only `/v1/models` (the model and its `max_model_len`)
and the completions the accounts get. Prompt lengths are set in the server's own tokens: two
calibration prompts measure its characters per token and its template's overhead from `usage`.

Exit status: 0 no answer held another account's canaries, 1 one did, 2 the probe could not run
(or no prompt got an answer, which tests nothing).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from minigrid_engine.canary import CanaryHarness
from minigrid_engine.errors import MinigridError

DEFAULT_FRACTIONS = (0.25, 0.5, 0.7, 0.85, 1.0)  # of the room a prompt has below the context


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

    def __post_init__(self) -> None:
        if len(self.tenants) < 2:
            raise MinigridError(
                f"--tenants names {len(self.tenants)} account(s): a leak is one account's data in "
                "another's answer, so give two at least (NAME:KEY,NAME:KEY)"
            )
        if len(set(self.tenants.values())) < len(self.tenants):
            raise MinigridError("--tenants: two accounts share one key; give each its own")
        if self.rounds < 1 or self.max_tokens < 1:
            raise MinigridError(f"rounds {self.rounds} and max_tokens {self.max_tokens} must be at least 1")


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
    seconds: float = 0.0
    foreign: dict[str, list[str]] = field(default_factory=dict)  # owner -> its canaries in the answer
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

    @property
    def leaks(self) -> list[ProbeShot]:
        return [s for s in self.shots if s.leaked]

    @property
    def answered(self) -> int:
        return sum(s.status == 200 for s in self.shots)

    @property
    def ok(self) -> bool:
        return not self.leaks

    def by_length(self) -> list[tuple[int, Counter[str]]]:
        rows: dict[int, Counter[str]] = {}
        for s in self.shots:
            c = rows.setdefault(s.target_tokens, Counter())
            c["sent"] += 1
            c["200"] += s.status == 200
            c["4xx"] += s.status is not None and 400 <= s.status < 500
            c["5xx / none"] += s.status is None or s.status >= 500
            c["leaked"] += s.leaked
        return sorted(rows.items())

    def text(self) -> str:
        lines = [
            f"minigrid probe {self.url}: model {self.model!r}, context "
            f"{self.context_length if self.context_length else 'not stated'}, "
            f"{len({s.tenant for s in self.shots})} accounts, {self.chars_per_token:.2f} characters a token",
            f"  {'prompt tokens':>13}  {'sent':>5}  {'200':>5}  {'4xx':>5}  {'5xx/none':>8}  {'leaked':>6}",
        ]
        for target, c in self.by_length():
            lines.append(
                f"  {target:>13,}  {c['sent']:>5}  {c['200']:>5}  {c['4xx']:>5}  {c['5xx / none']:>8}"
                f"  {c['leaked']:>6}"
            )
        for s in self.leaks[:5]:
            owners = "; ".join(f"{o}'s {sorted(m)}" for o, m in s.foreign.items())
            counted = f"{s.prompt_tokens:,}" if s.prompt_tokens is not None else "?"
            lines.append(
                f"  leak: round {s.round}, {s.tenant}'s {counted}-token prompt got HTTP {s.status} "
                f"with {owners}"
            )
        if not self.answered:
            lines.append("NOTHING TESTED: no prompt got an answer (HTTP 200)")
        elif self.ok:
            lines.append(f"PASS: none of {self.answered} answers held another account's canaries")
        else:
            lines.append(
                f"FAIL: {len(self.leaks)} answers held another account's canaries: they were built "
                "from other customers' KV pages"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        extra = {"ok": self.ok, "answered": self.answered, "leaked_answers": len(self.leaks)}
        return json.dumps({**asdict(self), **extra}, indent=2)


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
            raise MinigridError(
                f"{self.base}/models (HTTP {r.status_code}) lists no model: give one with --model"
            )
        card = next((c for c in cards if c["id"] == model), {})
        stated = card.get("max_model_len")
        context = self.cfg.context_length or (stated if isinstance(stated, int) and stated > 0 else None)
        return model, context

    def send(self, model: str, tenant: str, prompt: str, max_tokens: int) -> tuple[httpx.Response, float]:
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if self.cfg.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/completions"
        t0 = time.perf_counter()
        r = self._request("POST", path, tenant, json=body)
        return r, time.perf_counter() - t0

    def calibrate(self, model: str, context: int | None) -> tuple[float, float]:
        """Characters per token and the template's overhead, from two prompts' usage.prompt_tokens."""
        tenant = next(iter(self.cfg.tenants))
        room = (context or 4096) - 1
        sizes = (max(16, min(256, room // 4)), max(32, min(1024, room // 2)))
        counted = []
        for n in sizes:
            r, _ = self.send(model, tenant, self.harness.prompt(tenant, n, 4), 1)
            try:
                tokens = r.json()["usage"]["prompt_tokens"]
            except (ValueError, KeyError, TypeError):
                raise MinigridError(
                    f"calibration: {self.base} answered HTTP {r.status_code} without usage.prompt_tokens "
                    f"to a {n}-character prompt: {r.text[:200]!r}"
                ) from None
            counted.append(int(tokens))
        slope = (counted[1] - counted[0]) / (sizes[1] - sizes[0])  # tokens per character
        if slope <= 0:
            raise MinigridError(f"calibration: {sizes} characters counted as {counted} tokens")
        return 1 / slope, counted[0] - sizes[0] * slope

    def targets(self, context: int | None) -> list[int]:
        if self.cfg.prompt_tokens:
            return sorted(set(self.cfg.prompt_tokens))
        if context is None:
            raise MinigridError(
                f"{self.base}/models states no max_model_len: give --context-length N or --prompt-tokens N,N"
            )
        room = context - self.cfg.max_tokens
        if room < 8:
            raise MinigridError(
                f"context {context} leaves {room} tokens for a prompt "
                f"after --max-tokens {self.cfg.max_tokens}"
            )
        return sorted({max(8, int(room * f)) for f in DEFAULT_FRACTIONS})

    def run(self, progress: bool = False) -> ProbeReport:
        model, context = self.discover()
        cpt, overhead = self.calibrate(model, context)
        report = ProbeReport(self.cfg.url, model, context, cpt, overhead)
        names = list(self.cfg.tenants)
        plan = [
            (rnd, names[(i + rnd) % len(names)], target)  # each round, the accounts take turns
            for rnd in range(1, self.cfg.rounds + 1)
            for target in self.targets(context)
            for i in range(len(names))
        ]
        for rnd, tenant, target in tqdm(plan, desc="probe", unit="req", disable=not progress, leave=False):
            chars = max(8, round((target - overhead) * cpt))
            prompt = self.harness.prompt(tenant, chars, self.rng.randint(4, 10))
            shot = ProbeShot(rnd, tenant, target, chars)
            try:
                r, shot.seconds = self.send(model, tenant, prompt, self.cfg.max_tokens)
            except MinigridError:  # one lost answer is a finding to count, not the end of the probe
                report.shots.append(shot)
                continue
            if r.status_code in (401, 403):  # a key /models took but completions refuse
                raise MinigridError(f"{self.base}: HTTP {r.status_code} to {tenant}'s completion request")
            shot.status = r.status_code
            self._read(shot, r)
            report.shots.append(shot)
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
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") if self.cfg.chat else choice.get("text")
        shot.answer = text if isinstance(text, str) else ""
        finding = self.harness.check(shot.tenant, shot.answer, runs=False)
        shot.foreign = {o: sorted(m) for o, m in finding.foreign_canaries.items()}


def probe(cfg: ProbeConfig, progress: bool = False) -> ProbeReport:
    with httpx.Client(timeout=cfg.timeout_s) as client:
        return Probe(cfg, client).run(progress)
