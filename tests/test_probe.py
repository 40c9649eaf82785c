"""`minigrid probe`: the canary test from outside, through nothing but the OpenAI API.

Pointed at the engine as launched, two accounts taking turns find the leak on prompts longer than
the prefill pool, and only there; pointed at a fixed engine, the same probe passes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
from cli_run import minigrid
from fake_http import Route

from minigrid_engine.config import ServeConfig, corrected_preset, incident_preset
from minigrid_engine.errors import MinigridError
from minigrid_engine.handle import Engine
from minigrid_engine.probe import ProbeConfig, ProbeReport, ProbeShot, probe

TENANTS = "alice:sk-alice,bob:sk-bob"


def test_the_probe_finds_the_leak_past_the_pool_and_only_there() -> None:
    with Engine.start(incident_preset(), fixes="none") as eng:
        proc = minigrid("probe", "--url", eng.url, "--tenants", TENANTS, "--json", timeout=300)
        text = minigrid("probe", "--url", eng.url + "/v1", "--tenants", TENANTS, "--rounds", "1", timeout=300)
        # answers of 20 tokens are shorter than a record: the leak shows as whole codes or codes cut
        # short (test_a_canary_cut_short_is_still_a_leak counts the latter, on a fake server)
        short = minigrid("probe", "--url", eng.url, "--tenants", TENANTS, "--max-tokens", "20", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"] == "minigrid-byte" and report["context_length"] == 1024
    assert report["chars_per_token"] == 1.0  # a byte model, measured through usage.prompt_tokens
    shots = report["shots"]
    assert all(s["status"] == 200 for s in shots)  # the incident: every prompt got its 200
    leaked = [s for s in shots if s["foreign"]]
    assert leaked and report["leaked_answers"] == len(leaked)
    assert all(s["prompt_tokens"] > 665 for s in leaked)  # only prompts the prefill pool cannot hold
    for s in leaked:
        other = "bob" if s["tenant"] == "alice" else "alice"
        assert list(s["foreign"]) == [other]
        for code in s["foreign"][other]:  # whole, or 6 characters of it in a row at least
            assert code in s["answer"] or (code in s["partial"] and re.search(_pieces(code), s["answer"]))
    assert text.returncode == 1 and "FAIL:" in text.stdout and "leak: round 1" in text.stdout
    assert short.returncode == 1 and "FAIL:" in short.stdout, short.stdout + short.stderr
    assert "answers of 20 tokens are shorter than one record" in short.stdout


def _pieces(code: str) -> str:
    return "|".join(code[i : i + 6] for i in range(len(code) - 5))


@pytest.mark.parametrize(
    ("preset", "fixes", "rejected"),
    [(incident_preset, "reject-before-transfer", True), (corrected_preset, "all", False)],
)
def test_a_fixed_engine_passes(preset: Callable[[], ServeConfig], fixes: str, rejected: bool) -> None:
    with Engine.start(preset(), fixes=fixes) as eng:
        report = probe(ProbeConfig(eng.url, dict(eng.tenants), rounds=2))
        chat = probe(ProbeConfig(eng.url, dict(eng.tenants), rounds=1, chat=True, max_tokens=16))
    assert report.ok and chat.ok, report.text() + chat.text()
    over = [s for s in report.shots if (s.target_tokens or 0) > 665]
    assert over and all(s.status == (400 if rejected else 200) for s in over)
    if rejected:
        assert {s.code for s in over} == {"context_length_exceeded"}
    assert "PASS: none of" in report.text()
    assert chat.chars_per_token == pytest.approx(1.0) and chat.answered > 0


def test_the_probe_needs_two_accounts_and_a_server() -> None:
    with pytest.raises(MinigridError, match="give two at least"):
        ProbeConfig("http://127.0.0.1:9", {"alice": "sk-alice"})
    proc = minigrid("probe", "--url", "http://127.0.0.1:9", "--tenants", TENANTS, timeout=60)
    assert proc.returncode == 2 and "cannot reach http://127.0.0.1:9/v1/models" in proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "MINIGRID_PROBE_TENANTS"}
    proc = minigrid("probe", "--url", "http://127.0.0.1:9", timeout=60, env=env)
    assert proc.returncode == 2 and "give the accounts with --tenants" in proc.stderr
    proc = minigrid("probe", "--url", "x", "--tenants", TENANTS, "--prompt-tokens", "100,abc")
    assert proc.returncode == 2 and "'abc' is not a whole number" in proc.stderr


def test_a_wrong_key_is_named() -> None:
    with Engine.start(corrected_preset()) as eng:
        proc = minigrid("probe", "--url", eng.url, "--tenants", "alice:sk-alice,bob:sk-wrong", timeout=120)
    assert proc.returncode == 2 and "answered HTTP 401 to bob's key" in proc.stderr
    assert "Traceback" not in proc.stderr


class OtherServer:
    """An OpenAI-compatible server unlike minigrid: 4 characters a token, a 10-token template, no
    streaming (JSON even when asked to stream). With `leaky`, it answers each prompt with the codes
    of the prompt before it, whoever sent that one: the incident's answers, built on stale pages."""

    def __init__(self, leaky: bool, cut: int | None = None) -> None:
        self.leaky, self.cut, self.last_prompt = leaky, cut, ""  # cut: the answer ends inside a code
        self.streamed: list[bool] = []

    def models(self, _: Any) -> Route:
        return 200, json.dumps({"object": "list", "data": [{"id": "big-llm", "max_model_len": 32_768}]})

    def complete(self, body: Any) -> Route:
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        self.streamed.append(bool(body.get("stream")))
        tokens = len(prompt) // 4 + 10
        if tokens + body["max_tokens"] > 32_768:
            return 400, json.dumps({"error": {"code": "context_length_exceeded", "message": "too long"}})
        source = self.last_prompt if self.leaky else prompt
        self.last_prompt = prompt
        text = " ".join(re.findall(r"[A-Z0-9]{10}", source)[:3])
        if self.cut is not None:
            text = text[: self.cut]
        usage = {"prompt_tokens": tokens, "completion_tokens": 3, "total_tokens": tokens + 3}
        return 200, json.dumps({"object": "text_completion", "choices": [{"text": text}], "usage": usage})


