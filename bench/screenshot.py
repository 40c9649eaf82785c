"""Make the README's picture of the page-ownership view from a real run of the incident.

    python bench/screenshot.py docs/page-pools.png      # needs Debian's chromium

Starts the faulty engine, runs the incident scenario, draws `widgets.pool_view.pool_figure`
with bob's pages outlined, writes it as a self-contained HTML page and has headless Chromium
take the screenshot (no browser download: `/usr/bin/chromium`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from minigrid_engine.handle import Engine
from minigrid_engine.scenario import run_incident
from widgets.pool_view import pool_figure


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, default=Path("docs/page-pools.png"), help="the PNG to write")
    out = p.parse_args(argv).out.resolve()
    with Engine.start(fixes="none") as eng:
        rep = run_incident(
            eng, context_length=1024, prefill_pool_tokens=665, attacker_len=1000, max_tokens=24, attempts=4
        )
        fig = pool_figure(
            eng.pools(),
            read={"decode": {p["page"] for p in rep.pages}},
            writers={"decode": {p["page"]: p["last_writer_tenant"] for p in rep.pages}},
            title=f"bob's answer {rep.reply.text[:32]!r}: the pages it read (outlined)",
        )
    print(rep.summary())
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "pools.html"
        page = fig.to_html(include_plotlyjs=True, full_html=True, config={"displayModeBar": False})
        html.write_text(page.replace("<body>", '<body style="margin:0;overflow:hidden">', 1))  # no scrollbar
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={tmp}/profile",
                f"--screenshot={out}",
                "--window-size=760,250",
                html.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
