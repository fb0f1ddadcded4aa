# Every target creates the virtual environment it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
EXTRAS ?= cpu,test,bench
SRC := mlx_lm_patched tools tests

.PHONY: venv demo test acceptance lint format bench patches check-patches vendor \
	upstream-test check-upstream fuzz soak

ifeq ($(origin VENV),command line)
# A virtual environment named on the command line (CI's, or another
# checkout's) is used as it is, made only if missing: reinstalling it would
# point its editable install at this checkout.
venv:
	@test -x $(PYTHON) || $(MAKE) --no-print-directory $(VENV)/.installed
else
venv: $(VENV)/.installed
endif

$(VENV)/.installed: pyproject.toml
	@echo "Creating $(VENV) and installing mlx-lm-patched[$(EXTRAS)] (a minute or two)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install --progress-bar on -e ".[$(EXTRAS)]"
	touch $@

demo: venv
	$(PYTHON) -m mlx_lm_patched.demo

test: venv
	$(PYTHON) -m pytest -q -m "not acceptance"

# The command-line fronts, the server, batch_generate and 2 ranks end to end
# (tests/acceptance, about 4 CPU-minutes).
acceptance: venv
	$(PYTHON) -m pytest -q -rxX -m acceptance tests/acceptance

# Formatting as upstream's, and every name a runtime module uses resolving
# statically (pyflakes).
lint: venv
	$(BIN)/black --check $(SRC)
	$(BIN)/isort --check-only $(SRC)
	$(PYTHON) -m pyflakes mlx_lm_patched

format: venv
	$(BIN)/isort $(SRC)
	$(BIN)/black $(SRC)

bench: venv
	$(PYTHON) -m mlx_lm_patched.bench all

patches: venv
	$(PYTHON) -m tools patches

check-patches: venv
	$(PYTHON) -m tools check-patches

vendor: venv
	$(PYTHON) -m tools vendor $(if $(VERSION),--version $(VERSION))

upstream-test: venv
	$(PYTHON) -m tools test

check-upstream: venv
	$(PYTHON) -m tools check-release $(VERSION)

fuzz: venv
	MLX_LM_PATCHED_FUZZ_EXAMPLES=10000 $(PYTHON) -m pytest -q -m fuzz \
		--hypothesis-show-statistics

soak: venv
	$(PYTHON) -m mlx_lm_patched.bench soak