@pytest.mark.parametrize("leaky", [True, False])
def test_any_openai_server_in_its_own_tokens(serve: Any, leaky: bool) -> None:
    other = OtherServer(leaky)
    server = serve({"/v1/models": other.models, "/v1/completions": other.complete})
    proc = minigrid("probe", "--url", server.url, "--tenants", "ops-a:k1,ops-b:k2,ops-c:k3", "--json")
    assert proc.returncode == (1 if leaky else 0), proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"] == "big-llm" and report["chars_per_token"] == pytest.approx(4.0)
    assert report["overhead_tokens"] == pytest.approx(10.0, abs=1)
    targets = sorted({s["target_tokens"] for s in report["shots"]})
    assert targets[-1] == 32_768 - 48  # the default spread ends at the context, less the answer
    for s in report["shots"]:  # each prompt came out at its length in the server's tokens
        assert s["prompt_tokens"] == pytest.approx(s["target_tokens"], abs=2)
        assert s["ttft_s"] is None  # not streamed: no timing verdict, no false alarm
    assert all(other.streamed[2:])  # the probe asked for a stream every time after calibration
    leaked = [s for s in report["shots"] if s["foreign"]]
    assert bool(leaked) is leaky
    if leaky:  # each answer held the codes of the prompt before it, always another account's
        assert len(leaked) == len(report["shots"])
        assert all(s["tenant"] not in s["foreign"] for s in leaked)


