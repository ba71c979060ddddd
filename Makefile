# The two commands of the README: `make demo` and `make test`. Each sets up .venv
# itself on a fresh machine (Python 3.11, pip; torch 2.13.0 CPU comes from the
# machine's wheel cache or PyPI).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO := out/demo
# torchrec is installed without its dependencies: its metadata would pull the CUDA
# fbgemm-gpu wheel over fbgemm-gpu-cpu (see docs/architecture.md, "Installing").
TORCHREC := torchrec==1.8.0
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PYTHONDONTWRITEBYTECODE := 1

# `make pretrain` re-measures and re-trains the bundled CPU cost model. Profiling
# resumes: delete $(DATASET) to start from scratch. (The shipped model came from a
# run stopped at 10,315 compute samples, of which the 4,861 with a reference timing
# were used; see docs/architecture.md.)
DATASET ?= datasets/cpu
PRETRAIN_SAMPLES ?= 20000
COMM_SAMPLES ?= 240

.PHONY: setup tools demo test lint typecheck pytest pretrain clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TORCHREC)
	$(PY) -c "import torchrec, fbgemm_gpu, shardwise.planner" # the stack imports
	touch $(STAMP)

# helm v4 and kubectl for the chart checks (tests/test_chart_*.py) in .tools/bin
# (gitignored), and Debian's prometheus package (prometheus, promtool) for
# tests/test_observability.py. Idempotent: ~3 s + ~7 s (apt) the first time, 0.1 s after.
tools:
	bash scripts/install-tools.sh

demo: setup
	$(BIN)/shardwise tables generate --count 80 --seed 0 --out $(DEMO)/tables.yaml
	$(BIN)/shardwise plan $(DEMO)/tables.yaml --gpus 8 --gpu-memory 4GiB --compare --measure \
		--out $(DEMO)/plan.json --plot $(DEMO)/plan.png

pretrain: setup
	test -f $(DATASET)/pool.yaml || \
		$(BIN)/shardwise tables generate --count 300 --seed 7 --out $(DATASET)/pool.yaml
	$(BIN)/shardwise profile comm --world-size 2 --world-size 4 --world-size 8 \
		--samples $(COMM_SAMPLES) --seed 1 --out $(DATASET)/comm
	$(BIN)/shardwise profile compute --tables $(DATASET)/pool.yaml \
		--samples $(PRETRAIN_SAMPLES) --seed 1 --out $(DATASET)/compute
	$(BIN)/shardwise pretrain $(DATASET) --out planner/data/costmodel-cpu.pt \
		--plot docs/costmodel-scatter.png

lint: setup
	$(BIN)/ruff check planner profiler runtime operator src tests scripts benchmarks examples
	$(BIN)/ruff format --check planner profiler runtime operator src tests scripts benchmarks examples

typecheck: setup
	$(BIN)/mypy

pytest: setup tools
	$(BIN)/pytest

test: lint typecheck pytest

# The CPU image built from the Dockerfile without Docker, then smoke-tested inside: as
# root, buildah on a debootstrap'd Debian bookworm base (cached in ~/.cache/shardwise),
# apt-getting buildah and debootstrap if missing. CI runs it after `make test`; about
# 6 min cold on 2 cores (docs/install.md, "Building the image").
.PHONY: image
image:
	bash scripts/build-image.sh
	bash scripts/image-smoke.sh

clean:
	rm -rf $(VENV) out .tools .mypy_cache .ruff_cache .pytest_cache .hypothesis
