"""The OpenAI surface beyond a plain completion: `stop`, `/v1/chat/completions`, `stream`.

Checked with the official `openai` client against a live engine: a stop sequence ends the
answer where it first shows up and is left out; a chat request answers what the same text sent
as a completion answers; a streamed answer, put back together, is the answer sent whole, and it
arrives in pieces. `TextStream` (what may be sent before the end) is property-tested alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minigrid_engine.config import corrected_preset
from minigrid_engine.errors import MinigridError
from minigrid_engine.handle import Engine, EngineRefused
from minigrid_engine.openai_api import CHAT, TEXT, BadRequest, Bodies, TextStream, chat_prompt, error_param
from minigrid_engine.request import Request
from minigrid_engine.router import OUTCOMES
from minigrid_engine.tokenizer import ByteTokenizer

TENANTS = {"alice": "sk-alice", "bob": "sk-bob"}
PROMPT = "ALICE pin 48213X; ALICE card QZ7K2M9P; ALICE iban FR7630006; " * 3
MODEL = "minigrid-byte"


# -- TextStream and the stop cut, without an engine ----------------------------------------
def decode_like(
    output: list[int], stop: tuple[tuple[int, ...], ...], max_tokens: int
) -> tuple[list[int], list[int]]:
    """What decode does: one token at a time, `cut_at_stop` after each. Returns (streamed, final)."""
    req = Request("r", "t", [1], max_tokens, stop=stop)
    streamed: list[int] = []
    for t in output[:max_tokens]:
        req.output_ids.append(t)
        streamed.append(t)
        if req.cut_at_stop():
            break
    return streamed, req.output_ids


BYTES = st.lists(st.sampled_from([65, 66, 59, 32, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xFF]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(output=BYTES, stops=st.lists(BYTES.filter(bool).map(lambda b: tuple(b[:4])), max_size=3))
def test_streamed_text_is_the_final_text_and_never_shows_a_stop(
    output: list[int], stops: list[tuple[int, ...]]
) -> None:
    stop = tuple(stops)
    streamed, final = decode_like(output, stop, max_tokens=40)
    ts = TextStream(stop)
    pieces = [ts.push([t]) for t in streamed]
    pieces.append(ts.finish(final))
    assert "".join(pieces) == bytes(final).decode("utf-8", errors="replace")
    # Nothing was sent that the final answer does not hold: every prefix sent is a prefix of it.
    sent = ""
    for piece in pieces:
        sent += piece
        assert bytes(final).decode("utf-8", errors="replace").startswith(sent)


def test_half_a_character_waits_for_the_rest() -> None:
    ts = TextStream()
    euro = list("€".encode())
    assert ts.push(euro[:1]) == "" and ts.push(euro[1:2]) == ""
    assert ts.push(euro[2:]) == "€"
    assert ts.finish(euro) == ""


def test_a_possible_stop_is_held_back_until_it_is_not() -> None:
    stop = (tuple(b"; A"),)
    ts = TextStream(stop)
    assert ts.push(list(b"X;")) == "X"  # ';' might start "; A"
    assert ts.push(list(b" ")) == ""
    assert ts.push(list(b"B")) == "; B"  # it did not


def test_cut_at_stop_takes_the_stop_text_out() -> None:
    req = Request("r", "t", [1], 10, stop=(tuple(b"ab"), tuple(b"x")))
    req.output_ids = list(b"zab")
    assert req.cut_at_stop() and req.output_ids == list(b"z")
    req.output_ids = list(b"za")
    assert not req.cut_at_stop() and req.output_ids == list(b"za")


def test_chat_prompt_ends_on_the_last_message() -> None:
    bodies = Bodies(1024, ByteTokenizer())
    msgs = bodies.messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "BOB "}, {"type": "text", "text": "pin"}]},
        ]
    )
    assert chat_prompt(msgs) == "Be brief.\nBOB pin"
    with pytest.raises(BadRequest, match="at most 4"):
        bodies.stops(list("abcde"))
    with pytest.raises(BadRequest, match="a stop sequence holds a character that is not encodable"):
        bodies.stops(["ok", "\ud800"])


def test_a_workers_refusal_names_the_field_the_routers_length_check_names() -> None:
    """A KV pool's refusal (made in a worker, which sees token ids only) and the router's own
    context check name one param per endpoint; tests/test_disaggregated.py sees both over HTTP."""
    bodies = Bodies(1024, ByteTokenizer())
    long = "x" * 1020
    with pytest.raises(BadRequest) as text:
        bodies.completion({"prompt": long})
    with pytest.raises(BadRequest) as chat:
        bodies.chat({"messages": [{"role": "user", "content": long}]})
    assert text.value.code == chat.value.code == "context_length_exceeded"
    assert (text.value.param, chat.value.param) == ("prompt", "messages")
    assert error_param(TEXT, text.value.code) == "prompt"
    assert error_param(CHAT, chat.value.code) == "messages"
    assert error_param(CHAT, "prefill_failed") is None  # a server fault is about no field


def test_response_ids_stay_unique_across_server_restarts() -> None:
    code = "from minigrid_engine.openai_api import response_id; print(response_id('text', 'alice-1'))"
    ids = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout for _ in range(2)
    }
    assert len(ids) == 2 and all(i.startswith("cmpl-") and i.strip().endswith("-alice-1") for i in ids), ids


# -- the live engine, through the official client -------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    # One injected fault: bob's first request fails in prefill (see the test of errors below).
    with Engine.start(corrected_preset(tenants=TENANTS, inject=("prefill-error@bob",))) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: Engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{engine.url}/v1", api_key="sk-alice", max_retries=0)


def whole(client: openai.OpenAI, max_tokens: int = 40, prompt: str = PROMPT) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens).choices[0].text


@pytest.mark.parametrize("at", [3, 11, 24])
def test_a_stop_sequence_ends_the_answer_where_it_first_shows(client: openai.OpenAI, at: int) -> None:
    full = whole(client)
    stop = full[at : at + 2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop, "\x00never"])
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]
    # the stop's tokens were decoded too: usage counts them, as OpenAI bills them
    assert r.usage is not None and r.usage.completion_tokens == len(choice.text.encode()) + len(stop.encode())


def test_a_stop_that_never_shows_changes_nothing(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stop="\x00")
    assert r.choices[0].text == whole(client, 20) and r.choices[0].finish_reason == "length"


def test_chat_answers_what_the_same_text_as_a_completion_answers(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Continue."}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == whole(client, 24, "Continue.\n" + PROMPT)
    assert "ALICE" in (r.choices[0].message.content or "")  # the model copies from its context
    assert r.usage is not None and r.usage.prompt_tokens == len(("Continue.\n" + PROMPT).encode())


def test_usage_adds_up_and_max_completion_tokens_is_the_one_that_counts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 7)
    assert r.usage.total_tokens == len(PROMPT) + 7
    messages = [{"role": "user", "content": PROMPT}]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, max_tokens=9)
    assert c.usage is not None and c.usage.completion_tokens == 3  # the newer field wins, as OpenAI's
    assert c.usage.total_tokens == c.usage.prompt_tokens + 3


def test_the_python_handles_reply_counts_what_the_api_counts(engine: Engine, client: openai.OpenAI) -> None:
    reply = engine.complete("alice", PROMPT, max_tokens=5)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert reply.ok and (reply.prompt_tokens, reply.completion_tokens) == (len(PROMPT), 5)
    assert reply.text == r.choices[0].text and len(reply.text.encode()) == 5
    assert reply.ttft_s is not None and 0 < reply.ttft_s < 60


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_every_role_openai_defines_is_a_chat_message(engine: Engine, role: str) -> None:
    message: dict[str, object] = {"role": role, "content": "ALICE card QZ7K2M9P; "}
    message |= (
        {"tool_call_id": "call_1"} if role == "tool" else {"name": "lookup"} if role == "function" else {}
    )
    body = {"model": MODEL, "messages": [message, {"role": "user", "content": "ALICE card"}], "max_tokens": 2}
    r = httpx.post(
        f"{engine.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-alice"}
    )
    assert r.status_code == 200, r.text


def test_refusals_are_counted_under_their_outcome(engine: Engine) -> None:
    key = 'minigrid_requests_total{{outcome="{}"}}'.format
    before = engine.metrics()
    r = httpx.post(
        f"{engine.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}
    )
    assert r.status_code == 401
    r = httpx.post(
        f"{engine.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 0},
        headers={"Authorization": "Bearer sk-alice"},
    )
    assert r.status_code == 400
    after = engine.metrics()
    moved = {
        o: after.get(key(o), 0) - before.get(key(o), 0) for o in ("unauthorized", "invalid", "ok", "rejected")
    }
    assert moved == {"unauthorized": 1, "invalid": 1, "ok": 0, "rejected": 0}, moved
    # every outcome is a series from the start (none restarted or hung up here): an alert on it sees 0
    assert all(key(o) in after for o in OUTCOMES) and after[key("unavailable")] == 0


@pytest.mark.parametrize("stop", [None, "card"])
def test_a_streamed_completion_is_the_whole_one_in_pieces(client: openai.OpenAI, stop: str | None) -> None:
    whole_reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, stop=stop)
    want = whole_reply.choices[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=60,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want.text
    assert sum(1 for t in texts if t) > 5  # it came token by token, not in one piece at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage == whole_reply.usage
    stopped = len((stop or "").encode()) if want.finish_reason == "stop" else 0
    assert chunks[-1].usage.completion_tokens == len(want.text.encode()) + stopped


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_events_carry_usage_null_only_when_usage_is_asked(engine: Engine, include_usage: bool) -> None:
    """As OpenAI's: under include_usage every event but the last says "usage": null."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
    body |= {"stream": True, "stream_options": {"include_usage": include_usage}}
    with httpx.stream(
        "POST", f"{engine.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-alice"}
    ) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    if include_usage:
        assert all(e["usage"] is None for e in events[:-1]) and len(events) > 2
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    else:
        assert not any("usage" in e for e in events)