def test_a_canary_cut_short_is_still_a_leak(serve: Any) -> None:
    """An answer that stops 8 characters into another account's code: the stale page is there."""
    other = OtherServer(leaky=True, cut=8)
    server = serve({"/v1/models": other.models, "/v1/completions": other.complete})
    report = probe(ProbeConfig(server.url, {"ops-a": "k1", "ops-b": "k2"}, rounds=1, max_tokens=8))
    assert len(report.leaks) == len(report.shots) and all(s.partial for s in report.leaks)
    assert all(len(s.answer) == 8 and s.partial[0].startswith(s.answer) for s in report.leaks)
    text = report.text()
    assert "(in part)" in text and "... and 5 more leaks (--json lists every answer)" in text
    assert "answers of 8 tokens are shorter than one record" in text and "FAIL: 10 answers" in text
    honest = OtherServer(leaky=False, cut=8)
    server = serve({"/v1/models": honest.models, "/v1/completions": honest.complete})
    assert probe(ProbeConfig(server.url, {"ops-a": "k1", "ops-b": "k2"}, rounds=1, max_tokens=8)).ok


def test_a_server_that_is_not_openai_compatible_is_named(serve: Any) -> None:
    html = (404, "<html><body>Error response 404: File not found</body></html>")
    server = serve(
        {"/v1/models": html, "/v1/completions": (501, "<html><body>Unsupported method</body></html>")}
    )
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, timeout=60)
    assert proc.returncode == 2 and "/v1/models lists no model: HTTP 404" in proc.stderr, proc.stderr
    assert "is it an OpenAI-compatible server?" in proc.stderr and "File not found" in proc.stderr
    named = ("--model", "x", "--context-length", "4096")
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, *named, timeout=60)
    assert proc.returncode == 2 and f"POST {server.url}/v1/completions with a" in proc.stderr, proc.stderr
    assert (
        "answered HTTP 501 without usage.prompt_tokens" in proc.stderr and "Unsupported method" in proc.stderr
    )
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    fixed = (200, json.dumps({"choices": [{"text": "x"}], "usage": usage}))  # a proxy rewriting usage
    server = serve({"/v1/models": OtherServer(False).models, "/v1/completions": fixed})
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, timeout=60)
    assert proc.returncode == 2 and "were counted as 3 and 3 tokens" in proc.stderr, proc.stderr
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, "--max-tokens", "40000", timeout=60)
    assert "--max-tokens 40000 leaves 0 of the context's 32768 tokens" in proc.stderr, proc.stderr


def test_a_server_that_refuses_every_prompt_tested_nothing(serve: Any) -> None:
    """Every prompt answered 400 (a wrong model name, a proxy's limit): no leak seen, but nothing
    was tested either, so the exit status is 2, not the 0 of a pass."""
    other = OtherServer(False)
    refusal = json.dumps({"error": {"message": "over this proxy's limit", "code": "x"}})

    def calibrate_then_refuse(body: Any) -> tuple[int, str]:  # calibration: 256 and 1,024 characters
        return other.complete(body) if len(body["prompt"]) <= 1024 else (400, refusal)

    server = serve({"/v1/models": other.models, "/v1/completions": calibrate_then_refuse})
    named = ("--model", "x", "--context-length", "4096", "--prompt-tokens", "400,800", "--rounds", "1")
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, *named, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NOTHING TESTED: no prompt got an answer (HTTP 200)" in proc.stdout


def test_prompt_lengths_the_context_refuses_are_named_before_anything_is_sent(serve: Any) -> None:
    """A 32,750-token prompt with 48 answer tokens exceeds the 32,768-token context: the server's
    400 would say nothing of its pools, and a run of such prompts would pass as clean."""
    other = OtherServer(leaky=True)
    server = serve({"/v1/models": other.models, "/v1/completions": other.complete})
    proc = minigrid("probe", "--url", server.url, "--tenants", TENANTS, "--prompt-tokens", "1000,32750")
    assert proc.returncode == 2 and not other.streamed, proc.stdout + proc.stderr
    assert (
        "--prompt-tokens 32750 with --max-tokens 48 exceed the context of 32768 tokens" in proc.stderr
        and "at most 32720 tokens" in proc.stderr
    ), proc.stderr


