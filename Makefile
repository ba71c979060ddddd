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

# `make pretrain` re-measures and re-trains the bundled CPU cost model (docs/design.md
# §7), then prints its error on the held-out family it never trained on. Profiling
# resumes: delete $(DATASET) to start from scratch. The pool mixes the calibrated
# generator's tables (300, seed 7) and the broad family's (200, seed 11). Compute
# samples are numbered, and each band of batches owns a range of numbers (the
# *_SAMPLES are cumulative): a kernel reads batch × pooling × tables indices, so
# large batches pair with light tables, keeping that at most 2^21 (about 2 M):
#   - samples 0 .. SMALL_SAMPLES-1: batches 256-4096, any table, up to 15 tables;
#   - then up to MEDIUM_SAMPLES: batches 8192 and 16384, pooling <= 16, up to 8;
#   - then up to LARGE_SAMPLES: batches 32768 and 65536, pooling <= 4, up to 8;
#   - then up to MORE_SMALL_SAMPLES: small batches again (the first command's
#     settings; run in this order, or the first would take these numbers);
#   - then up to KIND_SAMPLES: ranks of the other kinds at batches 2048-16384, pooling
#     <= 16, up to 8 tables: 85% one rank of a row-wise cut (its range of every table,
#     the lookups that fall in it), 15% data-parallel copies beside fused tables, each
#     kernel recorded (pre-training learns one example per kernel).
# 30% of the samples are fp16. The held-out family (seed 2027) is measured the same
# way into $(HELDOUT). The shipped model: see docs/architecture.md.
DATASET ?= datasets/cpu
HELDOUT ?= datasets/heldout
BUNDLED ?= planner/data/costmodel-cpu.pt
NICE ?= nice -n 15
COMM_SAMPLES ?= 240
SMALL_SAMPLES ?= 800
MEDIUM_SAMPLES ?= 1050
LARGE_SAMPLES ?= 1200
MORE_SMALL_SAMPLES ?= 1800
KIND_SAMPLES ?= 2400
HELDOUT_SMALL ?= 200
HELDOUT_MEDIUM ?= 260
HELDOUT_LARGE ?= 320
HELDOUT_KIND ?= 400
PROFILE_COMPUTE = $(NICE) $(BIN)/shardwise profile compute --measure-on cpu --seed 1 \
	--fp16-share 0.3
SMALL_BATCHES = --global-batch 256 --global-batch 512 --global-batch 1024 \
	--global-batch 2048 --global-batch 4096 --max-tables 15
MEDIUM_BATCHES = --global-batch 8192 --global-batch 16384 --max-tables 8 --allow-mismatch
LARGE_BATCHES = --global-batch 32768 --global-batch 65536 --max-tables 8 --allow-mismatch
KIND_BATCHES = --global-batch 2048 --global-batch 4096 --global-batch 8192 \
	--global-batch 16384 --max-tables 8 --allow-mismatch --row-wise-share 0.85 \
	--data-parallel-share 0.15

.PHONY: setup tools demo test check scenarios lint typecheck pytest pretrain clean

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

# `make demo` calibrates the cost model to this machine on the example tables first
# (docs/calibration.md; a 90-second budget, stored in the model cache, which `plan`
# then picks), then plans them for 8 ranks of this machine (--target-device cpu, so it
# can measure and refine the plan here) at 1,024 samples per rank: a global batch of
# 8,192, at which the evaluator's spread over repeats is 3-6 % on 2 cores (at 128 per
# rank it was 18-57 %). NeuroShard's plan from the model alone, after measured
# refinement, and TorchRec's (offered every sharding kind, as users run it, and the
# table-wise/column-wise one beside it), measured side by side. The 40 tables (seed 5) hold no
# table that alone outweighs a rank's share, so the plans can differ. About 4.5
# minutes on 2 cores.
DEMO_TABLES ?= 40
DEMO_SEED ?= 5
DEMO_BATCH ?= 1024
DEMO_MEMORY ?= 2GiB
DEMO_MINUTES ?= 1.5
DEMO_GPUS ?= 8
demo: setup
	$(BIN)/shardwise tables generate --count $(DEMO_TABLES) --seed $(DEMO_SEED) \
		--out $(DEMO)/tables.yaml
	$(BIN)/shardwise calibrate --tables $(DEMO)/tables.yaml --gpus $(DEMO_GPUS) \
		--batch-per-rank $(DEMO_BATCH) --gpu-memory $(DEMO_MEMORY) --minutes $(DEMO_MINUTES)
	$(BIN)/shardwise plan $(DEMO)/tables.yaml --gpus $(DEMO_GPUS) --gpu-memory $(DEMO_MEMORY) \
		--batch-per-rank $(DEMO_BATCH) --target-device cpu --refine-budget 30 \
		--compare-with torchrec,torchrec-tw-cw --measure --repeats 4 \
		--out $(DEMO)/plan.json --plot $(DEMO)/plan.png

