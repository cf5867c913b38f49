// The C ABI's safety net. ctypes and PyTorch call the extern "C" functions; a C++ exception that
// unwinds out of one aborts the interpreter (std::bad_alloc from a pool of capacity 2^62 did).
// Every entry point runs its body through guarded(), which turns any exception into a status and
// a last_error() text, and checks its object handle first: not null, and not inherited from the
// parent of a fork (fork.h).
#pragma once

#include <exception>
#include <new>
#include <string>

#include "vmm_backend.h"

namespace oxygen {

// Runs body() -> Status; an exception becomes ERR_OOM (std::bad_alloc) or ERR_INTERNAL.
template <typename F>
int guarded(const char* where, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    set_last_error(std::string(where) + ": out of host memory (std::bad_alloc)");
    return ERR_OOM;
  } catch (const std::exception& e) {
    set_last_error(std::string(where) + ": internal error: " + e.what());
    return ERR_INTERNAL;
  } catch (...) {
    set_last_error(std::string(where) + ": internal error (unknown exception)");
    return ERR_INTERNAL;
  }
}

// For entry points that return a value rather than a status: `fallback` when body() throws.
template <typename T, typename F>
T guarded_value(const char* where, T fallback, F&& body) noexcept {
  T out = fallback;
  guarded(where, [&] {
    out = body();
    return OK;
  });
  return out;
}

inline Status invalid_handle(const char* where, const char* what) {
  set_last_error(std::string(where) + ": null " + what + " handle");
  return ERR_INVALID;
}

inline Status forked_handle(const char* where, const char* what) {
  set_last_error(std::string(where) + ": this " + what +
                 " was created before fork() and belongs to the parent process; a forked child "
                 "cannot use it (its locks may be held by threads the child does not have, its "
                 "pages are shared with the parent, and CUDA does not survive fork). Create a new "
                 "one in the child, or start workers with the 'spawn' method");
  return ERR_FORKED;
}

// Runs body(T*) on the object behind a C handle once it is known usable: not null, and not
// inherited across fork (inherited(const T&) says so). Guarded like any entry point.
template <typename T, typename Inherited, typename F>
int on_handle(void* handle, const char* where, const char* what, Inherited inherited,
              F&& body) noexcept {
  return guarded(where, [&]() -> int {
    auto* obj = static_cast<T*>(handle);
    if (!obj) return invalid_handle(where, what);
    if (inherited(*obj)) return forked_handle(where, what);
    return body(obj);
  });
}

}  // namespace oxygen
