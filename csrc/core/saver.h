// The saver core: a table of the allocations made inside regions, keyed by virtual
// address, and the pause/resume operations over them. Backend-agnostic; thread-safe.
//
// Host copies are not in the table: the backup tiers own them (tiers/host_copies.h), keyed by
// the allocation's address, with the cache, spill and share policy (tiers/backup_tiers.h); the
// saver tells them, with values, what each pause, resume and free did, and asks them.
//
// Locking: `mu_` guards the table and every allocation's state; it is never held across
// backend calls. Pause and resume run one at a time (`op_mu_`); they mark the allocations
// they work on as pausing/resuming, and a free of such an allocation waits until the
// operation has settled it (`settled_`). Frees and allocations of other memory proceed.
// The tiers' locks are taken after mu_ where both are held, never before it.
//
// What it is handed when made (SaverSetup: the node's budget and store, the process defaults
// it keeps itself) comes from the api layer, which alone reads the process defaults.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/address_index.h"
#include "platform/backend.h"
#include "platform/backup_choice.h"
#include "platform/options.h"
#include "node/chunk_store.h"
#include "node/host_budget.h"
#include "tiers/backup.h"
#include "tiers/backup_tiers.h"
#include "tiers/disk_tier.h"
#include "core/mapping.h"
#include "core/stray_catcher.h"
#include "core/allocation.h"
#include "core/tag_info.h"
#include "core/wake_checks.h"
#include "platform/status.h"

namespace tmsl {

class CopyMarks;

// The refusal of an allocation in a paused tag (tag_catalogue.cpp).
Status tag_paused_error(const std::string& tag);


// What poison-on-resume writes into every byte: 0xFF.. is NaN in every float format.
constexpr unsigned char kPoisonByte = 0xFF;

// What one tag holds on one device (device -1: a tag with no allocation), with the tag's
// own facts repeated on each of its devices.
struct TagFigures {
  std::string tag;
  int device = -1;
  size_t allocations = 0, reserved = 0, resident = 0, paused_bytes = 0, host_backup = 0;
  size_t disk_backup = 0;  // paused bytes whose content is in disk files
  // Where the content of its paused allocations is, by their bytes (together: paused_bytes):
  // this process's host memory, the node's store (held once per node), disk files, nowhere.
  size_t paused_in_host = 0, paused_in_store = 0, paused_on_disk = 0, paused_discarded = 0;
  bool backs_up = false;  // a pause copies some of it to host memory
  TagInfo info;
};

// Which tags a pause or resume covers: all of them, or the ones named.
struct TagSelection {
  bool all = true;
  std::set<std::string> tags;
  bool matches(const std::string& tag) const { return all || tags.count(tag) != 0; }
};

// What the api layer hands a saver it makes, besides its backend (api/node_budget.h makes it
// from the process defaults, environment.h).
struct SaverSetup {
  HostBudget& budget;  // the node's host-memory budget its backups are taken from (outlives the saver)
  ChunkStore* store = nullptr;  // the node's store of shared backups (outlives it); nullptr: no sharing
  bool keeps_host_cache = true;  // false: its host cache starts at 0 bytes (TMSL_LIKE_TORCH_MEMORY_SAVER=1)
  bool log_allocations = false;  // TMSL_LOG_ALLOCATIONS: a line on stderr per allocation and free
};

class Saver {
 public:
  Saver(std::unique_ptr<Backend> backend, const SaverSetup& setup);
  // Gives back everything still held, paused or not.
  ~Saver();

  Backend& backend() { return *backend_; }

  // Checks that `tag` may take new allocations (it is not paused), and enters it in the
  // catalogue with its first explicit backup choice.
  Status enter_tag(const std::string& tag, BackupChoice backup);
  // Records that a CUDA graph is being captured while a region of `tag` is open: from now
  // on a pause backs the tag up unless it was entered with an explicit kOff.
  Status mark_graph_memory(const std::string& tag);
  // The tag's catalogue entry; false when no region or allocation has named it.
  bool tag_info(const std::string& tag, TagInfo* out) const;
  // A tag's own value of an option of kTagScope (options.h), from its next pause on; "" takes
  // it back (TagOptionValues: the saver's value or the default again). Enters the tag if new.
  Status set_tag_option(const std::string& tag, const OptionRow& row, const std::string& text);
  // The tag's own value of such an option as text ("" where it has none).
  Status tag_option(const std::string& tag, const OptionRow& row, std::string* out) const;
  // The stray writes seen in the tag's memory since last asked, where it is awake (0 while
  // paused: they are told at its resume), and the StrayMode its last pause began with.
  Status take_stray_writes(const std::string& tag, size_t* count, StrayMode* mode);
  // How many awake tags of `selection` have stray writes to tell.
  size_t stray_tags_to_tell(const TagSelection& selection) const;
  // The device memory the stray-access scratch holds on `device` (core/stray_catcher.h).
  size_t stray_scratch_bytes(int device) { return catcher_.bytes(device); }

