# The two commands of the README:  `make lab`  and  `make test`.
# Both set up .venv first. torch==2.13.0 is installed before the package, from PyTorch's CPU
# wheel index as well as PyPI: on Linux, pip then takes the CPU build (2.13.0+cpu ranks above
# PyPI's 2.13.0, a CUDA build of several GB); elsewhere PyPI's wheel is CPU already. Where that
# index cannot be reached, pip says so and takes what PyPI or its local wheels hold. Triton has
# wheels for Linux with Python 3.11+ only: elsewhere it is skipped, and lab 12 and
# --attention triton say so in one line (everything else runs without it).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --no-input --disable-pip-version-check

.PHONY: setup lab test lint labs-check clean

setup: $(VENV)/.minigrid-setup

$(VENV)/.minigrid-setup: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install --extra-index-url $(TORCH_CPU_INDEX) torch==2.13.0
	$(PIP) install "triton==3.9.0; sys_platform == 'linux' and python_version >= '3.11'"  # its only wheels
	$(PIP) install -e '.[lab,dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (minigrid)"
	touch $@

lab: setup
	$(VENV)/bin/jupyter lab labs/ $(if $(filter 0,$(shell id -u)),--allow-root,)

test: setup
	$(PY) -m pytest

labs-check: setup  # every notebook headless, top to bottom, with its time and memory (labs/INSTRUCTOR.md)
	$(PY) bench/labs.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
