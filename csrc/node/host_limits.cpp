#include "node/host_limits.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <vector>

namespace tmsl {
namespace {

// A limit file's value; 0 when absent, "max" or unparsable (no limit).
size_t read_limit(const std::string& path) {
  std::ifstream file(path);
  std::string text;
  if (!(file >> text) || text == "max") return 0;
  try {
    return static_cast<size_t>(std::stoull(text));
  } catch (...) {
    return 0;
  }
}

// "MemTotal:  123 kB" -> bytes, for each field asked; 0 when absent.
size_t meminfo_bytes(const std::string& root, const std::string& field) {
  std::ifstream file(root + "/proc/meminfo");
  std::string name;
  size_t kib = 0;
  std::string unit;
  while (file >> name >> kib >> unit) {
    if (name == field + ":") return kib * 1024;
  }
  return 0;
}

// The least limit in `file_name` along `cgroup` (a path like "/a/b") and its ancestors
// under `mount`.
size_t cgroup_limit(const std::string& mount, std::string cgroup, const std::string& file_name) {
  size_t least = 0;
  while (true) {
    size_t limit = read_limit(mount + (cgroup == "/" ? "" : cgroup) + "/" + file_name);
    if (limit != 0 && (least == 0 || limit < least)) least = limit;
    if (cgroup.empty() || cgroup == "/") break;
    size_t slash = cgroup.rfind('/');
    cgroup = slash == 0 || slash == std::string::npos ? "/" : cgroup.substr(0, slash);
  }
  return least;
}

}  // namespace

size_t host_memory_limit(const std::string& root) {
  std::vector<size_t> known;
  for (const char* field : {"MemTotal", "MemAvailable"}) known.push_back(meminfo_bytes(root, field));
  // /proc/self/cgroup: "0::/path" (v2), "4:memory:/path" or "3:cpu,memory:/path" (v1).
  std::ifstream cgroups(root + "/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    size_t first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (controllers.empty()) {
      known.push_back(cgroup_limit(root + "/sys/fs/cgroup", path, "memory.max"));
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      known.push_back(cgroup_limit(root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes"));
    }
  }
  size_t least = 0;
  for (size_t value : known) {
    if (value != 0 && (least == 0 || value < least)) least = value;
  }
  return least;
}

}  // namespace tmsl
