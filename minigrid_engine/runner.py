"""The model runner: runs the model over a pool, reading and writing K/V only through block tables.

The runner knows nothing of queues, processes or who should own what. It is told a block table
and a length, writes this step's K/V into those pages, attends over the first `kv_len` tokens of
those pages, and records one write and one read event per request. Handing it a block table whose
pages hold another request's K/V is exactly what the faulty engine did.

The paged attention itself comes from a backend, `attention_ops("torch")` (`attention.py`) or
`attention_ops("triton")` (`kernels.py`): the same four functions, the same results, so the
trace and the owner-check behave the same whichever does the arithmetic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minigrid_engine import attention
from minigrid_engine.errors import ConfigError
from minigrid_engine.model import Transformer
from minigrid_engine.pool import KVPool
from minigrid_engine.request import Request
from minigrid_engine.trace import READ, WRITE


@dataclass(frozen=True)
class DecodeItem:
    """One request's decode step: feed `token` at `position`, attend over positions 0..position."""

    request: str
    tenant: str
    token: int
    position: int
    pages: list[int]

    @classmethod
    def next_step(cls, req: Request, pages: list[int]) -> DecodeItem:
        """The step that feeds `req`'s last output token at the position after its KV so far."""
        return cls(
            req.request_id, req.tenant, req.output_ids[-1], req.prompt_len + len(req.output_ids) - 1, pages
        )


ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionOps:
    """The paged-attention functions a backend provides, with `attention.py`'s signatures.

    decode_checked(q, k_cache, v_cache, block_tables, seq_lens, slot_tags, reader_tags) returns
    (output, foreign): decode plus the `owner-check` flags of `attention.foreign_pages`.
    """

    name: str
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    prefill: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    decode_checked: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _torch_decode_checked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_tags: torch.Tensor,
    reader_tags: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    foreign = attention.foreign_pages(slot_tags, reader_tags, block_tables, seq_lens, k_cache.shape[1])
    return attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens), foreign


def attention_ops(name: str = "torch") -> AttentionOps:
    """The backend called `name`; "triton" imports the kernels (and Triton) only when asked for."""
    if name == "torch":
        return AttentionOps(
            "torch",
            attention.write_kv,
            attention.paged_prefill_attention,
            attention.paged_decode_attention,
            _torch_decode_checked,
        )
    if name == "triton":
        try:
            from minigrid_engine import kernels  # sets TRITON_INTERPRET=1 first when there is no GPU
        except ImportError as exc:
            raise ConfigError(f"--attention triton is unavailable ({exc}); use --attention torch") from exc
        return AttentionOps(
            "triton",
            kernels.write_kv,
            kernels.paged_prefill_attention,
            kernels.paged_decode_attention,
            kernels.paged_decode_attention_checked,
        )
    raise ConfigError(f"attention {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")


class _PagedPrefill:
    """Attention backend for one request's prompt chunk at positions start..start+T-1."""

    def __init__(
        self, pool: KVPool, block_table: torch.Tensor, start: int, slots: torch.Tensor, ops: AttentionOps
    ):
        self.pool, self.block_table, self.start, self.slots = pool, block_table, start, slots
        self.ops = ops

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        self.ops.write_kv(kc, vc, self.slots, k[0], v[0])
        return self.ops.prefill(q[0], kc, vc, self.block_table, self.start)[None]


class _PagedDecode:
    """Attention backend for a batch of single-token decode steps."""

    def __init__(
        self,
        pool: KVPool,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor,
        reader_tags: torch.Tensor | None = None,
        ops: AttentionOps | None = None,
    ):
        self.pool, self.block_tables, self.seq_lens, self.slots = pool, block_tables, seq_lens, slots
        self.reader_tags = reader_tags
        self.ops = ops or attention_ops("torch")
        self.foreign: torch.Tensor | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        self.ops.write_kv(kc, vc, self.slots, k[:, 0], v[:, 0])
        if self.reader_tags is not None and self.foreign is None:  # fix `owner-check`, at the first read
            out, self.foreign = self.ops.decode_checked(
                q[:, 0], kc, vc, self.block_tables, self.seq_lens, self.pool.writer_tags, self.reader_tags
            )
        else:
            out = self.ops.decode(q[:, 0], kc, vc, self.block_tables, self.seq_lens)
        return out[:, None]


