"""The notebook handle: every setting reaches the engine, its failures are said in its own terms,
and nothing it started is left running, whatever stops it."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from minigrid_engine.config import corrected_preset
from minigrid_engine.errors import ConfigError, MinigridError
from minigrid_engine.handle import Engine, EngineNotReady, EngineUnreachable
from minigrid_engine.model import default_weights_path


def test_every_setting_reaches_the_engine(tmp_path: Path) -> None:
    weights = tmp_path / "copy.pt"
    shutil.copy(default_weights_path(), weights)
    tenants = {"team:red": "sk-red", "team,blue": "sk-blue"}  # the old flag syntax could not carry these
    cfg = corrected_preset(tenants=tenants, trace_maxlen=6, weights=str(weights))
    with Engine.start(cfg) as eng:
        assert f"decode model: 623,488 parameters from {weights}" in eng.config()["startup_log"]
        for tenant in tenants:
            assert eng.complete(tenant, "RED pin 7Q2M4K; " * 3, max_tokens=4).ok
        assert all(len(events) <= 6 for events in eng.trace().values())  # the bound was applied
    with pytest.raises(ConfigError, match="model weights not found at"):
        Engine.start(cfg.with_(weights=str(tmp_path / "none.pt")))


def test_fixes_may_be_a_list_of_names() -> None:
    with Engine.start(corrected_preset(), fixes=["owner-check", "kv-checksum"]) as eng:
        assert eng.config()["fixes"] == ["kv-checksum", "owner-check"]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


def test_a_start_that_times_out_leaves_no_engine_behind() -> None:
    before = children()
    with pytest.raises(EngineNotReady, match=r"not healthy after 0\.5 s"):
        Engine.start(timeout_s=0.5)
    time.sleep(0.5)
    assert children() - before == set()


def test_a_stopped_or_dead_engine_and_unsendable_values_are_named() -> None:
    eng = Engine.start(corrected_preset())
    with pytest.raises(MinigridError, match="cannot be sent as JSON"):
        eng.complete("alice", "hi", temperature=float("nan"))
    with pytest.raises(MinigridError, match="cannot be sent as JSON"):
        eng.complete("alice", b"hi")  # type: ignore[arg-type]
    eng.proc.kill()  # type: ignore[union-attr]
    eng.proc.wait()  # type: ignore[union-attr]
    with pytest.raises(EngineUnreachable, match="cannot reach the engine at"):
        eng.complete("alice", "hi")
    eng.stop()
    with pytest.raises(EngineUnreachable, match="this engine handle was stopped"):
        eng.complete("alice", "hi")
    with pytest.raises(ConfigError, match="holds the character 'é'"):
        Engine.connect(eng.url, "sk-é")


def test_interrupting_serve_while_its_workers_start_stops_them() -> None:
    """Ctrl-C or SIGTERM: the workers stop too, and the status is 128 + the signal (130, 143)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(
            [sys.executable, "-m", "minigrid_engine.cli", "serve", "--preset", "corrected", "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        router = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while len(router.children()) < 2 and time.monotonic() < deadline:  # both workers spawned
            time.sleep(0.05)
        workers = router.children()
        assert len(workers) == 2, proc.stderr
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig and "Traceback" not in err, err
        _, alive = psutil.wait_procs(workers, timeout=10)  # stop_workers: 5 s of grace
        assert not alive, f"{sig.name}: workers left running: {alive}"


def test_a_refusal_is_told_from_a_crash(tmp_path: Path) -> None:
    from minigrid_engine.config import incident_preset
    from minigrid_engine.handle import EngineRefusedToStart

    with pytest.raises(EngineRefusedToStart) as refused:
        Engine.start(incident_preset(), fixes="capacity-check")
    assert refused.value.reason.startswith("capacity-check: the prefill KV pool holds 665 tokens")
    broken = tmp_path / "weights.pt"
    broken.write_bytes(b"not a checkpoint")  # the worker crashes loading it: not a refusal
    with pytest.raises(EngineNotReady) as crashed:
        Engine.start(corrected_preset(weights=str(broken)))
    assert not isinstance(crashed.value, EngineRefusedToStart) and "during startup" in str(crashed.value)
