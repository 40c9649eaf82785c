"""The KV transfer between the roles: the Mooncake stand-in.

Page data moves over `torch.distributed` (gloo on CPU, NCCL on CUDA), so the roles can sit on
different hosts. The group holds every worker: prefill workers are ranks 0..N-1, decode workers
N..N+M-1 (`ServeConfig.rank`); a room's pages go point to point between the two workers the
router paired for it. Each message of page data is announced on the
control channel by a `TransferBegin` naming the decode pages it is for; the receiver writes it
into exactly those pages. Nothing in the protocol checks that those pages still belong to the
request: that is for the fixes.

`LoopbackTransport` does the same within one process, for tests of the schedulers.
"""

from __future__ import annotations

import socket
import zlib
from datetime import timedelta
from typing import Any, Protocol

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
    def send(self, data: torch.Tensor, dst: int) -> None: ...

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class DistTransport:
    """Every worker's torch.distributed group: point-to-point page data, in announcement order.

    `bind` is this worker's own address for page data (gloo binds its sockets there, so the bytes
    cross the link that address is on); None lets gloo choose (``GLOO_SOCKET_IFNAME``, else the
    host name). NCCL picks its interface from ``NCCL_SOCKET_IFNAME``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        device: str = "cpu",
        timeout_s: float = 60,
        bind: str | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.device = device
        timeout = timedelta(seconds=timeout_s)
        if self.rank == 0:
            # The rendezvous store listens where it is told (--transfer-host), not on every
            # interface as torch's own `tcp://` store does: it takes no key, so anyone who reaches
            # it could join the group. The store is handed a socket bound here.
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family)
            store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout)
        self.group: Any = None  # a gloo backend of our own: bound to `bind`, not the host name
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._timeout = timeout
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=bind)
                if bind
                else dist.ProcessGroupGloo.create_default_device()
            ]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, opts)
        else:
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )

    def send(self, data: torch.Tensor, dst: int) -> None:
        data = data.contiguous()
        if self.group is not None:
            self.group.send([data], dst, 0).wait()
        else:
            dist.send(data, dst=dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        buf = torch.empty_like(like)
        if self.group is not None:
            self.group.recv([buf], src, 0).wait()
        else:
            dist.recv(buf, src=src)
        return buf

    def close(self) -> None:
        self.group = None
        if dist.is_initialized():
            dist.destroy_process_group()


class LoopbackTransport:
    """In-process stand-in: what is sent is what the next `recv` returns."""

    def __init__(self) -> None:
        self._queue: list[torch.Tensor] = []

    def send(self, data: torch.Tensor, dst: int = 1) -> None:
        self._queue.append(data.clone())

    def recv(self, like: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not self._queue:
            raise RuntimeError("loopback transport: nothing was sent")
        data = self._queue.pop(0)
        if data.shape != like.shape:
            raise RuntimeError(f"loopback transport: sent {tuple(data.shape)}, expected {tuple(like.shape)}")
        return data

    def close(self) -> None:
        self._queue.clear()