def test_a_context_above_the_stated_one_is_probed_not_calibrated_at(serve: Any) -> None:
    """--context-length 40000 on a 32,768-token server: calibration stays within what the server
    takes; the prompts past its context get their 400, which is the right answer."""
    other = OtherServer(leaky=False)
    server = serve({"/v1/models": other.models, "/v1/completions": other.complete})
    cfg = ProbeConfig(server.url, {"ops-a": "k1", "ops-b": "k2"}, rounds=1, context_length=40_000)
    report = probe(cfg)
    assert report.ok and report.chars_per_token == pytest.approx(4.0)
    over = [s for s in report.shots if s.target_tokens + 48 > 32_768]
    assert over and all(s.status == 400 for s in over)


def _shot(target: int, ttft: float | None) -> ProbeShot:
    return ProbeShot(1, "alice", target, target, status=200, ttft_s=ttft)


def test_an_answer_faster_than_its_prefill_fails() -> None:
    shots = [_shot(1000, 0.40), _shot(1000, 0.50), _shot(1000, 0.45), _shot(8000, 1.9), _shot(8000, 0.05)]
    report = ProbeReport("http://x", "m", 8192, 4.0, 0.0, shots)
    assert report.judge_timing() == pytest.approx(0.45)
    assert [s.too_fast for s in shots] == [False, False, False, False, True]
    assert not report.ok and "1 more came faster than a real prefill" in report.text()
    # a short prompt answered fast is no evidence: only prompts twice the shortest are judged
    quick_short = [_shot(1000, 0.40), _shot(1000, 0.01), _shot(1500, 0.01)]
    report = ProbeReport("http://x", "m", 8192, 4.0, 0.0, quick_short)
    report.judge_timing()
    assert report.ok
    # prompts in flight at once: queueing sets the first token's time, so no timing verdict
    report = ProbeReport(
        "http://x", "m", 8192, 4.0, 0.0, [_shot(1000, 0.4), _shot(1000, 0.5), _shot(8000, 0.05)], 4
    )
    assert report.judge_timing() is None and report.ok
    assert "4 prompts in flight at once (no timing verdict)" in report.text()
    two = ProbeReport(
        "http://x", "m", 8192, 4.0, 0.0, [_shot(1000, 0.4), _shot(1000, 0.5), _shot(8000, 0.05)], 2
    )
    assert two.judge_timing() is None and two.ok  # two at once are already a queue
    # one streamed answer of the shortest length is no baseline to judge by
    one = ProbeReport("http://x", "m", 8192, 4.0, 0.0, [_shot(1000, 0.4), _shot(8000, 0.05)])
    assert one.judge_timing() is None and one.ok


def test_prompts_in_flight_at_once_still_find_the_leak_past_the_pool() -> None:
    """A busy deployment: four prompts at a time, pages freed and reused while others are served."""
    with Engine.start(incident_preset(), fixes="none") as eng:
        report = probe(ProbeConfig(eng.url, dict(eng.tenants), rounds=2, concurrency=4))
        eng.set_fixes("reject-before-transfer,owner-check")
        fixed = probe(ProbeConfig(eng.url, dict(eng.tenants), rounds=2, concurrency=4, seed=1))
    assert report.answered == len(report.shots) == 20  # every prompt answered, none lost
    assert [(s.round, s.tenant, s.target_tokens) for s in report.shots][:2] == [
        (1, "bob", 244),
        (1, "alice", 244),
    ]
    assert report.leaks and all((s.prompt_tokens or 0) > 665 for s in report.leaks)
    assert all(s.tenant not in s.foreign for s in report.leaks)
    assert not report.too_fast
    # fixed: the 12 prompts past the 665-token pool get their 400, the 8 that fit are answered
    assert fixed.ok and fixed.answered == 8
    assert all(
        (s.status, s.code) == (400, "context_length_exceeded") for s in fixed.shots if s.target_tokens > 665
    )
