"""Fault injection for tests and labs: off by default, refused unless asked for by name.

    MINIGRID_FAULT_INJECTION=1 minigrid serve --inject delay-transfer=3 --release-timeout 1
    MINIGRID_FAULT_INJECTION=1 minigrid serve --inject drop-done@carol --inject prefill-error

A spec is ``NAME[=SECONDS][@TENANT]``: each fault hits the next transfer (the next prefill, for
`prefill-error`) of `TENANT`, or of anyone without ``@``, once.

| fault | what happens to the next transfer |
|---|---|
| `delay-transfer=S` | prefill holds its page data and done message for S seconds (others go on) |
| `delay-done=S` | the page data goes out; the done message follows S seconds later |
| `drop-transfer` | the page data is never sent; the done message is |
| `drop-done` | the page data goes out; the done message never does |
| `duplicate-transfer` | the page data is sent twice, then the done message |
| `duplicate-done` | the done message is sent twice |
| `reorder-transfer` | the transfer is overtaken by the next one (it goes out after it) |
| `reorder-done` | the done message overtakes its page data (done, then the data) |
| `prefill-error` | prefill raises while computing the request (no transfer at all) |

An injection is accepted only where ``MINIGRID_FAULT_INJECTION=1`` is set, so that a production
command line cannot carry one by accident.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from minigrid_engine.errors import ConfigError

FAULTS = {
    "delay-transfer": "hold the next transfer's page data for SECONDS (delay-transfer=SECONDS)",
    "delay-done": "send the next transfer's done message SECONDS after its page data (delay-done=SECONDS)",
    "drop-transfer": "never send the next transfer's page data (its done message still goes)",
    "drop-done": "never send the next transfer's done message",
    "duplicate-transfer": "send the next transfer's page data twice",
    "duplicate-done": "send the next transfer's done message twice",
    "reorder-transfer": "let the next transfer be overtaken by the one after it",
    "reorder-done": "send the next transfer's done message before its page data",
    "prefill-error": "raise in prefill while it computes the next request",
}
TIMED = frozenset({"delay-transfer", "delay-done"})  # the faults that take =SECONDS
ENV = "MINIGRID_FAULT_INJECTION"

# What the prefill sender does for one transfer, in order: "data" is a TransferBegin and its page
# data, "done" the TransferDone. A fault changes this list (or holds the whole job: delay, reorder).
NORMAL_STEPS: tuple[str, ...] = ("data", "done")
STEPS = {
    "drop-transfer": ("done",),
    "drop-done": ("data",),
    "duplicate-transfer": ("data", "data", "done"),
    "duplicate-done": ("data", "done", "done"),
    "reorder-done": ("done", "data"),
}


@dataclass(frozen=True)
class Fault:
    name: str
    seconds: float = 0.0
    tenant: str | None = None  # None: whoever comes next

    def __str__(self) -> str:
        text = f"{self.name}={self.seconds:g}" if self.name in TIMED else self.name
        return text if self.tenant is None else f"{text}@{self.tenant}"

    def hits(self, tenant: str) -> bool:
        """Does this fault apply to a request of `tenant`?"""
        return self.tenant is None or self.tenant == tenant


def _choices() -> str:
    return "choose one of " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items())


def parse_fault(spec: str, tenants: Iterable[str] | None = None) -> Fault:
    """One ``NAME[=SECONDS][@TENANT]``; `tenants`, when given, are the names ``@`` may take."""
    text, at, tenant = spec.strip().partition("@")
    name, eq, value = text.partition("=")
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}: {_choices()}")
    if at:
        known = None if tenants is None else list(tenants)
        if not tenant or (known is not None and tenant not in known):
            names = ", ".join(known) if known else "a tenant's name"
            raise ConfigError(f"fault {spec!r}: @{tenant} is not a tenant of this engine: choose {names}")
    seconds = 0.0
    if name in TIMED:
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigError(f"{name} needs seconds, e.g. {name}=3, got {spec!r}") from None
        if not 0 < seconds <= 600:
            raise ConfigError(f"{name}={value}: seconds must be between 0 and 600")
    elif eq:
        raise ConfigError(f"fault {name!r} takes no value, got {spec!r}")
    return Fault(name, seconds, tenant or None)


def parse_faults(
    specs: list[str] | tuple[str, ...],
    env: dict[str, str] | None = None,
    tenants: Iterable[str] | None = None,
) -> tuple[Fault, ...]:
    """Parse `--inject` values; raise `ConfigError` naming the valid choices or the missing opt-in."""
    if not specs:
        return ()
    env = dict(os.environ) if env is None else env
    known = None if tenants is None else list(tenants)
    faults = tuple(parse_fault(spec, known) for spec in specs)
    if env.get(ENV) != "1":
        raise ConfigError(
            f"--inject {', '.join(map(str, faults))} is a fault injection for tests and labs: "
            f"set {ENV}=1 to allow it"
        )
    return faults


def take(faults: list[Fault], tenant: str, names: Iterable[str]) -> Fault | None:
    """Remove and return the first pending fault among `names` that hits `tenant`."""
    wanted = set(names)
    for i, fault in enumerate(faults):
        if fault.name in wanted and fault.hits(tenant):
            return faults.pop(i)
    return None
