#include "core/thread_region.h"

namespace tmsl {

ThreadRegion& thread_region() {
  static thread_local ThreadRegion region;
  return region;
}

const ThreadRegion& effective_region(SetupSource setup, const ProcessDefaults& d) {
  const ThreadRegion& region = thread_region();
  if (region.saver != 0 || region.explicit_none) return region;
  // The process defaults as this thread's region, filled in once the saver exists.
  static thread_local ThreadRegion from_defaults;
  if (from_defaults.saver == 0 && d.all_threads && default_saver(setup, d, &from_defaults.saver).ok()) {
    from_defaults.tag = d.tag;
    from_defaults.backup = d.backup;
  }
  return from_defaults;
}

Status region_saver(const ThreadRegion& region, SaverRef* out) {
  if (in_forked_child()) return forked_child_error();
  *out = find_saver(region.saver);
  if (*out) return Status::Ok();
  return Status::Error(Code::kInvalidArgument,
                       "this thread's region (tag '" + region.tag + "') belongs to a saver that has been "
                       "closed; leave the region and enter one of a live saver");
}

}  // namespace tmsl
