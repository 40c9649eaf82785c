"""The page-pool widget draws in a real browser: JupyterLab, headless, driven through Chromium.

Starts JupyterLab on 127.0.0.1 over a temporary copy of `labs/` (autosave must never write outputs
into the committed notebooks), opens `02_paged_kv_cache` in Debian's Chromium through Playwright
(`/usr/bin/chromium`, never a downloaded browser), runs every cell, and checks that the live
`PoolView` (a plotly `FigureWidget`, drawn by plotly's and anywidget's JupyterLab extensions) shows
one cell per page, coloured by `widgets.pool_view`'s tenant colours after the requests ran.

    MINIGRID_BROWSER_SCREENSHOT=docs/page-pool-browser.png pytest tests/test_browser.py

also writes the widget's screenshot there (the README's picture); otherwise it goes to tmp_path.
Without /usr/bin/chromium the test skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from minigrid_engine.handle import stop_process
from widgets.pool_view import NEVER, tenant_colours

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOK = "02_paged_kv_cache.ipynb"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_ALL_TIMEOUT_S = 180


def _missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: .ci/run installs Debian's chromium and the [dev] extra)")
    pytest.skip(reason)


def _rgb(hex_colour: str) -> str:
    """'#4C78A8' -> 'rgb(76, 120, 168)', as the browser reports an SVG fill."""
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def chromium() -> Any:
    """Playwright's `sync_playwright`, once Debian's Chromium and Playwright are both there."""
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is missing: `apt-get install chromium` (Debian) to run the browser test")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed: `pip install -e '.[dev]'`")
    return sync_playwright


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    log: Path


@pytest.fixture
def jupyterlab(tmp_path: Path) -> Iterator[Lab]:
    root = tmp_path / "labs"
    shutil.copytree(ROOT / "labs", root)  # a copy: autosave writes outputs here, not into labs/
    home = tmp_path / "jupyter"
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),  # no user settings
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
    }
    (home / "config" / "labconfig").mkdir(parents=True)
    (home / "config" / "labconfig" / "page_config.json").write_text(  # no "Jupyter news?" toast
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    tracker = home / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))  # every cell in the DOM, in order
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, as Galata drives it
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = tmp_path / "jupyterlab.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/status", params={"token": token}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer on {url} in 90 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        print(f"JupyterLab up in {time.monotonic() - deadline + 90:.1f} s")
        yield Lab(url, token, root, log)
    finally:
        stop_process(proc, 20)


# Runs in the page: the open notebook panel, through the app that --expose-app-in-browser gives.
KERNEL_READY = """async () => {
  const panel = window.jupyterapp.shell.currentWidget;
  await panel.context.ready;
  await panel.sessionContext.ready;
  return panel.sessionContext.session?.kernel?.status ?? null;
}"""
ALL_RAN = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  const kernel = panel.sessionContext.session?.kernel?.status;
  return kernel === 'idle' && cells.every(c => c.model.executionCount !== null)
    && !cells.some(c => c.promptNode?.textContent?.includes('*'));
}"""
ERRORS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const out = [];
  for (const c of panel.content.widgets) {
    if (c.model.type !== 'code') continue;
    for (let i = 0; i < c.model.outputs.length; i++) {
      const o = c.model.outputs.get(i).toJSON();
      if (o.output_type === 'error') out.push(o.ename + ': ' + o.evalue);
    }
  }
  return out;
}"""
LIVE_CELL = """() => {  // the cell whose output is a widget view and whose code makes the live view
  const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  const i = cells.findIndex(c => c.model.type === 'code' && c.model.sharedModel.source.includes('view.live()')
    && JSON.stringify(c.model.outputs.toJSON()).includes('application/vnd.jupyter.widget-view+json'));
  return i < 0 ? null : i;
}"""
STATIC_CELL = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  const i = cells.findIndex(c => c.model.type === 'code'
    && JSON.stringify(c.model.outputs.toJSON()).includes('application/vnd.plotly.v1+json'));
  return i < 0 ? null : i;
}"""
POINT_FILLS = """(plot) => Array.from(
  plot.querySelectorAll('.scatterlayer .trace')
).map(t => Array.from(t.querySelectorAll('path.point')).map(p => p.style.fill))"""


