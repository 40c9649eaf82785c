"""The OpenAI wire format: request bodies in, response bodies and stream events out.

Two endpoints share one path through the engine. `/v1/completions` takes a `prompt`;
`/v1/chat/completions` takes `messages`, which `chat_prompt` turns into one prompt (the model has
no chat tuning: it continues, and copies from, whatever it is given).
Both bodies become one `Sampling`: the prompt's token ids and how to decode them, `stop` and
`stream` included. Bad bodies raise `BadRequest`, which the router turns into an OpenAI-style 4xx.

Streaming (`"stream": true`) sends server-sent events as decode produces tokens. `TextStream`
decides what text is safe to send early: never half of a UTF-8 character, never the start of
what could still become a stop sequence (the stop text is left out of the answer, as OpenAI does).
"""

from __future__ import annotations

import codecs
import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from minigrid_engine.config import MODEL_ID
from minigrid_engine.errors import BadInput, MinigridError, shown
from minigrid_engine.messages import Result
from minigrid_engine.request import check_max_tokens, check_seed, check_temperature
from minigrid_engine.tokenizer import ByteTokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat uses it too (the model never ends by itself)
MAX_STOPS = 4  # as OpenAI
MAX_STOP_TOKENS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: deprecated
# A message's fields in OpenAI's chat API. Only `role` and `content` shape the prompt; the others
# (a name, an earlier turn's tool calls and their ids) are history the model cannot use. Any other
# field is refused by name, as a body's unknown fields are.
MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_call_id", "tool_calls", "function_call", "refusal", "audio"}
)
# OpenAI parameters minigrid does not implement, each with the values that mean "off" (clients send
# their defaults: accepted) and what minigrid does instead. Any other value is refused, never
# ignored: an answer that silently lacks what was asked for is wrong in a way the client cannot see.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((False,), "minigrid returns no log-probabilities"),  # completions' 0: the chosen token's
    "top_logprobs": ((0,), "minigrid returns no log-probabilities"),
    "echo": ((False,), "minigrid does not echo the prompt"),
    "best_of": ((1,), "minigrid samples one candidate"),
    "suffix": (("",), "minigrid does not insert text before a suffix"),
    "frequency_penalty": ((0, 0.0), "minigrid applies no penalties"),
    "presence_penalty": ((0, 0.0), "minigrid applies no penalties"),
    "logit_bias": (({},), "minigrid applies no logit bias"),
    "tools": (([],), "minigrid calls no tools"),
    "tool_choice": (("none",), "minigrid calls no tools"),
    "functions": (([],), "minigrid calls no functions"),
    "function_call": (("none",), "minigrid calls no functions"),
    "response_format": (({"type": "text"},), "minigrid answers in plain text only"),
    "modalities": ((["text"],), "minigrid answers in text only"),
    "audio": ((), "minigrid answers in text only"),
    "prediction": ((), "minigrid makes no use of predicted outputs"),
    "reasoning_effort": ((), "the model does not reason before it answers"),
    "verbosity": ((), "the model's answer length is max_tokens and stop"),
    "web_search_options": ((), "minigrid searches nothing"),
    # what other engines (vLLM, SGLang) add, off at the values they mean off
    "top_k": ((-1, 0), "minigrid samples from the whole distribution"),
    "min_p": ((0, 0.0), "minigrid samples from the whole distribution"),
    "repetition_penalty": ((1, 1.0), "minigrid applies no penalties"),
    "min_tokens": ((0,), "minigrid stops at the first stop sequence"),
    "include_stop_str_in_output": ((False,), "minigrid leaves the stop text out, as OpenAI does"),
}
# Fields that change nothing minigrid returns: who the user is, storage and routing hints, and
# (the model has no end-of-text token) whether to ignore it. Accepted, and that is all.
INERT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "safety_identifier",
        "prompt_cache_key",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)
