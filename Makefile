# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create ./.venv and install the project into it on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

MOONCAKE := $(VENV)/.mooncake
HF       := $(VENV)/.hf
TORCH    := $(VENV)/.torch
LINT     := $(VENV)/.lint

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml
	@echo "make: installing the project into $(VENV) (pip --quiet: a minute or two without output)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Mooncake's CPU transfer engine (+ libibverbs, unpacked into the venv without root)
# for the real-bytes KV pool tests; see scripts/install-mooncake.sh.
$(MOONCAKE): $(STAMP) scripts/install-mooncake.sh
	@echo "make: installing Mooncake's transfer engine into $(VENV) (scripts/install-mooncake.sh)"
	VENV=$(VENV) scripts/install-mooncake.sh
	touch $(MOONCAKE)

# real tokenizers (--tokenizer hf:<path>): the project's optional 'hf' extra
$(HF): $(STAMP)
	@echo "make: installing the hf extra (tokenizers) into $(VENV), quietly"
	$(BIN)/python -m pip install --quiet -e '.[hf]'
	touch $(HF)
# The torch engine's extra (PyTorch, safetensors, tokenizers, transformers); `make test` needs
# it, `make demo` (sim engine) does not. pip takes torch from PyPI (the CUDA build on Linux)
# unless told otherwise: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test
# takes the CPU build.
$(TORCH): $(STAMP)
	@echo "make: installing the torch extra into $(VENV), quietly: minutes (PyTorch 2.13.0; from PyPI on Linux the CUDA build, several GB, unless PIP_EXTRA_INDEX_URL names the CPU index: README, Engines)"
	$(BIN)/python -m pip install --quiet -e '.[test,torch]'
	touch $(TORCH)

# ruff and mypy (the project's 'lint' extra, pinned); configured in pyproject.toml
$(LINT): $(STAMP)
	@echo "make: installing the lint extra (ruff, mypy) into $(VENV), quietly"
	$(BIN)/python -m pip install --quiet -e '.[lint]'
	touch $(LINT)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/evolving-infra demo --out demo-out

# Two pytest-xdist workers, one per core of the 2-core CI box: the live lane (tests/e2e, tests/integration:
# clusters of real processes, one at a time) and the rest (unit, property, deploy, and the live files with no
# tight time bound that REST_LANE_LIVE_FILES lists to even the lanes, 19 now; at nice +5), as tests/conftest.py
# assigns them; the 25 slowest tests are listed at the end. A failed test of tests/e2e, tests/integration or tests/deploy
# is run once more (EI_LIVE_RERUNS=1): one that then passed is listed as RERUN in the short summary (-rR), a finding to fix.
test: $(STAMP) $(MOONCAKE) $(HF) $(TORCH)
	EI_REQUIRE_MOONCAKE=1 EI_LIVE_RERUNS=1 $(BIN)/python -m pytest -q -n 2 -rR --durations=25

# Static checks (CI runs them before the tests): ruff on all the Python (pyflakes, bugbear, ...),
# mypy on the packages (shared, services, evolving_infra); under a minute on 2 cores.
lint: $(LINT)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) demo-out demo-out-static demo-out-compare .pytest_cache .mypy_cache .ruff_cache
