#include "api/node_budget.h"

#include <pthread.h>

#include <atomic>

#include "platform/environment.h"

namespace tmsl {

namespace {

std::atomic<NodeLedger*> g_ledger{nullptr};

// Why a process whose defaults turn sharing off does not share.
std::string why_not_shared(const ProcessDefaults& d) {
  return d.share_backups_given ? "TMSL_SHARE_BACKUPS=0: this process holds its backups privately"
                               : "TMSL_LIKE_TORCH_MEMORY_SAVER=1: this process holds its backups privately, as "
                                 "torch_memory_saver does (TMSL_SHARE_BACKUPS=1 shares them)";
}

}  // namespace

NodeStore& node_store() {
  // Never destroyed: its chunks are let go of at exit by the store itself. A forked child
  // keeps it (the same directory and key; the store closes the child's copies of its chunks).
  static NodeStore* store = [] {
    const ProcessDefaults& d = process_defaults();  // TMSL_HOST_LEDGER, TMSL_SHARE_BACKUPS
    return new NodeStore(NodeStore::directory_for(NodeLedger::path_for(d.host_ledger)),
                         d.share_backups && d.share_backups_given);
  }();
  return *store;
}

NodeLedger& node_ledger() {
  NodeLedger* ledger = g_ledger.load(std::memory_order_acquire);
  if (ledger != nullptr) return *ledger;
  // Never destroyed: arenas may go at exit. A forked child starts a ledger of its own.
  static const int registered = pthread_atfork(nullptr, nullptr, [] {
    NodeLedger* inherited = g_ledger.exchange(nullptr);
    if (inherited != nullptr) inherited->leave_after_fork();
  });
  (void)registered;
  const ProcessDefaults& d = process_defaults();  // TMSL_HOST_LEDGER, TMSL_HOST_MEMORY_BUDGET (0: not set)
  NodeLedger::Settings settings;
  settings.path = NodeLedger::path_for(d.host_ledger);
  settings.budget = d.host_memory_budget;
  settings.budget_error = d.host_memory_budget_error;
  settings.budget_applies = d.host_memory_budget_applies;
  // The store's bytes are counted whether or not this process shares: another process may.
  NodeLedger* made = new NodeLedger(settings, &node_store());
  if (g_ledger.compare_exchange_strong(ledger, made)) return *made;
  delete made;  // another thread made it first
  return *ledger;
}

ChunkStore* shared_store() { return process_defaults().share_backups ? &node_store() : nullptr; }

SaverSetup saver_setup() {
  const ProcessDefaults& d = process_defaults();
  return SaverSetup{node_ledger(), shared_store(), d.keeps_host_cache, d.log_allocations};
}

NodeFigures node_figures() {
  NodeFigures f;
  NodeLedger& ledger = node_ledger();
  f.ledger = ledger.figures();
  NodeStore& store = node_store();
  f.store = store.directory();
  const bool sharing = shared_store() != nullptr;
  const bool keyed = sharing && store.content_key() != nullptr;
  f.alone = keyed && store.store_key_now(ledger) == nullptr;
  const std::string refusal = store.refusal();
  f.backups_shared = keyed && !f.alone && refusal.empty();
  f.sharing_off = !sharing  ? why_not_shared(process_defaults())
                  : !keyed  ? store.key_refusal()
                  : f.alone ? "this process is alone on the node: its backups are private copies (the store's memory "
                              "would cost it and nobody could share it) until another process of the node uses the "
                              "library; TMSL_SHARE_BACKUPS=1 stores them anyway"
                            : refusal;
  return f;
}

}  // namespace tmsl
