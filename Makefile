# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create ./.venv and install the project into it on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/evolving-infra demo --out demo-out

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-out .pytest_cache
