"""The fix notebooks read each fix's cost against the noise the benchmark measured with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from widgets.costs import FIXES_BENCH, fix_costs, load_fixes_bench, scrub_cost, show_fix_costs


def bench(noise: dict | None) -> dict:
    table = [
        {"fixes": "none", "throughput_vs_none": 1.0, "ttft_vs_none": 1.0},
        {"fixes": "kv-checksum", "throughput_vs_none": 0.93, "ttft_vs_none": 1.04},
        {"fixes": "scrub-on-free", "throughput_vs_none": 0.80, "ttft_vs_none": 1.02},
        {"fixes": "owner-check", "throughput_vs_none": 1.01, "ttft_vs_none": 1.30},
    ]
    return {"table": table, "noise": noise, "requests": 32, "rounds": 5}


def test_a_cost_is_past_the_noise_only_when_one_metric_exceeds_its_own_spread() -> None:
    costs = {
        c.fixes: c
        for c in fix_costs(
            ["kv-checksum", "scrub-on-free", "owner-check"], bench({"throughput": 0.10, "ttft_p50": 0.20})
        )
    }
    assert list(costs) == ["none", "kv-checksum", "scrub-on-free", "owner-check"]
    assert costs["kv-checksum"].past_noise is False  # 7% slower, 4% later: within 10% and 20%
    assert costs["scrub-on-free"].past_noise is True  # 20% slower throughput, past 10%
    assert costs["owner-check"].past_noise is True  # 30% later first token, past 20%
    assert "within the noise" in costs["kv-checksum"].describe()


def test_one_round_has_no_noise_figure_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    costs = fix_costs(["kv-checksum", "not-a-fix"], bench({"throughput": None, "ttft_p50": None}))
    assert [c.fixes for c in costs] == ["none", "kv-checksum"] and costs[1].past_noise is None
    f = tmp_path / "fixes.json"
    f.write_text(json.dumps({**bench(None), "rounds": 1}))
    show_fix_costs(["kv-checksum"], f)
    assert "no noise figure" in capsys.readouterr().out


def test_a_missing_benchmark_names_the_command_that_makes_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"python bench/fixes\.py"):
        load_fixes_bench(tmp_path / "nothing.json")


def test_the_committed_benchmark_has_a_noise_figure_and_every_fix() -> None:
    from minigrid_engine.fixes import FIXES

    b = load_fixes_bench(FIXES_BENCH)
    assert b["rounds"] >= 3 and b["noise"]["throughput"] > 0 and b["noise"]["ttft_p50"] > 0
    assert {row["fixes"] for row in b["table"]} == {"none", "all", *FIXES}


def test_the_scrub_cost_is_what_zeroing_adds_to_a_plain_release(tmp_path: Path) -> None:
    rows = [
        {"page_size": 16, "release_us_per_token_scrub": 0.080, "release_us_per_token_plain": 0.005,
         "scrub_over_plain": 16.0},
        {"page_size": 512, "release_us_per_token_scrub": 0.061, "release_us_per_token_plain": 0.001,
         "scrub_over_plain": 61.0},
    ]  # fmt: skip
    f = tmp_path / "fixes.json"
    f.write_text(json.dumps({**bench(None), "scrub_by_page_size": rows, "torch_threads": 2}))
    cost = scrub_cost(f)
    assert cost.extra_us == pytest.approx((0.060, 0.075))  # scrub minus plain, not the scrub alone
    assert cost.times_plain == (16.0, 61.0) and cost.page_sizes == (16, 512)
    said = cost.describe()
    assert "0.060-0.075 µs more than a plain release, 16-61x its time" in said
    assert "a CPU with 2 torch threads, not measured in this run" in said
