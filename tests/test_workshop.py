"""Workshop mode: one engine for a room, a key per student, the instructor's live fixes switch.

One `minigrid serve --workshop 3` serves the whole module (about 30 s on 2 cores).
"""

from __future__ import annotations

import csv
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from minigrid_engine.cli import main
from minigrid_engine.errors import MinigridError
from minigrid_engine.handle import Engine, EngineRefused
from minigrid_engine.router import free_port
from minigrid_engine.workshop import (
    ROOM_FIXES,
    LeakSizes,
    Room,
    dialable_host,
    keys_paths,
    load_keys,
    oversized_prompt,
    secret_codes,
    secret_prompt,
    whose_secrets,
)


class Workshop:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, keys: Path, log: Path) -> None:
        self.proc, self.url, self.keys, self.log = proc, url, keys, log
        self.room: Room = load_keys(keys.with_suffix(".json"))

    def key(self, who: str) -> dict[str, str]:
        k = self.room.instructor_key if who == "instructor" else self.room.students[who]
        return {"Authorization": f"Bearer {k}"}


@pytest.fixture(scope="module")
def room(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workshop]:
    with serve_room(tmp_path_factory.mktemp("workshop")) as r:
        yield r


@contextmanager
def serve_room(d: Path, *flags: str) -> Iterator[Workshop]:
    """A three-student room on the incident's numbers, or on those `flags` give (serve's flags)."""
    d.mkdir(parents=True, exist_ok=True)
    keys, ready, log = d / "keys.csv", d / "ready", d / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "minigrid_engine.cli", "serve", "--workshop", "3"),
                *("--keys-file", str(keys), "--port", "0", "--ready-file", str(ready), *flags),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "MINIGRID_ADMIN_KEY"},
        )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield Workshop(proc, ready.read_text().strip(), keys, log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    "context, pool, page, secret, oversized, answer",
    [
        (1024, 665, 128, 560, 976, 48),  # the incident's numbers at the lab's scale
        (1024, 400, 64, 329, 976, 48),
        (2048, 1300, 128, 1116, 2000, 48),
        (1024, 1000, 128, 854, 1001, 23),  # just over the pool: a shorter answer fills the context
        (1024, 1023, 128, 874, None, 48),  # the pool holds the longest prompt the room accepts
        (128, 80, 16, 49, 96, 32),  # a small context: a shorter answer
    ],
)
def test_leak_sizes_follow_the_rooms_numbers(
    context: int, pool: int, page: int, secret: int, oversized: int | None, answer: int
) -> None:
    sizes = LeakSizes.of_room({"context_length": context, "prefill_pool_tokens": pool, "page_size": page})
    assert (sizes.secret_tokens, sizes.oversized_tokens, sizes.answer_tokens) == (secret, oversized, answer)
    assert sizes.secret_tokens + 24 <= pool  # a secret prompt and its answer fit prefill's pool
    if oversized is not None:
        assert pool < oversized and oversized + answer == context
        assert f"{-(-context // page)} pages of {page}" in sizes.describe()
        assert "decode reserved" in sizes.describe()
        fixed = LeakSizes.of_room(
            {
                "context_length": context,
                "prefill_pool_tokens": pool,
                "page_size": page,
                "fixes": ["owner-check"],
            }
        )
        assert "Without fixes" in fixed.describe() and "this room runs owner-check" in fixed.describe()
    else:
        assert "no oversized prompt" in sizes.describe()


def test_keys_file_is_private_complete_and_never_logged(room: Workshop) -> None:
    for p in (room.keys, room.keys.with_suffix(".json")):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    rows = list(csv.DictReader(room.keys.read_text().splitlines()))
    assert [r["name"] for r in rows] == ["instructor", "student01", "student02", "student03"]
    assert all(r["url"] == room.url for r in rows)
    keys = [r["key"] for r in rows]
    assert len(set(keys)) == 4 and all(k.startswith("sk-") and len(k) > 20 for k in keys)
    assert room.room.students == {r["name"]: r["key"] for r in rows if r["role"] == "student"}
    from_csv = load_keys(room.keys)  # the CSV reads back as the JSON does: the instructor apart
    assert (from_csv.students, from_csv.instructor_key) == (room.room.students, room.room.instructor_key)
    assert from_csv.instructor_key not in from_csv.students.values()
    log = room.log.read_text()
    assert str(room.keys) in log and room.url in log
    assert not any(k in log for k in keys), "a key was printed in the startup log"
    # the workers' command lines (readable by every local user) carry no key either
    for child in psutil.Process(room.proc.pid).children(recursive=True):
        assert not any(k in " ".join(child.cmdline()) for k in keys)


