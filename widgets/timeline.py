"""Request timelines and the transfer protocol as a sequence diagram, drawn from the trace only.

`request_spans` turns the two roles' state events into one row per request: queued, prefill,
transfer and decode spans, and the moment decode began (the first token's way out, the TTFT
the client sees, within a few milliseconds). `sequence_figure` draws one request's messages
between the roles, with the page counts that tell a real transfer from the incident's stub.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from widgets.pool_view import tenant_colours

Events = dict[str, list[dict[str, Any]]]  # role -> trace events, as Engine.trace() returns them

PHASES = {"queued": "#BDBDBD", "prefill": "#4C78A8", "transfer": "#F58518", "decode": "#54A24B"}


@dataclass
class RequestSpans:
    """When each phase of one request began and ended (epoch seconds), from the trace."""

    request: str
    tenant: str | None
    arrived: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    transfer_start: float | None = None
    decode_start: float | None = None
    finished: float | None = None
    outcome: str | None = None
    error: str | None = None
    prefill_pages_written: int = 0  # pages prefill wrote for it
    decode_pages_reserved: int = 0  # pages decode reserved for it
    kv_len_at_decode: int | None = None  # tokens decode believed it held when it began
    states: list[tuple[str, float, str]] = field(default_factory=list)  # (role, time, to)

    @property
    def ttft_s(self) -> float | None:
        """Arrival to decode's start: the first token leaves the engine then."""
        if self.arrived is None or self.decode_start is None:
            return None
        return self.decode_start - self.arrived

    def phases(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) for the phases the trace shows, in order."""
        points = [
            ("queued", self.arrived, self.prefill_start),
            ("prefill", self.prefill_start, self.prefill_end),
            ("transfer", self.prefill_end or self.transfer_start, self.decode_start),
            ("decode", self.decode_start, self.finished),
        ]
        return [(n, a, b) for n, a, b in points if a is not None and b is not None and b >= a]


def request_spans(trace: Events) -> dict[str, RequestSpans]:
    """One `RequestSpans` per request seen in the trace, in order of arrival."""
    spans: dict[str, RequestSpans] = {}
    for role, events in trace.items():
        for e in events:
            req = e.get("request")
            if req is None:
                continue
            s = spans.setdefault(req, RequestSpans(req, e.get("tenant")))
            t, kind, detail = e["time"], e["kind"], e.get("detail", {})
            if s.arrived is None or t < s.arrived:
                s.arrived = t
            if kind == "state":
                to = detail.get("to")
                s.states.append((role, t, to))
                if role == "prefill" and to == "prefilling":
                    s.prefill_start = t
                elif role == "prefill" and to == "transferring":
                    s.prefill_end = t
                elif role == "decode" and to == "transferring":
                    s.transfer_start = t
                elif role == "decode" and to == "decoding":
                    s.decode_start = t
                    s.kv_len_at_decode = detail.get("kv_len")
                elif to == "finished" and (role == "decode" or s.finished is None):
                    s.finished = t
                    s.outcome = detail.get("outcome") or s.outcome
                    s.error = detail.get("error") or s.error
            elif kind == "write" and role == "prefill":
                s.prefill_pages_written += len(e["pages"])
            elif kind == "reserve" and role == "decode":
                s.decode_pages_reserved += len(e["pages"])
    return dict(sorted(spans.items(), key=lambda kv: kv[1].arrived or 0.0))


def timeline_figure(trace: Events, title: str = "Requests: queued, prefill, transfer, decode") -> go.Figure:
    """One row per request; the diamond marks when decode began (the first token's way out)."""
    spans = list(request_spans(trace).values())
    t0 = min((s.arrived for s in spans if s.arrived is not None), default=0.0)
    fig = go.Figure()
    shown: set[str] = set()
    for s in spans:
        label = f"{s.request}"
        for phase, a, b in s.phases():
            fig.add_trace(
                go.Bar(
                    x=[max((b - a) * 1000, 0.5)],
                    base=[(a - t0) * 1000],
                    y=[label],
                    orientation="h",
                    name=phase,
                    legendgroup=phase,
                    showlegend=phase not in shown,
                    marker_color=PHASES[phase],
                    hovertext=f"{s.request} ({s.tenant}) {phase}: {(b - a) * 1000:.1f} ms",
                    hoverinfo="text",
                )
            )
            shown.add(phase)
        if s.decode_start is not None and s.ttft_s is not None:
            fig.add_trace(
                go.Scatter(
                    x=[(s.decode_start - t0) * 1000],
                    y=[label],
                    mode="markers",
                    marker=dict(symbol="diamond", size=9, color="black"),
                    name="first token",
                    legendgroup="ttft",
                    showlegend="ttft" not in shown,
                    hovertext=f"{s.request}: TTFT {s.ttft_s * 1000:.1f} ms",
                    hoverinfo="text",
                )
            )
            shown.add("ttft")
        if s.outcome in ("rejected", "aborted"):
            fig.add_annotation(
                x=((s.finished or t0) - t0) * 1000, y=label, text=s.outcome, showarrow=False, xanchor="left"
            )
    fig.update_layout(
        title=title,
        barmode="overlay",
        xaxis_title="ms since the first request arrived",
        yaxis=dict(autorange="reversed", type="category"),
        height=120 + 26 * max(1, len(spans)),
        width=760,
        plot_bgcolor="white",
        margin=dict(l=90, r=20, t=50, b=40),
    )
    return fig


@dataclass(frozen=True)
class Message:
    """One arrow of the sequence diagram: `sender` -> `receiver` at (sent, received)."""

    sender: str
    receiver: str
    sent: float
    received: float
    label: str


def protocol_messages(trace: Events, request: str) -> list[Message]:
    """The messages of `request`'s disaggregated protocol, inferred from both roles' events.

    Bootstrapped (prefill admitted it), KVBootstrap (decode's page ids), the KV page data, and
    the done message. Receive times are the receiver's next event that depends on the message.
    """

    def first(role: str, pred: Any) -> dict[str, Any] | None:
        return next((e for e in trace.get(role, []) if e.get("request") == request and pred(e)), None)

    def state(role: str, to: str) -> dict[str, Any] | None:
        return first(role, lambda e: e["kind"] == "state" and e["detail"].get("to") == to)

    out: list[Message] = []
    admitted = state("prefill", "waiting") or state("prefill", "prefilling")
    prealloc = state("decode", "prealloc")
    if admitted and prealloc:
        out.append(Message("prefill", "decode", admitted["time"], prealloc["time"], "Bootstrapped (room)"))
    reserve = first("decode", lambda e: e["kind"] == "reserve")
    sent_pages = state("decode", "transferring")
    pf_transfer = state("prefill", "transferring")
    if reserve and sent_pages and pf_transfer:
        n = len(reserve["pages"])
        received = max(pf_transfer["time"], sent_pages["time"])
        out.append(
            Message("decode", "prefill", sent_pages["time"], received, f"KVBootstrap: {n} decode pages")
        )
    data = first("decode", lambda e: e["kind"] == "write" and e["detail"].get("source") == "transfer")
    if data and pf_transfer:
        n = len(data["pages"])
        out.append(
            Message(
                "prefill", "decode", pf_transfer["time"], data["time"], f"KV data: {n} page{'s' * (n != 1)}"
            )
        )
    decoding = state("decode", "decoding")
    if decoding:
        sent = (data or pf_transfer or decoding)["time"]
        kv = decoding["detail"].get("kv_len")
        out.append(
            Message(
                "prefill", "decode", sent, decoding["time"], f"done: Success (decode attends {kv} tokens)"
            )
        )
    return out


def sequence_figure(trace: Events, request: str) -> go.Figure:
    """The transfer protocol of one request: roles as columns, time downwards, messages as arrows."""
    lanes = {"prefill": 0.0, "decode": 1.0}
    msgs = protocol_messages(trace, request)
    spans = request_spans(trace).get(request)
    t0 = spans.arrived if spans and spans.arrived is not None else 0.0
    fig = go.Figure()
    colour = tenant_colours([spans.tenant] if spans and spans.tenant else [])
    for role, x in lanes.items():
        times = [(e["time"] - t0) * 1000 for e in trace.get(role, []) if e.get("request") == request]
        end = max(times, default=1.0)
        fig.add_trace(
            go.Scatter(
                x=[x, x], y=[0, end * 1.05], mode="lines", line=dict(color="#999", width=1), showlegend=False
            )
        )
        evs = [e for e in trace.get(role, []) if e.get("request") == request and e["kind"] != "read"]
        fig.add_trace(
            go.Scatter(
                x=[x] * len(evs),
                y=[(e["time"] - t0) * 1000 for e in evs],
                mode="markers",
                marker=dict(size=7, color=colour.get(spans.tenant if spans else None, "#444")),
                hovertext=[_describe(e) for e in evs],
                hoverinfo="text",
                name=role,
                showlegend=False,
            )
        )
    for m in msgs:
        fig.add_annotation(
            x=lanes[m.receiver],
            y=(m.received - t0) * 1000,
            ax=lanes[m.sender],
            ay=(m.sent - t0) * 1000,
            xref="x",
            yref="y",
            axref="x",
            ayref="y",
            showarrow=True,
            arrowhead=2,
            arrowwidth=1.5,
            text="",
        )
        fig.add_annotation(
            x=0.5,
            y=((m.sent + m.received) / 2 - t0) * 1000,
            text=m.label,
            showarrow=False,
            bgcolor="white",
            font=dict(size=11),
        )
    fig.update_layout(
        title=f"Transfer protocol of {request}, drawn from the trace",
        xaxis=dict(tickvals=list(lanes.values()), ticktext=list(lanes), range=[-0.3, 1.3], side="top"),
        yaxis=dict(autorange="reversed", title="ms since arrival"),
        height=460,
        width=640,
        plot_bgcolor="white",
        margin=dict(l=60, r=20, t=70, b=20),
    )
    return fig


def _describe(e: dict[str, Any]) -> str:
    d = e.get("detail", {})
    if e["kind"] == "state":
        return f"{d.get('from')} -> {d.get('to')}"
    return f"{e['kind']} pages {list(e['pages'])[:8]}{' ...' if len(e['pages']) > 8 else ''}"
