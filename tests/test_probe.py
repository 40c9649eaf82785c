"""`minigrid probe`: the canary test from outside, through nothing but the OpenAI API.

Pointed at the engine as launched, two accounts taking turns find the leak on prompts longer than
the prefill pool, and only there; pointed at a fixed engine, the same probe passes.
"""

from __future__ import annotations

import json
import os

import pytest
from cli_run import minigrid

from minigrid_engine.config import corrected_preset, incident_preset
from minigrid_engine.errors import MinigridError
from minigrid_engine.handle import Engine
from minigrid_engine.probe import ProbeConfig, probe

TENANTS = "alice:sk-alice,bob:sk-bob"


def test_the_probe_finds_the_leak_past_the_pool_and_only_there() -> None:
    with Engine.start(incident_preset(), fixes="none") as eng:
        proc = minigrid("probe", "--url", eng.url, "--tenants", TENANTS, "--json", timeout=300)
        text = minigrid("probe", "--url", eng.url + "/v1", "--tenants", TENANTS, "--rounds", "1", timeout=300)
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
        assert all(code in s["answer"] for code in s["foreign"][other])
    assert text.returncode == 1 and "FAIL:" in text.stdout and "leak: round 1" in text.stdout


@pytest.mark.parametrize(
    ("preset", "fixes", "rejected"),
    [(incident_preset, "reject-before-transfer", True), (corrected_preset, "all", False)],
)
def test_a_fixed_engine_passes(preset: object, fixes: str, rejected: bool) -> None:
    with Engine.start(preset(), fixes=fixes) as eng:  # type: ignore[operator]
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
