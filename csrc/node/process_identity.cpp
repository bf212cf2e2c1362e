#include "node/process_identity.h"

#include <fcntl.h>

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

}  // namespace tmsl