# Every other field is refused by name: a misspelt "max_token" would otherwise decode 16 tokens
# and the client would never learn why.
SAMPLING = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options"}
)
# stream_options: include_usage asks for a last event with the usage; include_obfuscation asks
# OpenAI to pad each event against a size side channel, which changes no text and minigrid never does.
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
COMPLETION_FIELDS = SAMPLING | {"prompt"} | set(UNSUPPORTED) | INERT
CHAT_FIELDS = SAMPLING | {"messages", "max_completion_tokens"} | set(UNSUPPORTED) | INERT


class BadRequest(Exception):
    def __init__(
        self, message: str, code: str = "invalid_request", param: str | None = None, status: int = 400
    ):
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status


def unknown_model(model: Any) -> BadRequest:
    """404 `model_not_found`: in a request body, or asked for at `/v1/models/{id}`."""
    return BadRequest(
        f"the model {shown(model)} does not exist; this server serves {MODEL_ID!r}",
        "model_not_found",
        "model",
        404,
    )


@dataclass(frozen=True)
class Sampling:
    """One request once its body is checked: what to feed the model and how to decode."""

    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None  # when sampling: the client's, or one drawn for this request alone
    stop: tuple[tuple[int, ...], ...] = ()  # stop sequences as token ids
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last event with the usage


def chat_prompt(messages: list[dict[str, str]]) -> str:
    """The chat template: the messages' texts, one after the other, joined by newlines.

    The model was never tuned to chat: it continues the text it ends on, copying from its context.
    A role marker such as ``assistant:`` at the end sends it off course (measured: spaces, where
    the plain transcript gets the records continued), so the answer continues the last message."""
    return "\n".join(m["content"] for m in messages)