class ModelRunner:
    """Prefill and batched decode of `model` over the pages of `pool`."""

    def __init__(
        self, model: Transformer, pool: KVPool, owner_check: bool = False, attention: str = "torch"
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.k.device
        self.owner_check = owner_check
        self.ops = attention_ops(attention)  # "torch" or "triton": same results, same trace
        # After each decode(): request -> pages it was about to read that someone else wrote last.
        self.violations: dict[str, list[int]] = {}

    def _pages_covering(self, pages: list[int], start: int, end: int) -> list[int]:
        p = self.pool.page_size
        return pages[start // p : (end - 1) // p + 1]

    @torch.inference_mode()
    def prefill(
        self, request: str, tenant: str, token_ids: list[int], pages: list[int], start: int = 0
    ) -> torch.Tensor:
        """Write K/V of `token_ids` at positions start.. into `pages`; return the last logits [vocab]."""
        n = len(token_ids)
        end = start + n
        if end > len(pages) * self.pool.page_size:
            raise ValueError(
                f"prefill of positions {start}..{end - 1} needs {self.pool.pages_for(end)} pages, "
                f"block table has {len(pages)}"
            )
        table = torch.tensor(pages, dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        slots = attention.slot_ids(table, positions, self.pool.page_size)
        tokens = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits = self.model(tokens, positions[None], _PagedPrefill(self.pool, table, start, slots, self.ops))
        written = self._pages_covering(pages, start, end)
        self.pool.note_span(request, tenant, pages, start, end)  # those slots only
        trace = self.pool.trace
        trace.emit(WRITE, request, tenant, written, start=start, end=end)
        trace.emit(READ, request, tenant, self._pages_covering(pages, 0, end), kv_len=end)
        return logits[0, -1]

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One decode step for every item, in one batch; returns logits [B, vocab]."""
        p = self.pool.page_size
        for it in items:
            if it.position >= len(it.pages) * p:
                raise ValueError(
                    f"request {it.request}: position {it.position} is past its {len(it.pages)} pages"
                )
        # Only the pages up to each position are read: pages reserved for tokens not yet decoded
        # stay out of the block table (gathering them would copy K/V that the mask then drops).
        reads = [it.pages[: it.position // p + 1] for it in items]
        width = max(len(r) for r in reads)
        table = torch.tensor(
            [r + [r[0]] * (width - len(r)) for r in reads],
            dtype=torch.long,
            device=self.device,
        )
        positions = torch.tensor([it.position for it in items], dtype=torch.long, device=self.device)
        rows = torch.arange(len(items), device=self.device)
        slots = table[rows, positions // p] * p + positions % p
        tokens = torch.tensor([[it.token] for it in items], dtype=torch.long, device=self.device)
        # This step's K/V goes into each request's slot at `position` before attention reads it.
        self.pool.note_writes(
            [(it.request, it.tenant, it.pages[it.position // p], it.position % p) for it in items]
        )
        reader_tags = None
        if self.owner_check:
            reader_tags = torch.tensor([self.pool.tag_of(it.request) for it in items], device=self.device)
        backend = _PagedDecode(self.pool, table, positions + 1, slots, reader_tags, self.ops)
        logits = self.model(tokens, positions[:, None], backend)
        self.violations = {}
        if backend.foreign is not None:
            for row, it in enumerate(items):
                bad = table[row][backend.foreign[row]].tolist()
                if bad:
                    self.violations[it.request] = bad
        trace = self.pool.trace
        for it in items:
            page = it.pages[it.position // p]
            trace.emit(
                WRITE,
                it.request,
                it.tenant,
                [page],
                start=it.position,
                end=it.position + 1,
                offset=it.position % p,
            )
            trace.emit(
                READ,
                it.request,
                it.tenant,
                self._pages_covering(it.pages, 0, it.position + 1),
                kv_len=it.position + 1,
                batch_size=len(items),
            )
        return logits[:, 0]


# A request samples from two streams: its first token where its prompt is computed (prefill, or
# the single-process engine's prefill), then its decode steps.
FIRST_TOKEN, DECODE_STEPS = 0, 1


def sampling_generator(seed: int, stream: int) -> torch.Generator:
    """The generator for one of a seeded request's sampling streams.

    torch's CPU generator keeps only the low 32 bits of the seed it is given, so seeds 2**32 apart
    would sample alike, and a plain "decode uses seed + 1" would make one request's decode steps
    another's first token. The whole 64-bit seed and the stream are hashed into the generator's seed instead.
    """
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> int:
    """Greedy at temperature 0 (deterministic); otherwise sample from softmax(logits / T).

    Sampling runs on the CPU whatever device computed the logits: the generators are CPU ones, and
    a seed then gives the same tokens on a GPU as here.
    """
    if temperature <= 0:
        return int(torch.argmax(logits).item())
    # Shift so the largest logit is 0 before dividing, in float64: a temperature of 1e-300 (within
    # 0-2, so allowed) then gives 0 for the best token and -inf, never NaN, for the others.
    logits = logits.detach().to("cpu", torch.float64)
    scaled = (logits - logits.max()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
