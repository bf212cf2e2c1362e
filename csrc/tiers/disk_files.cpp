#include "tiers/disk_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "node/process_identity.h"

namespace tmsl {
namespace {

constexpr size_t kTagChars = 64;  // a longer (escaped) tag is cut, with a hash of the whole

// A path as Python's repr shows it, which the messages have always used.
std::string quoted(const std::string& path) {
  const bool doubles = path.find('\'') != std::string::npos && path.find('"') == std::string::npos;
  const char q = doubles ? '"' : '\'';
  std::string out(1, q);
  for (char c : path) {
    if (c == q || c == '\\') out += '\\';
    out += c;
  }
  return out + q;
}

// mountinfo writes space, tab, newline and backslash as \ooo.
std::string unescape_mount(const std::string& field) {
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() && isdigit(field[i + 1]) && isdigit(field[i + 2]) &&
        isdigit(field[i + 3])) {
      out += static_cast<char>(strtol(field.substr(i + 1, 3).c_str(), nullptr, 8));
      i += 3;
    } else {
      out += field[i];
    }
  }
  return out;
}

std::string real_path(const std::string& path) {
  // Like os.path.realpath: the part that exists resolved, the rest appended.
  char buffer[PATH_MAX];
  if (realpath(path.c_str(), buffer) != nullptr) return buffer;
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return real_path(".") + "/" + path;
  if (slash == 0) return path;
  return real_path(path.substr(0, slash)) + path.substr(slash);
}

const std::set<std::string>& memory_file_systems() {
  static const std::set<std::string> kinds{"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"};
  return kinds;
}

}  // namespace

std::string filesystem_type(const std::string& path) {
  const std::string target = real_path(path);
  std::ifstream mounts("/proc/self/mountinfo");
  std::string line, best, kind = "unknown";
  bool found = false;
  while (std::getline(mounts, line)) {
    std::istringstream in(line);
    std::vector<std::string> fields;
    for (std::string f; in >> f;) fields.push_back(f);
    size_t dash = 0;
    while (dash < fields.size() && fields[dash] != "-") ++dash;
    if (fields.size() < 5 || dash + 1 >= fields.size()) continue;
    const std::string mount_point = unescape_mount(fields[4]);
    std::string prefix = mount_point;
    while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
    const bool inside = target == mount_point || target.compare(0, prefix.size() + 1, prefix + "/") == 0;
    if (inside && (!found || mount_point.size() >= best.size())) {
      best = mount_point, kind = fields[dash + 1], found = true;
    }
  }
  return kind;
}

std::string directory_problem(const std::string& path) {
  const std::string kind = filesystem_type(path);
  if (memory_file_systems().count(kind) != 0) {
    return "the disk backup directory " + quoted(path) + " is on " + kind +
           ", which is host memory: a disk backup there saves nothing; choose a directory on a real disk, or use "
           "enable_cpu_backup=True";
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return "";  // made by check_directory (which says why, should that fail)
    return "the disk backup directory " + quoted(path) + " cannot be used: " + strerror(errno) + " (errno " +
           std::to_string(errno) + ")";
  }
  if (!S_ISDIR(st.st_mode)) return "the disk backup directory " + quoted(path) + " is not a directory";
  if (access(path.c_str(), W_OK | X_OK) != 0) return "the disk backup directory " + quoted(path) + " is not writable";
  return "";
}

Status check_directory(const std::string& path, std::string* real) {
  if (path.empty()) return Status::Error(Code::kInvalidArgument, "the disk backup directory must be a path, got ''");
  std::string problem = directory_problem(path);  // before mkdir: a refused directory is not left behind
  if (!problem.empty()) return Status::Error(Code::kInvalidArgument, problem);
  // mkdir -p
  for (size_t at = path.find('/', 1);; at = path.find('/', at + 1)) {
    const std::string part = at == std::string::npos ? path : path.substr(0, at);
    if (!part.empty() && mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
      const int err = errno;
      return Status::Error(Code::kInvalidArgument, "cannot create the disk backup directory " + quoted(path) +
                                                       ": [Errno " + std::to_string(err) + "] " + strerror(err) +
                                                       ": " + quoted(part));
    }
    if (at == std::string::npos) break;
  }
  problem = directory_problem(path);
  if (!problem.empty()) return Status::Error(Code::kInvalidArgument, problem);
  *real = real_path(path);
  return Status::Ok();
}

std::string host_id() {
  static const std::string id = [] {
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string boot_id;
    char ns[256];
    const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
    if (!std::getline(boot, boot_id) || n <= 0) {
      // Unknown: a name no other process shares, so none judges another's files.
      std::random_device random;
      return sha1_hex(std::to_string(random()) + std::to_string(random()) + std::to_string(getpid())).substr(0, 8);
    }
    while (!boot_id.empty() && isspace(static_cast<unsigned char>(boot_id.back()))) boot_id.pop_back();
    return sha1_hex(boot_id + std::string(ns, static_cast<size_t>(n))).substr(0, 8);
  }();
  return id;
}