  // The tag's allocations (address, size, device, the choice of the region that made it),
  // in address order.
  struct Range {
    uintptr_t va;
    size_t size;
    int device;
    BackupChoice choice;
  };
  std::vector<Range> allocations_of(const std::string& tag) const;

  // Admits the allocation as enter_tag does, then reserves and maps it.
  Status allocate(size_t size, int device, const std::string& tag, BackupChoice backup, uintptr_t* va);
  // Frees an allocation, paused or not. `stream` is the stream the memory was last used
  // on (torch passes it); only that stream is waited for, never the whole device.
  Status free(uintptr_t va, void* stream);

  // Waits for the devices' outstanding work, queues the copies of backed-up allocations to
  // pinned host memory (all of them, before anything is released), then unmaps and
  // releases the physical memory: allocations without backup at once, the others each as
  // soon as its own copy has landed. The VA stays reserved. Already paused allocations are
  // skipped. On error, every allocation is either still active with its content or paused
  // with a complete backup.
  Status pause(const TagSelection& selection);
  // Maps fresh physical memory at the same addresses and restores backed-up content (each
  // allocation's copy queued as soon as it is mapped);
  // with poison on, memory without a backup is filled with 0xFF bytes (NaN as floats).
  // All or nothing: on error (out of memory, say) whatever this call mapped is unmapped
  // again and everything it covered stays paused, backups intact; a later call can succeed.
  // Backups are freed in the background afterwards unless retention is on.
  Status resume(const TagSelection& selection);

  // Sets host memory aside, in the background, for the backups the next pause of
  // `selection` will take: for every resident allocation of a tag that is backed up and may
  // keep its backups cached, that has none yet, provided they all fit in the host cache
  // beside what it holds already. That pause then copies at once, instead of waiting for
  // fresh host memory to be faulted in and page-locked. Best effort: when the memory cannot
  // be had now, the pause takes it itself. Named tags no region has used are skipped.
  Status prepare_backups(const TagSelection& selection);

  // Bytes of paused allocations whose content a spill sent to disk.
  size_t spilled_bytes() const;

  // The disk tier (disk_tier.h): where allocations made with kDisk, and those the node's
  // budget cannot hold, keep their content while paused. `path` is checked (made if missing;
  // refused on host memory or unwritable) and its stale files removed; "" turns the tier off
  // for later pauses (files already written stay until read back); disk_notices() says what
  // the user should hear of (stale files removed). Once set, a pause writes the files itself: device ->
  // staging (host memory from the budget, on the copy stream) -> file, all before anything is
  // released; a resume reads them back and removes them; a free removes its file.
  Status set_disk_directory(const std::string& path);
  // The disk tier's directory ("" for none).
  std::string disk_directory() const;
  // What the disk tier has to tell since last asked (O_DIRECT refused, ...).
  std::vector<std::string> disk_notices();

  // Returns once the work handed to the background has run: backups freed, host memory
  // asked for by prepare_backups faulted in and page-locked.
  void wait_for_released_backups() { tiers_.background().wait_idle(); }

  // {"<tag>": {"allocations": n, "reserved_bytes": n, "resident_bytes": n,
  //            "paused_bytes": n, "host_backup_bytes": n, "paused": b, "graph_memory": b,
  //            "backs_up": b}, ...} for every tag in the catalogue
  // Per tag and device, in tag order then device order.
  std::vector<TagFigures> figures() const;

