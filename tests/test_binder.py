"""Binder's files (repo2docker) install what `make setup` installs: the same pins, the lab extra.

Binder builds from `binder/` alone (files there win over the repository root), so its pins can
drift from the Makefile's without any local run noticing; these checks keep them equal.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _lines(path: Path) -> list[str]:
    """The file's lines without comments and blank lines."""
    stripped = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in stripped if line]


def binder_requirements() -> tuple[dict[str, Requirement], list[str]]:
    """Named requirements by canonical name, and the option lines (`--extra-index-url`, `-e`)."""
    named, options = {}, []
    for line in _lines(BINDER / "requirements.txt"):
        if line.startswith("-"):
            options.append(line)
        else:
            req = Requirement(line)
            named[canonicalize_name(req.name)] = req
    return named, options


def makefile_pins() -> dict[str, Version]:
    """`NAME==VERSION` on the Makefile's install lines (torch and triton, installed before the package)."""
    text = (ROOT / "Makefile").read_text()
    pin = r"\b([A-Za-z0-9_.-]+)==([0-9][^\s'\";]*)"  # NAME==VERSION, before any marker
    pins = {canonicalize_name(n): Version(v) for n, v in re.findall(pin, text)}
    assert {"torch", "triton"} <= set(pins), f"the Makefile pins {sorted(pins)}"
    return pins


def pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra if not r.startswith(project["name"])]
    return {canonicalize_name(r.name): r for r in reqs}


def pinned(req: Requirement) -> Version:
    (spec,) = req.specifier
    assert spec.operator == "==", f"binder/requirements.txt: pin {req} with =="
    return Version(spec.version)


def test_torch_and_triton_match_the_makefile() -> None:
    named, _ = binder_requirements()
    pins = makefile_pins()
    for name in ("torch", "triton"):
        assert name in named, f"binder/requirements.txt does not install {name}"
        v = pinned(named[name])
        assert Version(v.public) == pins[name], f"{name}: binder {v}, Makefile {pins[name]}"


def test_every_package_pinned_in_both_places_agrees() -> None:
    named, _ = binder_requirements()
    pins, project = makefile_pins(), pyproject_requirements()
    for name, req in named.items():
        v = pinned(req)
        if name in pins:
            assert Version(v.public) == pins[name], f"{name}: binder {v}, Makefile {pins[name]}"
        if name in project:  # pyproject keeps ranges; Binder's pin must fall inside them
            assert project[name].specifier.contains(v.public, prereleases=True), (
                f"{name}: binder pins {v}, pyproject.toml asks {project[name].specifier}"
            )


def test_torch_is_the_cpu_build() -> None:
    named, options = binder_requirements()
    assert pinned(named["torch"]).local == "cpu", "torch==X+cpu: PyPI's Linux torch is a CUDA build"
    assert f"--extra-index-url {CPU_INDEX}" in options, f"the CPU wheels come from {CPU_INDEX}"
    assert not any(o.startswith(("--index-url", "-i ")) for o in options), "JupyterLab comes from PyPI"


def test_binder_installs_the_package_with_the_lab_extra() -> None:
    _, options = binder_requirements()
    local = [o for o in options if o.startswith("-e ")]
    assert len(local) == 1, f"one editable install of the repository, found {local}"
    req = Requirement("minigrid" + local[0].removeprefix("-e .").strip())
    assert "lab" in req.extras, f"{local[0]}: the notebooks need the [lab] extra"
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    assert any(Requirement(r).name == "jupyterlab" for r in lab)


def test_runtime_is_python_311_and_the_package_admits_it() -> None:
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains("3.11"), requires


def test_the_readme_badge_opens_jupyterlab_on_labs() -> None:
    readme = (ROOT / "README.md").read_text()
    urls = re.findall(r"\(https://mybinder\.org/v2/gh/[^)\s]+\)", readme)
    assert urls, "no Binder launch badge in the README"
    for url in urls:
        assert url.strip("()").endswith("?urlpath=lab/tree/labs"), url
    assert (ROOT / "labs" / "01_welcome.ipynb").exists()
