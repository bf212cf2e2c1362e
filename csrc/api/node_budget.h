// The node's parts the api layer hands every saver it makes (SaverSetup, core/saver.h): the
// node's ledger, its host-memory budget (node_ledger.h), and the node's store of shared backups
// (node_store.h), made from the process defaults (environment.h) on first use.
//
// The ledger counts the store's bytes whether or not this process shares; savers are handed
// the store only where it does (TMSL_SHARE_BACKUPS: "sharing on" is "a store was handed"). The
// one place that picks them and reads their settings: below the api layer nothing reads the
// process defaults or reaches these objects.
#pragma once

#include <string>

#include "core/saver.h"
#include "node/chunk_store.h"
#include "node/node_ledger.h"
#include "node/node_store.h"

namespace tmsl {

// The ledger, opened on first use (never destroyed: arenas may go at exit); a forked child
// opens one of its own.
NodeLedger& node_ledger();
// The store beside the ledger (NodeStore::directory_for its file), one per process, made on
// first use and never destroyed.
NodeStore& node_store();
// node_store() where this process shares its backups (TMSL_SHARE_BACKUPS, the switch
// TMSL_LIKE_TORCH_MEMORY_SAVER=1 without it); nullptr where it does not.
ChunkStore* shared_store();
// What a saver made now is handed: the ledger as its budget, shared_store(), the process
// defaults it keeps itself. (A SetupSource, core/registry.h.)
SaverSetup saver_setup();

// The node's figures as host_memory() shows them: the ledger's, and the store's as this
// process sees it.
struct NodeFigures {
  NodeLedger::Figures ledger;
  // Whether this process's large backups go into the node's store; where not, why (sharing
  // turned off, a store on disk or not trusted, this process alone on the node; or what the
  // latest backup offered to it met: no room, no descriptors).
  bool backups_shared = false;
  std::string sharing_off;
  // Whether this process is alone on the node (no other live process uses the library), so
  // that its backups are private copies until another arrives (ChunkStore::store_key_now).
  bool alone = false;
  std::string store;  // the store's directory (NodeStore::directory_for the ledger's path)
};
NodeFigures node_figures();

}  // namespace tmsl
