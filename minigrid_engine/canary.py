"""The canary harness: the test that would have caught the incident.

Cloudflare's launch tests checked status codes and latency. These check content:

- every prompt a tenant sends carries **canaries**, unique random markers registered to that
  tenant; a response holding another tenant's canary, or a long run of another tenant's prompt
  text, is a leak;
- a **TTFT floor**: an answer whose first token arrives faster than a real prefill of its prompt
  length allows was not computed from its prompt (the incident's one visible symptom).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from minigrid_engine.records import FIELDS, random_code, shaped_prompt

MARKER = re.compile(r"\b[A-Z0-9]{6,12}\b")


def longest_shared_run(text: str, source: str, exclude: str = "") -> int:
    """Length of the longest substring of `text` that also occurs in `source` and holds something
    `exclude` does not (with `exclude` the reader's own prompt, text they could have copied from
    it, such as a template both share, does not count)."""
    best = 0
    for i in range(len(text)):
        n = best + 1
        if i + n > len(text) or text[i : i + n] not in source:
            continue  # no run from here beats the best
        while i + n < len(text) and text[i : i + n + 1] in source:
            n += 1
        if not exclude or text[i : i + n] not in exclude:  # shorter runs from i are in it too
            best = n
    return best


@dataclass
class Finding:
    """What the harness found in one response."""

    tenant: str
    foreign_canaries: dict[str, set[str]] = field(default_factory=dict)  # owner -> markers
    partial: set[str] = field(default_factory=set)  # of those, the markers seen only in part
    longest_foreign_run: int = 0
    longest_foreign_run_owner: str | None = None
    too_fast: bool = False

    @property
    def leak(self) -> bool:
        return bool(self.foreign_canaries)

    def explain(self) -> str:
        if not self.leak and not self.too_fast:
            return f"{self.tenant}: clean (longest run of another tenant's text: {self.longest_foreign_run})"
        parts = [f"{owner}'s canaries {sorted(m)}" for owner, m in self.foreign_canaries.items()]
        if self.too_fast:
            parts.append("first token faster than a real prefill of this prompt allows")
        return f"{self.tenant}: LEAK: " + "; ".join(parts)


class CanaryHarness:
    """Registers each tenant's canaries and prompts; checks responses against everyone else's."""

    def __init__(self, seed: int = 0, run_threshold: int = 24) -> None:
        self.rng = random.Random(seed)
        self.canaries: dict[str, set[str]] = {}
        self.prompts: dict[str, list[str]] = {}
        self.run_threshold = run_threshold

    def canary(self, tenant: str) -> str:
        marker = random_code(self.rng, 10)
        self.canaries.setdefault(tenant, set()).add(marker)
        return marker

    def prompt(self, tenant: str, n_tokens: int, n_records: int = 8) -> str:
        """A prompt of exactly `n_tokens` bytes of `tenant`'s records, every code a canary."""
        name = tenant.upper()
        block = "".join(f"{name} {self.rng.choice(FIELDS)} {self.canary(tenant)}; " for _ in range(n_records))
        text = (block * (n_tokens // len(block) + 1))[:n_tokens]
        return self.register(tenant, text)

    def shaped(self, tenant: str, shape: str, n_tokens: int) -> str:
        """A prompt of exactly `n_tokens` bytes of `tenant`'s secrets in one of `records.SHAPES` (a
        letter, code, a chat transcript) or records; its codes are canaries, and its text is
        guarded as every prompt's is."""
        if shape == "records":
            return self.prompt(tenant, n_tokens)
        text = shaped_prompt(tenant, shape, n_tokens, self.rng)
        self.canaries.setdefault(tenant, set()).update(MARKER.findall(text))
        return self.register(tenant, text)

    def register(self, tenant: str, prompt: str) -> str:
        """Remember a prompt `tenant` sent (its text is then guarded too)."""
        self.prompts.setdefault(tenant, []).append(prompt)
        return prompt

    def check(self, tenant: str, text: str, runs: bool = True, fragment: int | None = None) -> Finding:
        """Another tenant's canaries in `text`; with `runs`, also the longest run of its prompts'
        text that `tenant`'s own prompts do not hold (a search over every prompt sent: leave it off
        when they are long, as a probe's are).

        With `fragment` N, N characters in a row of another tenant's canary count too (unless they
        are also in one of `tenant`'s own): an answer that ends, or a page that starts, inside a
        record holds its code cut short, and a short answer holds no whole record at all."""
        found = set(MARKER.findall(text))
        finding = Finding(tenant)
        for owner, markers in self.canaries.items():
            if owner != tenant and found & markers:
                finding.foreign_canaries[owner] = found & markers
        if fragment is not None:
            self._fragments(finding, text, fragment)
        if not runs:
            return finding
        own = "\x00".join(self.prompts.get(tenant, []))  # text the reader could copy from its own
        for owner, prompts in self.prompts.items():
            if owner == tenant:
                continue
            # one search over all of the owner's prompts (a campaign sends hundreds)
            n = longest_shared_run(text, "\x00".join(prompts), exclude=own)
            if n > finding.longest_foreign_run:
                finding.longest_foreign_run, finding.longest_foreign_run_owner = n, owner
        if finding.longest_foreign_run >= self.run_threshold and finding.longest_foreign_run_owner:
            finding.foreign_canaries.setdefault(finding.longest_foreign_run_owner, set())
        return finding

    def _fragments(self, finding: Finding, text: str, n: int) -> None:
        def pieces(marker: str) -> set[str]:
            return {marker[i : i + n] for i in range(len(marker) - n + 1)}

        in_text = {text[i : i + n] for i in range(len(text) - n + 1)}
        own = set().union(*map(pieces, self.canaries.get(finding.tenant, ())))
        for owner, markers in self.canaries.items():
            if owner == finding.tenant:
                continue
            seen = {m for m in markers if (pieces(m) - own) & in_text}
            new = seen - finding.foreign_canaries.get(owner, set())
            if new:
                finding.foreign_canaries.setdefault(owner, set()).update(new)
                finding.partial |= new


@dataclass
class TTFTFloor:
    """Flags a first token that came faster than a real prefill of its prompt length allows.

    Fed with (prompt tokens, TTFT) of prompts known to be really prefilled, it models a prefill as
    a fixed cost (the request's trip through router, prefill, transfer and decode) plus a cost per
    prompt token, each the fastest seen: the fixed cost from the shortest prompts, the cost per token
    from the longer ones. A response whose TTFT is below `fixed_margin` of the fixed cost plus
    `margin` of the per-token cost could not have been computed from its whole prompt. With one
    prompt length seen, the whole TTFT counts as per-token cost (a floor of `margin` x the
    fastest rate), which misses stubs where the fixed cost dominates, as on a CPU.
    """

    margin: float = 0.5
    fixed_margin: float = 0.8  # a real prefill is never much faster than the fastest trip seen
    observed: list[tuple[int, float]] = field(default_factory=list)

    def observe(self, prompt_tokens: int, ttft_s: float) -> None:
        if prompt_tokens > 0 and ttft_s > 0:
            self.observed.append((prompt_tokens, ttft_s))

    def model(self) -> tuple[float, float]:
        """(fixed cost s, cost per prompt token s): the fastest prefill the observations allow."""
        if not self.observed:
            return 0.0, 0.0
        shortest = min(n for n, _ in self.observed)
        longer = [(n, t) for n, t in self.observed if n >= 2 * shortest]
        if not longer:  # one length seen: no fixed cost can be told apart
            return 0.0, min(t / n for n, t in self.observed)
        fixed = min(t for n, t in self.observed if n == shortest)
        per_token = min(max(0.0, t - fixed) / (n - shortest) for n, t in longer)
        return fixed, per_token

    def floor_s(self, prompt_tokens: int) -> float:
        fixed, per_token = self.model()
        return self.fixed_margin * fixed + self.margin * per_token * prompt_tokens

    def too_fast(self, prompt_tokens: int, ttft_s: float | None) -> bool:
        return ttft_s is not None and ttft_s < self.floor_s(prompt_tokens)
