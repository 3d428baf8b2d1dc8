# Cross toolchain for AArch64 Linux with Debian's cross compiler (g++-aarch64-linux-gnu);
# binaries run under qemu-user (qemu-aarch64 -L /usr/aarch64-linux-gnu), which CMake uses as
# the emulator for try-runs and gtest discovery. Used by scripts/test_aarch64.sh.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(SUPERCHIP_AARCH64_SYSROOT /usr/aarch64-linux-gnu)
list(APPEND CMAKE_FIND_ROOT_PATH ${SUPERCHIP_AARCH64_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
find_program(SUPERCHIP_QEMU_AARCH64 qemu-aarch64)
if(SUPERCHIP_QEMU_AARCH64)
  # -cpu max: every feature qemu emulates, SVE included.
  set(CMAKE_CROSSCOMPILING_EMULATOR ${SUPERCHIP_QEMU_AARCH64} -L ${SUPERCHIP_AARCH64_SYSROOT} -cpu max)
endif()