class Bodies:
    """Checks request bodies against the engine's context length and tokenizer."""

    def __init__(self, context_length: int, tokenizer: ByteTokenizer) -> None:
        self.context_length = context_length
        self.tokenizer = tokenizer

    # -- the two endpoints -----------------------------------------------------------------
    def completion(self, body: Any) -> Sampling:
        """A `/v1/completions` body."""
        self._object(body, COMPLETION_FIELDS, "/v1/completions")
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", "missing_required_parameter", "prompt")
        return self._sampling(body, self.prompt_ids(body["prompt"]), "max_tokens", "prompt")

    def chat(self, body: Any) -> Sampling:
        """A `/v1/chat/completions` body (`max_completion_tokens`, or the older `max_tokens`)."""
        self._object(body, CHAT_FIELDS, "/v1/chat/completions")
        if "messages" not in body:
            raise BadRequest("'messages' is required", "missing_required_parameter", "messages")
        prompt = chat_prompt(self.messages(body["messages"]))
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if field == "max_completion_tokens" and body.get("max_tokens") is not None:
            try:  # the older field is not used then, but a bad value in it is refused, not ignored
                check_max_tokens(body["max_tokens"], "max_tokens")
            except BadInput as exc:
                raise BadRequest(str(exc), exc.code, exc.param) from None
        return self._sampling(body, self._encode(prompt, "messages"), field, "messages")

    # -- the parts -------------------------------------------------------------------------
    def _object(self, body: Any, fields: frozenset[str], endpoint: str) -> None:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        _refuse_unknown(
            body,
            fields,
            f"a parameter of {endpoint} (minigrid refuses what it does not know rather than ignore it)",
        )
        if "model" in body:
            if not isinstance(body["model"], str):
                raise BadRequest(
                    f"'model' must be a string, got {shown(body['model'])}", "invalid_type", "model"
                )
            if body["model"] != MODEL_ID:
                raise unknown_model(body["model"])

    def _sampling(self, body: dict[str, Any], ids: list[int], max_field: str, prompt_field: str) -> Sampling:
        max_tokens = body.get(max_field)
        temperature = body.get("temperature")
        try:
            max_tokens = check_max_tokens(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, max_field)
            temperature = check_temperature(0 if temperature is None else temperature)
            seed = check_seed(body.get("seed"))
        except BadInput as exc:
            raise BadRequest(str(exc), exc.code, exc.param) from None
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest(f"'stream' must be a boolean, got {shown(stream)}", "invalid_type", "stream")
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise BadRequest(f"'n' must be an integer, got {shown(n)}", "invalid_type", "n")
        if n not in (None, 1):
            raise BadRequest("'n' must be 1: minigrid returns one choice", "unsupported_parameter", "n")
        self._top_p(body.get("top_p"), temperature)
        for name, (off, instead) in UNSUPPORTED.items():
            value = body.get(name)
            if value is not None and not any(type(value) is type(o) and value == o for o in off):
                allowed = " or ".join(["null"] + [json.dumps(o) for o in off])
                raise BadRequest(
                    f"'{name}' is not supported ({instead}): leave it out or send {allowed}, got "
                    f"{shown(value)}",
                    "unsupported_parameter",
                    name,
                )
        total = len(ids) + max_tokens
        if total > self.context_length:
            raise BadRequest(
                f"This model's maximum context length is {self.context_length} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the prompt, {max_tokens} for the completion).",
                "context_length_exceeded",
                prompt_field,
            )
        if seed is None and temperature > 0:
            # No seed: a fresh one for this request, as OpenAI samples afresh on every call
            seed = secrets.randbits(63)
        return Sampling(
            ids,
            max_tokens,
            temperature,
            seed,
            self.stops(body.get("stop")),
            bool(stream),
            self._include_usage(body.get("stream_options"), bool(stream)),
        )

    @staticmethod
    def _top_p(top_p: Any, temperature: float) -> None:
        """Nucleus sampling is not implemented: top_p 1 (the whole distribution) is what minigrid
        samples from; below 1 it matters only when sampling (temperature above 0)."""
        if top_p is None:
            return
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 <= top_p <= 1:
            raise BadRequest(
                f"'top_p' must be a number from 0 to 1, got {shown(top_p)}", "invalid_value", "top_p"
            )
        if top_p < 1 and temperature > 0:
            raise BadRequest(
                f"'top_p' {shown(top_p)} is not supported: minigrid samples from the whole distribution "
                "(top_p 1); leave it out, send 1, or sample greedily (temperature 0)",
                "unsupported_parameter",
                "top_p",
            )

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of an OpenAI `prompt`: a string, token ids, or a batch of exactly one of those."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt:
                raise BadRequest("'prompt' is an empty list of token ids", "invalid_prompt", "prompt")
            if all(isinstance(p, (str, list)) for p in prompt):
                raise BadRequest(
                    f"'prompt' is a batch of {len(prompt)} prompts: minigrid answers one prompt per "
                    "request (send each on its own)",
                    "unsupported_parameter",
                    "prompt",
                )
            if len(prompt) >= self.context_length:  # too long whatever it holds: say so before reading it
                raise BadRequest(
                    f"This model's maximum context length is {self.context_length} tokens. However, "
                    f"your prompt holds {len(prompt)} tokens, and the completion needs at least 1 more.",
                    "context_length_exceeded",
                    "prompt",
                )
            vocab = self.tokenizer.vocab_size
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise BadRequest(
                        f"'prompt' holds {shown(t)} at index {i}: token ids are integers from 0 to "
                        f"{vocab - 1}, and one prompt per request",
                        "invalid_type",
                        "prompt",
                    )
            return list(prompt)
        if not isinstance(prompt, str):
            raise BadRequest(
                "'prompt' must be a string or a list of token ids (one prompt per request)",
                "invalid_type",
                "prompt",
            )
        return self._encode(prompt, "prompt")

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except MinigridError as exc:
            raise BadRequest(str(exc), "invalid_prompt", param) from None

    def messages(self, messages: Any) -> list[dict[str, str]]:
        """The chat `messages`, each `{"role", "content"}` with text content (a string or text parts)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                '\'messages\' must be a non-empty list of {"role", "content"} objects',
                "invalid_type",
                "messages",
            )
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise BadRequest(f"'{where}' must be an object, got {shown(m)}", "invalid_type", "messages")
            _refuse_unknown(m, MESSAGE_FIELDS, f"a field of a chat message ({where})", f"{where}.")
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise BadRequest(
                    f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}",
                    "invalid_value",
                    "messages",
                )
            out.append({"role": role, "content": self._content(m.get("content"), where)})
        return out

    @staticmethod
    def _content(content: Any, where: str) -> str:
        if content is None:
            return ""  # an assistant turn that only called tools
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else part
                    raise BadRequest(
                        f"'{where}.content[{j}]' is {shown(kind)}: minigrid reads text parts only "
                        '({"type": "text", "text": ...})',
                        "unsupported_content",
                        "messages",
                    )
                text = part.get("text")
                if not isinstance(text, str):  # a text part, malformed: say what it lacks
                    field = f"{where}.content[{j}].text"
                    if text is None:
                        raise BadRequest(
                            f"'{field}' is required: a text part holds its text",
                            "missing_required_parameter",
                            field,
                        )
                    raise BadRequest(f"'{field}' must be a string, got {shown(text)}", "invalid_type", field)
                texts.append(text)
            return "".join(texts)
        raise BadRequest(
            f"'{where}.content' must be a string or a list of text parts, got {shown(content)}",
            "invalid_type",
            "messages",
        )

    def stops(self, stop: Any) -> tuple[tuple[int, ...], ...]:
        """`stop`: null, a string, or a list of at most 4 non-empty strings."""
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise BadRequest(
                f"'stop' must be a string or a list of strings, got {shown(stop)}", "invalid_type", "stop"
            )
        if len(items) > MAX_STOPS:
            raise BadRequest(
                f"'stop' holds {len(items)} sequences; at most {MAX_STOPS} are allowed",
                "invalid_value",
                "stop",
            )
        out = []
        for s in items:
            if s == "":
                raise BadRequest("'stop' holds an empty string", "invalid_value", "stop")
            try:
                ids = tuple(self.tokenizer.encode(s, "a stop sequence"))
            except MinigridError as exc:
                raise BadRequest(f"'stop' {shown(s)}: {exc}", "invalid_value", "stop") from None
            if len(ids) > MAX_STOP_TOKENS:
                raise BadRequest(
                    f"a stop sequence of {len(ids)} tokens is longer than the {MAX_STOP_TOKENS} allowed",
                    "invalid_value",
                    "stop",
                )
            out.append(ids)
        return tuple(out)

    @staticmethod
    def _include_usage(options: Any, stream: bool) -> bool:
        """`stream_options`: whether the stream ends with a usage event. Its unknown keys are
        refused by name, as the body's are."""
        if options is None:
            return False
        if not stream:
            raise BadRequest(
                "'stream_options' is only allowed with \"stream\": true", "invalid_value", "stream_options"
            )
        if not isinstance(options, dict):
            raise BadRequest(
                f"'stream_options' must be an object like {{\"include_usage\": true}}, got {shown(options)}",
                "invalid_type",
                "stream_options",
            )
        _refuse_unknown(
            options,
            STREAM_OPTIONS,
            f"a field of stream_options, which holds {' and '.join(STREAM_OPTIONS)}",
            "stream_options.",
        )
        for name in STREAM_OPTIONS:
            value = options.get(name)
            if value is not None and not isinstance(value, bool):
                raise BadRequest(
                    f"'stream_options.{name}' must be a boolean, got {shown(value)}",
                    "invalid_type",
                    f"stream_options.{name}",
                )
        return bool(options.get("include_usage"))


