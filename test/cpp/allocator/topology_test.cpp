// Topology discovery: whatever the machine (hwloc or the fallback), the answers are usable.
#include <gtest/gtest.h>

#include <algorithm>

#include "allocator/Topology.h"

namespace superchip {
namespace {

TEST(Topology, HasANodeWithCpus) {
  const Topology& topo = Topology::get();
  ASSERT_GE(topo.nodes().size(), 1u);
  EXPECT_TRUE(std::any_of(topo.nodes().begin(), topo.nodes().end(),
                          [](const NumaNode& n) { return !n.cpus.empty(); }));
  for (const NumaNode& node : topo.nodes()) {
    EXPECT_GE(node.os_index, 0);
    EXPECT_TRUE(std::is_sorted(node.cpus.begin(), node.cpus.end()));
  }
  EXPECT_EQ(&topo, &Topology::get());  // discovered once
}

TEST(Topology, NearestNodeIsAlwaysAValidIndex) {
  const Topology& topo = Topology::get();
  const int n = int(topo.nodes().size());
  for (const char* id : {"", "0000:41:00.0", "00000000:41:00.0", "41:00.0", "garbage"}) {
    const int node = topo.nearest_node(id);
    EXPECT_GE(node, 0) << id;
    EXPECT_LT(node, n) << id;
  }
}

TEST(Topology, DescribeListsEveryNode) {
  const Topology& topo = Topology::get();
  const std::string text = topo.describe();
  EXPECT_NE(text.find("NUMA topology"), std::string::npos) << text;
  for (const NumaNode& node : topo.nodes()) {
    EXPECT_NE(text.find("node " + std::to_string(node.os_index) + ":"), std::string::npos) << text;
  }
}

TEST(Topology, CudaPciBusIdOfNoDeviceIsEmpty) {
  EXPECT_EQ(cuda_pci_bus_id(-1), "");
}

}  // namespace
}  // namespace superchip
