"""Serving configuration and the presets of the incident (torch-free: the router imports it).

Numbers from INCIDENT.md, scaled so that one lab token stands for 1,024 production tokens:
context 1,024 (1,048,576), prefill pool 665 (681,280), page 128 (a full-context prompt is 8
pages), corrected pool 2,048 (about 2.04 M, twice the context).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import InitVar, asdict, dataclass, field, fields, replace
from typing import Any

from minigrid_engine.errors import TRITON_WHEELS, ConfigError, counted
from minigrid_engine.fixes import Fixes, parse_fixes
from minigrid_engine.recovery import DEFAULT_RESTART_WINDOW_S

INCIDENT_CONTEXT = 1024
INCIDENT_PREFILL_POOL = 665
INCIDENT_PAGE_SIZE = 128
CORRECTED_POOL = 2048
DEFAULT_DECODE_POOL = 4096
DEFAULT_TENANTS = {"alice": "sk-alice", "bob": "sk-bob"}
MODEL_ID = "minigrid-byte"
MAX_WORKERS_PER_ROLE = 8
ROLES = ("prefill", "decode")
MAX_WORKER_RESTARTS = 100
MAX_RESTART_WINDOW_S = 7 * 24 * 3600.0
MAX_PAGE_SIZE = 4096  # tokens per KV page: what the pool (pool.py) and the kernels accept


def _whole(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_pool_size(tokens: int | None, page_size: int, tokens_name: str, page_name: str) -> None:
    """The two rules of a KV pool's size, in one place for the pool (`pool.PoolConfig`), the
    engine's settings and `minigrid pool`, each naming the numbers as its caller spells them
    (``capacity_tokens``, ``--prefill-pool-tokens``, ``"page_size"``): a page holds 1 to
    `MAX_PAGE_SIZE` tokens, and a pool holds one page at least (`tokens` None: not sized yet)."""
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ConfigError(f"{page_name} {page_size}: between 1 and {MAX_PAGE_SIZE} tokens per page")
    if tokens is not None and tokens < page_size:
        raise ConfigError(
            f"{tokens_name} {tokens} is smaller than one page of {page_name} {page_size} tokens"
        )


# How the command line spells a setting, where `--` + its name with dashes does not say it.
_FLAGS = {"release_timeout_s": "--release-timeout", "worker_restart_window_s": "--worker-restart-window"}
_NO_FLAG = ("worker_threads", "trace_maxlen", "weights")  # set in code or a config file only


def _flag(name: str) -> str:
    """A setting as the command line names it: --context-length (one with no flag: its name)."""
    return name if name in _NO_FLAG else _FLAGS.get(name, "--" + name.replace("_", "-"))


def _key(name: str) -> str:
    """A setting as a config file (JSON) names it: "context_length"."""
    return f'"{name}"'


ADMIN = "admin"  # who the admin key is, in the router and the handle: no tenant may be called that


def check_key_text(whose: str, key: str) -> None:
    """A key travels in an HTTP header (``Authorization: Bearer KEY``), which carries printable
    ASCII: a key with another character could be configured but never presented."""
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ConfigError(
            f"{whose} holds the character {bad!r} (U+{ord(bad):04X}): an API key travels in an HTTP "
            "header, so use printable ASCII without spaces (e.g. openssl rand -hex 16)"
        )


def check_admin_key(tenants: dict[str, str], admin_key: str | None) -> None:
    """The admin key must be no tenant's key: otherwise it would let that tenant in, not the admin."""
    if not admin_key:
        return
    check_key_text("the admin key", admin_key)
    for name, key in tenants.items():
        if key == admin_key:
            raise ConfigError(
                f"the admin key is also the key of tenant {name!r}: give the admin a key of its own"
            )


def parse_tenants(text: str) -> dict[str, str]:
    """'alice:sk-a,bob:sk-b' -> {'alice': 'sk-a', 'bob': 'sk-b'}."""
    tenants: dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, key = item.partition(":")
        if not sep or not name.strip() or not key.strip():
            raise ConfigError(f"tenant {item!r} must be NAME:KEY, e.g. alice:sk-alice")
        if name.strip() in tenants:
            raise ConfigError(f"tenant {name.strip()!r} is named twice")
        if key.strip() in tenants.values():
            raise ConfigError(f"tenant {name.strip()!r} reuses another tenant's key")
        tenants[name.strip()] = key.strip()
    if not tenants:
        raise ConfigError(f"--tenants {text!r} names no tenant: use NAME:KEY,NAME:KEY")
    return tenants


