"""`minigrid audit` against SGLang servers: their gauges, their /server_info, several URLs at once.

Each fake server below answers what an SGLang server of that kind exports; the minigrid engine's own
metrics are audited in test_disaggregated.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cli_run import minigrid
from fake_http import Route

from minigrid_engine.audit import (
    VersionFinding,
    audit,
    metric_samples,
    parse_sglang_metrics,
    parse_sglang_server_info,
    server_root,
)
from minigrid_engine.errors import MinigridError


def sglang_metrics(engine_type: str | None, capacity_by_rank: list[int], context: int) -> Route:
    """SGLang's /metrics: one gauge sample per tensor-parallel rank, as it exports them (older
    releases, `engine_type` None, label no role)."""
    lines = [
        "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.",
        "# TYPE sglang:max_total_num_tokens gauge",
    ]
    role = "" if engine_type is None else f'engine_type="{engine_type}",'
    labels = role + 'model_name="glm",pp_rank="0",tp_rank="{}"'
    lines += [
        f"sglang:max_total_num_tokens{{{labels.format(r)}}} {float(c)}"
        for r, c in enumerate(capacity_by_rank)
    ]
    lines += ["# HELP sglang:context_len The context length.", "# TYPE sglang:context_len gauge"]
    lines += [
        f"sglang:context_len{{{labels.format(r)}}} {float(context)}" for r in range(len(capacity_by_rank))
    ]
    lines += [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{labels.format(0)}}} 3.0",
    ]
    return 200, "\n".join(lines) + "\n"


def test_the_incidents_deployment_fails_on_its_prefill_pool(serve: Any) -> None:
    """Two servers, as disaggregated SGLang runs: the prefill pool is short, the decode pool is not."""
    prefill = serve({"/metrics": sglang_metrics("prefill", [681_280, 681_280], 1_048_576)})
    decode = serve({"/metrics": sglang_metrics("decode", [2_100_000, 2_050_000], 1_048_576)})
    proc = minigrid("audit", "--url", prefill.url, "--url", decode.url, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "context length 1048576 tokens" in proc.stdout
    assert "the prefill pool holds 681280 tokens < context length 1048576" in proc.stdout
    assert "decode" in proc.stdout and "2,050,000 tokens  ok" in proc.stdout  # the smaller rank
    report = json.loads(minigrid("audit", "--url", prefill.url, "--url", decode.url, "--json").stdout)
    assert report["ok"] is False and report["urls"] == [prefill.url, decode.url]
    by_role = {p["role"]: p for p in report["pools"]}
    assert by_role["prefill"]["shortfall_tokens"] == 1_048_576 - 681_280
    assert by_role["prefill"]["source"] == f"{prefill.url}/metrics (sglang)"
    assert by_role["decode"]["covers"] is True


@pytest.mark.parametrize(("capacity", "code"), [(1_048_576, 0), (1_048_575, 1), (1_048_577, 0)])
def test_a_pool_exactly_the_context_passes_and_one_token_short_fails(
    serve: Any, capacity: int, code: int
) -> None:
    prefill = serve({"/metrics": sglang_metrics("prefill", [capacity], 1_048_576)})
    decode = serve({"/metrics": sglang_metrics("decode", [2_100_000], 1_048_576)})
    proc = minigrid("audit", "--url", prefill.url, "--url", decode.url, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    if code:
        assert "TOO SMALL by 1 token" in proc.stdout, proc.stdout


def test_a_pool_is_its_smallest_rank(serve: Any) -> None:
    one_rank_short = serve({"/metrics": sglang_metrics("unified", [40_000, 30_000], 32_768)})
    report = audit(one_rank_short.url)
    assert not report.ok
    [pool] = report.pools
    assert (pool.role, pool.capacity_tokens, pool.shortfall_tokens) == ("unified", 30_000, 2_768)
    assert pool.engine == "sglang" and f"[{one_rank_short.url}/metrics (sglang)]" in report.text()


def test_every_pool_is_held_to_the_longest_advertised_context(serve: Any) -> None:
    """The prefill side accepts 131,072 tokens; the decode pool must hold that, whatever decode says."""
    prefill = serve({"/metrics": sglang_metrics("prefill", [200_000], 131_072)})
    decode = serve({"/metrics": sglang_metrics("decode", [100_000], 65_536)})
    report = audit([prefill.url, decode.url])
    assert report.context_length == 131_072
    assert [(p.role, p.covers) for p in report.pools] == [("prefill", True), ("decode", False)]
    text = report.text()
    assert "advertise different context lengths" in text
    assert (
        "the decode pool holds 100000 tokens < context length 131072: a prompt plus its answer longer "
        "than the pool cannot be decoded, and a longer prompt's pages cannot be received from prefill"
    ) in text
    assert "prefilled" not in text  # the prefill pool covers the context: nothing to blame it for


def test_each_short_pool_is_told_what_it_breaks(serve: Any) -> None:
    """A short prefill pool cannot prefill; a short decode pool cannot receive or decode; a short
    unified pool (an SGLang server on its own, or vLLM) cannot hold the request."""
    prefill = serve({"/metrics": sglang_metrics("prefill", [681_280], 1_048_576)})
    decode = serve({"/metrics": sglang_metrics("decode", [700_000], 1_048_576)})
    unified = serve({"/metrics": vllm_metrics(["40000"])})  # 640,000 tokens
    text = audit([prefill.url, decode.url, unified.url], context_length=1_048_576).text()
    fail = text.splitlines()[-1]
    assert fail == (
        "FAIL: the prefill pool holds 681280 tokens < context length 1048576: prompts longer than the "
        "pool can be accepted but cannot be prefilled; "
        "the decode pool holds 700000 tokens < context length 1048576: a prompt plus its answer longer "
        "than the pool cannot be decoded, and a longer prompt's pages cannot be received from prefill; "
        "the unified pool holds 640000 tokens < context length 1048576: a prompt plus its answer longer "
        "than the pool cannot be held"
    )
    alone = audit(serve({"/metrics": sglang_metrics("unified", [30_000], 32_768)}).url).text()
    assert alone.endswith(": a prompt plus its answer longer than the pool cannot be held")
    # one token short: the longest prompt the API accepts (a token kept for the answer) still fits
    edge = audit(serve({"/metrics": sglang_metrics("prefill", [1023], 1024)}).url).text()
    assert "TOO SMALL by 1 token " in edge
    assert edge.splitlines()[-1] == (
        "FAIL: the prefill pool holds 1023 tokens < context length 1024: the longest prompt the API "
        "accepts just fits, with no margin; the rule is a pool of at least the context"
    )


def test_without_metrics_the_audit_reads_server_info(serve: Any) -> None:
    """SGLang without --enable-metrics: /metrics is a 404, the pool is in /get_server_info (older
    releases) and the context, left null in the server arguments, in /v1/models."""
    info = {
        "context_length": None,
        "disaggregation_mode": "decode",
        "internal_states": [{"max_total_num_tokens": 300_000}, {"max_total_num_tokens": 290_000}],
    }
    models = {"object": "list", "data": [{"id": "glm", "object": "model", "max_model_len": 262_144}]}
    server = serve({"/get_server_info": (200, json.dumps(info)), "/v1/models": (200, json.dumps(models))})
    report = audit(server.url + "/")
    [pool] = report.pools
    assert (pool.role, pool.capacity_tokens, pool.context_length) == ("decode", 290_000, 262_144)
    assert pool.source == f"{server.url}/get_server_info (sglang)"
    assert report.ok
    proc = minigrid("audit", "--url", server.url, timeout=60)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/metrics"])
def test_the_openai_base_url_is_read_as_the_server(serve: Any, suffix: str) -> None:
    """`minigrid probe` and OpenAI clients take http://HOST:PORT/v1: the audit reads that server."""
    server = serve({"/metrics": sglang_metrics("unified", [500_000], 131_072)})
    proc = minigrid("audit", "--url", server.url + suffix, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"minigrid audit {server.url}: context length 131072 tokens")
    assert f"[{server.url}/metrics (sglang)]" in proc.stdout and "/v1" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://gw:8080/sglang/v1/", "http://gw:8080/sglang"),
        ("http://h:30000/v1/metrics", "http://h:30000"),
        ("http://v1", "http://v1"),  # a host named v1 is not a path
        ("http://metrics:9090/", "http://metrics:9090"),
        ("http://h:30000/v10", "http://h:30000/v10"),
        ("http://h:30000/v1/models", "http://h:30000"),
        ("https://gw/sglang/v1/chat/completions", "https://gw/sglang"),
        ("http://h:30000/health", "http://h:30000"),
        ("http://h:30000/get_server_info/", "http://h:30000"),
        ("http://h:30000/models", "http://h:30000/models"),  # a prefix the proxy may need
        ("https://gw/v1/prefill", "https://gw/v1/prefill"),  # a gateway's route: another server
        ("https://gw/v1/decode/v1/models", "https://gw/v1/decode"),
        ("http://h:30000/metrics?x=1#top", "http://h:30000"),
    ],
)
def test_server_roots(url: str, root: str) -> None:
    assert server_root(url) == root


