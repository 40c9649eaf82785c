"""Run every lab notebook headless, top to bottom, the way CI and an instructor before class do.

    python bench/labs.py            # all of labs/, reference answers on; writes bench/results/labs-cpu.json
    python bench/labs.py --only 05 --out-dir /tmp/labs   # one notebook
    python bench/labs.py --student             # as students get them (exercises unanswered); writes no JSON

Prints each notebook's time, the peak memory of the notebook kernel plus the engine processes it
started (summed PSS of every process below this one, sampled every 0.2 s) and each exercise
checker's verdict, then the totals; the JSON records the same, verdicts included.
Executed notebooks go to --out-dir; their widget state is not stored (plotly's FigureWidget would
add its 4-5 MB JavaScript bundle to every saved notebook).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import papermill as pm
import psutil

LABS = Path(__file__).resolve().parents[1] / "labs"


@dataclass
class LabRun:
    notebook: str
    seconds: float
    peak_mib: float
    result: dict[str, Any]


class PeakMemory:
    """Peak of the summed memory of this process's descendants (kernel and engine processes)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.peak_bytes = interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        for p in psutil.Process().children(recursive=True):
            try:
                info = p.memory_full_info()
                total += getattr(info, "pss", info.rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_lab(notebook: Path, out_dir: Path, **parameters: Any) -> LabRun:
    """Execute one notebook with papermill; its result file (the `result_path` parameter) is read back."""
    out_dir = out_dir.resolve()  # the notebook runs in labs/: a relative path would land there
    out_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / f"{notebook.stem}.json"
    result_file.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        pm.execute_notebook(
            str(notebook),
            str(out_dir / notebook.name),
            parameters={**parameters, "result_path": str(result_file)},
            kernel_name="python3",
            progress_bar=False,
            start_timeout=180,
            cwd=str(notebook.parent),
            store_widget_state=False,
        )
    seconds = time.perf_counter() - t0
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return LabRun(notebook.name, round(seconds, 1), round(mem.peak_bytes / 2**20, 1), result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None, help="notebook number prefixes, e.g. 01 05")
    p.add_argument("--student", action="store_true", help="leave the exercises unanswered")
    p.add_argument("--out-dir", type=Path, default=Path("runs") / "labs")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "labs-cpu.json")
    a = p.parse_args(argv)
    notebooks = sorted(LABS.glob("[0-9][0-9]_*.ipynb"))
    if a.only:
        notebooks = [n for n in notebooks if n.name[:2] in a.only]
    if not notebooks:
        print(f"no notebook matches {a.only} in {LABS}", file=sys.stderr)
        return 2
    from tqdm.auto import tqdm

    runs = []
    for nb in tqdm(notebooks, desc="labs", unit="notebook"):
        run = run_lab(nb, a.out_dir, reveal_solutions=not a.student)
        failed = [k for k, ok in run.result.get("verdicts", {}).items() if not ok]
        runs.append(run)
        tqdm.write(
            f"{run.notebook:34s} {run.seconds:6.1f} s  peak {run.peak_mib:7.1f} MiB  "
            f"exercises {'all correct' if not failed else 'not yet: ' + ', '.join(failed)}"
        )
    total = sum(r.seconds for r in runs)
    peak = max(r.peak_mib for r in runs)
    print(f"series: {len(runs)} notebooks in {total:.0f} s ({total / 60:.1f} min); peak {peak:.0f} MiB")
    verdicts = [(r.notebook, k, ok) for r in runs for k, ok in r.result.get("verdicts", {}).items()]
    rejected = [f"{nb}: {k}" for nb, k, ok in verdicts if not ok]
    unchecked = [r.notebook for r in runs if not r.result.get("verdicts")]
    accepted = not rejected and not unchecked
    if not a.student:
        print(
            "every checker accepted its reference answer"
            if accepted
            else f"reference answers rejected: {rejected}; notebooks with no verdict: {unchecked}"
        )
    if not a.only and not a.student:  # the record is of the reference answers, the whole series
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "benchmark": "every lab notebook headless under papermill, top to bottom",
                    "cpus": psutil.cpu_count(),
                    "total_seconds": round(total, 1),
                    "peak_mib": peak,
                    "reveal_solutions": True,
                    "every_checker_accepts_its_reference_answer": accepted,
                    "notebooks": [
                        {k: v for k, v in asdict(r).items() if k != "result"}
                        | {"verdicts": r.result.get("verdicts", {})}
                        for r in runs
                    ],
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {a.json}")
    return 0 if accepted or a.student else 1


if __name__ == "__main__":
    sys.exit(main())