std::string safe_tag(const std::string& tag) {
  std::vector<std::string> parts;  // one per character (a UTF-8 sequence escaped whole)
  size_t length = 0;
  for (size_t i = 0; i < tag.size();) {
    const unsigned char c = static_cast<unsigned char>(tag[i]);
    std::string part;
    if (isalnum(c) || c == '_' || c == '.') {
      part = std::string(1, static_cast<char>(c));
      ++i;
    } else {
      size_t n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      for (size_t k = 0; k < n && i < tag.size(); ++k, ++i) {
        char hex[4];
        snprintf(hex, sizeof(hex), "%%%02X", static_cast<unsigned char>(tag[i]));
        part += hex;
      }
    }
    length += part.size();
    parts.push_back(std::move(part));
  }
  std::string out;
  if (length <= kTagChars) {
    for (const auto& part : parts) out += part;
    return out;
  }
  for (const auto& part : parts) {
    if (out.size() + part.size() > kTagChars - 13) break;
    out += part;
  }
  return out + "~" + sha1_hex(tag).substr(0, 12);
}

std::string disk_file_name(const std::string& tag, int device, uintptr_t address) {
  // (The start time only tells names apart, a pid reused later getting others; never liveness.)
  static const uint64_t start = process_start_time(getpid());
  char tail[64];
  snprintf(tail, sizeof(tail), "-dev%d-%llx.bin", device, static_cast<unsigned long long>(address));
  return "tmsl-" + std::to_string(getpid()) + "-" + std::to_string(start) + "-" + host_id() + "-" + safe_tag(tag) +
         tail;
}

bool hold_file(int fd) {
  while (flock(fd, LOCK_SH) != 0 && errno == EINTR) {
  }  // waits while a cleaner looks at it
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_nlink > 0;
}

namespace {

// Removes the file at `path` if no process holds it; its size, or -1 if kept.
long long remove_if_unheld(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -1;  // removed meanwhile, or not ours to open
  long long size = -1;
  struct stat held, named;
  if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &held) == 0 && lstat(path.c_str(), &named) == 0 &&
      held.st_nlink > 0 && held.st_dev == named.st_dev && held.st_ino == named.st_ino &&
      unlink(path.c_str()) == 0) {
    size = held.st_size;  // else held by a live process, removed or replaced meanwhile
  }
  close(fd);
  return size;
}

}  // namespace

StaleFiles remove_stale_files(const std::string& directory) {
  static const std::regex name(R"(tmsl-(\d+)-(\d+)-([0-9a-f]{8})-.+-dev\d+-[0-9a-f]+\.bin)");
  StaleFiles result;
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return result;
  std::vector<std::string> names;
  while (dirent* entry = readdir(dir)) names.push_back(entry->d_name);
  closedir(dir);
  for (const auto& file : names) {
    std::smatch match;
    if (!std::regex_match(file, match, name)) continue;
    if (match[3] != host_id()) {
      ++result.foreign;
      continue;
    }
    const long long size = remove_if_unheld(directory + "/" + file);
    if (size >= 0) result.removed++, result.removed_bytes += static_cast<size_t>(size);
  }
  return result;
}

std::string StaleFiles::removed_notice(const std::string& directory) const {
  if (removed == 0) return "";
  char text[64];
  snprintf(text, sizeof(text), "%zu disk backup files (%.0f MiB)", removed, removed_bytes / 1048576.0);
  return std::string("removed ") + text + " in " + directory + " left by processes that no longer exist";
}

std::string StaleFiles::foreign_notice(const std::string& directory) const {
  if (foreign == 0) return "";
  return std::to_string(foreign) + " disk backup files in " + directory +
         " belong to another machine, boot or container; left alone (remove them by hand if nothing else uses "
         "this directory)";
}

std::string sha1_hex(const std::string& data) {
  uint32_t h[5] = {0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0};
  std::string msg = data;
  const uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  msg += static_cast<char>(0x80);
  while (msg.size() % 64 != 56) msg += '\0';
  for (int i = 7; i >= 0; --i) msg += static_cast<char>((bits >> (i * 8)) & 0xFF);
  auto rol = [](uint32_t x, int n) { return (x << n) | (x >> (32 - n)); };
  for (size_t block = 0; block < msg.size(); block += 64) {
    uint32_t w[80];
    for (int i = 0; i < 16; ++i) {
      const auto* p = reinterpret_cast<const unsigned char*>(msg.data() + block + 4 * i);
      w[i] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
    }
    for (int i = 16; i < 80; ++i) w[i] = rol(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
    for (int i = 0; i < 80; ++i) {
      uint32_t f, k;
      if (i < 20) f = (b & c) | (~b & d), k = 0x5A827999;
      else if (i < 40) f = b ^ c ^ d, k = 0x6ED9EBA1;
      else if (i < 60) f = (b & c) | (b & d) | (c & d), k = 0x8F1BBCDC;
      else f = b ^ c ^ d, k = 0xCA62C1D6;
      const uint32_t t = rol(a, 5) + f + e + k + w[i];
      e = d, d = c, c = rol(b, 30), b = a, a = t;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e;
  }
  char hex[41];
  for (int i = 0; i < 5; ++i) snprintf(hex + 8 * i, 9, "%08x", h[i]);
  return hex;
}

}  // namespace tmsl
