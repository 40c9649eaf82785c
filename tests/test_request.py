"""The request state machine: the edges it has, and every edge it refuses."""

from __future__ import annotations

import itertools

import pytest

from minigrid_engine.request import TRANSITIONS, IllegalTransition, Outcome, Request, State
from minigrid_engine.trace import Trace

S = State
# The three roles' paths (prefill worker, decode worker, the one-process engine), and FINISHED
# from every live state: nothing else. A finished request never moves again.
PATHS = {
    "prefill": [S.WAITING, S.BOOTSTRAPPING, S.WAITING, S.PREFILLING, S.TRANSFERRING, S.FINISHED],
    "decode": [S.WAITING, S.BOOTSTRAPPING, S.PREALLOC, S.TRANSFERRING, S.DECODING, S.FINISHED],
    "engine": [S.WAITING, S.PREFILLING, S.DECODING, S.FINISHED],
    "decode, early bootstrap": [S.WAITING, S.PREALLOC, S.TRANSFERRING, S.DECODING, S.FINISHED],
    "prefill, no bootstrap wait": [S.WAITING, S.BOOTSTRAPPING, S.PREFILLING, S.TRANSFERRING, S.FINISHED],
}
EDGES = {(a, b) for path in PATHS.values() for a, b in itertools.pairwise(path)}
EDGES |= {(s, S.FINISHED) for s in State if s is not S.FINISHED}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_each_roles_path_is_walked_and_traced(path: list[State]) -> None:
    trace = Trace("test")
    req = Request("r1", "alice", [1, 2, 3])
    for state in path[1:]:
        req.advance(state, trace)
    moves = [(e.detail["from"], e.detail["to"]) for e in trace.events(kind="state")]
    assert moves == [(a.value, b.value) for a, b in itertools.pairwise(path)]


def test_the_table_has_exactly_these_edges_and_refuses_every_other() -> None:
    assert {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts} == EDGES
    for a in State:
        for b in State:
            req = Request("r1", "alice", [1])
            req.state = a
            if (a, b) in EDGES:
                req.advance(b)
                assert req.state is b
            else:
                with pytest.raises(IllegalTransition, match=f"no edge {a.value} -> {b.value}"):
                    req.advance(b)
                assert req.state is a  # a refused move changes nothing


def test_a_finished_request_never_comes_back() -> None:
    req = Request("r1", "alice", [1])
    req.advance(S.PREFILLING)
    req.advance(S.DECODING)
    req.finish(Outcome.LENGTH)  # moves to FINISHED itself
    assert req.state is S.FINISHED and req.finished()
    for state in State:
        with pytest.raises(IllegalTransition):
            req.advance(state)
    with pytest.raises(IllegalTransition):  # finished twice: a bookkeeping bug, never hidden
        req.finish(Outcome.ABORTED)
