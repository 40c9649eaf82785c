"""The command line: clear one-line errors that name the value, and a working generate."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest
from cli_run import minigrid

from minigrid_engine.cli import build_parser


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pool", "--pool-tokens", "abc"], "'abc' is not a whole number"),
        (["pool", "--pool-tokens", "1024", "--page-size", "0"], "0 must be at least 1"),
        (["pool", "--pool-memory", "lots"], "'lots' is not a memory size"),
        (["pool", "--pool-memory", "1KiB"], "memory budget of 1024 bytes is smaller than one page"),
        (["generate", "--prompt", ""], "prompt is empty"),
        (["generate", "--prompt", "hi", "--max-tokens", "-3"], "-3 must be at least 1"),
        (["generate", "--prompt", "hi", "--stop", ""], "a stop sequence is empty"),
        (
            ["generate", "--prompt", "hi", "--prompt-file", "/dev/null"],
            "argument --prompt-file: not allowed with argument --prompt",
        ),
        (
            ["generate", "--prompt", "hi", "--temperature", "3"],
            "'temperature' must be a number from 0 to 2, got 3",
        ),
        (["bogus"], "invalid choice: 'bogus'"),
        (
            ["serve", "--preset", "corrected", "--ready-file", "/nonexistent/url"],
            "--ready-file /nonexistent/url: the folder /nonexistent does not exist",
        ),
        (
            ["serve", "--workshop", "2", "--keys-file", "/nonexistent/keys.csv"],
            "--keys-file /nonexistent/keys.csv: the folder /nonexistent does not exist",
        ),
        (["serve", "--preset", "corrected", "--tenants", "admin:sk-t"], "a tenant may not be called 'admin'"),
        (
            ["serve", "--preset", "corrected", "--tenants", "alice:sk-a", "--admin-key", "sk-a"],
            "the admin key is also the key of tenant 'alice'",
        ),
        (
            ["serve", "--preset", "corrected", "--tenants", "zo\u00eb:cl\u00e9-zo\u00eb"],
            "the API key of tenant 'zo\u00eb' holds the character '\u00e9' (U+00E9)",
        ),
        (
            ["serve", "--preset", "corrected", "--admin-key", "sk admin"],
            "the admin key holds the character ' ' (U+0020)",
        ),
        (
            ["check-protocol", "--requests", "alice:9"],
            "alice-1: 9 pages; prompts run from 1 page to the context",
        ),
        (["check-protocol", "--requests", "alice"], "request 'alice': write TENANT:PAGES"),
        (["check-protocol", "--requests", ""], "--requests '': give at least one TENANT:PAGES"),
        (["check-protocol", "--requests", "a:1,b:1,c:1,d:1,e:1"], "5 requests: the model checks 1 to 4"),
        (["check-protocol", "--losses", "7"], "losses must be between 0 and 3, got 7"),
        (["check-protocol", "--fixes", "bogus"], "unknown fix 'bogus'"),
        (
            ["generate", "--prompt", "hi", "--temperature", "1", "--seed", str(10**24)],
            "'seed' must be a 64-bit signed integer",
        ),
        (["audit", "--url", "http://127.0.0.1:9", "--timeout", "-1"], "-1 seconds: give a number above 0"),
        (["audit", "--url", "http://127.0.0.1:9", "--timeout", "nan"], "nan seconds: give a number above 0"),
        (["audit", "--url", "http://[::1"], "'http://[::1' is not a URL the audit can read"),
        (["faults", "--restart-wait", "-1"], "-1 seconds: give a number above 0"),
        (
            ["probe", "--url", "http://127.0.0.1:9", "--tenants", "a:k1,b:k2", "--concurrency", "0"],
            "argument --concurrency: 0 must be at least 1",
        ),
        (["faults", "--only", ""], "--only '' names no case"),
        (["pool", "--page-size", "99999"], "--page-size 99999: between 1 and 4096 tokens per page"),
        (["pool", "--pool-tokens", "100"], "--pool-tokens 100 is smaller than one page of --page-size 128"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0: 'temperature' must be"),
        (["faults", "--only", "drop-done", "--out", "/"], "--out /: is a folder; give a file name"),
        (
            ["fuzz", "--max-tokens", "5000"],
            "--max-tokens 5000 leaves no room for a prompt in a context of 1024 tokens",
        ),
        (["fuzz", "--tenants", "1"], "--tenants 1: a campaign needs from 2 to 1,000"),
        (
            ["serve", "--fixes", "none", "--page-size", "5000", "--prefill-pool-tokens", "5000"],
            "--page-size 5000: between 1 and 4096 tokens per page",
        ),
        (["serve", "--config", "/nonexistent/cfg.json"], "--config /nonexistent/cfg.json: No such file"),
        (["serve", "--config", "cfg.json", "--preset", "corrected"], "and --preset corrected: choose one"),
        (
            ["serve", "--page-size", "0"],
            "minigrid serve: error: argument --page-size: 0 must be at least 1 "
            "(minigrid serve --help lists the options)",
        ),
        (
            ["probe", "--url", "http://127.0.0.1:9", "--rounds", "0"],
            "argument --rounds: 0 must be at least 1",
        ),
        (["check-protocol", "--prefill-pages", "0"], "argument --prefill-pages: 0 must be at least 1"),
        (
            ["serve", "--preset", "corrected", "--fixes", "owner-check,,kv-checksum"],
            "--fixes 'owner-check,,kv-checksum': item 2 is empty",
        ),
        (
            ["serve", "--preset", "corrected", "--fixes", "owner-check,"],
            "--fixes 'owner-check,': item 2 is empty",
        ),
    ],
)
def test_bad_values_get_one_clear_line(args: list[str], message: str) -> None:
    proc = minigrid(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr  # no usage block: --help has it


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(
    ("args", "workers", "reason"),
    [
        ([], "the prefill worker", "capacity-check: the prefill KV pool holds 665 tokens"),
        (
            ["--preset", "corrected", "--context-length", "5000"],
            "the prefill and decode workers",
            "capacity-check: the prefill KV pool holds 2048 tokens and the decode KV pool 4096 tokens",
        ),
        (
            ["--preset", "incident", "--prefill-workers", "2"],
            "the prefill workers",
            "capacity-check: the prefill KV pool holds 665 tokens",
        ),
        (  # a check only the worker can make (it needs torch): said once all the same
            ["--preset", "corrected", "--decode-pool-tokens", "4000000000"],
            "the decode worker",
            "--decode-pool-tokens 4000000000: decode KV pool: 4000000000 tokens",
        ),
        pytest.param(
            ["--preset", "corrected", "--device", "cuda"],
            "the prefill and decode workers",
            "--device cuda: no CUDA device is visible",
            marks=pytest.mark.skipif(_cuda(), reason="a CUDA device is visible here"),
        ),
    ],
    ids=["incident", "both-pools", "two-prefill-workers", "no-memory", "no-cuda"],
)
def test_a_refusal_to_start_is_said_once_naming_the_workers(
    args: list[str], workers: str, reason: str
) -> None:
    proc = minigrid("serve", "--port", "0", *args, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"minigrid serve: error: {workers} refused to start: {reason}"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.count(reason) == 1, proc.stderr


def test_undecodable_prompt_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ALICE \xff\xfe")
    proc = minigrid("generate", "--prompt-file", str(bad))
    assert proc.returncode == 2
    assert "not valid UTF-8: byte 0xff at offset 6" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "h\udcffi"], "prompt is not valid UTF-8: byte 0xff at offset 1"),
        (["--prompt", "hi", "--stop", "\udcff"], "a stop sequence is not valid UTF-8: byte 0xff at offset 0"),
        (["--prompt", "hi", "--stop", ""], "a stop sequence is empty"),
    ],
    ids=["prompt", "stop", "empty-stop"],
)
def test_undecodable_arguments_are_named_before_the_model_loads(args: list[str], message: str) -> None:
    proc = minigrid("generate", *args)  # argv carries the invalid byte itself (os.fsencode)
    assert proc.returncode == 2 and message in proc.stderr
    assert "KV pool" not in proc.stderr and "Traceback" not in proc.stderr


def test_pool_reports_tokens_pages_and_bytes() -> None:
    proc = minigrid("pool", "--pool-tokens", "665", "--page-size", "128")
    assert proc.returncode == 0
    assert "665 tokens in 6 pages of 128 tokens" in proc.stdout
    assert "1536 bytes per token" in proc.stdout


def test_a_pool_too_big_to_hold_is_described_or_refused_in_one_line() -> None:
    """Describing a pool computes its size and allocates nothing; one the machine cannot hold is
    refused at start with the GiB it would cost, never a traceback or a worker lost to it."""
    described = minigrid("pool", "--pool-tokens", "100000000000")
    assert described.returncode == 0, described.stderr
    assert "100000000000 tokens in 781250000 pages of 128 tokens" in described.stdout
    assert "1536 bytes per token, 146484375.0 MiB" in described.stdout
    generate = minigrid("generate", "--prompt", "hi", "--pool-tokens", "100000000000")
    assert generate.returncode == 2 and "cannot allocate 143,051.1 GiB" in generate.stderr, generate.stderr
    serve = minigrid("serve", "--preset", "corrected", "--decode-pool-tokens", "100000000000", "--port", "0")
    assert serve.returncode == 2, serve.stderr
    assert "--decode-pool-tokens 100000000000" in serve.stderr and "GiB of memory" in serve.stderr
    for proc in (generate, serve):
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2, proc.stderr


def test_generate_copies_a_record() -> None:
    prompt = "ZED pin 7Q2M4K; ZED card PX81KQ0A; " * 6
    proc = minigrid("generate", "--prompt", prompt, "--max-tokens", "40", "--tenant", "zed")
    assert proc.returncode == 0, proc.stderr
    records = re.findall(r"ZED [a-z]+ [A-Z0-9]+; ", proc.stdout)
    assert records and all(r in prompt for r in records), proc.stdout
    assert "engine KV pool: 2048 tokens in 16 pages" in proc.stderr


def test_generate_ends_at_a_stop_text_and_leaves_it_out() -> None:
    prompt = "ZED pin 7Q2M4K; ZED card PX81KQ0A; " * 6
    whole = minigrid("generate", "--prompt", prompt, "--max-tokens", "40", "--tenant", "zed")
    cut = minigrid("generate", "--prompt", prompt, "--max-tokens", "40", "--tenant", "zed", "--stop", "; ")
    assert whole.returncode == 0 and cut.returncode == 0, cut.stderr
    answer = cut.stdout.removesuffix("\n")
    assert "; " in whole.stdout and "; " not in answer, cut.stdout
    assert whole.stdout.startswith(answer + "; "), (whole.stdout, cut.stdout)


def test_generate_rejects_a_prompt_over_the_context() -> None:
    proc = minigrid("generate", "--prompt", "x" * 300, "--context-length", "256", "--pool-tokens", "512")
    assert proc.returncode == 1
    want = "prompt of 300 tokens + max_tokens 32 = 332 exceeds the context length of 256 tokens"
    assert want in proc.stderr
    pool = minigrid("generate", "--prompt", "x" * 300, "--context-length", "1024", "--pool-tokens", "256")
    assert "= 332 exceeds the KV pool of 256 tokens" in pool.stderr, pool.stderr
    tiny = minigrid("generate", "--prompt", "x", "--max-tokens", "1", "--context-length", "1")
    assert "exceeds the context length of 1 token" in tiny.stderr and "one page" not in tiny.stderr, (
        tiny.stderr
    )


def test_check_protocol_finds_the_incident_and_the_fixes_close_it() -> None:
    import json

    bug = minigrid("check-protocol", "--fixes", "none")
    assert bug.returncode == 1, bug.stderr
    assert "VIOLATION (stale-read), shortest trace of 18 steps" in bug.stdout
    assert "reads page 1 of alice-1 (alice)" in bug.stdout
    fixed = minigrid("check-protocol", "--scenario", "late-transfer", "--fixes", "all", "--json")
    assert fixed.returncode == 0, fixed.stderr
    (result,) = json.loads(fixed.stdout)
    assert result["safe"] and result["complete"] and result["states_explored"] > 1000
    # other bounds than the built-in scenarios: three tenants, a bigger pool, a prompt over it
    custom = minigrid(
        "check-protocol",
        "--requests",
        "carol:1,dave:2,erin:4",
        "--prefill-pages",
        "3",
        "--decode-pages",
        "5",
        "--context-pages",
        "4",
    )
    assert custom.returncode == 0, custom.stdout + custom.stderr
    rows = dict(re.findall(r"^  (\S+)\s+[\d,]+  (.+)$", custom.stdout, re.M))
    assert rows["none"].startswith("stale-read"), custom.stdout
    assert rows["capacity-check"] == "refuses to start"
    assert rows["all-but-capacity-check"] == "safe" and rows["reject-before-transfer"] == "safe"
    assert "reads page" in custom.stdout and "erin-3" in custom.stdout


def test_check_protocol_cut_short_says_no_verdict() -> None:
    proc = minigrid("check-protocol", "--scenario", "late-transfer", "--fixes", "all", "--max-states", "50")
    assert proc.returncode == 2
    assert "search cut short at max_states: no verdict" in proc.stdout
    assert "cut short at --max-states" in proc.stderr


def test_a_config_file_is_checked_field_by_field(tmp_path: Path) -> None:
    """Each error names the key in the file ("page_size"), not the flag that would set it."""
    cfg = tmp_path / "cfg.json"
    for text, message in [
        ("{not json", "not JSON"),
        ("[1, 2]", "the settings must be a JSON object, got list"),
        ('{"context_lenght": 2048}', "unknown setting(s) context_lenght"),
        ('{"page_size": "big"}', "\"page_size\" must be a whole number, got 'big'"),
        ('{"context_length": "big"}', "\"context_length\" must be a whole number, got 'big'"),
        ('{"port": 70000}', '"port" 70000 is not a TCP port'),
        ('{"prefill_pool_tokens": 10}', '"prefill_pool_tokens" 10 is smaller than one page'),
        ('{"tenants": {" bob": "sk-b"}}', "tenant name ' bob': give a name without spaces around it"),
        ('{"fixes": ["owner-check", "bogus"]}', "unknown fix 'bogus'"),
        ('{"fixes": "owner-check,,kv-checksum"}', "\"fixes\" 'owner-check,,kv-checksum': item 2 is empty"),
        ('{"host": 5}', '"host" must be a string, got 5'),
        ('{"worker_listen": 7100}', '"worker_listen" must be a string, got 7100'),
        ('{"admin_key": 5}', '"admin_key" must be a string, got 5'),
        ('{"release_timeout_s": "5"}', "\"release_timeout_s\" '5' must be a number of seconds"),
        ('{"release_timeout_s": true}', '"release_timeout_s" True must be a number of seconds'),
    ]:
        cfg.write_text(text)
        proc = minigrid("serve", "--config", str(cfg))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"--config {cfg}: " in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("router", ["noport", "127.0.0.1:abc", "127.0.0.1:99999"])
def test_a_worker_names_a_router_address_it_cannot_use(router: str, tmp_path: Path) -> None:
    key = tmp_path / "key.hex"
    key.write_text("ab" * 32)
    proc = minigrid("worker", "--role", "decode", "--router", router, "--authkey-file", str(key))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--router {router!r} must be HOST:PORT" in proc.stderr, proc.stderr


def test_a_worker_with_no_router_there_names_the_address(tmp_path: Path) -> None:
    key = tmp_path / "key.hex"
    key.write_text("ab" * 32)
    with socket.socket() as s:  # a port nothing listens on: bound here, never listened
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        proc = minigrid(
            "worker",
            "--role",
            "decode",
            "--router",
            addr,
            "--authkey-file",
            str(key),
            "--connect-timeout",
            "1",
        )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"cannot reach a router at {addr} (nothing listened there for 1 s)" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--transfer-host", "nonexistent.invalid"),
        ("--worker-listen", "nonexistent.invalid:0"),
        ("--host", "999.1.1.1"),
        ("--host", "nonexistent.invalid"),
    ],
)
def test_serve_names_an_address_it_cannot_listen_on(flag: str, value: str) -> None:
    proc = minigrid("serve", "--preset", "corrected", flag, value, "--port", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{flag} {value}: cannot listen" in proc.stderr, proc.stderr


def test_serve_on_a_port_in_use_says_so_with_status_2() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = minigrid("serve", "--preset", "corrected", "--port", str(port))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr


def test_fuzz_draws_no_progress_bar_into_a_pipe() -> None:
    proc = minigrid("fuzz", "--requests", "3", "--concurrency", "1", "--abort-rate", "0", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "req/s" not in proc.stderr and "fuzz:" not in proc.stderr, proc.stderr


def test_check_protocol_cut_short_claims_no_isolation() -> None:
    proc = minigrid("check-protocol", "--fixes", "none", "--max-states", "1", "--json")
    assert proc.returncode == 2
    [r] = __import__("json").loads(proc.stdout)
    assert r["complete"] is False and r["safe"] is False and r["verdict"] == "no verdict (cut short)"
    assert r["states_explored"] == 1  # the bound is a bound: not one state more
    text = minigrid("check-protocol", "--fixes", "none", "--max-states", "1").stdout
    assert "isolation holds" not in text and "no violation in the states explored" in text


def test_every_command_explains_its_options() -> None:
    """Each subcommand's help formats (argparse raises on a bare % in a help string)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"serve", "audit", "probe", "generate"} <= set(commands)
    for name, sub in commands.items():
        assert sub.format_help().startswith(f"usage: minigrid {name}"), name
