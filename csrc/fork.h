// What survives fork().
//
// A forked child has one thread: the parent's other threads (Python threads in the middle of a
// malloc, the pools' refill threads) are gone, and any lock one of them held stays locked in the
// child forever. PyTorch's DataLoader forks its workers, so this is ordinary use, not an edge.
//
// The rule: objects created before the fork belong to the parent. In the child they refuse every
// call with ERR_FORKED (their locks may be held by threads that no longer exist, and CUDA does not
// survive fork), and destroying one only forgets it. Objects created in the child work normally.
// The child handler below resets the process-wide locks and registries to empty before the child
// runs any code of ours, so that creating a new pool cannot block on a lock the parent's threads
// held. It also makes the parent's host pages private to the child (host_maps.h): tensors over
// them are ordinary memory to torch, and a child writing them must not write the parent's.
#pragma once

#include <cstdint>

namespace oxygen {
namespace fork_state {

// 0 in the process that loaded the library; each fork() gives the child the parent's value + 1.
std::uint64_t generation();

}  // namespace fork_state

// Child-side resets of each module's process-wide state, run by the one pthread_atfork child
// handler (fork.cpp). They must not allocate or lock: they construct fresh empty mutexes and
// containers in place, leaking whatever the parent's threads left behind.
void page_pool_after_fork_child();
void capture_after_fork_child();
void host_backend_after_fork_child();
void capi_after_fork_child();
// The host page mappings (host_maps.h): locked across fork() so the child's list is its address
// space, then made private in the child.
void host_maps_before_fork();
void host_maps_after_fork_parent();
void host_maps_after_fork_child();

}  // namespace oxygen
