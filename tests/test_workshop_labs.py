"""The workshop notebooks, run by papermill against a workshop server started here.

The story they must keep telling: with the fixes off, a student's oversized prompt brings back
another student's secret; after the instructor switches the fixes on, the same prompt gets the
400 and nothing foreign. The numbered series' checks (tests/test_labs.py, bench/labs.py) glob
`labs/[0-9][0-9]_*.ipynb` and so skip `labs/workshop/`; its cleared outputs are checked here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from notebooks import committed_clean
from pages import pages_in_use, wait_pages_free
from test_workshop import Workshop, room, serve_room  # noqa: F401  (the module-scoped workshop server)

from minigrid_engine.handle import Engine

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "labs" / "workshop").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "bench"))

from labs import run_lab  # noqa: E402  (bench/labs.py)


def test_both_notebooks_exist() -> None:
    assert [n.name for n in NOTEBOOKS] == ["instructor.ipynb", "student.ipynb"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_workshop_notebooks_are_committed_clean(nb: Path) -> None:
    source = "".join(c.source for c in committed_clean(nb).cells)
    assert not re.search(r"sk-[A-Za-z0-9_-]{8,}", source), f"{nb.name} holds a key"


def run(name: str, out: Path, **params: object) -> dict:
    result = run_lab(ROOT / "labs" / "workshop" / name, out, **params).result
    assert result, f"{name} wrote no result"
    return result


def test_the_room_leaks_then_the_switch_stops_it(room: Workshop, tmp_path: Path) -> None:  # noqa: F811
    keys = room.room.students
    victim = run(
        "student.ipynb",
        tmp_path / "s1",
        url=room.url,
        api_key=keys["student01"],
        send_oversized=False,
        seed=1,
    )
    assert victim["student"] == "student01" and victim["my_codes"]
    # her answer can reach her before prefill releases her pages: on a busy machine the next
    # prompt would be given other ones (in a class, seconds pass between two students)
    teacher_view = Engine.connect(room.url, room.room.instructor_key)
    assert wait_pages_free(teacher_view, timeout_s=30), pages_in_use(teacher_view)
    bob = run("student.ipynb", tmp_path / "s2", url=room.url, api_key=keys["student02"], store_secret=False)
    assert bob["status"] == 200 and bob["fixes"] == []
    stolen = set(bob["found"].get("student01", [])) & set(victim["my_codes"])
    assert stolen, f"student02's answer holds no secret of student01: {bob['text']!r}"

    teacher = run(
        "instructor.ipynb",
        tmp_path / "t",
        url=room.url,
        instructor_key=room.room.instructor_key,
        switch_to="ROOM_FIXES",
    )
    assert "reject-before-transfer" in teacher["fixes"] and "capacity-check" not in teacher["fixes"]
    rows = {r["student"]: r for r in teacher["overview"]}
    assert rows["student02"]["answers_with_foreign_pages"] >= 1
    assert rows["student02"]["read_pages_of"].get("student01", 0) > 0 and rows["student01"]["requests"] >= 2

    after = run("student.ipynb", tmp_path / "s3", url=room.url, api_key=keys["student02"], store_secret=False)
    assert after["status"] == 400 and after["error"]["code"] == "context_length_exceeded"
    assert after["found"] == {} and after["text"] == ""


def test_a_room_on_other_numbers_leaks_with_sizes_read_from_it(tmp_path: Path) -> None:
    # a 400-token prefill pool in pages of 64: the student notebook hardcodes none of 665, 976, 128
    with serve_room(tmp_path / "room", "--prefill-pool-tokens", "400", "--page-size", "64") as other:
        keys = other.room.students
        victim = run(
            "student.ipynb", tmp_path / "s1", url=other.url, api_key=keys["student01"], send_oversized=False
        )
        bob = run(
            "student.ipynb", tmp_path / "s2", url=other.url, api_key=keys["student02"], store_secret=False
        )
        assert bob["status"] == 200 and bob["pages_read"] == 16  # 976 + 48 tokens in pages of 64
        assert bob["pages_written_for_you"] == 2  # the stub's page and the answer's: 14 of 16 were stale
        # student01's records (STUAA ...) in student02's answer, whole codes or not
        assert set(bob["found"].get("student01", [])) & set(victim["my_codes"]) or "STUAA" in bob["text"]
