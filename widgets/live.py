"""Live views: plotly FigureWidgets that follow a running engine, and their static twins.

In JupyterLab a `PoolView` or `TimelineView` updates in place while an action runs
(`view.follow(fn, ...)` runs `fn` in a thread and redraws from the engine a few times a second).
Headless (papermill) no frontend draws a widget and no state is saved, so every view also has
`static()`: a plain figure, shown with plotly's mimetype renderer so the saved notebook holds
the figure's JSON (tens of kB), not a copy of plotly.js (megabytes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import plotly.graph_objects as go
import plotly.io as pio

from widgets.pool_view import pool_figure
from widgets.timeline import timeline_figure

T = TypeVar("T")

RENDERER = "plotly_mimetype"  # JupyterLab renders it; the notebook does not embed plotly.js


def use_light_renderer() -> None:
    """Make `fig.show()` write the figure as JSON for JupyterLab, never the plotly.js bundle."""
    pio.renderers.default = RENDERER


def show(fig: go.Figure) -> None:
    """Display a static figure, kept in the saved notebook: plotly's JSON, which JupyterLab draws,
    and one line naming the figure, which a text or HTML export (nbconvert, GitHub) shows instead
    of nothing."""
    from IPython.display import display

    use_light_renderer()
    bundle = fig._repr_mimebundle_(include=None, exclude=None)
    bundle["text/plain"] = f"[figure: {_title(fig)}; JupyterLab draws it]"
    display(bundle, raw=True)


def _title(fig: go.Figure) -> str:
    return fig.layout.title.text or "untitled"


class NamedFigureWidget(go.FigureWidget):
    """A FigureWidget that says what it is where no widget is drawn (a text export, a notebook run
    headless), instead of printing its whole figure."""

    def __repr__(self) -> str:
        return f"[live figure: {_title(self)}; JupyterLab draws it and redraws it from the engine]"


class Source(Protocol):
    def pools(self) -> dict[str, list[dict[str, Any]]]: ...

    def trace(self, since: int = 0, tenant: str = "admin") -> dict[str, list[dict[str, Any]]]: ...


class _LiveFigure:
    """A FigureWidget redrawn from `self.figure()`; subclasses say how to make the figure."""

    def __init__(self) -> None:
        self.widget: go.FigureWidget | None = None

    def figure(self) -> go.Figure:
        raise NotImplementedError

    def refresh(self) -> go.Figure:
        """Redraw from the engine now; returns the static figure it drew."""
        fig = self.figure()
        if self.widget is not None:
            w = self.widget
            with w.batch_update():
                if len(w.data) == len(fig.data):
                    for old, new in zip(w.data, fig.data):
                        old.update(new.to_plotly_json(), overwrite=True)
                else:  # tenants or requests appeared: replace the traces
                    w.data = ()
                    w.add_traces(list(fig.data))
                w.layout.update(fig.layout.to_plotly_json(), overwrite=True)
        return fig

    def live(self) -> go.FigureWidget:
        """The FigureWidget to display in JupyterLab (needs anywidget with plotly >= 6)."""
        if self.widget is None:
            self.widget = NamedFigureWidget(self.figure())
        return self.widget

    def static(self) -> go.Figure:
        return self.figure()

    def watch(self, interval_s: float = 1.0) -> go.FigureWidget:
        """Redraw the live widget every `interval_s` in the background until `unwatch()` (a room's
        pool changes with every student's request, not with an action of this notebook)."""
        widget = self.live()
        self.unwatch()
        stop = self._stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.refresh()
                except Exception:  # the engine went away: stop quietly, the widget keeps its picture
                    return

        threading.Thread(target=loop, name="live-view", daemon=True).start()
        return widget

    def unwatch(self) -> None:
        stop: threading.Event | None = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def follow(self, action: Callable[..., T], *args: Any, interval_s: float = 0.25, **kwargs: Any) -> T:
        """Run `action(*args, **kwargs)` in a thread, redrawing until it returns; return its value."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = action(*args, **kwargs)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(interval_s)
            if self.widget is not None:
                self.refresh()
        self.refresh()
        if "error" in box:
            raise box["error"]
        return box["value"]


class PoolView(_LiveFigure):
    """Every page of each role's pool, coloured by last writer; `read` outlines selected pages."""

    def __init__(
        self,
        engine: Source,
        read: dict[str, set[int]] | None = None,
        writers: dict[str, dict[int, str | None]] | None = None,
        columns: int = 16,
    ) -> None:
        super().__init__()
        self.engine, self.read, self.writers, self.columns = engine, read, writers, columns

    def figure(self) -> go.Figure:
        return pool_figure(
            self.engine.pools(), read=self.read, writers=self.writers, columns=self.columns, now=time.time()
        )

    def select(self, pages: list[dict[str, Any]], role: str = "decode") -> None:
        """Outline the pages one answer read (`pages_read` rows) and colour them by their writer then
        (on the worker each row names, where a role has several)."""
        read: dict[str, set[int]] = {}
        writers: dict[str, dict[int, str | None]] = {}
        for p in pages:
            key = p.get("worker", role)
            read.setdefault(key, set()).add(p["page"])
            writers.setdefault(key, {})[p["page"]] = p["last_writer_tenant"]
        self.read, self.writers = read, writers
        self.refresh()


class TimelineView(_LiveFigure):
    """One row per request that arrived after `after` (epoch seconds; default: now)."""

    def __init__(self, engine: Source, after: float | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.after = time.time() if after is None else after

    def figure(self) -> go.Figure:
        return timeline_figure(since_time(self.engine.trace(), self.after))


def since_time(trace: dict[str, list[dict[str, Any]]], after: float) -> dict[str, list[dict[str, Any]]]:
    """The events of requests whose first event came at or after `after` (whole requests only)."""
    first: dict[str, float] = {}
    for events in trace.values():
        for e in events:
            if e.get("request") is not None:
                first[e["request"]] = min(first.get(e["request"], e["time"]), e["time"])
    keep = {r for r, t in first.items() if t >= after}
    return {role: [e for e in evs if e.get("request") in keep] for role, evs in trace.items()}


class LocalPools:
    """A `Source` over pools in this process (the paged-KV lab needs no engine processes)."""

    def __init__(self, **pools: Any) -> None:
        self.by_role = pools  # role -> minigrid_engine.pool.KVPool

    def pools(self) -> dict[str, list[dict[str, Any]]]:
        return {role: pool.snapshot() for role, pool in self.by_role.items()}

    def trace(self, since: int = 0, tenant: str = "admin") -> dict[str, list[dict[str, Any]]]:
        return {
            role: [e.to_dict() for e in pool.trace.events(since) if tenant == "admin" or e.tenant == tenant]
            for role, pool in self.by_role.items()
        }
