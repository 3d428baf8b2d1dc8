# The two commands a newcomer needs: `make demo` and `make test`. Both do every set-up step
# (scripts/setup.sh is idempotent) and print what they do.
PY ?= python3
JOBS ?= 2

.PHONY: setup build demo test test-cpp test-aarch64 test-python bench clean

setup:
	@bash scripts/setup.sh

build: setup
	@bash scripts/build.sh

demo: build
	@echo "[demo] $(PY) examples/demo.py"
	@$(PY) examples/demo.py

test: build
	@bash scripts/test.sh

test-cpp: setup
	@bash scripts/test.sh cpp

test-aarch64: setup
	@bash scripts/test.sh aarch64

test-python: build
	@bash scripts/test.sh python

bench: build
	@$(PY) bench/dispatch.py
	@$(PY) bench/optim.py

clean:
	rm -rf build
