#include "allocator/Topology.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <exception>

#ifdef SUPERCHIP_HAVE_HWLOC
#include <hwloc.h>
#endif

#include "allocator/MemoryManager.h"

namespace superchip {

namespace {

// Canonical form of a PCI bus id: lower-case, 4-digit domain ("0000:41:00.0"). Accepts the
// 8-digit domain of nvidia-smi ("00000000:41:00.0") and a missing domain ("41:00.0").
std::string normalize_bus_id(const std::string& id) {
  std::string s;
  for (char c : id) {
    if (!std::isspace(static_cast<unsigned char>(c))) s += char(std::tolower(static_cast<unsigned char>(c)));
  }
  const size_t first_colon = s.find(':');
  if (first_colon == std::string::npos) return s;
  if (s.find(':', first_colon + 1) == std::string::npos) return "0000:" + s;
  if (first_colon > 4) s.erase(0, first_colon - 4);
  return s;
}

// "0-3,8,10-11"
std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) j++;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::vector<int> online_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) {
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (long c = 0; c < std::max(n, 1L); ++c) cpus.push_back(int(c));
  }
  return cpus;
}

uint64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? uint64_t(pages) * uint64_t(page_size) : 0;
}

#ifdef SUPERCHIP_HAVE_HWLOC
// Frees the hwloc topology on every path out of discovery.
struct HwlocTopology {
  hwloc_topology_t topo = nullptr;
  ~HwlocTopology() {
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }
};

std::vector<int> bitmap_to_vector(hwloc_const_bitmap_t bitmap) {
  std::vector<int> out;
  if (bitmap == nullptr) return out;
  for (int i = hwloc_bitmap_first(bitmap); i != -1; i = hwloc_bitmap_next(bitmap, i)) out.push_back(i);
  return out;
}
#endif

}  // namespace

Topology::Topology() {
  try {
#ifdef SUPERCHIP_HAVE_HWLOC
    HwlocTopology h;
    if (hwloc_topology_init(&h.topo) != 0) {
      h.topo = nullptr;
      fallback_reason_ = "hwloc_topology_init failed";
    } else {
      // PCI devices are filtered out by default; we need them to place a GPU.
      hwloc_topology_set_io_types_filter(h.topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
#if HWLOC_API_VERSION >= 0x00020100
      // The linux backend reads PCI locality from sysfs; the libpciaccess-based "pci"
      // plugin adds nothing we use and leaks at unload (LeakSanitizer flags it).
      (void)hwloc_topology_set_components(h.topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, "pci");
#endif
      if (hwloc_topology_load(h.topo) != 0) {
        fallback_reason_ = "hwloc_topology_load failed";
      } else {
        std::vector<std::pair<int, int>> os_to_index;  // node os_index -> index in nodes_
        hwloc_obj_t obj = nullptr;
        while ((obj = hwloc_get_next_obj_by_type(h.topo, HWLOC_OBJ_NUMANODE, obj)) != nullptr) {
          NumaNode node;
          node.os_index = int(obj->os_index);
          node.cpus = bitmap_to_vector(obj->cpuset);
          node.memory_bytes = obj->attr != nullptr ? obj->attr->numanode.local_memory : 0;
          os_to_index.emplace_back(node.os_index, int(nodes_.size()));
          nodes_.push_back(std::move(node));
        }
        hwloc_obj_t pci = nullptr;
        while ((pci = hwloc_get_next_pcidev(h.topo, pci)) != nullptr) {
          hwloc_obj_t anchor = hwloc_get_non_io_ancestor_obj(h.topo, pci);
          if (anchor == nullptr || anchor->nodeset == nullptr) continue;
          const int os_node = hwloc_bitmap_first(anchor->nodeset);
          for (const auto& [os_index, index] : os_to_index) {
            if (os_index != os_node) continue;
            const auto& bus = pci->attr->pcidev;
            char id[32];
            std::snprintf(id, sizeof(id), "%04x:%02x:%02x.%01x", unsigned(bus.domain),
                          unsigned(bus.bus), unsigned(bus.dev), unsigned(bus.func));
            pci_nodes_.emplace_back(id, index);
          }
        }
        const bool any_cpu = std::any_of(nodes_.begin(), nodes_.end(),
                                         [](const NumaNode& n) { return !n.cpus.empty(); });
        if (any_cpu) {
          from_hwloc_ = true;
        } else {
          fallback_reason_ = "hwloc reported no NUMA node with CPUs";
        }
      }
    }
#else
    fallback_reason_ = "built without hwloc";
#endif
  } catch (const std::exception& e) {
    fallback_reason_ = std::string("topology discovery failed: ") + e.what();
  }
  if (!from_hwloc_) {
    nodes_.clear();
    pci_nodes_.clear();
    NumaNode node;
    node.cpus = online_cpus();
    node.memory_bytes = physical_memory();
    nodes_.push_back(std::move(node));
  }
}

const Topology& Topology::get() {
  static const Topology topology;
  return topology;
}

int Topology::nearest_node(const std::string& pci_bus_id) const {
  if (!pci_bus_id.empty()) {
    const std::string id = normalize_bus_id(pci_bus_id);
    for (const auto& [bus, index] : pci_nodes_) {
      if (bus == id) return index;
    }
  }
  const int cpu = sched_getcpu();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const auto& cpus = nodes_[i].cpus;
    if (std::find(cpus.begin(), cpus.end(), cpu) != cpus.end()) return int(i);
  }
  return 0;
}

std::string Topology::describe() const {
  std::string out = "NUMA topology (";
  out += from_hwloc_ ? "hwloc" : "fallback: " + fallback_reason_;
  out += "): " + std::to_string(nodes_.size()) + " node(s)\n";
  for (const NumaNode& node : nodes_) {
    out += "  node " + std::to_string(node.os_index) + ": cpus " + format_cpu_list(node.cpus) +
           ", memory " + (node.memory_bytes != 0 ? format_bytes(node.memory_bytes) : "unknown") +
           "\n";
  }
  for (const auto& [bus, index] : pci_nodes_) {
    out += "  pci " + bus + " -> node " + std::to_string(nodes_[size_t(index)].os_index) + "\n";
  }
  return out;
}

}  // namespace superchip