def _refuse_unknown(given: dict[str, Any], known: Collection[str], what: str, param: str = "") -> None:
    """The first key of `given` that is not `known`, refused by name (as OpenAI does), not ignored."""
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise BadRequest(
            f"unrecognized request argument supplied: {shown(unknown[0])} is not {what}",
            "unknown_parameter",
            param + unknown[0][:60],
        )


# -- what goes back -----------------------------------------------------------------------
CHAT, TEXT = "chat", "text"


def error_param(kind: str, code: str | None) -> str | None:
    """The `param` of a worker's refusal. A worker knows the prompt only as token ids: a prompt
    too large for a KV pool (`context_length_exceeded`) is named as the router's own length check
    names it, `prompt` or (chat) `messages`."""
    if code == "context_length_exceeded":
        return "messages" if kind == CHAT else "prompt"
    return None


def usage(result: Result) -> dict[str, int]:
    """Token counts as OpenAI bills them: a stop sequence's tokens were decoded, so they count."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.generated,
        "total_tokens": result.prompt_tokens + result.generated,
    }


# Request ids (`alice-3`) count from 1 in each server: the response id adds this server's own tag,
# so that ids stay unique across restarts, as clients that store them expect.
SERVER_TAG = secrets.token_hex(4)


def response_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{SERVER_TAG}-{request_id}"


def response(kind: str, result: Result, text: str, created: int) -> dict[str, Any]:
    """The whole answer of a request that was not streamed."""
    if kind == CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        head = {"id": response_id(kind, result.request_id), "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text}
        head = {"id": response_id(kind, result.request_id), "object": "text_completion"}
    return {
        **head,
        "created": created,
        "model": MODEL_ID,
        "choices": [{**choice, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage(result),
        "minigrid": {"request_id": result.request_id, "room": result.room, **result.timings},
    }


def chunk(
    kind: str,
    request_id: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    include_usage: bool = False,
) -> dict[str, Any]:
    """One stream event. For chat, `text=None` with no finish is the opening `role` delta. Under
    `stream_options.include_usage` every event but the last carries `"usage": null`, as OpenAI's do."""
    if kind == CHAT:
        if text is None and finish_reason is None:
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
        else:
            delta = {} if text is None else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        head = {"id": response_id(kind, request_id), "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": text or ""}
        head = {"id": response_id(kind, request_id), "object": "text_completion"}
    event = {
        **head,
        "created": created,
        "model": MODEL_ID,
        "choices": [{**choice, "logprobs": None, "finish_reason": finish_reason}],
    }
    return {**event, "usage": None} if include_usage else event


