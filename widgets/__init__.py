"""ipywidgets and plotly views of the engine's trace (page grid, timeline, controls).

The engine never imports this package; these views read only the engine's trace and snapshots.
"""
