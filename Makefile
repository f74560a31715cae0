# The front door: each target is a one-liner over build.py or .ci/services.
# The tool and its test extras live in a virtual environment of their own in the checkout (PEP 668:
# the system Python stays as the distribution left it); `make setup` makes it. PYTHON=... picks another.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
BASE ?= v0.25.1
BASE_REPO ?=
IMAGE ?= vllm/vllm-openai:$(BASE)-m3patch
REGISTRY ?= 127.0.0.1:5000/ops
# make demo pushes to a place of its own, so that a second run never meets what the runbook's signed pushes left
# under REGISTRY (moving a tag off an image with a signed pass takes --replace).
DEMO_REGISTRY ?= 127.0.0.1:5000/demo
REPO_FLAG = $(if $(BASE_REPO),--base-repo $(BASE_REPO),)
# make image PLATFORM=all / make push PLATFORM=all: every platform of the base, pushed under one index
PLATFORM ?=
PLATFORM_FLAG = $(if $(PLATFORM),--platform $(PLATFORM),)
# make push ALLOW_GPU_UNVERIFIED=1: push an image smoke-tested on a host without GPUs
GPU_FLAG = $(if $(ALLOW_GPU_UNVERIFIED),--allow-gpu-unverified,)

# make image ARGS="--rebuild --builder assemble": more of the tool's own arguments, after those a target gives.
ARGS ?=
# make exits 2 for any failed recipe: the tool's own exit code (build.py --help lists them) is said in a line.
TOOL = tool_run() { "$$@" || { rc=$$?; echo "make: build.py exited $$rc (its exit codes: $(PYTHON) build.py --help)" >&2; exit $$rc; }; }; tool_run $(PYTHON) build.py

# Error hints then name the make variable where a flag has one (ALLOW_GPU_UNVERIFIED=1, PLATFORM=all), not the
# flag; other flags (--replace, --rebuild) are said as flags, and go in ARGS.
export VLLM_HOTFIX_VIA_MAKE := 1

.DEFAULT_GOAL := help
.PHONY: help setup tool services stop image render smoke push demo demo-platforms test unit lint bench bench-platforms bench-registry prune clean \
	clean-records
# The Docker 26.1 engine `.ci/services start-cdi-engine` runs beside the distribution's (it keeps platforms).
PLATFORM_ENGINE ?= unix:///run/vllm-hotfix-cdi/docker.sock
STANDIN_REGISTRY ?= 127.0.0.1:5000/vllm

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: ## Install the system packages, a Docker 26.1 engine under /opt and the tool into .venv (README lists them)
	.ci/services install
	.ci/services install-cdi-engine
	[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q -e '.[test]'

# Targets that run the tool say what to do when it is not installed, instead of "No such file".
tool:
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) is missing: run 'make setup' first (or pass PYTHON=...)" >&2; exit 1; }

services: ## Start a local Docker engine (and two more instances of it for the tests), a CDI-capable Docker 26.1 engine and a registry unless they answer
	.ci/services start-engine
	.ci/services start-second-engine
	.ci/services start-third-engine
	.ci/services start-cdi-engine
	.ci/services start-registry

stop: ## Stop the engine and registry that `make services` (or demo/test) started
	.ci/services stop

image: tool ## Build the patched image: make image BASE=v0.25.1 [BASE_REPO=...] [PLATFORM=all] [ARGS="--rebuild ..."]
	$(TOOL) image --definition $(BASE) $(REPO_FLAG) $(PLATFORM_FLAG) $(ARGS)

render: tool ## Print the Dockerfile `image` would build
	$(TOOL) render --definition $(BASE) $(REPO_FLAG) $(ARGS)

# make smoke MODEL=... REFERENCE=... SIGN_KEY=...: the site's model folder, reference answers and signing key for the
# definition's [smoke] table (images/<definition>.toml), which holds the rest of the runbook's settings.
MODEL ?=
REFERENCE ?=
SIGN_KEY ?=
SMOKE_FLAGS = $(if $(MODEL),--serve-model $(MODEL),) $(if $(REFERENCE),--reference $(REFERENCE),) \
	$(if $(SIGN_KEY),--sign-key $(SIGN_KEY),)
