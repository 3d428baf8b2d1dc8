#!/usr/bin/env bash
# Runs every test: C++ GoogleTest suites (allocator/, ops/), the thread pool and the offload
# engine under ThreadSanitizer, the aarch64 kernel tests under qemu, and the pytest suite.
# `scripts/test.sh cpp|tsan|aarch64|python` runs one part. `scripts/test.sh asan [pytest args]`
# (not part of the default: about 35 minutes on 2 cores, 10 of them the first build) runs the pytest suite against the
# extension built with AddressSanitizer + UBSan.
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

if [[ $part == asan ]]; then
  # superchip._C built with -fsanitize=address,undefined (build/asan, CUDA parts off) in a copy
  # of the package (build/asan/python), the suite run with libasan preloaded (Python is not
  # built with it; libstdc++ preloaded too, or ASan cannot find the real __cxa_throw). Every
  # report goes to build/asan/logs, subprocesses' and crash-isolated sweep workers' included;
  # any report fails the run. Deselected: a test that needs malloc to fail under an
  # address-space limit, where ASan's allocator aborts instead.
  shift || true
  echo "[test] AddressSanitizer + UBSan: pytest against build/asan"
  cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSUPERCHIP_SANITIZE=ON \
    -DSUPERCHIP_BUILD_PYTHON=ON -DSUPERCHIP_WITH_CUDA=OFF -DPython3_EXECUTABLE="$(command -v "$PY")" >/dev/null
  cmake --build build/asan -j "$jobs" --target _C
  rm -rf build/asan/python build/asan/logs && mkdir -p build/asan/python build/asan/logs
  cp -r python/superchip build/asan/python/
  rm -f build/asan/python/superchip/_C*.so
  ln -s "$(pwd)"/build/asan/backend/_C*.so build/asan/python/superchip/
  set +e
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
    ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:log_path=$(pwd)/build/asan/logs/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:log_path=$(pwd)/build/asan/logs/ubsan" \
    PYTHONPATH="$(pwd)/build/asan/python" $PY -m pytest -q -p no:cacheprovider \
    --deselect test/python/test_memory.py::test_an_executor_out_of_memory_gets_superchip_cache_back \
    "${@:-test/python}"
  rc=$?
  set -e
  if compgen -G "build/asan/logs/*" >/dev/null; then
    echo "[test] sanitizer reports:"; head -n 30 build/asan/logs/*
    exit 1
  fi
  exit $rc
fi
