"""The Python handle for notebooks: start the engine in the background and talk to it.

    from minigrid_engine.handle import Engine
    eng = Engine.start(fixes="none")            # router + prefill + decode processes, embedded
    r = eng.complete("alice", "ALICE card QZ7K2M9P; " * 20, max_tokens=24)
    r.status, r.text, r.prompt_tokens, r.ttft_s
    eng.pools()["decode"][:3]                    # owner and last writer of every page
    eng.trace()                                  # every reserve / write / read / release event
    eng.stop()

It runs `minigrid serve` as a child process on a free loopback port (no server to start by
hand), with an admin key of its own so it may read the pools and the whole trace.
`Engine.connect(url, key)` talks to an engine someone else started (workshop mode: the room's
engine; `MINIGRID_URL` and `MINIGRID_API_KEY` stand in for the arguments):

    eng = Engine.connect("http://10.0.0.5:8000", "sk-...")   # the key on your slip
    eng.tenant                                               # 'student07'
    eng.complete(eng.tenant, "...")                          # as yourself; eng.trace(): your own events
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minigrid_engine.config import DEFAULT_TENANTS, ServeConfig, check_key_text, incident_preset
from minigrid_engine.errors import MinigridError, error_message
from minigrid_engine.fixes import Fixes, parse_fixes
from minigrid_engine.forensics import pages_read
from minigrid_engine.router import REFUSED_TAIL, free_port


@dataclass(frozen=True)
class Reply:
    """What a client saw for one completion request."""

    status: int
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    request_id: str | None
    ttft_s: float | None
    latency_s: float
    error: dict[str, Any] | None = None
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200


class EngineNotReady(MinigridError):
    """The engine did not come up: it exited, stayed unhealthy, or its handle was stopped."""


class EngineRefusedToStart(EngineNotReady):
    """A worker looked at its settings and refused them (capacity-check and a pool shorter than the
    context, a pool this machine cannot hold): `reason` is its one-line explanation, the outcome a
    lab prints instead of a traceback. A crash during startup stays `EngineNotReady`."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


_SERVE_ERROR = "minigrid serve: error: "


class EngineUnreachable(MinigridError):
    """The engine did not answer: not running (any more), a wrong URL, or this handle stopped."""