def usage_chunk(kind: str, result: Result, created: int) -> dict[str, Any]:
    """The last event under `stream_options.include_usage`: no choices, the usage."""
    head = chunk(kind, result.request_id, created, "")
    return {**head, "choices": [], "usage": usage(result)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event; `[DONE]` ends the stream."""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


class TextStream:
    """Turns the tokens of a streamed request into text deltas that are safe to send early.

    Held back: a UTF-8 character not yet complete (the incremental decoder keeps its bytes) and
    any tail of the output that could still grow into a stop sequence. `finish` takes the final
    output from decode (already cut at a stop) and returns the rest of the text.
    """

    def __init__(self, stop: tuple[tuple[int, ...], ...] = ()) -> None:
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # tokens whose bytes went into the decoder
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        safe = len(self.ids) - self._held()
        if safe <= self.sent:
            return ""
        text = self._utf8.decode(bytes(self.ids[self.sent : safe]))
        self.sent = safe
        return text

    def finish(self, output_ids: list[int]) -> str:
        rest = output_ids[self.sent :] if len(output_ids) >= self.sent else []
        return self._utf8.decode(bytes(rest), final=True)

    def _held(self) -> int:
        """Length of the longest tail of the output that is a prefix of a stop sequence (a whole
        one too: decode cuts it off, and its `Result` is on the way)."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s), len(self.ids)), held, -1):
                if tuple(self.ids[-n:]) == s[:n]:
                    held = n
                    break
        return held
