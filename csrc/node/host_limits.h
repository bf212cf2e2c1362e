// How much host memory this process may use, for the host cache's default budget.
#pragma once

#include <cstddef>
#include <string>

namespace tmsl {

// The least of: the machine's memory (MemTotal), the memory available now (MemAvailable),
// and the limits of this process's memory cgroup and its ancestors (cgroup v2 memory.max,
// v1 memory.limit_in_bytes). sysconf alone sees the host's RAM, not a container's share.
// `root` prefixes every path read ("" in production; a fake tree in tests). 0: nothing known.
size_t host_memory_limit(const std::string& root = "");

}  // namespace tmsl
