"""The page-pool view draws what the snapshots say."""

from __future__ import annotations

import pytest

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


def test_live_pool_view_follows_a_local_pool() -> None:
    from minigrid_engine.model import ModelConfig
    from minigrid_engine.pool import KVPool, PoolConfig
    from widgets.live import LocalPools, PoolView

    pool = KVPool(PoolConfig(64, 16), ModelConfig(), role="demo")
    view = PoolView(LocalPools(demo=pool), columns=4)
    widget = view.live()

    def work() -> list[int]:
        res = pool.reserve("alice-1", "alice", 40)
        pool.note_write("alice-1", "alice", res.pages)
        pool.release("alice-1")
        pool.reserve("bob-2", "bob", 20)
        return res.pages

    pages = view.follow(work)
    cells = next(t for t in widget.data if t.name == "demo")
    colours = tenant_colours(["alice"])
    assert [cells.marker.color[p] for p in pages] == [colours["alice"]] * 3
    # the free list hands alice's first pages to bob (most recently freed first)
    assert "s ago" in cells.hovertext[pages[0]] and "owner: bob-2" in cells.hovertext[pages[0]]
    assert "owner: free" in cells.hovertext[pages[-1]]
    stale = next(t for t in widget.data if t.name == "demo stale")
    assert len(stale.x) == 2  # bob holds two pages alice wrote
    # where no widget is drawn (a text export, papermill), one line says what it is, not the figure
    assert repr(widget).startswith("[live figure: ") and len(repr(widget)) < 200


def test_a_static_figure_is_plotlys_json_and_a_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import plotly.graph_objects as go
    from IPython import display as ipd

    from widgets import live

    shown: list[dict] = []
    monkeypatch.setattr(ipd, "display", lambda bundle, raw: shown.append(bundle))
    live.show(go.Figure(go.Scatter(x=[1], y=[2]), layout={"title": "Pages each program read"}))
    (bundle,) = shown
    assert bundle["text/plain"] == "[figure: Pages each program read; JupyterLab draws it]"
    assert bundle["application/vnd.plotly.v1+json"]["data"][0]["y"] == [2]
    assert set(bundle) == {"text/plain", "application/vnd.plotly.v1+json"}  # no plotly.js bundle


def test_timeline_and_sequence_from_a_trace() -> None:
    from widgets.timeline import protocol_messages, request_spans, sequence_figure, timeline_figure

    def ev(role: str, t: float, kind: str, pages: list[int] = (), **detail: object) -> dict:  # type: ignore[assignment]
        return {
            "time": t,
            "kind": kind,
            "request": "bob-4",
            "tenant": "bob",
            "pages": list(pages),
            "detail": detail,
        }

    trace = {
        "prefill": [
            ev("prefill", 0.0, "state", to="waiting"),
            ev("prefill", 0.01, "state", to="prefilling"),
            ev("prefill", 0.02, "write", [3], start=0, end=1),
            ev("prefill", 0.03, "state", to="transferring"),
        ],
        "decode": [
            ev("decode", 0.005, "state", to="prealloc"),
            ev("decode", 0.006, "reserve", [1, 2, 3, 4, 5, 6, 7, 8]),
            ev("decode", 0.007, "state", to="transferring"),
            ev("decode", 0.04, "write", [1], source="transfer"),
            ev("decode", 0.05, "state", to="decoding", kv_len=1000),
            ev("decode", 0.09, "state", to="finished", outcome="length"),
        ],
    }
    s = request_spans(trace)["bob-4"]
    assert (s.prefill_pages_written, s.decode_pages_reserved, s.kv_len_at_decode) == (1, 8, 1000)
    assert [p for p, _, _ in s.phases()] == ["queued", "prefill", "transfer", "decode"]
    assert abs(s.ttft_s - 0.05) < 1e-9
    labels = [m.label for m in protocol_messages(trace, "bob-4")]
    assert labels == [
        "Bootstrapped (room)",
        "KVBootstrap: 8 decode pages",
        "KV data: 1 page",
        "done: Success (decode attends 1000 tokens)",
    ]
    assert len(sequence_figure(trace, "bob-4").layout.annotations) == 8
    assert {t.name for t in timeline_figure(trace).data} >= {"prefill", "transfer", "decode", "first token"}


