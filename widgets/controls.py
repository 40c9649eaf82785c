"""Controls: pool size, fixes and tenants, and a button that restarts the engine behind them.

The logic is plain Python (`EngineControls.config()`, `restart()`), so papermill and the tests
drive it through the widgets' traitlets (`.value`, `apply.click()`); a frontend is only needed
to see it move. A restart stops the current engine and starts a new one with a progress bar.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from minigrid_engine.config import ServeConfig, incident_preset
from minigrid_engine.fixes import FIXES
from minigrid_engine.handle import Engine, EngineRefusedToStart

EXPECTED_START_S = 5.0  # a cold start on a 2-core laptop: three processes, torch imported twice


class EngineControls:
    """Sliders and toggles for the next engine; `apply` restarts it and calls every `on_ready`."""

    def __init__(
        self,
        base: ServeConfig | None = None,
        fixes: str = "none",
        start: Callable[..., Engine] = Engine.start,
    ) -> None:
        self.base = base or incident_preset()
        self._start = start
        self.engine: Engine | None = None
        self.error: str | None = None  # why the last restart did not start an engine
        self.on_ready: list[Callable[[Engine], None]] = []
        self.pool = W.IntSlider(
            value=self.base.prefill_pool_tokens,
            min=self.base.page_size,
            max=max(2048, 2 * self.base.context_length),
            step=self.base.page_size // 2 or 1,
            description="prefill pool",
            continuous_update=False,
            style={"description_width": "90px"},
            layout=W.Layout(width="480px"),
        )
        chosen = set(FIXES) if fixes == "all" else {f for f in fixes.split(",") if f in FIXES}
        self.fixes = W.SelectMultiple(
            options=list(FIXES),
            value=tuple(f for f in FIXES if f in chosen),
            description="fixes",
            rows=len(FIXES),
            style={"description_width": "90px"},
        )
        self.tenants = W.Text(
            value=",".join(f"{n}:{k}" for n, k in self.base.tenants.items()),
            description="tenants",
            style={"description_width": "90px"},
            layout=W.Layout(width="480px"),
        )
        self.apply = W.Button(description="restart engine", button_style="primary", icon="refresh")
        self.progress = W.FloatProgress(value=0, min=0, max=1, description="", layout=W.Layout(width="300px"))
        self.status = W.HTML("")
        self.apply.on_click(lambda _: self.restart())

    @property
    def box(self) -> W.VBox:
        return W.VBox([self.pool, self.fixes, self.tenants, W.HBox([self.apply, self.progress]), self.status])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)

    def config(self) -> ServeConfig:
        """The configuration the controls describe (raises ConfigError naming a bad value)."""
        from minigrid_engine.config import parse_tenants

        return self.base.with_(
            prefill_pool_tokens=int(self.pool.value),
            fixes=",".join(self.fixes.value) or "none",
            tenants=parse_tenants(self.tenants.value),
        )

    def restart(self) -> Engine | None:
        """Stop the current engine, start one with `config()`; the progress bar moves meanwhile."""
        try:
            cfg = self.config()
        except Exception as exc:  # a bad value in a box: say so, keep the running engine
            self.error = str(exc)
            self.status.value = f"<span style='color:#B00'>{exc}</span>"
            return self.engine
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
        self.apply.disabled = True
        self.status.value = f"starting: prefill pool {cfg.prefill_pool_tokens} tokens, fixes {cfg.fixes} ..."
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(self._run_start(cfg)), daemon=True)
        t0 = time.monotonic()
        worker.start()
        while worker.is_alive():
            worker.join(0.1)
            self.progress.value = min(0.95, (time.monotonic() - t0) / EXPECTED_START_S)
        self.apply.disabled = False
        self.error = box.get("error")
        if self.error is not None:
            self.progress.value = 0
            self.status.value = f"<span style='color:#B00'>the engine did not start: {box['error']}</span>"
            return None
        self.progress.value = 1
        self.engine = box["engine"]
        self.status.value = (
            f"ready in {time.monotonic() - t0:.1f} s: prefill pool {cfg.prefill_pool_tokens} tokens, "
            f"fixes {cfg.fixes}"
        )
        for callback in self.on_ready:
            callback(self.engine)
        return self.engine

    def _run_start(self, cfg: ServeConfig) -> dict[str, Any]:
        try:
            return {"engine": self._start(cfg)}
        except Exception as exc:  # shown in the status line, not as a traceback
            return {"error": reason(exc)}

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None


def reason(exc: BaseException) -> str:
    """The one line of an engine's failed start that says why (its refusal, else its last line)."""
    if isinstance(exc, EngineRefusedToStart):
        return exc.reason
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines or [type(exc).__name__])[-1]