def test_students_see_their_own_trace_and_config_only(room: Workshop) -> None:
    s1 = Engine.connect(room.url, room.room.students["student01"])
    s2 = Engine.connect(room.url, room.room.students["student02"])
    assert (s1.tenant, s2.tenant) == ("student01", "student02")
    assert s1.complete("student01", secret_prompt("student01", 200, 1), max_tokens=4).ok
    mine, theirs = s1.trace(), s2.trace()
    assert any(e["tenant"] == "student01" for evs in mine.values() for e in evs)
    assert all(e["tenant"] == "student01" for evs in mine.values() for e in evs)
    assert all(e["tenant"] == "student02" for evs in theirs.values() for e in evs)
    assert "student02" not in json.dumps(mine) and "student01" not in json.dumps(theirs)
    assert s1.config()["tenants"] == ["student01"]
    assert "startup_log" not in s1.config()  # the admin's: paths of this host, addresses of others
    with pytest.raises(MinigridError, match="admin"):
        s1.pools()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/minigrid/pools"), ("GET", "/v1/minigrid/integrity"), ("POST", "/v1/minigrid/fixes")],
)
def test_admin_endpoints_refuse_students(room: Workshop, method: str, path: str) -> None:
    body = {"fixes": "none"} if method == "POST" else None
    r = httpx.request(method, room.url + path, headers=room.key("student03"), json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = httpx.request(method, room.url + path, headers={"Authorization": "Bearer sk-guess"}, json=body)
    assert r.status_code == 401
    r = httpx.request(method, room.url + path, headers=room.key("instructor"), json=body)
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"fixes": "owner-chek"}, 400, "owner-check"),  # names the valid ones
        ({"fixes": ["reject-before-transfer", "nope"]}, 400, "'nope'"),
        ({"fixes": 3}, 400, "reject-before-transfer"),
        ([1, 2], 400, "none, all"),
        ({"fixes": "none", "owner-check": True}, 400, 'unknown field "owner-check"'),
        ({"fixes": "capacity-check"}, 409, "665 tokens, fewer than the context length of 1024"),
        ({"fixes": "all"}, 409, "665 tokens"),
    ],
)
def test_bad_fixes_are_refused_by_name(room: Workshop, body: object, status: int, says: str) -> None:
    r = httpx.post(room.url + "/v1/minigrid/fixes", headers=room.key("instructor"), json=body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["message"].count("scrub-on-free") <= 1, r.text  # the fixes listed once
    assert httpx.get(room.url + "/v1/minigrid/config", headers=room.key("instructor")).json()["fixes"] == []
    bad = httpx.post(room.url + "/v1/minigrid/fixes", headers=room.key("instructor"), content=b"{")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_the_live_switch_changes_the_outcome_of_the_same_prompt(room: Workshop) -> None:
    victim = Engine.connect(room.url, room.room.students["student01"])
    bob = Engine.connect(room.url, room.room.students["student02"])
    teacher = Engine.connect(room.url, room.room.instructor_key)
    assert teacher.tenant == "admin"
    secrets = [secret_prompt("student01", 560, 100 + i) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # together, so that their pages fill the decode pool
        assert all(r.ok for r in pool.map(lambda p: victim.complete("student01", p, max_tokens=24), secrets))
    prompt = oversized_prompt("student02", seed=7)
    before = bob.complete("student02", prompt, max_tokens=48)
    assert before.status == 200 and before.prompt_tokens == 976
    stolen = whose_secrets(before.text, "student02").get("student01", set())
    assert stolen & set().union(*map(secret_codes, secrets)), f"no secret of student01 in {before.text!r}"

    switched = teacher.set_fixes(ROOM_FIXES)
    assert switched["previous"] == "none" and set(switched["workers"]) >= {"prefill", "decode"}
    assert teacher.config()["fixes"] == ROOM_FIXES.split(",")
    assert teacher.metrics()['minigrid_fix_enabled{fix="reject-before-transfer"}'] == 1.0
    after = bob.complete("student02", prompt, max_tokens=48)
    assert after.status == 400 and after.error is not None
    assert after.error["code"] == "context_length_exceeded" and not whose_secrets(after.text, "student02")

    teacher.set_fixes("none")  # and back: the room is the faulty engine again
    assert teacher.metrics()['minigrid_fix_enabled{fix="reject-before-transfer"}'] == 0.0
    assert bob.complete("student02", prompt, max_tokens=48).status == 200

    # the fixes that act inside the workers, each alone: the switch reaches the attention read...
    teacher.set_fixes("owner-check")
    caught = bob.complete("student02", prompt, max_tokens=48)
    assert caught.status == 500 and caught.error is not None, caught
    assert caught.error["code"] == "owner_check_violation" and not whose_secrets(caught.text, "student02")
    assert teacher.metrics()["minigrid_owner_check_violations_total"] >= 1
    # ...and the pool's free list: the victim's pages, freed after the switch, are zeroed
    teacher.set_fixes("scrub-on-free")
    with ThreadPoolExecutor(2) as pool:
        assert all(r.ok for r in pool.map(lambda p: victim.complete("student01", p, max_tokens=24), secrets))
    scrubbed = bob.complete("student02", prompt, max_tokens=48)
    assert scrubbed.status == 200 and not whose_secrets(scrubbed.text, "student02"), scrubbed.text
    teacher.set_fixes("none")
    with pytest.raises(EngineRefused, match="401"):  # a made-up admin key is no admin key
        Engine.connect(room.url, room.room.students["student02"], admin_key="sk-nope").set_fixes("all")


def test_switching_fixes_under_load_fails_no_request(room: Workshop) -> None:
    """A switch waits for the requests in flight, holding new ones back meanwhile: no request is
    prefilled under one set of fixes and checked by decode under another (a spurious checksum or
    coverage error would teach the class something false)."""
    teacher = Engine.connect(room.url, room.room.instructor_key)
    students = sorted(room.room.students)
    clients = [Engine.connect(room.url, room.room.students[s]) for s in students]
    jobs = [
        (i % len(clients), secret_prompt(students[i % len(students)], 200 + 40 * (i % 8), i))
        for i in range(18)
    ]
    with ThreadPoolExecutor(6) as pool:
        replies = [
            pool.submit(lambda j=j: clients[j[0]].complete(students[j[0]], j[1], max_tokens=40)) for j in jobs
        ]
        for fixes in ("all", "none", "owner-check", "kv-checksum,scrub-on-free", "none"):
            time.sleep(0.4)
            spec = fixes if fixes != "all" else ROOM_FIXES
            assert set(teacher.set_fixes(spec)["fixes"]) == (
                set() if spec == "none" else set(spec.split(","))
            )
        got = [r.result() for r in replies]
    failed = [(r.status, r.error) for r in got if r.status != 200]
    assert not failed, failed


def test_connect_errors_name_the_problem(room: Workshop, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MinigridError, match="refused this API key"):
        Engine.connect(room.url, "sk-wrong")
    with pytest.raises(MinigridError, match="cannot reach the engine") as down:
        Engine.connect(f"http://127.0.0.1:{free_port()}", "sk-x", timeout_s=2)
    said = str(down.value)  # once, and no advice to start an engine of one's own
    assert said.count("cannot reach") == 1 and "Engine.start()" not in said and "whoever runs it" in said
    assert down.value._render_traceback_() == [f"EngineUnreachable: {said}"]  # a notebook shows this line
    monkeypatch.delenv("MINIGRID_URL", raising=False)
    with pytest.raises(MinigridError, match="MINIGRID_URL"):
        Engine.connect(api_key="sk-x")
    monkeypatch.setenv("MINIGRID_URL", room.url)
    monkeypatch.setenv("MINIGRID_API_KEY", room.room.students["student03"])
    assert Engine.connect().tenant == "student03"


def test_cli_refuses_bad_workshops_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "keys.csv"
    taken.write_text("handed out yesterday\n")
    cases = [
        (["--workshop", "0"], "from 1 to 200"),
        (["--workshop", "201"], "from 1 to 200"),
        (["--workshop", "3", "--keys-file", str(taken)], f"{taken} already exists"),
        (["--keys-file", str(tmp_path / "k.csv")], "go with --workshop N"),
        (["--workshop", "3", "--tenants", "a:sk-a"], "drop --tenants"),
    ]
    for flags, says in cases:
        assert main(["serve", *flags]) == 2, flags
        assert says in capsys.readouterr().err, flags
    assert taken.read_text() == "handed out yesterday\n"


@pytest.mark.parametrize(
    ("given", "csv_name", "json_name"),
    [
        ("room.csv", "room.csv", "room.json"),
        ("room.json", "room.csv", "room.json"),
        ("keys", "keys", "keys.json"),
    ],
)
def test_a_keys_file_named_json_gets_the_json(
    given: str, csv_name: str, json_name: str, tmp_path: Path
) -> None:
    assert keys_paths(tmp_path / given) == (tmp_path / csv_name, tmp_path / json_name)


def test_a_students_own_secrets_are_not_anothers() -> None:
    mine = secret_prompt("student01", 200, 1)
    theirs = secret_prompt("student02", 200, 2)
    own, other = sorted(secret_codes(mine))[0], sorted(secret_codes(theirs))[0]
    assert whose_secrets(f"x {own}; y", "student01") == {}
    assert whose_secrets(f"x {own}; {other}; y", "student01") == {"student02": {other}}
    assert whose_secrets(f"x {own}; y", "student02") == {"student01": {own}}


class _Probe:
    """A UDP socket whose connect finds `address` as this machine's (None: no route at all)."""

    address: str | None = None

    def __init__(self, *args: object) -> None: ...

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: object) -> None: ...

    def connect(self, where: object) -> None:
        if self.address is None:
            raise OSError("Network is unreachable")

    def getsockname(self) -> tuple[str, int]:
        assert self.address is not None
        return self.address, 40000


@pytest.mark.parametrize(
    ("names", "route", "dialed"),
    [
        ({"lab-pc": "10.1.2.3", "localhost": "127.0.0.1"}, "10.1.2.3", "10.1.2.3"),  # its address first
        ({"vm": "127.0.1.1", "localhost": "127.0.0.1"}, "192.0.2.2", "192.0.2.2"),  # a name only here
        ({"lab-pc": "10.1.2.3", "localhost": "127.0.0.1"}, None, "lab-pc"),  # no route: the name
        ({"vm": "127.0.1.1", "localhost": "127.0.0.1"}, None, None),  # no route, no name: --public-url
        ({"vm": "127.0.1.1", "localhost": "127.0.0.1"}, "127.0.0.1", None),
    ],
    ids=["address", "loopback-name", "name", "nothing", "loopback-route"],
)
def test_a_room_on_every_interface_is_dialed_by_a_name_or_address_others_reach(
    monkeypatch: pytest.MonkeyPatch, names: dict[str, str], route: str | None, dialed: str | None
) -> None:
    import socket

    def getaddrinfo(name: str, *args: object) -> list[tuple[Any, ...]]:
        if name not in names:
            raise socket.gaierror(f"unknown host {name}")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (names[name], 0))]

    host = next(iter(names))
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(_Probe, "address", route)
    monkeypatch.setattr(socket, "socket", _Probe)
    assert dialable_host() == dialed


