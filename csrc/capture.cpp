// See capture.h.
#include "capture.h"

#include "fork.h"

#include <atomic>
#include <new>
#include <utility>
#include <vector>

namespace oxygen {
namespace capture {

namespace {
std::mutex g_query_mu;
std::atomic<int> g_announced{0};
std::atomic<int> g_detected{0};
std::atomic<std::uint64_t> g_next_token{0};
thread_local std::uint64_t t_token = 0;

struct Listener {
  void* key;
  std::function<void()> on_begin;
  std::function<void(std::uint64_t)> on_release;
};
std::mutex g_listen_mu;
// Leaked on purpose: allocators may unregister during static destruction.
std::vector<Listener>* g_listeners = new std::vector<Listener>();
std::vector<Listener>& listeners() { return *g_listeners; }
}  // namespace

}  // namespace capture

void capture_after_fork_child() {
  // No capture runs in a fresh child, and the parent's allocators must never be called back
  // (their locks may be held by threads the child does not have): empty state, fresh locks.
  using namespace capture;
  new (&g_query_mu) std::mutex();
  new (&g_listen_mu) std::mutex();
  new (g_listeners) std::vector<Listener>();
  g_announced.store(0, std::memory_order_release);
  g_detected.store(0, std::memory_order_release);
  t_token = 0;
}

namespace capture {

std::uint64_t announce_begin() {
  {
    std::lock_guard<std::mutex> g(g_listen_mu);
    for (auto& l : listeners()) l.on_begin();
  }
  std::lock_guard<std::mutex> g(g_query_mu);  // waits for an event query in flight to finish
  g_announced.fetch_add(1, std::memory_order_acq_rel);
  t_token = ++g_next_token;
  return t_token;
}

void announce_end(std::uint64_t token) {
  std::lock_guard<std::mutex> g(g_query_mu);
  if (g_announced.load(std::memory_order_acquire) > 0)
    g_announced.fetch_sub(1, std::memory_order_acq_rel);
  if (t_token == token) t_token = 0;
}

std::uint64_t thread_token() { return t_token; }

void release(std::uint64_t token) {
  // Called under the lock so that an allocator being destroyed (remove_release_listener) waits.
  std::lock_guard<std::mutex> g(g_listen_mu);
  for (auto& l : listeners()) l.on_release(token);
}

void add_listener(void* key, std::function<void()> on_begin,
                  std::function<void(std::uint64_t)> on_release) {
  std::lock_guard<std::mutex> g(g_listen_mu);
  listeners().push_back({key, std::move(on_begin), std::move(on_release)});
}

void remove_listener(void* key) {
  std::lock_guard<std::mutex> g(g_listen_mu);
  auto& v = listeners();
  for (auto it = v.begin(); it != v.end();) it = it->key == key ? v.erase(it) : it + 1;
}

void note_detected(int delta) { g_detected.fetch_add(delta, std::memory_order_acq_rel); }

bool maybe_active() {
  return g_announced.load(std::memory_order_acquire) > 0 ||
         g_detected.load(std::memory_order_acquire) > 0;
}

QueryGuard::QueryGuard() : lock_(g_query_mu), allowed_(!maybe_active()) {}

}  // namespace capture
}  // namespace oxygen
