"""Workshop mode: one shared engine for a room, a key per student, a key for the instructor.

    minigrid serve --workshop 30 --keys-file room-keys.csv --host 0.0.0.0

starts the incident's engine (fixes off: the lesson is the leak) with tenants student01..student30,
each with a random `sk-...` key, and an instructor key (the admin key: every page pool and every
trace, and `POST /v1/minigrid/fixes` to switch the room's fixes live). The keys go to a text/CSV
file for printing slips and a JSON file for tools, both readable by their owner only.

Students' notebooks connect with `Engine.connect(url, key)`; this module also holds what both
workshop notebooks share: a student's secret records, the oversized prompt, whose secrets an
answer holds, and the instructor's room overview (from the admin trace alone).
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from minigrid_engine.errors import ConfigError, MinigridError
from minigrid_engine.forensics import affected_responses
from minigrid_engine.handle import Reply
from minigrid_engine.records import CODE_ALPHABET, FIELDS

MAX_STUDENTS = 200
INSTRUCTOR = "instructor"
# Every fix that can be switched on in a running room: capacity-check is a deployment check
# (a role refuses to start), so on the incident's 665-token pool the engine answers it with 409.
ROOM_FIXES = "reject-before-transfer,coverage-check,kv-checksum,scrub-on-free,owner-check,deferred-release"


def student_names(n: int) -> list[str]:
    """student01..studentNN (three digits from 100 students on)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STUDENTS:
        raise ConfigError(f"--workshop {n!r}: the number of students must be from 1 to {MAX_STUDENTS}")
    width = max(2, len(str(n)))
    return [f"student{i:0{width}d}" for i in range(1, n + 1)]


@dataclass(frozen=True)
class Room:
    """The keys of one workshop: students by name, the instructor's (admin) key, the engine URL."""

    students: dict[str, str]
    instructor_key: str
    url: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {"url": self.url, "instructor_key": self.instructor_key, "students": self.students}, indent=2
        )

    def to_csv(self) -> str:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["role", "name", "url", "key"])
        w.writerow([INSTRUCTOR, INSTRUCTOR, self.url, self.instructor_key])
        for name, key in self.students.items():
            w.writerow(["student", name, self.url, key])
        return out.getvalue()


def new_key() -> str:
    return "sk-" + secrets.token_urlsafe(18)


def make_room(n: int, url: str = "") -> Room:
    """`n` students with fresh random keys, and a fresh instructor key."""
    return Room({name: new_key() for name in student_names(n)}, new_key(), url)


def dialable_host() -> str | None:
    """An address or name of this machine that other machines can dial, for a room served on every
    interface (0.0.0.0): the address this machine sends from (found by pointing a UDP socket at a
    documentation address: no packet leaves), else its host name when that resolves outside
    loopback (here; the students' machines must resolve it too). None when there is only loopback:
    the instructor must give --public-url. The startup log prints the URL chosen."""
    import ipaddress
    import socket

    def outward(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return not (ip.is_loopback or ip.is_unspecified)

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            address = probe.getsockname()[0]
        except OSError:
            address = None
    if address is not None and outward(address):
        return str(address)
    for name in (socket.getfqdn(), socket.gethostname()):
        try:
            infos = socket.getaddrinfo(name, None) if name else []
        except OSError:
            continue
        if infos and all(outward(str(i[4][0])) for i in infos):
            return name
    return None


def keys_paths(path: Path) -> tuple[Path, Path]:
    """The CSV file and its JSON twin beside it: the name given is the CSV, unless it ends in
    `.json` (then it is the JSON, and the CSV is the same name in `.csv`)."""
    if path.suffix == ".json":
        return path.with_suffix(".csv"), path
    return path, path.with_suffix(".json")


def check_keys_file(path: Path, overwrite: bool) -> None:
    """Refuse, before anything starts, to replace keys handed out already."""
    if overwrite:
        return
    for p in keys_paths(path):
        if p.exists():
            raise ConfigError(
                f"the keys file {p} already exists (keys of an earlier workshop?): delete it, choose "
                f"another --keys-file, or pass --overwrite-keys to replace it"
            )


def write_keys(room: Room, path: Path, overwrite: bool = False) -> list[Path]:
    """Write the CSV and JSON keys files, readable and writable by their owner only (0600)."""
    written = []
    for p, text in zip(keys_paths(path), (room.to_csv(), room.to_json() + "\n")):
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(p, flags, 0o600)
        except FileExistsError:
            raise ConfigError(
                f"the keys file {p} already exists: pass --overwrite-keys to replace it"
            ) from None
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)  # also when an existing file is overwritten
            f.write(text)
        written.append(p)
    return written


def load_keys(path: str | Path) -> Room:
    """Read a keys file back (the JSON twin, or the CSV)."""
    p = Path(path)
    if p.suffix == ".json":
        d = json.loads(p.read_text())
        return Room(dict(d["students"]), d["instructor_key"], d.get("url", ""))
    rows = list(csv.DictReader(p.read_text().splitlines()))
    instructor = next(r for r in rows if r["role"] == INSTRUCTOR)
    return Room(
        {r["name"]: r["key"] for r in rows if r["role"] == "student"}, instructor["key"], instructor["url"]
    )


