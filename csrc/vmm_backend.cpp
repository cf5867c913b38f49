// Host and CUDA implementations of oxygen::Backend. See vmm_backend.h.
#include "vmm_backend.h"

#include "fork.h"
#include "host_maps.h"
#include "stats.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <thread>

#include <cuda.h>

namespace oxygen {

namespace {
thread_local std::string g_last_error;
thread_local const char* g_last_error_fixed = nullptr;

// Messages are formatted with snprintf, not iostreams: on the H200 an ostringstream in this
// library crashed inside libstdc++'s locale code when formatting a driver error.
std::string errno_text(const char* what) {
  int err = errno;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s failed: %s (errno %d)", what, std::strerror(err), err);
  return buf;
}

Status os_error(const char* what) {
  const int err = errno;  // before anything below can change it
  set_last_error(errno_text(what));
  return err == ENOMEM ? ERR_OOM : ERR_OS;
}
}  // namespace

void set_last_error(const char* msg) noexcept {
  try {
    g_last_error = msg;
  } catch (...) {  // no memory for the text: keep a fixed one (assigning it cannot allocate more)
    g_last_error.clear();
    g_last_error.shrink_to_fit();
    g_last_error_fixed = "out of host memory while reporting an error";
    return;
  }
  g_last_error_fixed = nullptr;
}
void set_last_error(const std::string& msg) noexcept { set_last_error(msg.c_str()); }
const char* last_error() noexcept {
  return g_last_error_fixed ? g_last_error_fixed : g_last_error.c_str();
}

// ---------------------------------------------------------------------------------------------
// host backend: a physical handle is a memfd named "oxygen_page" of `size` bytes; map() mmaps it
// MAP_FIXED|MAP_SHARED over part of a PROT_NONE reservation, unmap() puts PROT_NONE back (never
// leaves a hole another mmap could take).
//
// The reservation itself is a PROT_NONE mapping of an empty memfd named "oxygen_va" (one per
// reservation, at file offset = address, so neighbouring unmapped pages merge back into one
// mapping), not an anonymous one: /proc/self/maps then tells the pool's own mappings from
// anyone else's. glibc's per-thread malloc arenas are anonymous PROT_NONE mappings of 64 MiB
// too, and one placed in a range a pool had just released looked exactly like a leaked
// reservation to the leak check (tools/leakcheck.py).

namespace {

std::atomic<std::uint64_t> g_host_events{0};
std::atomic<bool> g_host_hold{false};
// Test knob: an event completes `g_host_lag_ns` after it was recorded, like a GPU running behind
// the CPU (host memory itself is written synchronously). 0: complete once recorded.
std::atomic<std::uint64_t> g_host_lag_ns{0};
// Test knob: creating a physical page takes up to about this long, like a driver call under load.
std::atomic<std::uint64_t> g_host_create_delay_ns{0};
// Test knob: unmapping a page takes this long, as a driver unmap does on a GPU (20-50 us).
std::atomic<std::uint64_t> g_host_unmap_delay_ns{0};
std::mutex g_host_event_mu;
std::map<std::uint64_t, std::uint64_t> g_host_recorded_at;  // event -> steady clock ns
std::mutex g_host_capture_mu;
std::map<void*, std::uint64_t> g_host_capture;

class HostBackend final : public Backend {
 public:
  explicit HostBackend(std::size_t page) : page_(page) {}
  const char* name() const override { return "host"; }
  std::size_t granularity() const override { return page_; }

