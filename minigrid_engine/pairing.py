"""Pairing: which prefill worker and which decode worker serve one request (the room's pair).

SGLang's mini load balancer picks a prefill server and a decode server for each request, then
sends both the same bootstrap room and the prefill server's bootstrap address, so the decode side
knows where its KV comes from. Here the router does the same with its worker processes: per role,
the live worker with the fewest requests outstanding, ties broken round-robin (deterministic, so
a test can say where a request goes). The pair travels in the `GenerateRequest`; every later
message of the room stays between those two workers.

Torch-free: the router imports it.
"""

from __future__ import annotations

from collections.abc import Collection


class Pairing:
    """Outstanding requests per worker and the pair each room was given."""

    def __init__(self, workers: dict[str, int]) -> None:
        """`workers`: role -> how many workers it has (ids ``ROLE-INDEX``)."""
        self.order = {role: [f"{role}-{i}" for i in range(n)] for role, n in workers.items()}
        self.outstanding = {w: 0 for ids in self.order.values() for w in ids}
        self.rooms: dict[int, tuple[str, str]] = {}
        self._next = dict.fromkeys(workers, 0)  # round-robin start, per role

    def pick(self, role: str, alive: Collection[str]) -> str:
        """The live worker of `role` with the fewest requests outstanding (round-robin on ties)."""
        ids = self.order[role]
        start = self._next[role]
        live = [(self.outstanding[w], (i - start) % len(ids), i) for i, w in enumerate(ids) if w in alive]
        if not live:
            raise ConnectionError(f"no {role} worker is up")
        _, _, i = min(live)
        self._next[role] = (i + 1) % len(ids)
        return ids[i]

    def pair(self, room: int, alive: Collection[str]) -> tuple[str, str]:
        """Choose (prefill, decode) for `room` and count it outstanding on both."""
        pair = (self.pick("prefill", alive), self.pick("decode", alive))
        self.rooms[room] = pair
        for w in pair:
            self.outstanding[w] += 1
        return pair

    def done(self, room: int) -> tuple[str, str] | None:
        """`room` has its answer: it no longer counts against its pair."""
        pair = self.rooms.pop(room, None)
        for w in pair or ():
            self.outstanding[w] -= 1
        return pair

    def rooms_of(self, worker: str) -> list[int]:
        """Rooms outstanding on `worker` (what its death fails)."""
        return [room for room, pair in self.rooms.items() if worker in pair]
