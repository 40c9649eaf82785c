"""`minigrid audit --url URL [--url URL ...]`: does every KV pool of the *running* deployment cover
the context length it advertises?

The operator's check of INCIDENT.md's first question, made from what the servers themselves
export rather than from a configuration file that may not be what is deployed. It reads:

- a minigrid engine: `minigrid_kv_pool_capacity_tokens{role}` and `minigrid_context_length_tokens`
  on `/metrics`;
- an SGLang server: the `sglang:max_total_num_tokens` and `sglang:context_len` gauges on `/metrics`
  (exported with `--enable-metrics`, one sample per rank, labelled with `engine_type` unified,
  prefill or decode; where the label is missing or says unified, the role is `/server_info`'s
  `disaggregation_mode`), else `max_total_num_tokens`, `context_length` and `disaggregation_mode` from
  `/server_info` (`/get_server_info` before SGLang 0.5), the context falling back to
  `/v1/models`' `max_model_len`;
- a vLLM server: `num_gpu_blocks` x `block_size` from `vllm:cache_config_info` on `/metrics`, the
  context from `/v1/models`' `max_model_len` (vLLM refuses to start when one sequence of that length
  cannot fit, but the audit checks what runs, and each server of a prefill/decode pair on its own).

A disaggregated SGLang deployment has one server per role: give each with its own `--url` (its root;
the `/v1` address OpenAI clients and `minigrid probe` take, or an endpoint such as `/v1/models` or
`/metrics`, is read as the root, and a server given twice is read once). Every pool
is held to the longest context any of them advertises (or `--context-length`), because a prompt the
prefill side accepts must also fit the decode pool it is sent to. Where a role runs on several
ranks, its pool is the smallest rank's: a request may land on any of them.

It also answers INCIDENT.md's fifth question for what it reads: an SGLang server in prefill or
decode mode older than 0.5.22, the release that completes the upstream fixes, fails the audit.

Exit status: 0 every pool covers the context and no disaggregated server runs a release before the
fixes, 1 otherwise, 2 a server could not be read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from packaging.version import InvalidVersion, Version
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from minigrid_engine.errors import MinigridError

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
# a server's own endpoints: pasted, they are read as its root
ROOT_ENDPOINTS = ("metrics", "health", *(p.lstrip("/") for p in SERVER_INFO_PATHS))
OPENAI_ENDPOINTS = ("models", "completions", "chat", "embeddings")  # after /v1: the root is before it
FIXED_SGLANG = Version("0.5.22")  # INCIDENT.md: operators of disaggregated SGLang should run it or later
DISAGGREGATED_ROLES = ("prefill", "decode")
# What goes wrong when a pool of that role is smaller than the context: prefill builds the prompt's
# KV cache, decode receives those pages and appends the answer's, a unified pool holds both.
SHORT_POOL_CONSEQUENCE = {
    "prefill": "prompts longer than the pool can be accepted but cannot be prefilled",
    "decode": "a prompt plus its answer longer than the pool cannot be decoded, "
    "and a longer prompt's pages cannot be received from prefill",
    "unified": "a prompt plus its answer longer than the pool cannot be held",
}


@dataclass(frozen=True)
class PoolFinding:
    role: str
    capacity_tokens: int
    context_length: int
    source: str = ""  # where the capacity was read: "http://h:8000/metrics (minigrid)"
    engine: str = "minigrid"  # the server that stated it: "minigrid", "sglang" or "vllm"

    @property
    def covers(self) -> bool:
        return self.capacity_tokens >= self.context_length

    @property
    def shortfall_tokens(self) -> int:
        return max(0, self.context_length - self.capacity_tokens)

    @property
    def consequence(self) -> str:
        """What a too-small pool of this role does to a long request (a role not named: unified)."""
        if self.role == "prefill" and self.capacity_tokens >= self.context_length - 1:
            # the API keeps a token of the context for the answer: the longest prompt just fits
            return (
                "the longest prompt the API accepts just fits, with no margin; "
                "the rule is a pool of at least the context"
            )
        return SHORT_POOL_CONSEQUENCE.get(self.role, SHORT_POOL_CONSEQUENCE["unified"])


@dataclass(frozen=True)
class ServerReading:
    """What one server states about itself: its pools by role and the context it advertises."""

    url: str
    source: str
    pools: dict[str, int]
    context_length: int | None
    engine: str = "minigrid"  # or "sglang", "vllm"
    version: str | None = None  # the release the server states, when it states one


@dataclass(frozen=True)
class VersionFinding:
    """An SGLang server in a disaggregated role, and whether its release has the upstream fixes."""

    url: str
    role: str
    version: str | None

    @property
    def fixed(self) -> bool | None:
        """True from 0.5.22 on (its pre-releases are before it), False before, None when not stated."""
        if self.version is None:
            return None
        try:
            return Version(self.version) >= FIXED_SGLANG
        except InvalidVersion:
            return None

    def text(self) -> str:
        if self.fixed is None:
            said = "states no version" if self.version is None else f"states version {self.version!r}"
            return f"  {self.role:8s} SGLang at {self.url} {said}: check it runs {FIXED_SGLANG} or later"
        verdict = "ok" if self.fixed else f"BEFORE {FIXED_SGLANG}, the release with every disaggregated fix"
        return f"  {self.role:8s} SGLang {self.version} at {self.url}  {verdict}"


@dataclass(frozen=True)
class AuditReport:
    urls: tuple[str, ...]
    context_length: int
    pools: list[PoolFinding]
    advertised: dict[str, int | None]  # each server's own context length, by URL
    versions: list[VersionFinding] = field(default_factory=list)

    @property
    def url(self) -> str:
        return ", ".join(self.urls)

    @property
    def ok(self) -> bool:
        pools_ok = bool(self.pools) and all(p.covers for p in self.pools)
        return pools_ok and not any(v.fixed is False for v in self.versions)

    def to_json(self) -> str:
        return json.dumps(
            {
                "url": self.url,
                "urls": list(self.urls),
                "ok": self.ok,
                "context_length_tokens": self.context_length,
                "advertised_context_length_tokens": self.advertised,
                "pools": [
                    asdict(p) | {"covers": p.covers, "shortfall_tokens": p.shortfall_tokens}
                    for p in self.pools
                ],
                "sglang_versions": [
                    asdict(v) | {"fixed": v.fixed, "fixed_from": str(FIXED_SGLANG)} for v in self.versions
                ],
            },
            indent=2,
        )

    def text(self) -> str:
        lines = [f"minigrid audit {self.url}: context length {self.context_length} tokens"]
        if len({c for c in self.advertised.values() if c is not None}) > 1:
            stated = ", ".join(f"{u} {c}" for u, c in self.advertised.items())
            lines.append(f"  the servers advertise different context lengths ({stated}): the largest applies")
        show_source = len(self.urls) > 1 or any(p.engine != "minigrid" for p in self.pools)
        for p in self.pools:
            verdict = (
                "ok"
                if p.covers
                else f"TOO SMALL by {p.shortfall_tokens:,} token{'s' * (p.shortfall_tokens != 1)}"
            )
            where = f"  [{p.source}]" if show_source else ""
            lines.append(f"  {p.role:8s} KV pool {p.capacity_tokens:>9,} tokens  {verdict}{where}")
        lines += [v.text() for v in self.versions]
        if self.ok:
            lines.append("PASS: every KV pool holds a full-context prompt")
            return "\n".join(lines)
        faults = [
            f"the {p.role} pool holds {p.capacity_tokens} tokens < context length {p.context_length}: "
            + p.consequence
            for p in self.pools
            if not p.covers
        ]
        old = [v for v in self.versions if v.fixed is False]
        if old:
            faults.append(
                "; ".join(f"the {v.role} server runs SGLang {v.version}" for v in old)
                + f": disaggregated SGLang should run {FIXED_SGLANG} or later"
            )
        lines.append("FAIL: " + "; ".join(faults))
        return "\n".join(lines)


def metric_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text, parsed once for all the readers below (ValueError if it is
    not Prometheus text)."""
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def parse_metrics(samples: Iterable[Sample]) -> tuple[int | None, dict[str, int]]:
    """A minigrid engine's context length and pool capacities by role, from its metrics."""
    context: int | None = None
    pools: dict[str, int] = {}
    for s in samples:
        if s.name == "minigrid_context_length_tokens":
            context = int(s.value)
        elif s.name == "minigrid_kv_pool_capacity_tokens":
            pools[s.labels.get("role", "?")] = int(s.value)
    return context, pools