  Status reserve(std::size_t size, std::uintptr_t* va) override {
    if (size == 0 || size % page_ || size > kMaxReserve)
      return invalid("reserve: size " + std::to_string(size) +
                     " is not a multiple of the page or larger than any address space");
    // Aligned to the page, as cuMemAddressReserve's are to the granularity: placement aligns
    // addresses (slab pages) and counts pages from the base. Over-reserve, trim both ends.
    void* p = mmap(nullptr, size + page_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return os_error(("reserving " + std::to_string(size) +
                                          " bytes of address space: mmap(PROT_NONE)").c_str());
    auto raw = reinterpret_cast<std::uintptr_t>(p);
    std::uintptr_t aligned = (raw + page_ - 1) / page_ * page_;
    if (aligned > raw) munmap(p, aligned - raw);
    std::size_t tail = raw + size + page_ - (aligned + size);
    if (tail) munmap(reinterpret_cast<void*>(aligned + size), tail);
    int fd = memfd_create("oxygen_va", MFD_CLOEXEC);
    Status s = fd < 0 ? os_error("memfd_create(oxygen_va)") : OK;
    if (s == OK && mmap(reinterpret_cast<void*>(aligned), size, PROT_NONE,
                        MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, fd, static_cast<off_t>(aligned)) ==
                       MAP_FAILED)
      s = os_error("mmap(oxygen_va reservation)");
    if (s == OK) {
      std::lock_guard<std::mutex> g(res_mu_);
      res_[aligned] = {fd, size};
      *va = aligned;
      return OK;
    }
    if (fd >= 0) close(fd);
    munmap(reinterpret_cast<void*>(aligned), size);
    return s;
  }
  Status free_va(std::uintptr_t va, std::size_t size) override {
    int fd = -1;
    {
      std::lock_guard<std::mutex> g(res_mu_);
      auto it = res_.find(va);
      if (it == res_.end() || it->second.size != size)
        return invalid("free_va: not a reservation of this backend");
      fd = it->second.fd;
      res_.erase(it);
    }
    close(fd);
    std::lock_guard<std::mutex> g(host_maps::lock());
    if (munmap(reinterpret_cast<void*>(va), size) != 0) return os_error("munmap(reservation)");
    host_maps::forget(va, size);  // pages still mapped in it went with it
    return OK;
  }
  Status create(std::size_t size, PhysHandle* handle) override {
    if (size == 0 || size % page_) return invalid("create: size is not a multiple of the page");
    if (std::uint64_t d = g_host_create_delay_ns.load(std::memory_order_acquire)) {
      // A pseudo-random share of d (a multiplicative hash of a counter), so that creations on
      // two threads finish in either order.
      static std::atomic<std::uint64_t> n{0};
      std::uint64_t h = (n.fetch_add(1) + 1) * 0x9E3779B97F4A7C15ull;
      std::this_thread::sleep_for(std::chrono::nanoseconds(d / 8 + (h >> 40) % d));
    }
    int fd = memfd_create("oxygen_page", MFD_CLOEXEC);
    if (fd < 0) return os_error("memfd_create");
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      Status s = os_error("ftruncate(memfd)");
      close(fd);
      return s;
    }
    *handle = static_cast<PhysHandle>(fd);
    return OK;
  }
  Status release(PhysHandle handle) override {
    if (close(static_cast<int>(handle)) != 0) return os_error("close(memfd)");
    return OK;
  }
  // Page mappings change under host_maps::lock() and are recorded there: a forked child makes
  // them private (host_maps.h).
  Status map(std::uintptr_t va, std::size_t size, PhysHandle handle) override {
    std::lock_guard<std::mutex> g(host_maps::lock());
    host_maps::add(va, size, static_cast<int>(handle));
    // Mapped PROT_NONE until set_access, as the driver does.
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
    if (p == MAP_FAILED) {
      Status s = os_error("mmap(MAP_FIXED page)");
      host_maps::forget(va, size);
      return s;
    }
    return OK;
  }
  Status set_access(std::uintptr_t va, std::size_t size) override {
    std::lock_guard<std::mutex> g(host_maps::lock());
    if (mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE) != 0)
      return os_error("mprotect(read/write)");
    host_maps::set_access(va, size);
    return OK;
  }
  Status unmap(std::uintptr_t va, std::size_t size) override {
    int fd = reservation_fd(va, size);
    if (fd < 0) return invalid("unmap: range is not inside a reservation of this backend");
    if (std::uint64_t d = g_host_unmap_delay_ns.load(std::memory_order_acquire))
      std::this_thread::sleep_for(std::chrono::nanoseconds(d));
    std::lock_guard<std::mutex> g(host_maps::lock());
    void* p = mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_FIXED | MAP_NORESERVE, fd, static_cast<off_t>(va));
    if (p == MAP_FAILED) return os_error("mmap(PROT_NONE over unmapped page)");
    host_maps::forget(va, size);
    return OK;
  }
  Status mem_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    std::ifstream f("/proc/meminfo");
    std::string key;
    std::size_t kb = 0;
    std::string unit;
    *free_bytes = *total_bytes = 0;
    while (f >> key >> kb >> unit) {
      if (key == "MemTotal:") *total_bytes = kb * 1024;
      if (key == "MemAvailable:") *free_bytes = kb * 1024;
    }
    if (*total_bytes == 0) {
      set_last_error("/proc/meminfo has no MemTotal");
      return ERR_OS;
    }
    return OK;
  }
  // Host memory is written synchronously, so an event is complete once recorded -- unless a test
  // holds events back to exercise the stream-ordered paths.
  Status event_create(EventHandle* event) override {
    *event = ++g_host_events;
    return OK;
  }
  Status event_destroy(EventHandle event) override {
    std::lock_guard<std::mutex> g(g_host_event_mu);
    g_host_recorded_at.erase(event);
    return OK;
  }
  Status event_record(EventHandle event, void*) override {
    if (g_host_lag_ns.load(std::memory_order_acquire) == 0) return OK;
    std::lock_guard<std::mutex> g(g_host_event_mu);
    g_host_recorded_at[event] = now_ns();
    return OK;
  }
  Status event_query(EventHandle event, bool* done) override {
    *done = !g_host_hold.load(std::memory_order_acquire);
    std::uint64_t lag = g_host_lag_ns.load(std::memory_order_acquire);
    if (*done && lag) {
      std::lock_guard<std::mutex> g(g_host_event_mu);
      auto it = g_host_recorded_at.find(event);
      *done = it == g_host_recorded_at.end() || now_ns() >= it->second + lag;
    }
    return OK;
  }
  Status capture_info(void* stream, bool* capturing, std::uint64_t* id) override {
    std::lock_guard<std::mutex> g(g_host_capture_mu);
    auto it = g_host_capture.find(stream);
    *id = it == g_host_capture.end() ? 0 : it->second;
    *capturing = *id != 0;
    return OK;
  }
  Status synchronize() override {
    if (!g_host_hold.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(g_host_event_mu);
      g_host_recorded_at.clear();  // everything recorded so far has completed
      return OK;
    }
    set_last_error("host backend: events are held (test knob), nothing completes");
    return ERR_UNSUPPORTED;
  }

 private:
  // Far above any machine's address space (x86-64 and arm64 user space is at most 2^56 bytes),
  // low enough that size + page and file offsets cannot overflow.
  static constexpr std::size_t kMaxReserve = std::size_t{1} << 57;
  struct Reservation {
    int fd;
    std::size_t size;
  };
  static Status invalid(const std::string& msg) {
    set_last_error(msg);
    return ERR_INVALID;
  }
  // The oxygen_va memfd of the reservation holding [va, va + size), or -1.
  int reservation_fd(std::uintptr_t va, std::size_t size) {
    std::lock_guard<std::mutex> g(res_mu_);
    auto it = res_.upper_bound(va);
    if (it == res_.begin()) return -1;
    --it;
    bool inside = va - it->first <= it->second.size && size <= it->second.size - (va - it->first);
    return inside ? it->second.fd : -1;
  }
  std::size_t page_;
  std::mutex res_mu_;
  std::map<std::uintptr_t, Reservation> res_;
};

}  // namespace

