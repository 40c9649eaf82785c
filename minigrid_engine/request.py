"""The request state machine: every state, every allowed edge, and the one function that moves.

```
                 +--------------------------------------------------------------+
                 |                                                              v
  WAITING --> BOOTSTRAPPING --> PREALLOC --> TRANSFERRING --> DECODING --> FINISHED
     |              |                            ^                           ^
     +--> PREFILLING+----------------------------+                           |
            |  (single process: PREFILLING --> DECODING)                     |
            +----------------------------------------------------------------+
```
Any live state may go to FINISHED; FINISHED has no way out. A finished request carries an
`Outcome`: ``stop`` / ``length`` (it completed), ``rejected`` (refused at admission, a 400) or
``aborted`` (failed on the way, an error).

SGLang's bug lives in the gap between `finished()` and `rejected()`: an over-long prompt gets a
*pending* finish (`pending_finish`, SGLang's ``to_finish``) and a one-token stub, but
`finished()` reads only `outcome`, so a queue that asks `finished()` treats it as alive.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from minigrid_engine.errors import BadInput, MinigridError, shown
from minigrid_engine.trace import STATE, Trace

# A request's sampling seed, any 64-bit signed integer (`runner.sampling_generator` hashes it)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


# -- the sampling a request may ask for: one check for every door (HTTP API, CLI, Python) ------
def check_max_tokens(value: object, name: str = "max_tokens") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"'{name}' must be an integer, got {shown(value)}", "invalid_type", name)
    if value < 1:
        raise BadInput(f"'{name}' must be at least 1, got {shown(value)}", "invalid_value", name)
    return value


def check_temperature(value: object) -> float:
    """0 is greedy; NaN and infinities fail the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"'temperature' must be a number, got {shown(value)}", "invalid_type", "temperature")
    if not 0 <= value <= 2:
        raise BadInput(
            f"'temperature' must be a number from 0 to 2, got {shown(value)}", "invalid_value", "temperature"
        )
    return float(value)


def check_seed(value: object) -> int | None:
    """None (draw one when sampling) or what torch.Generator takes: out of range, it would raise
    inside a worker, so it is refused at the door instead."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"'seed' must be an integer, got {shown(value)}", "invalid_type", "seed")
    if not SEED_MIN <= value <= SEED_MAX:
        raise BadInput(
            f"'seed' must be a 64-bit signed integer ({SEED_MIN} to {SEED_MAX}), got {shown(value)}",
            "invalid_value",
            "seed",
        )
    return value


class State(enum.Enum):
    WAITING = "waiting"
    BOOTSTRAPPING = "bootstrapping"
    PREALLOC = "prealloc"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"


class Outcome(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    REJECTED = "rejected"
    ABORTED = "aborted"


S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    S.WAITING: frozenset({S.BOOTSTRAPPING, S.PREALLOC, S.PREFILLING, S.FINISHED}),
    S.BOOTSTRAPPING: frozenset({S.WAITING, S.PREALLOC, S.PREFILLING, S.FINISHED}),
    S.PREALLOC: frozenset({S.TRANSFERRING, S.FINISHED}),
    S.PREFILLING: frozenset({S.TRANSFERRING, S.DECODING, S.FINISHED}),
    S.TRANSFERRING: frozenset({S.DECODING, S.FINISHED}),
    S.DECODING: frozenset({S.FINISHED}),
    S.FINISHED: frozenset(),
}


class IllegalTransition(MinigridError):
    """A request was asked to take an edge the state machine does not have."""


@dataclass
class Request:
    """One completion request as the engine sees it."""

    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    room: int | None = None  # bootstrap room shared by the prefill and decode copies
    stubbed_from: int | None = None  # prompt length before a one-token stub replaced it
    state: State = State.WAITING
    output_ids: list[int] = field(default_factory=list)
    outcome: Outcome | None = None
    pending_finish: Outcome | None = None  # SGLang's `to_finish`: set, but not yet finished
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    finished_at: float | None = None
    stop: tuple[tuple[int, ...], ...] = ()  # stop sequences, as token ids
    stream: bool = False  # the client reads tokens as they come
    stop_tokens: int = 0  # tokens decoded, then cut off as the stop sequence they completed

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def cut_at_stop(self) -> bool:
        """If the output now ends with a stop sequence, cut it off and say so.

        Called after every new token, so a match can only be at the end. The stop text is not
        part of the answer (as in OpenAI's API)."""
        for s in self.stop:
            if len(self.output_ids) >= len(s) and tuple(self.output_ids[-len(s) :]) == s:
                del self.output_ids[-len(s) :]
                self.stop_tokens = len(s)
                return True
        return False

    def completed(self) -> Outcome | None:
        """After a new token: ``stop`` if the output now ends with a stop sequence (cut off),
        ``length`` if it reached `max_tokens`, None while the request goes on."""
        if self.cut_at_stop():
            return Outcome.STOP
        if len(self.output_ids) >= self.max_tokens:
            return Outcome.LENGTH
        return None

    def finished(self) -> bool:
        """True once an outcome is set. Like SGLang's `Req.finished()`: blind to `pending_finish`."""
        return self.outcome is not None

    def rejected(self) -> bool:
        """True when admission refused the request, pending or final."""
        return Outcome.REJECTED in (self.outcome, self.pending_finish)

    def advance(self, new: State, trace: Trace | None = None, **detail: object) -> None:
        """Move to `new` along an allowed edge, emitting one trace event; raise otherwise."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: no edge {self.state.value} -> {new.value}")
        old, self.state = self.state, new
        if trace is not None:
            trace.emit(
                STATE, self.request_id, self.tenant, (), **{"from": old.value, "to": new.value}, **detail
            )

    def finish(self, outcome: Outcome, trace: Trace | None = None, error: str | None = None) -> None:
        """End the request with `outcome` (from any live state)."""
        self.outcome = outcome
        self.pending_finish = None
        self.error = error
        self.finished_at = time.time()
        self.advance(State.FINISHED, trace, outcome=outcome.value, error=error)