@dataclass(frozen=True)
class ServeConfig:
    """Everything `minigrid serve` and the notebook handle need to start the three processes."""

    host: str = "127.0.0.1"
    port: int = 8000
    context_length: int = INCIDENT_CONTEXT
    page_size: int = INCIDENT_PAGE_SIZE
    prefill_pool_tokens: int = INCIDENT_PREFILL_POOL
    decode_pool_tokens: int = DEFAULT_DECODE_POOL
    fixes: Fixes = field(default_factory=Fixes.none)
    tenants: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_TENANTS))
    admin_key: str | None = None
    device: str = "cpu"
    attention: str = "torch"
    transfer_host: str = "127.0.0.1"  # where prefill listens for decode (bootstrap + gloo store)
    prefill_workers: int = 1  # worker processes per role; the router pairs one of each per request
    decode_workers: int = 1
    remote: tuple[str, ...] = ()  # roles whose workers run on another host (`minigrid worker`)
    worker_listen: str = "127.0.0.1:0"  # where the router listens for its workers (HOST:PORT)
    max_batch: int = 32
    worker_threads: int = 1  # torch threads per worker process
    trace_maxlen: int = 50_000
    weights: str | None = None  # None: the weights shipped in the package
    release_timeout_s: float = 5.0  # decode gives up on a transfer after this long
    inject: tuple[str, ...] = ()  # fault injections (faults.py), for tests and labs only
    worker_restarts: int = 3  # times the router restarts its workers after one dies (0: never) ...
    worker_restart_window_s: float = DEFAULT_RESTART_WINDOW_S  # ... within any this many seconds
    # How the errors below name a setting: "flag" (--context-length) or "key" ("context_length",
    # for settings read from a JSON file: `from_json`). Not a setting itself.
    said_as: InitVar[str] = "flag"

    def __post_init__(self, said_as: str) -> None:
        spell: Callable[[str], str] = _key if said_as == "key" else _flag
        # A config file (`--config`) can hold any JSON: strings first, so later checks can use them.
        for setting in ("host", "transfer_host", "worker_listen", "device", "attention", "admin_key"):
            value = getattr(self, setting)
            if not isinstance(value, str) and not (setting == "admin_key" and value is None):
                raise ConfigError(f"{spell(setting)} must be a string, got {value!r}")
        _whole(spell("port"), self.port, 0)
        if self.port > 65535:
            raise ConfigError(f"{spell('port')} {self.port} is not a TCP port (0-65535)")
        _whole(spell("context_length"), self.context_length)
        _whole(spell("page_size"), self.page_size)
        _whole(spell("worker_threads"), self.worker_threads)
        _whole(spell("trace_maxlen"), self.trace_maxlen)
        if self.weights is not None and not isinstance(self.weights, str):
            raise ConfigError(f"{spell('weights')} must be the path of a weights file, got {self.weights!r}")
        if self.weights is not None and not os.path.isfile(self.weights):
            raise ConfigError(
                f"model weights not found at {self.weights}: "
                "run `python -m minigrid_engine.train` to make them"
            )
        _whole(spell("prefill_pool_tokens"), self.prefill_pool_tokens)
        _whole(spell("decode_pool_tokens"), self.decode_pool_tokens)
        _whole(spell("max_batch"), self.max_batch)
        for role in ROLES:
            check_pool_size(
                self.pool_tokens(role), self.page_size, spell(f"{role}_pool_tokens"), spell("page_size")
            )
        for role, n in (("prefill", self.prefill_workers), ("decode", self.decode_workers)):
            _whole(spell(f"{role}_workers"), n)
            if n > MAX_WORKERS_PER_ROLE:
                raise ConfigError(
                    f"{spell(f'{role}_workers')} {n}: at most {MAX_WORKERS_PER_ROLE} workers per role"
                )
        for role in self.remote:
            if role not in ROLES:
                raise ConfigError(f"{spell('remote')} {role!r}: choose prefill or decode")
        if len(set(self.remote)) == len(ROLES):
            raise ConfigError(
                f"{spell('remote')} names both roles: the router's host runs at least one of them"
            )
        host, sep, port = self.worker_listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(
                f"{spell('worker_listen')} {self.worker_listen!r} must be HOST:PORT, e.g. 10.0.0.1:7100"
            )
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"{spell('device')} {self.device!r}: choose cpu or cuda")
        if self.attention not in ("torch", "triton"):
            raise ConfigError(f"{spell('attention')} {self.attention!r}: choose torch or triton")
        if self.attention == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError(
                f"{spell('attention')} triton: Triton is not installed ({TRITON_WHEELS}); "
                f"use {spell('attention')} torch"
            )
        if not self.tenants:
            example = '"tenants": {"NAME": "KEY"}' if said_as == "key" else "--tenants NAME:KEY"
            raise ConfigError(f"at least one tenant is needed ({example})")
        for name, key in self.tenants.items():
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise ConfigError(f"tenant name {name!r}: give a name without spaces around it")
            bad = next((c for c in name if not c.isprintable()), None)
            if bad is not None:
                raise ConfigError(
                    f"tenant name {name!r} holds the character U+{ord(bad):04X}: use printable text"
                )
            if not key.strip():  # an empty key would let "Authorization: Bearer " in as that tenant
                raise ConfigError(f"tenant {name!r} has an empty API key")
            check_key_text(f"the API key of tenant {name!r}", key)
            if name == ADMIN:
                raise ConfigError(
                    f"a tenant may not be called {ADMIN!r}: the name stands for the admin key "
                    f"({spell('admin_key')})"
                )
        check_admin_key(self.tenants, self.admin_key)
        _whole(spell("worker_restarts"), self.worker_restarts, 0)
        if self.worker_restarts > MAX_WORKER_RESTARTS:
            raise ConfigError(
                f"{spell('worker_restarts')} {self.worker_restarts}: at most {MAX_WORKER_RESTARTS} "
                "(0 turns restarts off)"
            )
        window = self.worker_restart_window_s
        if (
            isinstance(window, bool)
            or not isinstance(window, int | float)
            or not 1 <= window <= MAX_RESTART_WINDOW_S
        ):
            raise ConfigError(
                f"{spell('worker_restart_window_s')} {window!r} must be between 1 and "
                f"{MAX_RESTART_WINDOW_S:g} seconds (a week)"
            )
        timeout = self.release_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
            raise ConfigError(
                f"{spell('release_timeout_s')} {timeout!r} must be a number of seconds between 0 and 3600"
            )

    def workers(self, role: str) -> int:
        """How many worker processes `role` has."""
        return self.prefill_workers if role == "prefill" else self.decode_workers

    def pool_tokens(self, role: str) -> int:
        """The size of `role`'s KV pool, in tokens."""
        return self.prefill_pool_tokens if role == "prefill" else self.decode_pool_tokens

    def short_of_context(self, role: str) -> str | None:
        """What `capacity-check` refuses in `role`'s pool (it cannot hold one full context), or None."""
        tokens = self.pool_tokens(role)
        if tokens >= self.context_length:
            return None
        return (
            f"the {role} KV pool holds {counted(tokens, 'token')}, fewer than the context length of "
            f"{counted(self.context_length, 'token')}"
        )

    def capacity_refusal(self, roles: Sequence[str]) -> str | None:
        """What fix `capacity-check` says of `roles`' pools where they cannot hold a full
        context: one sentence for all of them, each pool and its flag named; None when all can."""
        short = [role for role in roles if self.short_of_context(role)]
        if not short:
            return None
        pools = " and the ".join(
            f"{role} KV pool" + (" holds" if i == 0 else "") + f" {counted(self.pool_tokens(role), 'token')}"
            for i, role in enumerate(short)
        )
        flags = " and ".join(f"--{role}-pool-tokens" for role in short)
        # the corrected preset changes the prefill pool only: worth naming when that is what is short
        hint = " (--preset corrected)" if "prefill" in short and self.corrected_fits else ""
        return (
            f"capacity-check: the {pools}, fewer than the context length of "
            f"{counted(self.context_length, 'token')}: a valid prompt would not fit. Raise {flags} to "
            f"at least {self.context_length}{hint} or lower --context-length; --fixes none runs the "
            "faulty configuration on purpose."
        )

    @property
    def corrected_fits(self) -> bool:
        """Whether `--preset corrected`'s pool holds this context (worth naming in a hint)."""
        return self.context_length <= CORRECTED_POOL

    def rank(self, role: str, index: int) -> int:
        """The torch.distributed rank of worker `index` of `role`: prefill first, then decode."""
        return index if role == "prefill" else self.prefill_workers + index

    @property
    def world_size(self) -> int:
        return self.prefill_workers + self.decode_workers

    @property
    def pages_per_context(self) -> int:
        return math.ceil(self.context_length / self.page_size)

    def with_(self, **changes: Any) -> ServeConfig:
        if isinstance(changes.get("fixes"), str):
            changes["fixes"] = parse_fixes(changes["fixes"])
        return replace(self, **changes)

    def to_json(self) -> str:
        d = asdict(self)
        d["fixes"] = str(self.fixes)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        """The settings `to_json` wrote (or a person: any field left out keeps its default)."""
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"the settings must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}: see minigrid_engine.config.ServeConfig"
            )
        if "fixes" in d:
            d["fixes"] = parse_fixes(d["fixes"], what=_key("fixes"))
        for name in ("inject", "remote"):
            if name in d:
                if not isinstance(d[name], list) or not all(isinstance(x, str) for x in d[name]):
                    raise ConfigError(f"{_key(name)} must be a list of strings, got {d[name]!r}")
                d[name] = tuple(d[name])
        if "tenants" in d and not (
            isinstance(d["tenants"], dict) and all(isinstance(v, str) for v in d["tenants"].values())
        ):
            raise ConfigError(f"{_key('tenants')} must map names to API keys, got {d['tenants']!r}")
        return cls(**d, said_as="key")  # its errors name the file's keys, not the flags


def incident_preset(**changes: Any) -> ServeConfig:
    """The incident's configuration, faulty engine: context 1,024 over a 665-token prefill pool."""
    return ServeConfig().with_(**changes)


def corrected_preset(**changes: Any) -> ServeConfig:
    """Cloudflare's corrected configuration: a 2,048-token pool, about twice the context."""
    return ServeConfig(prefill_pool_tokens=CORRECTED_POOL, fixes=Fixes.all()).with_(**changes)
