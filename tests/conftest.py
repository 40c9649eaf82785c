"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fake_http import Answer, FakeServer


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeServer]]:
    """`serve(routes, key=None)`: a FakeServer, closed when the test ends."""
    started: list[FakeServer] = []

    def start(routes: dict[str, Answer], key: str | None = None) -> FakeServer:
        started.append(FakeServer(routes, key))
        return started[-1]

    yield start
    for s in started:
        s.close()
