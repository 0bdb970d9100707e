# dflash_lab: `make report` runs every notebook headless; `make test` runs the tests.
# Both start with `setup`, so each is one command on a fresh machine.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
include mk/vllm.mk  # .venv-vllm (vLLM's CPU build) and `make serve`

# Offline at run time; vLLM's grouping runs on the CPU.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_TARGET_DEVICE ?= cpu
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup browser lab report test bench clean

setup: $(STAMP) $(VLLM_STAMP) browser

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	touch $(STAMP)

# Debian's chromium for the browser tests; Playwright is pointed at it, no browser download.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Jupyter refuses to start as root without --allow-root: pass it for root only.
JUPYTER_ROOT_FLAG = $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(VENV)/bin/jupyter lab $(JUPYTER_ROOT_FLAG) notebooks/

report: setup
	$(PY) -m dflash_lab.tools.report --out reports notebooks

# Each chapter runs once: the browser test (tests/browser/) runs it in JupyterLab and checks its
# printouts against the committed ones by nbval's rules; `pytest --nbval notebooks/` still works alone.
test: setup
	$(PY) -m pytest -q --durations=30 tests

bench: setup
	$(PY) -m dflash_lab.tools.bench acceptance

clean:
	rm -rf reports test-output .pytest_cache
