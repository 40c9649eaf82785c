"""The page-pool view: one cell per page of each pool, coloured by the tenant that last wrote it.

One panel per role, or per worker where a role has several (each worker has its own pool; the
snapshot's pages name their worker).

Reads only what the engine exposes (`Engine.pools()` snapshots, `pages_read` forensics); the
engine never imports this module.
"""

from __future__ import annotations

import colorsys
import time
from typing import Any

import plotly.graph_objects as go

PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"]
NEVER = "#E8E8E8"


def tenant_colours(tenants: list[str]) -> dict[str | None, str]:
    """A colour per tenant, none repeated however many (a 30-student room): the palette first, then
    hues spread by the golden angle, two lightnesses apart, never the grey of a never-written page."""
    colours: dict[str | None, str] = {None: NEVER}
    for i, t in enumerate(sorted(set(tenants))):
        colours[t] = PALETTE[i] if i < len(PALETTE) else _spread_colour(i - len(PALETTE))
    return colours


def _spread_colour(i: int) -> str:
    hue = (0.11 + i * 0.381966) % 1.0  # golden-angle steps: neighbours far apart on the wheel
    light, sat = (0.42, 0.65) if i % 2 == 0 else (0.62, 0.55)
    r, g, b = colorsys.hls_to_rgb(hue, light + 0.04 * ((i // 2) % 3 - 1), sat)
    return f"#{round(r * 255):02X}{round(g * 255):02X}{round(b * 255):02X}"


def pool_figure(
    pools: dict[str, list[dict[str, Any]]],
    read: dict[str, set[int]] | None = None,
    columns: int = 16,
    writers: dict[str, dict[int, str | None]] | None = None,
    title: str = "KV page pools: colour = tenant that last wrote the page",
    now: float | None = None,
) -> go.Figure:
    """A grid per role. Pages in `read[role]` (e.g. the pages one answer read) are outlined in black;
    a page whose last writer is not its current owner (stale, not zeroed) is marked with a dot.
    `writers[role][page]` colours a page by another writer than the snapshot's (e.g. who had
    written it when the selected answer read it). The figure always has the same traces for the
    same roles and tenants, so a live view can update it in place."""
    now = time.time() if now is None else now
    read = read or {}
    writers = writers or {}
    tenants = sorted(
        {p["last_writer_tenant"] for snap in pools.values() for p in snap if p["last_writer_tenant"]}
    )
    colours = tenant_colours(tenants)
    fig = go.Figure()
    y0 = 0.0
    annotations = []
    for role, worker, snap in _panels(pools):
        name = worker or role
        # `read` / `writers` name a panel by role or by worker id (a role's only worker: either)
        keys = [name] if worker else [role, *sorted({p["worker"] for p in snap if p.get("worker")})]
        role_read = next((read[k] for k in keys if k in read), set())
        role_writers = next((writers[k] for k in keys if k in writers), {})
        rows = (len(snap) + columns - 1) // columns
        annotations.append(dict(x=-0.6, y=y0 + rows / 2 - 0.5, text=name, showarrow=False, xanchor="right"))
        xs, ys, colour, text, line = [], [], [], [], []
        for p in snap:
            x, y = p["page"] % columns, y0 + p["page"] // columns
            xs.append(x)
            ys.append(y)
            tenant = role_writers.get(p["page"], p["last_writer_tenant"])
            colour.append(colours.get(tenant, NEVER))
            outlined = p["page"] in role_read
            line.append(3 if outlined else 0.5)
            age = "" if p.get("written_at") is None else f", {max(0.0, now - p['written_at']):.1f} s ago"
            text.append(
                f"{name} page {p['page']}<br>owner: {p['owner'] or 'free'}<br>"
                f"last writer: {p['last_writer'] or 'never written'}{age}"
                + ("<br><b>stale: held by one request, written by another</b>" if _stale(p) else "")
                + ("<br><b>read by the selected answer</b>" if outlined else "")
            )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=name,
                showlegend=False,
                hovertext=text,
                hoverinfo="text",
                marker=dict(symbol="square", size=22, color=colour, line=dict(width=line, color="black")),
            )
        )
        stale = [(x, y) for x, y, p in zip(xs, ys, snap) if _stale(p)]
        fig.add_trace(  # always present (maybe empty): a live view updates traces in place
            go.Scatter(
                x=[s[0] for s in stale],
                y=[s[1] for s in stale],
                mode="markers",
                name=f"{name} stale",
                showlegend=False,
                hoverinfo="skip",
                marker=dict(symbol="circle", size=6, color="white"),
            )
        )
        y0 += rows + 1
    for t in tenants:  # legend entries
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=t,
                marker=dict(symbol="square", size=12, color=colours[t]),
            )
        )
    fig.update_layout(
        title=title,
        annotations=annotations,
        height=60 + 28 * y0,
        width=720,
        plot_bgcolor="white",
        xaxis=dict(visible=False),
        yaxis=dict(visible=False, autorange="reversed"),
        margin=dict(l=80, r=20, t=50, b=20),
    )
    return fig


def _panels(pools: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str | None, list[dict[str, Any]]]]:
    """(role, worker or None, pages): one panel per role, or per worker where a role has several.
    `read` and `writers` are keyed by the panel's name (the role, or the worker id)."""
    out: list[tuple[str, str | None, list[dict[str, Any]]]] = []
    for role, snap in pools.items():
        by_worker: dict[str | None, list[dict[str, Any]]] = {}
        for p in snap:
            by_worker.setdefault(p.get("worker"), []).append(p)
        if len(by_worker) <= 1:
            out.append((role, None, snap))
        else:
            out += [(role, w, pages) for w, pages in by_worker.items()]
    return out


def _stale(page: dict[str, Any]) -> bool:
    """Held by a request, but last written by another one (its old K/V was never zeroed)."""
    return bool(page["stale"]) and page["owner"] is not None
