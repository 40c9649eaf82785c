"""`minigrid audit --url URL`: does every KV pool of the *running* engine cover its context length?

The operator's check of INCIDENT.md's first question, made from the engine's own `/metrics`
rather than from a configuration file that may not be what is deployed.
Exit status: 0 every pool covers the context, 1 one does not, 2 the engine could not be read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minigrid_engine.errors import MinigridError


@dataclass(frozen=True)
class PoolFinding:
    role: str
    capacity_tokens: int
    context_length: int

    @property
    def covers(self) -> bool:
        return self.capacity_tokens >= self.context_length

    @property
    def shortfall_tokens(self) -> int:
        return max(0, self.context_length - self.capacity_tokens)


@dataclass(frozen=True)
class AuditReport:
    url: str
    context_length: int
    pools: list[PoolFinding]

    @property
    def ok(self) -> bool:
        return bool(self.pools) and all(p.covers for p in self.pools)

    def to_json(self) -> str:
        return json.dumps(
            {
                "url": self.url,
                "ok": self.ok,
                "context_length_tokens": self.context_length,
                "pools": [
                    asdict(p) | {"covers": p.covers, "shortfall_tokens": p.shortfall_tokens}
                    for p in self.pools
                ],
            },
            indent=2,
        )

    def text(self) -> str:
        lines = [f"minigrid audit {self.url}: context length {self.context_length} tokens"]
        for p in self.pools:
            verdict = "ok" if p.covers else f"TOO SMALL by {p.shortfall_tokens} tokens"
            lines.append(f"  {p.role:8s} KV pool {p.capacity_tokens:>9,} tokens  {verdict}")
        if self.ok:
            lines.append("PASS: every KV pool holds a full-context prompt")
        else:
            short = [p for p in self.pools if not p.covers]
            lines.append(
                "FAIL: "
                + "; ".join(
                    f"the {p.role} pool holds {p.capacity_tokens} tokens < context length {p.context_length}"
                    for p in short
                )
                + ": prompts longer than the pool can be accepted but cannot be prefilled"
            )
        return "\n".join(lines)


def parse_metrics(text: str) -> tuple[int | None, dict[str, int]]:
    context: int | None = None
    pools: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "minigrid_context_length_tokens":
                context = int(s.value)
            elif s.name == "minigrid_kv_pool_capacity_tokens":
                pools[s.labels.get("role", "?")] = int(s.value)
    return context, pools


def audit(url: str, timeout_s: float = 10) -> AuditReport:
    base = url.rstrip("/")
    target = base if base.endswith("/metrics") else base + "/metrics"
    try:
        r = httpx.get(target, timeout=timeout_s)
    except httpx.InvalidURL as exc:
        raise MinigridError(f"{url!r} is not a URL the audit can read: {exc}") from None
    except httpx.HTTPError as exc:
        raise MinigridError(f"cannot read {target}: {exc}") from None
    if r.status_code != 200:
        raise MinigridError(f"{target} answered HTTP {r.status_code}")
    try:
        context, pools = parse_metrics(r.text)
    except ValueError as exc:
        raise MinigridError(f"{target} is not Prometheus text: {exc}") from None
    if context is None or not pools:
        raise MinigridError(
            f"{target} has no minigrid_context_length_tokens or minigrid_kv_pool_capacity_tokens: "
            "is this a minigrid engine?"
        )
    return AuditReport(
        base, context, [PoolFinding(role, cap, context) for role, cap in sorted(pools.items())]
    )
