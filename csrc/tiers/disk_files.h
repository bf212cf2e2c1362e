// The files of the disk tier, one per paused allocation, and the directory holding them:
// what may serve as that directory, what the files are called, how a file's owner proves it
// is alive, and the removal of files no live process holds.
//
// A file's owner holds a shared flock on it for the file's whole life: the kernel drops it
// when the owner dies (kill -9 included), in any pid namespace, so a file is stale exactly
// when its lock can be taken. Its name says which process made it (pid and start time,
// unique on this boot) and where: the "host" part (a hash of the boot and the pid namespace)
// keeps files of other machines sharing the directory, other containers or an earlier boot
// out of this process's hands. Names and messages are those the Python side used to make,
// so files of earlier versions are recognised.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "platform/status.h"

namespace tmsl {

// The type of the file system holding `path` (from /proc/self/mountinfo), "unknown" if none.
std::string filesystem_type(const std::string& path);

// Why `path` cannot hold disk backups ("" where it can, or where it does not exist yet but
// could be made). Changes nothing.
std::string directory_problem(const std::string& path);

// Creates `path` if needed and checks it is on a disk; *real: its real path. The failure
// (kInvalidArgument) says why, in the words directory_problem uses.
Status check_directory(const std::string& path, std::string* real);

// This boot of this machine and this pid namespace, as 8 hex digits (the names' host part).
std::string host_id();

// The tag as file names show it: ASCII letters, digits, '_' and '.' as they are, any other
// byte as %XX (so '/' cannot make a path and two tags never share a name); cut to 64
// characters with a hash of the whole tag if longer.
std::string safe_tag(const std::string& tag);

// tmsl-<pid>-<start>-<host>-<tag>-dev<N>-<address>.bin: the name of the file that holds the
// allocation at `address` of this process while it is paused.
std::string disk_file_name(const std::string& tag, int device, uintptr_t address);

// Takes the owner's hold on the file open at `fd` (a shared flock, kept until fd is
// closed); false when a cleaner removed it before the lock was taken (make it again).
bool hold_file(int fd);

// What remove_stale_files did, for the caller to tell the user.
struct StaleFiles {
  size_t removed = 0, removed_bytes = 0, foreign = 0;
  // The warning about removed files and the note about foreign ones ("" for none).
  std::string removed_notice(const std::string& directory) const;
  std::string foreign_notice(const std::string& directory) const;
};

// Removes the backup files in `directory` of this machine (this boot and pid namespace) that
// no process holds any more: what a process killed before it could clean up left. Files a
// live process holds are kept, whatever its pid looks like from here, and so are files of
// other machines, boots or containers.
StaleFiles remove_stale_files(const std::string& directory);

// The SHA-1 of `data`, in hex (names only, never a check of content).
std::string sha1_hex(const std::string& data);

}  // namespace tmsl
