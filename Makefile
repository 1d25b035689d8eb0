# meshtrain developer entry points.  Every install step the project needs is
# here or in scripts/bootstrap.sh, so a fresh machine gets the same setup as CI.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: help venv bootstrap run run-local test test-unit test-e2e benchmarks clean \
        chart-sync manifests lint-chart sandbox-up sandbox-down sandbox-status

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)  ## create .venv and install meshtrain with its test extras (idempotent)

bootstrap:  ## build/locate kube-apiserver, etcd, kubectl, helm and install prometheus (cached)
	scripts/bootstrap.sh

run: venv bootstrap  ## the main job: sandbox up, kubectl apply the example TrainingJob, follow it to Succeeded
	$(BIN)/python -m meshtrain.sandbox run-example

run-local: venv  ## train the example TrainingJob with `meshtrain run` (no cluster)
	$(BIN)/meshtrain run manifests/examples/tiny-cpu.yaml

sandbox-up: venv bootstrap  ## start the local sandbox (control plane, simulated GPU nodes, operator, Prometheus)
	$(BIN)/python -m meshtrain.sandbox up

sandbox-down: venv  ## stop the sandbox and every process it started
	$(BIN)/python -m meshtrain.sandbox down

sandbox-status: venv  ## what the sandbox is running
	$(BIN)/python -m meshtrain.sandbox status

test: venv bootstrap  ## the whole test suite (unit, integration, e2e)
	$(BIN)/pytest

test-unit: venv  ## only the pure unit tests (no processes, no binaries)
	$(BIN)/pytest tests/unit

test-e2e: venv bootstrap  ## only the sandbox end-to-end tests
	$(BIN)/pytest -m e2e tests/e2e

chart-sync:  ## copy the CRD, dashboards and rules into the chart (a test checks the copies)
	scripts/chart-sync.sh

manifests: bootstrap  ## regenerate manifests/rbac and manifests/operator from the chart
	scripts/render-manifests.sh

lint-chart: bootstrap  ## helm lint --strict the chart
	"$$(scripts/bootstrap.sh --print-bin-dir)/helm" lint --strict charts/meshtrain

benchmarks: venv  ## run every benchmark; results go to benchmarks/results/
	$(BIN)/python -m benchmarks

clean:  ## remove build outputs (keeps .venv and the binary cache)
	rm -rf build dist *.egg-info runs .pytest_cache
