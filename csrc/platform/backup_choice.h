// How a region's allocations are kept across a pause: a value the environment's defaults,
// the ABI and the core share, so it lives below all of them.
#pragma once

namespace tmsl {

// How a region's allocations are kept across a pause; each allocation keeps the choice of
// the region it was made in. kAuto (a region's default) follows the tag's first explicit
// choice, and otherwise backs up only once the tag holds graph memory: a CUDA graph captured
// while one of the tag's regions was open reads state written at capture time that replays
// never rewrite, so releasing it without a copy would make later replays compute something
// else. kOnUncached backs up like kOn, but gives the host memory back at every resume
// (cpu_backup_backend "mmap"). kDisk: no host copy; the Python side writes it to a file.
enum class BackupChoice : int { kAuto = -1, kOff = 0, kOn = 1, kOnUncached = 2, kDisk = 3 };
constexpr int kMaxBackupChoice = 3;

}  // namespace tmsl
