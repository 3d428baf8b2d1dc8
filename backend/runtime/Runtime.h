// Runtime: process-wide state of the superchip devices: which executor runs the kernels,
// how many devices there are, the current device of each thread, and each device's
// two-tier MemoryManager (created on first use from SUPERCHIP_* environment variables).
// Thread-safety: executor()/device_count() are fixed after the first call; memory() creates
// managers under a mutex and never moves them; the current device is thread-local.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>

#include <string>

#include "allocator/MemoryManager.h"

namespace superchip {

enum class Executor { kCpu, kCuda };

// kCuda when SUPERCHIP_EXECUTOR=cuda, or when it is unset and this build has CUDA, torch has
// CUDA and a GPU is visible; kCpu otherwise. A request that cannot be met raises, saying why.
Executor executor();
const char* executor_name(Executor e) noexcept;
// The device type forwarded kernels run on (kCPU or kCUDA), its dense dispatch key, and the
// device of superchip:index.
c10::DeviceType executor_device_type();
c10::DispatchKey executor_dispatch_key();
c10::Device executor_device(c10::DeviceIndex index);

// Number of superchip devices: the CUDA device count with the CUDA executor, otherwise
// SUPERCHIP_DEVICE_COUNT (default 1). Never throws (0 on error).
c10::DeviceIndex device_count() noexcept;
// Raises, naming the variable and the accepted forms, when a variable read at start-up
// (SUPERCHIP_DEVICE_COUNT) is malformed; superchip's _init calls it at import. device_count()
// itself never throws (c10's contract) and reads a malformed count as 1.
void check_environment();
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
// Raises a user error naming the index and the count when the index is out of range.
void check_device_index(c10::DeviceIndex index);
// index, or the current device when index < 0.
c10::DeviceIndex resolve_device(c10::DeviceIndex index);

// The two-tier memory of superchip:index (created on first use). Budgets come from
// SUPERCHIP_HBM_BYTES / SUPERCHIP_HOST_BYTES (integers with an optional K/M/G/T suffix);
// SUPERCHIP_HOST_MEMORY_CHECK=0 maps host memory the machine cannot hold (Note [The
// machine's memory] in allocator/Backing.cpp).
MemoryManager& memory(c10::DeviceIndex index);
// The managers created so far (nullptr for devices not used yet); index < device_count().
MemoryManager* memory_if_created(c10::DeviceIndex index) noexcept;

// Parses "123", "64M", "8G", "1.5G" (binary units). Raises a user error naming `what`.
// `zero_is_unlimited`: the setting's 0 means no budget (the tiers'), which its errors say.
size_t parse_bytes(const std::string& text, const char* what, bool zero_is_unlimited = true);
// A whole number with optional spaces around it (a CR too); -1 when it is not one.
long parse_whole_number(const std::string& text);

}  // namespace superchip
