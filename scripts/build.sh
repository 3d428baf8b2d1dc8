#!/usr/bin/env bash
# Builds and installs the superchip package against the installed torch. Incremental: the
# CMake build tree is kept in build/ and compiles go through ccache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
echo "[build] pip install --no-build-isolation . (build tree in build/, ccache on)"
# --no-build-isolation: build against the torch already installed (an isolated build env
# would download a multi-GB CUDA torch).
$PY -m pip install --no-build-isolation --no-deps -q . 2>&1 | grep -v "Running pip as the 'root' user" || true
$PY -c "import superchip, torch; print('[build] superchip installed; executor:', superchip.executor(), '| torch', torch.__version__)"