def parse_sglang_metrics(
    samples: Iterable[Sample], default_role: str = "unified"
) -> tuple[int | None, dict[str, int]]:
    """SGLang's gauges: the smallest rank's pool per `engine_type`, the largest context advertised."""
    contexts: list[int] = []
    pools: dict[str, int] = {}
    for s in samples:
        if s.name == "sglang:context_len":
            contexts.append(int(s.value))
        elif s.name == "sglang:max_total_num_tokens":
            role = s.labels.get("engine_type") or default_role
            pools[role] = min(pools.get(role, int(s.value)), int(s.value))
    return (max(contexts) if contexts else None), pools


def parse_vllm_metrics(samples: Iterable[Sample]) -> dict[str, int]:
    """vLLM's `vllm:cache_config_info` labels: `num_gpu_blocks` x `block_size`, the smallest engine's."""
    pools: dict[str, int] = {}
    for s in samples:
        if s.name != "vllm:cache_config_info":
            continue
        blocks, size = s.labels.get("num_gpu_blocks", ""), s.labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit() and int(blocks) * int(size) > 0:
            tokens = int(blocks) * int(size)
            pools["unified"] = min(pools.get("unified", tokens), tokens)
    return pools


def _whole(value: Any) -> int | None:
    """A positive whole number from JSON, else None (null, "n/a", true, 0 all mean: not stated)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return int(value)


def _smallest(values: Iterable[Any]) -> int | None:
    found = [v for v in map(_whole, values) if v is not None]
    return min(found) if found else None


def parse_sglang_server_info(info: dict[str, Any]) -> tuple[int | None, dict[str, int]]:
    """SGLang's `/server_info`: the pool (top level, else the smallest rank's) and the context length."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    capacity = _whole(info.get("max_total_num_tokens"))
    if capacity is None:
        capacity = _smallest(s.get("max_total_num_tokens") for s in states)
    if capacity is None:
        capacity = _smallest((s.get("memory_usage") or {}).get("token_capacity") for s in states)
    context = _whole(info.get("context_length"))
    if context is None:
        context = _smallest(s.get("context_length") for s in states)
    role = _disaggregation_mode(info) or "unified"
    return context, ({role: capacity} if capacity is not None else {})