# -- the student's part ----------------------------------------------------------------------
def tag(student: str) -> str:
    """Two letters standing for a student (student01 -> AA, student02 -> AB, ... student30 -> BD).

    The records' names and codes are letters, as the model learned them (`train.py`): it copies
    STUAB far better than STUDENT02. Each code starts with its owner's tag, so a code that comes
    back whole says whose it is."""
    digits = re.sub(r"\D", "", student)
    i = int(digits) - 1 if digits else sum(map(ord, student))
    return CODE_ALPHABET[(i // 26) % 26] + CODE_ALPHABET[i % 26]


SECRET = re.compile(r"\b([A-Z]{2})([A-Z0-9]{8});")


@dataclass(frozen=True)
class LeakSizes:
    """The workshop's prompt sizes, derived from a room's own numbers (`eng.config()`): secrets that
    fit its prefill pool, and an oversized prompt that does not but, with its answer, fills the
    context. On the incident's numbers (context 1,024, pool 665, page 128): 560, 976 and 48."""

    context_length: int
    prefill_pool_tokens: int
    page_size: int
    answer_tokens: int
    secret_tokens: int
    oversized_tokens: int | None  # None: the pool holds every prompt the room accepts
    fixes: tuple[str, ...] = ()  # the room's fixes when the sizes were read

    @classmethod
    def of_room(cls, room: dict[str, Any], answer_tokens: int = 48) -> LeakSizes:
        context, pool, page = room["context_length"], room["prefill_pool_tokens"], room["page_size"]
        answer = max(1, min(answer_tokens, context // 4))
        oversized = None
        if pool < context - 1:  # some prompt the API accepts (with 1 answer token at least) is longer
            oversized = max(pool + 1, context - answer)
            answer = context - oversized  # prompt + answer fill the context exactly
        return cls(
            context,
            pool,
            page,
            answer,
            secret_tokens=max(16, (min(pool, context) - 24) * 7 // 8),  # with its 24-token answer
            oversized_tokens=oversized,
            fixes=tuple(room.get("fixes") or ()),
        )

    def describe(self) -> str:
        if self.oversized_tokens is None:
            return (
                f"this room's prefill pool ({self.prefill_pool_tokens:,} tokens) holds every prompt its "
                f"{self.context_length:,}-token context accepts: there is no oversized prompt to send"
            )
        pages = -(-(self.oversized_tokens + self.answer_tokens) // self.page_size)
        return (
            f"the oversized prompt: {self.oversized_tokens:,} tokens, larger than the "
            f"{self.prefill_pool_tokens:,}-token prefill pool; with its {self.answer_tokens}-token answer "
            f"it fills the {self.context_length:,}-token context ({pages} pages of {self.page_size}). "
            + (
                f"Without fixes, prefill would replace it with a one-token placeholder and write one page, "
                f"and decode would read all {pages} it reserved; this room runs {', '.join(self.fixes)}: "
                "the reply below says what they do instead."
                if self.fixes
                else f"Prefill replaces it with a one-token placeholder and writes one page; decode "
                f"reserved {pages} and reads them all."
            )
        )


def secret_prompt(student: str, n_tokens: int = 560, seed: int | None = None) -> str:
    """A prompt of exactly `n_tokens` bytes of `student`'s secret records (``STUAB pin ABQ7K2M9PX; ``)."""
    rng = random.Random(seed)
    t = tag(student)
    block = "".join(
        f"STU{t} {rng.choice(FIELDS)} {t}{''.join(rng.choice(CODE_ALPHABET) for _ in range(8))}; "
        for _ in range(rng.randint(6, 9))
    )
    return (block * (n_tokens // len(block) + 1))[:n_tokens]


def oversized_prompt(student: str, n_tokens: int = 976, seed: int | None = None) -> str:
    """A prompt longer than the room's 665-token prefill pool; with 48 tokens to generate it fills
    the 1,024-token context exactly (8 pages: decode reserves them all, prefill writes one)."""
    return secret_prompt(student, n_tokens, None if seed is None else seed + 10_000)


def secret_codes(prompt: str) -> set[str]:
    """The secret codes a prompt holds."""
    return {a + b for a, b in SECRET.findall(prompt)}


def whose_secrets(text: str, me: str, students: list[str] | None = None) -> dict[str, set[str]]:
    """Codes in `text` that look like another student's secrets, by owner (read from the tag)."""
    if students is None:  # the names of a room as large as it can be, numbered like `me`
        width = max(2, len(re.sub(r"\D", "", me)))
        students = [f"student{i:0{width}d}" for i in range(1, MAX_STUDENTS + 1)]
    owners = {tag(s): s for s in students}
    found: dict[str, set[str]] = {}
    for a, b in re.findall(r"\b([A-Z]{2})([A-Z0-9]{8})\b", text):
        owner = owners.get(a)
        if owner is not None and owner != me:
            found.setdefault(owner, set()).add(a + b)
    return found


class Student(Protocol):
    tenant: str | None

    def complete(self, tenant: str, prompt: str, max_tokens: int = 16, **body: Any) -> Reply: ...

    def trace(self, since: int = 0, tenant: str | None = None) -> dict[str, list[dict[str, Any]]]: ...


def store_secrets(eng: Student, prompts: int = 2, n_tokens: int = 560, seed: int = 0) -> list[str]:
    """Send `prompts` prompts of your secret records at once (their pages fill the decode pool and
    go back to it, not zeroed, when the answers are done); returns the prompts."""
    me = eng.tenant or "admin"
    texts = [secret_prompt(me, n_tokens, seed * 10 + i) for i in range(prompts)]
    with ThreadPoolExecutor(prompts) as pool:
        replies = list(pool.map(lambda t: eng.complete(me, t, max_tokens=24), texts))
    failed = [r for r in replies if not r.ok]
    if failed:
        raise MinigridError(f"storing your secrets failed: HTTP {failed[0].status}: {failed[0].error}")
    return texts


@dataclass
class LeakAttempt:
    """What your oversized prompt brought back."""

    reply: Reply
    found: dict[str, set[str]]  # other student -> their codes in your answer
    attempt: int
    pages_read: int = 0  # decode pages your answer read
    pages_written_for_you: int = 0  # of those, pages your own request wrote

    def summary(self) -> str:
        r = self.reply
        if not r.ok:
            code = (r.error or {}).get("code")
            return f"HTTP {r.status} {code}: {(r.error or {}).get('message')}\nno secret came back"
        whose = (
            "; ".join(f"{s}: {sorted(c)}" for s, c in sorted(self.found.items())) or "nobody's (try again)"
        )
        return (
            f"HTTP 200, prompt_tokens={r.prompt_tokens}, attempt {self.attempt}\n"
            f"answer: {r.text!r}\n"
            f"secrets of: {whose}\n"
            f"your answer read {self.pages_read} decode pages; your request wrote "
            f"{self.pages_written_for_you} of them"
        )


def try_the_leak(
    eng: Student, attempts: int = 3, n_tokens: int = 976, max_tokens: int = 48, seed: int = 0
) -> LeakAttempt:
    """Send the oversized prompt (a new text each attempt) until an answer holds another student's
    secrets or `attempts` run out; a refusal (the fixes are on) ends it at once."""
    me = eng.tenant or "admin"
    result = None
    for i in range(1, attempts + 1):
        reply = eng.complete(me, oversized_prompt(me, n_tokens, seed * 10 + i), max_tokens=max_tokens)
        result = LeakAttempt(reply, whose_secrets(reply.text, me) if reply.ok else {}, i)
        if reply.request_id is not None:  # from your own trace: which pages you read and wrote
            events = eng.trace()["decode"]
            mine = [e for e in events if e.get("request") == reply.request_id]
            read = {p for e in mine if e["kind"] == "read" for p in e["pages"]}
            wrote = {p for e in mine if e["kind"] == "write" for p in e["pages"]}
            result.pages_read, result.pages_written_for_you = len(read), len(read & wrote)
        if result.found or not reply.ok:
            break
    assert result is not None
    return result


# -- the instructor's part -------------------------------------------------------------------
@dataclass
class StudentRow:
    student: str
    requests: int = 0
    answers_with_foreign_pages: int = 0
    read_pages_of: dict[str, int] = field(default_factory=dict)  # other tenant -> pages read


def room_overview(
    trace: dict[str, list[dict[str, Any]]], students: list[str] | None = None
) -> list[StudentRow]:
    """Per student, from the admin trace alone: requests sent (admitted by prefill or not), and
    answers whose decode read pages another tenant had written (the forensics of notebook 6)."""
    rows: dict[str, StudentRow] = {s: StudentRow(s) for s in students or []}
    seen: set[str] = set()
    for events in trace.values():
        for e in events:
            req, tenant = e.get("request"), e.get("tenant")
            if req is None or tenant in (None, "?") or req in seen:
                continue
            seen.add(req)
            rows.setdefault(tenant, StudentRow(tenant)).requests += 1
    for a in affected_responses(trace.get("decode", [])):
        row = rows.setdefault(a.tenant, StudentRow(a.tenant))
        row.answers_with_foreign_pages += 1
        for other, pages in a.foreign.items():
            row.read_pages_of[other] = row.read_pages_of.get(other, 0) + len(pages)
    return sorted(rows.values(), key=lambda r: r.student)


def overview_table(rows: list[StudentRow]) -> str:
    lines = [f"{'student':<12} {'requests':>8} {'leaky answers':>13}  read pages of"]
    for r in rows:
        whose = ", ".join(f"{t} ({n})" for t, n in sorted(r.read_pages_of.items())) or "-"
        lines.append(f"{r.student:<12} {r.requests:>8} {r.answers_with_foreign_pages:>13}  {whose}")
    return "\n".join(lines)