  // For [address, address + nbytes) inside one backed-up allocation: *host points at its
  // copy while paused (page-locked as one range, so one CUDA copy may cover it), nullptr
  // while resident. Waits for a pause or resume in progress.
  // *lease holds the copy's host memory: it stays valid while the lease lives, whatever
  // resumes and frees happen meanwhile.
  Status lease_backup(uintptr_t address, size_t nbytes, const void** host, HostBuffer* lease);

  // Whether [address, address + nbytes) overlaps an allocation that is not active (paused, or
  // being paused or resumed): true with its tag in *tag. The eager guard asks it before an op.
  bool paused_tag_in(uintptr_t address, size_t nbytes, std::string* tag) const;

  // Whether va is the start of one of this saver's allocations; takes no saver-wide lock.
  bool owns(uintptr_t va) const { return index_.contains(va); }

  // The saver's value of an option of kSaverScope (options.h), as text in the option's
  // grammar; kInvalidArgument for a bad value or an option of another scope. What each means:
  //   memory_margin_bytes  free device memory an allocation or a resume must leave behind
  //       (checked before each physical allocation, so the saver never takes the last bytes
  //       another engine on the GPU counts on)
  //   retain_cpu_backup    keep host backups after a successful resume and reuse them at the
  //       next pause, so a pause/resume cycle stops paying for host allocation
  //   host_cache_bytes     the host cache's budget, held by the tiers (set_host_cache_bytes)
  //   poison_on_resume     fill resumed memory that has no backup with 0xFF bytes, so code
  //       that wrongly reads discarded content sees NaN instead of plausible leftovers
  //   verify_wake          a pause fingerprints every backed-up allocation on its device, and
  //       a resume checks the restored bytes against it; on a mismatch the resume fails with
  //       Code::kContentMismatch naming the tag and allocation, and everything it covered stays
  //       paused with its backups
  //   stray_access         whether pauses cover memory without a backup with the scratch, and
  //       what a resume that finds writes there does (StrayMode; tags may choose their own)
  //   soft_pause           a pause keeps each host copy mapped at its allocation's own address
  //       (soft_pause.cpp), so touching the paused tensor reads and writes the copy instead of
  //       faulting, and the resume brings back what the copy holds then (tags may choose)
  //   disk_backup_dir      the disk tier's directory (set_disk_directory)
  Status set_option(const OptionRow& row, const std::string& text);
  Status option(const OptionRow& row, std::string* out) const;
  // A numeric option the saver holds (options.h's saver_holds), for the code that obeys it.
  uint64_t option(Option id) const { return options_.get(id); }
  void set_option(Option id, uint64_t value) { options_.set(id, value); }
  // The host cache: after a resume, its backups stay (page-locked, ready for the next pause
  // of the same memory) as long as all that is kept this way fits in `bytes`; 0 = none.
  // Without it every pause would fault in and page-lock new host memory, at a fraction of
  // the link's speed. Retention (above) keeps backups whatever their size.
  // A lowered budget applies at once to what the cache holds already: whole arenas of
  // resident allocations' copies are let go (least recently used first; retained ones stay)
  // until the rest fits.
  void set_host_cache_bytes(size_t bytes);
  size_t host_cache_bytes() const { return tiers_.cache_bytes(); }
  // Frees the host memory kept for resident allocations (the cache, retained backups).
  void release_host_cache();
  // The backup tiers (host memory, its pool, the background work and its gate): for tests
  // and the testing ABI.
  BackupTiers& tiers() { return tiers_; }

 private:
  using State = AllocationState;