def test_a_streamed_chat_is_the_whole_one_in_pieces(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_a_stream_that_fails_before_its_first_token_is_a_plain_error(engine: Engine) -> None:
    """Refused by the router (over the context) or failed in a worker (prefill, injected): either
    way the client gets the status and code, not a 200 stream, as it would without `stream`."""
    c = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="sk-bob", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        list(c.completions.create(model=MODEL, prompt="x" * 1020, max_tokens=10, stream=True))
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(openai.InternalServerError) as failed:
        list(c.completions.create(model=MODEL, prompt="BOB pin 1234; " * 8, max_tokens=10, stream=True))
    assert failed.value.status_code == 500 and failed.value.code == "prefill_failed"
    again = list(c.completions.create(model=MODEL, prompt="BOB pin 1234; " * 8, max_tokens=10, stream=True))
    assert again[-1].choices[0].finish_reason == "length"  # the fault was one-shot; bob is served


def test_the_python_handle_streams_too(engine: Engine) -> None:
    pieces = list(engine.stream("alice", PROMPT, 30, stop="; "))
    assert len(pieces) > 3 and "".join(pieces) == engine.complete("alice", PROMPT, 30, stop="; ").text
    with pytest.raises(EngineRefused, match="HTTP 400: This model's maximum context length is 1024"):
        list(engine.stream("alice", "x" * 1020, 10))
    with pytest.raises(MinigridError, match=r"use Engine\.stream"):
        engine.complete("alice", PROMPT, 4, stream=True)


def test_streams_leave_no_page_behind(engine: Engine) -> None:
    m = engine.metrics()
    assert m['minigrid_kv_pages_in_use{role="prefill"}'] == 0
    assert m['minigrid_kv_pages_in_use{role="decode"}'] == 0
    assert m['minigrid_requests_total{outcome="ok"}'] >= 10


def test_a_worker_that_dies_mid_stream_ends_it_with_an_error_event(engine: Engine) -> None:
    """The answer has started (200, tokens sent): the failure comes as an OpenAI error event,
    which the client raises, then `[DONE]`; the router restarts the workers. Runs last here."""
    body = {"prompt": PROMPT, "max_tokens": 800, "stream": True}
    events: list[str] = []
    alice = {"Authorization": "Bearer sk-alice"}
    with (
        httpx.Client(base_url=engine.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body, headers=alice) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(engine.worker_pids()["decode"], signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] in ("worker_unavailable", "engine_restarting"), error
    assert "decode" in error["message"]
    assert engine.wait_health("ok", timeout_s=60)["status"] == "ok"
    c = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="sk-alice", max_retries=0)
    assert "ALICE" in whole(c, 16)
