// Tests of HostMemory (the machine's memory as the kernel reports it) and of the host backing
// refusing what the machine cannot hold (Note [The machine's memory] in Backing.cpp).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "allocator/Backing.h"
#include "allocator/HostMemory.h"
#include "allocator/MemoryManager.h"

namespace superchip {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

// A directory laid out like / for the files read_host_memory() reads; removed at the end.
class FakeRoot {
 public:
  FakeRoot() {
    char tmpl[] = "/tmp/superchip_hostmem_XXXXXX";
    const char* dir = mkdtemp(tmpl);
    if (dir == nullptr) throw std::runtime_error("mkdtemp failed");
    root_ = dir;
  }
  ~FakeRoot() { std::system(("rm -rf '" + root_ + "'").c_str()); }
  FakeRoot(const FakeRoot&) = delete;
  FakeRoot& operator=(const FakeRoot&) = delete;

  void write(const std::string& path, const std::string& text) {
    std::string dir = root_;
    size_t from = 1;
    for (size_t slash; (slash = path.find('/', from)) != std::string::npos; from = slash + 1) {
      dir = root_ + path.substr(0, slash);
      ::mkdir(dir.c_str(), 0755);
    }
    std::ofstream(root_ + path) << text;
  }
  // MemTotal 16 GiB, MemAvailable `available_mib` MiB, in meminfo's kB.
  void meminfo(size_t available_mib) {
    write("/proc/meminfo", "MemTotal:       16777216 kB\nMemFree:         1000 kB\nMemAvailable:   " +
                               std::to_string(available_mib * 1024) + " kB\nBuffers: 0 kB\n");
  }
  const std::string& path() const { return root_; }

 private:
  std::string root_;
};

TEST(HostMemory, MeminfoAloneGivesMemAvailable) {
  FakeRoot fs;
  fs.meminfo(3000);
  const std::optional<HostMemory> m = read_host_memory(fs.path());
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->total, 16 * kGiB);
  EXPECT_EQ(m->available, 3000 * kMiB);
  EXPECT_FALSE(m->cgroup_limited);
  EXPECT_EQ(m->headroom(), 3000 * kMiB);
  EXPECT_EQ(m->limit(), 16 * kGiB);
  EXPECT_EQ(m->describe(), "2.93 GiB available to this process (MemAvailable 2.93 GiB of 16.00 GiB)");
}

TEST(HostMemory, UnreadableOrIncompleteMeminfoGivesNothing) {
  FakeRoot fs;
  EXPECT_FALSE(read_host_memory(fs.path()).has_value());
  fs.write("/proc/meminfo", "MemTotal: 16777216 kB\n");  // no MemAvailable (a very old kernel)
  EXPECT_FALSE(read_host_memory(fs.path()).has_value());
}

TEST(HostMemory, CgroupV2TheAncestorLeavingLeastRoomBinds) {
  FakeRoot fs;
  fs.meminfo(12000);
  fs.write("/proc/self/cgroup", "0::/job/step\n");
  fs.write("/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n");
  // The process's own cgroup: no limit. Its parent: 2 GiB, 1.5 GiB charged of which 512 MiB
  // are inactive file pages the kernel can reclaim.
  fs.write("/sys/fs/cgroup/job/step/memory.max", "max\n");
  fs.write("/sys/fs/cgroup/job/step/memory.current", std::to_string(100 * kMiB) + "\n");
  fs.write("/sys/fs/cgroup/job/memory.max", std::to_string(2 * kGiB) + "\n");
  fs.write("/sys/fs/cgroup/job/memory.current", std::to_string(1536 * kMiB) + "\n");
  fs.write("/sys/fs/cgroup/job/memory.stat",
           "anon 1000\nfile 2000\nactive_file 5\ninactive_file " + std::to_string(512 * kMiB) + "\n");
  const std::optional<HostMemory> m = read_host_memory(fs.path());
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->cgroup_limited);
  EXPECT_EQ(m->cgroup, "/job");
  EXPECT_EQ(m->cgroup_limit, 2 * kGiB);
  EXPECT_EQ(m->cgroup_used, 1024 * kMiB);
  EXPECT_EQ(m->headroom(), 1024 * kMiB);  // below MemAvailable
  EXPECT_EQ(m->limit(), 2 * kGiB);
  EXPECT_EQ(m->describe(),
            "1.00 GiB available to this process (memory cgroup /job: limit 2.00 GiB, 1.00 GiB "
            "in use; MemAvailable 11.72 GiB of 16.00 GiB)");
  // A tighter limit on the process's own cgroup binds instead.
  fs.write("/sys/fs/cgroup/job/step/memory.max", std::to_string(300 * kMiB) + "\n");
  EXPECT_EQ(read_host_memory(fs.path())->cgroup, "/job/step");
  EXPECT_EQ(read_host_memory(fs.path())->headroom(), 200 * kMiB);
  // MemAvailable binds when it is below what the cgroup leaves.
  fs.meminfo(150);
  EXPECT_EQ(read_host_memory(fs.path())->headroom(), 150 * kMiB);
}

