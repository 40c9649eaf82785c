"""Message faults and worker deaths: each injected on a live engine, each survived with every fix on.

The parsing tests are instant; each live case starts its own small engine (fault_campaign.py), a
few seconds on two cores. Assertions are on outcomes (status, code, pages, health), not timings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_run import minigrid

from minigrid_engine.errors import ConfigError
from minigrid_engine.fault_campaign import CASES, TARGET, VICTIM, campaign_config, run_case, select
from minigrid_engine.faults import ENV, Fault, parse_faults
from minigrid_engine.handle import Engine
from minigrid_engine.records import record_prompt

ALLOW = {ENV: "1"}


# -- parsing -------------------------------------------------------------------------------
def test_every_fault_parses_with_seconds_and_tenant() -> None:
    faults = parse_faults(
        ["delay-transfer=2", "delay-done=0.5@carol", "drop-transfer", "reorder-done@alice", "prefill-error"],
        ALLOW,
        tenants=["alice", "carol"],
    )
    assert faults[0] == Fault("delay-transfer", 2.0)
    assert faults[1] == Fault("delay-done", 0.5, "carol")
    assert faults[3] == Fault("reorder-done", 0.0, "alice")
    assert [str(f) for f in faults] == [
        "delay-transfer=2",
        "delay-done=0.5@carol",
        "drop-transfer",
        "reorder-done@alice",
        "prefill-error",
    ]
    assert faults[1].hits("carol") and not faults[1].hits("alice") and faults[0].hits("anyone")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "melt-gpu",
            r"unknown fault 'melt-gpu': choose one of delay-transfer: .*drop-transfer.*prefill-error",
        ),
        ("delay-done", r"delay-done needs seconds, e.g. delay-done=3"),
        ("delay-transfer=soon", r"delay-transfer needs seconds"),
        ("delay-transfer=0", r"seconds must be between 0 and 600"),
        ("delay-done=601", r"seconds must be between 0 and 600"),
        ("drop-done=2", r"fault 'drop-done' takes no value"),
        ("drop-done@mallory", r"@mallory is not a tenant of this engine: choose alice, carol"),
        ("reorder-done@", r"is not a tenant of this engine"),
    ],
)
def test_bad_fault_specs_name_the_choices(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_faults([spec], ALLOW, tenants=["alice", "carol"])


def test_fault_injection_needs_the_opt_in() -> None:
    with pytest.raises(ConfigError, match=f"drop-transfer@carol is a fault injection .* set {ENV}=1"):
        parse_faults(["drop-transfer@carol"], {})


def test_serve_refuses_an_unknown_tenant_before_starting() -> None:
    proc = minigrid("serve", "--inject", "drop-done@mallory", timeout=60, env={**os.environ, ENV: "1"})
    assert proc.returncode == 2
    assert "@mallory is not a tenant of this engine: choose alice, bob" in proc.stderr


def test_campaign_names_its_cases() -> None:
    assert [c.name for c in select("drop-done,kill-decode")] == ["drop-done", "kill-decode"]
    with pytest.raises(ConfigError, match="unknown case melt; choose from delay-transfer"):
        select("drop-done,melt")


# -- each message fault on a live engine, every fix on --------------------------------------
EXPECTED = {  # what carol's client sees
    "delay-transfer": (504, "kv_transfer_timeout", "did not complete within"),
    "delay-done": (504, "kv_transfer_timeout", "did not complete within"),
    "drop-transfer": (502, "kv_coverage_mismatch", "page data for only 0 of"),
    "drop-done": (504, "kv_transfer_timeout", "did not complete within"),
    "duplicate-transfer": (502, "kv_transfer_duplicate", "arrived twice"),
    "duplicate-done": (200, None, ""),  # the second done comes after the commit: ignored, traced
    "reorder-transfer": (200, None, ""),  # rooms are matched by id, not by order
    "reorder-done": (502, "kv_coverage_mismatch", "overtaken by the done message"),
    "prefill-error": (500, "prefill_failed", "prefill failed while computing"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_message_fault_is_survived(name: str) -> None:
    (case,) = select(name)
    out = run_case(case)
    status, code, words = EXPECTED[name]
    assert out.affected == (f"{status} {code}" if code else "200"), out
    assert words in out.message, out.message
    assert out.clear_error, out
    assert not out.foreign_data, out.foreign_data
    assert out.pages_back and out.integrity, out
    assert out.health == "ok" and out.served_again, out
    assert out.survived and out.as_expected


def test_fixes_none_control_shows_the_leak() -> None:
    """The same late transfer with every fix off lands in pages alice holds: the checks can fail."""
    (case,) = select("control:delay-transfer")
    # The late data must land while alice holds the pages: a busy machine (CI's 2 shared cores)
    # can shift the timing so that it lands between her requests; try again with new prompts.
    for seed in range(5):
        out = run_case(case, seed=seed)
        if out.foreign_data:
            break
    assert out.affected == "504 kv_transfer_timeout"
    assert any("written into pages held by alice" in d for d in out.foreign_data), out.foreign_data
    assert not out.survived and out.as_expected


def test_a_killed_decode_worker_fails_the_request_and_health_says_so() -> None:
    """Until the router restarts workers this is "not survived", said plainly; after, survived."""
    (case,) = select("kill-decode")
    out = run_case(case, restart_wait_s=20)
    assert out.affected == "503 worker_unavailable", out
    assert "worker died" in out.message, out.message
    assert not out.foreign_data
    assert out.survived or (out.health != "ok" and out.note == "not survived: engine did not come back"), out


# -- the traces and the worker: one engine, two faults on carol, alice untouched ------------
@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    cfg = campaign_config(inject=("duplicate-done@carol", "prefill-error@carol"))
    with Engine.start(cfg, fixes="all") as eng:
        yield eng


def _prompt(tenant: str, seed: int) -> str:
    import random

    return record_prompt(tenant, 96, random.Random(seed), 6)


def test_prefill_error_fails_one_request_and_the_worker_stays_up(engine: Engine) -> None:
    pids = engine.worker_pids()
    alice = engine.complete(VICTIM, _prompt(VICTIM, 1), max_tokens=8)
    assert alice.status == 200  # the faults wait for carol, whoever comes first
    carol = engine.complete(TARGET, _prompt(TARGET, 3), max_tokens=8)
    assert carol.status == 500 and carol.error is not None
    assert carol.error["code"] == "prefill_failed"
    assert "injected fault prefill-error@carol" in carol.error["message"]
    assert engine.worker_pids() == pids  # no worker died


def test_a_duplicate_done_is_ignored_and_traced(engine: Engine) -> None:
    carol = engine.complete(TARGET, _prompt(TARGET, 2), max_tokens=8)
    assert carol.status == 200  # duplicate-done: served; the second done came after the commit
    ignored = [e for e in engine.trace()["decode"] if e["kind"] == "ignored"]
    assert [e["request"] for e in ignored] == [carol.request_id]
    assert "late or duplicate" in ignored[0]["detail"]["reason"]
    m = engine.metrics()
    assert m['minigrid_kv_pages_in_use{role="prefill"}'] == 0
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0


# -- the campaign's command line ------------------------------------------------------------
def test_faults_cli_runs_a_subset_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the command needs no opt-in
    proc = minigrid("faults", "--only", "drop-done", "--json", "--out", str(out), timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    assert report["survived"] == 1 and report["faults"] == 1 and report["ok"]
    (row,) = report["cases"]
    assert row["name"] == "drop-done" and row["affected"] == "504 kv_transfer_timeout" and row["survived"]


def test_every_case_is_in_the_campaign() -> None:
    names = {c.name for c in CASES}
    assert set(EXPECTED) | {"kill-prefill-during-transfer", "kill-decode"} <= names
    assert sum(c.control for c in CASES) >= 2