void host_hold_events(bool hold) { g_host_hold.store(hold, std::memory_order_release); }

void host_set_create_delay(std::uint64_t ns) {
  g_host_create_delay_ns.store(ns, std::memory_order_release);
}

void host_set_unmap_delay(std::uint64_t ns) {
  g_host_unmap_delay_ns.store(ns, std::memory_order_release);
}

void host_set_event_lag(std::uint64_t ns) {
  g_host_lag_ns.store(ns, std::memory_order_release);
  if (ns) return;
  std::lock_guard<std::mutex> g(g_host_event_mu);
  g_host_recorded_at.clear();
}

void host_set_capture(void* stream, std::uint64_t id) {
  std::lock_guard<std::mutex> g(g_host_capture_mu);
  if (id)
    g_host_capture[stream] = id;
  else
    g_host_capture.erase(stream);
}

void host_backend_after_fork_child() {
  // Fresh, empty test-knob state in the child: the parent's threads may have held these locks or
  // been half-way through an update of the maps. Placement new leaks the old contents on purpose.
  new (&g_host_event_mu) std::mutex();
  new (&g_host_recorded_at) std::map<std::uint64_t, std::uint64_t>();
  new (&g_host_capture_mu) std::mutex();
  new (&g_host_capture) std::map<void*, std::uint64_t>();
}

