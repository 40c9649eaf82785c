"""Pictures of a protocol model check: the pages along a counterexample, and the fix table.

Reads only what `minigrid_engine.protocol.check_protocol` returns.
"""

from __future__ import annotations

import plotly.graph_objects as go

from minigrid_engine.protocol import NONE, ModelCheckResult, Scenario
from widgets.pool_view import tenant_colours

SAFE, UNSAFE, REFUSED, CUT_SHORT = "#1B7F3B", "#B3261E", "#9E9E9E", "#E0A100"


def counterexample_figure(result: ModelCheckResult, scenario: Scenario) -> go.Figure:
    """One row per step of the shortest trace, one square per page of each role.

    Colour: the tenant that last wrote the page (grey: never written, or scrubbed); the letter: the
    request that owns it now (blank: free); a thick outline: owned by one tenant's request but last
    written by another tenant's, the stale page the decode is about to read.
    """
    if result.violation is None or result.violation_states is None:
        raise ValueError(f"{result.scenario} under fixes {result.fixes} has no counterexample to draw")
    reqs = scenario.requests
    colours = tenant_colours(sorted({r.tenant for r in reqs}))
    steps = [f"{i:2d}. {s.actor}: {s.action} {s.request or ''}" for i, s in enumerate(result.violation, 1)]
    cells: dict[tuple[str | None, bool], list[tuple[str, str, str, str]]] = {}
    for label, step, world in zip(steps, result.violation, result.violation_states, strict=True):
        for role, pages in (("prefill", world.ppages), ("decode", world.dpages)):
            for page, (owner, writer) in enumerate(pages):
                tenant = reqs[writer].tenant if writer != NONE else None
                stale = owner != NONE and writer != NONE and reqs[owner].tenant != reqs[writer].tenant
                hover = (
                    f"{role} page {page}<br>owner: {reqs[owner].name if owner != NONE else 'free'}"
                    f"<br>last written by: {reqs[writer].name if writer != NONE else 'nobody'}"
                    f"<br>{step.text}"
                )
                cells.setdefault((tenant, stale), []).append(
                    (
                        f"{role[0]}{page}",
                        label,
                        reqs[owner].name.split("-")[0] if owner != NONE else "",
                        hover,
                    )
                )
    fig = go.Figure()
    for (tenant, stale), pts in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in pts],
                y=[p[1] for p in pts],
                mode="markers+text",
                text=[p[2] for p in pts],
                textfont=dict(color="white", size=10),
                marker=dict(
                    symbol="square",
                    size=26,
                    color=colours.get(tenant, colours[None]),
                    line=dict(width=4 if stale else 0, color="black"),
                ),
                name=("stale: " if stale else "") + f"last written by {tenant or 'nobody'}",
                hovertext=[p[3] for p in pts],
                hoverinfo="text",
            )
        )
    fig.update_layout(
        title=f"The shortest counterexample ({len(steps)} steps): pages after each step "
        "(colour = last writer, letters = owner, outline = stale)",
        xaxis=dict(title="page (p = prefill pool, d = decode pool)", side="top"),
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=steps),
        width=860,
        height=140 + 28 * len(steps),
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.02),
    )
    return fig


def fix_table_figure(rows: dict[str, ModelCheckResult], title: str) -> go.Figure:
    """States explored per setting, coloured by the verdict."""
    names = list(rows)
    colour = {"leak": UNSAFE, "safe": SAFE, "no verdict": CUT_SHORT}
    colours = [REFUSED if r.refused_to_start else colour[r.observed] for r in (rows[n] for n in names)]
    fig = go.Figure(
        go.Bar(
            x=[rows[n].states_explored for n in names],
            y=names,
            orientation="h",
            marker_color=colours,
            text=[rows[n].verdict for n in names],
            textposition="outside",
            hovertext=[f"{rows[n].transitions} transitions" for n in names],
        )
    )
    fig.update_layout(
        title=title
        + " (green: isolation holds; red: a stale read; grey: refuses to start; amber: no verdict)",
        xaxis_title="states explored",
        yaxis=dict(autorange="reversed"),
        width=860,
        height=120 + 30 * len(names),
        plot_bgcolor="white",
        margin=dict(r=160),
    )
    return fig