def test_controls_restart_through_their_traitlets() -> None:
    from widgets.controls import EngineControls

    started: list[object] = []

    class Fake:
        def stop(self) -> None:
            started.append("stopped")

    def start(cfg: object) -> Fake:
        started.append(cfg)
        return Fake()

    c = EngineControls(start=start)  # type: ignore[arg-type]
    ready: list[object] = []
    c.on_ready.append(ready.append)
    c.pool.value = 2048
    c.fixes.value = ("reject-before-transfer",)
    c.apply.click()
    cfg = started[0]
    assert cfg.prefill_pool_tokens == 2048 and str(cfg.fixes) == "reject-before-transfer"  # type: ignore[attr-defined]
    assert ready and c.progress.value == 1 and "ready" in c.status.value
    c.tenants.value = "alice"  # no key: a clear message, the running engine kept
    c.apply.click()
    assert "NAME:KEY" in c.status.value and c.engine is not None and "stopped" not in started

    def refuse(cfg: object) -> Fake:
        raise RuntimeError(
            "the engine exited with status 3:\nminigrid: ...\ncapacity-check: the prefill KV pool holds 665"
        )

    c2 = EngineControls(start=refuse)  # type: ignore[arg-type]
    c2.apply.click()
    assert c2.engine is None and "capacity-check: the prefill KV pool holds 665" in c2.status.value


def test_model_check_figures_outline_the_stale_pages() -> None:
    from dataclasses import replace

    from minigrid_engine.fixes import Fixes
    from minigrid_engine.protocol import INCIDENT, check_protocol, fix_table
    from widgets.model_check import counterexample_figure, fix_table_figure
    from widgets.pool_view import tenant_colours

    bug = check_protocol(INCIDENT, Fixes.none())
    fig = counterexample_figure(bug, INCIDENT)
    stale = [t for t in fig.data if t.marker.line.width == 4]
    assert stale and all(t.marker.color == tenant_colours(["alice", "bob"])["alice"] for t in stale)
    cells = {(x, y) for t in stale for x, y in zip(t.x, t.y, strict=True)}
    last = fig.layout.yaxis.categoryarray[-1]
    assert ("d1", last) in cells  # bob reads decode page 1, last written by alice, at the last step
    assert all(x.startswith("d") for x, _ in cells)  # prefill never holds a stale page here
    with pytest.raises(ValueError, match="no counterexample"):
        counterexample_figure(check_protocol(INCIDENT, replace(Fixes.all(), capacity_check=False)), INCIDENT)
    bars = fix_table_figure(fix_table(INCIDENT), "incident").data[0]
    verdicts = dict(zip(bars.y, bars.text, strict=True))
    assert verdicts["none"].startswith("stale-read") and verdicts["owner-check"] == "safe"


def test_a_room_of_thirty_gets_thirty_colours_and_none_is_the_never_written_grey() -> None:
    names = [f"student{i:02d}" for i in range(1, 31)]
    colours = tenant_colours(names)
    picked = [colours[n] for n in names]
    assert len(set(picked)) == 30 and NEVER not in picked
    assert tenant_colours(list(reversed(names))) == colours  # the same student, the same colour


def test_the_probe_picture_puts_each_answer_where_it_stood() -> None:
    from minigrid_engine.probe import ProbeReport, ProbeShot
    from widgets.probe_view import probe_figure

    shots = [
        ProbeShot(1, "alice", 300, 300, status=200, prompt_tokens=301, ttft_s=0.05),
        ProbeShot(1, "bob", 900, 900, status=200, prompt_tokens=902, ttft_s=0.04, foreign={"alice": ["X"]}),
        ProbeShot(1, "alice", 1000, 1000, status=400, code="context_length_exceeded"),
    ]
    fig = probe_figure(ProbeReport("http://x", "m", 1024, 1.0, 0.0, shots), pool_tokens=665)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {
        "clean answer (1)",
        "leaked: another account's canaries (1)",
        "refused or failed (no answer) (1)",
    }
    leaked = by_name["leaked: another account's canaries (1)"]
    assert list(leaked.x) == [902] and list(leaked.y) == [40.0]
    assert [s["x0"] for s in fig.layout.shapes] == [665, 1024]  # the pool's edge and the context
    assert "1 of 3 answers leaked" in fig.layout.title.text
