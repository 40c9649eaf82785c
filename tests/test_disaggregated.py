"""The disaggregated engine as real processes: the incident's leak, reproduced as readable text."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from cli_run import minigrid

from minigrid_engine.config import MODEL_ID, corrected_preset, incident_preset
from minigrid_engine.handle import Engine
from minigrid_engine.messages import RecentRooms
from minigrid_engine.records import record_prompt
from minigrid_engine.scenario import codes_in, record_codes, run_incident


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def incident():
    eng = Engine.start(incident_preset(tenants={"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol"}))
    yield eng
    eng.stop()


def test_startup_logs_each_pool_in_tokens_and_pages(incident: Engine) -> None:
    log = incident.log()
    assert "prefill KV pool: 665 tokens in 6 pages of 128 tokens" in log
    assert "decode KV pool: 4096 tokens in 32 pages of 128 tokens" in log
    m = incident.metrics()
    assert m['minigrid_kv_pool_capacity_tokens{role="prefill"}'] == 665
    assert m['minigrid_kv_pool_capacity_tokens{role="decode"}'] == 4096
    assert m["minigrid_context_length_tokens"] == 1024
    for name in ("minigrid_kv_checksum_mismatches_total", "minigrid_owner_check_violations_total"):
        assert name in m


def test_the_incident_bob_reads_alices_pages(incident: Engine) -> None:
    rep = run_incident(
        incident,
        attempts=4,
        context_length=1024,
        prefill_pool_tokens=665,
        attacker_len=1000,
        max_tokens=24,
        seed=1,
    )
    r = rep.reply
    assert r.status == 200, r.error  # 200 instead of 400
    assert r.prompt_tokens == 1000  # an exact prompt-token count
    assert rep.leaked_codes, f"bob's answer {r.text!r} holds none of alice's secrets"
    assert rep.longest_run >= 12, f"bob's answer {r.text!r} shares no long run with alice's prompts"
    assert rep.pages_by_tenant() == {"alice": 7, "bob": 1}, rep.pages
    assert rep.pages[0]["last_writer_tenant"] == "bob"  # the one page prefill wrote: the stub
    assert r.ttft_s is not None and rep.baseline_ttft_s is not None
    assert r.ttft_s < rep.baseline_ttft_s, "bob's 1000 tokens came back faster than alice's shorter prefill"
    assert rep.too_fast, "the TTFT floor should flag a 1000-token answer this fast"
    m = incident.metrics()
    assert m["minigrid_prefill_stubbed_requests_total"] >= 1
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0
    assert m['minigrid_kv_pages_in_use{role="prefill"}'] == 0


def test_prompts_that_fit_answer_from_their_own_context_in_one_batch(incident: Engine) -> None:
    rng = random.Random(9)
    prompts = {
        t: record_prompt(t, rng.randint(200, 500), rng, rng.randint(3, 7)) for t in ("alice", "bob", "carol")
    }
    since = max((e["seq"] for e in incident.trace()["decode"]), default=-1) + 1  # run alone: none yet
    with ThreadPoolExecutor(3) as pool:
        replies = dict(
            zip(prompts, pool.map(lambda t: incident.complete(t, prompts[t], max_tokens=40), prompts))
        )
    for tenant, reply in replies.items():
        assert reply.status == 200 and reply.prompt_tokens == len(prompts[tenant])
        own = record_codes(prompts[tenant], tenant)
        found = codes_in(reply.text)
        assert found, f"{tenant}'s answer {reply.text!r} copied no record"
        assert found <= own, f"{tenant}'s answer {reply.text!r} holds codes not in its prompt"
    reads = [e for e in incident.trace(since=since)["decode"] if e["kind"] == "read"]
    assert max(e["detail"]["batch_size"] for e in reads) >= 2, "the tenants never shared a decode batch"


def test_tenants_see_only_their_own_trace(incident: Engine) -> None:
    incident.complete("carol", "CAROL pin 123456; " * 4, max_tokens=4)
    events = incident.trace(tenant="carol")
    assert events["decode"] and {e["tenant"] for role in events.values() for e in role} == {"carol"}
    r = httpx.get(f"{incident.url}/v1/minigrid/pools", headers={"Authorization": "Bearer sk-carol"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [({}, 401, "invalid_api_key"), ({"Authorization": "Bearer sk-nobody"}, 401, "invalid_api_key")],
)
def test_missing_or_unknown_key_is_401(
    incident: Engine, headers: dict[str, str], status: int, code: str
) -> None:
    r = httpx.post(f"{incident.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == status and r.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 4}, "prompt", "missing_required_parameter"),
        ({"prompt": ""}, "prompt", "invalid_prompt"),
        ({"prompt": 5}, "prompt", "invalid_type"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "invalid_type"),
        ({"prompt": "x", "temperature": 9}, "temperature", "invalid_value"),
        ({"prompt": "x" * 1020, "max_tokens": 16}, "prompt", "context_length_exceeded"),
    ],
)
def test_bad_bodies_get_openai_style_400(incident: Engine, body: dict, param: str, code: str) -> None:
    r = httpx.post(f"{incident.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["type"] == "invalid_request_error"


def test_a_pools_refusal_names_the_param_the_routers_check_names() -> None:
    """The prefill pool's refusal (`reject-before-transfer`) and the decode pool's (a request
    larger than the whole pool) are made in the workers, which see token ids only; the 400 names
    the prompt's field as the router's own length check does (above): `prompt` for completions,
    `messages` for chat, streamed or not."""
    cfg = incident_preset(decode_pool_tokens=768, tenants={"bob": "sk-bob"})  # prefill pool: 665
    refusals = [  # (prompt, max_tokens, what the refusal says): both fit the context of 1024
        ("x" * 700, 16, "This prompt of 700 tokens does not fit the prefill KV pool of 665 tokens"),
        ("x" * 600, 200, "needs 800 tokens of decode KV (600 prompt + 200 max_tokens)"),
    ]
    endpoints = [
        ("/v1/completions", lambda text: {"prompt": text}, "prompt"),
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]
    with (
        Engine.start(cfg, fixes="reject-before-transfer") as eng,
        httpx.Client(base_url=eng.url, headers={"Authorization": "Bearer sk-bob"}, timeout=60) as http,
    ):
        for text, max_tokens, message in refusals:
            for path, body, param in endpoints:
                for stream in (False, True):
                    r = http.post(path, json={**body(text), "max_tokens": max_tokens, "stream": stream})
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
                    assert message in err["message"], err
        assert eng.metrics()['minigrid_kv_pages_in_use{role="decode"}'] == 0


def test_official_openai_client_works_unchanged(incident: Engine) -> None:
    client = openai.OpenAI(base_url=f"{incident.url}/v1", api_key="sk-alice", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    prompt = "ALICE card QZ7K2M9P; ALICE pin 48213X; " * 5
    done = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20)
    assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == 20
    assert "ALICE" in done.choices[0].text
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_ID, prompt="x" * 2000, max_tokens=5)
    assert exc.value.code == "context_length_exceeded"
    bad = openai.OpenAI(base_url=f"{incident.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)


def test_other_numbers_leak_the_same_way() -> None:
    """Pages of 64, prefill pool 720, decode pool 3072, a 980-token prompt: not one configuration."""
    cfg = incident_preset(page_size=64, prefill_pool_tokens=720, decode_pool_tokens=3072)
    with Engine.start(cfg) as eng:
        assert "prefill KV pool: 720 tokens in 12 pages of 64 tokens" in eng.log()
        rep = run_incident(
            eng,
            context_length=1024,
            prefill_pool_tokens=720,
            attacker_len=980,
            max_tokens=24,
            seed=2,
            attempts=4,
        )
        assert rep.reply.status == 200 and rep.reply.prompt_tokens == 980
        assert rep.leaked_codes, rep.summary()
        assert rep.pages_by_tenant() == {"bob": 1, "alice": 15}, rep.pages  # 981 tokens read: 16 pages of 64


def test_dead_worker_is_reported_not_hung() -> None:
    """With restarts off (--worker-restarts 0) a dead worker leaves the engine down, saying why;
    tests/test_restart.py has the restarts."""
    with Engine.start(incident_preset(worker_restarts=0)) as eng:
        pids = eng.worker_pids()
        os.kill(pids["decode"], signal.SIGKILL)
        eng.wait_health("down", timeout_s=30)
        status, body = eng.health()
        assert status == 503 and not body["workers"]["decode"]["up"]
        assert "decode worker died" in body["workers"]["decode"]["error"]
        assert "restarts are off (--worker-restarts 0)" in body["recovery"]
        t0 = time.monotonic()
        r = eng.complete("alice", "ALICE pin 1; " * 3, max_tokens=3)
        assert r.status == 503 and "decode worker died" in r.error["message"]
        assert r.error["code"] == "engine_down"
        assert time.monotonic() - t0 < 5


def test_sigterm_stops_all_three_processes() -> None:
    eng = Engine.start(incident_preset())
    pids = [*eng.worker_pids().values()]
    assert eng.proc is not None
    eng.stop()
    assert eng.proc.returncode == 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a worker outlived the router"


def test_router_killed_outright_leaves_no_orphans() -> None:
    eng = Engine.start(incident_preset())
    pids = [*eng.worker_pids().values()]
    assert eng.proc is not None
    eng.proc.kill()
    eng.proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "workers outlived a SIGKILLed router"


def test_a_killed_notebook_kernel_leaves_no_engine() -> None:
    """The embedded engine stops when the process that started it dies (a restarted kernel)."""
    code = (
        "from minigrid_engine.handle import Engine; from minigrid_engine.config import incident_preset; "
        "import os, sys; e = Engine.start(incident_preset()); "
        "print(e.proc.pid, *e.worker_pids().values(), flush=True); os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 3, proc.stdout + proc.stderr
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "the engine outlived the kernel that started it"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prefill-pool-tokens", "10"],
            "--prefill-pool-tokens 10 is smaller than one page of --page-size 128 tokens",
        ),
        (["--fixes", "bogus"], "unknown fix 'bogus': choose none, all, or"),
        (["--tenants", "alice"], "tenant 'alice' must be NAME:KEY"),
        (["--port", "70000"], "--port 70000 is not a TCP port"),
        (["--context-length", "lots"], "'lots' is not a whole number"),
        (["--attention", "flash"], "invalid choice: 'flash'"),
        (["--device", "cuda", "--fixes", "none"], "--device cuda: no CUDA device is visible"),
    ],
)
def test_serve_refuses_impossible_settings(args: list[str], message: str) -> None:
    proc = minigrid("serve", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def _audit(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return minigrid("audit", "--url", url, *extra, timeout=60)


def test_audit_reads_the_running_engine(incident: Engine) -> None:
    proc = _audit(incident.url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the prefill pool holds 665 tokens < context length 1024" in proc.stdout
    assert "/metrics" not in proc.stdout  # one minigrid server: where each pool was read goes unsaid
    report = json.loads(_audit(incident.url, "--json").stdout)
    assert report["ok"] is False
    prefill = next(p for p in report["pools"] if p["role"] == "prefill")
    assert prefill["shortfall_tokens"] == 1024 - 665


def test_audit_passes_the_corrected_configuration() -> None:
    with Engine.start(corrected_preset()) as eng:
        proc = _audit(eng.url)
        assert proc.returncode == 0, proc.stdout
        assert "PASS" in proc.stdout


def test_audit_of_nothing_says_so() -> None:
    proc = _audit("http://127.0.0.1:9")
    assert proc.returncode == 2 and "cannot read http://127.0.0.1:9/metrics" in proc.stderr


def test_a_role_remembers_recent_rooms_only() -> None:
    """Late messages are told apart by room, but the memory of rooms stays bounded."""
    rooms: RecentRooms[str] = RecentRooms(limit=3)
    for room in range(1, 7):
        rooms[room] = f"decode-{room % 2}"
    assert list(rooms) == [4, 5, 6] and rooms[5] == "decode-1"
    rooms[5] = "decode-0"  # seen again: updated, nothing else forgotten
    assert list(rooms) == [4, 5, 6]