def _disaggregation_mode(info: dict[str, Any] | None) -> str | None:
    """The role `/server_info` says the server runs in, prefill or decode; None for any other."""
    mode = info.get("disaggregation_mode") if info is not None else None
    return mode if mode in DISAGGREGATED_ROLES else None


def _in_mode(pools: dict[str, int], mode: str | None) -> dict[str, int]:
    """The gauges' pools, a unified one (no `engine_type` label, as older releases export, or the
    label at unified) renamed to the mode the server runs in: a prefill server's pool is audited, and
    its release judged, as prefill's."""
    if mode is None:
        return pools
    found: dict[str, int] = {}
    for role, capacity in pools.items():
        role = mode if role == "unified" else role
        found[role] = min(found.get(role, capacity), capacity)
    return found


class _Reader:
    """GETs against one server, every failure turned into a MinigridError that names the address."""

    def __init__(self, client: httpx.Client, base: str) -> None:
        self.client, self.base = client, base
        self.keyed = "authorization" in client.headers  # --api-key given

    def get(self, path: str) -> httpx.Response:
        target = self.base + path
        try:
            r = self.client.get(target)
        except httpx.InvalidURL as exc:
            raise MinigridError(f"{self.base!r} is not a URL the audit can read: {exc}") from None
        except httpx.HTTPError as exc:
            raise MinigridError(f"cannot read {target}: {exc}") from None
        if r.status_code in (401, 403):
            said = (
                "the key given with --api-key was refused"
                if self.keyed
                else "give the server's key with --api-key"
            )
            raise MinigridError(f"{target} answered HTTP {r.status_code}: {said}")
        return r

    def json(self, path: str) -> dict[str, Any] | None:
        r = self.get(path)
        if r.status_code != 200:
            return None
        try:
            body = r.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def model_context(self) -> int | None:
        """The largest `max_model_len` `/v1/models` lists (SGLang and vLLM both state it there)."""
        body = self.json("/v1/models")
        models = body.get("data") if body else None
        if not isinstance(models, list):
            return None
        found = [_whole(m.get("max_model_len")) for m in models if isinstance(m, dict)]
        return max((c for c in found if c is not None), default=None)


def _server_info(reader: _Reader) -> tuple[str, dict[str, Any]] | None:
    for path in SERVER_INFO_PATHS:
        info = reader.json(path)
        if info is not None:
            return path, info
    return None


def _sglang_reading(
    reader: _Reader, source: str, pools: dict[str, int], context: int | None, info: dict[str, Any] | None
) -> ServerReading:
    """An SGLang server's reading, its role, context and version completed from /server_info and
    /v1/models."""
    if context is None and info is not None:
        context = parse_sglang_server_info(info)[0]
    version = info.get("version") if info is not None else None
    return ServerReading(
        reader.base,
        source,
        _in_mode(pools, _disaggregation_mode(info)),
        context or reader.model_context(),
        engine="sglang",
        version=version if isinstance(version, str) and version else None,
    )


