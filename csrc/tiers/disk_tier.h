// The disk tier: a paused allocation's content in a file of its own (disk_files.h) instead
// of host memory, for hosts whose RAM cannot hold the backups.
//
// A save preallocates every file first (a full disk fails before anything is written), then
// moves the content in chunks on worker threads, each through a page-locked staging buffer
// of one chunk: device -> staging on the backend's copy stream (the one host backups use),
// staging -> file. A load runs the other way. The staging buffers are host memory of the
// backup tiers inside the node's budget: the pool's (back to it when the call ends), else
// fresh and never pooled (freed, out of the budget, when the call ends: staging never
// lingers counted against the process). Files are opened with O_DIRECT where the file system allows it (no page
// cache: host memory stays free and the disk's own speed is what counts), through the page
// cache otherwise (said once).
//
// A file lives from the save that wrote it until its DiskFile goes (a resume that read it
// back, a free, the saver's end); the process's exit removes what is left.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "platform/backend.h"
#include "platform/status.h"
#include "tiers/backup_tiers.h"

namespace tmsl {

// One allocation's content on disk: the file, held open (and locked, its owner's liveness)
// until this object goes, which removes it (only in the process that made it).
class DiskFile {
 public:
  DiskFile(std::string path, int fd, size_t size);
  ~DiskFile();
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;
  const std::string& path() const { return path_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // Whether this process made it (a forked child must not remove its parent's files).
  bool made_here() const;

 private:
  const std::string path_;
  const int fd_;
  const size_t size_;
  const int pid_;  // a forked child must not remove its parent's files
};

// What a save or load moves: `size` bytes of mapped memory at `va` on `device`.
struct DiskRange {
  uintptr_t va = 0;
  size_t size = 0;
  int device = 0;
  std::string tag;
};

// Chunk size and worker count (environment.h's disk_backup_settings, read at each pause).
struct DiskSettings {
  size_t chunk_bytes = 64 << 20;
  size_t workers = 4;
};

class DiskTier {
 public:
  // Checks `path` (check_directory: made if missing, refused on host memory or unwritable)
  // and removes the stale files there. What the user should hear of it is in notices().
  static Status open(std::shared_ptr<Backend> backend, const std::string& path, std::shared_ptr<DiskTier>* out);
  ~DiskTier();

  const std::string& directory() const { return directory_; }

  // Writes each range to a new file; *files gets them in order. The memory is only read.
  // On failure no file is left and the error names the tag, the size and the directory.
  // Staging memory comes from `tiers`.
  Status save(const std::vector<DiskRange>& ranges, const DiskSettings& settings, BackupTiers& tiers,
              std::vector<std::shared_ptr<DiskFile>>* files);
  // Reads each file back into its range (mapped again, of the file's size). The files stay.
  // `lent`: staging buffers the caller lends instead of asking `tiers` (page-locked host
  // memory it may overwrite), when the budget has no room left.
  Status load(const std::vector<DiskRange>& ranges, const std::vector<DiskFile*>& files,
              const DiskSettings& settings, BackupTiers& tiers, const std::vector<HostBuffer>* lent = nullptr);

  // What happened that the user should hear of (stale files removed, O_DIRECT refused),
  // taken once.
  std::vector<std::string> take_notices();
  // Adds a notice (the saver's: what the budget sent here).
  void note(std::string text);

  // Whether files here are opened with O_DIRECT (false once the file system refused it).
  bool direct() const { return direct_.load(); }

 private:
  DiskTier(std::shared_ptr<Backend> backend, std::string directory);
  // Creates, holds and preallocates the file for `range`.
  Status create(const DiskRange& range, std::shared_ptr<DiskFile>* file);
  int open_file(const std::string& path, int flags);
  // Runs the chunks of every range on the workers, each with its own staging buffer.
  Status transfer(const std::vector<DiskRange>& ranges, const std::vector<int>& fds, bool to_disk,
                  const DiskSettings& settings, BackupTiers& tiers, const std::vector<HostBuffer>* lent);

  const std::shared_ptr<Backend> backend_;
  const std::string directory_;
  std::atomic<bool> direct_{true};
  std::mutex notices_mu_;
  std::vector<std::string> notices_;
};

}  // namespace tmsl