TEST(HostMemory, CgroupV2WithoutTheMemoryControllerIsIgnored) {
  FakeRoot fs;
  fs.meminfo(4000);
  fs.write("/proc/self/cgroup", "0::/job\n");
  fs.write("/sys/fs/cgroup/cgroup.controllers", "cpu io pids\n");
  fs.write("/sys/fs/cgroup/job/memory.max", std::to_string(kGiB) + "\n");
  fs.write("/sys/fs/cgroup/job/memory.current", "0\n");
  EXPECT_FALSE(read_host_memory(fs.path())->cgroup_limited);
}

TEST(HostMemory, CgroupV1UsesTheHierarchicalLimitAndReclaimableFiles) {
  FakeRoot fs;
  fs.meminfo(12000);
  fs.write("/proc/self/cgroup", "12:pids:/\n4:memory:/runner/job\n1:name=systemd:/\n0::/\n");
  const std::string dir = "/sys/fs/cgroup/memory/runner/job";
  fs.write(dir + "/memory.limit_in_bytes", std::to_string(4 * kGiB) + "\n");
  fs.write(dir + "/memory.usage_in_bytes", std::to_string(1536 * kMiB) + "\n");
  fs.write(dir + "/memory.stat", "cache 10\nhierarchical_memory_limit " + std::to_string(2 * kGiB) +
                                     "\ninactive_file 1\ntotal_inactive_file " +
                                     std::to_string(256 * kMiB) + "\n");
  const std::optional<HostMemory> m = read_host_memory(fs.path());
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->cgroup_limited);
  EXPECT_EQ(m->cgroup, "/runner/job");
  EXPECT_EQ(m->cgroup_limit, 2 * kGiB);
  EXPECT_EQ(m->cgroup_used, 1280 * kMiB);
  EXPECT_EQ(m->headroom(), 768 * kMiB);
}

// An ancestor's limit binds against the ancestor's usage, which counts the process's
// siblings: v1 with the limit on the parent (the leaf's hierarchical limit alone set 1 GiB
// against the leaf's 50 MiB: 974 MiB of room where 74 MiB were left), and v2 where the leaf
// has no memory.max at all (its parent does not enable the controller below it: no limit
// was found).
TEST(HostMemory, AnAncestorsLimitBindsAgainstItsOwnUsage) {
  {
    FakeRoot fs;
    fs.meminfo(12000);
    fs.write("/proc/self/cgroup", "4:memory:/pod/job\n");
    fs.write("/sys/fs/cgroup/memory/pod/memory.limit_in_bytes", std::to_string(kGiB) + "\n");
    fs.write("/sys/fs/cgroup/memory/pod/memory.usage_in_bytes", std::to_string(950 * kMiB) + "\n");
    fs.write("/sys/fs/cgroup/memory/pod/job/memory.limit_in_bytes", "9223372036854771712\n");
    fs.write("/sys/fs/cgroup/memory/pod/job/memory.usage_in_bytes", std::to_string(50 * kMiB) + "\n");
    fs.write("/sys/fs/cgroup/memory/pod/job/memory.stat",
             "hierarchical_memory_limit " + std::to_string(kGiB) + "\n");
    const std::optional<HostMemory> m = read_host_memory(fs.path());
    ASSERT_TRUE(m.has_value());
    EXPECT_EQ(m->cgroup, "/pod");
    EXPECT_EQ(m->headroom(), 74 * kMiB);
  }
  {
    FakeRoot fs;
    fs.meminfo(12000);
    fs.write("/proc/self/cgroup", "0::/job/leaf\n");
    fs.write("/sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n");
    fs.write("/sys/fs/cgroup/job/memory.max", std::to_string(kGiB) + "\n");
    fs.write("/sys/fs/cgroup/job/memory.current", std::to_string(600 * kMiB) + "\n");
    fs.write("/sys/fs/cgroup/job/leaf/cgroup.procs", "1\n");
    const std::optional<HostMemory> m = read_host_memory(fs.path());
    ASSERT_TRUE(m.has_value());
    EXPECT_TRUE(m->cgroup_limited);
    EXPECT_EQ(m->cgroup, "/job");
    EXPECT_EQ(m->headroom(), 424 * kMiB);
  }
}

