// HostMemory: how much memory this machine can still give the process, read from the kernel:
// /proc/meminfo's MemAvailable, bounded by the process's memory cgroup (v2: memory.max of its
// cgroup and every ancestor; v1: memory.limit_in_bytes of its cgroup and every ancestor and
// its hierarchical limit; each against that cgroup's own usage). The host backing
// asks it before it maps a large block (Note [The machine's memory] in Backing.cpp), so a
// host tier without a budget fails a request with OutOfTierMemory where the kernel would
// otherwise kill the process when the pages are first touched.
// Thread-safety: read_host_memory() reads files only and keeps no state; safe from any thread.
// It never throws: a file it cannot read or parse leaves that bound out.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace superchip {

struct HostMemory {
  size_t total = 0;      // MemTotal
  size_t available = 0;  // MemAvailable: free memory plus what the kernel can reclaim
  // The memory cgroup whose limit leaves the least room, when one has a limit below `total`.
  bool cgroup_limited = false;
  std::string cgroup;       // its path in the hierarchy ("/" for the root)
  size_t cgroup_limit = 0;  // its limit
  size_t cgroup_used = 0;   // its usage minus its inactive file pages (reclaimable)

  // What a new allocation can still take: MemAvailable, or the cgroup's limit minus its use
  // where that is less.
  size_t headroom() const noexcept;
  // The memory this process could ever have: min(MemTotal, the cgroup's limit).
  size_t limit() const noexcept;
  // "1.20 GiB available to this process (memory cgroup /x: limit 1.50 GiB, 300.00 MiB in use;
  // MemAvailable 20.10 GiB of 23.54 GiB)".
  std::string describe() const;
};

// Reads the kernel's figures. `root` is prepended to /proc and /sys paths (tests point it at
// a directory laid out like them). nullopt when /proc/meminfo has no MemTotal and MemAvailable.
std::optional<HostMemory> read_host_memory(const std::string& root = "");

// What superchip leaves free for the rest of the process and the machine (Python, the data
// loader, torch's own CPU tensors): limit / 32, at least 256 MiB, at most 2 GiB.
size_t host_memory_reserve(size_t limit) noexcept;

}  // namespace superchip
