"""Control messages between the router, the prefill worker and the decode worker.

Plain dataclasses, pickled over `multiprocessing.connection` sockets. K/V page data never travels
here: it goes over `torch.distributed` (see `transfer.py`), announced by a `TransferBegin`.
This module imports no torch, so the router stays light.

The handshake of one request, as in SGLang's disaggregated mode::

    router  --GenerateRequest-->  prefill, decode        (same bootstrap room, naming the pair)
    prefill --Bootstrapped----->  decode                 (prefill's bootstrap queue admitted it)
    decode  --KVBootstrap------>  prefill                (the decode pages to fill)
    prefill --TransferBegin + page data + TransferDone-->  decode
    decode  --Tokens----------->  router                 (each decode step, when streamed)
    decode  --Result----------->  router
    anyone  --Abort------------>  the others             (a request that failed on the way)

Beside requests: `Query` (stats, pool, trace), `SetFixes` (switch the fixes live) and `Shutdown`.

With several workers per role, the router picks one prefill and one decode worker per request
and names them in the `GenerateRequest` (as SGLang's router carries the prefill's bootstrap host
beside the room): every later message of the room goes between that pair only. Each decode
worker keeps one connection to every prefill worker, opened with a `PeerHello`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

V = TypeVar("V")
RECENT_ROOMS = 10_000  # how many rooms a role remembers, for messages that come late


class RecentRooms(dict[int, V]):
    """What a role keeps about its most recent rooms, oldest forgotten first: late or overtaking
    messages are told apart from unknown ones without the memory growing with every request."""

    def __init__(self, limit: int = RECENT_ROOMS) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, room: int, value: V) -> None:
        super().__setitem__(room, value)
        while len(self) > self.limit:
            del self[next(iter(self))]


@dataclass(frozen=True)
class GenerateRequest:
    room: int  # bootstrap room: the id both roles use for one request
    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    prefill: str = "prefill-0"  # the pair the router chose for this room
    decode: str = "decode-0"
    stop: tuple[tuple[int, ...], ...] = ()  # stop sequences (token ids): decode ends the request there
    stream: bool = False  # decode sends each new token to the router as a `Tokens`


@dataclass(frozen=True)
class Tokens:
    """Decode to router, for a streamed request: the tokens decoded since the last `Tokens`.

    A preview: the `Result` that follows is the request's answer (cut at its stop sequence)."""

    room: int
    ids: list[int]


@dataclass(frozen=True)
class Bootstrapped:
    """Prefill's bootstrap queue let the request through; decode may now preallocate."""

    room: int


@dataclass(frozen=True)
class KVBootstrap:
    """Decode tells prefill where the request's K/V must land (decode page ids, in order)."""

    room: int
    decode_pages: list[int]
    reserved_tokens: int


@dataclass(frozen=True)
class TransferBegin:
    """Announces one torch.distributed message of page data for `room`.

    The data that follows is a float tensor [2, n_layers, len(dst_pages), page_size, kv_heads, dim].
    """

    room: int
    dst_pages: list[int]


@dataclass(frozen=True)
class TransferDone:
    """Prefill's status message. In the faulty engine: room and status only, no length, no digest."""

    room: int
    success: bool
    first_token: int | None = None
    written_tokens: int | None = None  # `coverage-check` fills this in
    checksums: list[int] | None = None  # `kv-checksum` fills this in
    error: str | None = None


@dataclass(frozen=True)
class Abort:
    room: int
    reason: str
    status: int = 500
    code: str = "aborted"
    source: str = ""


@dataclass(frozen=True)
class AbortAck:
    """Prefill to decode: nothing more will be sent for `room` (after every earlier message)."""

    room: int


@dataclass(frozen=True)
class Result:
    """The end of a request, as the router returns it to the client."""

    room: int
    request_id: str
    tenant: str
    status: int  # HTTP status
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"
    error: str | None = None
    code: str | None = None
    error_type: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    completion_tokens: int | None = None  # tokens decoded, the stop's included; None: output_ids

    @property
    def generated(self) -> int:
        """The tokens decode made (what usage counts): the answer's, and a stop sequence's cut off."""
        return len(self.output_ids) if self.completion_tokens is None else self.completion_tokens

    @classmethod
    def failed(
        cls, room: int, status: int, code: str, message: str, request_id: str = "", tenant: str = ""
    ) -> Result:
        """A request that ends in an error: a 4xx is the client's, a 5xx the server's."""
        error_type = "invalid_request_error" if status < 500 else "server_error"
        return cls(
            room,
            request_id,
            tenant,
            status,
            finish_reason="error",
            error=message,
            code=code,
            error_type=error_type,
        )


@dataclass(frozen=True)
class Ready:
    role: str
    pid: int
    capacity_tokens: int
    page_size: int
    n_pages: int
    log: list[str] = field(default_factory=list)
    worker: str = ""  # its id, e.g. "decode-1"
    host: str = ""  # the address its page data comes from or goes to (the transfer's peer address)


@dataclass(frozen=True)
class PeerHello:
    """A decode worker's first message on its connection to a prefill worker."""

    worker: str
    rank: int
    host: str = ""  # the address its page data arrives at


@dataclass(frozen=True)
class Join:
    """A worker started by hand on another host (`minigrid worker`) asks the router for a slot."""

    role: str
    index: int | None = None  # None: the first free slot of the role
    host: str = ""  # the address it sends page data from


@dataclass(frozen=True)
class Assign:
    """The router's answer to `Join`: the slot, the configuration, where the peers listen."""

    worker: str
    index: int
    config: str  # ServeConfig as JSON
    peer_ports: list[int]
    dist_port: int
    error: str | None = None  # set when the router refuses the worker


@dataclass(frozen=True)
class Query:
    """Router asks a worker for `kind`: "stats", "pool" (owner table) or "trace"."""

    qid: int
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class QueryReply:
    qid: int
    data: Any


@dataclass(frozen=True)
class SetFixes:
    """Router to every worker: run with `fixes` (a `--fixes` spec) from the next step of its loop on.

    Sent by the admin's `POST /v1/minigrid/fixes` (workshop mode switches a room's fixes live); the
    worker applies it between two batches and answers `QueryReply(qid, {"fixes": ...})`."""

    qid: int
    fixes: str


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""
