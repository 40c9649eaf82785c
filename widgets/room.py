"""The instructor's widgets for a workshop room: the fixes switch and the room's live page pool.

Both work over HTTP with the instructor's (admin) key, against the room's one engine
(`Engine.connect(url, instructor_key)`). Logic stays in plain methods (`FixesSwitch.switch`),
so papermill and the tests drive them through traitlets (`.value`, `apply.click()`).
"""

from __future__ import annotations

from typing import Any, Protocol

import ipywidgets as W

from minigrid_engine.errors import MinigridError
from minigrid_engine.fixes import BUILT, FIXES


class Switchable(Protocol):
    def config(self, tenant: str | None = None) -> dict[str, Any]: ...

    def set_fixes(self, fixes: str | list[str]) -> dict[str, Any]: ...


class FixesSwitch:
    """One checkbox per fix, ticked as the engine runs now, and a button that switches the room."""

    def __init__(self, engine: Switchable) -> None:
        self.engine = engine
        on = set(engine.config()["fixes"])
        self.boxes = {
            name: W.Checkbox(value=name in on, description=name, indent=False)
            for name in FIXES
            if name in BUILT
        }
        self.apply = W.Button(description="switch the room", button_style="warning")
        self.status = W.HTML(self._said(engine.config()["fixes"]))
        self.apply.on_click(lambda _: self.switch())

    @staticmethod
    def _said(names: list[str]) -> str:
        return f"<b>fixes now:</b> {', '.join(names) or 'none (the incident)'}"

    def chosen(self) -> list[str]:
        return [name for name, box in self.boxes.items() if box.value]

    def switch(self, fixes: str | list[str] | None = None) -> str:
        """Switch the room to `fixes` (default: the ticked boxes); returns what the status shows."""
        wanted = self.chosen() if fixes is None else fixes
        try:
            names = self.engine.set_fixes(wanted or "none")["fixes"]
        except MinigridError as exc:  # 409 for capacity-check on the small pool, said as it is
            self.status.value = f"<b>refused:</b> {exc}"
            return str(exc)
        for name, box in self.boxes.items():
            box.value = name in names
        self.status.value = self._said(names)
        return self.status.value

    def box(self) -> W.VBox:
        return W.VBox(
            [
                W.HBox(list(self.boxes.values())[:4]),
                W.HBox(list(self.boxes.values())[4:]),
                self.apply,
                self.status,
            ]
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box())
