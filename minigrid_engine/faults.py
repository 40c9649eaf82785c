"""Fault injection for tests and labs: off by default, refused unless asked for by name.

    MINIGRID_FAULT_INJECTION=1 minigrid serve --inject delay-transfer=3 --release-timeout 1

| fault | what happens |
|---|---|
| `delay-transfer=S` | prefill holds the page data of the next transfer for S seconds (others go on) |
| `drop-done` | prefill never sends the done message of the next transfer |
| `duplicate-done` | prefill sends the done message of the next transfer twice |

An injection is accepted only where ``MINIGRID_FAULT_INJECTION=1`` is set, so that a production
command line cannot carry one by accident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from minigrid_engine.errors import ConfigError

FAULTS = {
    "delay-transfer": "hold the next transfer's page data for SECONDS (delay-transfer=SECONDS)",
    "drop-done": "never send the next transfer's done message",
    "duplicate-done": "send the next transfer's done message twice",
}
ENV = "MINIGRID_FAULT_INJECTION"


@dataclass(frozen=True)
class Fault:
    name: str
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"{self.name}={self.seconds:g}" if self.name == "delay-transfer" else self.name


def parse_faults(specs: list[str] | tuple[str, ...], env: dict[str, str] | None = None) -> tuple[Fault, ...]:
    """Parse `--inject` values; raise `ConfigError` naming the valid choices or the missing opt-in."""
    if not specs:
        return ()
    env = dict(os.environ) if env is None else env
    faults = []
    for spec in specs:
        name, _, value = spec.strip().partition("=")
        if name not in FAULTS:
            raise ConfigError(
                f"unknown fault {name!r}: choose one of " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items())
            )
        if name == "delay-transfer":
            try:
                seconds = float(value)
            except ValueError:
                raise ConfigError(
                    f"delay-transfer needs seconds, e.g. delay-transfer=3, got {spec!r}"
                ) from None
            if not 0 < seconds <= 600:
                raise ConfigError(f"delay-transfer={value}: seconds must be between 0 and 600")
            faults.append(Fault(name, seconds))
        elif value:
            raise ConfigError(f"fault {name!r} takes no value, got {spec!r}")
        else:
            faults.append(Fault(name))
    if env.get(ENV) != "1":
        raise ConfigError(
            f"--inject {', '.join(map(str, faults))} is a fault injection for tests and labs: "
            f"set {ENV}=1 to allow it"
        )
    return tuple(faults)
