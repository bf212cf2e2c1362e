// The host-memory budget the api layer hands every saver it makes: the node's ledger
// (node_ledger.h), opened on first use. The one place that picks it.
#pragma once

#include "node/host_budget.h"
#include "node/node_ledger.h"

namespace tmsl {

inline HostBudget& node_budget() { return NodeLedger::instance(); }

}  // namespace tmsl