@pytest.mark.parametrize("dial", ["lab-pc", None])
def test_the_keys_files_name_what_students_dial_or_the_log_says_to_give_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dial: str | None
) -> None:
    from minigrid_engine import cli, workshop

    monkeypatch.setattr(workshop, "dialable_host", lambda: dial)
    keys = tmp_path / "room.csv"
    args = cli.build_parser().parse_args(
        ["serve", "--workshop", "2", "--host", "0.0.0.0", "--keys-file", str(keys)]
    )
    said = cli._workshop(args, {})("http://0.0.0.0:8629")
    url = load_keys(keys.with_suffix(".json")).url
    if dial is not None:
        assert url == "http://lab-pc:8629" and not any("WARNING" in line for line in said)
    else:  # nothing better than localhost: written, and said plainly
        assert url == "http://localhost:8629"
        assert "give --public-url http://HOST:8629" in said[-1] and "WARNING" in said[-1]
    public = cli.build_parser().parse_args(
        [
            "serve",
            "--workshop",
            "2",
            "--keys-file",
            str(tmp_path / "p.csv"),
            "--public-url",
            "https://room.example/",
        ]
    )
    cli._workshop(public, {})("http://0.0.0.0:8629")
    assert load_keys(tmp_path / "p.json").url == "https://room.example"
