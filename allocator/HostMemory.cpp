#include "allocator/HostMemory.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "allocator/MemoryManager.h"

namespace superchip {

namespace {

constexpr size_t kUnlimited = std::numeric_limits<size_t>::max();

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

// A decimal unsigned integer at the start of `text` (after blanks); nullopt for anything else
// ("max" included).
std::optional<size_t> parse_number(const std::string& text) {
  const char* begin = text.c_str();
  while (*begin == ' ' || *begin == '\t') begin++;
  if (*begin < '0' || *begin > '9') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(begin, &end, 10);
  if (errno != 0 || end == begin) return std::nullopt;
  return static_cast<size_t>(v);
}

// The value of `key` in a "key value" or "Key: value kB" listing (meminfo, memory.stat),
// in bytes when the line says kB.
std::optional<size_t> field(const std::string& text, const std::string& key) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    size_t pos = key.size();
    if (pos < line.size() && line[pos] == ':') pos++;
    if (pos >= line.size() || (line[pos] != ' ' && line[pos] != '\t')) continue;
    std::optional<size_t> v = parse_number(line.substr(pos));
    if (v && line.find("kB") != std::string::npos) *v *= 1024;
    return v;
  }
  return std::nullopt;
}

std::optional<size_t> file_number(const std::string& path) {
  const std::optional<std::string> text = read_text(path);
  return text ? parse_number(*text) : std::nullopt;
}

// The process's cgroup paths: the v2 one ("0::/path") and the v1 memory controller's.
struct CgroupPaths {
  std::optional<std::string> v2;
  std::optional<std::string> v1_memory;
};

CgroupPaths cgroup_paths(const std::string& root) {
  CgroupPaths paths;
  const std::optional<std::string> text = read_text(root + "/proc/self/cgroup");
  if (!text) return paths;
  std::istringstream lines(*text);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a);
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {
      paths.v2 = path;
      continue;
    }
    std::istringstream names(controllers);
    std::string name;
    while (std::getline(names, name, ',')) {
      if (name == "memory") paths.v1_memory = path;
    }
  }
  return paths;
}

// The directory of the process's cgroup under `mount`, or `mount` itself when that path is
// not there (a container sees its own cgroup as the root of the mount). The directory, not a
// file in it: a v2 cgroup whose parent does not enable the memory controller for its children
// has no memory.max of its own, and its ancestors' limits still bind.
std::string cgroup_dir(const std::string& mount, const std::string& path) {
  const std::string dir = path == "/" ? mount : mount + path;
  return exists(dir) ? dir : mount;
}

std::string cgroup_name(const std::string& mount, const std::string& dir) {
  return dir.size() > mount.size() ? dir.substr(mount.size()) : "/";
}

struct Bound {
  size_t limit = kUnlimited;
  size_t used = 0;
  std::string where;
  size_t room() const noexcept { return limit - std::min(used, limit); }
};

// v2: every cgroup from the process's up to the mount's root may have a memory.max; the one
// leaving the least room binds.
std::optional<Bound> cgroup_v2_bound(const std::string& root, const std::string& path) {
  for (const char* m : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
    const std::string mount = root + m;
    const std::optional<std::string> controllers = read_text(mount + "/cgroup.controllers");
    if (!controllers || controllers->find("memory") == std::string::npos) continue;
    std::optional<Bound> best;
    std::string dir = cgroup_dir(mount, path);
    while (true) {
      const std::optional<size_t> limit = file_number(dir + "/memory.max");
      const std::optional<size_t> current = file_number(dir + "/memory.current");
      if (limit && current) {
        Bound b;
        b.limit = *limit;
        const std::optional<std::string> stat = read_text(dir + "/memory.stat");
        const size_t inactive = stat ? field(*stat, "inactive_file").value_or(0) : 0;
        b.used = *current - std::min(inactive, *current);
        b.where = cgroup_name(mount, dir);
        if (!best || b.room() < best->room()) best = b;
      }
      if (dir.size() <= mount.size()) break;
      dir = dir.substr(0, dir.rfind('/'));
    }
    return best;
  }
  return std::nullopt;
}

