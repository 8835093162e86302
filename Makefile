# The two commands a newcomer runs: `make serve` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: serve demo test bench-kernels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch would pull CUDA builds.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve up --model tiny

demo: $(STAMP)
	$(BIN)/pagedserve demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench-kernels: $(STAMP)
	$(BIN)/python -m kernels.benchmark

clean:
	rm -rf $(VENV) .cache
