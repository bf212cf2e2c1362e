// Who a process is and whether it still lives: the one owner of both for the node's files;
// and whose a file of the node is (private_to_this_user: the one trust check of the ledger and
// the store, both in /dev/shm, which every user may write).
//
// Identity: a pid with its start time (clock ticks after boot, /proc/<pid>/stat field 22), so a
// pid reused by a new process is not taken for the old one.
// Liveness: a process lives while it holds its POSIX record lock on a range of a shared file.
// The kernel drops it when the process dies (kill -9, a zombie included), a forked child does
// not inherit it, and it is seen across PID namespaces that share the file, where /proc is not.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>

namespace tmsl {

// When `pid` started; 0 when it is gone or /proc cannot tell.
uint64_t process_start_time(pid_t pid);

// Takes the record lock on [start, start + length) of `fd` for this process without waiting;
// false while another process holds it (or no lock can be had).
bool claim_range(int fd, off_t start, off_t length);

// Whether a live process holds the record lock on that range; true when it cannot be told
// (a share is never taken from a process that may be alive).
bool range_held(int fd, off_t start, off_t length);

// Takes a shared record lock on [start, start + length) of `fd` (open for reading) for this
// process: many holders at once, each dropped when its process dies. (As every record lock,
// closing any descriptor of the file in this process drops it: open such files once.)
bool hold_range_shared(int fd, off_t start, off_t length);

// Whether a process of another PID namespace holds a record lock on that range of `fd`. The
// kernel says the holder's pid as this namespace numbers it (0 where it cannot see it: a
// parent or sibling namespace's), and /proc says in which namespace that process lives (a
// child namespace's are seen from here too). false where nobody holds one: a process's record
// locks on a file go whenever it closes any descriptor of it, so a holder of this namespace
// may have lost its own, and nothing then says the file is another namespace's.
bool held_in_another_pid_namespace(int fd, off_t start, off_t length);

// Whether a file (or directory) of /dev/shm, which every user may write, can be trusted: this
// user's (the effective one), and nobody else may write it.
bool private_to_this_user(const struct stat& st);

}  // namespace tmsl