smoke: tool ## Smoke-test an image as its definition's [smoke] table says: make smoke IMAGE=... [MODEL=... REFERENCE=... SIGN_KEY=...]
	$(TOOL) smoke $(IMAGE) $(SMOKE_FLAGS) $(ARGS)

push: tool ## Push a smoke-tested image: make push IMAGE=... REGISTRY=host:port/path [ALLOW_GPU_UNVERIFIED=1] [PLATFORM=all]
	$(TOOL) push $(IMAGE) --registry $(REGISTRY) $(GPU_FLAG) $(PLATFORM_FLAG) $(ARGS)

demo: setup ## End to end on a local engine: stand-in base, build, smoke, push to a local registry's demo/ (README)
	@echo "==> demo: starts a Docker engine and a registry on 127.0.0.1:5000 unless they answer, downloads the"
	@echo "    vLLM $(BASE) wheel (about 250 MB, once, into build/cache) and a Debian root file system (about 13 MB)"
	@echo "    for the stand-in base, then builds and pushes"
	.ci/services start-engine
	.ci/services start-registry
	$(PYTHON) build.py standin --version $(patsubst v%,%,$(BASE))
	$(PYTHON) build.py image --definition $(BASE)
	$(PYTHON) build.py push vllm/vllm-openai:$(BASE)-m3patch --registry $(DEMO_REGISTRY) --allow-gpu-unverified

demo-platforms: setup services ## Like demo, for linux/amd64 + linux/arm64 from a stand-in index, on a Docker 26.1 engine
	.ci/services install-cdi-engine
	.ci/services start-cdi-engine
	DOCKER_HOST=$(PLATFORM_ENGINE) $(PYTHON) build.py standin --version $(patsubst v%,%,$(BASE)) \
		--platform linux/amd64,linux/arm64 --publish $(STANDIN_REGISTRY)
	DOCKER_HOST=$(PLATFORM_ENGINE) $(PYTHON) build.py image --definition $(BASE) --base-repo $(STANDIN_REGISTRY)/vllm-openai \
		--tag vllm/vllm-openai:$(BASE)-m3patch
	DOCKER_HOST=$(PLATFORM_ENGINE) $(PYTHON) build.py push vllm/vllm-openai:$(BASE)-m3patch --platform all \
		--registry $(REGISTRY) --allow-gpu-unverified

# make test WORKERS=N: pytest workers; each engine's lane runs on one of them. Three suit two cores (four were
# slower there: the cores, not the lanes, set the time); a machine with more cores may take more.
WORKERS ?= 3
test: setup services ## Run every tier against real engines and registries: lanes of one engine each over WORKERS workers
	$(PYTHON) -m pytest -v -n $(WORKERS) --dist loadgroup --durations=15 tests

# make unit keeps Python's bytecode caches (__pycache__, ignored by git) where a shell's PYTHONDONTWRITEBYTECODE
# turns them off: each worker imports every module and rewrites every test's asserts, which without them is
# compiled again at every run, a fifth of the tier's CPU on two cores.
unit: tool ## Run the unit tier (tests/unit): no engine, no registry, no network; seconds
	PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -q -n 3 tests/unit

lint: tool ## ruff and mypy
	$(PYTHON) -m ruff check vllm_hotfix tests bench build.py
	$(PYTHON) -m mypy vllm_hotfix

bench: tool ## Benchmarks: the tool against the manual flow and the floor
	$(PYTHON) bench/run.py

prune: tool ## Remove what builds, rollbacks, stand-ins, tests and the services left (README); then make stop
	-$(TOOL) prune
	.ci/services prune

clean: ## Remove caches (keeps build/records, which push, list and rollback rely on; not images)
	rm -rf build/cache build/runs .pytest_cache .mypy_cache .ruff_cache

clean-records: ## Delete the journal of builds, verdicts and pushes (asks first)
	@printf 'delete build/records (every build, verdict and push the tool knows)? [y/N] '; read a; [ "$$a" = y ] && rm -rf build/records || echo kept

bench-platforms: tool ## Wall time of image + push, one platform vs two, on stand-ins (needs a 26.1 engine + qemu)
	$(PYTHON) bench/platforms.py

bench-registry: tool ## image --in-registry vs docker pull of the base, and bytes read, on 1 and 4 GiB stand-ins
	$(PYTHON) bench/registry.py