def test_a_key_protected_server_asks_for_the_key(serve: Any) -> None:
    server = serve({"/metrics": sglang_metrics("unified", [500_000], 131_072)}, key="sk-ops-1234")
    proc = minigrid("audit", "--url", server.url, timeout=60)
    assert proc.returncode == 2 and "answered HTTP 401: give the server's key with --api-key" in proc.stderr
    proc = minigrid("audit", "--url", server.url, "--api-key", "sk-ops-1234", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert server.authorizations[-1] == "Bearer sk-ops-1234"
    proc = minigrid("audit", "--url", server.url, "--api-key", "sk-old", timeout=60)
    assert proc.returncode == 2 and "HTTP 401: the key given with --api-key was refused" in proc.stderr


def test_a_server_pasted_as_an_endpoint_or_twice_is_read_once_at_its_root(serve: Any) -> None:
    server = serve({"/metrics": sglang_metrics("unified", [500_000], 131_072)})
    urls = [server.url + "/v1/models", server.url + "/health", server.url]
    report = audit([*urls, server.url + "/v1/chat/completions"])
    assert [p.source for p in report.pools] == [f"{server.url}/metrics (sglang)"]  # one pool, not four
    assert report.ok


def test_no_context_anywhere_asks_for_it(serve: Any) -> None:
    server = serve({"/server_info": (200, json.dumps({"max_total_num_tokens": 681_280}))})
    with pytest.raises(
        MinigridError, match="give the longest prompt the deployment accepts with --context-length"
    ):
        audit(server.url)
    assert not audit(server.url, context_length=1_048_576).ok
    proc = minigrid("audit", "--url", server.url, "--context-length", "600000", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_server_that_is_neither_says_so(serve: Any) -> None:
    server = serve(
        {"/metrics": (200, "# HELP up Up.\n# TYPE up gauge\nup 1.0\n"), "/": (200, "<html></html>")}
    )
    proc = minigrid("audit", "--url", server.url, timeout=60)
    assert proc.returncode == 2, proc.stdout
    assert "is this a minigrid engine, an SGLang or a vLLM server?" in proc.stderr
    assert "/metrics has none of minigrid_kv_pool_capacity_tokens, sglang:max_total_num_tokens" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_unreachable_server_fails_the_whole_audit(serve: Any) -> None:
    good = serve({"/metrics": sglang_metrics("prefill", [2_000_000], 1_048_576)})
    proc = minigrid("audit", "--url", good.url, "--url", "http://127.0.0.1:9", timeout=60)
    assert proc.returncode == 2 and "cannot read http://127.0.0.1:9/metrics" in proc.stderr


def test_disaggregated_sglang_before_the_fixes_fails(serve: Any) -> None:
    """INCIDENT.md's fifth question, from the servers: the pools fit, but prefill runs 0.5.19."""
    info = {"version": "0.5.19", "max_total_num_tokens": 2_040_000, "disaggregation_mode": "prefill"}
    prefill = serve(
        {
            "/metrics": sglang_metrics("prefill", [2_040_000], 1_048_576),
            "/server_info": (200, json.dumps(info)),
        }
    )
    decode_info = {"version": "0.5.22.post1", "disaggregation_mode": "decode", "context_length": 1_048_576}
    decode = serve({"/get_server_info": (200, json.dumps(decode_info | {"max_total_num_tokens": 2_100_000}))})
    proc = minigrid("audit", "--url", prefill.url, "--url", decode.url, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "the prefill server runs SGLang 0.5.19: disaggregated SGLang should run 0.5.22 or later"
        in proc.stdout
    )
    assert f"SGLang 0.5.22.post1 at {decode.url}  ok" in proc.stdout
    assert "pool holds" not in proc.stdout  # both pools cover the context: only the release fails
    report = json.loads(minigrid("audit", "--url", prefill.url, "--url", decode.url, "--json").stdout)
    assert [(v["role"], v["fixed"]) for v in report["sglang_versions"]] == [
        ("prefill", False),
        ("decode", True),
    ]


@pytest.mark.parametrize(
    ("version", "fixed"),
    [("0.5.22", True), ("0.5.23rc1", True), ("0.5.22rc0", False), ("0.5.21.post2", False), ("dev", None)],
)
def test_release_verdicts(version: str, fixed: bool | None) -> None:
    assert VersionFinding("http://x", "decode", version).fixed is fixed


def test_public_metrics_and_a_protected_server_info(serve: Any) -> None:
    """The gauges are readable without the key, /server_info is not: the pools are audited and the
    release is left for the operator to check."""
    server = serve(
        {
            "/metrics": sglang_metrics("decode", [3_000_000], 1_048_576),
            "/server_info": (401, '{"error": "Unauthorized"}'),
        }
    )
    report = audit(server.url)
    assert report.ok and [v.fixed for v in report.versions] == [None]
    assert "states no version: check it runs 0.5.22 or later" in report.text()


@pytest.mark.parametrize(
    ("engine_type", "info_path", "mode"),
    [(None, "/server_info", "prefill"), ("unified", "/get_server_info", "decode")],
)
def test_gauges_without_a_role_take_it_from_server_info(
    serve: Any, engine_type: str | None, info_path: str, mode: str
) -> None:
    """Older releases label no `engine_type` (or leave it at unified) on a disaggregated server: its
    role is /server_info's `disaggregation_mode`, and a 0.5.10 prefill or decode server fails."""
    info = {"version": "0.5.10", "disaggregation_mode": mode, "context_length": 1_048_576}
    server = serve(
        {
            "/metrics": sglang_metrics(engine_type, [2_100_000, 2_100_000], 1_048_576),
            info_path: (200, json.dumps(info | {"max_total_num_tokens": 2_100_000})),
        }
    )
    proc = minigrid("audit", "--url", server.url, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"  {mode:8s} KV pool 2,100,000 tokens  ok  [{server.url}/metrics (sglang)]" in proc.stdout
    assert f"  {mode:8s} SGLang 0.5.10 at {server.url}  BEFORE 0.5.22" in proc.stdout
    assert (
        f"FAIL: the {mode} server runs SGLang 0.5.10: disaggregated SGLang should run 0.5.22 or later"
        in proc.stdout
    )
    assert "unified" not in proc.stdout and "pool holds" not in proc.stdout


def test_a_unified_server_is_not_judged_by_release(serve: Any) -> None:
    info = {"version": "0.5.10", "max_total_num_tokens": 500_000, "context_length": 131_072}
    report = audit(serve({"/server_info": (200, json.dumps(info))}).url)
    assert report.ok and report.versions == []


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"max_total_num_tokens": 4096, "context_length": 2048}, (2048, {"unified": 4096})),
        ({"max_total_num_tokens": 4096, "disaggregation_mode": "null"}, (None, {"unified": 4096})),
        ({"max_total_num_tokens": True, "context_length": "n/a"}, (None, {})),
        (
            {"internal_states": [{"memory_usage": {"token_capacity": 270_336}}] * 2},
            (None, {"unified": 270_336}),
        ),
        ({"max_total_num_tokens": 0, "internal_states": "broken"}, (None, {})),
        ({"max_total_num_tokens": 8192, "disaggregation_mode": "prefill"}, (None, {"prefill": 8192})),
    ],
)
def test_server_info_fields(info: dict[str, Any], expected: tuple[int | None, dict[str, int]]) -> None:
    assert parse_sglang_server_info(info) == expected


