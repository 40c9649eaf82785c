"""The KV transfer between the roles: the Mooncake stand-in.

Page data moves over `torch.distributed` (gloo on CPU, NCCL on CUDA), rank 0 = prefill, rank 1 =
decode, so the two roles can sit on two hosts. Each message of page data is announced on the
control channel by a `TransferBegin` naming the decode pages it is for; the receiver writes it
into exactly those pages. Nothing in the protocol checks that those pages still belong to the
request: that is for the fixes.

`LoopbackTransport` does the same within one process, for tests of the schedulers.
"""

from __future__ import annotations

import socket
import zlib
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from minigrid_engine.pool import KVPool


def page_data(pool: KVPool, pages: list[int]) -> torch.Tensor:
    """K and V of `pages`, every layer: [2, n_layers, len(pages), page_size, kv_heads, dim]."""
    index = torch.tensor(pages, dtype=torch.long, device=pool.k.device)
    return torch.stack((pool.k.index_select(1, index), pool.v.index_select(1, index)))


def store_pages(pool: KVPool, pages: list[int], data: torch.Tensor) -> None:
    """Write received page data into `pages` of `pool`."""
    index = torch.tensor(pages, dtype=torch.long, device=pool.k.device)
    pool.k.index_copy_(1, index, data[0])
    pool.v.index_copy_(1, index, data[1])


def page_checksums(pool: KVPool, pages: list[int]) -> list[int]:
    """Adler-32 of each page's K and V bytes, every layer (what `kv-checksum` compares)."""
    data = page_data(pool, pages).cpu()  # [2, L, n, ...]
    return [zlib.adler32(data[:, :, i].contiguous().numpy().tobytes()) for i in range(len(pages))]


class Transport(Protocol):
    def send(self, data: torch.Tensor) -> None: ...

    def recv(self, like: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


class DistTransport:
    """Two-rank torch.distributed group: prefill sends, decode receives, in announcement order."""

    def __init__(self, role: str, host: str, port: int, device: str = "cpu", timeout_s: float = 60) -> None:
        self.rank = 0 if role == "prefill" else 1
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        if self.rank == 0:
            # The rendezvous store listens where it is told (--transfer-host), not on every
            # interface as torch's own `tcp://` store does: it takes no key, so anyone who reaches
            # it could join the group. The store is handed a socket bound here.
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family)
            store = dist.TCPStore(host, port, 2, True, timeout, master_listen_fd=sock.detach())
        else:
            store = dist.TCPStore(host, port, 2, False, timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=2, timeout=timeout)

    def send(self, data: torch.Tensor) -> None:
        dist.send(data.contiguous(), dst=1 - self.rank)

    def recv(self, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(like)
        dist.recv(buf, src=1 - self.rank)
        return buf

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LoopbackTransport:
    """In-process stand-in: what is sent is what the next `recv` returns."""

    def __init__(self) -> None:
        self._queue: list[torch.Tensor] = []

    def send(self, data: torch.Tensor) -> None:
        self._queue.append(data.clone())

    def recv(self, like: torch.Tensor) -> torch.Tensor:
        if not self._queue:
            raise RuntimeError("loopback transport: nothing was sent")
        data = self._queue.pop(0)
        if data.shape != like.shape:
            raise RuntimeError(f"loopback transport: sent {tuple(data.shape)}, expected {tuple(like.shape)}")
        return data

    def close(self) -> None:
        self._queue.clear()
