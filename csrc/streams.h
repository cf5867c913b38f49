// Stream-ordered reuse with tickets.
//
// Every free on stream S takes a ticket (S, n). Memory freed with ticket (S, n) may be reused at
// once by S (stream order protects it), and by anyone -- another stream, or an unmap -- once an
// event recorded on S after that free has completed: then safe(S) >= n. Events are recorded
// sparingly (at most two in flight per stream) and queried only through capture::QueryGuard.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "vmm_backend.h"

namespace oxygen {

struct StreamState {
  void* stream = nullptr;
  std::uint64_t issued = 0;    // last ticket handed to a free on this stream
  std::uint64_t recorded = 0;  // last ticket covered by a recorded event
  std::uint64_t safe = 0;      // every free with a ticket <= safe has completed on the device
  struct Pending {
    EventHandle event;
    std::uint64_t ticket;
  };
  std::deque<Pending> inflight;
};

// Who last freed a byte range. stream == nullptr: safe for everyone.
struct Tag {
  StreamState* stream = nullptr;
  std::uint64_t ticket = 0;
};

inline bool is_safe(const Tag& t) { return !t.stream || t.ticket <= t.stream->safe; }

// The tag usable by `user` (a stream about to allocate): its own frees, or anything safe.
inline bool usable_by(const Tag& t, const StreamState* user) {
  return t.stream == user || is_safe(t);
}

// Tag of two adjacent free ranges joined into one, or false when they cannot join. Only frees of
// one stream, or ranges already safe for everyone, join: joining a still-in-flight range with a
// safe one would make the safe part unusable to other streams (and to captures) until the event
// completes. FreeExtents::coalesce() joins what became compatible later.
inline bool merge_tags(const Tag& a, const Tag& b, Tag* out) {
  bool sa = is_safe(a), sb = is_safe(b);
  if (sa && sb) {
    *out = Tag{};
    return true;
  }
  if (a.stream == b.stream) {
    *out = {a.stream, a.ticket > b.ticket ? a.ticket : b.ticket};
    return true;
  }
  return false;
}

// The streams one allocator has seen. Not thread-safe: used under the allocator's lock.
class Streams {
 public:
  explicit Streams(Backend& be) : be_(be) {}
  ~Streams();
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;

  StreamState* get(void* stream);
  std::size_t count() const { return map_.size(); }
  Tag on_free(StreamState* s) { return {s, ++s->issued}; }

  // Record an event on s covering its latest ticket, unless one is pending enough already.
  // Caller holds a QueryGuard that allowed it. Returns true if an event was recorded.
  bool record(StreamState* s);
  // Advance safe tickets from completed events. Caller holds an allowing QueryGuard.
  void poll();
  // After a device-wide synchronize: every ticket handed out so far is complete.
  void all_complete();
  bool any_unsafe() const;

 private:
  Status take_event(EventHandle* e);

  Backend& be_;
  std::unordered_map<void*, std::unique_ptr<StreamState>> map_;
  std::vector<EventHandle> spare_;
};

}  // namespace oxygen
