"""What each fix costs, as `bench/fixes.py` measured it, read against the noise measured with it.

The fix notebooks (7, 8, 9) call `show_fix_costs(names)`: one line per fix with its throughput and
TTFT against `none`, then whether the difference is larger than the spread between rounds of one
configuration (the benchmark's own measure of its noise, `noise` in its JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXES_BENCH = Path(__file__).resolve().parents[1] / "bench" / "results" / "fixes-cpu.json"


@dataclass(frozen=True)
class FixCost:
    fixes: str
    throughput_vs_none: float
    ttft_vs_none: float
    past_noise: bool | None  # None: the benchmark ran one round, so it has no noise figure

    def describe(self) -> str:
        line = f"{self.fixes:24s} throughput x{self.throughput_vs_none:.2f}"
        line += f"   TTFT p50 x{self.ttft_vs_none:.2f}"
        if self.fixes == "none" or self.past_noise is None:
            return line
        return line + ("   past the noise" if self.past_noise else "   within the noise")


def load_fixes_bench(path: Path = FIXES_BENCH) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python bench/fixes.py` to measure the fixes")
    return json.loads(path.read_text())


def fix_costs(names: list[str], bench: dict[str, Any]) -> list[FixCost]:
    """`none` and each of `names`, in that order; a name the benchmark did not run is left out."""
    rows = {row["fixes"]: row for row in bench["table"]}
    noise = bench.get("noise") or {}
    out = []
    for name in ["none", *names]:
        row = rows.get(name)
        if row is None:
            continue
        thr, ttft = row["throughput_vs_none"], row["ttft_vs_none"]
        past = None
        if noise.get("throughput") is not None and noise.get("ttft_p50") is not None:
            past = (1 - thr) > noise["throughput"] or (ttft - 1) > noise["ttft_p50"]
        out.append(FixCost(name, thr, ttft, past))
    return out


def show_fix_costs(names: list[str], path: Path = FIXES_BENCH) -> list[FixCost]:
    """Print each fix's cost against `none` and against the noise; return the rows."""
    bench = load_fixes_bench(path)
    costs = fix_costs(names, bench)
    for c in costs:
        print(c.describe())
    noise = bench.get("noise") or {}
    how = f"bench/fixes.py, {bench['requests']} requests x {bench['rounds']} rounds"
    if noise.get("throughput") is None:
        print(f"({how}: one round, so no noise figure; rerun it with --rounds 3 or more)")
    else:
        print(
            f"({how}; noise, the spread between one configuration's rounds: "
            f"throughput {noise['throughput']:.0%}, TTFT {noise['ttft_p50']:.0%})"
        )
    return costs


@dataclass(frozen=True)
class ScrubCost:
    """What zeroing a freed token's K/V adds to its release, over the page sizes measured."""

    extra_us: tuple[float, float]  # microseconds per token, scrub minus a plain release
    times_plain: tuple[float, float]  # scrubbed release time / plain release time
    page_sizes: tuple[int, int]
    torch_threads: int | None

    def describe(self) -> str:
        (lo, hi), (rlo, rhi) = self.extra_us, self.times_plain
        where = f"a CPU with {self.torch_threads} torch threads" if self.torch_threads else "a CPU"
        return (
            f"zeroing one freed token's K/V: {lo:.3f}-{hi:.3f} µs more than a plain release, "
            f"{rlo:.0f}-{rhi:.0f}x its time (pages of {self.page_sizes[0]}-{self.page_sizes[1]} tokens; "
            f"bench/fixes.py on {where}, not measured in this run)"
        )


def scrub_cost(path: Path = FIXES_BENCH) -> ScrubCost:
    """The measured cost of `scrub-on-free`'s zeroing, from `bench/fixes.py`'s results."""
    bench = load_fixes_bench(path)
    rows = bench["scrub_by_page_size"]
    extra = [r["release_us_per_token_scrub"] - r["release_us_per_token_plain"] for r in rows]
    times = [r["scrub_over_plain"] for r in rows]
    sizes = [r["page_size"] for r in rows]
    return ScrubCost(_span(extra), _span(times), _span(sizes), bench.get("torch_threads"))


def _span(values: list[Any]) -> tuple[Any, Any]:
    return min(values), max(values)
