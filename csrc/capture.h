// What the allocator knows about CUDA-graph captures in the process.
//
// H200 fact: during a global-mode capture (torch.cuda.graph's default), cuEventQuery and cuMemAlloc
// from ANY thread return 900 and invalidate the capture, while the VMM calls (create, map,
// set-access, unmap) succeed. So event queries and records go through a QueryGuard, which refuses
// while a capture may be in progress. Two sources say so:
//   - announced captures: the Python layer wraps torch.cuda.CUDAGraph.capture_begin/capture_end
//     (enable() does this), which also gives each capture a token so its memory can be handed
//     back when the graph is released;
//   - detected captures: malloc/free ask cuStreamGetCaptureInfo about their own stream (a call that
//     is safe during capture) and count the captures they see until they see them end.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>

namespace oxygen {
namespace capture {

// Called (through the C ABI) just before capture_begin; returns a token, also remembered as the
// calling thread's current token so allocations seen capturing on this thread are tied to it.
std::uint64_t announce_begin();
// Called after capture_end returned (or capture_begin failed).
void announce_end(std::uint64_t token);
// The calling thread's current announced token, 0 when none.
std::uint64_t thread_token();

// The graph of `token` is gone (reset or collected): allocators may reuse its memory.
void release(std::uint64_t token);
// Allocators listen for two things: just before a capture is announced (a last chance to poll
// events, so the capture can use everything already complete) and a released token.
void add_listener(void* key, std::function<void()> on_begin,
                  std::function<void(std::uint64_t)> on_release);
void remove_listener(void* key);

// Allocators add +1 when they first see a capture and -1 when they see it end.
void note_detected(int delta);
// True while any announced or detected capture may be in progress.
bool maybe_active();

// Holds the query lock: announce_begin waits for it, so once allowed() is true no capture can be
// announced until the guard is gone.
class QueryGuard {
 public:
  QueryGuard();
  bool allowed() const { return allowed_; }

 private:
  std::unique_lock<std::mutex> lock_;
  bool allowed_;
};

}  // namespace capture
}  // namespace oxygen