TEST(HostMemory, CgroupV1UnlimitedBindsNothing) {
  FakeRoot fs;
  fs.meminfo(5000);
  fs.write("/proc/self/cgroup", "4:memory:/x\n");
  fs.write("/sys/fs/cgroup/memory/x/memory.limit_in_bytes", "9223372036854771712\n");
  fs.write("/sys/fs/cgroup/memory/x/memory.usage_in_bytes", std::to_string(15 * kGiB) + "\n");
  const std::optional<HostMemory> m = read_host_memory(fs.path());
  EXPECT_FALSE(m->cgroup_limited);
  EXPECT_EQ(m->headroom(), 5000 * kMiB);
}

TEST(HostMemory, AContainerSeesItsCgroupAsTheMountRoot) {
  // The path names the cgroup on the host; inside the container the mount is that cgroup.
  FakeRoot fs;
  fs.meminfo(9000);
  fs.write("/proc/self/cgroup", "7:memory:/docker/0123abcd\n");
  fs.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(kGiB) + "\n");
  fs.write("/sys/fs/cgroup/memory/memory.usage_in_bytes", std::to_string(100 * kMiB) + "\n");
  const std::optional<HostMemory> m = read_host_memory(fs.path());
  EXPECT_TRUE(m->cgroup_limited);
  EXPECT_EQ(m->cgroup, "/");
  EXPECT_EQ(m->headroom(), 924 * kMiB);
}

TEST(HostMemory, ReserveIsAThirtySecondWithinBounds) {
  EXPECT_EQ(host_memory_reserve(kGiB), 256 * kMiB);
  EXPECT_EQ(host_memory_reserve(24 * kGiB), 768 * kMiB);
  EXPECT_EQ(host_memory_reserve(size_t{512} * kGiB), 2 * kGiB);
}

TEST(HostMemory, ThisMachineIsRead) {
  const std::optional<HostMemory> m = read_host_memory();
  ASSERT_TRUE(m.has_value()) << "/proc/meminfo unreadable";
  EXPECT_GT(m->total, 0u);
  EXPECT_LE(m->available, m->total);
  EXPECT_LE(m->headroom(), m->available);
}

