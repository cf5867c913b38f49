// See fork.h.
#include "fork.h"

#include <pthread.h>

#include <atomic>

namespace oxygen {
namespace fork_state {

namespace {
std::atomic<std::uint64_t> g_generation{0};

void before_fork() { host_maps_before_fork(); }

void after_fork_parent() { host_maps_after_fork_parent(); }

void after_fork_child() {
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  host_maps_after_fork_child();
  page_pool_after_fork_child();
  capture_after_fork_child();
  host_backend_after_fork_child();
  capi_after_fork_child();
}

// Registered when the library is loaded (a global initialiser that touches nothing but libc):
// the handler must be in place before the first fork, whichever thread forks.
const int g_registered = pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}  // namespace

std::uint64_t generation() {
  (void)g_registered;
  return g_generation.load(std::memory_order_acquire);
}

}  // namespace fork_state
}  // namespace oxygen
