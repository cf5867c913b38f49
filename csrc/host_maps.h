// The host backend's page mappings, as a forked child must not keep them.
//
// A host page is a memfd mapped MAP_SHARED (vmm_backend.cpp), so after fork() parent and child
// would write the same physical memory: a KV arena's blocks, which both go on handing out from
// copies of the same free list. That was issue 31's silent corruption (the children's tokens
// unlike stock in 4 calls of 5, the parent's in 3 of 5). The child objects that own those pages
// refuse every call (fork.h), but tensors over them are ordinary memory to torch.
//
// So every mapping of a page is recorded here, and the fork child handler maps each one again
// MAP_PRIVATE over the same memfd and offset: no copy is made at fork time, the child's reads see
// the page, and its writes go to pages of its own (copy on write), which the parent never sees.
// (A page the child has not written still shows what the parent writes to it later: a child
// must not read the parent's objects either; the KV layer gives a child pools of its own.)
//
// The lock is held across each mmap/mprotect that changes a recorded mapping and by fork()
// itself (the atfork prepare handler), so the list the child reads is its address space.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "vmm_backend.h"

namespace oxygen {
namespace host_maps {

// Held across the system call that changes a mapping and the record of it.
std::mutex& lock();
// (lock held) Records that [va, va + size) maps `fd` from offset 0 MAP_SHARED, not yet
// accessible; replaces what was recorded there. Before the mmap, so that the only failure
// (std::bad_alloc) leaves nothing mapped; forget() it if the mmap then fails.
void add(std::uintptr_t va, std::size_t size, int fd);
// (lock held) set_access made [va, va + size) readable and writable.
void set_access(std::uintptr_t va, std::size_t size);
// (lock held) [va, va + size) no longer maps any page (unmapped, or the reservation freed).
void forget(std::uintptr_t va, std::size_t size);
// How many mappings are recorded (tests).
std::size_t count();

}  // namespace host_maps
}  // namespace oxygen
