# fastformer: set up, build, test and benchmark.
#   make bench        fresh machine: venv + torch + fastformer, then `python -m fastformer bench`
#   make test         fresh machine: venv + torch + fastformer, then the test suite
#   PYTHON=python3 make test   use an existing environment whose torch is already installed
PYTHON ?=
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
LATEST_TORCH ?= torch==2.15.0
DEV_DEPS := numpy pytest pytest-benchmark pytest-timeout pytest-xdist ruff matplotlib ninja setuptools wheel
PYTEST_ARGS ?=

ifeq ($(strip $(PYTHON)),)
PY := $(VENV)/bin/python
OWN_ENV := 1
else
PY := $(PYTHON)
OWN_ENV := 0
endif

.PHONY: install build test test-compat test-latest bench check info lint format clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(TORCH_SPEC) $(DEV_DEPS)

# Builds fastformer._C (ninja, incremental) and installs the package in editable mode.
install: $(if $(filter 1,$(OWN_ENV)),$(VENV)/bin/python)
	@$(PY) scripts/check_env.py
	$(PY) -m pip install --no-build-isolation --no-deps -e .

# Rebuild the extension in place after editing csrc/ (serialised: several shells may build).
build:
	flock /tmp/fastformer-build.lock $(PY) setup.py build_ext --inplace

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The same tests on the GPU machine's stack (torch 2.11 + triton 3.6) in .venv-compat (CI runs it).
test-compat:
	bash scripts/test_compat.sh $(PYTEST_ARGS)

# And on the newest torch and Triton on PyPI (torch 2.15 + triton 3.9: what `pip install torch`
# gives a user now) in .venv-latest. An empty constraint file lifts a pip configuration's cap on
# torch (the CI machine's caps it at 2.14.1, the release its mirror holds).
test-latest:
	PIP_CONSTRAINT=/dev/null COMPAT_TORCH=$(LATEST_TORCH) COMPAT_NUMPY=numpy \
	    COMPAT_VENV=.venv-latest COMPAT_DIR=build/latest \
	    bash scripts/test_compat.sh $(PYTEST_ARGS)

bench: install
	$(PY) -m fastformer bench

check: install
	$(PY) -m fastformer check --quick

info: install
	$(PY) -m fastformer info

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf build fastformer/_C*.so fastformer/_build_info.json *.egg-info
