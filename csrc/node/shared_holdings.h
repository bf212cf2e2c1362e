// What the node holds once for all its processes, beside what each holds: the node's store of
// shared backups (node_store.h) implements it, and the api layer hands it to the node's ledger
// (node_ledger.h), which counts its bytes in the budget. So the ledger knows the store only as
// bytes, and the store knows nothing of the ledger.
#pragma once

#include <cstddef>

namespace tmsl {

class SharedHoldings {
 public:
  virtual ~SharedHoldings() = default;
  // The memory it takes now (0 where there is none, or it is not trusted).
  virtual size_t bytes() = 0;
  // Lets go of what processes that died left behind (nobody holds it any more).
  virtual void collect_garbage() = 0;
};

}  // namespace tmsl