pretrain: setup
	mkdir -p $(DATASET) $(HELDOUT)
	test -f $(DATASET)/pool.yaml || \
		$(BIN)/shardwise tables generate --count 300 --seed 7 --out $(DATASET)/pool.yaml
	test -f $(DATASET)/broad.yaml || $(BIN)/shardwise tables generate --family broad \
		--count 200 --seed 11 --out $(DATASET)/broad.yaml
	test -f $(HELDOUT)/heldout.yaml || $(BIN)/shardwise tables generate --family heldout \
		--count 60 --seed 2027 --out $(HELDOUT)/heldout.yaml
	$(BIN)/shardwise tables merge $(DATASET)/pool.yaml $(DATASET)/broad.yaml \
		--out $(DATASET)/pool-all.yaml
	$(BIN)/shardwise tables merge $(DATASET)/pool-all.yaml --max-pooling 16 \
		--out $(DATASET)/pool-p16.yaml
	$(BIN)/shardwise tables merge $(DATASET)/pool-all.yaml --max-pooling 4 \
		--out $(DATASET)/pool-p4.yaml
	$(BIN)/shardwise tables merge $(HELDOUT)/heldout.yaml --max-pooling 16 \
		--out $(HELDOUT)/heldout-p16.yaml
	$(BIN)/shardwise tables merge $(HELDOUT)/heldout.yaml --max-pooling 4 \
		--out $(HELDOUT)/heldout-p4.yaml
	$(NICE) $(BIN)/shardwise profile comm --world-size 2 --world-size 4 --world-size 8 \
		--samples $(COMM_SAMPLES) --seed 1 --out $(DATASET)/comm
	$(PROFILE_COMPUTE) --out $(DATASET)/compute --tables $(DATASET)/pool-all.yaml \
		--samples $(SMALL_SAMPLES) $(SMALL_BATCHES)
	$(PROFILE_COMPUTE) --out $(DATASET)/compute --tables $(DATASET)/pool-p16.yaml \
		--samples $(MEDIUM_SAMPLES) $(MEDIUM_BATCHES)
	$(PROFILE_COMPUTE) --out $(DATASET)/compute --tables $(DATASET)/pool-p4.yaml \
		--samples $(LARGE_SAMPLES) $(LARGE_BATCHES)
	$(PROFILE_COMPUTE) --out $(DATASET)/compute --tables $(DATASET)/pool-all.yaml \
		--samples $(MORE_SMALL_SAMPLES) $(SMALL_BATCHES)
	$(PROFILE_COMPUTE) --out $(DATASET)/compute --tables $(DATASET)/pool-p16.yaml \
		--samples $(KIND_SAMPLES) $(KIND_BATCHES)
	$(BIN)/shardwise pretrain $(DATASET) --out $(BUNDLED) --plot docs/costmodel-scatter.png
	$(PROFILE_COMPUTE) --out $(HELDOUT)/compute --tables $(HELDOUT)/heldout.yaml \
		--samples $(HELDOUT_SMALL) $(SMALL_BATCHES)
	$(PROFILE_COMPUTE) --out $(HELDOUT)/compute --tables $(HELDOUT)/heldout-p16.yaml \
		--samples $(HELDOUT_MEDIUM) $(MEDIUM_BATCHES)
	$(PROFILE_COMPUTE) --out $(HELDOUT)/compute --tables $(HELDOUT)/heldout-p4.yaml \
		--samples $(HELDOUT_LARGE) $(LARGE_BATCHES)
	$(PROFILE_COMPUTE) --out $(HELDOUT)/compute --tables $(HELDOUT)/heldout-p16.yaml \
		--samples $(HELDOUT_KIND) $(KIND_BATCHES)
	$(NICE) $(PY) benchmarks/bundled_model_heldout.py $(HELDOUT)/compute \
		--model bundled=$(BUNDLED) --trained-on $(DATASET)/compute

lint: setup
	$(BIN)/ruff check planner profiler runtime operator src tests scripts benchmarks examples
	$(BIN)/ruff format --check planner profiler runtime operator src tests scripts benchmarks examples

typecheck: setup
	$(BIN)/mypy

# The suite runs one pytest-xdist worker more than the cores (work stealing;
# tests/conftest.py starts the longest first): about a quarter of its test time is
# waiting (a frozen node's 30 s bound, kopf's timers, pods' processes), which the extra
# worker fills; its tests hold beside busy loops (docs/testing.md). `make check` is the
# inner loop's fast tier: unit, render and pure-decision tests, without what starts
# processes, kopf's engine or the worker pods (marked `slow` or `e2e`). CI runs everything.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST_XDIST = -n $(PYTEST_WORKERS) --dist worksteal
pytest: setup tools
	$(BIN)/pytest $(PYTEST_XDIST)

check: setup tools
	$(BIN)/pytest $(PYTEST_XDIST) -m "not slow and not e2e"

# The closed loop's six scenarios, one at a time, each held to its targets, figures
# printed (docs/resharding.md): 15-20 min on 2 cores; run it on a machine of its own.
scenarios: setup tools
	$(BIN)/pytest -s --scenarios tests/test_e2e_loop_scenarios.py

# `make test` ends with the benchmark's protocol cut to four small tasks and the bundled
# model (docs/bench.md): its figures are printed, none is asserted; ~2-3 min on 2 cores.
BENCH_QUICK ?= out/bench-quick
test: lint typecheck pytest
	rm -rf $(BENCH_QUICK)
	$(BIN)/shardwise bench --quick --out $(BENCH_QUICK)

# The CPU image built from the Dockerfile without Docker, then smoke-tested inside: as
# root, buildah on a debootstrap'd Debian bookworm base (cached in ~/.cache/shardwise),
# apt-getting buildah and debootstrap if missing. CI runs it after `make test`; about
# 6 min cold on 2 cores (docs/install.md, "Building the image").
# Every GPU path, run once with its figures, where CUDA is present (docs/gpu-check.md):
# the first thing to run on a machine with a GPU. Without one it says what it would run
# and exits 0 ("no GPU: skipped"). It needs only python3: it sets up .venv-gpu itself.
.PHONY: gpu-check
gpu-check:
	python3 scripts/gpu_check.py

.PHONY: image
image:
	bash scripts/build-image.sh
	bash scripts/image-smoke.sh

clean:
	rm -rf $(VENV) out .tools .mypy_cache .ruff_cache .pytest_cache .hypothesis
