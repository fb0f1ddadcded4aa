# Every target creates the virtual environment it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
EXTRAS ?= cpu,test,bench
comma := ,
# What `make demo` needs: the platform's extra of EXTRAS, no test or bench tools.
RUNTIME := $(filter cpu cuda12 cuda13,$(subst $(comma), ,$(EXTRAS)))
SRC := mlx_lm_patched tools tests

.PHONY: venv demo-venv demo test acceptance acceptance-vendored lint format bench patches check-patches vendor \
	upstream-test check-upstream fuzz soak

ifeq ($(origin VENV),command line)
# A virtual environment named on the command line (CI's, or another
# checkout's) is used as it is, made only if missing: reinstalling it would
# point its editable install at this checkout.
venv:
	@test -x $(PYTHON) || $(MAKE) --no-print-directory $(VENV)/.installed
demo-venv:
	@test -x $(PYTHON) || $(MAKE) --no-print-directory $(VENV)/.runtime
else
venv: $(VENV)/.installed
demo-venv: $(VENV)/.runtime
endif

# Installs with uv where it can be had (on PATH, or put in the environment by
# pip: seconds, against pip's half minute), from uv's cache alone when it has
# every package, with pip otherwise.
uv = $$UV pip install --python $(PYTHON) -e ".$(if $(1),[$(1)])"
install = { UV=$$(command -v uv || { $(BIN)/pip install -q uv && echo $(BIN)/uv; }) \
	&& { $(uv) --offline 2>/dev/null || $(uv); }; } \
	|| { $(BIN)/pip install -q --upgrade pip \
	&& $(BIN)/pip install --progress-bar on -e ".$(if $(1),[$(1)])"; }

$(VENV)/.runtime: pyproject.toml
	@echo "Creating $(VENV) with mlx-lm-patched[$(RUNTIME)]"
	$(PY) -m venv $(VENV)
	@$(call install,$(RUNTIME))
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	@echo "Installing mlx-lm-patched[$(EXTRAS)] in $(VENV)"
	@$(call install,$(EXTRAS))
	touch $@

demo: demo-venv
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

# The acceptance matrix on the vendored wheel: mlx-lm itself patched, the
# patches not applied at import; what needs upstream beside it is skipped.
acceptance-vendored: venv
	rm -rf dist .vendored
	$(PYTHON) -m tools vendor
	$(PYTHON) -m pip install -q --no-deps --no-index --target .vendored dist/*.whl
	PYTHONPATH=$(CURDIR)/.vendored:$(CURDIR) MLX_LM_PATCHED_APPLY=0 \
		$(PYTHON) -m pytest -q -rxX -m acceptance tests/acceptance

upstream-test: venv
	$(PYTHON) -m tools test

check-upstream: venv
	$(PYTHON) -m tools check-release $(VERSION)

fuzz: venv
	MLX_LM_PATCHED_FUZZ_EXAMPLES=10000 $(PYTHON) -m pytest -q -m fuzz \
		--hypothesis-show-statistics

soak: venv
	$(PYTHON) -m mlx_lm_patched.bench soak
