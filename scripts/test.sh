#!/usr/bin/env bash
# Runs every test: C++ GoogleTest suites (allocator/, ops/), the thread pool and the offload
# engine under ThreadSanitizer, the aarch64 kernel tests under qemu, and the pytest suite.
# `scripts/test.sh cpp|tsan|aarch64|python` runs one part.
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

if [[ $part == all || $part == tsan ]]; then
  # The thread pool (and the kernels that split work over it, the undo log) and the offload
  # engine's concurrency suite, built with -fsanitize=thread; any report fails the run.
  echo "[test] ThreadSanitizer: thread pool and offload engine (build/tsan)"
  cmake -S . -B build/tsan -G Ninja -DSUPERCHIP_TSAN=ON -DSUPERCHIP_BUILD_TESTS=ON \
    -DSUPERCHIP_BUILD_PYTHON=ON -DSUPERCHIP_WITH_CUDA=OFF -DPython3_EXECUTABLE="$(command -v "$PY")" >/dev/null
  cmake --build build/tsan -j "$jobs" --target ops_tests engine_tests
  export TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}"
  build/tsan/test/cpp/ops/ops_tests --gtest_brief=1 --gtest_filter='ThreadPool*:*ThreadPool*:*Undo*'
  build/tsan/backend/engine_tests --gtest_brief=1 --gtest_repeat=10  # more interleavings
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