  // Checks that every tag `selection` names is in the catalogue; needs mu_.
  Status check_known(const TagSelection& selection) const;
  // The catalogue check behind enter_tag and allocate, giving the tag's entry; needs mu_.
  Status admit(const std::string& tag, BackupChoice backup, TagInfo** entry = nullptr);
  // The tag's catalogue entry, entered if new once its name meets the tag rule; needs mu_.
  Status admit_name(const std::string& tag, TagInfo** entry, bool* is_new = nullptr);
  // Marks the allocations in `from` state that match `selection` as `to`, each with its
  // tag's backup decision, under the lock; their host copies are moving meanwhile.
  std::vector<Allocation*> claim(const TagSelection& selection, State from, State to);
  // Calls visit(a) for every allocation of the tags `selection` covers; needs mu_.
  template <typename Visit>
  void for_each_selected(const TagSelection& selection, Visit&& visit);
  // Sets the paused flag of the tags `selection` covers; needs mu_.
  void set_paused(const TagSelection& selection, bool paused);
  // pause / resume under op_mu_, naming the tags whose memory they moved; the public calls
  // time them.
  Status pause_locked(const TagSelection& selection, std::set<std::string>* moved, bool spill_everything = false);
  Status resume_locked(const TagSelection& selection, std::set<std::string>* moved);
  void note_duration(const std::set<std::string>& tags, std::chrono::steady_clock::time_point started,
                     double TagInfo::*field);
  // Moves claimed allocations [0, done) to `done_state` and the rest to `rest_state`, then
  // wakes frees waiting on them. With `backups` (a pause), batch[i < done] takes
  // backups[i] as its host copy; with `drop_backups` (a resume), batch[i < done] gives its
  // host copy up (otherwise the tiers judge which stay: HostCopies::settle_resume). Whatever
  // is let go is freed in the background.
  void settle(const std::vector<Allocation*>& batch, size_t done, State done_state,
              State rest_state, std::vector<HostBuffer>* backups, bool drop_backups);
  static std::set<int> devices_of(const std::vector<Allocation*>& batch);
  // The batch's addresses, in its order: how the tiers know its copies.
  static std::vector<uintptr_t> addresses_of(const std::vector<Allocation*>& batch);
  // Adds the tags of a batch's allocations to *tags.
  static void note_tags(const std::vector<Allocation*>& batch, std::set<std::string>* tags);
  Status synchronize_devices(const std::vector<Allocation*>& batch);
  // The disk tier's part of a pause (disk_backups.cpp). choose_spill, under op_mu_ and
  // without mu_ (the budget takes the node's lock): pushes the selection's allocations to
  // the tiers' choice (BackupTiers::choose_spill: the backed-up resident ones that would need
  // new host memory, largest first, until the rest fits in the node's budget) and marks
  // those it names as disk-backed (their effective choice is kDisk); with `everything`, all
  // of them. Marks left on resident allocations are judged afresh first. Returns the bytes
  // marked. write_disk_backups: writes the files of the batch's disk-backed
  // allocations before anything is released (none written: all stay resident).
  // read_disk_backups: reads them back into the mapped memory of a resume (`copies`: the
  // batch's host copies, as the tiers gave them to the resume).
  size_t choose_spill(const TagSelection& selection, bool everything);
  // check_disk_directory: refuses a pause of disk-backed allocations while no directory is
  // set (needs mu_); no_disk_directory: the error, for `tag`. with_disk_hint: a pause's
  // refusal for want of host memory, with what the disk tier did or could do.
  Status check_disk_directory(const TagSelection& selection);
  static Status no_disk_directory(const std::string& tag);
  Status with_disk_hint(const Status& refusal) const;
  Status write_disk_backups(const std::vector<Allocation*>& batch);
  Status read_disk_backups(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& copies);
  // read_disk_backups when the budget has no room for staging: through the batch's own host
  // copies (`copies`, already restored), which get their content back afterwards.
  Status load_through_own_copies(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& copies,
                                 DiskTier& tier,
                                 const std::pair<std::vector<DiskRange>, std::vector<DiskFile*>>& files,
                                 const DiskSettings& settings);
  // Queues the copy of every backed-up allocation of the batch into host memory, marking
  // the end of each allocation's copies in `copies`.
  // (Reorders the batch and its backups: see order_pending_last.)
  Status queue_backups(std::vector<Allocation*>* batch, std::vector<HostBuffer>* backups, CopyMarks* copies);
  // Verified wakes (WakeChecks, core/wake_checks.h), at the pipeline's stages (saver.cpp).
  // take_wake_fingerprints: once a pause's copies are queued (once per pause: *taken says it
  // ran). check_wake: once a resume's copies have landed, each checked allocation's restored
  // bytes against its pause's; check_wake_behind runs it one piece behind the copies, so a
  // wake's check costs about one piece's fingerprint, and check_wake checks what is left.
  // check_wake_chunks: a's chunks [checked_chunks, end) (after `after`, where given): a chunk
  // that differs is a soft pause's kept write, else kContentMismatch (its tag's verdict:
  // failed). note_wake_checks: a resume's verdicts for its tags, once it succeeded.
  Status take_wake_fingerprints(const std::vector<Allocation*>& batch, bool* taken);
  Status check_wake_behind(Allocation& a, size_t restored, WakeCheckBehind* behind);
  Status check_wake(const std::vector<Allocation*>& batch);
  Status check_wake_chunks(Allocation& a, size_t end, const CopyMark* after);
  void note_wake_checks(const std::vector<Allocation*>& batch);
  // The key the process fingerprints under: the store's where it shares, else its own.
  const FingerprintKey& process_key() {
    return tiers_.content_key() != nullptr ? *tiers_.content_key() : wake_key_;
  }
  // Stray access (stray_writes.cpp). stray_mode_of: the mode the tag follows from its next
  // pause on (needs mu_; its pause records it: TagInfo::paused_stray_mode). catches_strays:
  // whether, by that mode, its memory without a backup is covered. ready_stray_catchers: at a pause's start, before any copy,
  // the scratch made and filled on each device that will cover some of the batch, then
  // note_stray_writes. note_stray_writes: on each device of `devices` where memory is covered,
  // whether the scratch was written, counted for every tag covered there (before what is
  // covered changes, so a write is counted for the tags covered when it happened).
  // cover_stray: once a's memory is released, the scratch over it where its tag catches
  // strays (a failure leaves it unmapped, as without). uncover_stray: before its memory
  // comes back, or its range goes.
  bool catches_strays(const TagInfo& info) const;
  StrayMode stray_mode_of(const TagInfo& info) const;
  void ready_stray_catchers(const std::vector<Allocation*>& batch);
  // (`leaving`: an allocation out of the table, still covered, whose tag is counted too.)
  void note_stray_writes(const std::set<int>& devices, const Allocation* leaving = nullptr);
  void cover_stray(Allocation& a);
  Status uncover_stray(Allocation& a);
  // Soft pauses (soft_pause.cpp). soft_pauses: whether the tag's pauses are soft (needs mu_).
  // soft_request: whether a's pause needs a soft arena (not `kept`, its copy from the last
  // cycle). soft_map: once a's memory is released, its soft copy mapped at its address (a
  // failure leaves it unmapped: paused as without; after a failed resume, what that resume took
  // off mapped again). soft_unmap: before its memory comes back (piece by piece), or its range
  // goes. soft_write_kept: whether a's chunk `k`, restored as `restored`, is what
  // its soft copy holds (a write made while paused), which it then expects.
  // soft_alias: before a's copy is queued, its device memory mapped at a second address, which
  // the copy reads. soft_swap: while that copy runs, its own address taken from the device
  // memory and given its soft copy (which holds the right bytes once the pause returns).
  // soft_unswap: its copy failed, it stays resident: the device memory back at its address.
  // soft_release: its copy landed: the device memory goes (with the alias).
  bool soft_pauses(const TagInfo& info) const;
  bool soft_request(const Allocation& a, const HostBuffer& kept) const;
  void soft_alias(Allocation& a, const HostBuffer& copy);
  void soft_swap(Allocation& a, const HostBuffer& copy);
  void soft_unswap(Allocation& a);
  Status soft_release(Allocation& a, bool* unmapped);
  void soft_map(Allocation& a, const HostBuffer& copy);
  // (Up to `to`: the ranges that start before it, as a resume maps its pieces.)
  Status soft_unmap(Allocation& a, size_t to = SIZE_MAX);
  bool soft_write_kept(Allocation& a, size_t k, const Fingerprint& restored);
  // Sets one of the tag's settings (entering the tag, as a region would).
  Status set_tag(const std::string& tag, const std::function<void(TagInfo&)>& set);
  // Content backups (content_backups.cpp): a large backup's copy in chunks of the node's store
  // (tiers/content_copies.cpp): *kept (its content arena from the last cycle) where its memory
  // still holds those bytes, or with its changed chunks recycled, else a new content arena
  // (a stale *kept let go of first: emptied, and out of the tiers' copies). kUnsupported: the
  // device cannot fingerprint, or the store has no room; the caller copies as before.
  // Its chunks' fingerprints go to *fingerprints.
  // Without `make_room`, a shortage of host memory fails it instead of making the caches give way.
  // Chunks of *kept that other processes hold too are rewritten in place where they let go of
  // them by `others_by` (HostArena::recycle: one deadline for a whole pause).
  // Given `in_place_copies` (a pause's), the changed chunks of a *kept this process alone holds
  // are copied as their piece is fingerprinted (copy_while_fingerprinting).
  Status content_copy(const Allocation& a, const FingerprintKey& key, HostBuffer* kept, HostBuffer* out,
                      std::vector<Fingerprint>* fingerprints, std::chrono::steady_clock::time_point others_by,
                      bool make_room = true, CopyMarks* in_place_copies = nullptr);
  // The fingerprints of a's chunks into *chunks, piece by piece (kPipelinedPieceBytes), each
  // piece's changed chunks that `kept` can take in place (HostArena::take_in_place) copied into
  // it at once, queued on the copy stream while the next piece is fingerprinted: content changed
  // since the last pause (weights after a training step) keeps the link busy from the first
  // piece, not from the end of the whole pass. *queued: whether any copy was queued (`copies`
  // then waits for them after an error).
  Status copy_while_fingerprinting(const Allocation& a, const FingerprintKey& key, const HostBuffer& kept,
                                   std::vector<Fingerprint>* chunks, CopyMarks* copies, bool* queued);
  // 8 chunks: about 0.1 ms of fingerprinting on an H200 (0.4 ms with four processes at it),
  // 10 ms of the link; the link waits for one piece, and a pause makes 16 launches per 8 GiB.
  static constexpr size_t kPipelinedPieceBytes = 8 * HostArena::kRangeBytes;
  // Whether a's backup goes to the node's store (where this process shares: `key`): large
  // (more than one chunk) and kept after a resume (not an "mmap" copy).
  static bool content_addressed(const Allocation& a, const FingerprintKey* key) {
    return key != nullptr && a.choice != BackupChoice::kOnUncached && a.backup_bytes() > HostArena::kRangeBytes &&
           fingerprintable(a.backup_bytes());
  }
  // Moves the copies that wait for chunks other processes are making (and their allocations)
  // to the end of the batch, in order.
  static void order_pending_last(std::vector<Allocation*>* batch, std::vector<HostBuffer>* backups);
  // Once batch[i]'s copies have landed: its content arena's new chunks are named; where it
  // waits for other processes' chunks, the new chunks of every copy after it are named first
  // (their copies waited for), then the pending ones settled or made and copied here.
  Status finish_content(const std::vector<Allocation*>& batch, const std::vector<HostBuffer>& backups,
                        CopyMarks* copies, size_t i);
  // Settles the chunks of `backup` other processes were making, copying from a's memory those
  // nobody makes any more (where `key` is given, only while a is unchanged since `before`).
  Status settle_pending_chunks(const Allocation& a, const HostBuffer& backup, const FingerprintKey* key,
                               const std::vector<Fingerprint>* before);
  // Copies a's bytes of each part (offset, bytes) into `copy` and waits for them.
  Status copy_chunks(const Allocation& a, const HostBuffer& copy, const std::vector<std::pair<size_t, size_t>>& parts);
  // Content backups made ahead (share_ahead.cpp), in the background: the selected tags' large
  // backups taken into the node's store while resident, kept for their first pause.
  void share_ahead(const TagSelection& selection);
  HostBuffer share_one_ahead(const Allocation& a, const FingerprintKey& key);
  // Whether a's backup is one share_ahead makes (resident, content-addressed, none kept). Needs mu_.
  bool wants_ahead(const Allocation& a, const FingerprintKey& key);
  static bool looks_unwritten(const std::vector<Fingerprint>& chunks, const FingerprintKey& key);
  // OK where a's chunks still have the fingerprints `before`.
  Status unchanged_since(const Allocation& a, const FingerprintKey& key, const std::vector<Fingerprint>& before);
  // Queues the copy of a's host copy (`copy`, the tiers') back into its piece k (freshly
  // mapped), or the piece's poisoning.
  Status restore(const Allocation& a, const HostBuffer& copy, size_t k);
  Status wait_copies(const std::vector<Allocation*>& batch);
  // Takes a's memory down once its copy (`copy`, where it has one) has landed; then the
  // scratch or its soft copy goes over its address.
  Status release_physical(Allocation& a, bool* unmapped, const HostBuffer& copy);
  // Another process of the node needs the room: gives the whole host cache back
  // (BackupTiers::give_cache_back), unless a pause or resume of this saver is under way (the
  // ledger asks again shortly).
  void give_cache_back_on_request();
  // prepare_backups' work, on the background thread: takes the tags asked for so far,
  // prepares them, and waits until their host memory is ready.
  void prepare_pending();
  // Sets the arenas up and hands their buffers out; returns them.
  std::vector<std::shared_ptr<HostArena>> prepare_backups_now(const TagSelection& selection);
  // What the tiers need of `a` at a resume (whether its region and tag let its copy stay
  // cached, HostCopies::Resumed). Under mu_.
  static HostCopies::Resumed resumed(const Allocation& a);
  // "tag 'kv' (2.00 GiB)" or "tags 'kv', 'weights' (...)": what a pause or resume covered.
  static std::string describe(const std::vector<Allocation*>& batch);
  // Chooses how a resume maps `a`: in pieces of the backend's resume piece size when it has
  // a backup to copy in (`has_copy`) and is larger than one, in one piece otherwise.
  Status plan_pieces(Allocation& a, bool has_copy);
  // Maps fresh memory for the next piece of `a` not yet mapped.
  Status map_next_piece(Allocation& a);
  Status out_of_memory_on_resume(const std::vector<Allocation*>& batch, const Allocation& failed,
                                 const Status& cause);
  const Allocation* containing(uintptr_t address) const;  // needs mu_

