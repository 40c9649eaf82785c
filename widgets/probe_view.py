"""A picture of a `minigrid probe` run: every answer by prompt length and time to first token.

Reads only the `ProbeReport`. Leaked answers stand where the pool is too small for the prompt;
refused prompts lie on the floor, which is where an over-long prompt should be.
"""

from __future__ import annotations

import plotly.graph_objects as go

from minigrid_engine.probe import ProbeReport, ProbeShot

CLEAN, LEAKED, REFUSED, FAST = "#1B7F3B", "#B3261E", "#9E9E9E", "#E0A100"


def _kind(s: ProbeShot) -> str:
    if s.leaked:
        return "leaked: another account's canaries"
    if s.too_fast:
        return "too fast for its prompt"
    if s.status == 200:
        return "clean answer"
    return "refused or failed (no answer)"


def probe_figure(report: ProbeReport, pool_tokens: int | None = None) -> go.Figure:
    """One point per prompt: x its length in the server's tokens, y its time to first token.

    `pool_tokens`, when known (the audit gives it), draws the pool's edge: every leaked answer of
    the incident lies right of it.
    """
    colours = {
        "clean answer": CLEAN,
        "leaked: another account's canaries": LEAKED,
        "too fast for its prompt": FAST,
        "refused or failed (no answer)": REFUSED,
    }
    fig = go.Figure()
    for kind, colour in colours.items():
        shots = [s for s in report.shots if _kind(s) == kind]
        if not shots:
            continue
        fig.add_trace(
            go.Scatter(
                name=f"{kind} ({len(shots)})",
                x=[s.prompt_tokens or s.target_tokens for s in shots],
                y=[(s.ttft_s or 0) * 1000 for s in shots],
                mode="markers",
                marker={
                    "color": colour,
                    "size": 11,
                    "symbol": "x" if kind.startswith("refused") else "circle",
                    "line": {"width": 1, "color": "white"},
                },
                hovertext=[
                    f"round {s.round}, {s.tenant}: HTTP {s.status or 'none'} {s.code or ''}<br>"
                    + (f"held {', '.join(s.foreign)}'s canaries" if s.foreign else "no foreign canary")
                    for s in shots
                ],
                hoverinfo="text",
            )
        )
    edges = [("prefill pool", pool_tokens), ("context", report.context_length)]
    for label, x in edges:
        if x:
            fig.add_vline(x=x, line_dash="dash", line_color="#555", annotation_text=f"{label} {x:,}")
    fig.update_layout(
        title=f"minigrid probe: {len(report.leaks)} of {len(report.shots)} answers leaked",
        xaxis_title="prompt tokens (as the server counted them)",
        yaxis={"title": "time to first token (ms)", "rangemode": "tozero"},
        legend={"orientation": "h", "y": -0.25},
        height=420,
    )
    return fig
