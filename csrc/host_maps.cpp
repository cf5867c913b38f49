// See host_maps.h.
#include "host_maps.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>
#include <iterator>
#include <map>
#include <new>

#include "fork.h"

namespace oxygen {
namespace host_maps {
namespace {

struct Mapping {
  std::size_t size;
  int fd;
  off_t offset;  // into the memfd
  // The memfd's identity when mapped: a page that lent its handle (PageRange::lend) may still
  // map it after the borrower released it (closed the fd), and the number may be reused since.
  dev_t dev;
  ino_t ino;
  bool rw;  // set_access done: PROT_READ | PROT_WRITE, else PROT_NONE
};
using Mappings = std::map<std::uintptr_t, Mapping>;

// Leaked on purpose (used during process exit) and reset in a forked child, as page_pool.cpp's.
std::mutex g_mu;
Mappings* g_maps = new Mappings();

// The child's own copy of [at, at + size), in anonymous private memory: for a mapping whose memfd
// this process no longer has open. Without memory for it, the page becomes inaccessible rather
// than stay shared with the parent.
void copy_to_private(void* at, std::size_t size, int prot) noexcept {
  void* tmp = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (tmp != MAP_FAILED) {
    if (prot != PROT_NONE) std::memcpy(tmp, at, size);
    if (mprotect(tmp, size, prot) == 0 &&
        mremap(tmp, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, at) != MAP_FAILED)
      return;
    munmap(tmp, size);
  }
  mmap(at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
}

// In the forked child: the same pages, copy on write (no system call here allocates or locks).
void privatize(std::uintptr_t va, const Mapping& m) noexcept {
  void* at = reinterpret_cast<void*>(va);
  const int prot = m.rw ? PROT_READ | PROT_WRITE : PROT_NONE;
  struct stat st;
  if (fstat(m.fd, &st) == 0 && st.st_dev == m.dev && st.st_ino == m.ino &&
      mmap(at, m.size, prot, MAP_PRIVATE | MAP_FIXED, m.fd, m.offset) != MAP_FAILED)
    return;
  copy_to_private(at, m.size, prot);
}

}  // namespace

std::mutex& lock() { return g_mu; }

void add(std::uintptr_t va, std::size_t size, int fd) {
  forget(va, size);
  struct stat st;
  if (fstat(fd, &st) != 0) st.st_dev = 0, st.st_ino = 0;  // never matches: copied in a child
  (*g_maps)[va] = Mapping{size, fd, 0, st.st_dev, st.st_ino, false};
}

void set_access(std::uintptr_t va, std::size_t size) {
  Mappings& m = *g_maps;
  auto it = m.upper_bound(va);
  if (it != m.begin()) --it;
  for (; it != m.end() && it->first < va + size; ++it)
    if (it->first + it->second.size > va) it->second.rw = true;
}

void forget(std::uintptr_t va, std::size_t size) {
  Mappings& m = *g_maps;
  const std::uintptr_t end = va + size;
  auto it = m.upper_bound(va);
  if (it != m.begin() && std::prev(it)->first + std::prev(it)->second.size > va) --it;
  while (it != m.end() && it->first < end) {
    const std::uintptr_t a = it->first;
    const Mapping e = it->second;
    it = m.erase(it);
    // Parts outside [va, end) stay recorded (the backend maps and unmaps whole handles, so
    // this only splits a mapping when a caller unmaps part of one).
    if (a < va) m.emplace(a, Mapping{va - a, e.fd, e.offset, e.dev, e.ino, e.rw});
    if (a + e.size > end) {
      const off_t skip = static_cast<off_t>(end - a);
      it = m.emplace(end, Mapping{a + e.size - end, e.fd, e.offset + skip, e.dev, e.ino, e.rw})
               .first;
      ++it;
    }
  }
}

std::size_t count() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_maps->size();
}

}  // namespace host_maps

void host_maps_before_fork() { host_maps::g_mu.lock(); }

void host_maps_after_fork_parent() { host_maps::g_mu.unlock(); }

void host_maps_after_fork_child() {
  for (const auto& kv : *host_maps::g_maps) host_maps::privatize(kv.first, kv.second);
  // Private memory now: a grandchild inherits it copy on write like any other, so nothing is
  // left to record. Placement new leaks the old entries, as the other child resets do.
  new (&host_maps::g_mu) std::mutex();
  new (host_maps::g_maps) host_maps::Mappings();
}

}  // namespace oxygen
