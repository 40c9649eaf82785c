"""Every lab notebook runs headless under papermill and shows what its story claims.

The notebooks run with the reference answers (`reveal_solutions=True`), so every checker must
accept them; the leak lab also runs with the fix on, and two labs run as the student gets them,
where the checkers must reject the unanswered stubs. `bench/labs.py` runs the same series and
times it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import needs
import pytest
from notebooks import committed_clean

from minigrid_engine.canary import longest_shared_run

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
NOTEBOOKS = sorted(LABS.glob("[0-9][0-9]_*.ipynb"))
sys.path.insert(0, str(ROOT / "bench"))

from labs import run_lab  # noqa: E402  (bench/labs.py)


def test_there_is_a_series() -> None:
    assert len(NOTEBOOKS) >= 12, [n.name for n in NOTEBOOKS]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_clean_and_follow_the_pattern(nb: Path) -> None:
    data = committed_clean(nb)
    (params,) = [c.source for c in data.cells if "parameters" in c.metadata.get("tags", [])]
    assert "reveal_solutions = False" in params
    text = "\n".join(c.source for c in data.cells)
    assert "**You will:**" in text and "## Key points" in text, f"{nb.name}: objectives and key points"
    assert "check_" in text, f"{nb.name} has no exercise checker"
    assert "labs/.solutions" not in text.replace("labs/INSTRUCTOR.md", ""), "solutions are not shown"


def run(name: str, tmp_path: Path, **params: object) -> dict:
    result = run_lab(LABS / name, tmp_path, **{"reveal_solutions": True, **params}).result
    assert result, f"{name} wrote no result"
    failed = [k for k, ok in result.get("verdicts", {}).items() if not ok]
    if params.get("reveal_solutions", True):
        assert result["verdicts"] and not failed, f"{name}: the reference answers fail {failed}"
    return result


def test_01_welcome_reads_the_pool_from_the_running_engine(tmp_path: Path) -> None:
    r = run("01_welcome.ipynb", tmp_path)
    assert r["prefill_capacity"] == 665 and r["context_length"] == 1024 and r["audit_ok"] is False
    assert any("prefill KV pool: 665 tokens in 6 pages" in line for line in r["pool_lines"])


def test_01_with_capacity_check_the_refusal_is_the_outcome(tmp_path: Path) -> None:
    r = run("01_welcome.ipynb", tmp_path, fixes="capacity-check")
    assert r == {"started": False, "verdicts": {"shortfall": True}}


def test_02_paged_kv_cache_shows_stale_pages(tmp_path: Path) -> None:
    r = run("02_paged_kv_cache.ipynb", tmp_path)
    assert r["reused_pages"], "carol got none of alice's freed pages"
    assert "ALICE" in r["leaked_text"] and r["pages_in_use"] == 0


def test_02_student_copy_rejects_the_stub(tmp_path: Path) -> None:
    r = run("02_paged_kv_cache.ipynb", tmp_path, reveal_solutions=False)
    assert r["verdicts"] == {"slot": False}


def test_03_disaggregated_serving_draws_every_phase(tmp_path: Path) -> None:
    r = run("03_disaggregated_serving.ipynb", tmp_path)
    assert set(r["statuses"]) == {200}
    for phases in r["phases"].values():
        assert phases == ["queued", "prefill", "transfer", "decode"]
    assert all(w == d for w, d in r["pages"].values()), r["pages"]


def test_03_one_request_with_every_fix_runs_on_the_corrected_pool(tmp_path: Path) -> None:
    r = run("03_disaggregated_serving.ipynb", tmp_path, requests=1, fixes="all")
    assert r["statuses"] == [200] and list(r["phases"].values()) == [
        ["queued", "prefill", "transfer", "decode"]
    ]


def test_04_the_audit_turns_red_below_the_context(tmp_path: Path) -> None:
    r = run("04_shrink_the_pool.ipynb", tmp_path, sizes=[2048, 1024, 960, 665])
    assert r["audit"] == {"2048": True, "1024": True, "960": False, "665": False}
    assert r["oversized_status"] == 200 and r["stubbed"] and r["capacity_check_refused"]
    assert "665 tokens, fewer than the context length of 1024" in r["refusal"]


def test_04_sizes_off_the_slider_and_a_size_that_cannot_start(tmp_path: Path) -> None:
    r = run("04_shrink_the_pool.ipynb", tmp_path, sizes=[3000, 1023, 100, 700])
    assert r["audit"] == {"3000": True, "1023": False, "100": None, "700": False}
    assert r["oversized_status"] == 200 and r["stubbed"] and r["oversized_prompt_tokens"] == 1008


def test_04_ending_on_a_pool_that_holds_every_prompt_says_so(tmp_path: Path) -> None:
    r = run("04_shrink_the_pool.ipynb", tmp_path, sizes=[2048, 1023])
    assert r["audit"] == {"2048": True, "1023": False}  # it holds the longest prompt, not a full context
    assert r["oversized_status"] is None and not r["stubbed"] and r["capacity_check_refused"]


def test_05_leak_lab_shows_the_leak(tmp_path: Path) -> None:
    r = run("05_trigger_the_leak.ipynb", tmp_path, fixes="none")
    assert r["status"] == 200 and r["prompt_tokens"] == 1000
    assert r["leaked_codes"], f"the leak lab no longer leaks: {r['text']!r}"
    assert r["pages_by_tenant"] == {"alice": 7, "bob": 1} and r["too_fast"]


def test_05_leak_lab_reads_out_a_letter_too(tmp_path: Path) -> None:
    """alice's secrets in a shape the model never trained on: bob's answer still holds her text."""
    r = run("05_trigger_the_leak.ipynb", tmp_path, fixes="none", victim_shape="letter")
    assert r["status"] == 200 and r["pages_by_tenant"] == {"alice": 7, "bob": 1}
    runs = [longest_shared_run(r["text"], p) for p in r["victim_prompts"]]
    assert max(runs) >= 12, f"bob's answer {r['text']!r} holds no run of alice's letters"


def test_05_leak_lab_with_the_fix_shows_the_400(tmp_path: Path) -> None:
    r = run("05_trigger_the_leak.ipynb", tmp_path, fixes="reject-before-transfer")
    assert r["status"] == 400 and r["error"]["code"] == "context_length_exceeded"
    assert not r["leaked_codes"]


def test_05_leak_lab_with_a_pool_that_holds_the_prompt_leaks_nothing(tmp_path: Path) -> None:
    r = run("05_trigger_the_leak.ipynb", tmp_path, prefill_pool_tokens=1024)
    assert r["status"] == 200 and not r["leaked_codes"] and r["pages_by_tenant"] == {"bob": 8}


def test_05_leak_lab_with_capacity_check_says_the_engine_refused(tmp_path: Path) -> None:
    r = run("05_trigger_the_leak.ipynb", tmp_path, fixes="all")
    assert r["started"] is False and "status" not in r


def test_06_forensics_counts_affected_responses(tmp_path: Path) -> None:
    r = run("06_forensics.ipynb", tmp_path, day_requests=30)
    assert r["bob_pages_by_tenant"] == {"alice": 7, "bob": 1}
    assert 0 < r["affected"] <= r["over_threshold"]
    assert r["shortest_affected_prompt"] > 665  # every affected prompt is longer than the pool


def test_06_forensics_with_the_fix_counts_none(tmp_path: Path) -> None:
    r = run("06_forensics.ipynb", tmp_path, fixes="reject-before-transfer", day_requests=24)
    assert r["affected"] == 0 and r["with_foreign_canaries"] == 0


def test_06_forensics_on_a_pool_that_holds_the_context_counts_none(tmp_path: Path) -> None:
    r = run("06_forensics.ipynb", tmp_path, prefill_pool_tokens=1024, day_requests=12)
    assert r["bob_pages_by_tenant"] == {"bob": 8} and r["over_threshold"] == 0 and r["affected"] == 0


def test_07_admission_fixes(tmp_path: Path) -> None:
    r = run("07_fix_admission.ipynb", tmp_path)
    assert r["none"]["client_saw"] == "200 leak" and r["none"]["foreign_pages"] == 7
    assert r["reject-before-transfer"]["client_saw"] == "400"
    assert r["capacity-check"]["client_saw"] == "no engine"
    assert not r["reject-before-transfer"]["leaked"] and not r["capacity-check"]["leaked"]


def test_08_transfer_fixes(tmp_path: Path) -> None:
    r = run("08_fix_transfer.ipynb", tmp_path)
    assert set(r["verdicts"]) == {"prediction", "checksum"}
    inc = r["incident"]
    assert inc["coverage-check"] == {"client_saw": "error", "leaked": False, "code": "kv_coverage_mismatch"}
    assert inc["kv-checksum"] == {"client_saw": "error", "leaked": False, "code": "kv_checksum_mismatch"}
    assert inc["deferred-release"]["leaked"], "deferred-release is not meant to stop bob's leak"
    assert r["late_transfer"]["none"]["foreign_writes"] >= 1
    assert r["late_transfer"]["deferred-release"]["foreign_writes"] == 0


def test_09_memory_fixes(tmp_path: Path) -> None:
    r = run("09_fix_memory.ipynb", tmp_path)
    assert r["scrub-on-free"] == {"client_saw": "200 clean", "leaked": False, "code": None}
    assert r["owner-check"] == {"client_saw": "error", "leaked": False, "code": "owner_check_violation"}


def test_10_the_test_that_would_have_caught_it(tmp_path: Path) -> None:
    r = run("10_catch_it.ipynb", tmp_path)
    leaks = {"bob, faulty engine", "bob, faulty engine, a two-token answer"}
    assert {name for name, c in r["cases"].items() if c["leaked"]} == leaks
    # the leak cut to two tokens shows no secret: only the TTFT floor catches it
    silent = r["cases"]["bob, faulty engine, a two-token answer"]
    assert silent["status"] == 200 and not silent["foreign_canaries"] and silent["too_fast"]


def test_11_postmortem_answers_the_questions(tmp_path: Path) -> None:
    r = run("11_postmortem.ipynb", tmp_path)
    assert r["audit"] == {"as launched": False, "corrected": True} and r["launched_leak"]
    # the probe, from outside, finds the leak on prompts the 665-token prefill pool cannot hold
    assert r["probe_leak_prompts"] and all(n > 665 for n in r["probe_leak_prompts"])
    assert r["at_risk"] == ["chat-prod"]


def test_11_student_copy_rejects_the_stub(tmp_path: Path) -> None:
    r = run("11_postmortem.ipynb", tmp_path, reveal_solutions=False)
    assert r["verdicts"] == {"possibly_affected": False}


@needs.triton
def test_12_the_kernel_reads_alices_pages_and_owner_check_flags_them(tmp_path: Path) -> None:
    r = run("12_the_kernel.ipynb", tmp_path)
    assert "ALICE" in r["answer"], r["answer"]
    assert r["flagged_pages"] == r["alice_pages_read"] and r["flagged_pages"]
    assert r["max_diff"] < 1e-5


def test_13_model_check_finds_the_incident_and_the_fixes_close_it(tmp_path: Path) -> None:
    r = run("13_model_check.ipynb", tmp_path)
    assert r["incident_steps"] == 18 and "alice" in r["incident_last_step"]
    assert r["incident_table"]["none"].startswith("stale-read")
    assert r["incident_table"]["reject-before-transfer"] == "safe"
    assert r["incident_table"]["capacity-check"] == "refuses to start"
    assert r["late_table"]["owner-check"] == r["late_table"]["deferred-release"] == "safe"
    assert r["late_table"]["kv-checksum"].startswith("stale-read")
    assert r["combined_safe"] and r["combined_states"] > 100 and r["edges_outside_table"] == 0


def test_13_student_copy_rejects_the_stubs(tmp_path: Path) -> None:
    r = run("13_model_check.ipynb", tmp_path, reveal_solutions=False)
    assert r["verdicts"] == {"fix_prediction": False, "counterexample_bounds": False}


def test_13_a_search_cut_short_is_said_and_checks_nothing(tmp_path: Path) -> None:
    r = run_lab(LABS / "13_model_check.ipynb", tmp_path, reveal_solutions=True, max_states=100).result
    assert r["incident_steps"] is None and r["combined_safe"] is False
    assert r["late_table"]["none"] == "no verdict (cut short)"
    assert r["verdicts"]["fix_prediction"] is False  # no verdict confirms nor refutes a prediction


def test_labs_check_takes_a_relative_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `make labs-check` runs bench/labs.py with --out-dir runs/labs: relative to where it was started,
    # while each notebook runs with labs/ as its working directory
    monkeypatch.chdir(tmp_path)
    lab = run_lab(LABS / "13_model_check.ipynb", Path("runs") / "labs", reveal_solutions=True)
    assert lab.result["verdicts"] == {"fix_prediction": True, "counterexample_bounds": True}
    assert (tmp_path / "runs" / "labs" / "13_model_check.ipynb").exists()


def test_07_predictions_for_settings_of_your_own(tmp_path: Path) -> None:
    # the stub and the reference answers cover whatever fixes_to_try holds, combinations included
    tried = ["owner-check", "scrub-on-free,kv-checksum", "deferred-release,scrub-on-free"]
    r = run("07_fix_admission.ipynb", tmp_path, fixes_to_try=tried)
    assert {f: r[f]["client_saw"] for f in tried} == {
        "owner-check": "error",
        "scrub-on-free,kv-checksum": "error",
        "deferred-release,scrub-on-free": "200 clean",
    }
    student = run("07_fix_admission.ipynb", tmp_path / "student", fixes_to_try=tried, reveal_solutions=False)
    assert student["verdicts"]["prediction"] is False
