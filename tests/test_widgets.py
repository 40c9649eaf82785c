"""The page-pool view draws what the snapshots say."""

from __future__ import annotations

from widgets.pool_view import NEVER, pool_figure, tenant_colours


def snap(n: int, writers: dict[int, tuple[str, str]], owners: dict[int, str]) -> list[dict]:
    return [
        {
            "page": i,
            "owner": owners.get(i),
            "owner_tenant": None,
            "last_writer": writers.get(i, (None, None))[0],
            "last_writer_tenant": writers.get(i, (None, None))[1],
            "written_at": None,
            "stale": i in writers and owners.get(i) not in (None, writers[i][0]),
        }
        for i in range(n)
    ]


def test_cells_are_coloured_by_last_writer_and_read_pages_outlined() -> None:
    pools = {
        "prefill": snap(6, {0: ("bob-4", "bob")}, {}),
        "decode": snap(
            32,
            {0: ("bob-4", "bob"), 1: ("alice-2", "alice"), 2: ("alice-2", "alice")},
            {0: "bob-4", 1: "bob-4", 2: "bob-4"},
        ),
    }
    fig = pool_figure(pools, read={"decode": {0, 1, 2}})
    colours = tenant_colours(["alice", "bob"])
    decode = next(t for t in fig.data if t.name == "decode")
    assert len(decode.x) == 32
    assert decode.marker.color[1] == colours["alice"] and decode.marker.color[0] == colours["bob"]
    assert decode.marker.color[5] == NEVER
    assert [w for w in decode.marker.line.width[:4]] == [3, 3, 3, 0.5]
    assert "read by the selected answer" in decode.hovertext[1]
    stale = next(t for t in fig.data if t.name == "decode stale")
    assert len(stale.x) == 2  # pages 1 and 2: held by bob, written by alice
    assert {t.name for t in fig.data if t.x == (None,)} == {"alice", "bob"}
