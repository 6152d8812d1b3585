# The two entry points of the README: `make lab` (main job) and `make test` (whole suite).
# Both set up everything themselves on a fresh machine with Python 3.10+ and pip.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch, installed first. Here torch==2.13.0 resolves to the CPU wheel on disk; elsewhere
# add TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build (PyPI's Linux
# wheel is the CUDA one), or TORCH_SPEC=torch for the newest release.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PORT   ?= 8888
STAMP  := $(VENV)/.nbdebug-installed

.PHONY: setup kernels lab test lint unit browser-deps bench clean

# The suite runs with the versions Binder installs: binder/requirements.txt's pins (torch's
# aside, which TORCH_SPEC sets) are pip constraints here, so a new upstream release changes
# nothing until the pins move (tests/test_binder.py checks both agree).
PINS   := $(VENV)/binder-pins.txt

$(STAMP): pyproject.toml binder/requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	grep -E '^[A-Za-z0-9_.-]+==' binder/requirements.txt | grep -v '^torch==' > $(PINS)
	$(PIP) install -q -c $(PINS) -e ".[dev,lightning,hf,kernels]"
	touch $(STAMP)

## the compiled statistics kernel traces use on CPU (README "Faster statistics on CPU"):
## built once per machine and torch version into ~/.cache/nbdebug (a later call returns
## at once); without a C++ compiler, traces keep the eager statistics (same numbers)
kernels: $(STAMP)
	@$(VENV)/bin/nbdebug build-kernels || echo "nbdebug: no compiled kernel (above); traces use eager statistics" >&2

setup: $(STAMP) kernels

## main job: JupyterLab on notebooks/01_quickstart.ipynb, server root = the repository;
## prints the quickstart's URL (works headless); lessons are saved without outputs
## (jupyter_server_config.py)
lab: setup
	$(VENV)/bin/jupyter lab --config=jupyter_server_config.py --no-browser --ip=127.0.0.1 \
	  --port=$(PORT) $(if $(filter 0,$(shell id -u)),--allow-root)

## Debian's chromium for the browser test (Playwright drives it; no browser download)
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1; then \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; \
	  else echo "install chromium for the browser test" >&2; exit 1; fi; }

lint: setup
	$(VENV)/bin/ruff check nbdebug tests benchmarks docs
	$(VENV)/bin/ruff format --check nbdebug tests benchmarks docs
	$(VENV)/bin/mypy

unit: setup
	$(VENV)/bin/pytest -q

## whole suite: lint + type check + every test (incl. notebooks and the browser test)
test: setup browser-deps lint unit

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
