# meshtrain developer entry points.  Every install step the project needs is
# here or in scripts/bootstrap.sh, so a fresh machine gets the same setup as CI.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: help venv bootstrap run test test-unit test-integration benchmarks clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)  ## create .venv and install meshtrain with its test extras (idempotent)

bootstrap:  ## build/locate kube-apiserver, etcd, kubectl, helm and install prometheus (cached)
	scripts/bootstrap.sh

run: venv  ## the main job: train the example TrainingJob end to end on this machine
	$(BIN)/meshtrain run manifests/examples/tiny-cpu.yaml

test: venv bootstrap  ## the whole test suite (unit, integration, e2e)
	$(BIN)/pytest

test-unit: venv  ## only the pure unit tests (no processes, no binaries)
	$(BIN)/pytest tests/unit

benchmarks: venv  ## run every benchmark; results go to benchmarks/results/
	$(BIN)/python -m benchmarks

clean:  ## remove build outputs (keeps .venv and the binary cache)
	rm -rf build dist *.egg-info runs .pytest_cache
