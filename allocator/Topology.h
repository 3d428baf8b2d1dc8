// Topology: NUMA nodes, their cores, and the node nearest a GPU, read once through hwloc.
// Without hwloc data (containers, VMs, hwloc missing) it is one node holding every online
// core, with from_hwloc == false; it never fails. Immutable after construction: thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace superchip {

struct NumaNode {
  int os_index = 0;            // the kernel's node number (what libnuma takes)
  std::vector<int> cpus;       // OS indices of the node's online cores (PUs)
  uint64_t memory_bytes = 0;   // local memory, 0 if unknown
};

class Topology {
 public:
  // The machine's topology, discovered on first use.
  static const Topology& get();

  const std::vector<NumaNode>& nodes() const noexcept { return nodes_; }
  bool from_hwloc() const noexcept { return from_hwloc_; }
  // Node nearest the PCI device with this bus id ("0000:41:00.0"), or the node of the
  // calling thread's CPU when the id is empty or unknown; always a valid index into nodes().
  int nearest_node(const std::string& pci_bus_id) const;
  // Multi-line description for `python -m superchip info`.
  std::string describe() const;

 private:
  Topology();
  std::vector<NumaNode> nodes_;
  bool from_hwloc_ = false;
  std::string fallback_reason_;  // why hwloc data was not used; empty when from_hwloc_
  std::vector<std::pair<std::string, int>> pci_nodes_;  // bus id -> node index
};

// PCI bus id ("0000:41:00.0") of CUDA device `device`; "" when device < 0, in builds
// without CUDA, or when the runtime cannot answer (no driver, no GPU). Never throws.
std::string cuda_pci_bus_id(int device);
// (free, total) bytes of CUDA device `device` (cudaMemGetInfo); (0, 0) when the runtime cannot
// answer or the build has no CUDA. Never throws.
std::pair<size_t, size_t> cuda_memory_info(int device);

}  // namespace superchip