// v1: each cgroup from the process's up to the mount's root, its memory.limit_in_bytes
// against its own usage (which includes its children's, siblings of the process's cgroup too);
// and the hierarchical_memory_limit of the process's cgroup, which also carries the limits of
// ancestors the mount does not show (a container), against the usage known there. The one
// leaving the least room binds.
std::optional<Bound> cgroup_v1_bound(const std::string& root, const std::string& path) {
  const std::string mount = root + "/sys/fs/cgroup/memory";
  std::optional<Bound> best;
  std::string dir = cgroup_dir(mount, path);
  bool leaf = true;
  while (true) {
    const std::optional<size_t> limit = file_number(dir + "/memory.limit_in_bytes");
    const std::optional<size_t> usage = file_number(dir + "/memory.usage_in_bytes");
    if (limit && usage) {
      const std::optional<std::string> stat = read_text(dir + "/memory.stat");
      const size_t inactive = stat ? field(*stat, "total_inactive_file").value_or(0) : 0;
      Bound b;
      b.limit = *limit;
      if (leaf && stat) {
        if (const std::optional<size_t> h = field(*stat, "hierarchical_memory_limit")) {
          b.limit = std::min(b.limit, *h);
        }
      }
      b.used = *usage - std::min(inactive, *usage);
      b.where = cgroup_name(mount, dir);
      if (!best || b.room() < best->room()) best = b;
    }
    leaf = false;
    if (dir.size() <= mount.size()) break;
    dir = dir.substr(0, dir.rfind('/'));
  }
  return best;
}

}  // namespace

size_t HostMemory::headroom() const noexcept {
  if (!cgroup_limited) return available;
  return std::min(available, cgroup_limit - std::min(cgroup_used, cgroup_limit));
}

size_t HostMemory::limit() const noexcept {
  return cgroup_limited ? std::min(total, cgroup_limit) : total;
}

std::string HostMemory::describe() const {
  std::string s = format_bytes(headroom()) + " available to this process (";
  if (cgroup_limited) {
    s += "memory cgroup " + cgroup + ": limit " + format_bytes(cgroup_limit) + ", " +
         format_bytes(cgroup_used) + " in use; ";
  }
  return s + "MemAvailable " + format_bytes(available) + " of " + format_bytes(total) + ")";
}

std::optional<HostMemory> read_host_memory(const std::string& root) {
  const std::optional<std::string> meminfo = read_text(root + "/proc/meminfo");
  if (!meminfo) return std::nullopt;
  const std::optional<size_t> total = field(*meminfo, "MemTotal");
  const std::optional<size_t> available = field(*meminfo, "MemAvailable");
  if (!total || !available) return std::nullopt;
  HostMemory m;
  m.total = *total;
  m.available = *available;
  const CgroupPaths paths = cgroup_paths(root);
  std::optional<Bound> bound;
  if (paths.v2) bound = cgroup_v2_bound(root, *paths.v2);
  if (!bound && paths.v1_memory) bound = cgroup_v1_bound(root, *paths.v1_memory);
  // A limit at or above the machine's memory (v1 writes "unlimited" as a huge number) binds
  // nothing MemAvailable does not.
  if (bound && bound->limit < m.total) {
    m.cgroup_limited = true;
    m.cgroup = bound->where;
    m.cgroup_limit = bound->limit;
    m.cgroup_used = bound->used;
  }
  return m;
}

size_t host_memory_reserve(size_t limit) noexcept {
  constexpr size_t kMin = size_t{256} << 20;
  constexpr size_t kMax = size_t{2} << 30;
  return std::clamp(limit / 32, kMin, kMax);
}

}  // namespace superchip
