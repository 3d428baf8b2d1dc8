#!/usr/bin/env bash
# Cross-builds ops/ and its GoogleTest suite for AArch64 (build/aarch64, incremental) and runs
# it under qemu-user: once with every feature (-cpu max: SVE at qemu's default 512-bit vectors,
# NEON, scalar), then the SVE tests at 128 bits (Grace's width) and 256 bits, then on a CPU
# without SVE (cortex-a57) to check that SVE is reported unsupported and NEON is chosen.
# Needs the APT packages g++-aarch64-linux-gnu, qemu-user and googletest (scripts/setup.sh).
# Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD=$ROOT/build/aarch64
JOBS=${JOBS:-2}
SYSROOT=/usr/aarch64-linux-gnu
TOOLCHAIN=$ROOT/cmake/aarch64-linux-gnu.cmake

log() { printf '[test_aarch64] %s\n' "$*"; }
run() { log "+ $*"; "$@"; }

missing=()
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
[ -f /usr/src/googletest/CMakeLists.txt ] || missing+=(googletest)
if ((${#missing[@]})); then
  log "missing tools; install with: apt-get install ${missing[*]} (or run scripts/setup.sh)"
  exit 1
fi

# GoogleTest for the target, from Debian's sources (built once).
GTEST_BUILD=$BUILD/googletest
GTEST_PREFIX=$BUILD/googletest-install
if [ ! -f "$GTEST_PREFIX/lib/cmake/GTest/GTestConfig.cmake" ]; then
  log "building GoogleTest for aarch64 from /usr/src/googletest"
  run cmake -S /usr/src/googletest -B "$GTEST_BUILD" -G Ninja -Wno-dev \
    -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$GTEST_PREFIX" -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON >/dev/null
  run cmake --build "$GTEST_BUILD" -j "$JOBS" --target install >/dev/null
else
  log "GoogleTest for aarch64 present ($GTEST_PREFIX)"
fi

log "configuring ops for aarch64 in $BUILD/superchip"
run cmake -S "$ROOT" -B "$BUILD/superchip" -G Ninja -Wno-dev \
  -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DCMAKE_BUILD_TYPE=Release \
  -DSUPERCHIP_BUILD_PYTHON=OFF -DSUPERCHIP_BUILD_TESTS=ON -DSUPERCHIP_WITH_CUDA=OFF \
  -DSUPERCHIP_USE_NUMA=OFF -DGTest_DIR="$GTEST_PREFIX/lib/cmake/GTest" >/dev/null
log "building ops_tests"
run cmake --build "$BUILD/superchip" -j "$JOBS" --target ops_tests

TESTS=$BUILD/superchip/test/cpp/ops/ops_tests
qemu() {
  local cpu=$1
  shift
  run qemu-aarch64 -L "$SYSROOT" -cpu "$cpu" "$TESTS" --gtest_brief=1 "$@"
}
log "all tests, -cpu max (SVE 512-bit, NEON, scalar)"
qemu max
log "SVE tests at 128-bit vectors"
qemu max,sve-max-vq=1 --gtest_filter='*sve*:*Sve*:SimdDispatch.*'
log "SVE tests at 256-bit vectors"
qemu max,sve-max-vq=2 --gtest_filter='*sve*:*Sve*:SimdDispatch.*'
log "a CPU without SVE (cortex-a57): dispatch and NEON"
qemu cortex-a57 --gtest_filter='SimdDispatch.*:*neon*:*Golden*/sve'
log "all aarch64 runs passed"