std::unique_ptr<Backend> make_host_backend(std::size_t page_size, Status* status) {
  // The same rule as pool.page_size (config.py): a multiple of the 2 MiB device granularity, at
  // most 1 GiB. A host pool stands in for the device one in CI and is the CPU tier; a page size
  // the device would refuse must not work here (it is also a multiple of any OS page size).
  constexpr std::size_t kGranularity = std::size_t{2} << 20, kMaxPage = std::size_t{1} << 30;
  if (page_size == 0 || page_size % kGranularity || page_size > kMaxPage) {
    set_last_error("host backend: page size " + std::to_string(page_size) +
                   " is not allowed; allowed: a multiple of 2 MiB up to 1 GiB (as pool.page_size)");
    *status = ERR_INVALID;
    return nullptr;
  }
  *status = OK;
  return std::make_unique<HostBackend>(page_size);
}

// ---------------------------------------------------------------------------------------------
// cuda backend: the driver is opened with dlopen and every entry point resolved through
// cuGetProcAddress, asking for the ABI of the header we were compiled against (CUDA_VERSION),
// so the same build runs on CUDA 12 and 13 drivers.

namespace {

struct Driver {
  void* lib = nullptr;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  // The CUDA 13 driver hands out cuCtxSynchronize_v2, which takes the context to synchronize
  // (called without it, it reported CONTEXT_IS_DESTROYED on the H200). Passing the context is
  // right for both forms: the v1 form ignores the extra argument register.
  CUresult (*cuCtxSynchronize)(CUcontext) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  // cuGetProcAddress hands out cuStreamGetCaptureInfo_v3 for CUDA_VERSION >= 12.3 (status, id,
  // graph, dependencies, edge data, count: 7 arguments); the _v2 fallback takes 6. Declaring the
  // 7-argument form and passing null for every output past the id is right for both on x86-64
  // (the caller owns the argument registers); calling v3 through a 6-argument type left its
  // count pointer as register garbage and crashed on the H200.
  CUresult (*cuStreamGetCaptureInfo)(CUstream, CUstreamCaptureStatus*, cuuint64_t*, CUgraph*,
                                     const CUgraphNode**, const void**, size_t*) = nullptr;
  bool ok = false;
};

template <typename F>
bool resolve(void* lib, const char* sym, F* out) {
  using GetProc = CUresult (*)(const char*, void**, int, cuuint64_t,
                               CUdriverProcAddressQueryResult*);
  static GetProc get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
  void* fn = nullptr;
  if (get_proc) {
    CUdriverProcAddressQueryResult q;
    if (get_proc(sym, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q) != CUDA_SUCCESS)
      fn = nullptr;
  }
  // Fallback without cuGetProcAddress: the bare symbol is the oldest ABI, which differs for a few
  // entry points (cuStreamGetCaptureInfo, cuEventDestroy, cuMemGetInfo): ask for the _v2 names.
  if (!fn) {
    std::string v2 = std::string(sym) + "_v2";
    fn = dlsym(lib, v2.c_str());
    if (!fn) fn = dlsym(lib, sym);
  }
  *out = reinterpret_cast<F>(fn);
  return fn != nullptr;
}

Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    d.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!d.lib) return;
    bool ok = resolve(d.lib, "cuInit", &d.cuInit) &&
              resolve(d.lib, "cuDriverGetVersion", &d.cuDriverGetVersion) &&
              resolve(d.lib, "cuDeviceGetCount", &d.cuDeviceGetCount) &&
              resolve(d.lib, "cuDeviceGet", &d.cuDeviceGet) &&
              resolve(d.lib, "cuDeviceGetName", &d.cuDeviceGetName) &&
              resolve(d.lib, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute) &&
              resolve(d.lib, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain) &&
              resolve(d.lib, "cuDevicePrimaryCtxRelease", &d.cuDevicePrimaryCtxRelease) &&
              resolve(d.lib, "cuCtxPushCurrent", &d.cuCtxPushCurrent) &&
              resolve(d.lib, "cuCtxPopCurrent", &d.cuCtxPopCurrent) &&
              resolve(d.lib, "cuMemGetInfo", &d.cuMemGetInfo) &&
              resolve(d.lib, "cuMemGetAllocationGranularity", &d.cuMemGetAllocationGranularity) &&
              resolve(d.lib, "cuMemAddressReserve", &d.cuMemAddressReserve) &&
              resolve(d.lib, "cuMemAddressFree", &d.cuMemAddressFree) &&
              resolve(d.lib, "cuMemCreate", &d.cuMemCreate) &&
              resolve(d.lib, "cuMemRelease", &d.cuMemRelease) &&
              resolve(d.lib, "cuMemMap", &d.cuMemMap) &&
              resolve(d.lib, "cuMemSetAccess", &d.cuMemSetAccess) &&
              resolve(d.lib, "cuMemUnmap", &d.cuMemUnmap) &&
              resolve(d.lib, "cuGetErrorName", &d.cuGetErrorName) &&
              resolve(d.lib, "cuCtxGetCurrent", &d.cuCtxGetCurrent) &&
              resolve(d.lib, "cuCtxSynchronize", &d.cuCtxSynchronize) &&
              resolve(d.lib, "cuEventCreate", &d.cuEventCreate) &&
              resolve(d.lib, "cuEventDestroy", &d.cuEventDestroy) &&
              resolve(d.lib, "cuEventRecord", &d.cuEventRecord) &&
              resolve(d.lib, "cuEventQuery", &d.cuEventQuery) &&
              resolve(d.lib, "cuStreamGetCaptureInfo", &d.cuStreamGetCaptureInfo);
    d.ok = ok && d.cuInit(0) == CUDA_SUCCESS;
  });
  return d;
}

