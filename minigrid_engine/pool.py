"""The KV pool: a role's KV memory, fixed-size pages, a free list, an owner table, block tables.

Only this module touches the free list: `can_reserve` / `reserve` / `grow` / `release`, and
`check_integrity()` (free + owned = total, no page held twice) that tests call after every step.

Two properties of real engines are kept on purpose:
- freed pages go back on top of the free list, so the next reservation gets the pages that were
  freed most recently (the reverse block-table order is pushed, so a reservation of the same size
  gets them back in the same logical order);
- freed pages are **not zeroed**: their K/V stays until someone overwrites it. The owner table
  remembers who wrote each page last, which is how the labs see whose data a request read.

The pool is sized in tokens, like SGLang's ``max_total_num_tokens``; pages are the unit of
allocation. A budget that is not a whole number of pages (the incident's 665 tokens at 128 a
page) keeps the token budget for admission and rounds storage up to whole pages.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from minigrid_engine.config import check_pool_size
from minigrid_engine.errors import ConfigError, PoolError, PoolExhausted, counted
from minigrid_engine.model import ModelConfig
from minigrid_engine.trace import RELEASE, RESERVE, Trace


@dataclass(frozen=True)
class PoolConfig:
    """A pool's size: `capacity_tokens` of KV in pages of `page_size` tokens."""

    capacity_tokens: int
    page_size: int = 128

    def __post_init__(self) -> None:
        for name in ("capacity_tokens", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        check_pool_size(self.capacity_tokens, self.page_size, "capacity_tokens", "page_size")

    @property
    def n_pages(self) -> int:
        return -(-self.capacity_tokens // self.page_size)  # exact for any size

    def nbytes(self, model: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
        """What the pool's K and V cost, every layer, whole pages (computed, nothing allocated)."""
        return self.n_pages * self.page_size * model.kv_bytes_per_token(dtype)

    def describe(self, model: ModelConfig, role: str = "engine", dtype: torch.dtype = torch.float32) -> str:
        """The startup line: capacity in tokens and pages, and the bytes it costs."""
        slots = self.n_pages * self.page_size
        # the budget ends inside the last page: the pool holds no more tokens than the budget at once
        note = (
            f" ({slots} slots for the budget: at most {self.capacity_tokens} held at once)"
            if slots > self.capacity_tokens
            else ""
        )
        return (
            f"{role} KV pool: {self.capacity_tokens} tokens in {counted(self.n_pages, 'page')} of "
            f"{counted(self.page_size, 'token')}{note} ({model.kv_bytes_per_token(dtype)} bytes per token, "
            f"{self.nbytes(model, dtype) / 2**20:.1f} MiB)"
        )

    @classmethod
    def from_memory_budget(
        cls, budget_bytes: int, page_size: int, model: ModelConfig, dtype: torch.dtype = torch.float32
    ) -> PoolConfig:
        """Size a pool from bytes of memory, as SGLang does with the memory left after weights.

        One token costs `model.kv_bytes_per_token(dtype)` bytes (K and V, every layer); the
        budget buys that many tokens, rounded down to whole pages.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(f"memory budget must be a positive number of bytes, got {budget_bytes!r}")
        per_token = model.kv_bytes_per_token(dtype)
        per_page = per_token * page_size
        pages = budget_bytes // per_page
        if pages < 1:
            raise ConfigError(
                f"a memory budget of {budget_bytes} bytes is smaller than one page: "
                f"{page_size} tokens x {per_token} bytes per token = {per_page} bytes"
            )
        return cls(capacity_tokens=pages * page_size, page_size=page_size)


@dataclass
class PageInfo:
    """One row of the owner table."""

    owner: str | None = None  # request holding the page now (None: free)
    owner_tenant: str | None = None
    last_writer: str | None = None  # request that last wrote K/V into the page
    last_writer_tenant: str | None = None
    written_at: float | None = None


@dataclass
class Reservation:
    """A request's block table in this pool and the tokens it may fill."""

    request: str
    tenant: str
    pages: list[int]
    tokens: int
    created: float = field(default_factory=time.time)


class KVPool:
    """K/V storage for every layer plus the bookkeeping of who holds and who wrote each page."""

    def __init__(
        self,
        cfg: PoolConfig,
        model: ModelConfig,
        role: str = "engine",
        trace: Trace | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        scrub_on_free: bool = False,
    ) -> None:
        self.cfg = cfg
        self.scrub_on_free = scrub_on_free
        self.model_cfg = model
        self.role = role
        self.trace = trace if trace is not None else Trace(role)
        shape = (model.n_layers, cfg.n_pages, cfg.page_size, model.n_kv_heads, model.head_dim)
        # torch.empty: a fresh pool holds whatever memory held before, exactly like a GPU pool.
        try:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        except (RuntimeError, TypeError, OverflowError) as exc:  # out of memory, or past int64
            need = cfg.nbytes(model, dtype)
            raise ConfigError(
                f"{cfg.describe(model, role, dtype)}: cannot allocate {need / 2**30:,.1f} GiB on "
                f"{device} ({type(exc).__name__}); choose a smaller pool"
            ) from None
        self.k.zero_()  # deterministic start (tests); freed pages are never zeroed afterwards
        self.v.zero_()
        self.pages = [PageInfo() for _ in range(cfg.n_pages)]
        # Last writer of each slot as a number, beside the K/V, so that attention itself can check
        # every token it reads (the `owner-check` fix): [n_pages, page_size], 0 = never written or
        # scrubbed. Per slot, not per page: a one-token stub in slot 0 leaves the other slots of
        # the page whoever wrote them before.
        self.writer_tags = torch.zeros(cfg.n_pages, cfg.page_size, dtype=torch.int64, device=device)
        self._tags: dict[str, int] = {}
        self._writer_of: dict[int, tuple[str, str]] = {}  # tag -> (request, tenant)
        self._next_tag = 0
        self._free: list[int] = list(range(cfg.n_pages - 1, -1, -1))  # top of stack = end
        self._held: dict[str, Reservation] = {}
        self._tokens_reserved = 0

    # -- sizes ---------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.cfg.capacity_tokens

    @property
    def n_pages(self) -> int:
        return self.cfg.n_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return self.n_pages - len(self._free)

    @property
    def tokens_reserved(self) -> int:
        return self._tokens_reserved

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    def describe(self) -> str:
        """The startup line: capacity in tokens and pages, and the bytes it costs."""
        return self.cfg.describe(self.model_cfg, self.role, self.k.dtype)

    # -- reservation ---------------------------------------------------------------------
    def can_reserve(self, n_tokens: int) -> bool:
        return (
            n_tokens > 0
            and self.pages_for(n_tokens) <= len(self._free)
            and self._tokens_reserved + n_tokens <= self.capacity_tokens
        )

    def reserve(self, request: str, tenant: str, n_tokens: int) -> Reservation:
        """Hand `request` the pages for `n_tokens` tokens, most recently freed first."""
        if request in self._held:
            raise PoolError(f"{self.role} pool: request {request} already holds pages")
        if n_tokens <= 0:
            raise PoolError(f"{self.role} pool: cannot reserve {n_tokens} tokens")
        if not self.can_reserve(n_tokens):
            raise PoolExhausted(self._exhausted_message(n_tokens))
        pages = [self._free.pop() for _ in range(self.pages_for(n_tokens))]
        for p in pages:
            info = self.pages[p]
            info.owner, info.owner_tenant = request, tenant
        res = Reservation(request, tenant, pages, n_tokens)
        self._held[request] = res
        self._tokens_reserved += n_tokens
        self.trace.emit(RESERVE, request, tenant, pages, tokens=n_tokens)
        return res

    def grow(self, request: str, n_tokens: int) -> Reservation:
        """Extend `request`'s reservation to `n_tokens` tokens (more pages if needed)."""
        res = self.reservation(request)
        extra = n_tokens - res.tokens
        if extra <= 0:
            return res
        need = self.pages_for(n_tokens) - len(res.pages)
        if need > len(self._free) or self._tokens_reserved + extra > self.capacity_tokens:
            raise PoolExhausted(self._exhausted_message(extra))
        new = [self._free.pop() for _ in range(need)]
        for p in new:
            info = self.pages[p]
            info.owner, info.owner_tenant = request, res.tenant
        res.pages.extend(new)
        res.tokens = n_tokens
        self._tokens_reserved += extra
        if new:
            self.trace.emit(RESERVE, request, res.tenant, new, tokens=n_tokens)
        return res

    def release(self, request: str) -> list[int]:
        """Return every page of `request` to the free list, unchanged (not zeroed)."""
        res = self._held.pop(request, None)
        if res is None:
            raise PoolError(
                f"{self.role} pool: request {request} holds no pages (released twice, or never reserved)"
            )
        for p in reversed(res.pages):
            info = self.pages[p]
            if info.owner != request:  # the bookkeeping itself is broken: never hide that
                raise PoolError(f"{self.role} pool: page {p} is owned by {info.owner}, not {request}")
            info.owner = info.owner_tenant = None
            self._free.append(p)
        self._tokens_reserved -= res.tokens
        self.trace.emit(RELEASE, request, res.tenant, res.pages, tokens=res.tokens)
        if self.scrub_on_free:  # fix `scrub-on-free`: the cost the industry avoids
            self.scrub(res.pages)
        self._tags.pop(request, None)
        return res.pages

    def scrub(self, pages: list[int]) -> None:
        """Zero the K/V of `pages` and forget who wrote them."""
        index = torch.tensor(pages, dtype=torch.long, device=self.k.device)
        self.k.index_fill_(1, index, 0.0)
        self.v.index_fill_(1, index, 0.0)
        self.writer_tags.index_fill_(0, index, 0)
        for p in pages:
            info = self.pages[p]
            info.last_writer = info.last_writer_tenant = info.written_at = None
        self.trace.emit("scrub", None, None, pages)

    def tag_of(self, request: str) -> int:
        """A request's number in `writer_tags` (stable while it lives)."""
        tag = self._tags.get(request)
        if tag is None:  # never reused: a slot may still carry a dead request's tag
            self._next_tag += 1
            tag = self._tags[request] = self._next_tag
        return tag

    def slot_writers(self, page: int, n_slots: int | None = None) -> dict[tuple[str | None, str | None], int]:
        """Who wrote the first `n_slots` slots of `page` (all of them by default): (request,
        tenant) -> slots; (None, None) for slots never written or scrubbed."""
        counts: dict[tuple[str | None, str | None], int] = {}
        for tag in self.writer_tags[page, : self.page_size if n_slots is None else n_slots].tolist():
            who = self._writer_of.get(tag, (None, None))
            counts[who] = counts.get(who, 0) + 1
        return counts

    def release_pages(self, request: str, pages: list[int]) -> None:
        """Release some pages of `request` (e.g. a trailing page it no longer needs)."""
        res = self.reservation(request)
        for p in pages:
            if not 0 <= p < self.n_pages:
                raise PoolError(f"{self.role} pool: page {p} does not exist (pool has {self.n_pages})")
            owner = self.pages[p].owner
            if owner is None:
                raise PoolError(f"{self.role} pool: page {p} is already free (double release)")
            if owner != request:
                raise PoolError(
                    f"{self.role} pool: request {request} cannot release page {p}: it is owned by {owner}"
                )
        for p in reversed(pages):
            res.pages.remove(p)
            info = self.pages[p]
            info.owner = info.owner_tenant = None
            self._free.append(p)
        kept = min(res.tokens, len(res.pages) * self.page_size)
        self._tokens_reserved -= res.tokens - kept
        res.tokens = kept
        self.trace.emit(RELEASE, request, res.tenant, pages, tokens=res.tokens)
        if not res.pages:
            del self._held[request]

    def _exhausted_message(self, n_tokens: int) -> str:
        return (
            f"{self.role} pool exhausted: {n_tokens} tokens ({self.pages_for(n_tokens)} pages) "
            f"requested, {len(self._free)} of {self.n_pages} pages free, "
            f"{self.capacity_tokens - self._tokens_reserved} of {self.capacity_tokens} tokens unreserved"
        )

    # -- lookups -------------------------------------------------------------------------
    def reservation(self, request: str) -> Reservation:
        try:
            return self._held[request]
        except KeyError:
            raise PoolError(f"{self.role} pool: request {request} holds no pages") from None

    def holds(self, request: str) -> bool:
        return request in self._held

    def holders(self) -> list[str]:
        return list(self._held)

    def note_write(self, request: str, tenant: str, pages: list[int]) -> None:
        """Record that `request` wrote every slot of `pages` (a KV transfer copies whole pages)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.writer_tags.device)
        self.writer_tags.index_fill_(0, index, self._writer_tag(request, tenant))
        self._note_pages(request, tenant, pages)

    def note_span(self, request: str, tenant: str, pages: list[int], start: int, end: int) -> None:
        """Record that `request` wrote positions ``start .. end-1`` of the block table `pages`
        (a prefill): only those slots; the rest of a page keeps whoever wrote it before."""
        if end <= start:
            return
        device = self.writer_tags.device
        table = torch.tensor(pages, dtype=torch.long, device=device)
        positions = torch.arange(start, end, device=device)
        slots = table[positions // self.page_size] * self.page_size + positions % self.page_size
        self.writer_tags.view(-1)[slots] = self._writer_tag(request, tenant)
        self._note_pages(request, tenant, pages[start // self.page_size : (end - 1) // self.page_size + 1])

    def note_writes(self, writes: list[tuple[str, str, int, int]]) -> None:
        """Record several (request, tenant, page, offset) one-token writes at once (a decode step)."""
        if not writes:
            return
        device = self.writer_tags.device
        slots = torch.tensor([page * self.page_size + off for _, _, page, off in writes], device=device)
        tags = torch.tensor([self._writer_tag(r, t) for r, t, _, _ in writes], device=device)
        self.writer_tags.view(-1)[slots] = tags
        for request, tenant, page, _ in writes:
            self._note_pages(request, tenant, [page])

    def _writer_tag(self, request: str, tenant: str) -> int:
        tag = self.tag_of(request)
        self._writer_of[tag] = (request, tenant)
        if len(self._writer_of) > 2 * self.writer_tags.numel():  # forget writers no slot holds now
            live = set(self.writer_tags.unique().tolist()) | {tag}
            self._writer_of = {t: w for t, w in self._writer_of.items() if t in live}
        return tag

    def _note_pages(self, request: str, tenant: str, pages: list[int]) -> None:
        now = time.time()
        for p in pages:
            info = self.pages[p]
            info.last_writer, info.last_writer_tenant, info.written_at = request, tenant, now

    def check_integrity(self) -> None:
        """free + owned = total; no page free and owned, or held twice; token budget respected."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolError(f"{self.role} pool: a page appears twice in the free list")
        owned: dict[int, str] = {}
        for req, res in self._held.items():
            for p in res.pages:
                if p in owned:
                    raise PoolError(f"{self.role} pool: page {p} held by {owned[p]} and {req}")
                if p in free:
                    raise PoolError(f"{self.role} pool: page {p} is free and held by {req}")
                if self.pages[p].owner != req:
                    raise PoolError(
                        f"{self.role} pool: page {p} held by {req} but the owner table says "
                        f"{self.pages[p].owner}"
                    )
                owned[p] = req
        if len(free) + len(owned) != self.n_pages:
            raise PoolError(
                f"{self.role} pool: {len(free)} free + {len(owned)} owned != {self.n_pages} pages"
            )
        for p in free:
            if self.pages[p].owner is not None:
                raise PoolError(f"{self.role} pool: free page {p} still names owner {self.pages[p].owner}")
        if self._tokens_reserved != sum(r.tokens for r in self._held.values()):
            raise PoolError(f"{self.role} pool: token count {self._tokens_reserved} disagrees")
        if self._tokens_reserved > self.capacity_tokens:
            raise PoolError(
                f"{self.role} pool: {self._tokens_reserved} tokens reserved > {self.capacity_tokens}"
            )

    def snapshot(self) -> list[dict[str, object]]:
        """The owner table as plain dicts, one per page (for widgets and the notebook handle)."""
        return [
            {
                "page": i,
                "owner": info.owner,
                "owner_tenant": info.owner_tenant,
                "last_writer": info.last_writer,
                "last_writer_tenant": info.last_writer_tenant,
                "written_at": info.written_at,
                "stale": info.last_writer is not None and info.last_writer != info.owner,
            }
            for i, info in enumerate(self.pages)
        ]
