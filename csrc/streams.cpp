// See streams.h.
#include "streams.h"

#include "capture.h"

namespace oxygen {

Streams::~Streams() {
  // Events are destroyed only when no capture can be disturbed; otherwise they are leaked (a few
  // bytes of driver state) rather than risk invalidating someone's graph.
  for (auto& kv : map_)
    for (auto& p : kv.second->inflight) spare_.push_back(p.event);
  if (capture::maybe_active()) return;
  for (EventHandle e : spare_) be_.event_destroy(e);
}

StreamState* Streams::get(void* stream) {
  auto it = map_.find(stream);
  if (it != map_.end()) return it->second.get();
  auto st = std::make_unique<StreamState>();
  st->stream = stream;
  StreamState* raw = st.get();
  map_.emplace(stream, std::move(st));
  return raw;
}

Status Streams::take_event(EventHandle* e) {
  if (!spare_.empty()) {
    *e = spare_.back();
    spare_.pop_back();
    return OK;
  }
  return be_.event_create(e);
}

bool Streams::record(StreamState* s) {
  if (s->issued <= s->recorded || s->inflight.size() >= 2) return false;
  EventHandle e = 0;
  if (take_event(&e) != OK) return false;
  if (be_.event_record(e, s->stream) != OK) {
    spare_.push_back(e);
    return false;
  }
  s->recorded = s->issued;
  s->inflight.push_back({e, s->issued});
  return true;
}

void Streams::poll() {
  for (auto& kv : map_) {
    StreamState* s = kv.second.get();
    // Pop what completed, cover the newest frees with an event, and look once more: when the
    // device has caught up (after a synchronize, or on the host) the new event is done at once.
    for (int round = 0; round < 2; ++round) {
      while (!s->inflight.empty()) {
        bool done = false;
        if (be_.event_query(s->inflight.front().event, &done) != OK || !done) break;
        s->safe = s->inflight.front().ticket;
        spare_.push_back(s->inflight.front().event);
        s->inflight.pop_front();
      }
      if (!record(s)) break;
    }
  }
}

void Streams::all_complete() {
  for (auto& kv : map_) {
    StreamState* s = kv.second.get();
    s->safe = s->issued;
    s->recorded = s->issued;
    for (auto& p : s->inflight) spare_.push_back(p.event);
    s->inflight.clear();
  }
}

bool Streams::any_unsafe() const {
  for (auto& kv : map_)
    if (kv.second->safe < kv.second->issued) return true;
  return false;
}

}  // namespace oxygen