def test_the_page_pool_widget_draws_in_jupyterlab(chromium: Any, jupyterlab: Lab, tmp_path: Path) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout  # there: `chromium` checked

    nb = json.loads((jupyterlab.root / NOTEBOOK).read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    source = "".join(params["source"])
    assert "page_size = 16" in source and "pool_tokens = 256" in source, source
    pages = 256 // 16  # one demo pool of 16 pages: the widget's first trace has one point per page

    shot = Path(os.environ.get("MINIGRID_BROWSER_SCREENSHOT") or tmp_path / "page-pool-browser.png")
    with chromium() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # a fresh profile every run
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            t_open = time.monotonic()
            page.goto(f"{jupyterlab.url}/lab/tree/{NOTEBOOK}?token={jupyterlab.token}")
            page.wait_for_function(
                "() => window.jupyterapp?.shell?.currentWidget?.sessionContext", timeout=90_000
            )
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
            print(f"notebook open: {time.monotonic() - t_open:.1f} s")
            status = page.evaluate(KERNEL_READY)
            assert status is not None, f"no kernel started:\n{jupyterlab.log.read_text()[-3000:]}"
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                timeout=60_000,
            )
            t0 = time.monotonic()
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(ALL_RAN, timeout=RUN_ALL_TIMEOUT_S * 1000, polling=500)
            print(f"run all cells in the browser: {time.monotonic() - t0:.1f} s")
            assert page.evaluate(ERRORS) == [], "a cell raised in the browser's kernel"

            # The live view's cell: its output is the FigureWidget, drawn by plotly in the browser.
            index = page.evaluate(LIVE_CELL)
            assert index is not None, "no cell displays the live view's FigureWidget"
            cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
            cell.scroll_into_view_if_needed()
            plot = cell.locator(".jp-OutputArea-output .js-plotly-plot")
            try:
                plot.wait_for(timeout=30_000)
            except PlaywrightTimeout:
                shown = cell.locator(".jp-OutputArea").inner_text()
                pytest.fail(
                    "the FigureWidget did not draw (are the anywidget and jupyterlab-plotly extensions "
                    f"in `jupyter labextension list`?); its output shows {shown!r}"
                )
            fills = plot.evaluate(POINT_FILLS)
            assert fills and len(fills[0]) == pages, f"expected {pages} page cells, drew {fills}"

            # After the requests ran the widget was redrawn from Python: alice's and bob's pages
            # carry their colours (sorted tenants, as pool_view assigns them), the rest stay grey.
            colours = tenant_colours(["alice", "bob"])
            alice, bob, never = _rgb(colours["alice"]), _rgb(colours["bob"]), _rgb(NEVER)
            drawn = set(fills[0])
            assert alice in drawn and bob in drawn, f"tenant colours {alice}, {bob} not in {drawn}"
            assert drawn <= {alice, bob, never}, drawn
            assert len(fills[1]) > 0, "no stale page (carol's pages hold alice's K/V) is marked"
            legend = plot.locator(".legend").text_content() or ""
            assert "alice" in legend and "bob" in legend, legend

            # The static twin drawn right after `view.refresh()` (plotly's mimetype renderer, the
            # picture a saved notebook keeps) shows the same pages as the live widget.
            index = page.evaluate(STATIC_CELL)
            assert index is not None, "no cell displays a static plotly figure"
            static_cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
            static_cell.scroll_into_view_if_needed()
            static = static_cell.locator(".jp-OutputArea-output.jp-RenderedPlotly.js-plotly-plot")
            static.wait_for(timeout=30_000)
            assert static.evaluate(POINT_FILLS)[:2] == fills[:2]

            shot.parent.mkdir(parents=True, exist_ok=True)
            cell.scroll_into_view_if_needed()
            plot.scroll_into_view_if_needed()
            plot.screenshot(path=str(shot))
        finally:
            context.close()
    assert shot.stat().st_size > 5_000, f"{shot}: an empty screenshot"
