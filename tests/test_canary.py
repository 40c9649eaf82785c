"""The canary harness and the TTFT floor: the checks the launch tests lacked."""

from __future__ import annotations

from minigrid_engine.canary import CanaryHarness, TTFTFloor, longest_shared_run


def test_foreign_canaries_are_a_leak_own_are_not() -> None:
    h = CanaryHarness(seed=1)
    alice = h.prompt("alice", 300, 5)
    bob = h.prompt("bob", 300, 5)
    assert len(alice) == 300 and len(h.canaries["alice"]) == 5
    a_code = sorted(h.canaries["alice"])[0]
    finding = h.check("bob", f"BOB pin 12; ALICE key {a_code}; ")
    assert finding.leak and finding.foreign_canaries == {"alice": {a_code}}
    assert "alice's canaries" in finding.explain()
    own = bob[40:80]
    clean = h.check("bob", own)
    assert not clean.leak, clean.explain()


def test_a_canary_cut_short_is_a_leak_when_fragments_count() -> None:
    """An answer that ends inside a record holds its code cut short: 6 characters in a row of it
    count with `fragment=6`, unless the same 6 are in one of the reader's own codes."""
    h = CanaryHarness(seed=3)
    h.prompt("alice", 200, 4)
    h.prompt("bob", 200, 4)
    a_code = sorted(h.canaries["alice"])[0]
    cut = f"BOB pin 12; ALICE key {a_code[:7]}"
    assert not h.check("bob", cut).leak  # whole codes only, by default
    finding = h.check("bob", cut, fragment=6)
    assert finding.foreign_canaries == {"alice": {a_code}} and finding.partial == {a_code}
    whole = h.check("bob", f"ALICE key {a_code}; ", fragment=6)
    assert whole.foreign_canaries == {"alice": {a_code}} and not whole.partial
    b_code = sorted(h.canaries["bob"])[0]
    h.canaries["alice"].add(b_code[:6] + "QQQQ")  # shares its first 6 with one of bob's own
    assert not h.check("bob", b_code[:6], fragment=6).leak
    assert not h.check("bob", a_code[:5], fragment=6).leak  # 5 are too few


def test_a_long_run_of_another_tenants_text_is_a_leak_without_canaries() -> None:
    h = CanaryHarness(seed=2, run_threshold=24)
    h.register("alice", "the board meets on friday to approve the merger with globex corp")
    f = h.check("bob", "xx approve the merger with globex corp yy")
    assert f.longest_foreign_run >= 24 and f.leak and f.longest_foreign_run_owner == "alice"
    assert not h.check("bob", "the cat sat on the mat").leak
    # the threshold itself: a run of exactly 24 characters is a leak, 23 is not
    assert h.check("bob", "<" + "approve the merger with globex corp"[:24] + ">").leak
    assert not h.check("bob", "<" + "approve the merger with globex corp"[:23] + ">").leak
    h.register("bob", "note: the board meets on friday to approve the merger with initech")
    assert not h.check("bob", "xx the board meets on friday to approve the merger with yy").leak  # his own
    assert longest_shared_run("abcdef", "zzcdezz") == 3
    # a run the reader's own prompt also holds (a template both share) does not count...
    assert (
        longest_shared_run(
            "-- password for the Oslo server --",
            "The password for the Oslo server is x",
            exclude="Your password for the Lyon server",
        )
        == 30
    )
    assert (
        longest_shared_run(
            "-- password for the --", "The password for the Oslo", exclude="my password for the Lyon"
        )
        == 0
    )
    # ...unless it runs on into text the prompt does not hold
    assert (
        longest_shared_run("password for the Oslo", "the password for the Oslo", exclude="password for the ")
        == 21
    )


def test_ttft_floor_flags_an_answer_faster_than_its_prefill() -> None:
    floor = TTFTFloor(margin=0.5)
    assert not floor.too_fast(1000, 0.001)  # nothing observed yet: no claim
    floor.observe(500, 0.050)  # 10,000 prefill tokens/s seen
    assert abs(floor.floor_s(1000) - 0.050) < 1e-9
    assert floor.too_fast(1000, 0.020)
    assert not floor.too_fast(1000, 0.080)


def test_ttft_floor_with_a_fixed_cost_flags_a_stub_a_rate_alone_would_miss() -> None:
    """Measured on the CPU engine: ~43 ms for any request, +0.04 ms a prompt token. A stub of a
    700-token prompt answers in 44 ms; a real prefill of it takes ~71 ms."""
    floor = TTFTFloor()
    for ttft in (0.045, 0.043, 0.044):
        floor.observe(22, ttft)  # short prompts: the trip's fixed cost
    floor.observe(574, 0.066)  # a victim prompt, really prefilled
    fixed, per_token = floor.model()
    assert fixed == 0.043 and abs(per_token - 0.023 / 552) < 1e-12
    assert floor.too_fast(700, 0.044)  # the stub
    assert not floor.too_fast(700, 0.071)  # a real prefill of it
    assert not floor.too_fast(30, 0.040)  # a short prompt a little faster than seen: no false alarm
    floor.observe(30, 0.0431)  # a prompt barely longer than the shortest says nothing of the rate
    assert floor.model() == (fixed, per_token) and floor.too_fast(700, 0.044)
    only_rate = TTFTFloor()
    only_rate.observe(574, 0.066)
    assert not only_rate.too_fast(700, 0.044)  # what the rate alone said