def server_root(url: str) -> str:
    """The server's root from what an operator may paste: `http://h:30000/`, an endpoint of it
    (`.../metrics`, `.../health`, `.../server_info`), or the OpenAI base URL `.../v1` that
    `minigrid probe` and OpenAI clients take, alone or with an endpoint after it (`/v1/models`).
    A `v1` elsewhere in the path is part of the root (a gateway's `/v1/prefill` and `/v1/decode`
    are two servers), and a query or fragment is dropped."""
    base = url.rstrip("/")
    try:
        parts = urlsplit(base)
    except ValueError:
        return base  # not a URL: the first GET names it
    segments = parts.path.split("/")  # the path's, not a host's: http://v1:8000 stays as it is
    ends = [i for i, seg in enumerate(segments) if seg == "v1" and _endpoint_after(segments[i + 1 :])]
    if ends:
        segments = segments[: ends[-1]]
    elif segments[-1] in ROOT_ENDPOINTS:
        segments = segments[:-1]
    path = "/".join(segments).rstrip("/")
    return urlunsplit(parts._replace(path=path, query="", fragment="")).rstrip("/")


def _endpoint_after(rest: list[str]) -> bool:
    """`rest` (the path after a `v1`) is nothing, or an OpenAI or server endpoint."""
    return not rest or rest[0] in OPENAI_ENDPOINTS + ROOT_ENDPOINTS


def read_server(client: httpx.Client, url: str) -> ServerReading:
    """One server's pools and context: minigrid's metrics, SGLang's metrics, else SGLang's JSON."""
    base = server_root(url)
    reader = _Reader(client, base)
    r = reader.get("/metrics")
    why = f"/metrics answered HTTP {r.status_code}"
    if r.status_code == 200:
        try:
            samples = metric_samples(r.text)
            context, pools = parse_metrics(samples)
            if pools:
                if context is None:
                    raise MinigridError(
                        f"{base}/metrics has minigrid_kv_pool_capacity_tokens but no "
                        "minigrid_context_length_tokens"
                    )
                return ServerReading(base, f"{base}/metrics (minigrid)", pools, context)
            context, pools = parse_sglang_metrics(samples)
        except ValueError as exc:
            why = f"/metrics is not Prometheus text ({exc})"
        else:
            if pools:
                try:  # only the version and perhaps the context are left to find there
                    found = _server_info(reader)
                except MinigridError:  # a key-protected /server_info: the version goes unstated
                    found = None
                info = found[1] if found else None
                return _sglang_reading(reader, f"{base}/metrics (sglang)", pools, context, info)
            pools = parse_vllm_metrics(samples)
            if pools:
                return ServerReading(
                    base, f"{base}/metrics (vllm)", pools, reader.model_context(), engine="vllm"
                )
            why = (
                "/metrics has none of minigrid_kv_pool_capacity_tokens, sglang:max_total_num_tokens, "
                "vllm:cache_config_info"
            )
    found = _server_info(reader)
    if found is not None:
        path, info = found
        context, pools = parse_sglang_server_info(info)
        if pools:
            return _sglang_reading(reader, f"{base}{path} (sglang)", pools, context, info)
    raise MinigridError(
        f"{base}: {why}, and neither {' nor '.join(SERVER_INFO_PATHS)} states max_total_num_tokens: "
        "is this a minigrid engine, an SGLang or a vLLM server? (give each server, not a router in "
        "front of them; SGLang exports /metrics with --enable-metrics)"
    )


def audit(
    urls: str | Sequence[str],
    timeout_s: float = 10,
    *,
    api_key: str | None = None,
    context_length: int | None = None,
) -> AuditReport:
    """Read each server and hold every pool to the deployment's context length.

    `context_length` overrides what the servers advertise: the longest prompt the deployment's front
    door accepts, when that is set elsewhere (a gateway, a router's own limit).
    """
    urls = (urls,) if isinstance(urls, str) else tuple(urls)
    if not urls:
        raise MinigridError("give at least one --url to audit")
    roots = dict.fromkeys(server_root(u) for u in urls)  # a server given twice is read once
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        readings = [read_server(client, root) for root in roots]
    stated = [r.context_length for r in readings if r.context_length is not None]
    context = context_length or (max(stated) if stated else None)
    if context is None:
        raise MinigridError(
            f"{', '.join(r.url for r in readings)} state their KV pools but not their context length: "
            "give the longest prompt the deployment accepts with --context-length N"
        )
    pools = [
        PoolFinding(role, cap, context, r.source, r.engine)
        for r in readings
        for role, cap in sorted(r.pools.items())
    ]
    versions = [
        VersionFinding(r.url, role, r.version)
        for r in readings
        if r.engine == "sglang"
        for role in sorted(r.pools)
        if role in DISAGGREGATED_ROLES
    ]
    return AuditReport(
        tuple(r.url for r in readings),
        context,
        pools,
        {r.url: r.context_length for r in readings},
        versions,
    )
