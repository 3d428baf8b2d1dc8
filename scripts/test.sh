#!/usr/bin/env bash
# Runs every test: C++ GoogleTest suites (allocator/, ops/), the aarch64 kernel tests under
# qemu, and the pytest suite. `scripts/test.sh cpp|aarch64|python` runs one part.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
part=${1:-all}
jobs=${JOBS:-2}

if [[ $part == all || $part == cpp ]]; then
  echo "[test] C++ suites: cmake build/cpp + ctest"
  cmake -S . -B build/cpp -G Ninja -DSUPERCHIP_BUILD_PYTHON=OFF -DSUPERCHIP_BUILD_TESTS=ON >/dev/null
  cmake --build build/cpp -j "$jobs"
  ctest --test-dir build/cpp --output-on-failure -j "$jobs"
fi

if [[ $part == all || $part == aarch64 ]]; then
  if [[ -x scripts/test_aarch64.sh ]]; then
    echo "[test] aarch64 kernels under qemu"
    bash scripts/test_aarch64.sh
  fi
fi

if [[ $part == all || $part == python ]]; then
  echo "[test] pytest test/python"
  $PY -m pytest -q -p no:cacheprovider test/python
fi
