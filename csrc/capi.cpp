// The C ABI of _oxygen.so, called through ctypes (oxygen_torch/_native.py) and, for
// oxygen_malloc / oxygen_free, by PyTorch's CUDAPluggableAllocator.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "capi_guard.h"
#include "host_maps.h"
#include "stats.h"
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

// The backend's calls timed for `total` bytes as handles of `handle` bytes each, mapped side by
// side in one reserved range: out_ns = {create, map, set_access, unmap, release}, each the sum
// over the handles (set_access: one call over the whole range, or one a handle when
// `access_each`). What growth by `total` bytes costs with handles of that size: the map calls
// are what the allocating thread pays (handles are created ahead by the refill thread).
Status map_probe(const char* kind, int device, std::size_t handle, std::size_t total,
                 bool access_each, std::uint64_t* out_ns) {
  Status s;
  std::unique_ptr<Backend> be = std::strcmp(kind, "host") == 0 ? make_host_backend(2u << 20, &s)
                                                               : make_cuda_backend(device, &s);
  if (!be) return s;
  const std::size_t gran = be->granularity();
  if (handle == 0 || handle % gran || total == 0 || total % handle) {
    set_last_error("map probe: the handle size must be a multiple of the backend's granularity (" +
                   std::to_string(gran) + " bytes) and the total a multiple of the handle");
    return ERR_INVALID;
  }
  const std::size_t n = total / handle;
  std::uintptr_t va = 0;
  if ((s = be->reserve(total, &va)) != OK) return s;
  std::vector<PhysHandle> hs;
  hs.reserve(n);
  std::size_t mapped = 0;
  auto timed = [&](int k, auto&& body) {
    std::uint64_t t0 = now_ns();
    if (s == OK) s = body();
    out_ns[k] += now_ns() - t0;
  };
  for (int k = 0; k < 5; ++k) out_ns[k] = 0;
  timed(0, [&]() -> Status {
    for (std::size_t i = 0; i < n; ++i) {
      PhysHandle h = 0;
      if (Status c = be->create(handle, &h); c != OK) return c;
      hs.push_back(h);
    }
    return OK;
  });
  timed(1, [&]() -> Status {
    for (; mapped < hs.size(); ++mapped)
      if (Status c = be->map(va + mapped * handle, handle, hs[mapped]); c != OK) return c;
    return OK;
  });
  timed(2, [&]() -> Status {
    if (!access_each) return be->set_access(va, total);
    for (std::size_t i = 0; i < n; ++i)
      if (Status c = be->set_access(va + i * handle, handle); c != OK) return c;
    return OK;
  });
  std::uint64_t t0 = now_ns();  // (undone whatever happened above)
  for (std::size_t i = 0; i < mapped; ++i) {
    Status u = be->unmap(va + i * handle, handle);
    if (s == OK) s = u;
  }
  out_ns[3] = now_ns() - t0;
  t0 = now_ns();
  for (PhysHandle h : hs) {
    Status r = be->release(h);
    if (s == OK) s = r;
  }
  out_ns[4] = now_ns() - t0;
  Status f = be->free_va(va, total);
  return s == OK ? f : s;
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

// See map_probe above. out_ns: 5 values.
OXY_API int oxygen_backend_map_probe(const char* kind, int device, size_t handle_bytes,
                                     size_t total_bytes, int access_each, uint64_t* out_ns) {
  return guarded("backend_map_probe", [&]() -> int {
    if (!kind || !out_ns) return invalid_handle("backend_map_probe", "backend or output");
    return map_probe(kind, device, handle_bytes, total_bytes, access_each != 0, out_ns);
  });
}

// How many host page mappings a forked child would make private (host_maps.h); tests check that
// the record follows what the pools map and unmap.
OXY_API size_t oxygen_host_mappings() {
  return guarded_value<size_t>("host_mappings", 0, [] { return host_maps::count(); });
}
