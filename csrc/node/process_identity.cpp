#include "node/process_identity.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace tmsl {

uint64_t process_start_time(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t name_end = text.rfind(')');  // the command name may hold spaces and parentheses
  if (name_end == std::string::npos || name_end + 2 > text.size()) return 0;
  std::istringstream fields(text.substr(name_end + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

namespace {

struct flock range(short type, off_t start, off_t length) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = start;
  lock.l_len = length;
  return lock;
}

}  // namespace

bool claim_range(int fd, off_t start, off_t length) {
  struct flock own = range(F_WRLCK, start, length);
  return fcntl(fd, F_SETLK, &own) == 0;
}

bool range_held(int fd, off_t start, off_t length) {
  struct flock probe = range(F_WRLCK, start, length);
  if (fcntl(fd, F_GETLK, &probe) != 0) return true;
  return probe.l_type != F_UNLCK;
}

bool hold_range_shared(int fd, off_t start, off_t length) {
  struct flock shared = range(F_RDLCK, start, length);
  return fcntl(fd, F_SETLK, &shared) == 0;
}

bool held_in_another_pid_namespace(int fd, off_t start, off_t length) {
  struct flock probe = range(F_WRLCK, start, length);  // (this process's own locks never conflict)
  if (fcntl(fd, F_GETLK, &probe) != 0) return true;  // cannot be told: not trusted
  if (probe.l_type == F_UNLCK) return false;
  if (probe.l_pid <= 0) return true;  // a holder this namespace cannot see
  // /proc numbers processes as the namespace it was mounted for does: only this one's will do.
  char self[32] = {};
  if (readlink("/proc/self", self, sizeof(self) - 1) <= 0 || std::strtol(self, nullptr, 10) != getpid()) return true;
  struct stat holder {}, own {};
  return !(stat(("/proc/" + std::to_string(probe.l_pid) + "/ns/pid").c_str(), &holder) == 0 &&
           stat("/proc/self/ns/pid", &own) == 0 && holder.st_ino == own.st_ino && holder.st_dev == own.st_dev);
}

bool private_to_this_user(const struct stat& st) {
  return st.st_uid == geteuid() && (st.st_mode & 022) == 0;
}

}  // namespace tmsl
