#include "tiers/host_pool.h"

#include <algorithm>
#include <mutex>

namespace tmsl {
namespace {

constexpr size_t kBufferAlignment = 4096;
size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

struct HostPool::State : std::enable_shared_from_this<HostPool::State> {
  std::mutex mu;
  std::vector<std::unique_ptr<HostArena>> arenas;  // least recently used first
  size_t bytes = 0;
  size_t limit = 0;
  size_t returns = 0;
  bool closed = false;
  int free_now = 0;  // FreeNow scopes open: what is let go is freed where it is let go  // the pool is gone: arenas let go are freed where they are
  BackgroundWork* background = nullptr;  // valid until closed
  ForegroundGate* gate = nullptr;

  // Frees arenas off the caller's thread, once the foreground is quiet. Needs mu.
  void free_later(std::vector<std::unique_ptr<HostArena>> let_go) {
    if (let_go.empty()) return;
    if (free_now > 0) return;  // freed by the caller, at once: the caller needs the bytes back
    for (auto& arena : let_go) {
      auto one = std::make_shared<std::unique_ptr<HostArena>>(std::move(arena));
      background->run_after_foreground(*gate, [one](bool in_background) {
        if (in_background) (*one)->give_back_gently();
        one->reset();
      });
    }
  }
  // Arenas over the limit, least recently used first. Needs mu.
  std::vector<std::unique_ptr<HostArena>> trim() {
    std::vector<std::unique_ptr<HostArena>> over;
    size_t k = 0;
    while (bytes > limit && k < arenas.size()) {
      bytes -= arenas[k]->used_bytes();
      over.push_back(std::move(arenas[k++]));
    }
    arenas.erase(arenas.begin(), arenas.begin() + static_cast<std::ptrdiff_t>(k));
    return over;
  }
  void come_back(HostArena* raw, bool poolable) {
    std::unique_ptr<HostArena> arena(raw);
    std::unique_lock<std::mutex> lock(mu);
    if (closed) {
      lock.unlock();
      return;  // freed here
    }
    ++returns;
    if (poolable && arena->poolable() && bytes + arena->used_bytes() <= limit) {
      bytes += arena->used_bytes();
      // By last use: the least recently used go first.
      auto at = std::upper_bound(arenas.begin(), arenas.end(), arena->last_use(),
                                 [](uint64_t use, const std::unique_ptr<HostArena>& a) { return use < a->last_use(); });
      arenas.insert(at, std::move(arena));
      return;
    }
    if (free_now > 0) {
      lock.unlock();
      return;  // freed here
    }
    std::vector<std::unique_ptr<HostArena>> let_go;
    let_go.push_back(std::move(arena));
    free_later(std::move(let_go));
  }
};

HostPool::FreeNow::FreeNow(HostPool& pool) : pool_(pool) {
  std::lock_guard<std::mutex> lock(pool_.state_->mu);
  ++pool_.state_->free_now;
}

HostPool::FreeNow::~FreeNow() {
  std::lock_guard<std::mutex> lock(pool_.state_->mu);
  --pool_.state_->free_now;
}

HostPool::HostPool(BackgroundWork& background, ForegroundGate& gate) : state_(std::make_shared<State>()) {
  state_->background = &background;
  state_->gate = &gate;
}

HostPool::~HostPool() {
  std::vector<std::unique_ptr<HostArena>> let_go;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->closed = true;
    let_go = std::move(state_->arenas);
    state_->bytes = 0;
  }
}

std::shared_ptr<HostArena> HostPool::track(std::unique_ptr<HostArena> arena, bool poolable) {
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<HostArena>(arena.release(), [state, poolable](HostArena* a) { state->come_back(a, poolable); });
}

void HostPool::take(int device, const std::vector<size_t>& sizes, std::vector<HostBuffer>* out) {
  std::vector<size_t> wanted;  // indices, largest first
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if ((*out)[i]) continue;
    wanted.push_back(i);
    total += round_up(sizes[i], kBufferAlignment);
  }
  if (wanted.empty()) return;
  std::stable_sort(wanted.begin(), wanted.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::vector<size_t> order;  // candidate arenas
    for (size_t k = 0; k < state_->arenas.size(); ++k) {
      if (state_->arenas[k]->device() == device) order.push_back(k);
    }
    if (order.empty()) return;
    auto size_of = [&](size_t k) { return state_->arenas[k]->used_bytes(); };
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return size_of(a) > size_of(b); });
    // The smallest that holds everything, if one does (it is last among those that do).
    size_t whole = order.size();
    for (size_t j = 0; j < order.size() && size_of(order[j]) >= total; ++j) whole = j;
    if (whole < order.size()) order = {order[whole]};
    std::vector<bool> used(state_->arenas.size(), false);
    std::vector<std::pair<size_t, size_t>> placed;  // (index, offset), per arena below
    for (size_t k : order) {
      placed.clear();
      // First fit, largest buffers first, into the runs of page-locked ranges.
      std::vector<std::pair<size_t, size_t>> spans = state_->arenas[k]->spans();
      for (size_t& i : wanted) {
        if (i == SIZE_MAX) continue;
        for (auto& span : spans) {
          if (span.second - span.first < sizes[i]) continue;
          placed.emplace_back(i, span.first);
          span.first = std::min(span.second, round_up(span.first + sizes[i], kBufferAlignment));
          i = SIZE_MAX;  // placed
          break;
        }
      }
      if (placed.empty()) continue;
      used[k] = true;
      HostArena* arena = state_->arenas[k].get();
      arena->note_use();
      arena->hurry();  // a pause copies into it now
      // Handed out under the same deleter: back here when its new holders let go.
      std::shared_ptr<State> state = state_;
      std::shared_ptr<HostArena> shared(state_->arenas[k].release(),
                                        [state](HostArena* a) { state->come_back(a, true); });
      state_->bytes -= shared->used_bytes();
      for (const auto& [i, offset] : placed) (*out)[i] = HostBuffer{shared, offset, sizes[i]};
    }
    std::vector<std::unique_ptr<HostArena>> kept;
    for (size_t k = 0; k < state_->arenas.size(); ++k) {
      if (!used[k]) kept.push_back(std::move(state_->arenas[k]));
    }
    state_->arenas = std::move(kept);
  }
}

size_t HostPool::bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->bytes;
}

size_t HostPool::bytes_on(int device) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  size_t bytes = 0;
  for (const auto& arena : state_->arenas) {
    if (arena->device() == device) bytes += arena->used_bytes();
  }
  return bytes;
}

size_t HostPool::limit() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->limit;
}

size_t HostPool::returns() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->returns;
}

void HostPool::set_limit(size_t bytes, bool now) {
  std::vector<std::unique_ptr<HostArena>> over;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->limit = bytes;
    over = state_->trim();
    if (!now && state_->free_now == 0) state_->free_later(std::move(over));
  }
  over.clear();  // with `now`: here, off the lock
}

}  // namespace tmsl
