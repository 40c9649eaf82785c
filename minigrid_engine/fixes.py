"""The fixes: named, independently switchable changes (`--fixes none|all|NAME,NAME...`).

Each fix is one boolean here and one named branch where it acts, so that a learner can find
"what `coverage-check` changes" with a search for `fixes.coverage_check`. `none` is the faulty
engine of the incident (bug-compatible mode).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from minigrid_engine.errors import ConfigError

# name on the command line -> what it changes (shown by `minigrid serve --help` and errors)
FIXES: dict[str, str] = {
    "capacity-check": "refuse to start when a pool holds fewer tokens than the context length",
    "reject-before-transfer": "a rejected request leaves every queue before any page is reserved",
    "coverage-check": "prefill states the tokens of KV it wrote; decode aborts when they differ",
    "kv-checksum": "prefill sends page checksums; decode verifies every reserved page",
    "scrub-on-free": "pages are zeroed when freed",
    "owner-check": "every page read checks that the page's last writer is the reader",
    "deferred-release": "free pages only after the other role acknowledges or a timeout passes",
}

# Fixes this build implements; asking for another is an error, never a silent no-op.
BUILT: frozenset[str] = frozenset(
    {
        "capacity-check",
        "reject-before-transfer",
        "coverage-check",
        "kv-checksum",
        "scrub-on-free",
        "owner-check",
        "deferred-release",
    }
)


@dataclass(frozen=True)
class Fixes:
    capacity_check: bool = False
    reject_before_transfer: bool = False
    coverage_check: bool = False
    kv_checksum: bool = False
    scrub_on_free: bool = False
    owner_check: bool = False
    deferred_release: bool = False

    @classmethod
    def none(cls) -> Fixes:
        return cls()

    @classmethod
    def all(cls) -> Fixes:
        return cls(**{f.name: f.name.replace("_", "-") in BUILT for f in fields(cls)})

    def names(self) -> list[str]:
        return [f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name)]

    def __str__(self) -> str:
        return ",".join(self.names()) or "none"


def parse_fixes(text: str | list[str] | tuple[str, ...], what: str = "--fixes") -> Fixes:
    """'none', 'all' or a comma-separated list of fix names (or a list of them); `what` names
    where they were given in the errors (the flag at the command line, the field over HTTP)."""
    if isinstance(text, (list, tuple)) and all(isinstance(n, str) for n in text):
        text = ",".join(text)
    if not isinstance(text, str):
        raise ConfigError(f"{what} {text!r}: give none, all, or names from {', '.join(FIXES)}")
    spec = text.strip().lower()
    if spec == "none":
        return Fixes.none()
    if spec == "all":
        return Fixes.all()
    items = [n.strip() for n in spec.split(",")]
    names = [n for n in items if n]
    if not names:
        raise ConfigError(f"{what} {text!r}: give none, all, or names from {', '.join(FIXES)}")
    if len(names) < len(items):  # "owner-check,,kv-checksum": a name lost to a typo is said, not dropped
        raise ConfigError(
            f"{what} {text!r}: item {items.index('') + 1} is empty; "
            "write fix names with one comma between them, e.g. owner-check,kv-checksum"
        )
    if len(names) > 1 and {"none", "all"} & set(names):
        raise ConfigError(f"{what} {text!r}: 'none' and 'all' stand alone; list fix names instead")
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        raise ConfigError(
            f"unknown fix {unknown[0]!r}: choose none, all, or a comma-separated list of {', '.join(FIXES)}"
        )
    missing = [n for n in names if n not in BUILT]
    if missing:
        raise ConfigError(f"fix {missing[0]!r} is not built yet in this version of minigrid")
    return Fixes(**{n.replace("-", "_"): True for n in names})
