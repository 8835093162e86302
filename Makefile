# The two commands a newcomer runs: `make serve` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: serve demo test test-latest lock fuzz soak soak-attack bench-kernels gpu-wheels gpu-check gpu-bench clean

# The GPU machine runs the check with its own Python (torch, triton; no network, no .venv there).
GPU_PY ?= python3
GPU_WHEELS := .whl/gpu
# Any pip can download for another interpreter; the .venv's once it exists.
WHEELS_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))

# Exact versions that were tested (pyproject.toml keeps the lower bounds for those who install the
# package): `make lock` writes it anew from the newest releases allowed; `make test-latest` tries them.
LOCK := requirements.lock
# pip-compile's flags for the lock; its torch is the CPU build pip finds on this machine's disk.
LOCK_FLAGS := --extra dev --allow-unsafe --strip-extras --no-emit-find-links --no-emit-index-url

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r $(LOCK)
	# Our package alone, editable, built by the locked setuptools (no build environment to fetch).
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve tiny

demo: $(STAMP)
	$(BIN)/pagedserve demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# A scratch venv with the newest releases pyproject.toml allows (not the lock), and a short subset:
# the next release that breaks us is found here first. Then `make lock` to move the lock forward.
LATEST := .cache/latest-venv
test-latest:
	rm -rf $(LATEST) && $(PY) -m venv $(LATEST)
	# torch pinned first: the CPU wheel; an unpinned torch would pull CUDA builds.
	$(LATEST)/bin/python -m pip install -q torch==2.13.0
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager '.[dev]'
	$(LATEST)/bin/python -m pip list --format=freeze | grep -iE '^(transformers|kernels|tokenizers|fastapi|xgrammar)=='
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider tests/test_install_names.py \
		tests/test_exactness.py tests/test_engine.py tests/test_router_service.py tests/test_structured_outputs.py

lock:
	rm -rf .cache/lock-venv && $(PY) -m venv .cache/lock-venv
	.cache/lock-venv/bin/python -m pip install -q torch==2.13.0 pip-tools
	.cache/lock-venv/bin/pip-compile -q --upgrade $(LOCK_FLAGS) -o $(LOCK) pyproject.toml

# A few minutes of mixed traffic while processes are killed and paused at random (needs Redis at
# 127.0.0.1:6379; tests/test_soak.py is the short form in `make test`).
soak: $(STAMP)
	$(BIN)/python -m pagedserve.loadgen.soak --duration 180

# A few minutes of a steady normal load while hostile clients of every class of issue 28 run
# (loadgen/attacks.py); exit 1 if a target is missed. tests/test_attack_soak.py is the short form.
soak-attack: $(STAMP)
	$(BIN)/python -m pagedserve.loadgen.attack_soak --quiet 30 --duration 150 --rounds 3 --out attack-soak.json

# The long form of the fuzzing in `make test`: Hypothesis over every protocol decoder, and
# schemathesis over every route of a running router (no 5xx, no blocks left held). ~10 minutes.
fuzz: $(STAMP)
	FUZZ_EXAMPLES=20000 API_FUZZ_EXAMPLES=300 $(BIN)/python -m pytest tests/test_protocol_fuzz.py tests/test_api_fuzz.py

bench-kernels: $(STAMP)
	$(BIN)/python -m pagedserve.kernels.benchmark

# Here, with network: wheels for the GPU machine's Python 3.12 (scripts/gpu-requirements.txt).
gpu-wheels:
	$(WHEELS_PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 --platform any -d $(GPU_WHEELS) -r scripts/gpu-requirements.txt
	@du -sh $(GPU_WHEELS)

# There: one table, under 5 minutes; exits 77 at once (make then says Error 77) without CUDA.
gpu-check:
	@$(GPU_PY) scripts/gpu_check.py

# There too: the speed figures of issue 30 (engine step profile, offline paged vs Orca-Oracle, the
# served stack), eager and CUDA graphs side by side, one table, under 5 minutes; exit 77 without CUDA.
gpu-bench:
	@$(GPU_PY) scripts/gpu_bench.py

clean:
	rm -rf $(VENV) .cache