def test_sglang_gauges_without_an_engine_type_label() -> None:
    """Older releases export no engine_type: the pool is one unified pool."""
    text = (
        'sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 1000.0\n'
        'sglang:context_len{model_name="m"} 800.0\n'
    )
    assert parse_sglang_metrics(metric_samples(text)) == (800, {"unified": 1000})


def vllm_metrics(blocks_by_engine: list[str], block_size: int = 16) -> Route:
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for engine, blocks in enumerate(blocks_by_engine):
        labels = f'block_size="{block_size}",cache_dtype="auto",engine="{engine}",num_gpu_blocks="{blocks}"'
        lines.append(f"vllm:cache_config_info{{{labels}}} 1.0")
    return 200, "\n".join(lines) + "\n"


def test_a_vllm_prefill_decode_pair(serve: Any) -> None:
    """vLLM states its pool as blocks x block size, per engine; the context is in /v1/models."""
    models = (200, json.dumps({"data": [{"id": "m", "object": "model", "max_model_len": 131_072}]}))
    prefill = serve({"/metrics": vllm_metrics(["9000", "8000"]), "/v1/models": models})  # 128,000 tokens
    decode = serve({"/metrics": vllm_metrics(["20000"]), "/v1/models": models})
    report = audit([prefill.url, decode.url])
    assert [(p.capacity_tokens, p.covers) for p in report.pools] == [(128_000, False), (320_000, True)]
    assert report.pools[0].source == f"{prefill.url}/metrics (vllm)" and report.versions == []
    assert "TOO SMALL by 3,072 tokens" in report.text()
    not_yet = serve({"/metrics": vllm_metrics(["None"]), "/v1/models": models})  # still profiling
    with pytest.raises(MinigridError, match="vllm:cache_config_info"):
        audit(not_yet.url)
