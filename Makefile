# meshtrain developer entry points.  Every install step the project needs is
# here or in scripts/bootstrap.sh, so a fresh machine gets the same setup as CI.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CRD    := manifests/crd/trainingjobs.meshtrain.io.yaml
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock | sha1sum | cut -c1-12)

.PHONY: help venv lock verify crd bootstrap images run run-local test test-unit test-torch-oldest test-e2e test-nvidia-crd test-gang-backends benchmarks bench-overlap bench-faults bench-churn bench-headtohead clean \
        chart-docs chart-sync chart-package release manifests lint-chart sandbox-up sandbox-down sandbox-status

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)  ## create .venv with the locked dependencies and meshtrain (idempotent)

lock: venv  ## re-resolve requirements.lock (CUDA 13) and requirements-cu12.lock (CUDA 12, torch 2.10) from pyproject.toml (one pin of every dependency each)
	$(BIN)/uv pip compile pyproject.toml --all-extras --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 -o requirements.lock -q
	@# the CUDA 13 pins are the preferences: the CUDA 12 lock differs only where torch 2.10 needs it
	cp requirements.lock requirements-cu12.lock
	$(BIN)/uv pip compile pyproject.toml --all-extras -c requirements-cu12.in --python-version 3.11 \
	  --python-platform x86_64-manylinux_2_28 -o requirements-cu12.lock -q

verify: venv  ## static checks CI runs before the tests: ruff lint + format, mypy, import contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	@$(BIN)/python -m meshtrain.api.crd | diff -u $(CRD) - \
	  || { echo "$(CRD) is not what the model generates: run make crd"; exit 1; }
	@scripts/chart-sync.sh --check || { echo "the chart's copies differ: run make chart-sync"; exit 1; }
	@$(BIN)/python scripts/chart-docs.py --check

bootstrap:  ## build/locate the control plane, kubelet, containerd, CoreDNS, helm, the registry; apt: prometheus, runc, CNI, buildah (cached)
	scripts/bootstrap.sh

images: bootstrap  ## build the pause, operator and trainer images with buildah (cached; the sandbox does this too)
	scripts/images.sh

run: venv bootstrap  ## the main job: sandbox up, kubectl apply the example TrainingJob, follow it to Succeeded
	$(BIN)/python -m meshtrain.sandbox run-example

run-local: venv  ## train the example TrainingJob with `meshtrain run` (no cluster)
	$(BIN)/meshtrain run manifests/examples/tiny-cpu.yaml

sandbox-up: venv bootstrap  ## start the local sandbox (control plane, kubelet node, images, operator via helm, Prometheus)
	$(BIN)/python -m meshtrain.sandbox up

sandbox-down: venv  ## stop the sandbox and every process it started
	$(BIN)/python -m meshtrain.sandbox down

sandbox-status: venv  ## what the sandbox is running
	$(BIN)/python -m meshtrain.sandbox status

test: venv  ## every test but the sandbox's (unit, trainer, integration, telemetry); CI runs this
	scripts/bootstrap.sh --no-node
	$(BIN)/pytest -m "not e2e and not alone and not nvidia_crd and not gang_backends and not gpu_rehearsal" -n 2 --dist loadfile --durations=30  # each file whole on one worker: docs/development.md, "Suite time"
	$(BIN)/pytest -m "alone and not e2e" --durations=5  # wall-time comparisons, with the machine to themselves

test-gang-backends: venv  ## the gang backends against real schedulers: scheduler-plugins' Coscheduling as a second scheduler vs none (needs the full bootstrap's build_scheduler_plugins)
	$(BIN)/pytest -m gang_backends tests/integration/operator/test_operator_gang_backends.py

test-gpu-check: venv  ## rehearse benchmarks/gpu_check.sh's every suite on the CPU (about 7 min); run it before spending a lent device's minutes
	$(BIN)/pytest -m gpu_rehearsal tests/trainer/test_gpu_check.py

test-unit: venv  ## only the pure unit tests (no processes, no binaries)
	$(BIN)/pytest tests/unit

test-torch-oldest:  ## the trainer subset of scripts/test-torch-oldest.sh on the oldest supported torch (its own ~7 GB venv under ~/.cache/meshtrain)
	scripts/test-torch-oldest.sh

test-e2e: venv bootstrap  ## the sandbox tests: real kubelet nodes, images and chart pushed to its registry and pulled from it, docs/install.md run (not in CI: see README)
	$(BIN)/pytest -m e2e tests/e2e tests/telemetry

test-nvidia-crd: venv bootstrap  ## the operator's ComputeDomains against NVIDIA's real CRD, which the full bootstrap fetches from its Go module (not in CI: see docs/operator.md, "GPUs through DRA")
	$(BIN)/pytest -m nvidia_crd tests/integration/operator

chart-docs: venv  ## regenerate the values table of charts/meshtrain/README.md from values.yaml's comments
	$(BIN)/python scripts/chart-docs.py

chart-sync:  ## copy the CRD, dashboards and rules into the chart (make verify checks the copies)
	scripts/chart-sync.sh

crd: venv  ## regenerate the TrainingJob CRD from the spec model and rules, and its chart copy
	$(BIN)/python -m meshtrain.api.crd > $(CRD)
	scripts/chart-sync.sh

manifests: bootstrap  ## regenerate manifests/rbac and manifests/operator from the chart
	scripts/render-manifests.sh

chart-package: bootstrap  ## helm package the chart into dist/meshtrain-VERSION.tgz (VERSION = meshtrain.api.release.VERSION)
	scripts/chart-package.sh dist

release:  ## build, tag (meshtrain.api.release.VERSION) and push both images and the chart: make release REGISTRY=ghcr.io/meshtrain [PLAIN_HTTP=1]
	@test -n "$(REGISTRY)" || { echo "make release needs REGISTRY=registry[:port]/path, e.g. REGISTRY=ghcr.io/meshtrain"; exit 2; }
	scripts/release.sh "$(REGISTRY)" $(if $(PLAIN_HTTP),--plain-http)

lint-chart: bootstrap  ## helm lint --strict the chart
	"$$(scripts/bootstrap.sh --print-bin-dir)/helm" lint --strict charts/meshtrain

benchmarks: venv  ## run every benchmark; results go to benchmarks/results/
	$(BIN)/python -m benchmarks

bench-overlap: venv  ## communication overlap before/after (tp2, dp2 ZeRO-1/2, pp2) and ZeRO-2 vs ZeRO-1 peak memory, one run (BENCH_ARGS=...)
	$(BIN)/python benchmarks/bench_overlap.py $(BENCH_ARGS)

bench-faults: venv bootstrap  ## the sandbox fault benchmark, gang rebuild vs in-place side by side (root; e2e tier, not in `make benchmarks`; BENCH_ARGS=...)
	$(BIN)/python benchmarks/bench_faults.py $(BENCH_ARGS)

bench-churn: venv bootstrap  ## the operator under a trace's churn on a KWOK fleet, results/churn-<host>.json (never CI; ~30 min; BENCH_ARGS=...)
	$(BIN)/python -m benchmarks.fleet.churn $(BENCH_ARGS)

bench-headtohead: venv bootstrap  ## meshtrain vs Kueue TAS, the same trace on the same KWOK fleet, results/headtohead-<host>.json (never CI; ~25 min; BENCH_ARGS=...)
	$(BIN)/python -m benchmarks.fleet.headtohead $(BENCH_ARGS)

clean:  ## remove build outputs (keeps .venv and the binary cache)
	rm -rf build dist *.egg-info runs .pytest_cache