class _Client(httpx.Client):
    """httpx, with the handle's failures said in the handle's terms instead of httpx's."""

    hint = "is it still running? Engine.start() starts a new one"  # a connected handle says its own

    def build_request(self, *args: Any, **kwargs: Any) -> httpx.Request:
        try:
            return super().build_request(*args, **kwargs)
        except (TypeError, ValueError) as exc:  # JSON cannot carry it: bytes, NaN, a set ...
            raise MinigridError(f"this request cannot be sent as JSON: {exc}") from None

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        if self.is_closed:
            raise EngineUnreachable("this engine handle was stopped: start or connect a new one")
        try:
            return super().send(request, **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnreachable(
                f"cannot reach the engine at {self.base_url}: {exc or type(exc).__name__} ({self.hint})"
            ) from None


class EngineRefused(MinigridError):
    """The engine answered with an error (a wrong key, an admin-only view, a bad value)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _refused(r: httpx.Response, what: str) -> EngineRefused:
    msg = error_message(r.text) or r.text[:200]
    return EngineRefused(r.status_code, f"{what}: HTTP {r.status_code}: {msg}")


class Engine:
    def __init__(
        self,
        url: str,
        tenants: dict[str, str],
        admin_key: str | None,
        proc: subprocess.Popen[bytes] | None = None,
        log_path: Path | None = None,
        cfg: ServeConfig | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.tenants = tenants
        self.admin_key = admin_key
        self.proc = proc
        self.log_path = log_path
        self.cfg = cfg
        self.tenant = "admin" if admin_key else None  # who `connect(url, key)` is; see trace()
        self.http = _Client(base_url=self.url, timeout=120)
        if proc is None:  # an engine someone else runs (a workshop room, another host)
            self.http.hint = "is the URL right, and is the engine running? ask whoever runs it"

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        cfg: ServeConfig | None = None,
        *,
        fixes: str | Fixes | None = None,
        timeout_s: float = 120,
        **changes: Any,
    ) -> Engine:
        """Start router, prefill and decode in the background; returns once /health is 200."""
        cfg = cfg or incident_preset()
        if fixes is not None:
            changes["fixes"] = fixes if isinstance(fixes, Fixes) else parse_fixes(fixes)
        admin = secrets.token_hex(16)
        cfg = cfg.with_(port=free_port(), admin_key=admin, **changes)
        log = Path(tempfile.mkstemp(prefix="minigrid-", suffix=".log")[1])
        # Every setting goes over in one file (mode 0600, as mkstemp makes it: it holds the keys),
        # read once at startup and removed once the engine is up or gone.
        fd, settings = tempfile.mkstemp(prefix="minigrid-config-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(cfg.to_json())
        cmd = [sys.executable, "-m", "minigrid_engine.cli", "serve", "--config", settings]
        env = dict(os.environ, MINIGRID_ADMIN_KEY=admin, PYTHONUNBUFFERED="1", MINIGRID_EXIT_WITH_PARENT="1")
        if cfg.inject:  # asked for by name in code: the notebook or test means it
            env["MINIGRID_FAULT_INJECTION"] = "1"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        eng = cls(f"http://{cfg.host}:{cfg.port}", dict(cfg.tenants), admin, proc, log, cfg)
        atexit.register(eng.stop)
        try:
            eng.wait_ready(timeout_s)
        except BaseException:  # not ready in time, or interrupted: no engine is left behind
            eng.stop()
            raise
        finally:
            Path(settings).unlink(missing_ok=True)
        return eng

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        api_key: str | None = None,
        *,
        tenants: dict[str, str] | None = None,
        admin_key: str | None = None,
        timeout_s: float = 10,
    ) -> Engine:
        """Talk to an engine someone else started, as the owner of `api_key` (a student's key, or
        the instructor's admin key), or with several `tenants`' keys. `url` and `api_key` default
        to `$MINIGRID_URL` and `$MINIGRID_API_KEY`. Checks the key at once: a wrong key or an
        unreachable URL is a clear error here, not at the first request."""
        url = url or os.environ.get("MINIGRID_URL")
        api_key = api_key or os.environ.get("MINIGRID_API_KEY") or None
        if not url:
            raise MinigridError("no engine URL: pass Engine.connect(url, key) or set MINIGRID_URL")
        if not url.startswith(("http://", "https://")):
            raise MinigridError(f"engine URL {url!r} must start with http:// or https://")
        if api_key is None and not tenants and not admin_key:
            raise MinigridError("no API key: pass Engine.connect(url, key) or set MINIGRID_API_KEY")
        keys = {"the API key": api_key, "the admin key": admin_key}
        keys |= {f"the key of tenant {n!r}": k for n, k in (tenants or {}).items()}
        for whose, key in keys.items():
            if key is not None:  # a header carries printable ASCII only: say so, not UnicodeEncodeError
                check_key_text(whose, key)
        eng = cls(url, dict(tenants or {}), admin_key)
        if api_key is None:
            return eng
        try:
            r = eng.http.get(
                "/v1/minigrid/config", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s
            )
        except EngineUnreachable:  # it says where and why
            eng.http.close()
            raise
        except httpx.HTTPError as exc:
            eng.http.close()
            raise MinigridError(
                f"cannot reach the engine at {eng.url}: {exc} (is the URL right, and is the engine running?)"
            ) from None
        if r.status_code == 401:
            eng.http.close()
            raise MinigridError(
                f"the engine at {eng.url} refused this API key (401): check the key you were given"
            )
        if r.status_code != 200:
            eng.http.close()
            raise _refused(r, f"the engine at {eng.url} did not answer /v1/minigrid/config")
        you = r.json()["you"]
        if you == "admin":
            eng.admin_key, eng.tenant = api_key, "admin"
        else:
            eng.tenant = you
            eng.tenants[you] = api_key
        return eng

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = self.log()
                said = f"the engine exited with status {self.proc.returncode}:\n{log}"
                # a worker's refusal of its settings, not a crash (that stays EngineNotReady)
                refusals = [
                    ln for ln in log.splitlines() if ln.startswith(_SERVE_ERROR) and REFUSED_TAIL in ln
                ]
                if self.proc.returncode == 2 and refusals:
                    raise EngineRefusedToStart(said, refusals[-1].partition(REFUSED_TAIL)[2])
                raise EngineNotReady(said)
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except (httpx.HTTPError, EngineUnreachable):
                if self.http.is_closed:
                    raise EngineNotReady("this engine handle was stopped while it waited") from None
            time.sleep(0.1)
        raise EngineNotReady(f"the engine was not healthy after {timeout_s:g} s:\n{self.log()}")

    def stop(self, timeout_s: float = 15) -> None:
        """Stop all three processes (SIGTERM, then SIGKILL after `timeout_s`)."""
        if self.proc is not None:
            stop_process(self.proc, timeout_s)
        self.http.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        """Everything the engine printed (startup lines: the pool sizes)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    # -- requests ------------------------------------------------------------------------
    def _key(self, tenant: str) -> str:
        if tenant == "admin" and self.admin_key:
            return self.admin_key
        try:
            return self.tenants[tenant]
        except KeyError:
            raise MinigridError(
                f"unknown tenant {tenant!r}: this engine has {', '.join(self.tenants)}"
            ) from None

    def complete(self, tenant: str, prompt: str, max_tokens: int = 16, **body: Any) -> Reply:
        """POST /v1/completions as `tenant`; returns what the client saw, errors included.
        Extra OpenAI fields go in `body` (`stop=";"`, `temperature=0.7`); to stream, `stream()`."""
        if body.get("stream"):
            raise MinigridError("complete() returns the whole answer: use Engine.stream() to stream")
        t0 = time.perf_counter()
        r = self.http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, **body},
            headers={"Authorization": f"Bearer {self._key(tenant)}"},
        )
        latency = time.perf_counter() - t0
        data = r.json()
        if r.status_code != 200:
            return Reply(r.status_code, "", None, None, None, None, latency, data.get("error"), data)
        usage, extra = data["usage"], data.get("minigrid", {})
        return Reply(
            200,
            data["choices"][0]["text"],
            usage["prompt_tokens"],
            usage["completion_tokens"],
            extra.get("request_id"),
            extra.get("ttft_s"),
            latency,
            None,
            data,
        )

    def stream(self, tenant: str, prompt: str, max_tokens: int = 16, **body: Any) -> Iterator[str]:
        """POST /v1/completions with `"stream": true` as `tenant`: the answer's text, piece by piece
        as decode makes it. An error (before or during the stream) raises `MinigridError`."""
        payload = {"prompt": prompt, "max_tokens": max_tokens, **body, "stream": True}
        headers = {"Authorization": f"Bearer {self._key(tenant)}"}
        with self.http.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise _refused(r, "the completion")
            try:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise MinigridError(f"the stream failed: {event['error'].get('message')}")
                    if event["choices"] and event["choices"][0]["text"]:
                        yield event["choices"][0]["text"]
            except httpx.TransportError as exc:  # the engine went away mid-answer
                raise EngineUnreachable(f"the stream from {self.url} broke off: {exc}") from None

    def pools(self) -> dict[str, list[dict[str, Any]]]:
        """Owner table of each role: owner, last writer and staleness of every page (admin key)."""
        if not self.admin_key:
            raise MinigridError("the page pools are shown to the admin (instructor) key only")
        r = self.http.get("/v1/minigrid/pools", headers={"Authorization": f"Bearer {self._key('admin')}"})
        if r.status_code != 200:
            raise _refused(r, "the page pools")
        return dict(r.json())

    def trace(self, since: int = 0, tenant: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Trace events of each role (the admin sees all; a tenant only its own). `tenant` defaults
        to whoever this handle is: the admin, or the student whose key `connect` was given."""
        r = self.http.get(
            "/v1/minigrid/trace",
            params={"since": since},
            headers={"Authorization": f"Bearer {self._key(tenant or self.tenant or 'admin')}"},
        )
        if r.status_code != 200:
            raise _refused(r, "the trace")
        return dict(r.json())

    def config(self, tenant: str | None = None) -> dict[str, Any]:
        """`/v1/minigrid/config` as `tenant` (default: this handle's identity): numbers and fixes."""
        r = self.http.get(
            "/v1/minigrid/config",
            headers={"Authorization": f"Bearer {self._key(tenant or self.tenant or 'admin')}"},
        )
        if r.status_code != 200:
            raise _refused(r, "the configuration")
        return dict(r.json())

    def set_fixes(self, fixes: str | list[str]) -> dict[str, Any]:
        """Switch the running engine's fixes (admin key): "none", a list of names, or "a,b".
        The engine refuses what cannot hold for its pools (409) and names the valid fixes (400)."""
        if not self.admin_key:
            raise MinigridError("only the admin (instructor) key may switch the fixes")
        r = self.http.post(
            "/v1/minigrid/fixes", json={"fixes": fixes}, headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        if r.status_code != 200:
            raise _refused(r, f"switching the fixes to {fixes!r}")
        if self.cfg is not None:
            self.cfg = self.cfg.with_(fixes=",".join(r.json()["fixes"]) or "none")
        return dict(r.json())

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {'name{label="v"}': value}."""
        text = self.http.get("/metrics").text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def health(self) -> tuple[int, dict[str, Any]]:
        r = self.http.get("/health")
        return r.status_code, r.json()

    def wait_health(self, *statuses: str, timeout_s: float = 120) -> dict[str, Any]:
        """Poll `/health` until its status is one of `statuses` (ok, restarting, down); its body.
        Raises `EngineNotReady` with the last body seen when it does not get there in time."""
        deadline = time.monotonic() + timeout_s
        body: dict[str, Any] = {}
        while True:
            try:
                body = self.health()[1]
            except httpx.HTTPError as exc:
                body = {"error": str(exc)}
            if body.get("status") in statuses:
                return body
            if time.monotonic() > deadline:
                wanted = " or ".join(statuses)
                raise EngineNotReady(f"/health did not say {wanted} in {timeout_s:g} s: {body}")
            time.sleep(0.05)

    def worker_pids(self) -> dict[str, int]:
        """Pid of each worker, by role (by worker id, e.g. decode-1, where a role has several)."""
        return {name: w["pid"] for name, w in self.health()[1]["workers"].items()}

    def pages_read_by(self, request_id: str) -> Iterator[dict[str, Any]]:
        """Decode pages the request's attention read, with who last wrote each before it."""
        yield from pages_read(self.trace()["decode"], request_id)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 15) -> None:
    """SIGTERM `proc` if it still runs, then SIGKILL it after `timeout_s`; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = [
    "DEFAULT_TENANTS",
    "Engine",
    "EngineNotReady",
    "EngineRefused",
    "EngineRefusedToStart",
    "EngineUnreachable",
    "Reply",
    "pages_read",
]