// The host tier without a budget refuses, as out of memory in the machine, a block the
// machine cannot hold beside the reserve, which mmap alone would grant (overcommit) and the
// kernel would kill the process for on first touch; with the check off it is mapped.
TEST(HostMemory, TheHostTierRefusesWhatTheMachineCannotHold) {
  const HostMemory m = *read_host_memory();
  const size_t reserve = host_memory_reserve(m.limit());
  // Past what the machine leaves free but within what the kernel's default overcommit
  // heuristic maps (MemTotal plus swap), so mmap alone would succeed.
  const size_t request = m.headroom() - reserve / 2;
  MemoryConfig config;
  MemoryManager mm(config);
  const TierStats before = mm.stats(Tier::kHost);
  try {
    void* p = mm.allocate(request, Tier::kHost);
    mm.free(p);
    FAIL() << "allocated " << format_bytes(request) << " with " << m.describe();
  } catch (const OutOfTierMemory& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(e.system());
    EXPECT_EQ(e.tier(), Tier::kHost);
    EXPECT_NE(msg.find("Tier 'host' of superchip:0 cannot take it: tried to allocate " +
                       format_bytes(request) + " (capacity unlimited"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("this machine cannot hold it: "), std::string::npos) << msg;
    EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
    EXPECT_NE(msg.find("of which superchip leaves " + format_bytes(reserve) + " free"), std::string::npos) << msg;
    EXPECT_NE(msg.find("SUPERCHIP_HOST_MEMORY_CHECK=0"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("raise SUPERCHIP_HOST_BYTES"), std::string::npos) << msg;  // would not help
  }
  const TierStats after = mm.stats(Tier::kHost);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.num_ooms, before.num_ooms + 1);
  // Placement names both tiers and keeps the machine's advice.
  MemoryManager placed(MemoryConfig{});
  placed.set_capacity(Tier::kHbm, 4 * kMiB);
  try {
    placed.allocate_placed(request);
    FAIL() << "placed " << format_bytes(request);
  } catch (const OutOfTierMemory& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(e.system());
    EXPECT_NE(msg.find("Neither tier of superchip:0 can take it"), std::string::npos) << msg;
    EXPECT_NE(msg.find("this machine cannot hold it"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("raise a budget"), std::string::npos) << msg;
  }
  // With the check off the block is mapped (never touched here, so it costs nothing), where
  // the kernel maps lazily (overcommit_memory 0 or 1).
  std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
  int mode = -1;
  overcommit >> mode;
  if (mode == 0 || mode == 1) {
    MemoryConfig unchecked;
    unchecked.check_host_memory = false;
    MemoryManager off(unchecked);
    void* p = off.allocate(request, Tier::kHost);
    EXPECT_NE(p, nullptr);
    off.free(p);
  }
}

// Note [Blocks mapped and not yet written]: a mapped block takes nothing from MemAvailable
// until its pages are written, so blocks mapped earlier (torch.empty of a buffer filled later)
// used to be invisible to the next request once the figures were read again: three blocks of
// 40% of the headroom, 60 ms apart, were all granted. Now the third is refused, naming what
// the unwritten blocks will take, and a block released stops counting. Nothing is written
// here past 64 MiB, so the test costs no memory.
TEST(HostMemory, BlocksMappedAndNotWrittenCountAgainstTheNext) {
  const HostMemory m = *read_host_memory();
  const size_t reserve = host_memory_reserve(m.limit());
  ASSERT_GT(m.headroom(), reserve + 64 * kMiB) << m.describe();
  const size_t request = ((m.headroom() - reserve) / 5 * 2) / kMiB * kMiB;  // 40%
  const auto past_cache = [] { std::this_thread::sleep_for(std::chrono::milliseconds(60)); };
  MemoryManager mm(MemoryConfig{});
  void* a = mm.allocate(request, Tier::kHost);
  past_cache();
  void* b = mm.allocate(request, Tier::kHost);
  past_cache();
  EXPECT_GE(host_blocks_unwritten_bytes(), 2 * request);
  try {
    void* c = mm.allocate(request, Tier::kHost);
    mm.free(c);
    FAIL() << "a third block of " << format_bytes(request) << " granted with " << m.describe();
  } catch (const OutOfTierMemory& e) {
    EXPECT_TRUE(e.system());
    EXPECT_NE(std::string(e.what()).find("that superchip's blocks will take when their pages are first written"),
              std::string::npos)
        << e.what();
  }
  // Released (freed, then the cache emptied), a block no longer counts.
  mm.free(b);
  mm.empty_cache();
  past_cache();
  void* c = mm.allocate(request, Tier::kHost);
  mm.free(c);
  mm.free(a);
  mm.empty_cache();
}

// A block whose pages are all written leaves the list: the figures count it from then on.
TEST(HostMemory, AWrittenBlockStopsCountingAsUnwritten) {
  MemoryManager mm(MemoryConfig{});
  const size_t before = host_blocks_unwritten_bytes();
  void* p = mm.allocate(64 * kMiB, Tier::kHost);
  EXPECT_GE(host_blocks_unwritten_bytes(), before + 64 * kMiB);
  std::memset(p, 1, 32 * kMiB);
  const size_t half = host_blocks_unwritten_bytes();
  EXPECT_GE(half, before + 16 * kMiB);  // the other half is still to come (THP may fault ahead)
  EXPECT_LT(half, before + 64 * kMiB);
  std::memset(p, 1, 64 * kMiB);
  EXPECT_EQ(host_blocks_unwritten_bytes(), before);
  mm.free(p);
  mm.empty_cache();
}

}  // namespace
}  // namespace superchip
