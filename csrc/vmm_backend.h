// One interface over two ways of backing a reserved virtual range with physical pages:
//   cuda: the driver's VMM API (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess ...),
//         resolved at run time from libcuda.so.1, so nothing links against the driver;
//   host: memfd_create pages mmap'ed with MAP_FIXED into a PROT_NONE reservation, the same
//         reserve / create / map / unmap life cycle on ordinary memory (CI and the CPU tier).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace oxygen {

// Error codes crossing the C ABI. Python turns them into messages (oxygen_torch/_native.py).
enum Status : int {
  OK = 0,
  ERR_NO_DRIVER = 1,      // libcuda.so.1 could not be opened
  ERR_DRIVER = 2,         // a driver call failed; last_error() has the call and its code
  ERR_NO_DEVICE = 3,      // driver present, but no such device
  ERR_INVALID = 4,        // bad argument (size, alignment, unknown pointer)
  ERR_OOM = 5,            // no physical memory left
  ERR_OS = 6,             // a host system call failed; last_error() has errno
  ERR_UNSUPPORTED = 7,    // the device or build cannot do this (e.g. no VMM support)
  ERR_FORKED = 8,         // the object was created before fork(): it belongs to the parent
  ERR_INTERNAL = 9,       // a C++ exception reached the C ABI (a bug); last_error() has it
};

// An opaque event (cuda: CUevent; host: a sequence number that completes at once unless a test
// holds events back).
using EventHandle = std::uint64_t;

// Thread-local text of the last error, for the C ABI's oxygen_last_error(). Never throws: it runs
// inside the C ABI's exception handlers (when the text cannot be stored, a fixed one is kept).
void set_last_error(const std::string& msg) noexcept;
void set_last_error(const char* msg) noexcept;
const char* last_error() noexcept;

// An opaque physical allocation of one or more pages.
using PhysHandle = std::uint64_t;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Smallest unit of reserve/create/map, in bytes (2 MiB on H100/H200; on the host backend the
  // page size it was made with, a multiple of 2 MiB like the device's).
  virtual std::size_t granularity() const = 0;
  virtual Status reserve(std::size_t size, std::uintptr_t* va) = 0;
  virtual Status free_va(std::uintptr_t va, std::size_t size) = 0;
  virtual Status create(std::size_t size, PhysHandle* handle) = 0;
  virtual Status release(PhysHandle handle) = 0;
  virtual Status map(std::uintptr_t va, std::size_t size, PhysHandle handle) = 0;
  virtual Status set_access(std::uintptr_t va, std::size_t size) = 0;
  virtual Status unmap(std::uintptr_t va, std::size_t size) = 0;
  // Free and total physical memory of the device (host: MemAvailable / MemTotal).
  virtual Status mem_info(std::size_t* free_bytes, std::size_t* total_bytes) = 0;

  // Stream-ordered reuse. Events are created without timing; query sets *done (true when the work
  // before the record has completed). Never query or record while a stream capture may be in
  // progress (H200: cuEventQuery returns 900 and invalidates the capture): see capture.h.
  virtual Status event_create(EventHandle* event) = 0;
  virtual Status event_destroy(EventHandle event) = 0;
  virtual Status event_record(EventHandle event, void* stream) = 0;
  virtual Status event_query(EventHandle event, bool* done) = 0;
  // Whether `stream` is capturing (an invalidated but unterminated capture counts as capturing) and
  // the capture sequence id. Safe to call during capture.
  virtual Status capture_info(void* stream, bool* capturing, std::uint64_t* id) = 0;
  // Waits for all work on the device (used only when a CUDA graph's memory is handed back).
  virtual Status synchronize() = 0;
};

// Test knobs of the host backend: hold events pending (so stream-ordered reuse can be tested on a
// CPU) and mark a fake stream as capturing with a given id (0 = not capturing).
void host_hold_events(bool hold);
// Test knob: host events complete `ns` after they are recorded, like a GPU running behind (0: at
// once).
void host_set_event_lag(std::uint64_t ns);
// Test knob: every host page creation first sleeps a pseudo-random time up to about ns (0: off).
void host_set_create_delay(std::uint64_t ns);
// Test knob: every host page unmap first sleeps ns (0: off).
void host_set_unmap_delay(std::uint64_t ns);
void host_set_capture(void* stream, std::uint64_t id);

// Factories. On failure they return nullptr and set *status and last_error().
std::unique_ptr<Backend> make_host_backend(std::size_t page_size, Status* status);
std::unique_ptr<Backend> make_cuda_backend(int device, Status* status);

// Driver facts for `doctor`, without creating a backend. Returns OK, ERR_NO_DRIVER or ERR_DRIVER.
Status cuda_driver_probe(int* driver_version, int* device_count);
Status cuda_device_info(int device, char* name, std::size_t name_len, std::size_t* granularity,
                        std::size_t* free_bytes, std::size_t* total_bytes, int* vmm_supported);

}  // namespace oxygen
