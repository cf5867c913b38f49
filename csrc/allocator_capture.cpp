// See allocator.h. CUDA-graph capture arenas.
//
// Blocks handed out while the allocating stream captures belong to that capture: freed inside it
// on the same stream they serve later allocations of the same capture (the graph replays in
// capture order); freed after it they are quarantined, because the graph may replay and write them.
// The quarantine ends when Python says the graph is gone (token released: CUDAGraph.reset or the
// graph object collected), after one device synchronize so no replay is still running.
//
// Unannounced captures (token 0: the MemPool route, where PyTorch's caching allocator sits in
// front of us and keeps its own graph pools, or a capture begun outside torch.cuda.CUDAGraph)
// are treated as released when they end: their owner is responsible for graph lifetime, as with
// cudaMalloc'ed memory.
#include <algorithm>

#include "allocator.h"
#include "capture.h"

namespace oxygen {

CaptureState* Allocator::capture_for(std::uint64_t id, void* stream) {
  auto& c = captures_[id];
  if (!c) {
    c = std::make_unique<CaptureState>();
    c->id = id;
    c->stream = stream;
    c->token = capture::thread_token();
    active_captures_.push_back(c.get());
    capture::note_detected(+1);
  }
  return c.get();
}

void Allocator::refresh_captures() {
  // cuStreamGetCaptureInfo is safe during capture; copy the list, end_capture edits it.
  std::vector<CaptureState*> active = active_captures_;
  for (CaptureState* c : active) {
    bool capturing = false;
    std::uint64_t id = 0;
    Status s = ctx().backend().capture_info(c->stream, &capturing, &id);
    if (s != OK || !capturing || id != c->id) end_capture(c);
  }
}

void Allocator::end_capture(CaptureState* c) {
  c->active = false;
  capture::note_detected(-1);
  active_captures_.erase(std::find(active_captures_.begin(), active_captures_.end(), c));
  for (auto& kv : c->reusable) {
    c->quarantine.emplace_back(kv.second, kv.first);
    c->quarantined += kv.first;
    bump(stats_.quarantined_bytes, kv.first);
  }
  c->reusable.clear();
  if (c->token == 0 && !c->release_queued) {
    c->release_queued = true;
    pending_release_.push_back(c);
  }
}

void Allocator::free_capture_block(const Block& b, StreamState* fs) {
  CaptureState* c = captures_[b.capture].get();
  if (c->released) {  // its graph is gone: an ordinary free
    if (b.slab) return slab_put(b.slab, b.slot, streams_.on_free(fs));
    return large_free(b, fs);
  }
  bool same_stream = fs->stream == c->stream;
  if (b.slab) {
    if (!c->active || same_stream) {
      // Inside the capture: reusable by it. After it: the heap never allocates again, so the slot
      // simply waits in its page for the release.
      slab_put(b.slab, b.slot, streams_.on_free(fs));
      if (!c->active) {
        c->quarantined += b.span;
        bump(stats_.quarantined_bytes, b.span);
      }
    }
    // Freed on another stream of the same capture: not reused by it (the graph orders the two
    // streams only where the capture joined them); the slot returns with the heap's release.
    return;
  }
  if (c->active && same_stream) {
    c->reusable.emplace(b.span, b.addr);
    return;
  }
  c->quarantine.emplace_back(b.addr, b.span);
  c->quarantined += b.span;
  bump(stats_.quarantined_bytes, b.span);
}

void Allocator::release_capture(std::uint64_t token) {
  std::lock_guard<std::mutex> g(mu_);
  if (!active_captures_.empty()) refresh_captures();
  for (auto& kv : captures_) {
    CaptureState* c = kv.second.get();
    if (c->token != token || c->active || c->released || c->release_queued) continue;
    c->release_queued = true;
    pending_release_.push_back(c);
  }
  poll_events(false);
}

void Allocator::process_pending_releases() {
  // Caller holds an allowing QueryGuard.
  if (pending_release_.empty()) return;
  bool work = false;
  for (CaptureState* c : pending_release_) work = work || !c->quarantine.empty() || !c->heaps.empty();
  // Replays of a released graph may still run: wait once for the device before reusing anything.
  if (work) {
    if (ctx().backend().synchronize() != OK) return;
    streams_.all_complete();
  }
  std::vector<CaptureState*> todo;
  todo.swap(pending_release_);
  for (CaptureState* c : todo) finish_release(c);
}

void Allocator::finish_release(CaptureState* c) {
  for (auto& q : c->quarantine) {
    std::size_t p0 = (q.first - base()) / page_, p1 = (q.first + q.second - 1 - base()) / page_;
    unref_pages(p0, p1);
    extents_.insert(q.first, q.second, Tag{});
  }
  c->quarantine.clear();
  drop(stats_.quarantined_bytes, c->quarantined);
  c->quarantined = 0;
  for (Heap* h : c->heaps) {
    h->released = true;
    for (int cls = 0; cls < kNumClasses; ++cls) {
      std::vector<SlabPage*> pages = h->partial[cls];
      for (SlabPage* sp : pages) {
        if (!sp->empty()) continue;
        h->remove_partial(sp);
        release_slab_page(sp, Tag{});  // after the device synchronize
      }
    }
  }
  c->released = true;
}

}  // namespace oxygen
