"""Each fix alone, on the incident scenario and on one with other numbers: what the client sees."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from cli_run import minigrid

from minigrid_engine.config import corrected_preset, incident_preset
from minigrid_engine.errors import ConfigError
from minigrid_engine.fixes import FIXES, parse_fixes
from minigrid_engine.handle import Engine
from minigrid_engine.scenario import LeakReport, codes_in, record_codes, run_incident, run_late_transfer


@dataclass(frozen=True)
class Numbers:
    context: int
    page: int
    prefill_pool: int
    decode_pool: int
    attacker_len: int
    victim_prompts: int


INCIDENT = Numbers(1024, 128, 665, 4096, 1000, 2)
OTHER = Numbers(1024, 64, 720, 3072, 980, 2)


def scenario(fixes: str, n: Numbers, **changes: object) -> tuple[LeakReport, dict[str, float], str]:
    settings: dict[str, object] = {
        "context_length": n.context,
        "page_size": n.page,
        "prefill_pool_tokens": n.prefill_pool,
        "decode_pool_tokens": n.decode_pool,
        **changes,
    }
    with Engine.start(incident_preset(**settings), fixes=fixes) as eng:
        rep = run_incident(
            eng,
            context_length=n.context,
            prefill_pool_tokens=int(settings["prefill_pool_tokens"]),  # type: ignore[call-overload]
            attacker_len=n.attacker_len,
            max_tokens=24,
            victim_prompts=n.victim_prompts,
            seed=3,
        )
        return rep, eng.metrics(), eng.log()


def assert_victims_served(rep: LeakReport) -> None:
    for prompt, reply in zip(rep.victim_prompts, rep.victim_replies):
        assert reply.status == 200
        assert codes_in(reply.text) <= record_codes(prompt, rep.victim), reply.text


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_reject_before_transfer(n: Numbers) -> None:
    rep, m, _ = scenario("reject-before-transfer", n)
    r = rep.reply
    assert r.status == 400 and r.error is not None
    assert r.error["code"] == "context_length_exceeded"
    for number in (n.attacker_len, n.context, n.prefill_pool):
        assert f"{number} tokens" in r.error["message"], r.error["message"]
    assert not rep.pages  # bob's decode read nothing
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0
    assert_victims_served(rep)


def test_reject_before_transfer_reserves_no_decode_page() -> None:
    with Engine.start(incident_preset(), fixes="reject-before-transfer") as eng:
        before = eng.metrics()
        r = eng.complete("bob", "BOB pin 123456; " * 62, max_tokens=16)
        assert r.status == 400
        after = eng.metrics()
        for outcome, more in (("rejected", 1), ("aborted", 0), ("ok", 0), ("error", 0)):
            key = f'minigrid_requests_total{{outcome="{outcome}"}}'
            assert after.get(key, 0) - before.get(key, 0) == more, (outcome, after)
        assert after["minigrid_prefill_stubbed_requests_total"] == 0  # refused, not sent on as a stub
        trace = eng.trace()
        assert not [e for e in trace["decode"] if e["kind"] == "reserve" and e["tenant"] == "bob"]
        assert not [e for e in trace["prefill"] if e["kind"] == "reserve" and e["tenant"] == "bob"]


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_coverage_check(n: Numbers) -> None:
    rep, m, log = scenario("coverage-check", n)
    assert rep.reply.status == 500 and rep.reply.error["code"] == "kv_coverage_mismatch"
    assert m['minigrid_requests_total{outcome="aborted"}'] == 1  # an error, not a refusal
    assert m.get('minigrid_requests_total{outcome="rejected"}', 0) == 0
    assert m["minigrid_prefill_stubbed_requests_total"] >= 1  # the stub went on: decode caught it
    assert f"prefill wrote 1 token of KV, decode preallocated {n.attacker_len}" in rep.reply.error["message"]
    assert "KV coverage mismatch" in log  # named in the log
    assert rep.reply.text == ""
    assert_victims_served(rep)


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_kv_checksum(n: Numbers) -> None:
    rep, m, _ = scenario("kv-checksum", n)
    assert rep.reply.status == 500 and rep.reply.error["code"] == "kv_checksum_mismatch"
    pages = -(-n.attacker_len // n.page)
    assert m["minigrid_kv_checksum_mismatches_total"] == pages - 1  # all but the stub's page
    assert rep.reply.text == ""
    assert_victims_served(rep)


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_scrub_on_free_hides_the_leak_but_the_answer_is_wrong(n: Numbers) -> None:
    rep, _, _ = scenario("scrub-on-free", n)
    r = rep.reply
    assert r.status == 200 and r.prompt_tokens == n.attacker_len  # still 200, still "exact"
    assert not rep.leaked, rep.summary()
    assert rep.longest_run < 12
    assert not (codes_in(r.text) & record_codes(rep.attacker_prompt)), "bob's answer cannot be right"
    assert set(rep.pages_by_tenant()) <= {"bob", None}  # scrubbed pages: written by nobody
    assert_victims_served(rep)


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_owner_check(n: Numbers) -> None:
    rep, m, _ = scenario("owner-check", n)
    assert rep.reply.status == 500 and rep.reply.error["code"] == "owner_check_violation"
    assert m["minigrid_owner_check_violations_total"] >= 1
    assert rep.reply.text == ""
    assert_victims_served(rep)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the prefill KV pool holds 665 tokens, fewer than the context length of 1024 tokens"),
        (
            ["--page-size", "64", "--prefill-pool-tokens", "720", "--context-length", "1024"],
            "the prefill KV pool holds 720 tokens, fewer than the context length of 1024 tokens",
        ),
        (
            ["--prefill-pool-tokens", "2048", "--decode-pool-tokens", "900"],
            "the decode KV pool holds 900 tokens, fewer than the context length of 1024 tokens",
        ),
    ],
    ids=["incident", "other-numbers", "decode-pool"],
)
def test_capacity_check_refuses_to_start(args: list[str], message: str) -> None:
    proc = minigrid("serve", "--fixes", "capacity-check", "--port", "0", *args, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "-pool-tokens to at least 1024" in proc.stderr


def test_capacity_check_starts_on_the_corrected_pool() -> None:
    with Engine.start(corrected_preset(), fixes="capacity-check") as eng:
        assert eng.health()[0] == 200
        assert eng.complete("alice", "ALICE pin 7Q2M4KX1; " * 40, max_tokens=8).status == 200


@pytest.mark.parametrize("n", [INCIDENT, OTHER], ids=["incident", "other-numbers"])
def test_all_fixes_on_the_corrected_pool_serve_bob_his_own_answer(n: Numbers) -> None:
    pool = 2 * n.context  # the corrected configuration: about twice the context
    rep, m, log = scenario("all", n, prefill_pool_tokens=pool)
    assert f"prefill KV pool: {pool} tokens" in log
    r = rep.reply
    assert r.status == 200 and r.prompt_tokens == n.attacker_len
    assert not rep.leaked, rep.summary()
    assert codes_in(r.text) and codes_in(r.text) <= record_codes(rep.attacker_prompt, "bob"), r.text
    assert rep.pages_by_tenant() == {"bob": -(-n.attacker_len // n.page)}
    assert m["minigrid_owner_check_violations_total"] == 0
    assert m["minigrid_kv_checksum_mismatches_total"] == 0
    assert_victims_served(rep)


def test_all_but_capacity_on_the_incident_numbers_rejects_bob() -> None:
    names = ",".join(f for f in FIXES if f != "capacity-check")
    rep, _, _ = scenario(names, INCIDENT)
    assert rep.reply.status == 400 and rep.reply.error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus", "unknown fix 'bogus': choose none, all, or a comma-separated list of capacity-check"),
        ("owner-check,scrub", "unknown fix 'scrub'"),
        (",", "give none, all, or names from"),
        ("none,owner-check", "'none' and 'all' stand alone"),
        ("owner-check,,kv-checksum", "item 2 is empty"),
    ],
)
def test_bad_fix_names(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fixes(text)


def test_all_is_every_fix_and_each_name_is_its_own_switch() -> None:
    assert parse_fixes("all").names() == list(FIXES)  # `--fixes all`, the corrected preset's default
    assert parse_fixes("none").names() == []
    for name in FIXES:
        assert parse_fixes(name).names() == [name]
    assert parse_fixes("kv-checksum,owner-check").names() == ["kv-checksum", "owner-check"]


@pytest.mark.parametrize("page", [128, 64])
@pytest.mark.parametrize("fixes", ["none", "deferred-release"])
def test_deferred_release_against_a_late_transfer(fixes: str, page: int) -> None:
    """Decode gives up on a slow transfer; the late data then lands in pages given to alice (bug)."""
    cfg = corrected_preset(
        page_size=page,
        release_timeout_s=1.0,
        inject=("delay-transfer=1.4",),  # lands while alice, who came right after, still decodes
        tenants={"alice": "sk-alice", "carol": "sk-carol"},
    )
    with Engine.start(cfg, fixes=fixes) as eng:
        rep = run_late_transfer(eng, context_length=cfg.context_length, seed=4)
        assert rep.slow_reply.status == 504 and rep.slow_reply.error["code"] == "kv_transfer_timeout"
        assert rep.reply.status == 200
        if fixes == "none":
            # carol's late K/V was written into pages alice held while she decoded
            owners = {o for w in rep.foreign_writes for o in w["detail"]["owners"]}
            assert owners == {rep.reply.request_id}, rep.foreign_writes
        else:
            assert not rep.foreign_writes, rep.foreign_writes
            assert not rep.foreign_codes, f"alice's answer {rep.reply.text!r} holds carol's codes"
        time.sleep(cfg.release_timeout_s)  # quarantined pages come back by the timeout at the latest
        assert eng.metrics()['minigrid_kv_pages_in_use{role="decode"}'] == 0


def test_fault_injection_is_refused_unless_allowed() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MINIGRID_FAULT_INJECTION"}
    proc = minigrid("serve", "--inject", "delay-transfer=2", timeout=60, env=env)
    assert proc.returncode == 2 and "set MINIGRID_FAULT_INJECTION=1 to allow it" in proc.stderr
    proc = minigrid("serve", "--inject", "melt-gpu", timeout=60, env=env)
    assert proc.returncode == 2 and "unknown fault 'melt-gpu': choose one of delay-transfer" in proc.stderr


def test_serve_runs_every_fix_by_default_so_the_incident_numbers_refuse_to_start() -> None:
    proc = minigrid("serve", "--port", "0", timeout=60)
    assert proc.returncode == 2
    assert "capacity-check: the prefill KV pool holds 665 tokens" in proc.stderr
    assert "--preset corrected" in proc.stderr