Status driver_error(const char* call, CUresult r) {
  const char* nm = "?";
  if (driver().cuGetErrorName) driver().cuGetErrorName(r, &nm);
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s failed: %s (%d)", call, nm, static_cast<int>(r));
  set_last_error(buf);
  return r == CUDA_ERROR_OUT_OF_MEMORY ? ERR_OOM : ERR_DRIVER;
}

#define OXY_CU(call)                                   \
  do {                                                 \
    CUresult r_ = (call);                              \
    if (r_ != CUDA_SUCCESS) return driver_error(#call, r_); \
  } while (0)

Status open_driver() {
  Driver& d = driver();
  if (!d.lib) {
    set_last_error(std::string("dlopen(libcuda.so.1) failed: ") +
                   "no NVIDIA driver on this machine (CPU paths only)");
    return ERR_NO_DRIVER;
  }
  if (!d.ok) {
    set_last_error("libcuda.so.1 opened, but resolving entry points or cuInit(0) failed");
    return ERR_DRIVER;
  }
  return OK;
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp p;
  std::memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}

// Makes the device's primary context current for the life of the guard (driver calls need one;
// PyTorch uses the same primary context, so nothing new is created).
class CtxGuard {
 public:
  // The allocator's hot path runs on PyTorch's threads, which already have the primary context
  // current: skip the push/pop there.
  explicit CtxGuard(CUcontext ctx) {
    CUcontext cur = nullptr;
    if (driver().cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx)
      ok_ = false;
    else
      ok_ = driver().cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~CtxGuard() {
    CUcontext c;
    if (ok_) driver().cuCtxPopCurrent(&c);
  }

 private:
  bool ok_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, CUdevice dev, CUcontext ctx, std::size_t gran)
      : device_(device), dev_(dev), ctx_(ctx), gran_(gran) {}
  ~CudaBackend() override { driver().cuDevicePrimaryCtxRelease(dev_); }
  const char* name() const override { return "cuda"; }
  std::size_t granularity() const override { return gran_; }

  Status reserve(std::size_t size, std::uintptr_t* va) override {
    CtxGuard g(ctx_);
    CUdeviceptr p = 0;
    OXY_CU(driver().cuMemAddressReserve(&p, size, gran_, 0, 0));
    *va = static_cast<std::uintptr_t>(p);
    return OK;
  }
  Status free_va(std::uintptr_t va, std::size_t size) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuMemAddressFree(static_cast<CUdeviceptr>(va), size));
    return OK;
  }
  Status create(std::size_t size, PhysHandle* handle) override {
    CtxGuard g(ctx_);
    CUmemAllocationProp prop = device_prop(device_);
    CUmemGenericAllocationHandle h = 0;
    OXY_CU(driver().cuMemCreate(&h, size, &prop, 0));
    *handle = static_cast<PhysHandle>(h);
    return OK;
  }
  Status release(PhysHandle handle) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)));
    return OK;
  }
  Status map(std::uintptr_t va, std::size_t size, PhysHandle handle) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuMemMap(static_cast<CUdeviceptr>(va), size, 0,
                             static_cast<CUmemGenericAllocationHandle>(handle), 0));
    return OK;
  }
  Status set_access(std::uintptr_t va, std::size_t size) override {
    CtxGuard g(ctx_);
    CUmemAccessDesc a;
    std::memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = device_;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    OXY_CU(driver().cuMemSetAccess(static_cast<CUdeviceptr>(va), size, &a, 1));
    return OK;
  }
  Status unmap(std::uintptr_t va, std::size_t size) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuMemUnmap(static_cast<CUdeviceptr>(va), size));
    return OK;
  }
  Status mem_info(std::size_t* free_bytes, std::size_t* total_bytes) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuMemGetInfo(free_bytes, total_bytes));
    return OK;
  }
  Status event_create(EventHandle* event) override {
    CtxGuard g(ctx_);
    CUevent e = nullptr;
    OXY_CU(driver().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    *event = reinterpret_cast<EventHandle>(e);
    return OK;
  }
  Status event_destroy(EventHandle event) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuEventDestroy(reinterpret_cast<CUevent>(event)));
    return OK;
  }
  Status event_record(EventHandle event, void* stream) override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuEventRecord(reinterpret_cast<CUevent>(event),
                                  static_cast<CUstream>(stream)));
    return OK;
  }
  Status event_query(EventHandle event, bool* done) override {
    CtxGuard g(ctx_);
    CUresult r = driver().cuEventQuery(reinterpret_cast<CUevent>(event));
    *done = r == CUDA_SUCCESS;
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_NOT_READY) return OK;
    return driver_error("cuEventQuery", r);
  }
  Status capture_info(void* stream, bool* capturing, std::uint64_t* id) override {
    CtxGuard g(ctx_);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    cuuint64_t seq = 0;
    OXY_CU(driver().cuStreamGetCaptureInfo(static_cast<CUstream>(stream), &st, &seq, nullptr,
                                           nullptr, nullptr, nullptr));
    *capturing = st != CU_STREAM_CAPTURE_STATUS_NONE;
    *id = *capturing ? static_cast<std::uint64_t>(seq) : 0;
    return OK;
  }
  Status synchronize() override {
    CtxGuard g(ctx_);
    OXY_CU(driver().cuCtxSynchronize(ctx_));
    return OK;
  }

 private:
  int device_;
  CUdevice dev_;
  CUcontext ctx_;
  std::size_t gran_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, Status* status) {
  if ((*status = open_driver()) != OK) return nullptr;
  Driver& d = driver();
  int count = 0;
  CUresult r = d.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) {
    *status = driver_error("cuDeviceGetCount", r);
    return nullptr;
  }
  if (device < 0 || device >= count) {
    set_last_error("cuda backend: device " + std::to_string(device) + " does not exist (" +
                   std::to_string(count) + " visible)");
    *status = ERR_NO_DEVICE;
    return nullptr;
  }
  CUdevice dev;
  int vmm = 0;
  std::size_t gran = 0;
  CUcontext ctx = nullptr;
  CUmemAllocationProp prop = device_prop(device);
  if ((r = d.cuDeviceGet(&dev, device)) != CUDA_SUCCESS ||
      (r = d.cuDeviceGetAttribute(
           &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)) != CUDA_SUCCESS ||
      (r = d.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) !=
          CUDA_SUCCESS ||
      (r = d.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS) {
    *status = driver_error("cuda backend setup", r);
    return nullptr;
  }
  if (!vmm) {
    d.cuDevicePrimaryCtxRelease(dev);
    set_last_error("device " + std::to_string(device) + " does not support virtual memory management");
    *status = ERR_UNSUPPORTED;
    return nullptr;
  }
  *status = OK;
  return std::make_unique<CudaBackend>(device, dev, ctx, gran);
}

Status cuda_driver_probe(int* driver_version, int* device_count) {
  Status s = open_driver();
  if (s != OK) return s;
  OXY_CU(driver().cuDriverGetVersion(driver_version));
  OXY_CU(driver().cuDeviceGetCount(device_count));
  return OK;
}

Status cuda_device_info(int device, char* name, std::size_t name_len, std::size_t* granularity,
                        std::size_t* free_bytes, std::size_t* total_bytes, int* vmm_supported) {
  Status s;
  auto be = make_cuda_backend(device, &s);
  if (!be) {
    if (s != ERR_UNSUPPORTED) return s;
  }
  Driver& d = driver();
  CUdevice dev;
  OXY_CU(d.cuDeviceGet(&dev, device));
  OXY_CU(d.cuDeviceGetName(name, static_cast<int>(name_len), dev));
  OXY_CU(d.cuDeviceGetAttribute(vmm_supported,
                                CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  CUmemAllocationProp prop = device_prop(device);
  OXY_CU(d.cuMemGetAllocationGranularity(granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  *free_bytes = *total_bytes = 0;
  if (be) return be->mem_info(free_bytes, total_bytes);
  return OK;
}

}  // namespace oxygen
