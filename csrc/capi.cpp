// The C ABI of _oxygen.so, called through ctypes (oxygen_torch/_native.py) and, for
// oxygen_malloc / oxygen_free, by PyTorch's CUDAPluggableAllocator.
#include <cstring>
#include <memory>

#include "capi_guard.h"
#include "host_maps.h"
#include "vmm_backend.h"

#define OXY_API extern "C" __attribute__((visibility("default")))

using namespace oxygen;

OXY_API const char* oxygen_version() { return "0.1.0"; }

// Text of the last error on the calling thread ("" when none).
OXY_API const char* oxygen_last_error() { return last_error(); }

OXY_API int oxygen_cuda_probe(int* driver_version, int* device_count) {
  return guarded("cuda_probe", [&]() -> int {
    if (!driver_version || !device_count) return invalid_handle("cuda_probe", "output");
    *driver_version = 0;
    *device_count = 0;
    return cuda_driver_probe(driver_version, device_count);
  });
}

OXY_API int oxygen_cuda_device_info(int device, char* name, size_t name_len, size_t* granularity,
                                    size_t* free_bytes, size_t* total_bytes, int* vmm_supported) {
  return guarded("cuda_device_info", [&]() -> int {
    if (!name || !name_len || !granularity || !free_bytes || !total_bytes || !vmm_supported)
      return invalid_handle("cuda_device_info", "output");
    name[0] = '\0';
    return cuda_device_info(device, name, name_len, granularity, free_bytes, total_bytes,
                            vmm_supported);
  });
}

namespace {

Status selftest(const char* kind, int device, size_t page_size, size_t* granularity_out) {
  Status s;
  std::unique_ptr<Backend> be = std::strcmp(kind, "host") == 0 ? make_host_backend(page_size, &s)
                                                               : make_cuda_backend(device, &s);
  if (!be) return s;
  const size_t page = be->granularity();
  *granularity_out = page;
  std::uintptr_t va = 0;
  PhysHandle h = 0;
  if ((s = be->reserve(2 * page, &va)) != OK) return s;
  if ((s = be->create(page, &h)) != OK) {
    be->free_va(va, 2 * page);
    return s;
  }
  s = be->map(va + page, page, h);
  if (s == OK) s = be->set_access(va + page, page);
  if (s == OK && std::strcmp(kind, "host") == 0) {
    auto* p = reinterpret_cast<unsigned char*>(va + page);
    for (size_t i = 0; i < page; i += 4096) p[i] = static_cast<unsigned char>(i / 4096 * 7 + 1);
    for (size_t i = 0; i < page && s == OK; i += 4096)
      if (p[i] != static_cast<unsigned char>(i / 4096 * 7 + 1)) {
        set_last_error("host backend self-test: page did not read back what was written");
        s = ERR_OS;
      }
  }
  Status u = be->unmap(va + page, page);
  Status r = be->release(h);
  Status f = be->free_va(va, 2 * page);
  if (s == OK) s = u != OK ? u : r != OK ? r : f;
  return s;
}

}  // namespace

// Runs one full reserve / create / map / set_access / write / read / unmap / release / free_va
// cycle on a backend ("host" or "cuda" -- the latter only checks the calls, it cannot touch device
// memory from the host). Used by `doctor` to prove the backend works on this machine.
OXY_API int oxygen_backend_selftest(const char* kind, int device, size_t page_size,
                                    size_t* granularity_out) {
  return guarded("backend_selftest", [&]() -> int {
    if (!kind || !granularity_out) return invalid_handle("backend_selftest", "backend or output");
    return selftest(kind, device, page_size, granularity_out);
  });
}

// How many host page mappings a forked child would make private (host_maps.h); tests check that
// the record follows what the pools map and unmap.
OXY_API size_t oxygen_host_mappings() {
  return guarded_value<size_t>("host_mappings", 0, [] { return host_maps::count(); });
}
