#!/usr/bin/env bash
# Builds superchip._C with CMake alone (no pip, no scikit-build-core, no network) into
# build/inplace and links it into python/superchip, so that `PYTHONPATH=python python3 ...`
# imports this tree. For machines that cannot install packages (an offline GPU machine):
# needs only torch, a C++ compiler, CMake and ninja (or make). Incremental.
# SUPERCHIP_BUILD_TESTS=ON adds the C++ suites; SUPERCHIP_CMAKE_ARGS passes more -D options.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=build/inplace
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
echo "[build_inplace] cmake -S . -B $BUILD (${gen[*]:-make})"
cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSUPERCHIP_BUILD_PYTHON=ON \
  -DSUPERCHIP_BUILD_TESTS="${SUPERCHIP_BUILD_TESTS:-OFF}" -DPython3_EXECUTABLE="$(command -v "$PY")" \
  ${SUPERCHIP_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD" -j "${JOBS:-2}" ${SUPERCHIP_BUILD_KEEP_GOING:+-- -k 0}
so=$(ls "$BUILD"/backend/_C*.so)
ln -sf "$(pwd)/$so" python/superchip/
echo "[build_inplace] linked $so into python/superchip; use PYTHONPATH=$(pwd)/python"
PYTHONPATH=python $PY -c "import superchip, torch; print('[build_inplace] executor:', superchip.executor(), '| torch', torch.__version__)"
