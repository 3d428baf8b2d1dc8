#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: system packages, torch (CPU build when none is
# installed), Python build/test dependencies, then the superchip build + install.
# Every step says what it does and skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
APT_PACKAGES=(
  cmake ninja-build ccache pkg-config
  libnuma-dev libhwloc-dev libgtest-dev
  g++-aarch64-linux-gnu qemu-user googletest
)
# The Hugging Face packages (trl included), Lightning and bitsandbytes (QLoRA's 4-bit layers and paged optimizers) are
# pinned to the versions the tests ran with: their releases change
# what runs on a device they do not know (accelerate 1.16 allows fp16 there, transformers 5
# kernelizes loaded models), and a fresh machine should not meet a new release in CI.
PIP_PACKAGES=(scikit-build-core ninja pytest expecttest hypothesis numpy transformers==5.25.0 accelerate==1.16.0 matplotlib peft==0.21.2 torchao==0.18.0 lightning==2.6.6 bitsandbytes==0.50.2 trl==1.16.0)

log() { printf '[setup] %s\n' "$*"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
    # Offline machines (a lent GPU machine) still build: hwloc/libnuma are optional and the
    # test-only packages are needed by `make test` alone; scripts/build_inplace.sh needs none.
    log "WARNING: could not install ${missing[*]} (offline?); continuing without them"
  fi
else
  log "system packages present"
fi

if $PY -c "import torch" 2>/dev/null; then
  log "torch $($PY -c 'import torch; print(torch.__version__)') already installed"
else
  # Installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  log "pip install torch==2.13.0"
  $PY -m pip install -q torch==2.13.0
fi

need=()
for p in "${PIP_PACKAGES[@]}"; do
  mod=${p%%=*}       # the module name: no version pin, '_' for '-'
  mod=${mod//-/_}
  $PY -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$mod') is None)" 2>/dev/null || need+=("$p")
done
if ((${#need[@]})); then
  log "pip install ${need[*]}"
  $PY -m pip install -q "${need[@]}"
else
  log "python packages present"
fi