  // op_mu_ taken for a caller's operation (pause, resume, a lease, a cache change):
  // background host work gives way meanwhile (the gate).
  class ForegroundOp {
   public:
    explicit ForegroundOp(Saver& saver) : saver_(saver), active_(saver.tiers_.gate()) {
      saver_.op_mu_.lock();
    }
    ~ForegroundOp() { saver_.op_mu_.unlock(); }
    ForegroundOp(const ForegroundOp&) = delete;
    ForegroundOp& operator=(const ForegroundOp&) = delete;

   private:
    Saver& saver_;
    ForegroundGate::Active active_;
  };

  std::shared_ptr<Backend> backend_;  // shared with host arenas, which leases may keep alive
  std::mutex op_mu_;
  mutable std::mutex mu_;
  std::condition_variable settled_;
  // Allocations by base address, held in place: pointers to them stay valid until erased.
  using Table = std::map<uintptr_t, Allocation>;
  Table table_;
  // The tag catalogue, under mu_. Entries are never erased: allocations point at theirs.
  std::map<std::string, TagInfo> tags_;
  Mappings mappings_;  // every take-down and its orphans; after backend_, which it uses
  StrayCatcher catcher_;  // after mappings_, which it hands its orphans
  AddressIndex index_;
  // Its values of the options it holds (options.h), the process defaults until set: the
  // api layer hands them over when it makes the saver.
  OptionValues options_;
  FingerprintKey wake_key_;  // drawn at construction; where the process shares, the store key serves instead
  // The wake check (bound to tiers_ below, which it uses only from the first pause on).
  WakeChecks wake_{*backend_, tiers_, options_};
  // TMSL_LOG_ALLOCATIONS: a line on stderr per allocation and free (handed once: off, it costs
  // each of them one predictable branch).
  const bool log_allocations_;
  // The disk tier (null: none); set under op_mu_ and mu_, read under either.
  std::shared_ptr<DiskTier> disk_;
  // Tags whose host memory is to be prepared, and whether a task to do it is queued.
  std::mutex prepare_mu_;
  TagSelection prepare_pending_{false, {}};
  bool prepare_queued_ = false;
  BackupTiers tiers_;  // declared last: it holds the host copies, and its background work reads the table above
};

// One walk in address order, as torch_memory_saver's pause does. A per-tag index cost every
// allocation a heap node and a tree insertion and removal (bench_core_overhead.py) to spare a
// pause a compare per allocation of other tags.
template <typename Visit>
void Saver::for_each_selected(const TagSelection& selection, Visit&& visit) {
  const TagInfo* last = nullptr;  // a tag's allocations often lie together: its answer is kept
  bool selected = selection.all;
  for (auto& entry : table_) {
    Allocation& a = entry.second;
    if (!selection.all && a.tag_info != last) {
      last = a.tag_info;
      selected = selection.matches(a.tag);
    }
    if (selected) visit(a);
  }
}

}  // namespace tmsl
